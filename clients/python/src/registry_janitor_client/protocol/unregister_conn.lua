-- registry-janitor connection-server protocol, layout conns: a clean disconnect of one
-- connection of a user.
--
-- The connection's field goes only if it still names this server (the connection may
-- have moved elsewhere meanwhile); Redis deletes the user's Hash with its last field.
-- Then the member `<connection id> <user id>` leaves the reverse set. A fenced server
-- (declared dead) still loses the field (the janitor removes it anyway), but its reverse
-- set is not written and the answer is the error FENCED, noted in `server:{S}:refused`
-- (field `unregister`, and `last_ms`; it lives as long as the fence).
--
-- One node: KEYS[1] server:{S}:fenced  KEYS[2] server:{S}:refused  KEYS[3] server:{S}:users
--           KEYS[4] the user's Hash `user:{<user>}:conns`
-- Redis Cluster: call release.lua on the user's Hash first (KEYS[1] the Hash, ARGV
--   <connection> <S> 'hash'), then this script with KEYS[1] to KEYS[3] only (it then
--   answers 0).
-- ARGV[1] user id  ARGV[2] server id S  ARGV[3] connection id
-- Returns the number of fields deleted (0 or 1), or the error reply "FENCED ..." or
-- "BADCONN ..."

local fence, refusals, users, forward = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local user, server, connection = ARGV[1], ARGV[2], ARGV[3] or ''
local deleted = 0

if #connection < 1 or #connection > 200 or string.find(connection, '[^!-~]')
    or string.find(connection, '[{}]') then
  return redis.error_reply('BADCONN connection id must be 1 to 200 bytes of printable ASCII without whitespace or braces')
end
if forward and redis.call('HGET', forward, connection) == server then
  deleted = redis.call('HDEL', forward, connection)
end
if redis.call('EXISTS', fence) == 1 then
  local t = redis.call('TIME')
  redis.pcall('HINCRBY', refusals, 'unregister', 1)
  redis.pcall('HSET', refusals, 'last_ms', t[1] * 1000 + math.floor(t[2] / 1000))
  local ttl = redis.call('PTTL', fence)
  if ttl > 0 then redis.pcall('PEXPIRE', refusals, ttl) end
  return redis.error_reply('FENCED server ' .. server .. ' was declared dead: close its sockets and start again under a new server id')
end
redis.call('SREM', users, connection .. ' ' .. user)
return deleted
