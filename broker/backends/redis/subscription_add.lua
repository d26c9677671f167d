-- KEYS: meta, subs, wake channel. ARGV: uri, grace_ms, publish command, limit (0: none).
-- Returns the subscription count, 0 when the session is gone, -1 when a new URI would pass
-- the limit (nothing changed). Tells the session's stream ('S+<uri>') so it keeps its copy of
-- the set for restoring a lost session.
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then return 0 end
local limit = tonumber(ARGV[4])
if limit > 0 and redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 0 and redis.call('SCARD', KEYS[2]) >= limit then
  return -1
end
redis.call('SADD', KEYS[2], ARGV[1])
-- The set outlives the record by a grace period so the expiry sweep can still clean the index.
redis.call('PEXPIRE', KEYS[2], ttl + tonumber(ARGV[2]))
redis.call(ARGV[3], KEYS[3], 'S+' .. ARGV[1])
return redis.call('SCARD', KEYS[2])
