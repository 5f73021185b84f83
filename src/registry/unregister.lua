-- A clean disconnect, the forward half: the entry goes only if it still names this server
-- (the user may have reconnected elsewhere meanwhile). The caller then SREMs the member.
--
-- KEYS[1] forward hash (layout hash) or key (layout keys)
-- ARGV[1] user  ARGV[2] server  ARGV[3] 'hash' or 'keys'
-- Returns the number of entries deleted (0 or 1)
if ARGV[3] == 'hash' then
  if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
elseif redis.call('GET', KEYS[1]) == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
