-- KEYS: records hash, ids zset, collections zset, change-log partition, the tenant's record usage hash.
-- ARGV: record id, collection, log maxlen, packed change. Returns 1 when the record existed.
local size = redis.call('HSTRLEN', KEYS[1], ARGV[1])
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
-- Records stored before usage was counted are not in it: never count below zero.
if redis.call('HINCRBY', KEYS[5], 'n', -1) < 0 then redis.call('HSET', KEYS[5], 'n', 0) end
if redis.call('HINCRBY', KEYS[5], 'b', -size) < 0 then redis.call('HSET', KEYS[5], 'b', 0) end
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('ZREM', KEYS[3], ARGV[2]) end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*', 'c', ARGV[4])
return 1
