-- Returns a member's neighbourhood in a leaderboard sorted set, atomically.
--
-- KEYS[1]  the sorted set
-- ARGV[1]  the member
-- ARGV[2]  how many neighbours on each side
--
-- Result: false when the member is absent, else {index of the first
-- element, {member, score, ...}} covering up to ARGV[2] elements before the
-- member, the member, and up to ARGV[2] after it.

local rank = redis.call('ZRANK', KEYS[1], ARGV[1])
if not rank then
  return false
end
local n = tonumber(ARGV[2])
local first = math.max(0, rank - n)
return {first, redis.call('ZRANGE', KEYS[1], first, rank + n, 'WITHSCORES')}
