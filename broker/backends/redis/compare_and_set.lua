-- KEYS: one string key. ARGV: the value it is expected to hold, the new value.
-- Sets the new value only if the key holds the expected one (the change log's layouts, which
-- a switch and the workers that finish its drain both change). Returns 1 when it was set.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
