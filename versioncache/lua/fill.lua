-- fill.lua: store a freshly loaded value as the current value, but only if
-- the version is still the one the loader read before it queried the
-- database.
--
-- KEYS[1]  version key          P{id}:v
-- KEYS[2]  current key          P{id}:c
-- KEYS[3]  lease key            P{id}:l   ("<version>:<lease token>")
-- ARGV[1]  version the loader started from
-- ARGV[2]  "<version>:<encoded value>"
-- ARGV[3]  TTL in milliseconds
-- ARGV[4]  lease token, "" when the caller holds no lease
--
-- Returns 1 when stored, 0 when the version has moved on or is gone: an
-- Invalidate (or a re-initialisation, which always picks a larger version)
-- may have happened since the load began, so the load may predate a write.
-- The key is gone when it was evicted or flushed, or when it expired: the
-- fill came more than TTL + FillLeaseTTL (the life read.lua gives it) after
-- the last miss that read this version.

-- Release only our lease for this version: a miss under a newer version
-- may have taken the key over.
if ARGV[4] ~= '' and redis.call('GET', KEYS[3]) == ARGV[1] .. ':' .. ARGV[4] then
  redis.call('DEL', KEYS[3])
end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
-- Keep the version key alive at least as long as the current value, so that
-- a later Invalidate moves on from it rather than re-initialising. Never
-- shorten it: another miss's load under this version may still be running,
-- and read.lua promised it the key for longer.
local pttl = redis.call('PTTL', KEYS[1])
if pttl < tonumber(ARGV[3]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 1
