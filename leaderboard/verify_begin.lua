-- verity leaderboard: start a Verify pass.
--
-- KEYS[1] holds the token of the Verify pass under way; ARGV[1] is the
-- pass's token. It is stored with the server's replication id: a replica
-- promoted since (a failover, which may have lost the pass's repairs
-- while keeping this key) has another, and verified.lua then records
-- nothing. A user refused INFO stores no id, which is not compared.
local info = redis.pcall('INFO', 'replication')
local id = ''
if type(info) == 'string' then
  id = string.match(info, 'master_replid:(%x+)') or ''
end
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. id)
return 1
