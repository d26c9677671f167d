-- KEYS: for each change-log partition of the call, three keys: the partition, its backlog hash
--       (changes not yet fanned out, per tenant), its seal (set once a switch drains it).
-- ARGV: maxlen, tenant_max, then for each change, in order: its partition's place among the
--       triples (1, 2, ...), its tenant, the packed change.
-- Appends every change or none, so nothing is acknowledged that the log cannot keep (one call
-- spans several partitions on a single server; on Cluster each call holds one). None when a
-- partition is sealed ({-3, place}: the caller's layout is stale), would hold more than maxlen
-- entries ({-2, place, entries}), or a tenant would have more than tenant_max changes of one
-- partition not yet fanned out ({-1, place, tenant, held, asked}). Each change is counted under
-- its tenant in its partition, and its entry names the tenant ('t'), so the acknowledgement
-- (changelog_ack.lua) counts it out; a count above the log's length is cut to it.
-- Returns {1, entry id, entry id, ...} in the order of the changes.
local max = tonumber(ARGV[2])
local places = #KEYS / 3
local asked = {}
local order = {}
local added = {}
for p = 1, places do
  asked[p] = {}
  order[p] = {}
  added[p] = 0
end
for i = 3, #ARGV, 3 do
  local p = tonumber(ARGV[i])
  local tenant = ARGV[i + 1]
  if not asked[p][tenant] then
    asked[p][tenant] = 0
    order[p][#order[p] + 1] = tenant
  end
  asked[p][tenant] = asked[p][tenant] + 1
  added[p] = added[p] + 1
end
for p = 1, places do
  if redis.call('EXISTS', KEYS[3 * p]) == 1 then return {-3, p} end
  local entries = redis.call('XLEN', KEYS[3 * p - 2])
  if entries + added[p] > tonumber(ARGV[1]) then return {-2, p, entries} end
  for _, tenant in ipairs(order[p]) do
    local held = tonumber(redis.call('HGET', KEYS[3 * p - 1], tenant) or '0')
    -- No tenant can have more changes waiting than the log holds entries: a count beyond that
    -- drifted (entries trimmed or acknowledged by a worker that predates the counts) and heals here.
    if held > entries then
      held = entries
      redis.call('HSET', KEYS[3 * p - 1], tenant, held)
    end
    if held + asked[p][tenant] > max then return {-1, p, tenant, held, asked[p][tenant]} end
  end
end
local ids = {1}
for i = 3, #ARGV, 3 do
  local p = tonumber(ARGV[i])
  ids[#ids + 1] = redis.call('XADD', KEYS[3 * p - 2], '*', 'c', ARGV[i + 2], 't', ARGV[i + 1])
end
for p = 1, places do
  for _, tenant in ipairs(order[p]) do redis.call('HINCRBY', KEYS[3 * p - 1], tenant, asked[p][tenant]) end
end
return ids
