-- KEYS: the subscription's record hash, every subscription's ids, the subscriptions counted by tenant.
-- ARGV: id; a time (or ''): only if the record's lease expires by then; a credential (JSON, or ''):
-- only if the record is still bound to it. Returns the record's session (JSON) when it was removed,
-- else false: a refresh that came in after the caller read the record keeps it.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return false
end
if ARGV[2] ~= '' and tonumber(redis.call('HGET', KEYS[1], 'expires_at')) > tonumber(ARGV[2]) then
  return false
end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'credential') ~= ARGV[3] then
  return false
end
local session = redis.call('HGET', KEYS[1], 'session')
local tenant = redis.call('HGET', KEYS[1], 'tenant')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[1])
if tenant and redis.call('HINCRBY', KEYS[3], tenant, -1) <= 0 then
  redis.call('HDEL', KEYS[3], tenant)
end
return session
