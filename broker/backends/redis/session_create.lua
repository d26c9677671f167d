-- KEYS: meta, subs, inbox. ARGV: ttl_ms, then field, value pairs of the record.
-- A session id is random, but a reused one must never inherit another session's state.
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
local fields = {}
for i = 2, #ARGV do fields[#fields + 1] = ARGV[i] end
if LINEAGE ~= '' then fields[#fields + 1] = 'rid' fields[#fields + 1] = LINEAGE end
-- When the session began, by the server's clock, in milliseconds ('born', inbox_append.lua).
local now = redis.call('TIME')
fields[#fields + 1] = 'born'
fields[#fields + 1] = now[1] .. string.format('%03d', math.floor(tonumber(now[2]) / 1000))
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
