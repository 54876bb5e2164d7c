-- verity projection gate: applies a batch of versioned absolute-state writes.
--
-- ARGV[1] is the mode: "live" writes the live keys (and, for a collection
-- whose rebuild marker exists, the shadow keys too); "shadow" writes only
-- the shadow keys. ARGV[2] is the number C of collections in the call.
-- Then five arguments per write:
--   kind ("z" sorted set, "h" hash, "d" document), base (index into KEYS),
--   member (field; "" for documents), version (canonical decimal), value
--   (score as a decimal integer, or bytes)
-- or, for a collection whose live or shadow versions are bucketed, seven:
--   kind ("Z" or "H"), base, version key index, shadow version key index,
--   member, version, value.
-- Then, last, three arguments per collection: base (index into KEYS of its
-- first key), live layout, shadow layout (the version bucket counts the
-- caller built the live and shadow version keys for, as canonical
-- decimals; "0" means one version hash).
-- Keys from base: collections use value, layout, rebuild marker, shadow
-- value, shadow layout, unbucketed version, unbucketed shadow version;
-- documents use value, version. Version (bucket) keys follow, referenced by
-- index from the writes.
--
-- Before anything is written, every collection's stored layout is checked
-- against the caller's (shadow layout too while a rebuild runs, or in
-- shadow mode): a mismatch returns the error "VERITY_LAYOUT <live|shadow>
-- <base> <stored>" and writes nothing, because a version looked up in the
-- wrong bucket would look absent and let a stale write in. A layout key that
-- is absent means 0 when the collection holds anything (written before
-- layouts existed), and is set to the caller's layout when it is empty.
--
-- Returns one element per write: the integer 1 applied, 2 duplicate,
-- 3 stale; or, when the stored version is not a canonical decimal integer,
-- that stored version as a string (nothing written).
--
-- Lua numbers are doubles, which cannot hold every int64, so versions are
-- never converted to numbers: they are compared as decimal strings.

local APPLIED, DUPLICATE, STALE = 1, 2, 3

local function canonical(s)
  return s == '0' or string.match(s, '^%-?[1-9][0-9]*$') ~= nil
end

-- compare returns -1, 0 or 1 for canonical decimal integers a and b:
-- sign first, then length, then digit by digit (bytes, not the locale).
local function compare(a, b)
  local negA, negB = string.byte(a, 1) == 45, string.byte(b, 1) == 45
  if negA ~= negB then
    if negA then return -1 end
    return 1
  end
  local c = 0
  if #a ~= #b then
    if #a < #b then c = -1 else c = 1 end
  else
    for i = 1, #a do
      local x, y = string.byte(a, i), string.byte(b, i)
      if x ~= y then
        if x < y then c = -1 else c = 1 end
        break
      end
    end
  end
  if negA then return -c end
  return c
end

local function gate(kind, valueKey, versionKey, member, version, value)
  local stored
  if kind == 'd' then
    stored = redis.call('GET', versionKey)
  else
    stored = redis.call('HGET', versionKey, member)
  end
  if stored then
    if not canonical(stored) then return stored end
    local c = compare(version, stored)
    if c == 0 then return DUPLICATE end
    if c < 0 then return STALE end
  end
  if kind == 'z' then
    redis.call('ZADD', valueKey, value, member)
    redis.call('HSET', versionKey, member, version)
  elseif kind == 'h' then
    redis.call('HSET', valueKey, member, value)
    redis.call('HSET', versionKey, member, version)
  else
    redis.call('SET', valueKey, value)
    redis.call('SET', versionKey, version)
  end
  return APPLIED
end

-- storedLayout returns the layout recorded for a collection, or nil for
-- an empty collection without one (any layout fits it). want is the
-- caller's layout: when it is "0", an absent layout key fits whatever the
-- collection holds, so the existence check is skipped.
local function storedLayout(layoutKey, valueKey, unbucketedKey, want)
  local s = redis.call('GET', layoutKey)
  if s then return s end
  if want == '0' then return nil end
  if redis.call('EXISTS', valueKey, unbucketedKey) > 0 then return '0' end
  return nil
end

local shadowOnly = ARGV[1] == 'shadow'
local ncoll = tonumber(ARGV[2])
-- rebuilding[base] records whether a collection's rebuild marker exists;
-- the script is atomic, so it cannot appear or vanish during the batch.
local rebuilding = {}
local adopt = {}
local function check(which, base, layoutKey, valueKey, unbucketedKey, want)
  local stored = storedLayout(layoutKey, valueKey, unbucketedKey, want)
  if stored == nil then
    if want ~= '0' then adopt[#adopt + 1] = { layoutKey, want } end
    return nil
  end
  if stored ~= want then
    return redis.error_reply('VERITY_LAYOUT ' .. which .. ' ' .. base .. ' ' .. stored)
  end
  return nil
end
local last = #ARGV - 3 * ncoll -- the last write argument
for a = last + 1, #ARGV, 3 do
  local base, live, shadow = tonumber(ARGV[a]), ARGV[a + 1], ARGV[a + 2]
  local err
  if shadowOnly then
    err = check('shadow', base, KEYS[base + 4], KEYS[base + 3], KEYS[base + 6], shadow)
  else
    err = check('live', base, KEYS[base + 1], KEYS[base], KEYS[base + 5], live)
    if not err then
      rebuilding[base] = redis.call('EXISTS', KEYS[base + 2]) == 1
      if rebuilding[base] then
        err = check('shadow', base, KEYS[base + 4], KEYS[base + 3], KEYS[base + 6], shadow)
      end
    end
  end
  if err then return err end
end
-- Checks passed: record the layout of empty collections this call fills.
for _, p in ipairs(adopt) do
  redis.call('SET', p[1], p[2])
end

local out = {}
local a = 3
while a <= last do
  local kind, base = ARGV[a], tonumber(ARGV[a + 1])
  local vi, svi
  if kind == 'Z' or kind == 'H' then
    kind = string.lower(kind)
    vi, svi = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    a = a + 2
  elseif kind == 'd' then
    vi = base + 1
  else
    vi, svi = base + 5, base + 6
  end
  local member, version, value = ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  a = a + 5
  if shadowOnly then
    out[#out + 1] = gate(kind, KEYS[base + 3], KEYS[svi], member, version, value)
  else
    out[#out + 1] = gate(kind, KEYS[base], KEYS[vi], member, version, value)
    if kind ~= 'd' and rebuilding[base] then
      gate(kind, KEYS[base + 3], KEYS[svi], member, version, value)
    end
  end
end
return out
