-- KEYS: meta, inbox, wake channel of session 1, then of session 2, ... (three per session).
-- ARGV: publish command (SPUBLISH or PUBLISH) or '' (the caller publishes), maxlen, now_ms,
--       cutoff_ms, the most frame bytes a wake-up carries, the data generation the frames'
--       changes were read from the log under ('' when unknown), then for each session its frame
--       count followed by, per frame, its change's field and position and the packed frame. The
--       field is 'c<partition>' and the position 40 digits (stream id ms and seq, each
--       zero-padded to 20); both are '' for a frame no change is behind.
-- Per session, atomically: a frame whose change is not newer than the newest change of its
-- partition that an earlier call appended to the session (hash field 'c<partition>') is
-- skipped: a redone batch repeats the same changes in the same order, so it is a repeat.
-- Frames of this call are weighed against what came before it, so one change's frames for
-- several URIs all land. Positions are compared as strings of equal length and digits only.
-- The other frames get offsets head+1.. as entry ids '<offset>-0', entries older than the
-- cutoff are trimmed (a bounded amount per call), and, with a publish command, one wake-up
-- 'F<first offset>:<packed frames>' goes to the session's channel, or 'F<head>:' without the
-- frames when they are larger than the bound (the stream reads its inbox instead: a large
-- change watched by many streams of one worker must not fill its pub/sub output buffer).
-- Nothing is written for a session that is gone (its hash, which holds its epoch from
-- creation on, is). A session met on another lineage takes a new epoch first (lineage.lua),
-- and its wake-up carries no frames: its stream reads the inbox and finds the gap.
-- A session of another data generation than the frames' was made after the store lost the data
-- they were read from (a fan-out batch in hand across an empty restart or a FLUSHALL): a frame
-- of a change published before the session began ('born', the server's clock at creation,
-- against the millisecond part of the change's stream id) is skipped, as the feed already
-- stands for it (a resync, a truncation); it would otherwise follow that in the inbox.
-- Returns {heads, nodes, skips, trimmed}: per session its new head (-1 when gone); the worker
-- node that watches each session ('' when none), as one string when every session of the call
-- names the same one (as is usual: one worker's fan-out, its own streams), else a list; for each
-- session that skipped frames, its (1-based) number and the (1-based) numbers of the frames it
-- skipped (-1 when the session took a new epoch: announce without frames); and the entries this
-- call trimmed from the inboxes (by length or age, for the metrics). The caller reads a value or
-- two per session, not four. Without a publish command, the caller sends the wake-ups of a whole
-- batch to each node in one message, after this script.
-- In Redis Cluster a call holds one session (its keys share a hash tag) and publishes itself;
-- on a single node fan-out sends many sessions per call. A session with one frame, as most
-- are in a fan-out batch, takes a path of its own with no tables to weigh several.
local heads, nodes, skips, trimmed_all = {}, {}, {}, 0
-- The node every session of the call names so far; false once two differ.
local node_all = nil
local at = 7
local publish = ARGV[1]
local maxlen = tonumber(ARGV[2])
local now = ARGV[3]
local cutoff = tonumber(ARGV[4])
local wake_max = tonumber(ARGV[5])
local generation = ARGV[6]

-- When the session whose hash is KEYS[meta] (epoch `epoch`, not the frames' generation) began,
-- in milliseconds, if it began under another data generation than the frames were read under;
-- false otherwise. Its data generation is its epoch up to any 'r' (lineage.lua).
local function born_since_read(meta, epoch)
  if generation == '' or string.match(epoch, '^[^r]*') == generation then return false end
  return tonumber(redis.call('HGET', KEYS[meta], 'born')) or false
end

-- Whether the change at `position` (40 digits: its stream id's milliseconds and sequence, each
-- padded to 20) was published before `born`.
local function older(position, born)
  return born and position ~= '' and tonumber(string.sub(position, 1, 20)) < born
end

-- Appends the frames `kept` after `head` to the inbox of the session whose keys end at KEYS[k],
-- trims it by length and by age, adds the hash fields to set to `fields` and, with a publish
-- command, publishes the wake-up. Returns the new head and the entries trimmed.
local function append(k, head, kept, fields, t0, frameless)
  local before_len = redis.call('XLEN', KEYS[k - 1])
  local first = head + 1
  head = head + #kept
  fields[#fields + 1] = 'head'
  fields[#fields + 1] = head
  for i = 1, #kept do
    redis.call('XADD', KEYS[k - 1], (first + i - 1) .. '-0', 't', now, 'f', kept[i])
  end
  local trimmed = 0
  if before_len == 0 then
    -- A new inbox takes the session's expiry; from then on the session's touch renews both.
    local ttl = redis.call('PTTL', KEYS[k - 2])
    if ttl > 0 then redis.call('PEXPIRE', KEYS[k - 1], ttl) end
    t0 = tonumber(now)
    fields[#fields + 1] = 't0'
    fields[#fields + 1] = now
  end
  -- Whole stream nodes go (MAXLEN ~), so a full inbox keeps up to a node (100 entries by
  -- default) beyond the bound: trimming is tried once that much has gathered, not at every
  -- append. Reads hold to the bound itself (``inbox_gap``).
  if before_len + #kept >= maxlen + 100 then
    trimmed = redis.call('XTRIM', KEYS[k - 1], 'MAXLEN', '~', ARGV[2])
  end
  -- 't0' is at most the time of the inbox's oldest entry (up to the clock skew between
  -- workers): it is set when an append finds the inbox empty and when the inbox is searched
  -- for entries past the cutoff. Only when it is missing or past the cutoff is the inbox
  -- searched (an XRANGE per append otherwise).
  if not t0 or t0 < cutoff then
    local entries = redis.call('XRANGE', KEYS[k - 1], '-', '+', 'COUNT', 256)
    local keep = nil
    for _, entry in ipairs(entries) do
      if tonumber(entry[2][2]) >= cutoff then keep = entry break end
    end
    if keep then
      if keep ~= entries[1] then trimmed = trimmed + redis.call('XTRIM', KEYS[k - 1], 'MINID', keep[1]) end
      t0 = keep[2][2]
    elseif #entries < 256 then
      trimmed = trimmed + redis.call('XTRIM', KEYS[k - 1], 'MAXLEN', 0)
      t0 = now
    else
      trimmed = trimmed + redis.call('XTRIM', KEYS[k - 1], 'MINID', entries[#entries][1])
      t0 = entries[#entries][2][2]
    end
    fields[#fields + 1] = 't0'
    fields[#fields + 1] = t0
  end
  if publish ~= '' then
    local packed = table.concat(kept)
    if frameless or #packed > wake_max then
      redis.call(publish, KEYS[k], 'F' .. head .. ':')
    else
      redis.call(publish, KEYS[k], 'F' .. first .. ':' .. packed)
    end
  end
  return head, trimmed
end

for s = 1, #KEYS / 3 do
  local k = 3 * s
  local n = tonumber(ARGV[at])
  -- The first marked frame's field is read with head and node, in one call: fan-out sends
  -- one partition per session, so that is usually the only read.
  local first_field = nil
  for i = 1, n do
    local field = ARGV[at + 3 * i - 2]
    if field ~= '' then
      first_field = field
      break
    end
  end
  local got = redis.call('HMGET', KEYS[k - 2], 'head', 'node', first_field or 'head', 't0', 'epoch', 'rid')
  local fenced = got[5] and got[6] ~= LINEAGE and on_lineage(k - 2, got[5], got[6]) ~= got[5]
  -- The usual case, a session of the frames' generation, costs one comparison and no call.
  local born = got[5] ~= generation and got[5] and born_since_read(k - 2, got[5])
  local head = tonumber(got[1]) or 0
  local skipped = 0
  local trimmed = 0
  if not got[5] then
    head = -1
  elseif n == 1 then
    local position = ARGV[at + 2]
    if first_field and (position <= (got[3] or '') or born and older(position, born)) then
      skipped = {1}
    else
      local fields = first_field and {first_field, position} or {}
      head, trimmed = append(k, head, {ARGV[at + 3]}, fields, tonumber(got[4]), fenced)
      redis.call('HSET', KEYS[k - 2], unpack(fields))
    end
  else
    local before = {} -- field -> position stored before this call
    local newest = {} -- field -> newest position of this call
    if first_field then
      before[first_field] = got[3] or ''
      newest[first_field] = before[first_field]
    end
    local kept = {}
    for i = 1, n do
      local field = ARGV[at + 3 * i - 2]
      local keep = true
      if field ~= '' then
        local position = ARGV[at + 3 * i - 1]
        local stored = before[field]
        if stored == nil then
          stored = redis.call('HGET', KEYS[k - 2], field) or ''
          before[field] = stored
          newest[field] = stored
        end
        if position <= stored or born and older(position, born) then
          keep = false
        elseif position > newest[field] then
          newest[field] = position
        end
      end
      if keep then
        kept[#kept + 1] = ARGV[at + 3 * i]
      elseif skipped == 0 then
        skipped = {i}
      else
        skipped[#skipped + 1] = i
      end
    end
    local fields = {}
    for field, position in pairs(newest) do
      if position ~= before[field] then
        fields[#fields + 1] = field
        fields[#fields + 1] = position
      end
    end
    if #kept > 0 then
      head, trimmed = append(k, head, kept, fields, tonumber(got[4]), fenced)
    end
    if #fields > 0 then
      redis.call('HSET', KEYS[k - 2], unpack(fields))
    end
  end
  heads[s] = head
  local node = got[5] and got[2] or ''
  nodes[s] = node
  if node_all == nil then
    node_all = node
  elseif node_all ~= node then
    node_all = false
  end
  if fenced then
    skipped = -1
  end
  if skipped ~= 0 then
    skips[#skips + 1] = s
    skips[#skips + 1] = skipped
  end
  trimmed_all = trimmed_all + trimmed
  at = at + 3 * n + 1
end
if node_all ~= false then
  nodes = node_all or ''
end
return {heads, nodes, skips, trimmed_all}
