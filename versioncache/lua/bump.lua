-- bump.lua: after a database write, move an id to a new version and delete
-- its current value and GetAt's value, atomically.
--
-- KEYS[1]  version key          P{id}:v
-- KEYS[2]  current key          P{id}:c   ("<version>:<encoded value>")
-- KEYS[3]  GetAt key            P{id}:a   ("<caller's version>:<encoded value>")
-- ARGV[1]  TTL in milliseconds for the version key
--
-- Returns {new version, 1 if a current value was deleted else 0}, or an
-- error, having changed nothing, when it finds no new version.
--
-- The new version is larger than the current one and than the version of
-- the current value (which can outlive a lost version key), where those are
-- versions (see version below), and at least the server clock in
-- microseconds. Keeping versions at or near the clock is what lets read.lua
-- restart a lost version key from the clock without ever reusing a version
-- that a fill still in flight might carry.

-- version (versions.lua, which runs first) reads a stored version.

local t = redis.call('TIME')
local nextv = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- A version whose successor would not be below 2^53 is not followed, here
-- and below (none of ours is near it: the clock gets there in 2255).
local stored = redis.call('GET', KEYS[1])
local current = version(stored)
if current and current >= nextv and current + 1 < 9007199254740992 then
  nextv = current + 1
end
-- A version has at most 16 digits: its ':' is within the first 17 bytes.
local head = redis.call('GETRANGE', KEYS[2], 0, 16)
local sep = string.find(head, ':', 1, true)
local embedded = sep and version(string.sub(head, 1, sep - 1))
if embedded and embedded >= nextv and embedded + 1 < 9007199254740992 then
  nextv = embedded + 1
end
local nextText = string.format('%.0f', nextv)
-- fill.lua compares versions as text: were the version left as it is, a
-- fill that loaded before this write would pass. Only foreign values can
-- lead here (2^53 - 1 as the version, 2^53 - 2 in the current value).
if nextText == stored then
  return redis.error_reply('versioncache: no new version for ' .. KEYS[1] ..
    ' (it holds ' .. stored .. '); delete ' .. KEYS[1] .. ' and ' .. KEYS[2] ..
    ', then invalidate again')
end
local deleted = redis.call('DEL', KEYS[2])
-- GetAt's value too: Invalidate is how a caller repairs one that CheckAt
-- found divergent (a write that kept its row_version). A GetAt load in
-- flight may store again after this, under its caller's version: GetAt
-- takes that version to name the value.
redis.call('DEL', KEYS[3])
redis.call('SET', KEYS[1], nextText, 'PX', ARGV[1])
return {nextText, deleted}
