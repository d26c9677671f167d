-- KEYS: for each change-log partition read, two keys: its lease, the partition.
-- ARGV: consumer, consumer group, count (in all: a batch is at most that long, however many
-- partitions it reads; partitions after the count is reached are not read this time).
-- A read of new changes fenced by the lease: only the consumer that holds a partition takes
-- changes from it. A read sent while the lease was held and run after it lapsed (a stall, a
-- network that held the command back) would otherwise take changes that the new holder never
-- sees, pending to a consumer that may be gone. Several partitions in one call on a single
-- server (one per call on Cluster). Returns, per partition, {0} when the caller does not hold
-- the lease (nothing taken), else {1, id of the newest entry ('0-0' for none), entries}: a
-- caller that found nothing waits for an entry after that id (XREAD, which takes nothing) and
-- reads again through this script.
local out = {}
local remaining = tonumber(ARGV[3])
for p = 1, #KEYS / 2 do
  if redis.call('GET', KEYS[2 * p - 1]) ~= ARGV[1] then
    out[p] = {0}
  elseif remaining <= 0 then
    out[p] = {1, '0-0', {}}
  else
    local got = redis.call('XREADGROUP', 'GROUP', ARGV[2], ARGV[1], 'COUNT', remaining, 'STREAMS', KEYS[2 * p], '>')
    local entries = got and got[1] and got[1][2] or {}
    local last = '0-0'
    remaining = remaining - #entries
    if entries[1] then
      last = entries[#entries][1]
    else
      local newest = redis.call('XREVRANGE', KEYS[2 * p], '+', '-', 'COUNT', 1)
      if newest[1] then last = newest[1][1] end
    end
    out[p] = {1, last, entries}
  end
end
return out
