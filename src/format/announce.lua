-- A worker's round of the data format (see format/mod.rs): it announces itself, reads the
-- format in use, and, when asked, moves the format forward to its own, all in one step.
--
-- The announcement: field = the worker's consumer name, value
-- `<format>:<min format>:<since ms>:<seen ms>` (Redis time): the worker's format, the
-- oldest format it works under, since when it has been announced without a gap longer
-- than the live bound, and when it was last seen. A reader takes the first four fields
-- and ignores any that follow, so that releases can read each other's announcements.
--
-- Moving forward: only to this worker's own format, only from an older one, only when
-- this worker has been announced without a gap for a full live bound (after an outage of
-- Redis every worker's announcement looks old: the older ones get a bound to come back
-- before any move), and only while no other worker of an older format was seen within
-- the live bound.
--
-- KEYS[1] janitor:{format}:in_use (String; absent: format 1)
-- KEYS[2] janitor:{format}:workers (Hash)
-- ARGV[1] consumer  ARGV[2] the worker's format  ARGV[3] the oldest format it works under
-- ARGV[4] the live bound (ms)  ARGV[5] announcements older than this (ms) are removed
-- ARGV[6] '1' to move the format forward if it may
-- Returns {format in use, 1 if this call moved it forward else 0,
--          '' or '<consumer> <format>' of an older worker that keeps it where it is}

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local consumer, format, min = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local live, forget = tonumber(ARGV[4]), tonumber(ARGV[5])

local function parse(value)
  local f, m, since, seen = string.match(value, '^(%d+):(%d+):(%d+):(%d+)')
  if not f then return nil end
  return tonumber(f), tonumber(m), tonumber(since), tonumber(seen)
end

local in_use = redis.call('GET', KEYS[1])
local current = tonumber(in_use or '1')
if not current then
  return redis.error_reply('ERR ' .. KEYS[1] .. ' holds ' .. in_use .. ', not a format number')
end

local since = now
local previous = redis.call('HGET', KEYS[2], consumer)
if previous then
  local _, _, p_since, p_seen = parse(previous)
  if p_seen and now - p_seen <= live then since = p_since end
end
redis.call('HSET', KEYS[2], consumer, format .. ':' .. min .. ':' .. since .. ':' .. now)

local blocker = ''
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local name = all[i]
  local f, _, _, seen = parse(all[i + 1])
  if seen and now - seen > forget then
    redis.call('HDEL', KEYS[2], name)
  elseif f and name ~= consumer and now - seen <= live and f < format and blocker == '' then
    blocker = name .. ' ' .. f
  end
end

local moved = 0
if ARGV[6] == '1' and current < format and blocker == '' and now - since >= live then
  redis.call('SET', KEYS[1], format)
  current, moved = format, 1
end
return {current, moved, blocker}
