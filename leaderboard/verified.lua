-- verity leaderboard: record a verified projection.
--
-- KEYS[1] holds the token of the Verify pass under way, KEYS[2] is the
-- record that the projection is complete, KEYS[3] the board's sorted set,
-- KEYS[4] the record's companion (below), KEYS[5..] every version key of
-- the board (one hash, or its version buckets); all share the board's hash
-- tag.
-- ARGV[1] is the pass's token, ARGV[2] what to record after it: the time,
-- the identity of the database checked and the board's outbox table,
-- separated by spaces; ARGV[3] the number of users the pass checked.
--
-- The pass set KEYS[1] before it read anything. If Redis lost the board's
-- keys since (a restart without persistence, FLUSHALL), KEYS[1] is gone or
-- another pass replaced it, and nothing is recorded: the pages read before
-- the loss may be missing again. Returns 1 when recorded, 2 when the
-- sorted set or its version keys lost members during the pass (below), 3
-- when another pass's
-- marker, on this server, replaced this one's, 0 otherwise.
--
-- The record is "<token> <time> <identity> <outbox>". A client may run this script twice for
-- one call (go-redis resends it when the connection drops before the
-- reply): the second run finds KEYS[1] deleted by the first, and the token
-- in KEYS[2] tells that the record is this pass's, still in place.
--
-- KEYS[1] holds "<token> <replication id>" (verify_begin.lua): a server
-- whose id changed since (a replica promoted in a failover, which may
-- lack the pass's repairs) records nothing either. An empty id (INFO
-- refused to the user) is not compared.
local mine = ARGV[1] .. ' '
local info = redis.pcall('INFO', 'replication')
local id = ''
if type(info) == 'string' then
  id = string.match(info, 'master_replid:(%x+)') or ''
end
local marker = redis.call('GET', KEYS[1])
if not marker or string.sub(marker, 1, #mine) ~= mine or
    (string.sub(marker, #mine + 1) ~= '' and string.sub(marker, #mine + 1) ~= id) then
  local record = redis.call('GET', KEYS[2])
  if record and string.sub(record, 1, #mine) == mine then
    return 1
  end
  -- Another pass's marker on the same server: that pass began after this
  -- one, and replaced its marker (it records if it completes).
  if marker and string.sub(marker, 1, #mine) ~= mine and
      (id == '' or string.sub(marker, -#id) == id) then
    return 3
  end
  return 0
end
-- Each user the pass checked (ARGV[3]) is a member after it: current,
-- repaired, or overtaken by a newer write (the board never deletes a
-- user's row). A sorted set holding fewer lost members during the pass (a
-- DEL of it alone, its eviction) after the pass had found them current,
-- and is not recorded as complete.
if redis.call('ZCARD', KEYS[3]) < tonumber(ARGV[3] or '0') then
  return 2
end
-- So does each one's version (KEYS[5..]): fewer versions lost some the
-- pass had found current (a DEL or eviction of the version hash or a
-- bucket), and a user without one takes any redelivered older score.
local versions = 0
for i = 5, #KEYS do versions = versions + redis.call('HLEN', KEYS[i]) end
if #KEYS > 4 and versions < tonumber(ARGV[3] or '0') then
  return 2
end
redis.call('SET', KEYS[2], mine .. ARGV[2])
-- KEYS[4] holds the token and the sorted set's (KEYS[3]) size: readers
-- stop trusting the record once it holds fewer members (a DEL of it
-- alone, its eviction, also once new scores recreated it; a reader that
-- saw it smaller, also once they made it as large). It is written
-- for a board verified empty too ("<token> 0"), and readers take a record
-- without it as lost: an allkeys-* eviction can take it with the sorted
-- set and leave the record.
local held = redis.call('ZCARD', KEYS[3])
redis.call('SET', KEYS[4], ARGV[1] .. ' ' .. held)
redis.call('DEL', KEYS[1])
return 1
