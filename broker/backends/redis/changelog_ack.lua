-- KEYS: change-log partition, its backlog hash.
-- ARGV: consumer group, the id the group last delivered ('' when unknown), then entry ids.
-- Acknowledges the entries, counts each one that was pending out of its tenant's backlog, then
-- trims the log of what the group processed: every entry below the oldest pending one, or,
-- with none pending, every entry up to the newest id it acknowledged or was told was
-- delivered (delivery goes in id order, so with nothing pending all of those were
-- acknowledged). Nothing fan-out has yet to process is trimmed. An empty log resets the
-- backlog, so a count that drifted (entries an older version trimmed unread) heals once
-- fan-out catches up. Returns the entries left and the entries trimmed.
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  if not ms then return nil end
  return {tonumber(ms), tonumber(seq)}
end
local top = nil
local function consider(id)
  local parsed = parse(id)
  if parsed and (not top or parsed[1] > top[1] or (parsed[1] == top[1] and parsed[2] > top[2])) then
    top = parsed
  end
end
if ARGV[2] ~= '' then consider(ARGV[2]) end
for i = 3, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    local entry = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])[1]
    local fields = entry and entry[2] or {}
    for f = 1, #fields - 1, 2 do
      if fields[f] == 't' then
        if redis.call('HINCRBY', KEYS[2], fields[f + 1], -1) <= 0 then
          redis.call('HDEL', KEYS[2], fields[f + 1])
        end
        break
      end
    end
  end
  consider(ARGV[i])
end
local keep = nil
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1])
if pending.err then
  -- NOGROUP: the store lost the partition since the entries were read (a restart without its
  -- data, a FLUSHALL), so nothing of them is left to acknowledge, and nothing may be trimmed by
  -- their ids; the next read makes the group again.
  if not string.find(pending.err, 'NOGROUP', 1, true) then return pending end
  return {redis.call('XLEN', KEYS[1]), 0}
end
if tonumber(pending[1]) > 0 then
  keep = pending[2]
elseif top then
  keep = string.format('%.0f-%.0f', top[1], top[2] + 1)
end
local trimmed = 0
if keep then trimmed = redis.call('XTRIM', KEYS[1], 'MINID', keep) end
local left = redis.call('XLEN', KEYS[1])
if left == 0 then redis.call('DEL', KEYS[2]) end
return {left, trimmed}
