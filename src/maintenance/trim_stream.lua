-- Trims a stream the janitor writes (the events stream, the evictions stream, the
-- dead-letter stream) in two ways, and reports on its consumer groups.
--
-- Retention: for every consumer group on the stream, an entry is still needed if it is
-- pending (delivered, not acknowledged) or not yet delivered (after the group's
-- last-delivered-id). The retention point is the oldest such entry over all groups, and
-- no later than ARGV[1] (entries younger than the retention time are kept for
-- inspection). A stream that no group reads is left alone by retention (the events
-- stream: its entries wait for the workers' group; the dead-letter stream: its entries
-- wait for an operator), or trimmed by age alone with ARGV[2] = 'age' (the evictions
-- stream: nobody may ever read it).
--
-- Hard bound: entries older than ARGV[3] milliseconds (by Redis's clock) go even if a
-- group has not read or acknowledged them, so that a group nobody reads any more cannot
-- pin the stream for good; 0 turns it off. Except ARGV[4]'s own entries: an entry that
-- group (the workers' group on the events stream) still needs is never trimmed, nor is
-- anything after it; when ARGV[4] names a group that does not exist, the hard bound does
-- not apply at all (the group has not been created yet: the events wait for it).
--
-- XTRIM MINID removes only entries older than the trim point. Exact trimming: events are
-- rare, and approximate ('~') trimming may never remove a small stream's only node.
-- Entries trimmed while a group had not acknowledged them are counted per group: those
-- pending in it, and those never delivered to it (the trim runs in stages, one per
-- group's last-delivered-id, so each stage's count is exact for every group).
--
-- KEYS[1] the stream; ARGV[1] "<unix ms>-0", the newest id old enough for retention;
-- ARGV[2] 'age' to trim a stream without groups by retention, anything else to leave it;
-- ARGV[3] the hard bound's age in ms (0: off); ARGV[4] the protected group ('' for none).
-- Returns {removed, {name, unacked_trimmed, lag (-1 unknown), pending,
-- oldest_unacked_age_ms (-1 none), idle_ms (-1 no consumer)} per group}.

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

local function next_id(id)
  local ms, seq = parse(id)
  return ms .. '-' .. string.format('%d', tonumber(seq) + 1)
end

if redis.call('EXISTS', KEYS[1]) == 0 then return {0, {}} end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local max_age = tonumber(ARGV[3])
local protected = ARGV[4]

local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
local first_id = first[1] and first[1][1]

-- Each group: what it still needs, and its counts.
local groups = {}
local protected_found = false
local protected_needs = nil
for _, info in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local g = {
    name = field(info, 'name'),
    unread_from = next_id(field(info, 'last-delivered-id')),
    lag = field(info, 'lag'),
    pending = field(info, 'pending'),
    trimmed = 0,
  }
  g.needs = g.unread_from
  local summary = redis.call('XPENDING', KEYS[1], g.name)
  if summary[1] > 0 and older(summary[2], g.needs) then g.needs = summary[2] end
  if g.name == protected then
    protected_found = true
    protected_needs = g.needs
  end
  table.insert(groups, g)
end

local point = '0-0'
if #groups > 0 or ARGV[2] == 'age' then
  point = ARGV[1]
  for _, g in ipairs(groups) do
    if older(g.needs, point) then point = g.needs end
  end
end
if max_age > 0 and (protected == '' or protected_found) then
  local hard = string.format('%d', math.max(now_ms - max_age, 0)) .. '-0'
  if protected_needs and older(protected_needs, hard) then hard = protected_needs end
  if older(point, hard) then point = hard end
end

local removed = 0
if first_id and older(first_id, point) then
  -- Pending entries about to go, counted before they do (an entry trimmed earlier stays
  -- in the pending list: only those from the stream's first entry on are counted).
  for _, g in ipairs(groups) do
    if g.pending > 0 then
      local gone = redis.call('XPENDING', KEYS[1], g.name, first_id, '(' .. point, g.pending)
      g.trimmed = g.trimmed + #gone
    end
  end
  -- Undelivered entries: trim up to each group's first undelivered id in turn; what a
  -- stage removes was never delivered to the groups whose first undelivered id is at or
  -- before the stage's start.
  local cuts = {}
  for _, g in ipairs(groups) do
    if older(g.unread_from, point) then table.insert(cuts, g.unread_from) end
  end
  table.sort(cuts, older)
  table.insert(cuts, point)
  local from = nil
  for _, cut in ipairs(cuts) do
    local n = redis.call('XTRIM', KEYS[1], 'MINID', cut)
    removed = removed + n
    if from and n > 0 then
      for _, g in ipairs(groups) do
        if not older(from, g.unread_from) then g.trimmed = g.trimmed + n end
      end
    end
    from = cut
  end
end

local left = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
local report = {}
for _, g in ipairs(groups) do
  -- The oldest entry still in the stream that the group has not acknowledged: pending,
  -- or the first one not delivered to it.
  local oldest = nil
  if g.pending > 0 and left[1] then
    local p = redis.call('XPENDING', KEYS[1], g.name, left[1][1], '+', 1)
    if p[1] then oldest = p[1][1] end
  end
  local undelivered = redis.call('XRANGE', KEYS[1], g.unread_from, '+', 'COUNT', 1)
  if undelivered[1] and (not oldest or older(undelivered[1][1], oldest)) then
    oldest = undelivered[1][1]
  end
  local age = -1
  if oldest then age = math.max(now_ms - tonumber((parse(oldest))), 0) end
  local idle = -1
  for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], g.name)) do
    local i = field(c, 'idle')
    if idle < 0 or i < idle then idle = i end
  end
  local lag = -1
  if type(g.lag) == 'number' then lag = g.lag end
  table.insert(report, {g.name, g.trimmed, lag, g.pending, age, idle})
end
return {removed, report}
