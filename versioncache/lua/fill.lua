-- fill.lua: store a freshly loaded value, but only under the version the
-- loader read before it queried the database.
--
-- KEYS[1]  version key          P{id}:v
-- KEYS[2]  value key            P{id}:d:<version>
-- KEYS[3]  lease key            P{id}:l:<version>
-- ARGV[1]  version the loader started from
-- ARGV[2]  encoded value
-- ARGV[3]  TTL in milliseconds
-- ARGV[4]  lease token, "" when the caller holds no lease
--
-- Returns 1 when stored, 0 when the version has moved on (the load may
-- predate a write, and storing it would only create a dead key).

if ARGV[4] ~= '' and redis.call('GET', KEYS[3]) == ARGV[4] then
  redis.call('DEL', KEYS[3])
end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
-- Keep the version key alive at least as long as its newest value.
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
