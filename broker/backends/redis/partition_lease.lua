-- KEYS: the lease of one change-log partition. ARGV: consumer, ttl_ms[, 'renew'].
-- The consumer holds the partition for ttl_ms more when it held it or nobody did. Returns 1
-- when it already held it, 2 when it has just taken it (the last holder's pending changes are
-- now its own to finish first), 0 when another consumer holds it. With 'renew' it only extends
-- a lease it holds (1) and takes nothing (0). A ttl of 0 releases the partition when the
-- consumer holds it (returns 1) and takes nothing (returns 0 otherwise).
local holder = redis.call('GET', KEYS[1])
if ARGV[2] == '0' then
  if holder == ARGV[1] then
    redis.call('DEL', KEYS[1])
    return 1
  end
  return 0
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if holder or ARGV[3] == 'renew' then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 2
