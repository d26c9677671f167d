-- KEYS: the dead-letter list.
-- ARGV: the entry, how many entries to keep (the newest).
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
return 1
