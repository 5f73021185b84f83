-- Publishes `server.dead` for a server if, at this instant, it is dead: fenced (a worker
-- took a `server.dead` for it: dead for good, whatever its liveness key says, since a
-- plain writer, without the protocol's fence check, may still heartbeat) with something
-- left to clean; or its liveness key is gone and its last heartbeat in `servers` is
-- older than the grace period (or it has none). A fenced server with nothing left to
-- clean is not reported again (if a zombie's heartbeat put it back in `servers`, it
-- stays there until its fence expires, then is reported once more and cleaned: the
-- reconciler never writes `servers`, and its ACL user may not). A marker with a TTL
-- makes several reconcilers publish once per window; once it expires, a server that is
-- still not clean is reported again.
--
-- KEYS[1] server:{S}:alive  KEYS[2] servers  KEYS[3] server:{S}:reported
-- KEYS[4] registry:events  KEYS[5] server:{S}:fenced
-- KEYS[6] server:{S}:users  KEYS[7] server:{S}:walking  KEYS[8] server:{S}:moved
-- ARGV[1] server id  ARGV[2] cutoff (unix ms: now - heartbeat_grace_ms)
-- ARGV[3] the event's MessagePack payload  ARGV[4] marker TTL (ms)
-- ARGV[5] '1' while Redis has not been reachable for a full grace since its last outage
--         (src/guard/reachable.rs): a server that is not fenced is then not declared dead
-- Returns {verdict, detail}: 1 published (detail: entry id); 0 alive (liveness key
-- exists); 2 heartbeat too recent (detail: its score); 3 already reported; 4 fenced and
-- clean; 5 waiting for reachable time.

if redis.call('EXISTS', KEYS[5]) == 1 then
  if redis.call('EXISTS', KEYS[6], KEYS[7], KEYS[8]) == 0 then return {4, ''} end
else
  if redis.call('EXISTS', KEYS[1]) == 1 then return {0, ''} end
  if ARGV[5] == '1' then return {5, ''} end
  local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if score and tonumber(score) > tonumber(ARGV[2]) then return {2, score} end
end
if not redis.call('SET', KEYS[3], '1', 'NX', 'PX', ARGV[4]) then return {3, ''} end
local id = redis.call('XADD', KEYS[4], '*', 'type', 'server.dead', 'payload', ARGV[3])
return {1, id}
