-- The seed design's per-event projection script, rebuilt as the benchmark's
-- baseline: a marker key per event id short-circuits redeliveries, and the
-- version kept in a hash orders the rest.
--
-- KEYS[1] event marker, KEYS[2] sorted set, KEYS[3] version hash
-- ARGV[1] member, ARGV[2] score, ARGV[3] version, ARGV[4] marker TTL (s)
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 'duplicate'
end
local stored = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '-1')
redis.call('SET', KEYS[1], '1', 'EX', ARGV[4])
if tonumber(ARGV[3]) <= stored then
  return 'stale'
end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
return 'applied'
