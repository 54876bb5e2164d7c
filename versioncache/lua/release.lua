-- release.lua: give up a fill lease after a failed load, so that other
-- processes need not wait for it to lapse.
--
-- KEYS[1]  lease key   P{id}:l:<version>
-- ARGV[1]  lease token of the calling process
--
-- Returns 1 when released, 0 when the lease was not ours (any more).

if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
