-- KEYS: records hash, ids zset, collections zset, the tenant's record usage hash (all of the
--       partition the records move to).
-- ARGV: collection, then record id, data for each record.
-- Stores records moved from their collection's partition in an older layout (a switch of the
-- change log's partitions), counting each in the usage once: a move cut short and run again
-- counts nothing twice. Returns how many records were new here.
local new = 0
for i = 2, #ARGV, 2 do
  local old = redis.call('HSTRLEN', KEYS[1], ARGV[i])
  local size = string.len(ARGV[i + 1])
  if old == 0 then
    new = new + 1
    redis.call('HINCRBY', KEYS[4], 'n', 1)
  end
  if size ~= old then redis.call('HINCRBY', KEYS[4], 'b', size - old) end
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[2], 0, ARGV[i])
end
if #ARGV > 1 then redis.call('ZADD', KEYS[3], 0, ARGV[1]) end
return new
