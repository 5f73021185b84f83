-- Shared prelude of the janitor's scripts (concatenated in front of each at build time).

-- unpack() is bounded by Lua's C stack (8000 slots): lists go to Redis in batches.
local BATCH = 1000

-- Layout `conns`: a reverse-set member is `<connection id> <user id>` (split at the first
-- space: a connection id has none), and the forward entry is field <connection id> of the
-- user's Hash `<key_prefix>user:{<user id>}:conns`. A member is split once per script
-- (the check, the delete and the announcement each need its parts), its parts kept in
-- flat tables by member: no table per member.
local CONN_ID, CONN_USER, CONN_KEY = {}, {}, {}

-- The rule of connection (and server) ids: 1 to CONN_ID_MAX bytes of printable ASCII
-- without whitespace or braces ('!' to '~' but '{' and '}'). CONN_MEMBER splits a member
-- and checks its connection id in one match: the id is the run of allowed bytes at the
-- start, and the byte after it must be a space (so it is the first space); the user id
-- is the rest. Only the length is left to check.
local CONN_ID_MAX = 200
local CONN_MEMBER = '^([!-z|~]+) (.*)$'

-- Whether `c` keeps the rule of connection ids.
local function is_conn_id(c)
  return #c >= 1 and #c <= CONN_ID_MAX and not string.find(c, '[^!-z|~]')
end

-- The connection id and the user id of `member`, or nil for a member that is not one of
-- this layout (no space, or a connection id that breaks the rule: no protocol writer
-- makes one, and it is never read as another user's entry).
local function conn_parts(member)
  local connection = CONN_ID[member]
  if connection == nil then
    local c, user = string.match(member, CONN_MEMBER)
    if c and #c <= CONN_ID_MAX then
      connection = c
      CONN_USER[member] = user
    else
      connection = false
    end
    CONN_ID[member] = connection
  end
  if connection then return connection, CONN_USER[member] end
end

-- The connection id and the user's Hash of `member` (`user_prefix` is the same for every
-- call of a script), or nil.
local function conn_entry(member, user_prefix)
  local connection, user = conn_parts(member)
  if not connection then return nil end
  local key = CONN_KEY[member]
  if not key then
    key = user_prefix .. '{' .. user .. '}:conns'
    CONN_KEY[member] = key
  end
  return connection, key
end

-- The forward entries (owner server ids, false where none) of members[first..last].
-- `layout` is 'hash', 'keys' or 'conns' (the setting). Layout `keys`: the entries' keys
-- too, in the same order (delete_forward takes them).
local function owners_of(members, first, last, layout, registry_key, user_prefix)
  if layout == 'hash' then
    return redis.call('HMGET', registry_key, unpack(members, first, last))
  end
  if layout == 'conns' then
    local owners = {}
    for i = first, last do
      local owner = false
      local connection, key = conn_entry(members[i], user_prefix)
      if connection then
        -- A key of another type is no entry of this layout (MGET reads it so too).
        owner = redis.pcall('HGET', key, connection)
        if type(owner) ~= 'string' then owner = false end
      end
      owners[#owners + 1] = owner
    end
    return owners
  end
  local forward = {}
  for i = first, last do forward[i - first + 1] = user_prefix .. members[i] end
  return redis.call('MGET', unpack(forward)), forward
end

-- Deletes the forward entries of members[first..last] (default: all of `members`; at most
-- BATCH; already checked by the caller, in this script). Layout `conns`: one HDEL of the
-- connection's field each; Redis deletes the user's Hash with its last field, so no empty
-- Hash is left. Layout `keys`: `keys`, when given, are the entries' keys of
-- members[first..last] as owners_of returned them.
local function delete_forward(members, layout, registry_key, user_prefix, first, last, keys)
  first, last = first or 1, last or #members
  if last < first then return 0 end
  if layout == 'hash' then return redis.call('HDEL', registry_key, unpack(members, first, last)) end
  if layout == 'conns' then
    local deleted = 0
    for i = first, last do
      local connection, key = conn_entry(members[i], user_prefix)
      if connection then deleted = deleted + redis.call('HDEL', key, connection) end
    end
    return deleted
  end
  if keys then return redis.call('DEL', unpack(keys)) end
  local forward = {}
  for i = first, last do forward[i - first + 1] = user_prefix .. members[i] end
  return redis.call('DEL', unpack(forward))
end

-- The contract's server id rule: 1 to 200 bytes of printable ASCII, no braces. A value
-- that breaks it never goes into a key name.
local function valid_server_id(s)
  return #s >= 1 and #s <= 200 and not string.find(s, '[^!-~]') and not string.find(s, '[{}]')
end
