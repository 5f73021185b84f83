-- The bench's `careful` reference (the Redis CPU reference): one chunk of a dead server's
-- users checked and deleted in one call, as a straightforward careful cleanup would.
--
-- KEYS[1] registry, or '' for layout keys
-- KEYS[2] the dead server's reverse set
-- ARGV[1] server id
-- ARGV[2] layout: 'hash', 'keys' or 'conns'
-- ARGV[3] user key prefix (layouts keys and conns)
-- ARGV[4..] users of the chunk
-- Returns the number of forward entries deleted.
local users = {}
for i = 4, #ARGV do users[#users + 1] = ARGV[i] end
local owners, doomed = nil, {}
if ARGV[2] == 'conns' then
  -- Members `<connection> <user>`: the connection's field in the user's Hash.
  local deleted = 0
  for i = 1, #users do
    local at = string.find(users[i], ' ', 1, true)
    local key = ARGV[3] .. '{' .. string.sub(users[i], at + 1) .. '}:conns'
    local connection = string.sub(users[i], 1, at - 1)
    if redis.call('HGET', key, connection) == ARGV[1] then
      deleted = deleted + redis.call('HDEL', key, connection)
    end
  end
  redis.call('SREM', KEYS[2], unpack(users))
  return deleted
end
if ARGV[2] == 'hash' then owners = redis.call('HMGET', KEYS[1], unpack(users))
else
  local ks = {}
  for i = 1, #users do ks[i] = ARGV[3] .. users[i] end
  owners = redis.call('MGET', unpack(ks))
end
for i = 1, #users do
  if owners[i] == ARGV[1] then
    doomed[#doomed + 1] = (ARGV[2] == 'hash') and users[i] or (ARGV[3] .. users[i])
  end
end
if #doomed > 0 then
  if ARGV[2] == 'hash' then redis.call('HDEL', KEYS[1], unpack(doomed))
  else redis.call('DEL', unpack(doomed)) end
end
redis.call('SREM', KEYS[2], unpack(users))
return #doomed
