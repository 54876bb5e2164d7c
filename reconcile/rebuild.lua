-- verity reconcile: rebuild a collection into shadow keys, then switch.
--
-- KEYS (one hash tag, so one Redis Cluster slot): 1 marker, 2 shadow value,
-- 3 shadow layout, 4 live value, 5 live layout, 6 live unbucketed version
-- hash, 7 shadow unbucketed version hash, 8 copy count (the gate's count of
-- the copy's writes, field "rows", and of the members and versions every
-- shadow write created, fields "members" and "versions"), 9 switched (the token of the last
-- rebuild that switched, briefly), then four runs of version buckets: the
-- live buckets of layout L, the shadow buckets of layout S, the shadow
-- buckets of layout M, the live buckets of layout M, and last a key that
-- never exists (so that Redis Cluster refuses a step on a migrating slot
-- before it runs: see rebuildProbeKey).
-- ARGV: 1 step, 2 the rebuild's token, 3 the marker TTL in milliseconds
-- (switch: the TTL of the switched key),
-- 4 L, the live layout the caller read, 5 S, the shadow layout the caller
-- read (both "0" when the layout key is absent), 6 M, the rebuild's layout
-- (bucket counts as canonical decimals; "0" means one version hash), 7 the
-- number of live buckets passed: L, or every possible bucket when L is
-- "missing" (no layout key, values but no unbucketed version hash: a
-- bucketed collection that lost its layout key, whose bucket count is
-- unknown; bucket keys are named by index alone, so these cover any),
-- 8 the number of rows the copy sent (switch only), 9 the number of shadow
-- buckets passed: S, or every possible bucket when a start or an abort
-- finds a shadow layout key holding no bucket count (a hand edit).
--
-- Every step may run twice with the same token: a client resends a
-- command whose reply it lost (go-redis: MaxRetries), after Redis ran it.
-- The rerun must give the first run's answer and undo nothing.
--
-- start:   refuse (0) if another rebuild's marker exists; 1, touching
--          nothing, if the marker is ours already (a rerun: the shadow
--          may hold gate writes since). Otherwise clear leftover shadow
--          keys (of layouts S and M) and copy count, record M as the shadow
--          layout and set the marker, in one step, so that no gate write
--          dual-written after the marker appears can be cleared away, and
--          so that the gate dual-writes in layout M from then on.
-- refresh: extend the marker's TTL if it is still ours (1), else 0 (a
--          rerun extends it again).
-- switch:  if the marker is still ours and the copy count is ARGV[8],
--          replace the live keys by the shadow keys — value, every version
--          bucket of layout M (the live versions of layout L, or of any
--          layout when L is "missing", are removed first) and the layout
--          key, set to M ("0" included) — and remove the marker and the
--          count, atomically: readers and the gate see the old projection,
--          then the new one, never a half-built one or a layout key that
--          disagrees with the versions. A shadow key that was never created
--          means it would be empty, so the live key is just removed. It
--          leaves the token in the switched key for ARGV[3] ms: a rerun,
--          which finds the marker gone and the layouts changed, answers 1
--          from it before anything else.
--          Returns 1, 0 if the marker is gone or not ours, or 3 if the
--          count is not ARGV[8] or the shadow holds fewer values or
--          versions than that, or than the shadow writes created (nothing
--          is touched either way). The count
--          changes in the script that writes the copy's rows, so Redis keeps
--          or loses both together: a failover to a replica that missed some
--          of the copy, or a restart from a snapshot taken mid-copy, can
--          keep the marker but not a complete count, and that shadow must
--          not replace the live keys.
-- abort:   remove the marker if it is ours, and the shadow keys and copy
--          count if no other rebuild owns them (marker ours or gone): 1,
--          or 0 if another rebuild holds the marker (nothing is touched).
--          A rerun finds the marker gone and nothing of ours left, or
--          another rebuild's marker, which it leaves alone.
-- Any step but a switch's rerun returns 2, touching nothing, when the
-- stored layouts are no longer L and S (a gate recorded the layout of an
-- empty collection meanwhile, or a rerun's first run changed them): the
-- caller reads them again and retries.

local step, token = ARGV[1], ARGV[2]
local L, S, M = ARGV[4], ARGV[5], ARGV[6]
local nL, nS, nM = tonumber(ARGV[7]), tonumber(ARGV[9]), tonumber(M)
local marker, shadowValue, shadowLayout = KEYS[1], KEYS[2], KEYS[3]
local liveValue, liveLayout = KEYS[4], KEYS[5]
local liveFlat, shadowFlat = KEYS[6], KEYS[7]
local copied, switched = KEYS[8], KEYS[9]
local oldLive, oldShadow = 10, 10 + nL
local newShadow = oldShadow + nS
local newLive = newShadow + nM

-- unlink removes KEYS[first .. first+n-1] in slices, since unpack of many
-- thousands of values overflows Lua's stack.
local function unlink(first, n)
  local i = first
  while i < first + n do
    local j = math.min(i + 999, first + n - 1)
    redis.call('UNLINK', unpack(KEYS, i, j))
    i = j + 1
  end
end

local function stored(key)
  return redis.call('GET', key) or '0'
end

-- storedLive reads the live layout as the caller does: "missing" for
-- values without a layout key or an unbucketed version hash.
local function storedLive()
  local s = redis.call('GET', liveLayout)
  if s then return s end
  if redis.call('EXISTS', liveFlat) == 0 and redis.call('EXISTS', liveValue) == 1 then
    return 'missing'
  end
  return '0'
end

-- A rerun of a switch that ran: the marker is gone and the layouts
-- changed, so only the switched key can tell.
if step == 'switch' and redis.call('GET', switched) == token then
  return 1
end

if stored(shadowLayout) ~= S or (step == 'switch' and storedLive() ~= L) then
  return 2
end

if step == 'start' then
  local current = redis.call('GET', marker)
  if current == token then return 1 end -- a rerun
  if current then return 0 end
  redis.call('UNLINK', shadowValue, shadowFlat, copied)
  unlink(oldShadow, nS)
  unlink(newShadow, nM)
  redis.call('SET', shadowLayout, M)
  redis.call('SET', marker, token, 'PX', ARGV[3])
  return 1
end

local current = redis.call('GET', marker)

if step == 'abort' then
  if current and current ~= token then return 0 end
  redis.call('UNLINK', marker, shadowValue, shadowLayout, shadowFlat, copied)
  unlink(oldShadow, nS)
  unlink(newShadow, nM)
  return 1
end

if current ~= token then return 0 end

if step == 'refresh' then
  redis.call('PEXPIRE', marker, ARGV[3])
  return 1
end

if step == 'switch' then
  if S ~= M then
    return redis.error_reply('rebuild shadow layout ' .. S .. ' is not the rebuild\'s ' .. M)
  end
  -- Redis lost copy writes (and their counts) but kept the marker: this
  -- shadow would drop members the live keys still hold.
  if (redis.call('HGET', copied, 'rows') or '0') ~= ARGV[8] then
    return 3
  end
  -- The count survives a loss of the shadow keys alone (their eviction
  -- under an allkeys-* policy): every row copied is a member (the gate
  -- never removes one), so a shadow holding fewer values or versions than
  -- rows copied lost some, and must not replace the live keys.
  local rows = tonumber(ARGV[8])
  local t = redis.call('TYPE', shadowValue)
  t = t.ok or t
  local held = 0
  if t == 'zset' then held = redis.call('ZCARD', shadowValue)
  elseif t == 'hash' then held = redis.call('HLEN', shadowValue) end
  local versions = 0
  if nM == 0 then
    versions = redis.call('HLEN', shadowFlat)
  else
    for b = 0, nM - 1 do versions = versions + redis.call('HLEN', KEYS[newShadow + b]) end
  end
  -- Dual-written new members can make up for lost copied ones: every
  -- shadow write counts what it creates, and the shadow must still hold
  -- as many members and versions as were created in it.
  local created = tonumber(redis.call('HGET', copied, 'members') or '0')
  local createdVersions = tonumber(redis.call('HGET', copied, 'versions') or '0')
  if held < rows or versions < rows or held < created or versions < createdVersions then
    return 3
  end
  -- UNLINK first: RENAME over an existing key would free the old
  -- collection synchronously, blocking Redis for a large one; UNLINK
  -- frees it in the background.
  redis.call('UNLINK', liveValue, liveFlat)
  unlink(oldLive, nL)
  local function move(from, to)
    redis.call('UNLINK', to)
    if redis.call('EXISTS', from) == 1 then
      redis.call('RENAME', from, to)
    end
  end
  move(shadowValue, liveValue)
  if nM == 0 then
    move(shadowFlat, liveFlat)
  else
    for b = 0, nM - 1 do
      move(KEYS[newShadow + b], KEYS[newLive + b])
    end
    redis.call('UNLINK', shadowFlat)
  end
  -- M, "0" included: every collection records its layout.
  redis.call('SET', liveLayout, M)
  redis.call('DEL', shadowLayout, marker, copied)
  redis.call('SET', switched, token, 'PX', ARGV[3])
  return 1
end

return redis.error_reply('unknown rebuild step ' .. tostring(step))
