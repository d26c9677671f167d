-- KEYS: meta, subs, inbox. ARGV: ttl_ms, grace_ms, now_ms, refresh_ms[, principal].
-- Restarts the idle clock, only for the principal when one is given. Returns {tenant, uri...}
-- (the session's subscriptions) when the registry deadline and the expiry of the sets the
-- session is in are due for a refresh, 1 when the session is alive and they are fresh enough,
-- 0 when the session is gone (or belongs to another principal).
if ARGV[5] and redis.call('HGET', KEYS[1], 'principal') ~= ARGV[5] then return 0 end
if redis.call('PEXPIRE', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[1]) + tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[3], ARGV[1])
local last = tonumber(redis.call('HGET', KEYS[1], 'reg') or '0')
if tonumber(ARGV[3]) - last >= tonumber(ARGV[4]) then
  redis.call('HSET', KEYS[1], 'reg', ARGV[3])
  local due = redis.call('SMEMBERS', KEYS[2])
  table.insert(due, 1, redis.call('HGET', KEYS[1], 'tenant'))
  return due
end
return 1
