-- KEYS: the key's record hash, its digest's key, every key's ids, its tenant's ids.
-- ARGV: id, digest, then the record's field/value pairs. Stores the key and returns 1, or
-- returns 0 and changes nothing when a key of that id or that digest exists.
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'h', ARGV[2], unpack(ARGV, 3))
redis.call('SET', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], 0, ARGV[1])
redis.call('ZADD', KEYS[4], 0, ARGV[1])
return 1
