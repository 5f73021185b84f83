-- The reverse-index sweep on a Redis Cluster, part 1 of a step (slot of {S}): reads only.
-- The set and the forward entries are in different slots, so the owners are read by the
-- caller between this script and reverse_apply_cluster.lua (see there why that is safe).
--
-- KEYS[1] server:{S}:users  KEYS[2] server:{S}:moved
-- ARGV[1] SSCAN cursor  ARGV[2] COUNT  ARGV[3] grace period (ms)
-- Returns {next cursor, members of this page, members set aside longer than the grace
-- period (a bounded batch), to settle}

local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms - tonumber(ARGV[3]),
  'LIMIT', 0, ARGV[2])
local r = redis.call('SSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
return {r[1], r[2], due}
