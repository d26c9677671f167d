-- KEYS: meta, inbox. ARGV: first offset wanted, count.
-- Returns {epoch, head, entries} of a live session, or false when the session is gone; a
-- session met on another lineage takes its new epoch first (lineage.lua).
local meta = redis.call('HMGET', KEYS[1], 'epoch', 'head', 'rid')
if not meta[1] then return false end
local epoch = on_lineage(1, meta[1], meta[3])
local entries = redis.call('XRANGE', KEYS[2], ARGV[1] .. '-0', '+', 'COUNT', ARGV[2])
return {epoch, meta[2] or '0', entries}
