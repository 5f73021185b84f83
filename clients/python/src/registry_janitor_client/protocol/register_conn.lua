-- registry-janitor connection-server protocol, layout conns: register one connection of a
-- user on this server.
--
-- The user's connections are one Hash `user:{<user>}:conns` (field = connection id, value =
-- server id); this server's reverse set holds the member `<connection id> <user id>`.
-- A connection already registered elsewhere moves here (its field is overwritten; the
-- old server's member is left, and its cleanup keeps the entry, which no longer names it).
--
-- The fence check and the writes are one atomic step: a server declared dead (its fence
-- `server:{S}:fenced` exists) writes nothing and gets the error FENCED, noted in
-- `server:{S}:refused` (field `register`, and `last_ms`; it lives as long as the fence).
-- A connection id that breaks the rule (1 to 200 bytes of printable ASCII, no whitespace,
-- no braces) is refused with the error BADCONN, before anything is written.
--
-- One node: KEYS[1] server:{S}:fenced  KEYS[2] server:{S}:refused  KEYS[3] server:{S}:users
--           KEYS[4] the user's Hash `user:{<user>}:conns`
-- Redis Cluster: the user's Hash is in another slot. If KEYS[1] exists, call this script
--   with KEYS[1] to KEYS[3] only (it refuses, and notes it) and write nothing else.
--   Otherwise write the field first (HSET user:{<user>}:conns <connection> <S>), then call
--   this script with KEYS[1] to KEYS[3] only. If it answers FENCED, undo the field with
--   release.lua (KEYS[1] the user's Hash, ARGV <connection> <S> 'hash').
-- ARGV[1] user id  ARGV[2] server id S  ARGV[3] connection id
-- Returns 1, or the error reply "FENCED ..." or "BADCONN ..."
-- (Every key name carries the deployment's key_prefix.)

local fence, refusals, users, forward = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local user, server, connection = ARGV[1], ARGV[2], ARGV[3] or ''

if #connection < 1 or #connection > 200 or string.find(connection, '[^!-~]')
    or string.find(connection, '[{}]') then
  return redis.error_reply('BADCONN connection id must be 1 to 200 bytes of printable ASCII without whitespace or braces')
end
if redis.call('EXISTS', fence) == 1 then
  local t = redis.call('TIME')
  redis.pcall('HINCRBY', refusals, 'register', 1)
  redis.pcall('HSET', refusals, 'last_ms', t[1] * 1000 + math.floor(t[2] / 1000))
  local ttl = redis.call('PTTL', fence)
  if ttl > 0 then redis.pcall('PEXPIRE', refusals, ttl) end
  return redis.error_reply('FENCED server ' .. server .. ' was declared dead: close its sockets and start again under a new server id')
end
if forward then redis.call('HSET', forward, connection, server) end
redis.call('SADD', users, connection .. ' ' .. user)
return 1
