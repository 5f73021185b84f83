-- registry-janitor connection-server protocol: delete a user's forward entry only if it
-- still names the given server (the atomic check-and-delete the janitor uses too).
--
-- Used on a Redis Cluster, where the forward entry and the server's keys are in different
-- slots: the first step of unregister, and the undo of a registration refused as FENCED.
--
-- KEYS[1] the forward entry: `registry` (layout hash) or `user:<user>` (layout keys)
-- ARGV[1] user id  ARGV[2] server id  ARGV[3] 'hash' or 'keys'
-- Returns the number of entries deleted (0 or 1)

if ARGV[3] == 'hash' then
  if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
elseif redis.call('GET', KEYS[1]) == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
