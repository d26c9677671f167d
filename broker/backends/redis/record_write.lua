-- KEYS: records hash, ids zset, collections zset, change-log partition, its backlog hash.
-- ARGV: record id, data, collection, log maxlen, packed change for an existing record, packed
--       change for a new one (kind 'created'), tenant max, tenant, and optionally the value the
--       write expects.
-- Stores the record and appends the change that applies, atomically. Returns 1 when the record
-- is new, 0 when it existed; nothing is written and it returns -1 when an expected value does
-- not match, -2 when the log is full, -3 when the tenant has tenant max changes not yet fanned
-- out (the bounds of changelog_append.lua).
if ARGV[9] and redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[9] then
  return -1
end
if redis.call('XLEN', KEYS[4]) >= tonumber(ARGV[4]) then return -2 end
if tonumber(redis.call('HGET', KEYS[5], ARGV[8]) or '0') >= tonumber(ARGV[7]) then return -3 end
local created = redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if created == 1 then
  redis.call('ZADD', KEYS[2], 0, ARGV[1])
  redis.call('ZADD', KEYS[3], 0, ARGV[3])
  redis.call('XADD', KEYS[4], '*', 'c', ARGV[6], 't', ARGV[8])
else
  redis.call('XADD', KEYS[4], '*', 'c', ARGV[5], 't', ARGV[8])
end
redis.call('HINCRBY', KEYS[5], ARGV[8], 1)
return created
