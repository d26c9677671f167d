-- Prepended to the scripts that number a session's frames or hand out its head (scripts.py).
-- LINEAGE is the server's replication id (INFO's master_replid): a replica promoted to master
-- takes a new one, and so does a server restarted from its files, so an unchanged id means this
-- server's data is the history the session's frames were numbered in, nothing rolled back. A
-- session's hash keeps the lineage its ids were given in ('rid'). Met on another lineage, the
-- session may have lost frames that a client already saw (written to a master that was then
-- replaced, or after the last fsync of a restarted one), and its next offsets would name other
-- changes with the same ids: so its epoch changes, to its data generation (the hex digits before
-- any 'r') followed by 'r' and this lineage. Cursors of the old epoch are then gaps, and no id is
-- ever given to two changes. '' where the server has no INFO (fakeredis): nothing is fenced.
local LINEAGE = ''
do
  local info = redis.pcall('INFO', 'replication')
  if type(info) == 'string' then LINEAGE = string.match(info, 'master_replid:(%x+)') or '' end
end

-- The session whose hash is KEYS[meta], read with epoch `epoch` and lineage `rid` (false when
-- the hash has none: a session from before lineages were kept), brought onto this lineage;
-- returns its epoch from now on.
local function on_lineage(meta, epoch, rid)
  if rid == LINEAGE or LINEAGE == '' then return epoch end
  if rid then
    epoch = (string.match(epoch, '^%x+') or epoch) .. 'r' .. string.sub(LINEAGE, 1, 16)
    redis.call('HSET', KEYS[meta], 'rid', LINEAGE, 'epoch', epoch)
  else
    redis.call('HSET', KEYS[meta], 'rid', LINEAGE)
  end
  return epoch
end

