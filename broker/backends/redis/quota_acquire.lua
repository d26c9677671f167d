-- KEYS: the tenant's places of one kind (zset holder -> expiry, ms of the server clock).
-- ARGV: holder, limit, ttl_ms. Returns 1 when the holder holds a place now (new or renewed),
-- 0 when the tenant holds `limit` live places already (nothing changed). Lapsed places are
-- dropped first, so a killed worker's places stop counting by themselves.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
