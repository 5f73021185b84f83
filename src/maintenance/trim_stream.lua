-- Trims acknowledged entries off a stream (the events stream, the evictions stream),
-- never one a group still needs.
--
-- For every consumer group on the stream, an entry is still needed if it is pending
-- (delivered, not acknowledged) or not yet delivered (after the group's
-- last-delivered-id). The trim point is the oldest such entry over all groups, and no
-- later than ARGV[1] (entries younger than the retention time are kept for inspection).
-- XTRIM MINID removes only entries older than the trim point. Exact trimming: events
-- are rare, and approximate ('~') trimming may never remove a small stream's only node.
-- A stream that no group reads is left alone (the events stream: its entries wait for the
-- workers' group), or trimmed by age alone with ARGV[2] = 'age' (the evictions stream:
-- nobody may ever read it).
--
-- KEYS[1] the stream; ARGV[1] "<unix ms>-0", the newest id old enough to trim;
-- ARGV[2] 'age' to trim a stream without groups by age, anything else to leave it.
-- Returns the number of entries removed.

local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return ms, seq
end

local function older(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  am, bm = tonumber(am), tonumber(bm)
  return am < bm or (am == bm and tonumber(as) < tonumber(bs))
end

local function field(flat, name)
  for i = 1, #flat, 2 do
    if flat[i] == name then return flat[i + 1] end
  end
end

if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 and ARGV[2] ~= 'age' then return 0 end

local bound = ARGV[1]
for _, group in ipairs(groups) do
  local ms, seq = parse(field(group, 'last-delivered-id'))
  local first_undelivered = ms .. '-' .. string.format('%d', tonumber(seq) + 1)
  if older(first_undelivered, bound) then bound = first_undelivered end
  local pending = redis.call('XPENDING', KEYS[1], field(group, 'name'))
  if pending[1] > 0 and older(pending[2], bound) then bound = pending[2] end
end
return redis.call('XTRIM', KEYS[1], 'MINID', bound)
