-- Shared prelude of the janitor's scripts (concatenated in front of each at build time).

-- unpack() is bounded by Lua's C stack (8000 slots): lists go to Redis in batches.
local BATCH = 1000

-- The forward entries (owner server ids, false where none) of members[first..last].
local function owners_of(members, first, last, hash_layout, registry_key, user_prefix)
  if hash_layout then
    return redis.call('HMGET', registry_key, unpack(members, first, last))
  end
  local forward = {}
  for i = first, last do forward[#forward + 1] = user_prefix .. members[i] end
  return redis.call('MGET', unpack(forward))
end

-- Deletes the forward entries of `users` (already checked by the caller, in this script).
local function delete_forward(users, hash_layout, registry_key, user_prefix)
  if #users == 0 then return 0 end
  if hash_layout then return redis.call('HDEL', registry_key, unpack(users)) end
  local forward = {}
  for i = 1, #users do forward[i] = user_prefix .. users[i] end
  return redis.call('DEL', unpack(forward))
end

-- The contract's server id rule: 1 to 200 bytes of printable ASCII, no braces. A value
-- that breaks it never goes into a key name.
local function valid_server_id(s)
  return #s >= 1 and #s <= 200 and not string.find(s, '[^!-~]') and not string.find(s, '[{}]')
end
