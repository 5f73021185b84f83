-- One step of the reverse-index sweep of a live server: members of its set whose forward
-- entry now names another server (the user moved and the old server missed its SREM)
-- leave the set.
--
-- They are not dropped at once: a registration on this server may be in flight. A
-- connection server that writes SADD first and the forward entry second (the order on a
-- cluster) finds the member already there (its SADD changes nothing) while the entry
-- still names the old server; dropping the member then would leave the user registered
-- here with no index entry, and a cleanup of this server would miss it. So a member is
-- moved to `server:{S}:moved`, a Sorted Set scored by when (Redis TIME), which the
-- cleanup of S walks as well. A member set aside longer than the grace period is settled:
-- back into the set if its entry names this server by then (its registration finished),
-- dropped otherwise (no registration can still be in flight: one that began before the
-- member was set aside has ended, and one that began after it added the member back).
-- Read and move are one atomic script.
--
-- KEYS[1] server:{S}:users  KEYS[2] registry  KEYS[3] server:{S}:moved
-- ARGV[1] server id  ARGV[2] cursor  ARGV[3] COUNT  ARGV[4] 'hash', 'keys' or 'conns'
-- ARGV[5] forward key prefix (<key_prefix>user:)  ARGV[6] grace period (ms)
-- Returns {next cursor, members scanned, members set aside}

local layout = ARGV[4]
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- Settle members set aside before the grace period, a bounded batch per step.
local settled = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now_ms - tonumber(ARGV[6]),
  'LIMIT', 0, ARGV[3])
for first = 1, #settled, BATCH do
  local last = math.min(first + BATCH - 1, #settled)
  local owners = owners_of(settled, first, last, layout, KEYS[2], ARGV[5])
  for i = 1, #owners do
    if owners[i] == ARGV[1] then redis.call('SADD', KEYS[1], settled[first + i - 1]) end
  end
  redis.call('ZREM', KEYS[3], unpack(settled, first, last))
end

local r = redis.call('SSCAN', KEYS[1], ARGV[2], 'COUNT', ARGV[3])
local members = r[2]
local removed = 0
for first = 1, #members, BATCH do
  local last = math.min(first + BATCH - 1, #members)
  local owners = owners_of(members, first, last, layout, KEYS[2], ARGV[5])
  local moved = {}
  for i = 1, #owners do
    if owners[i] and owners[i] ~= ARGV[1] then
      moved[#moved + 1] = now_ms
      moved[#moved + 1] = members[first + i - 1]
    end
  end
  if #moved > 0 then
    redis.call('ZADD', KEYS[3], unpack(moved))
    local out = {}
    for i = 2, #moved, 2 do out[#out + 1] = moved[i] end
    removed = removed + redis.call('SREM', KEYS[1], unpack(out))
    -- The set outlives no server for long: one that leaves `servers` (a clean shutdown)
    -- is swept no more, so its set aside members would never settle.
    redis.call('PEXPIRE', KEYS[3], 604800000) -- 7 days
  end
end
return {r[1], #members, removed}
