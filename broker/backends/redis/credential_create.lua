-- KEYS: the key's record hash, its digest's key, every key's ids, its tenant's ids, and (for a key
-- made with another key) the maker's record hash.
-- ARGV: id, digest, then the record's field/value pairs. Stores the key and returns 1; returns 0
-- and changes nothing when a key of that id or that digest exists, -1 when the maker is gone or
-- revoked (checked in the step that stores, so no key is made after its maker's revocation).
if KEYS[5] and (redis.call('EXISTS', KEYS[5]) == 0 or redis.call('HEXISTS', KEYS[5], 'r') == 1) then
  return -1
end
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'h', ARGV[2], unpack(ARGV, 3))
redis.call('SET', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], 0, ARGV[1])
redis.call('ZADD', KEYS[4], 0, ARGV[1])
return 1
