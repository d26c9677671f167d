-- KEYS: meta, subs, inbox of session 1, then of session 2, ... (three per session; in Redis
-- Cluster one session a call, on a single node many).
-- ARGV: ttl_ms, grace_ms, now_ms, refresh_ms[, principal].
-- Per session, restarts the idle clock, only for the principal when one is given. Returns, per
-- session, {tenant, uri...} (its subscriptions) when the registry deadline and the expiry of the
-- sets it is in are due for a refresh, 1 when it is alive and they are fresh enough, 0 when it
-- is gone (or belongs to another principal).
local results = {}
local ttl = tonumber(ARGV[1])
local subs_ttl = ttl + tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local refresh = tonumber(ARGV[4])
for s = 1, #KEYS / 3 do
  local k = 3 * s
  local result = 0
  if (not ARGV[5] or redis.call('HGET', KEYS[k - 2], 'principal') == ARGV[5])
      and redis.call('PEXPIRE', KEYS[k - 2], ttl) == 1 then
    redis.call('PEXPIRE', KEYS[k - 1], subs_ttl)
    redis.call('PEXPIRE', KEYS[k], ttl)
    local last = tonumber(redis.call('HGET', KEYS[k - 2], 'reg') or '0')
    if now - last >= refresh then
      redis.call('HSET', KEYS[k - 2], 'reg', ARGV[3])
      result = redis.call('SMEMBERS', KEYS[k - 1])
      table.insert(result, 1, redis.call('HGET', KEYS[k - 2], 'tenant'))
    else
      result = 1
    end
  end
  results[s] = result
end
return results
