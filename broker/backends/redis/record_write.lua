-- KEYS: records hash, ids zset, collections zset, change-log partition, the tenant's record usage
--       hash in this partition, the partition's backlog hash (changes not yet fanned out, per
--       tenant), the partition's seal, then the tenant's usage hashes of its other partitions
--       (none on Cluster, where the quotas given are this partition's share).
-- ARGV: record id, data, collection, log maxlen, packed change for an existing record, packed
--       change for a new one (kind 'created'), the tenant's record quota (count), its quota in
--       bytes, the tenant's change-log bound (changes not yet fanned out), the tenant, and
--       optionally the value the write expects.
-- Stores the record and appends the change that applies, atomically. Returns 1 when the record
-- is new, 0 when it existed; nothing is written and it returns -1 when an expected value does
-- not match, -2 or -3 when the tenant's record count or bytes would pass its quota, -4 when the
-- change-log partition is full, -5 when the tenant has its bound of changes not yet fanned out
-- (the bounds of changelog_append.lua), -6 when the partition is sealed (the caller's layout
-- is stale, see changelog_append.lua). The quota counts the usage of every hash given. The
-- usage hash (fields n: records, b: bytes of values) and the backlog change in the same step,
-- so they cannot drift.
if redis.call('EXISTS', KEYS[7]) == 1 then return -6 end
local old
if ARGV[11] then
  old = redis.call('HGET', KEYS[1], ARGV[1])
  if old ~= ARGV[11] then return -1 end
  old = string.len(old)
else
  -- A stored record is never empty (it is encoded JSON), so 0 means there is none.
  old = redis.call('HSTRLEN', KEYS[1], ARGV[1])
  if old == 0 then old = false end
end
local grow = string.len(ARGV[2]) - (old or 0)
local count, bytes = 0, 0
for k = 5, #KEYS do
  if k == 5 or k > 7 then
    local used = redis.call('HMGET', KEYS[k], 'n', 'b')
    count = count + (tonumber(used[1]) or 0)
    bytes = bytes + (tonumber(used[2]) or 0)
  end
end
if not old and count >= tonumber(ARGV[7]) then return -2 end
-- A write that does not grow the tenant's bytes passes even over a lowered quota.
if grow > 0 and bytes + grow > tonumber(ARGV[8]) then return -3 end
local entries = redis.call('XLEN', KEYS[4])
if entries >= tonumber(ARGV[4]) then return -4 end
-- A tenant's count above the log's length drifted (see changelog_append.lua): cut to it.
if math.min(tonumber(redis.call('HGET', KEYS[6], ARGV[10]) or '0'), entries) >= tonumber(ARGV[9]) then return -5 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if grow ~= 0 then redis.call('HINCRBY', KEYS[5], 'b', grow) end
redis.call('HINCRBY', KEYS[6], ARGV[10], 1)
if not old then
  redis.call('HINCRBY', KEYS[5], 'n', 1)
  redis.call('ZADD', KEYS[2], 0, ARGV[1])
  redis.call('ZADD', KEYS[3], 0, ARGV[3])
  redis.call('XADD', KEYS[4], '*', 'c', ARGV[6], 't', ARGV[10])
  return 1
end
redis.call('XADD', KEYS[4], '*', 'c', ARGV[5], 't', ARGV[10])
return 0
