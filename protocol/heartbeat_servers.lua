-- registry-janitor connection-server protocol, Redis Cluster: the second step of a
-- heartbeat. `servers` is in another slot than the server's own keys, so heartbeat.lua
-- is called with KEYS[1] to KEYS[3] only; when it answered 1, this script records the
-- heartbeat in `servers` with Redis's time (TIME), never the caller's, so that a
-- connection server whose clock runs ahead or behind is judged like any other.
--
-- (On one node heartbeat.lua writes `servers` itself: this script is not needed there.)
--
-- KEYS[1] servers
-- ARGV[1] server id S
-- Returns 1
-- (Every key name carries the deployment's key_prefix.)

local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], t[1] * 1000 + math.floor(t[2] / 1000), ARGV[1])
return 1
