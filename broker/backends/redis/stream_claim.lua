-- KEYS: meta, wake channel. ARGV: publish command, owner.
-- Makes ARGV[2] the session's one live stream and tells the previous one (a 'T<owner>' wake).
-- Returns 1 when the session had a stream before.
local had = 0
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HEXISTS', KEYS[1], 'owner') == 1 then had = 1 end
  redis.call('HSET', KEYS[1], 'owner', ARGV[2])
end
redis.call(ARGV[1], KEYS[2], 'T' .. ARGV[2])
return had
