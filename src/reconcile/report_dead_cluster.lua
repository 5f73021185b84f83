-- The reconciler on a Redis Cluster, slot of {S}: the liveness check and the
-- once-per-window marker of report_dead.lua. The heartbeat's age (ZSCORE of `servers`)
-- is checked before, and the event published after, by the caller: those keys live in
-- other slots. A crash between the marker and the event delays the report by one marker
-- TTL; it is never lost for good.
--
-- KEYS[1] server:{S}:alive  KEYS[2] server:{S}:reported   ARGV[1] marker TTL (ms)
-- Returns 1 (dead: publish now), 0 (alive), 3 (already reported)

if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[1]) then return 3 end
return 1
