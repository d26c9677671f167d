-- KEYS: meta, subs, wake channel. ARGV: uri, grace_ms, publish command.
-- Returns the subscription count, 0 when the session is gone. Tells the session's stream
-- ('S+<uri>') so it keeps its copy of the set for restoring a lost session.
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then return 0 end
redis.call('SADD', KEYS[2], ARGV[1])
-- The set outlives the record by a grace period so the expiry sweep can still clean the index.
redis.call('PEXPIRE', KEYS[2], ttl + tonumber(ARGV[2]))
redis.call(ARGV[3], KEYS[3], 'S+' .. ARGV[1])
return redis.call('SCARD', KEYS[2])
