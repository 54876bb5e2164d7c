-- verity reconcile: rebuild a collection into shadow keys, then switch.
--
-- KEYS: marker, shadow value, shadow version, live value, live version
-- (one hash tag, so one Redis Cluster slot). ARGV[1] is the step, ARGV[2]
-- the rebuild's token, ARGV[3] the marker TTL in milliseconds.
--
-- start:   refuse (0) if a marker exists; otherwise clear leftover shadow
--          keys and set the marker, in one step, so that no gate write
--          dual-written after the marker appears can be cleared away.
-- refresh: extend the marker's TTL if it is still ours (1), else 0.
-- switch:  if the marker is still ours, replace the live keys by the
--          shadow keys (UNLINK, then RENAME; a shadow that was never created
--          means the source is empty, so the live key is just removed) and
--          remove the marker, atomically: readers see the old projection,
--          then the new one, never a half-built one. Returns 1, or 0 if the
--          marker is gone or not ours (nothing is touched).
-- abort:   remove the marker if it is ours, and the shadow keys if no other
--          rebuild owns them (marker ours or gone): 1, or 0 if another
--          rebuild holds the marker (nothing is touched).

local step, token = ARGV[1], ARGV[2]
local marker, shadowValue, shadowVersion = KEYS[1], KEYS[2], KEYS[3]

if step == 'start' then
  if redis.call('EXISTS', marker) == 1 then return 0 end
  redis.call('UNLINK', shadowValue, shadowVersion)
  redis.call('SET', marker, token, 'PX', ARGV[3])
  return 1
end

local current = redis.call('GET', marker)

if step == 'abort' then
  if current and current ~= token then return 0 end
  redis.call('UNLINK', marker, shadowValue, shadowVersion)
  return 1
end

if current ~= token then return 0 end

if step == 'refresh' then
  redis.call('PEXPIRE', marker, ARGV[3])
  return 1
end

if step == 'switch' then
  local moves = { { shadowValue, KEYS[4] }, { shadowVersion, KEYS[5] } }
  for _, p in ipairs(moves) do
    -- UNLINK first: RENAME over an existing key would free the old
    -- collection synchronously, blocking Redis for a large one; UNLINK
    -- frees it in the background.
    redis.call('UNLINK', p[2])
    if redis.call('EXISTS', p[1]) == 1 then
      redis.call('RENAME', p[1], p[2])
    end
  end
  redis.call('DEL', marker)
  return 1
end

return redis.error_reply('unknown rebuild step ' .. tostring(step))
