-- KEYS: the key's record hash. ARGV: the revocation's time (Unix seconds).
-- Returns 1 when it revoked the key now, 0 when it was revoked already (its first time stays),
-- -1 when there is no such key.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
end
if redis.call('HEXISTS', KEYS[1], 'r') == 1 then
  return 0
end
redis.call('HSET', KEYS[1], 'r', ARGV[1])
return 1
