-- KEYS: the lease of one change-log partition, or on a single server several (one reply each).
-- ARGV: consumer, ttl_ms[, 'renew'], the same for every key.
-- The consumer holds the partition for ttl_ms more when it held it or nobody did. Returns 1
-- when it already held it, 2 when it has just taken it (the last holder's pending changes are
-- now its own to finish first), 0 when another consumer holds it. With 'renew' it only extends
-- a lease it holds (1) and takes nothing (0). A ttl of 0 releases the partition when the
-- consumer holds it (returns 1) and takes nothing (returns 0 otherwise). With one key the
-- reply is that number; with several, the list of them in the order of KEYS.
local function hold(i)
  local holder = redis.call('GET', KEYS[i])
  if ARGV[2] == '0' then
    if holder == ARGV[1] then
      redis.call('DEL', KEYS[i])
      return 1
    end
    return 0
  end
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
    return 1
  end
  if holder or ARGV[3] == 'renew' then return 0 end
  redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
  return 2
end
if #KEYS == 1 then return hold(1) end
local out = {}
for i = 1, #KEYS do out[i] = hold(i) end
return out
