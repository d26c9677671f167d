-- KEYS: meta, inbox. ARGV: first offset wanted, count.
-- Returns {epoch, head, entries} of a live session, or false when the session is gone.
local meta = redis.call('HMGET', KEYS[1], 'epoch', 'head')
if not meta[1] then return false end
local entries = redis.call('XRANGE', KEYS[2], ARGV[1] .. '-0', '+', 'COUNT', ARGV[2])
return {meta[1], meta[2] or '0', entries}
