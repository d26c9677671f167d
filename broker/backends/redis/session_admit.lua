-- KEYS: the tenant's session set (zset sid -> registry deadline, see sessions.Lifetimes).
-- ARGV: now (s), limit, sid, deadline, derived_ms. Adds the session unless the tenant has
-- `limit` sessions whose deadline is still ahead (a deadline is an upper bound of expiry, so a
-- session past it is dead whatever the sweep did). Returns -1 when added, else the live count.
local live = redis.call('ZCOUNT', KEYS[1], '(' .. ARGV[1], '+inf')
if live >= tonumber(ARGV[2]) then return live end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return -1
