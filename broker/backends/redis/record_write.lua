-- KEYS: records hash, ids zset, collections zset, change-log partition, the tenant's record usage hash.
-- ARGV: record id, data, collection, log maxlen, packed change for an existing record, packed
--       change for a new one (kind 'created'), the tenant's record quota (count), its quota in
--       bytes, and optionally the value the write expects.
-- Stores the record and appends the change that applies, atomically. Returns 1 when the record
-- is new, 0 when it existed, -1 (nothing written) when an expected value does not match, -2 or
-- -3 (nothing written) when the tenant's record count or bytes would pass its quota. The usage
-- hash (fields n: records, b: bytes of values) changes in the same step, so it cannot drift.
local old
if ARGV[9] then
  old = redis.call('HGET', KEYS[1], ARGV[1])
  if old ~= ARGV[9] then return -1 end
  old = string.len(old)
else
  -- A stored record is never empty (it is encoded JSON), so 0 means there is none.
  old = redis.call('HSTRLEN', KEYS[1], ARGV[1])
  if old == 0 then old = false end
end
local grow = string.len(ARGV[2]) - (old or 0)
local used = redis.call('HMGET', KEYS[5], 'n', 'b')
if not old and (tonumber(used[1]) or 0) >= tonumber(ARGV[7]) then return -2 end
-- A write that does not grow the tenant's bytes passes even over a lowered quota.
if grow > 0 and (tonumber(used[2]) or 0) + grow > tonumber(ARGV[8]) then return -3 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if grow ~= 0 then redis.call('HINCRBY', KEYS[5], 'b', grow) end
if not old then
  redis.call('HINCRBY', KEYS[5], 'n', 1)
  redis.call('ZADD', KEYS[2], 0, ARGV[1])
  redis.call('ZADD', KEYS[3], 0, ARGV[3])
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'c', ARGV[6])
  return 1
end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'c', ARGV[5])
return 0
