-- verity leaderboard: end a Verify pass that records nothing.
--
-- KEYS[1] holds the token of the Verify pass under way; ARGV[1] is the
-- token of the pass that ends. The key is deleted only while it is still
-- that pass's: a pass started since keeps its own. Returns 1 when deleted.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
