-- KEYS: meta, subs. ARGV: uri, grace_ms. Returns the subscription count, 0 when the session is gone.
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then return 0 end
redis.call('SADD', KEYS[2], ARGV[1])
-- The set outlives the record by a grace period so the expiry sweep can still clean the index.
redis.call('PEXPIRE', KEYS[2], ttl + tonumber(ARGV[2]))
return redis.call('SCARD', KEYS[2])
