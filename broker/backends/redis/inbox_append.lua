-- KEYS: meta, inbox, wake channel of session 1, then of session 2, ... (three per session).
-- ARGV: publish command (SPUBLISH or PUBLISH) or '' (the caller publishes), maxlen, now_ms,
--       cutoff_ms, then for each session its frame count followed by its packed frames.
-- Per session, atomically: the frames get offsets head+1.. as entry ids '<offset>-0', entries
-- older than the cutoff are trimmed (a bounded amount per call), and, with a publish command,
-- one wake-up 'F<first offset>:<packed frames>' goes to the session's channel. Nothing is
-- written for a session that is gone. Returns, per session, its new head (-1 when gone) and
-- the worker node that watches it ('' when none): without a publish command, the caller sends
-- the wake-ups of a whole batch to each node in one message, after this script.
-- In Redis Cluster a call holds one session (its keys share a hash tag) and publishes itself;
-- on a single node fan-out sends many sessions per call.
local heads = {}
local at = 5
local cutoff = tonumber(ARGV[4])
for s = 1, #KEYS / 3 do
  local k = 3 * s
  local n = tonumber(ARGV[at])
  local ttl = redis.call('PTTL', KEYS[k - 2])
  if ttl < 0 then
    heads[2 * s - 1] = -1
    heads[2 * s] = ''
  else
    local head = redis.call('HINCRBY', KEYS[k - 2], 'head', n)
    local first = head - n + 1
    local payload = {}
    for i = 1, n do
      local frame = ARGV[at + i]
      redis.call('XADD', KEYS[k - 1], 'MAXLEN', '~', ARGV[2], (first + i - 1) .. '-0', 't', ARGV[3], 'f', frame)
      payload[i] = frame
    end
    redis.call('PEXPIRE', KEYS[k - 1], ttl)
    local oldest = redis.call('XRANGE', KEYS[k - 1], '-', '+', 'COUNT', 1)
    if oldest[1] and tonumber(oldest[1][2][2]) < cutoff then
      local entries = redis.call('XRANGE', KEYS[k - 1], '-', '+', 'COUNT', 256)
      local keep = nil
      for _, entry in ipairs(entries) do
        if tonumber(entry[2][2]) >= cutoff then keep = entry[1] break end
      end
      if keep then
        redis.call('XTRIM', KEYS[k - 1], 'MINID', keep)
      elseif #entries < 256 then
        redis.call('XTRIM', KEYS[k - 1], 'MAXLEN', 0)
      else
        redis.call('XTRIM', KEYS[k - 1], 'MINID', entries[#entries][1])
      end
    end
    if ARGV[1] ~= '' then
      redis.call(ARGV[1], KEYS[k], 'F' .. first .. ':' .. table.concat(payload))
    end
    heads[2 * s - 1] = head
    heads[2 * s] = redis.call('HGET', KEYS[k - 2], 'node') or ''
  end
  at = at + n + 1
end
return heads
