-- KEYS: subs, wake channel. ARGV: uri, publish command.
-- Removes the URI from the session's set and tells the session's stream ('S-<uri>').
if redis.call('SREM', KEYS[1], ARGV[1]) == 1 then
  redis.call(ARGV[2], KEYS[2], 'S-' .. ARGV[1])
end
return 1
