-- verity projection gate: applies a batch of versioned absolute-state writes.
--
-- ARGV[1] is the mode: "live" writes the live keys (and, for a collection
-- whose rebuild marker exists, the shadow keys too); "shadow" writes only
-- the shadow keys; "shadow <token>" also refuses, with the error
-- "VERITY_NOT_OWNED <base>" and nothing written, unless every collection's
-- rebuild marker holds that token; "shadow <token> <batch>" (a rebuild's
-- copy; batch a positive decimal) also counts, once the writes are done,
-- each collection's writes in the call — every one sent, whatever its
-- outcome — in its copy count: HINCRBY of field "rows", unless field
-- "batch" already holds this batch or a later one (a retried call that
-- ran before), then "batch" is set. Live writes dual-written into the
-- shadow keys are never counted in "rows" (every shadow write counts what
-- it creates in "members" and "versions": see the keys below). ARGV[2] is
-- the number C of collections in the call.
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
-- value, shadow layout, unbucketed version, unbucketed shadow version, and
-- the copy count (where every write into the shadow keys, copied or
-- dual-written, counts in fields "members" and "versions" the members and
-- versions it creates there, for the rebuild's switch); documents use
-- value, version. Version (bucket) keys follow, referenced by
-- index from the writes.
--
-- Before anything is written, every collection's stored layout is checked
-- against the caller's (shadow layout too while a rebuild runs, or in
-- shadow mode): a mismatch returns the error "VERITY_LAYOUT <live|shadow>
-- <base> <stored>" and writes nothing, because a version looked up in the
-- wrong bucket would look absent and let a stale write in. <stored> is the
-- layout key's value if it is decimal digits, "missing" (see below), or
-- else "unreadable": Redis trims line breaks off an error reply, so other
-- bytes could arrive as a bucket count ("8\n" as "8"). Once the checks
-- pass, a collection without a layout key gets the caller's, "0" included,
-- so that every collection records its layout.
--
-- Without a layout key the keys tell: an empty collection fits any layout;
-- one with the unbucketed version hash was written before layouts were
-- recorded, and fits "0"; one with values but not that hash has stored
-- layout "missing", refused for every caller: it lost its layout key (DEL,
-- eviction), its bucket count is unknown, and a flat lookup would find no
-- version. (An unbucketed collection whose version hash empties keeps its
-- recorded "0".)
--
-- Returns one element per write: the integer 1 applied, 2 duplicate,
-- 3 stale, 4 conflict (the stored version equals the write's but the value
-- stored with it differs: two states claim one version; nothing written);
-- or, when the stored version is not a positive int64 in
-- canonical decimal, that stored version as a string (nothing written).
-- A Redis error in a write (WRONGTYPE, when a key holds another type)
-- ends the script, but Redis keeps what it wrote before: the reply is then
-- the elements of the writes done before the failing one, followed by the
-- error (an error reply as an array element), so the caller knows which
-- writes this call applied. An error before the first write (a layout or
-- marker key of another type) is the script's error reply as usual.
--
-- A live call whose writes all go to collections with one version hash,
-- none of them being rebuilt (the relay's common case), is decided and
-- written in bulk, with the same replies: see bulk below.
--
-- Lua numbers are doubles, which cannot hold every int64, so versions are
-- never converted to numbers: they are compared as decimal strings.

local APPLIED, DUPLICATE, STALE, CONFLICT = 1, 2, 3, 4

-- compare returns -1, 0 or 1 for decimal integers a and b without sign or
-- leading zeros: length first, then digit by digit (bytes, not the locale,
-- which Lua's string < would use).
local function compare(a, b)
  if #a ~= #b then
    if #a < #b then return -1 end
    return 1
  end
  for i = 1, #a do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      if x < y then return -1 end
      return 1
    end
  end
  return 0
end

local MAX_INT64 = '9223372036854775807'

-- readable reports whether a stored version is one the gate could have
-- written: a positive int64 in canonical decimal. Anything else (zero, a
-- sign, a leading zero, a value past int64) cannot be ordered against the
-- source's versions: one too long would make every later write stale.
local function readable(s)
  if string.match(s, '^[1-9][0-9]*$') == nil then return false end
  return #s < #MAX_INT64 or (#s == #MAX_INT64 and compare(s, MAX_INT64) <= 0)
end

-- differs reports whether a stored value (false when absent) differs from
-- a write's: scores as the numbers ZADD stores (the caller sends a decimal
-- integer, Redis returns its own formatting), other values as bytes. An
-- absent value is no conflict: the version was applied and the value lost
-- since, which the reconciler finds and repairs.
local function differs(kind, held, value)
  if not held then return false end
  if kind == 'z' then return tonumber(held) ~= tonumber(value) end
  return held ~= value
end

-- held returns the value stored for one write's target, false when there
-- is none or when it cannot be read (a key of another type: the write is
-- not applied, so nothing fails, as before values were compared).
local function held(kind, valueKey, member)
  local r
  if kind == 'z' then
    r = redis.pcall('ZSCORE', valueKey, member)
  elseif kind == 'h' then
    r = redis.pcall('HGET', valueKey, member)
  else
    r = redis.pcall('GET', valueKey)
  end
  if type(r) == 'table' then return false end
  return r
end

local function gate(kind, valueKey, versionKey, member, version, value)
  local stored
  if kind == 'd' then
    stored = redis.call('GET', versionKey)
  else
    stored = redis.call('HGET', versionKey, member)
  end
  if stored then
    if not readable(stored) then return stored end
    local c = compare(version, stored)
    if c == 0 then
      if differs(kind, held(kind, valueKey, member), value) then return CONFLICT end
      return DUPLICATE
    end
    if c < 0 then return STALE end
  end
  if kind == 'z' then
    redis.call('ZADD', valueKey, value, member)
    redis.call('HSET', versionKey, member, version)
  elseif kind == 'h' then
    redis.call('HSET', valueKey, member, value)
    redis.call('HSET', versionKey, member, version)
  else
    -- SET would replace a key of any type: refuse another type's here
    -- (WRONGTYPE, before anything is written), as ZADD and HSET do.
    redis.call('STRLEN', valueKey)
    redis.call('SET', valueKey, value)
    redis.call('SET', versionKey, version)
  end
  return APPLIED
end

-- shadowGate is gate for a collection write into its shadow keys (value
-- KEYS[base + 3], versions KEYS[svi]) that also counts, in the copy count
-- (KEYS[base + 7]), the members and versions it creates there: copy and
-- dual writes alike, so that the switch can tell a shadow that lost some
-- (an eviction) from one whose losses new members made up for.
local function shadowGate(kind, base, svi, member, version, value)
  local hadValue = held(kind, KEYS[base + 3], member) and true or false
  local hadVersion = redis.pcall('HGET', KEYS[svi], member)
  hadVersion = hadVersion ~= false and type(hadVersion) ~= 'table'
  local r = gate(kind, KEYS[base + 3], KEYS[svi], member, version, value)
  if r == APPLIED then
    if not hadValue then redis.call('HINCRBY', KEYS[base + 7], 'members', 1) end
    if not hadVersion then redis.call('HINCRBY', KEYS[base + 7], 'versions', 1) end
  end
  return r
end

-- storedLayout returns a collection's layout (nil when it is empty) and
-- whether its layout key records it; see the header for the rule.
local function storedLayout(layoutKey, valueKey, unbucketedKey)
  local s = redis.call('GET', layoutKey)
  if s then return s, true end
  if redis.call('EXISTS', unbucketedKey) == 1 then return '0', false end
  if redis.call('EXISTS', valueKey) == 1 then return 'missing', false end
  return nil, false
end

local mode, token, batch = ARGV[1], nil, nil
do
  local sp = string.find(mode, ' ', 1, true)
  if sp then
    mode, token = string.sub(mode, 1, sp - 1), string.sub(mode, sp + 1)
    sp = string.find(token, ' ', 1, true)
    if sp then
      token, batch = string.sub(token, 1, sp - 1), string.sub(token, sp + 1)
    end
  end
end
local shadowOnly = mode == 'shadow'
local ncoll = tonumber(ARGV[2])
-- rebuilding[base] records whether a collection's rebuild marker exists;
-- the script is atomic, so it cannot appear or vanish during the batch.
local rebuilding = {}
local adopt = {}
local function check(which, base, layoutKey, valueKey, unbucketedKey, want)
  local stored, recorded = storedLayout(layoutKey, valueKey, unbucketedKey)
  if stored ~= nil and stored ~= want then
    if stored ~= 'missing' and string.match(stored, '^[0-9]+$') == nil then
      stored = 'unreadable'
    end
    return redis.error_reply('VERITY_LAYOUT ' .. which .. ' ' .. base .. ' ' .. stored)
  end
  if not recorded then adopt[#adopt + 1] = { layoutKey, want } end
  return nil
end
local last = #ARGV - 3 * ncoll -- the last write argument
for a = last + 1, #ARGV, 3 do
  local base, live, shadow = tonumber(ARGV[a]), ARGV[a + 1], ARGV[a + 2]
  local err
  if shadowOnly then
    if token and redis.call('GET', KEYS[base + 2]) ~= token then
      return redis.error_reply('VERITY_NOT_OWNED ' .. base)
    end
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
-- Checks passed: record the layout of collections that had no layout key.
for _, p in ipairs(adopt) do
  redis.call('SET', p[1], p[2])
end

-- CHUNK bounds the arguments of one command built with unpack, whose
-- results must fit Lua's C stack (8,000 slots).
local CHUNK = 1000

-- bulk decides and writes a live call whose writes are all to collections
-- with one version hash ("z", "h") none of which is being rebuilt, the
-- relay's common case, with a few commands per collection instead of three
-- per write: HMGET of every member's stored version, then, once every
-- write is decided in order (a write counting as stored for later writes
-- of its member; per collection, a ZMSCORE or HMGET, in chunks, of the
-- values stored for writes at their stored version tells a duplicate from
-- a conflict), one ZADD or HSET of the values and one HSET of the
-- versions, each in chunks. It returns nil, having written nothing, for
-- any other call, and when a key holds another type: the loop below then
-- runs and reports the failing write as the header says. Once it writes,
-- a failure is reported after the writes decided before the first write
-- applied (only the first write command can fail: Redis checks maxmemory
-- until a script's first write, the types were checked, and scores are
-- decimal integers, which ZADD always accepts; a value ZADD could refuse
-- would make a later chunk fail after earlier ones were written, and this
-- reply under-report them).
local function bulk()
  if shadowOnly or last < 3 then return nil end
  -- Per write, its first argument's position and its collection; per
  -- collection (in order of first write), its kind, members, stored
  -- versions, and the arguments of its value and version writes.
  local at, coll, order, colls = {}, {}, {}, {}
  local a = 3
  while a <= last do
    local kind, base = ARGV[a], tonumber(ARGV[a + 1])
    if (kind ~= 'z' and kind ~= 'h') or rebuilding[base] then return nil end
    local c = colls[base]
    if not c then
      c = { base = base, kind = kind, members = {}, stored = {}, held = {}, unsure = {}, values = {}, versions = {} }
      colls[base] = c
      order[#order + 1] = c
    elseif c.kind ~= kind then
      return nil
    end
    local n = #at + 1
    at[n], coll[n] = a, c
    c.members[#c.members + 1] = ARGV[a + 2]
    a = a + 5
  end
  for _, c in ipairs(order) do
    local t = redis.call('TYPE', KEYS[c.base])
    t = t.ok or t
    if t ~= 'none' and t ~= ((c.kind == 'z') and 'zset' or 'hash') then return nil end
    local members, stored = c.members, c.stored
    for i = 1, #members, CHUNK do
      local j = math.min(i + CHUNK - 1, #members)
      local got = redis.pcall('HMGET', KEYS[c.base + 5], unpack(members, i, j))
      if got.err then return nil end
      for k = i, j do stored[members[k]] = got[k - i + 1] end
    end
  end
  local out, firstApplied = {}, nil
  for i = 1, #at do
    local a, c = at[i], coll[i]
    local member, version = ARGV[a + 2], ARGV[a + 3]
    local stored = c.stored[member]
    local r = APPLIED
    if stored then
      if not readable(stored) then
        r = stored
      else
        local cmp = compare(version, stored)
        if cmp == 0 then
          -- A redelivery, or a conflict. Neither writes, so the later
          -- writes' verdicts do not depend on which: a value written
          -- earlier in this call decides now, one stored before it once
          -- read (below).
          local h = c.held[member]
          if h == nil then
            r = DUPLICATE
            c.unsure[#c.unsure + 1] = i
          else
            r = differs(c.kind, h, ARGV[a + 4]) and CONFLICT or DUPLICATE
          end
        elseif cmp < 0 then
          r = STALE
        end
      end
    end
    if r == APPLIED then
      firstApplied = firstApplied or i
      c.stored[member], c.held[member] = version, ARGV[a + 4]
      local vs, ws = c.values, c.versions
      local n = #vs
      if c.kind == 'z' then
        vs[n + 1], vs[n + 2] = ARGV[a + 4], member
      else
        vs[n + 1], vs[n + 2] = member, ARGV[a + 4]
      end
      n = #ws
      ws[n + 1], ws[n + 2] = member, version
    end
    out[i] = r
  end
  -- The values stored before this call, of the writes at their stored
  -- version that no earlier write of the call decided: read only for
  -- those (rare outside a retry), and before anything is written.
  for _, c in ipairs(order) do
    local unsure, cmd = c.unsure, (c.kind == 'z') and 'ZMSCORE' or 'HMGET'
    for i = 1, #unsure, CHUNK do
      local j = math.min(i + CHUNK - 1, #unsure)
      local members = {}
      for k = i, j do members[k - i + 1] = ARGV[at[unsure[k]] + 2] end
      local got = redis.call(cmd, KEYS[c.base], unpack(members))
      for k = i, j do
        local w = unsure[k]
        if differs(c.kind, got[k - i + 1], ARGV[at[w] + 4]) then out[w] = CONFLICT end
      end
    end
  end
  local ok, failure = pcall(function()
    for _, c in ipairs(order) do
      local cmd = (c.kind == 'z') and 'ZADD' or 'HSET'
      local vs, ws = c.values, c.versions
      for i = 1, #vs, 2 * CHUNK do
        redis.call(cmd, KEYS[c.base], unpack(vs, i, math.min(i + 2 * CHUNK - 1, #vs)))
      end
      for i = 1, #ws, 2 * CHUNK do
        redis.call('HSET', KEYS[c.base + 5], unpack(ws, i, math.min(i + 2 * CHUNK - 1, #ws)))
      end
    end
  end)
  if not ok then
    if type(failure) ~= 'table' then failure = { err = tostring(failure) } end
    local reply = {}
    for i = 1, firstApplied - 1 do reply[i] = out[i] end
    reply[#reply + 1] = failure
    return reply
  end
  return out
end
do
  local reply = bulk()
  if reply then return reply end
end

local out = {}
-- copied[base] counts a copy call's writes per collection; counted lists
-- the bases in order of first write, for a deterministic script.
local copied, counted = {}, {}
local a = 3
-- pcall: see the header on errors in a write.
local ok, failure = pcall(function()
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
      out[#out + 1] = shadowGate(kind, base, svi, member, version, value)
      if batch then
        if not copied[base] then counted[#counted + 1] = base end
        copied[base] = (copied[base] or 0) + 1
      end
    else
      local r = gate(kind, KEYS[base], KEYS[vi], member, version, value)
      if kind ~= 'd' and rebuilding[base] then
        shadowGate(kind, base, svi, member, version, value)
      end
      -- Only once the shadow write is done too: the write whose shadow
      -- keys fail is the failing one.
      out[#out + 1] = r
    end
  end
end)
if not ok then
  -- Redis 7 raises a command's error as a table {err = ...}; earlier
  -- versions, and Lua itself, as a string.
  if type(failure) ~= 'table' then failure = { err = tostring(failure) } end
  out[#out + 1] = failure
  return out
end
-- Counted after the writes, in this same call: Redis keeps both or
-- neither, so the count proves to the rebuild's switch that the rows are
-- there. A batch counted already is not counted again.
for _, base in ipairs(counted) do
  local counter, n = KEYS[base + 7], copied[base]
  local last = redis.call('HGET', counter, 'batch')
  if not last or compare(batch, last) > 0 then
    redis.call('HINCRBY', counter, 'rows', n)
    redis.call('HSET', counter, 'batch', batch)
  end
end
return out
