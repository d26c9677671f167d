-- KEYS: meta. ARGV: field, value pairs. Updates a live session only (never resurrects one).
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
