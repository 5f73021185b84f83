-- Records the verdict against a server's incarnation: its fence (see fence/mod.rs).
-- Recording it again is harmless: the first verdict's time and entry are kept, and the
-- lifetime starts again from now.
--
-- KEYS[1] server:{S}:fenced
-- ARGV[1] lifetime (ms)  ARGV[2] stream entry id of the server.dead event ('' for none)
-- Returns {fenced_at_ms of the first verdict, unix ms now (Redis TIME)}

local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('HSETNX', KEYS[1], 'fenced_at_ms', now)
if ARGV[2] ~= '' then redis.call('HSETNX', KEYS[1], 'entry', ARGV[2]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return {tonumber(redis.call('HGET', KEYS[1], 'fenced_at_ms')), now}
