-- read.lua: the miss path of Get, and Peek. A hit never runs this script: it
-- is a plain GET of the current key.
--
-- KEYS[1]  version key          P{id}:v
-- KEYS[2]  current key          P{id}:c   ("<version>:<encoded value>")
-- KEYS[3]  lease key            P{id}:l   ("<version>:<lease token>")
-- ARGV[1]  "1" for a miss (initialise a missing version, keep it alive, take
--          the lease), "0" to only look (Peek): it writes nothing, and is
--          sent as EVALSHA_RO, which refuses writes
-- ARGV[2]  milliseconds a miss keeps the version key alive at least
--          (TTL + FillLeaseTTL)
-- ARGV[3]  fill-lease TTL in milliseconds, "0" when leases are off
-- ARGV[4]  lease token of the calling process (one per Cache)
-- ARGV[5]  "1" to ignore the current key (it did not decode), "0" otherwise
-- ARGV[6]  the version a waiter polls for, "" otherwise: under another
--          version the call takes no lease (the waiter starts over, and a
--          lease it took and gave up could be one another goroutine of its
--          process goes on to load under)
--
-- Returns {version or false, current or false, lease}
--   current: the current key's contents, when it exists and is not ignored;
--            the caller serves it (it is current by construction: every
--            Invalidate deletes it, every fill is version-checked).
--   lease:   0 = no lease asked (or the version is not ARGV[6]), 1 = the
--            caller's process holds the fill lease, 2 = another process
--            holds it.
--
-- One lease key per id, holding the version it was taken for, so that the
-- key is known before the version is read and can be declared in KEYS.

-- version (versions.lua, which runs first) reads a stored version.

local stored = redis.call('GET', KEYS[1])
if not version(stored) then
  stored = nil -- foreign or corrupt: as if lost, and replaced below
end
if ARGV[5] ~= '1' then
  local current = redis.call('GET', KEYS[2])
  if current then
    return {stored or false, current, 0}
  end
end
if ARGV[1] ~= '1' then
  return {stored or false, false, 0}
end

if stored then
  -- Keep the version alive until the load this miss may start has filled:
  -- had it expired first, the fill would be refused, and a load slower
  -- than the key's remaining life would never be cached. A version key
  -- that outlives its use costs memory only: versions never come back.
  local pttl = redis.call('PTTL', KEYS[1])
  if pttl < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
else
  -- The version key is gone (first use, TTL, eviction, FLUSHALL, lost
  -- write) or foreign. Restart from the server clock in microseconds:
  -- every version ever handed out is at most the clock when it was handed
  -- out, so the new one is larger than all of them and no fill still in
  -- flight under an old version can pass fill.lua's check. A current key
  -- that survived the version key (only reached here when it did not
  -- decode) also bounds it, if its prefix is a version with a successor
  -- (none of ours is near 2^53: the clock gets there in the year 2255).
  local t = redis.call('TIME')
  local nextv = tonumber(t[1]) * 1000000 + tonumber(t[2])
  -- A version has at most 16 digits: its ':' is within the first 17 bytes.
  local head = redis.call('GETRANGE', KEYS[2], 0, 16)
  local sep = string.find(head, ':', 1, true)
  local embedded = sep and version(string.sub(head, 1, sep - 1))
  if embedded and embedded >= nextv and embedded + 1 < 9007199254740992 then
    nextv = embedded + 1
  end
  stored = string.format('%.0f', nextv)
  redis.call('SET', KEYS[1], stored, 'PX', ARGV[2])
end

if ARGV[3] == '0' or (ARGV[6] ~= '' and ARGV[6] ~= stored) then
  return {stored, false, 0}
end
local ours = stored .. ':' .. ARGV[4]
local held = redis.call('GET', KEYS[3])
-- The token names a process, so another goroutine of the same process that
-- already holds the lease is reported as ours: it shares the load in-process.
if held == ours then
  return {stored, false, 1}
end
-- Versions have no leading zeros, so this prefix match is exact.
if held and string.sub(held, 1, #stored + 1) == stored .. ':' then
  return {stored, false, 2}
end
-- No lease, or one taken under another version: its holder's fill will be
-- refused by fill.lua's version check, so it guards nothing. Take it over.
redis.call('SET', KEYS[3], ours, 'PX', ARGV[3])
return {stored, false, 1}
