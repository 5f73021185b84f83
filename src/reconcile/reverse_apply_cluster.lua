-- The reverse-index sweep on a Redis Cluster, part 2 of a step (slot of {S}): the
-- verdicts of the owners the caller read after reverse_page_cluster.lua, applied as
-- sweep_reverse.lua applies them on one node.
--
-- The owners were read before this script runs, not inside it. That is safe because
-- nothing here drops a member that a registration on S may need:
-- - a member is only set aside (to `moved`, which the cleanup of S walks too), never
--   dropped, when its entry named another server at the read. A user who registers on S
--   again between the read and this script is then in `moved`, not `users`: still walked
--   by a cleanup of S, and put back when it is settled;
-- - a member set aside longer than the grace period is settled: put back if its entry
--   named S at the read, dropped from `moved` otherwise. A registration on S that began
--   before it was set aside has ended by then (the grace period), and one that begins
--   after the read adds the member to `users` itself (SADD), which this script does not
--   touch. A member set aside again since the page was read (a newer score) is left;
-- - writes that take memory come first (ZADD before SREM, SADD before ZREM), so an OOM
--   refusal stops the script before the member leaves its set.
--
-- KEYS[1] server:{S}:users  KEYS[2] server:{S}:moved
-- ARGV[1] grace period (ms)  ARGV[2] n1  ARGV[3] n2
-- ARGV[4 .. 3+n1] members whose entry named another server: set aside
-- next n2: members due for settling whose entry named S: put back
-- the rest: members due for settling whose entry did not name S: dropped
-- Returns the members set aside

local MOVED_TTL_MS = 604800000 -- 7 days
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local aside_end = 3 + tonumber(ARGV[2])
local back_end = aside_end + tonumber(ARGV[3])
local removed = 0
for i = 4, aside_end do
  if redis.call('SISMEMBER', KEYS[1], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[2], now_ms, ARGV[i])
    redis.call('SREM', KEYS[1], ARGV[i])
    removed = removed + 1
  end
end
-- The set outlives no server for long: one that leaves `servers` (a clean shutdown) is
-- swept no more, so its set aside members would never settle.
if removed > 0 then redis.call('PEXPIRE', KEYS[2], MOVED_TTL_MS) end
local due = now_ms - tonumber(ARGV[1])
for i = aside_end + 1, #ARGV do
  local score = redis.call('ZSCORE', KEYS[2], ARGV[i])
  if score and tonumber(score) <= due then
    if i <= back_end then redis.call('SADD', KEYS[1], ARGV[i]) end
    redis.call('ZREM', KEYS[2], ARGV[i])
  end
end
return removed
