-- KEYS: the tenant's places of one kind (zset holder -> expiry, ms of the server clock).
-- ARGV: ttl_ms, holder... Renews each holder's place (re-adding one that lapsed or was released
-- under it: the holder still holds its stream).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
