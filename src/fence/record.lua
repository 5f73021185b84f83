-- Records the verdict against a server's incarnation: its fence (see fence/mod.rs).
-- Recording it again is harmless: the first verdict's time and entry are kept, and the
-- lifetime starts again from now.
--
-- A server the registry does not know (no liveness key, no reverse set, no set being
-- walked, no members set aside, and, where `servers` is given, not in it), with no
-- standing fence but one of its own kind, gets the short lifetime ARGV[3] and the field
-- `unknown` = 1. Every other fence gets the full lifetime ARGV[1], and loses `unknown`:
-- a server that became known since its short fence was recorded gets the full lifetime.
-- The checks and the write are this one script: a registration or a heartbeat of S is
-- either before it (S is known) or after it (refused by the fence).
--
-- KEYS[1] server:{S}:fenced  KEYS[2] server:{S}:alive  KEYS[3] server:{S}:users
-- KEYS[4] server:{S}:walking  KEYS[5] server:{S}:moved
-- KEYS[6] servers (one node; absent on a cluster, where it is in another slot)
-- ARGV[1] lifetime (ms)  ARGV[2] stream entry id of the server.dead event ('' for none)
-- ARGV[3] the lifetime of a fence of a server the registry does not know (ms; 0: such
--         a server gets the full lifetime too)  ARGV[4] server id S
-- Returns {fenced_at_ms of the first verdict, unix ms now (Redis TIME), 1 if the fence is
--          one of a server the registry does not know, else 0}

local fence = KEYS[1]
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local short = tonumber(ARGV[3] or '0') or 0
local unknown = false
if short > 0 then
  local standing = redis.call('EXISTS', fence) == 1
  unknown = (not standing or redis.call('HGET', fence, 'unknown'))
    and redis.call('EXISTS', KEYS[2], KEYS[3], KEYS[4], KEYS[5]) == 0
    and not (KEYS[6] and redis.call('ZSCORE', KEYS[6], ARGV[4]))
end
redis.call('HSETNX', fence, 'fenced_at_ms', now)
if ARGV[2] ~= '' then redis.call('HSETNX', fence, 'entry', ARGV[2]) end
if unknown then
  redis.call('HSET', fence, 'unknown', '1')
  redis.call('PEXPIRE', fence, short)
else
  redis.call('HDEL', fence, 'unknown')
  redis.call('PEXPIRE', fence, ARGV[1])
end
return {tonumber(redis.call('HGET', fence, 'fenced_at_ms')), now, unknown and 1 or 0}
