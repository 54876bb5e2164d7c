-- Returns the first entries of a leaderboard sorted set, in page.lua's
-- reply shape. A Top without AtLeast sends ZRANGE itself; one with AtLeast
-- runs this script under versions.lua, which reads the required versions
-- in the same step.
--
-- KEYS[1]  the sorted set
-- ARGV[1]  how many entries to return
--
-- Result: {0, {member, score, member, score, ...}}.

return {0, redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')}
