-- KEYS: the subscription's record hash, every subscription's ids, the subscriptions counted by tenant.
-- ARGV: id, the tenant (JSON, as in the record), the deployment's bound, the tenant's ('' for none),
-- then the record's field/value pairs. Returns 1 stored; 0 a subscription of that id exists; -1 the
-- deployment has its bound; -2 the tenant has its quota. Nothing changes unless 1: the counts and the
-- create are one step, so creates racing for the last place cannot both get it.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[3]) then
  return -1
end
if ARGV[4] ~= '' and tonumber(redis.call('HGET', KEYS[3], ARGV[2]) or '0') >= tonumber(ARGV[4]) then
  return -2
end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
return 1
