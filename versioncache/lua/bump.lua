-- bump.lua: after a database write, move an id to a new version and delete
-- its current value, atomically.
--
-- KEYS[1]  version key          P{id}:v
-- KEYS[2]  current key          P{id}:c   ("<version>:<encoded value>")
-- ARGV[1]  TTL in milliseconds for the version key
--
-- Returns {new version, 1 if a current value was deleted else 0}.
--
-- The new version is larger than the current one, than the version of the
-- current value (which can outlive a lost version key), and at least the
-- server clock in microseconds. Keeping versions at or near the clock is
-- what lets read.lua restart a lost version key from the clock without ever
-- reusing a version that a fill still in flight might carry.

local t = redis.call('TIME')
local nextv = tonumber(t[1]) * 1000000 + tonumber(t[2])
local current = tonumber(redis.call('GET', KEYS[1]) or '')
if current and current >= nextv then
  nextv = current + 1
end
local head = redis.call('GETRANGE', KEYS[2], 0, 20)
local sep = string.find(head, ':', 1, true)
if sep then
  local embedded = tonumber(string.sub(head, 1, sep - 1))
  if embedded and embedded >= nextv then
    nextv = embedded + 1
  end
end
local deleted = redis.call('DEL', KEYS[2])
local version = string.format('%.0f', nextv)
redis.call('SET', KEYS[1], version, 'PX', ARGV[1])
return {version, deleted}
