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
-- are int64 and Lua numbers are doubles; that needs both to be canonical.

-- version returns the stored value's version prefix when it is one this
-- package writes and reads (splitVersioned in cache.go): a non-negative
-- int64 in canonical decimal, no sign or leading zeros, before the first
-- ':'. Otherwise nil. Such a prefix is at most 19 digits, so head, the
-- first 20 bytes, holds its ':' or the prefix is too long.
local function version(head)
  local sep = string.find(head, ':', 1, true)
  if not sep then
    return nil
  end
  local v = string.sub(head, 1, sep - 1)
  if not string.find(v, '^%d+$') then
    return nil
  end
  if #v > 1 and string.sub(v, 1, 1) == '0' then
    return nil
  end
  if #v == 19 and v > '9223372036854775807' then
    return nil
  end
  return v
end

-- A stored version that is newer wins, whether or not the payload decodes
-- for this caller: during a rollout that changes the codec or the cached
-- type, old and new processes cannot decode each other's values, and
-- replacing a newer one with an older version would make them overwrite
-- each other in turn and both keep missing. The caller serves what it
-- loaded, uncached. A prefix that does not parse is no version at all: no
-- process can be served that value, whatever it claims, so it is replaced,
-- or every caller would load until it expires.
local stored = version(redis.call('GETRANGE', KEYS[1], 0, 19))
local mine = ARGV[1]
if stored and (#stored > #mine or (#stored == #mine and stored > mine)) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
