-- KEYS: meta, wake channel. ARGV: publish command, the claiming worker's node ('' on Cluster).
-- Makes the caller the session's one live stream: a new generation, larger than every earlier
-- one of the session even after Redis lost it (it starts from the server clock in microseconds),
-- published as a 'T<generation>' wake. On a single node the session then names the claimer's
-- node, so of two streams that watched it at once the one that stays is the one woken for frames.
-- A session that no longer exists gets a bare 'T', which closes every stream it still has.
-- Returns {1 when the session had a stream before, the generation as a string or false}.
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call(ARGV[1], KEYS[2], 'T')
  return {0, false}
end
local previous = tonumber(redis.call('HGET', KEYS[1], 'gen') or '0')
local now = redis.call('TIME')
local generation = math.max(tonumber(now[1]) * 1000000 + tonumber(now[2]), previous + 1)
local text = string.format('%.0f', generation)
redis.call('HSET', KEYS[1], 'gen', text)
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'node', ARGV[2]) end
redis.call(ARGV[1], KEYS[2], 'T' .. text)
if previous > 0 then return {1, text} end
return {0, text}
