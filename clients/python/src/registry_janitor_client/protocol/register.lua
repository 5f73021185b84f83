-- registry-janitor connection-server protocol: register a user on this server.
--
-- The fence check and the writes are one atomic step: a server declared dead (its fence
-- `server:{S}:fenced` exists) writes nothing and gets the error FENCED, noted in
-- `server:{S}:refused` (field `register`, and `last_ms`; it lives as long as the fence) so
-- that the janitor's status and metrics can show it.
--
-- One node: KEYS[1] server:{S}:fenced  KEYS[2] server:{S}:refused  KEYS[3] server:{S}:users
--           KEYS[4] the forward entry: `registry` (layout hash) or `user:<user>` (keys)
-- Redis Cluster: the forward entry is in another slot. If KEYS[1] exists, call this
--   script with KEYS[1] to KEYS[3] only (it refuses, and notes it) and write no forward
--   entry. Otherwise write it first (HSET registry <user> <S>, or SET user:<user> <S>),
--   then call this script with KEYS[1] to KEYS[3] only. If it answers FENCED, undo the
--   forward entry with release.lua.
-- ARGV[1] user id  ARGV[2] server id S  ARGV[3] 'hash' or 'keys'
-- Returns 1, or the error reply "FENCED ..."
-- (Every key name carries the deployment's key_prefix.)

local fence, refusals, users, forward = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local user, server = ARGV[1], ARGV[2]

if redis.call('EXISTS', fence) == 1 then
  local t = redis.call('TIME')
  redis.pcall('HINCRBY', refusals, 'register', 1)
  redis.pcall('HSET', refusals, 'last_ms', t[1] * 1000 + math.floor(t[2] / 1000))
  local ttl = redis.call('PTTL', fence)
  if ttl > 0 then redis.pcall('PEXPIRE', refusals, ttl) end
  return redis.error_reply('FENCED server ' .. server .. ' was declared dead: close its sockets and start again under a new server id')
end
if forward then
  if ARGV[3] == 'hash' then
    redis.call('HSET', forward, user, server)
  else
    redis.call('SET', forward, server)
  end
end
redis.call('SADD', users, user)
return 1
