-- registry-janitor connection-server protocol: a clean disconnect of a user.
--
-- The forward entry goes only if it still names this server (the user may have
-- reconnected elsewhere meanwhile); then the user leaves the reverse set. A fenced
-- server (declared dead) still loses the forward entry (the janitor removes it anyway),
-- but its reverse set is not written and the answer is the error FENCED, noted in
-- `server:{S}:refused` (field `unregister`, and `last_ms`; it lives as long as the fence).
--
-- One node: KEYS[1] server:{S}:fenced  KEYS[2] server:{S}:refused  KEYS[3] server:{S}:users
--           KEYS[4] the forward entry: `registry` (layout hash) or `user:<user>` (keys)
-- Redis Cluster: call release.lua on the forward entry first, then this script with
--   KEYS[1] to KEYS[3] only (it then answers 0).
-- ARGV[1] user id  ARGV[2] server id S  ARGV[3] 'hash' or 'keys'
-- Returns the number of forward entries deleted (0 or 1), or the error reply "FENCED ..."

local fence, refusals, users, forward = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local deleted = 0
local user, server = ARGV[1], ARGV[2]

if forward then
  if ARGV[3] == 'hash' then
    if redis.call('HGET', forward, user) == server then deleted = redis.call('HDEL', forward, user) end
  elseif redis.call('GET', forward) == server then
    deleted = redis.call('DEL', forward)
  end
end
if redis.call('EXISTS', fence) == 1 then
  local t = redis.call('TIME')
  redis.pcall('HINCRBY', refusals, 'unregister', 1)
  redis.pcall('HSET', refusals, 'last_ms', t[1] * 1000 + math.floor(t[2] / 1000))
  local ttl = redis.call('PTTL', fence)
  if ttl > 0 then redis.pcall('PEXPIRE', refusals, ttl) end
  return redis.error_reply('FENCED server ' .. server .. ' was declared dead: close its sockets and start again under a new server id')
end
redis.call('SREM', users, user)
return deleted
