-- bump.lua: move an id to a new version after a database write.
--
-- KEYS[1]  version key          P{id}:v
-- KEYS[2]  value-key stem       P{id}:d:   (same hash tag as KEYS[1])
-- ARGV[1]  TTL in milliseconds for the version key
--
-- Returns {new version, 1 if the old version's value key still exists (it
-- is now an orphan that lives until its TTL) else 0}.
--
-- The new version is max(current + 1, server clock in microseconds). Keeping
-- versions at or below the clock is what lets read.lua restart a lost
-- version key from the clock without ever reusing a version.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local current = redis.call('GET', KEYS[1])
local nextv = now
local orphan = 0
if current then
  if redis.call('EXISTS', KEYS[2] .. current) == 1 then
    orphan = 1
  end
  local c = tonumber(current)
  if c and c >= now then
    nextv = c + 1
  end
end
local version = string.format('%.0f', nextv)
redis.call('SET', KEYS[1], version, 'PX', ARGV[1])
return {version, orphan}
