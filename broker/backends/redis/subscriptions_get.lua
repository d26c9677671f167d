-- KEYS: meta, subs. The URIs of a live session (the set alone may outlive an expired record).
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
return redis.call('SMEMBERS', KEYS[2])
