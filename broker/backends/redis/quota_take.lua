-- KEYS: a tenant's bucket, of publishing or of webhook verifications (hash: tokens `k`, time of the
-- last take `t` in µs of the server clock).
-- ARGV: count, rate (tokens a second), burst (capacity). One clock, Redis's, for every worker.
-- Returns 0 when `count` tokens were taken, else the µs until they would be there (nothing taken).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local count, rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'k', 't')
local tokens, last = tonumber(state[1]), tonumber(state[2])
if not tokens or not last then
  tokens, last = burst, now
end
tokens = math.min(burst, tokens + math.max(now - last, 0) * rate / 1000000)
local wait = 0
if tokens < count then
  wait = math.ceil((count - tokens) * 1000000 / rate)
else
  tokens = tokens - count
end
redis.call('HSET', KEYS[1], 'k', string.format('%.6f', tokens), 't', string.format('%.0f', now))
-- A full bucket is the same as none: the key lives as long as refilling it takes.
redis.call('PEXPIRE', KEYS[1], math.ceil(burst * 1000 / rate) + 1000)
return wait
