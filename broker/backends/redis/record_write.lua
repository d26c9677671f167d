-- KEYS: records hash, ids zset, collections zset, change-log partition.
-- ARGV: record id, data, collection, log maxlen, packed change. Returns 1 when the record is new.
local created = redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if created == 1 then
  redis.call('ZADD', KEYS[2], 0, ARGV[1])
  redis.call('ZADD', KEYS[3], 0, ARGV[3])
end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'c', ARGV[5])
return created
