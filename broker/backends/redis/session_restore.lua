-- KEYS: meta, subs, inbox. ARGV: ttl_ms, grace_ms, subscription count n, n URIs, then
-- field, value pairs of the record. Re-creates a session the store lost, with an empty inbox;
-- returns 0 and changes nothing when the session exists.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[2], KEYS[3])
local n = tonumber(ARGV[3])
local fields = {}
for i = 4 + n, #ARGV do fields[#fields + 1] = ARGV[i] end
if LINEAGE ~= '' then fields[#fields + 1] = 'rid' fields[#fields + 1] = LINEAGE end
-- When the session began, by the server's clock, in milliseconds ('born', inbox_append.lua).
local now = redis.call('TIME')
fields[#fields + 1] = 'born'
fields[#fields + 1] = now[1] .. string.format('%03d', math.floor(tonumber(now[2]) / 1000))
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
for i = 4, 3 + n do redis.call('SADD', KEYS[2], ARGV[i]) end
if n > 0 then redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[1]) + tonumber(ARGV[2])) end
return 1
