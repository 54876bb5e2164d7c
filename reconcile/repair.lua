-- verity reconcile: compare-and-set repairs.
--
-- ARGV[1] is the kind: "z" sorted set, "h" hash, "d" document. ARGV[2] is
-- the reconciler's layout (version bucket count as a canonical decimal).
-- For a collection, KEYS[1] is the value key, KEYS[2] the layout key,
-- KEYS[3] the unbucketed version hash, and version buckets follow; the
-- layout is checked first, by the gate's rule (storedLayout in
-- projection/gate.lua), and a mismatch returns the error
-- "VERITY_LAYOUT live 1 <stored>" with nothing written. <stored> is, as
-- in the gate's, the layout key's value if it is decimal digits,
-- "missing", or else "unreadable": Redis trims line breaks off an error
-- reply, so other bytes could arrive as a bucket count ("8\n" as "8").
-- Then eight
-- arguments per repair:
--   base        index into KEYS of the value key
--   vbase       index into KEYS of the version key (the member's bucket)
--   member      sorted-set member or hash field ("" for documents)
--   expVersion  the version read before deciding: "-" absent, "=" .. raw
--   expValue    the value read before deciding:   "-" absent, "=" .. raw
--               (either, read at or over the size limit: "#" .. its SHA-1
--               in hex, as "=" .. raw would be over Redis's bulk limit)
--               (for sorted sets the raw score is compared as a number;
--               versions always as exact strings)
--   action      "set" writes newVersion/newValue, "del" removes both
--   newVersion  canonical decimal (set only)
--   newValue    score as a decimal integer, or bytes (set only)
-- A repair is written only if the stored version and value are still
-- exactly what was read: anything written in between (a newer gate write,
-- another repair, a hand edit) wins, and the repair reports 0.
-- A repair one of whose keys holds another Redis type than the projection
-- keeps there (a hand edit, another program's key) is refused before it
-- reads or writes anything, and reports "value <type>" or "version <type>"
-- (the key and the type TYPE names): run into, its GET or HGET would fail
-- the whole script with WRONGTYPE, and every other repair of the call
-- with it.
-- Returns one element per repair: 1 written, 0 declined, or a refusal.

local kind, want = ARGV[1], ARGV[2]

-- storedLayout is the gate's rule (storedLayout in projection/gate.lua):
-- the layout key, else "0" for a collection with the unbucketed version
-- hash (written before layouts were recorded), "missing" for values
-- without it (a collection that lost its layout key: every entry would
-- look corrupt, and repairing them would overwrite versions ahead of the
-- source), nil for an empty collection. The second result tells whether
-- the layout key records it.
local function storedLayout()
  local s = redis.call('GET', KEYS[2])
  if s then return s, true end
  if redis.call('EXISTS', KEYS[3]) == 1 then return '0', false end
  if redis.call('EXISTS', KEYS[1]) == 1 then return 'missing', false end
  return nil, false
end

-- adoptLayout is set when the collection has no layout key: the first
-- repair written records the reconciler's layout, as the gate would.
local adoptLayout = false
if kind ~= 'd' then
  local layout, recorded = storedLayout()
  if layout and layout ~= want then
    if layout ~= 'missing' and string.match(layout, '^[0-9]+$') == nil then
      layout = 'unreadable'
    end
    return redis.error_reply('VERITY_LAYOUT live 1 ' .. layout)
  end
  adoptLayout = not recorded
end

local function storedVersion(versionKey, member)
  if kind == 'd' then return redis.call('GET', versionKey) end
  return redis.call('HGET', versionKey, member)
end

local function storedValue(valueKey, member)
  if kind == 'z' then return redis.call('ZSCORE', valueKey, member) end
  if kind == 'h' then return redis.call('HGET', valueKey, member) end
  return redis.call('GET', valueKey)
end

-- matches compares a stored string with what was read. Versions are
-- compared as strings, like the gate does: a Lua number is a double, and
-- int64 versions above 2^53 that round to the same double would match.
-- numeric is only set for a sorted-set score, whose text Redis may format
-- differently from the read reply; scores are bounded to ±2^53, where
-- doubles are exact. An expectation of "#" holds a SHA-1 of what was read.
local function matches(stored, expected, numeric)
  if expected == '-' then return not stored end
  if not stored then return false end
  local raw = string.sub(expected, 2)
  if string.sub(expected, 1, 1) == '#' then return redis.sha1hex(stored) == raw end
  if numeric and stored ~= raw then
    return tonumber(stored) == tonumber(raw)
  end
  return stored == raw
end

-- The types the projection keeps in a repair's value and version keys.
local valueType, versionType = 'string', 'string'
if kind == 'z' then
  valueType, versionType = 'zset', 'hash'
elseif kind == 'h' then
  valueType, versionType = 'hash', 'hash'
end

-- wrongType returns the refusal for a repair whose value or version key
-- holds another type, or nil ("none", an absent key, is fine).
local function wrongType(valueKey, versionKey)
  local t = redis.call('TYPE', valueKey)['ok']
  if t ~= 'none' and t ~= valueType then return 'value ' .. t end
  t = redis.call('TYPE', versionKey)['ok']
  if t ~= 'none' and t ~= versionType then return 'version ' .. t end
  return nil
end

local out = {}
for a = 3, #ARGV, 8 do
  local valueKey, versionKey = KEYS[tonumber(ARGV[a])], KEYS[tonumber(ARGV[a + 1])]
  local member = ARGV[a + 2]
  local refused = wrongType(valueKey, versionKey)
  if refused then
    out[#out + 1] = refused
  elseif matches(storedVersion(versionKey, member), ARGV[a + 3], false)
    and matches(storedValue(valueKey, member), ARGV[a + 4], kind == 'z') then
    local action, version, value = ARGV[a + 5], ARGV[a + 6], ARGV[a + 7]
    if adoptLayout then
      redis.call('SET', KEYS[2], want)
      adoptLayout = false
    end
    if action == 'set' then
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
    else
      if kind == 'z' then
        redis.call('ZREM', valueKey, member)
        redis.call('HDEL', versionKey, member)
      elseif kind == 'h' then
        redis.call('HDEL', valueKey, member)
        redis.call('HDEL', versionKey, member)
      else
        redis.call('DEL', valueKey, versionKey)
      end
    end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
