-- Runs a read script (page.lua, around.lua, top.lua) for a read with
-- AtLeast, and reads in the same atomic step the projected versions the
-- read requires: the versions a read reports as met must be those of the
-- answer itself, and Redis can go back to an older state between two
-- round trips (a failover to a replica that missed the newest writes).
-- read.go (withVersions) puts the read script before this one, as the
-- function read(KEYS, ARGV), which gets the read's own key and arguments.
--
-- KEYS[1]         the sorted set, the read script's key
-- KEYS[2]         the layout key
-- KEYS[3..2+n]    each requirement's version hash (its bucket's)
-- KEYS[3+n]       the unbucketed version hash (the board's own version
--                 hash when it uses no buckets)
-- ARGV[1]         n, the number of requirements
-- ARGV[2..1+n]    each requirement's user
-- ARGV[2+n..]     the read script's arguments
--
-- Result: {layout, keys, versions, answer}: the layout key's value
-- (false when absent or not a string: MGET, as the wait reads it); what
-- the keys tell when it is absent, as the gate reads them: 1 when the
-- unbucketed version hash exists (a projection of 0 buckets), 2 when it
-- does not but the sorted set does (a projection that lost its layout
-- key), 0 otherwise; each user's stored version in order (false when
-- absent); and the read script's result.

local n = tonumber(ARGV[1])
local layout = redis.call('MGET', KEYS[2])[1]
local keys = 0
if not layout then
  if redis.call('EXISTS', KEYS[3 + n]) == 1 then
    keys = 1
  elseif redis.call('EXISTS', KEYS[1]) == 1 then
    keys = 2
  end
end
local versions = {}
for i = 1, n do
  versions[i] = redis.call('HGET', KEYS[2 + i], ARGV[1 + i])
end
return {layout, keys, versions, read({KEYS[1]}, {unpack(ARGV, 2 + n)})}
