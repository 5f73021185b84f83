-- The reconciler on a Redis Cluster, slot of {S}: the fence, liveness and once-per-window
-- marker checks of report_dead.lua. For a server that is not fenced, the heartbeat's age
-- (ZSCORE of `servers`) is checked before, by the caller; the event is published after
-- by the caller: those keys live in other slots. A crash between the marker and the event delays the report by one marker
-- TTL; it is never lost for good.
--
-- KEYS[1] server:{S}:alive  KEYS[2] server:{S}:reported  KEYS[3] server:{S}:fenced
-- KEYS[4] server:{S}:users  KEYS[5] server:{S}:walking  KEYS[6] server:{S}:moved
-- ARGV[1] marker TTL (ms)
-- Returns 1 (dead: publish now), 0 (alive), 3 (already reported), 4 (fenced and clean)

if redis.call('EXISTS', KEYS[3]) == 1 then
  if redis.call('EXISTS', KEYS[4], KEYS[5], KEYS[6]) == 0 then return 4 end
elseif redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[1]) then return 3 end
return 1
