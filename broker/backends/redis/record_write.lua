-- KEYS: records hash, ids zset, collections zset, change-log partition.
-- ARGV: record id, data, collection, log maxlen, packed change for an existing record, packed
--       change for a new one (kind 'created'), and optionally the value the write expects.
-- Stores the record and appends the change that applies, atomically. Returns 1 when the record
-- is new, 0 when it existed, -1 (nothing written) when an expected value does not match.
if ARGV[7] and redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[7] then
  return -1
end
local created = redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if created == 1 then
  redis.call('ZADD', KEYS[2], 0, ARGV[1])
  redis.call('ZADD', KEYS[3], 0, ARGV[3])
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'c', ARGV[6])
else
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'c', ARGV[5])
end
return created
