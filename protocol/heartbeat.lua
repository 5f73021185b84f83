-- registry-janitor connection-server protocol: the heartbeat of this server.
--
-- Refreshes the liveness key and the `servers` score, unless the server is fenced
-- (declared dead): then nothing is written and the answer is the error FENCED, noted in
-- the fence (refused_heartbeat, last_refused_ms). The heartbeat is where a server learns
-- of a verdict against it: on FENCED it must close its sockets (its clients reconnect
-- elsewhere) and start again under a new server id.
--
-- One node: KEYS[1] server:{S}:fenced  KEYS[2] server:{S}:alive  KEYS[3] servers
-- Redis Cluster: `servers` is in another slot. Call with KEYS[1] and KEYS[2] only, then,
--   if it answered 1, ZADD servers <now_ms> <S>.
-- ARGV[1] server id S  ARGV[2] liveness TTL (ms)  ARGV[3] now (unix ms), the score
-- Returns 1, or the error reply "FENCED ..."

local fence, alive, servers = KEYS[1], KEYS[2], KEYS[3]
local server = ARGV[1]

if redis.call('EXISTS', fence) == 1 then
  local t = redis.call('TIME')
  redis.pcall('HINCRBY', fence, 'refused_heartbeat', 1)
  redis.pcall('HSET', fence, 'last_refused_ms', t[1] * 1000 + math.floor(t[2] / 1000))
  return redis.error_reply('FENCED server ' .. server .. ' was declared dead: close its sockets and start again under a new server id')
end
redis.call('SET', alive, '1', 'PX', ARGV[2])
if servers then redis.call('ZADD', servers, ARGV[3], server) end
return 1
