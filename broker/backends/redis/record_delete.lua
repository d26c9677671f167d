-- KEYS: records hash, ids zset, collections zset, change-log partition.
-- ARGV: record id, collection, log maxlen, packed change. Returns 1 when the record existed.
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('ZREM', KEYS[3], ARGV[2]) end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*', 'c', ARGV[4])
return 1
