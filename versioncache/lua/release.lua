-- release.lua: give up a fill lease after a failed load, so that other
-- processes need not wait for it to lapse.
--
-- KEYS[1]  lease key   P{id}:l   ("<version>:<lease token>")
-- ARGV[1]  version the lease was taken for
-- ARGV[2]  lease token of the calling process
--
-- Returns 1 when released, 0 when the lease was not ours (any more), for
-- instance because a miss under a newer version has taken it over.

if redis.call('GET', KEYS[1]) == ARGV[1] .. ':' .. ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
