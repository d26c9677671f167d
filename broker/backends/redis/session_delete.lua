-- KEYS: meta, subs, inbox. Returns {tenant, uri...} of the ended session, or false when unknown.
local tenant = redis.call('HGET', KEYS[1], 'tenant')
if not tenant then return false end
local out = redis.call('SMEMBERS', KEYS[2])
table.insert(out, 1, tenant)
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return out
