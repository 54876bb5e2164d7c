-- fill_at.lua: store a value GetAt loaded under a caller-supplied version,
-- unless a value of a newer version is already stored.
--
-- KEYS[1]  GetAt current key    P{id}:a   ("<version>:<encoded value>")
-- ARGV[1]  the caller's version (decimal, no sign, no leading zeros)
-- ARGV[2]  "<version>:<encoded value>"
-- ARGV[3]  TTL in milliseconds
-- ARGV[4]  "1" when the caller read a stored value that did not decode,
--          "0" otherwise
-- ARGV[5]  the bytes of that stored value ("" with ARGV[4] = "0")
--
-- Returns 1 when stored, 0 when the stored value is newer. Versions are
-- compared as decimal strings (length, then bytes) because caller versions
-- are int64 and Lua numbers are doubles.

-- Only Go can run the codec, so it tells us what did not decode. If the key
-- still holds exactly those bytes, nobody can be served them, whatever
-- version they claim: replace them, or every caller below that version
-- would load until they expire. A caller's value is at or above its own
-- version, and a hit needs a stored version at or above the reader's, so a
-- lower stored version costs misses, never a stale read. Anything written
-- since is left to the version comparison below.
if ARGV[4] == '1' and redis.call('GET', KEYS[1]) == ARGV[5] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
local head = redis.call('GETRANGE', KEYS[1], 0, 20)
local sep = string.find(head, ':', 1, true)
if sep then
  local stored = string.sub(head, 1, sep - 1)
  local mine = ARGV[1]
  if #stored > #mine or (#stored == #mine and stored > mine) then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
