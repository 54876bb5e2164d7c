-- verity projection gate: applies a batch of versioned absolute-state writes.
--
-- ARGV[1] is the mode: "live" writes the live keys (and, for a collection
-- whose rebuild marker exists, the shadow keys too); "shadow" writes only
-- the shadow keys. Then five arguments per write:
--   kind ("z" sorted set, "h" hash, "d" document), base (index into KEYS),
--   member (field; "" for documents), version (canonical decimal), value
--   (score as a decimal integer, or bytes).
-- Keys from base: collections use value, version, rebuild marker, shadow
-- value, shadow version; documents use value, version.
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

local shadowOnly = ARGV[1] == 'shadow'
-- rebuilding[base] caches whether a collection's rebuild marker exists; the
-- script is atomic, so it cannot appear or vanish during the batch.
local rebuilding = {}
local out = {}
for a = 2, #ARGV, 5 do
  local kind, base = ARGV[a], tonumber(ARGV[a + 1])
  local member, version, value = ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  if shadowOnly then
    out[#out + 1] = gate(kind, KEYS[base + 3], KEYS[base + 4], member, version, value)
  else
    out[#out + 1] = gate(kind, KEYS[base], KEYS[base + 1], member, version, value)
    if kind ~= 'd' then
      if rebuilding[base] == nil then
        rebuilding[base] = redis.call('EXISTS', KEYS[base + 2]) == 1
      end
      if rebuilding[base] then
        gate(kind, KEYS[base + 3], KEYS[base + 4], member, version, value)
      end
    end
  end
end
return out
