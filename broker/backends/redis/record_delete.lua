-- KEYS: records hash, ids zset, collections zset, change-log partition, its backlog hash.
-- ARGV: record id, collection, log maxlen, packed change, tenant max, tenant.
-- Returns 1 when the record existed (deleted, its change appended), 0 when it did not; -2 or
-- -3 (nothing deleted) when the log or the tenant's share of it is full (see record_write.lua).
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
if redis.call('XLEN', KEYS[4]) >= tonumber(ARGV[3]) then return -2 end
if tonumber(redis.call('HGET', KEYS[5], ARGV[6]) or '0') >= tonumber(ARGV[5]) then return -3 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('ZREM', KEYS[3], ARGV[2]) end
redis.call('XADD', KEYS[4], '*', 'c', ARGV[4], 't', ARGV[6])
redis.call('HINCRBY', KEYS[5], ARGV[6], 1)
return 1
