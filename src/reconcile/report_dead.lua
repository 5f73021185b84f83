-- Publishes `server.dead` for a server if, at this instant, it is dead: fenced (a worker
-- took a `server.dead` for it: dead for good, whatever its liveness key says, since a
-- plain writer, without the protocol's fence check, may still heartbeat) with something
-- left to clean; or its liveness key is gone and its last heartbeat in `servers` is
-- older than the grace period (or it has none). A fenced server with nothing left to
-- clean is not reported again (if a zombie's heartbeat put it back in `servers`, it
-- stays there until its fence expires, then is reported once more and cleaned). A marker
-- with a TTL makes several reconcilers publish once per window; once it expires, a
-- server that is still not clean is reported again.
--
-- The heartbeat's age is measured on Redis's clock (TIME), against a score written with
-- Redis's time by the protocol. A score later than now plus the tolerance was written
-- with a clock that runs ahead (see src/clock/mod.rs): it is lowered to now, which no
-- real heartbeat is later than (the write may fail, an ACL without it: the score then
-- counts as now, for this check only).
--
-- KEYS[1] server:{S}:alive  KEYS[2] servers  KEYS[3] server:{S}:reported
-- KEYS[4] registry:events  KEYS[5] server:{S}:fenced
-- KEYS[6] server:{S}:users  KEYS[7] server:{S}:walking  KEYS[8] server:{S}:moved
-- ARGV[1] server id  ARGV[2] heartbeat_grace_ms
-- ARGV[3] the event's MessagePack payload  ARGV[4] marker TTL (ms)
-- ARGV[5] '1' while Redis has not been reachable for a full grace since its last outage
--         (src/guard/reachable.rs): a server that is not fenced is then not declared dead
-- ARGV[6] tolerance (ms) of a score in the future
-- ARGV[7] the latest Redis time (unix ms) this call may read if Redis's clock has not
--         stepped forward since the guard last observed it ('' for no bound): a server
--         that is not fenced is not judged by a later TIME (src/guard/reachable)
-- Returns {verdict, detail, wait}: 1 published (detail: entry id); 0 alive (liveness key
-- exists); 2 heartbeat too recent (detail: its score, Redis time; wait: ms until it is
-- past the grace); 3 already reported; 4 fenced and clean; 5 waiting for reachable time;
-- 6 Redis's clock is past ARGV[7] (detail: Redis time).

if redis.call('EXISTS', KEYS[5]) == 1 then
  if redis.call('EXISTS', KEYS[6], KEYS[7], KEYS[8]) == 0 then return {4, '', 0} end
else
  if redis.call('EXISTS', KEYS[1]) == 1 then return {0, '', 0} end
  if ARGV[5] == '1' then return {5, '', 0} end
  -- A step forward of the clock expires liveness keys early and ages every score: the
  -- TIME that judges is checked first.
  local t = redis.call('TIME')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  if ARGV[7] ~= '' and now > tonumber(ARGV[7]) then
    return {6, string.format('%d', now), 0}
  end
  local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if score then
    local grace = tonumber(ARGV[2])
    local heartbeat = tonumber(score)
    if heartbeat > now + tonumber(ARGV[6]) then
      redis.pcall('ZADD', KEYS[2], 'XX', now, ARGV[1])
      heartbeat = now
    end
    if heartbeat > now - grace then
      return {2, string.format('%d', heartbeat), heartbeat + grace - now}
    end
  end
end
if not redis.call('SET', KEYS[3], '1', 'NX', 'PX', ARGV[4]) then return {3, '', 0} end
local id = redis.call('XADD', KEYS[4], '*', 'type', 'server.dead', 'payload', ARGV[3])
return {1, id, 0}
