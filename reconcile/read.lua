-- verity reconcile: read the versions of a page of members of a collection
-- whose versions are spread over buckets.
--
-- KEYS: value key, layout key, unbucketed version hash, then the version
-- buckets the page touches (one hash tag, so one Redis Cluster slot).
-- ARGV[1] is the reader's layout (its bucket count as a canonical decimal),
-- then two arguments per member: the KEYS index of its bucket, the member.
--
-- The layout is checked first, by the gate's rule: the layout key, or "0"
-- when it is absent but the collection holds values or unbucketed versions
-- (written before layout keys existed), or any layout for an empty
-- collection. A mismatch returns the error "VERITY_LAYOUT live 1 <stored>":
-- versions read from the wrong buckets would all look absent.
-- Returns one element per member: its version, or nil.

local want = ARGV[1]
local layout = redis.call('GET', KEYS[2])
if not layout and redis.call('EXISTS', KEYS[1], KEYS[3]) > 0 then
  layout = '0'
end
if layout and layout ~= want then
  return redis.error_reply('VERITY_LAYOUT live 1 ' .. layout)
end
local out = {}
for a = 2, #ARGV, 2 do
  out[#out + 1] = redis.call('HGET', KEYS[tonumber(ARGV[a])], ARGV[a + 1])
end
return out
