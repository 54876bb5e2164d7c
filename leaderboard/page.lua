-- Returns the page of a leaderboard sorted set that follows a keyset cursor.
--
-- KEYS[1]  the sorted set (scores are negated board scores)
-- ARGV[1]  the cursor's negated score, a decimal integer
-- ARGV[2]  the cursor's member
-- ARGV[3]  how many entries to return
--
-- Redis orders the set by (score, member), members compared as bytes
-- (memcmp). The page starts at the first element ordered after
-- (ARGV[1], ARGV[2]), whether or not the cursor's member is still there,
-- so pages stay stable while scores change. Result: {index of the first
-- element, {member, score, member, score, ...}}.

local key = KEYS[1]
local score = ARGV[1]
local cursor = ARGV[2]
local count = tonumber(ARGV[3])

-- Lua's string comparison uses the server's locale (strcoll); members must
-- be compared as bytes, exactly like the sorted set does.
local function after(member)
  local n = math.min(#member, #cursor)
  for i = 1, n do
    local a, b = string.byte(member, i), string.byte(cursor, i)
    if a ~= b then
      return a > b
    end
  end
  return #member > #cursor
end

-- Elements with the cursor's score occupy [lo, hi); binary search them for
-- the first member after the cursor's.
local lo = redis.call('ZCOUNT', key, '-inf', '(' .. score)
local hi = lo + redis.call('ZCOUNT', key, score, score)
while lo < hi do
  local mid = math.floor((lo + hi) / 2)
  local member = redis.call('ZRANGE', key, mid, mid)[1]
  if after(member) then
    hi = mid
  else
    lo = mid + 1
  end
end
return {lo, redis.call('ZRANGE', key, lo, lo + count - 1, 'WITHSCORES')}
