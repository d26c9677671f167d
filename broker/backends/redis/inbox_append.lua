-- KEYS: meta, inbox, wake channel.
-- ARGV: publish command (SPUBLISH or PUBLISH), maxlen, now_ms, cutoff_ms, then packed frames.
-- Appends the frames with offsets head+1.. as entry ids '<offset>-0' and publishes one wake-up
-- 'F<first offset>:<packed frames>' in the same atomic step. Returns the new head, or -1 when
-- the session is gone (nothing is written then: no orphaned inbox).
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then return -1 end
local n = #ARGV - 4
local head = redis.call('HINCRBY', KEYS[1], 'head', n)
local first = head - n + 1
local payload = {}
for i = 1, n do
  local frame = ARGV[4 + i]
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], (first + i - 1) .. '-0', 't', ARGV[3], 'f', frame)
  payload[i] = frame
end
redis.call('PEXPIRE', KEYS[2], ttl)
-- Time-based retention: drop entries older than the cutoff, a bounded amount per call.
local cutoff = tonumber(ARGV[4])
local oldest = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)
if oldest[1] and tonumber(oldest[1][2][2]) < cutoff then
  local entries = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 256)
  local keep = nil
  for _, entry in ipairs(entries) do
    if tonumber(entry[2][2]) >= cutoff then keep = entry[1] break end
  end
  if keep then
    redis.call('XTRIM', KEYS[2], 'MINID', keep)
  elseif #entries < 256 then
    redis.call('XTRIM', KEYS[2], 'MAXLEN', 0)
  else
    redis.call('XTRIM', KEYS[2], 'MINID', entries[#entries][1])
  end
end
redis.call(ARGV[1], KEYS[3], 'F' .. first .. ':' .. table.concat(payload))
return head
