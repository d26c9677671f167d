-- KEYS: the lease of one change-log partition, the partition.
-- ARGV: consumer, consumer group, count.
-- A read of new changes fenced by the lease: only the consumer that holds the partition takes
-- changes from it. A read sent while the lease was held and run after it lapsed (a stall, a
-- network that held the command back) would otherwise take changes that the new holder never
-- sees, pending to a consumer that may be gone. Returns {0} when the caller does not hold the
-- lease (nothing taken), else {1, id of the newest entry ('0-0' for none), entries}: a caller
-- that found nothing waits for an entry after that id (XREAD, which takes nothing) and reads
-- again through this script.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0} end
local got = redis.call('XREADGROUP', 'GROUP', ARGV[2], ARGV[1], 'COUNT', ARGV[3], 'STREAMS', KEYS[2], '>')
local entries = {}
if got and got[1] then
  -- Redis answers {{stream, entries}}; fakeredis {stream, entries}.
  if type(got[1]) == 'table' then entries = got[1][2] or {} else entries = got[2] or {} end
end
local newest = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local last = '0-0'
if newest[1] then last = newest[1][1] end
return {1, last, entries}
