-- KEYS: change-log partition, its backlog hash (changes not yet fanned out, per tenant).
-- ARGV: maxlen, tenant_max, then tenant, packed change for each change, in order.
-- Appends every change or none, so nothing is acknowledged that the log cannot keep. None when
-- the partition would hold more than maxlen entries ({-2, entries}) or a tenant more than
-- tenant_max changes not yet fanned out ({-1, tenant, held, asked}). Each change is counted
-- under its tenant, and its entry names the tenant ('t'), so the acknowledgement
-- (changelog_ack.lua) counts it out; a count above the log's length is cut to it. Returns {1, entry id, entry id, ...}.
local n = (#ARGV - 2) / 2
local entries = redis.call('XLEN', KEYS[1])
if entries + n > tonumber(ARGV[1]) then return {-2, entries} end
local asked = {}
local tenants = {}
for i = 3, #ARGV, 2 do
  local tenant = ARGV[i]
  if not asked[tenant] then
    asked[tenant] = 0
    tenants[#tenants + 1] = tenant
  end
  asked[tenant] = asked[tenant] + 1
end
local max = tonumber(ARGV[2])
for _, tenant in ipairs(tenants) do
  local held = tonumber(redis.call('HGET', KEYS[2], tenant) or '0')
  -- No tenant can have more changes waiting than the log holds entries: a count beyond that
  -- drifted (entries trimmed or acknowledged by a worker that predates the counts) and heals here.
  if held > entries then
    held = entries
    redis.call('HSET', KEYS[2], tenant, held)
  end
  if held + asked[tenant] > max then return {-1, tenant, held, asked[tenant]} end
end
local ids = {1}
for i = 3, #ARGV, 2 do
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'c', ARGV[i + 1], 't', ARGV[i])
end
for _, tenant in ipairs(tenants) do redis.call('HINCRBY', KEYS[2], tenant, asked[tenant]) end
return ids
