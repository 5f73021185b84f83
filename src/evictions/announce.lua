
-- The evictions stream (see evictions/mod.rs): one `users.evicted` entry per 1,000 users
-- deleted, written in the same script as their deletes, so that on one node a user is
-- announced exactly when their entry is deleted. The payload is a MessagePack map with
-- named keys, encoded here by hand: Redis' cmsgpack cannot write the binary type that
-- user ids (any bytes) need.

local EVICTED_PER_ENTRY = 1000

-- `n` (0 <= n < 2^53) as `width` (1, 2, 4 or 8) big-endian bytes, in one string.char:
-- each byte is n % 256, then n becomes (n - that byte) / 256 (= math.floor(n / 256)).
local function mp_be(n, width)
  local b1 = n % 256
  n = (n - b1) / 256
  if width == 1 then return string.char(b1) end
  local b2 = n % 256
  n = (n - b2) / 256
  if width == 2 then return string.char(b2, b1) end
  local b3 = n % 256
  n = (n - b3) / 256
  local b4 = n % 256
  n = (n - b4) / 256
  if width == 4 then return string.char(b4, b3, b2, b1) end
  local b5 = n % 256
  n = (n - b5) / 256
  local b6 = n % 256
  n = (n - b6) / 256
  local b7 = n % 256
  n = (n - b7) / 256
  return string.char(n % 256, b7, b6, b5, b4, b3, b2, b1)
end

local function mp_uint(n)
  if n < 128 then return string.char(n) end
  if n < 256 then return '\204' .. mp_be(n, 1) end
  if n < 65536 then return '\205' .. mp_be(n, 2) end
  if n < 4294967296 then return '\206' .. mp_be(n, 4) end
  return '\207' .. mp_be(n, 8)
end

local function mp_str(s)
  local n = #s
  if n < 32 then return string.char(160 + n) .. s end
  if n < 256 then return '\217' .. mp_be(n, 1) .. s end
  if n < 65536 then return '\218' .. mp_be(n, 2) .. s end
  return '\219' .. mp_be(n, 4) .. s
end

local function mp_bin(s)
  local n = #s
  -- The common case (user ids under 256 bytes) without mp_be's table: this runs per user.
  if n < 256 then return '\196' .. string.char(n) .. s end
  if n < 65536 then return '\197' .. mp_be(n, 2) .. s end
  return '\198' .. mp_be(n, 4) .. s
end

-- bin 8 headers by length, made as met.
local BIN8 = {}

local function bin8_header(n)
  local header = BIN8[n]
  if not header then
    header = '\196' .. string.char(n)
    BIN8[n] = header
  end
  return header
end

-- Appends to `out` (from index k + 1) the MessagePack `bin` items of users[first..last],
-- each its header and then its bytes; returns the new last index of `out`. This runs per
-- user, so it writes no table slot per user where it can help it: a run of ids of one
-- length under 256 bytes (the common case: ids of a fixed width) shares one header, and
-- table.concat(users, header, i, j) writes the run's ids with that header between them,
-- so the run goes into `out` as its first header and that one string.
local function mp_bin_items(out, k, users, first, last)
  local i = first
  while i <= last do
    local user = users[i]
    local n = #user
    if n < 256 then
      local j = i
      while j < last and #users[j + 1] == n do j = j + 1 end
      local header = BIN8[n] or bin8_header(n)
      out[k + 1] = header
      if j > i then
        out[k + 2] = table.concat(users, header, i, j)
      else
        out[k + 2] = user
      end
      k = k + 2
      i = j + 1
    else
      out[k + 1] = mp_bin(user)
      k = k + 1
      i = i + 1
    end
  end
  return k
end

local function mp_array_header(n)
  if n < 16 then return string.char(144 + n) end
  if n < 65536 then return '\220' .. mp_be(n, 2) end
  return '\221' .. mp_be(n, 4)
end

-- A map of string keys (fewer than 16) to values already encoded. The list is made at
-- its full size by the constructor (no table grows slot by slot), then each key is
-- encoded in its place.
local function mp_map(pairs_)
  local out = {string.char(128 + #pairs_ / 2), unpack(pairs_)}
  for i = 2, #out, 2 do out[i] = mp_str(out[i]) end
  return table.concat(out)
end

-- The TIME reply this script stamps its entries with: the first read, kept (a script is
-- atomic, so its entries share one instant); a script that reads TIME anyway sets it.
local TIME_READ

local function now_ms()
  local t = TIME_READ or redis.call('TIME')
  TIME_READ = t
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Refuses a step before any write when the evictions stream's key holds another type:
-- an XADD failing after the deletes would leave them unannounced.
local function check_evictions_stream(stream)
  if stream and stream ~= '' then
    local t = redis.call('TYPE', stream)
    t = type(t) == 'table' and t.ok or t
    if t ~= 'none' and t ~= 'stream' then
      return redis.error_reply('WRONGTYPE the evictions stream ' .. stream .. ' holds a ' .. t .. ', not a stream')
    end
  end
end

-- What precedes and follows the list in an eviction payload, made once per step: the map
-- of 6 pairs as mp_map makes it, with its keys written out (fixstr: 0xa0 + the length,
-- then the bytes): `v` 1, `source`, `server_id`, `event_id`, the list's key
-- (`list_key`, encoded: `users` or `connections`), then `evicted_at_ms`.
local function evicted_ends(source, server, event_id, list_key)
  local head = '\134\161v\1\166source' .. mp_str(source) .. '\169server_id' .. mp_str(server)
    .. '\168event_id' .. mp_str(event_id) .. list_key
  return head, '\173evicted_at_ms' .. mp_uint(now_ms())
end

-- XADDs `users.evicted` entries for `users` (deleted by this script), 1,000 per entry.
-- Returns the number of entries written.
local function announce_evicted(stream, server, event_id, source, users)
  if not stream or stream == '' or #users == 0 then return 0 end
  local head, tail = evicted_ends(source, server, event_id, '\165users')
  local entries = 0
  for first = 1, #users, EVICTED_PER_ENTRY do
    local last = math.min(first + EVICTED_PER_ENTRY - 1, #users)
    -- The constructor makes the header's slot and two more, which a run of ids of one
    -- length (the common case) fills; the list is read up to its last item.
    local list = {mp_array_header(last - first + 1), nil, nil}
    local k = mp_bin_items(list, 1, users, first, last)
    local payload = head .. table.concat(list, '', 1, k) .. tail
    redis.call('XADD', stream, '*', 'type', 'users.evicted', 'payload', payload)
    entries = entries + 1
  end
  return entries
end

-- str 8 headers by length (fixstr under 32), made as met.
local STR8 = {}

-- The str header of a connection id of `n` bytes (fixstr under 32), made as met.
local function str_header(n)
  local header = STR8[n]
  if not header then
    if n < 32 then header = string.char(160 + n)
    elseif n < 256 then header = '\217' .. string.char(n)
    elseif n < 65536 then header = '\218' .. mp_be(n, 2)
    else header = '\219' .. mp_be(n, 4) end
    STR8[n] = header
  end
  return header
end

-- A pair's array header and its user's bin 8 header, by the user id's length (under
-- 256), made as met: one slot of the list per pair less.
local PAIR_BIN8 = {}

local function pair_bin8_header(n)
  local header = '\146' .. (BIN8[n] or bin8_header(n))
  PAIR_BIN8[n] = header
  return header
end

-- Layout conns: XADDs `connections.evicted` entries for the pairs (users[i],
-- connections[i]), i = 1..n (whose entries this script deleted), 1,000 pairs per entry:
-- `connections` is an array of [user id (binary), connection id (string)]. Returns the
-- entries written.
local function announce_connection_pairs(stream, server, event_id, source, users, connections, n)
  if not stream or stream == '' or n == 0 then return 0 end
  local head, tail = evicted_ends(source, server, event_id, '\171connections')
  local entries = 0
  for first = 1, n, EVICTED_PER_ENTRY do
    local last = math.min(first + EVICTED_PER_ENTRY - 1, n)
    -- As in announce_evicted: cached headers and the ids themselves go into the list,
    -- so no string is made per pair.
    local list, k = {mp_array_header(last - first + 1)}, 1
    for i = first, last do
      local user, connection = users[i], connections[i]
      local ul, cl = #user, #connection
      if ul < 256 then
        list[k + 1], list[k + 2] = PAIR_BIN8[ul] or pair_bin8_header(ul), user
      else
        list[k + 1], list[k + 2] = '\146', mp_bin(user)
      end
      list[k + 3], list[k + 4] = STR8[cl] or str_header(cl), connection
      k = k + 4
    end
    local payload = head .. table.concat(list) .. tail
    redis.call('XADD', stream, '*', 'type', 'connections.evicted', 'payload', payload)
    entries = entries + 1
  end
  return entries
end

-- Layout conns: announce_connection_pairs for `members` (`<connection id> <user id>`,
-- whose entries this script deleted; split by conn_parts in owners.lua; a member that is
-- not one of this layout is left out).
local function announce_connections_evicted(stream, server, event_id, source, members)
  if not stream or stream == '' or #members == 0 then return 0 end
  local users, connections, n = {}, {}, 0
  for i = 1, #members do
    local connection, user = conn_parts(members[i])
    if connection then
      n = n + 1
      users[n], connections[n] = user, connection
    end
  end
  return announce_connection_pairs(stream, server, event_id, source, users, connections, n)
end

-- The announcement of deleted reverse-set members for `layout`: `users.evicted` (hash,
-- keys) or `connections.evicted` (conns).
local function announce_members(stream, server, event_id, source, members, layout)
  if layout == 'conns' then
    return announce_connections_evicted(stream, server, event_id, source, members)
  end
  return announce_evicted(stream, server, event_id, source, members)
end

-- XADDs the `server.cleaned` entry of a finished cleanup.
local function announce_cleaned(stream, server, event_id, deleted, kept)
  if not stream or stream == '' then return end
  local payload = mp_map({
    'v', mp_uint(1), 'server_id', mp_str(server), 'event_id', mp_str(event_id),
    'deleted', mp_uint(deleted), 'kept', mp_uint(kept), 'cleaned_at_ms', mp_uint(now_ms()),
  })
  redis.call('XADD', stream, '*', 'type', 'server.cleaned', 'payload', payload)
end
