-- verity leaderboard: end a Verify pass that records nothing.
--
-- KEYS[1] holds the token of the Verify pass under way, KEYS[2] is the
-- record that the projection is complete, KEYS[3] its companion (see
-- verified.lua); all share the board's hash tag.
-- ARGV[1] is the token of the pass that ends, ARGV[2] "1" when the pass
-- found the projection wrong and left it so, "0" otherwise.
--
-- KEYS[1] is deleted only while it is still that pass's: a pass started
-- since keeps its own. A pass that found the projection wrong deletes
-- KEYS[2], whichever pass made it: a record that outlived what this pass
-- saw is not to be trusted (a later pass that finds the projection right
-- records it again). Returns 1 when KEYS[1] was deleted.
if ARGV[2] == '1' then
  redis.call('DEL', KEYS[2], KEYS[3])
end
local marker = redis.call('GET', KEYS[1])
if marker and string.sub(marker, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
  return redis.call('DEL', KEYS[1])
end
return 0
