-- read.lua: one round trip for a cache read.
--
-- KEYS[1]  version key          P{id}:v
-- KEYS[2]  value-key stem       P{id}:d:   (value key = stem .. version)
-- KEYS[3]  lease-key stem       P{id}:l:   (lease key = stem .. version)
-- ARGV[1]  "1" to initialise a missing version, "0" to only look (Peek)
-- ARGV[2]  TTL in milliseconds for a freshly initialised version key
-- ARGV[3]  fill-lease TTL in milliseconds, "0" when leases are off
-- ARGV[4]  lease token of the calling process (one per Cache)
--
-- Returns {version or false, value or false, lease}
--   lease: 0 = no lease asked, 1 = the caller's process holds the fill
--          lease, 2 = another process holds it.
--
-- The value and lease keys are built here from the version just read, so
-- they cannot be listed in KEYS. Their stems are (KEYS[2], KEYS[3]) and they
-- carry the same hash tag as KEYS[1], so every key this script touches lives
-- in the slot Redis Cluster already routed the call to.

local version = redis.call('GET', KEYS[1])
if not version then
  if ARGV[1] ~= '1' then
    return {false, false, 0}
  end
  -- The version key is gone (first use, TTL, eviction, FLUSHALL, lost
  -- write). Restart from the server clock in microseconds: every version
  -- ever handed out is at most the clock at the time it was handed out, so
  -- the new one is larger than all of them and no surviving value key can
  -- be reached again. A fresh version has no value yet; do not look for one.
  local t = redis.call('TIME')
  version = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
  redis.call('SET', KEYS[1], version, 'PX', ARGV[2])
else
  local value = redis.call('GET', KEYS[2] .. version)
  if value then
    return {version, value, 0}
  end
end

if ARGV[3] == '0' then
  return {version, false, 0}
end
local lease = KEYS[3] .. version
if redis.call('SET', lease, ARGV[4], 'NX', 'PX', ARGV[3]) then
  return {version, false, 1}
end
-- The token names a process, so another goroutine of the same process that
-- already holds the lease is reported as ours: it shares the load in-process.
if redis.call('GET', lease) == ARGV[4] then
  return {version, false, 1}
end
return {version, false, 2}
