-- KEYS: the subscription's record hash.
-- ARGV: 'fail', 'set' or 'advance', then (for 'advance') the session and epoch (JSON) the record must
-- still have, then field/value pairs. Sets them and returns 1, or returns 0 for a record that is gone
-- (or, for 'advance', that moved to another session or epoch since: a stale worker's position never
-- lands on the record of a newer subscription). 'fail' keeps a stored failed_since that is not null
-- (the first failure's).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local first = 2
if ARGV[1] == 'advance' then
  if redis.call('HGET', KEYS[1], 'session') ~= ARGV[2] or redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[3] then
    return 0
  end
  first = 4
end
if ARGV[1] == 'fail' then
  local since = redis.call('HGET', KEYS[1], 'failed_since')
  if since and since ~= 'null' then
    redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
    return 1
  end
end
redis.call('HSET', KEYS[1], unpack(ARGV, first))
return 1
