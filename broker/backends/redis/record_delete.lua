-- KEYS: records hash, ids zset, collections zset, change-log partition, the tenant's record usage
--       hash in this partition, the partition's backlog hash, the partition's seal.
-- ARGV: record id, collection, log maxlen, packed change, the tenant's change-log bound, the tenant.
-- Returns 1 when the record existed (deleted, its change appended), 0 when it did not; -4 or -5
-- (nothing deleted) when the log or the tenant's share of it is full, -6 when the partition is
-- sealed (see record_write.lua).
if redis.call('EXISTS', KEYS[7]) == 1 then return -6 end
local size = redis.call('HSTRLEN', KEYS[1], ARGV[1])
if size == 0 then return 0 end
local entries = redis.call('XLEN', KEYS[4])
if entries >= tonumber(ARGV[3]) then return -4 end
-- A tenant's count above the log's length drifted (see changelog_append.lua): cut to it.
if math.min(tonumber(redis.call('HGET', KEYS[6], ARGV[6]) or '0'), entries) >= tonumber(ARGV[5]) then return -5 end
redis.call('HDEL', KEYS[1], ARGV[1])
-- Records stored before usage was counted are not in it: never count below zero.
if redis.call('HINCRBY', KEYS[5], 'n', -1) < 0 then redis.call('HSET', KEYS[5], 'n', 0) end
if redis.call('HINCRBY', KEYS[5], 'b', -size) < 0 then redis.call('HSET', KEYS[5], 'b', 0) end
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('ZREM', KEYS[3], ARGV[2]) end
redis.call('XADD', KEYS[4], '*', 'c', ARGV[4], 't', ARGV[6])
redis.call('HINCRBY', KEYS[6], ARGV[6], 1)
return 1
