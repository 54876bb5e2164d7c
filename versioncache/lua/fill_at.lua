-- fill_at.lua: store a value GetAt loaded under a caller-supplied version,
-- unless a value of a newer version is already stored.
--
-- KEYS[1]  GetAt current key    P{id}:a   ("<version>:<encoded value>")
-- ARGV[1]  the caller's version (decimal, no sign, no leading zeros)
-- ARGV[2]  "<version>:<encoded value>"
-- ARGV[3]  TTL in milliseconds
--
-- Returns 1 when stored, 0 when the stored value is newer. Versions are
-- compared as decimal strings (length, then bytes) because caller versions
-- are int64 and Lua numbers are doubles.

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
