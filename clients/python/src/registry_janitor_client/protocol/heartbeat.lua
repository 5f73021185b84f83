-- registry-janitor connection-server protocol: the heartbeat of this server.
--
-- Refreshes the liveness key and the `servers` score, unless the server is fenced
-- (declared dead): then nothing is written and the answer is the error FENCED, noted in
-- `server:{S}:refused` (field `heartbeat`, and `last_ms`; it lives as long as the fence). The heartbeat is where a server learns
-- of a verdict against it: on FENCED it must close its sockets (its clients reconnect
-- elsewhere) and start again under a new server id.
--
-- The score is Redis's time (TIME), never the caller's: the liveness of a server is
-- judged on Redis's clock alone, so a connection server whose clock runs ahead or behind
-- is declared dead as soon as, and no sooner than, one whose clock is right.
--
-- One node: KEYS[1] server:{S}:fenced  KEYS[2] server:{S}:refused  KEYS[3] server:{S}:alive
--           KEYS[4] servers
-- Redis Cluster: `servers` is in another slot. Call with KEYS[1] to KEYS[3] only, then,
--   if it answered 1, heartbeat_servers.lua with KEYS[1] `servers`.
-- ARGV[1] server id S  ARGV[2] liveness TTL (ms)  ARGV[3] the caller's time (unix ms):
--   accepted and not used (callers written for an earlier version send it)
-- Returns 1, or the error reply "FENCED ..."

local fence, refusals, alive, servers = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local server = ARGV[1]

if redis.call('EXISTS', fence) == 1 then
  local t = redis.call('TIME')
  redis.pcall('HINCRBY', refusals, 'heartbeat', 1)
  redis.pcall('HSET', refusals, 'last_ms', t[1] * 1000 + math.floor(t[2] / 1000))
  local ttl = redis.call('PTTL', fence)
  if ttl > 0 then redis.pcall('PEXPIRE', refusals, ttl) end
  return redis.error_reply('FENCED server ' .. server .. ' was declared dead: close its sockets and start again under a new server id')
end
redis.call('SET', alive, '1', 'PX', ARGV[2])
if servers then
  local t = redis.call('TIME')
  redis.call('ZADD', servers, t[1] * 1000 + math.floor(t[2] / 1000), server)
end
return 1
