-- KEYS: the registry of live fan-out consumers (zset; score: when the entry lapses, server ms).
-- ARGV: consumer, ttl_ms (0 removes the consumer).
-- Registers the consumer for ttl_ms more by the server's clock, forgets entries that lapsed,
-- and returns how many consumers are live: each takes its share of the partitions.
if ARGV[2] == '0' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return redis.call('ZCARD', KEYS[1])
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
