
-- The evictions stream (see evictions/mod.rs): one `users.evicted` entry per 1,000 users
-- deleted, written in the same script as their deletes, so that on one node a user is
-- announced exactly when their entry is deleted. The payload is a MessagePack map with
-- named keys, encoded here by hand: Redis' cmsgpack cannot write the binary type that
-- user ids (any bytes) need.

local EVICTED_PER_ENTRY = 1000

-- `n` (0 <= n < 2^53) as `width` big-endian bytes.
local function mp_be(n, width)
  local out = {}
  for i = width, 1, -1 do
    out[i] = string.char(n % 256)
    n = math.floor(n / 256)
  end
  return table.concat(out)
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

local function mp_array_header(n)
  if n < 16 then return string.char(144 + n) end
  if n < 65536 then return '\220' .. mp_be(n, 2) end
  return '\221' .. mp_be(n, 4)
end

-- A map of string keys (fewer than 16) to values already encoded.
local function mp_map(pairs_)
  local out = {string.char(128 + #pairs_ / 2)}
  for i = 1, #pairs_, 2 do
    out[#out + 1] = mp_str(pairs_[i])
    out[#out + 1] = pairs_[i + 1]
  end
  return table.concat(out)
end

local function now_ms()
  local t = redis.call('TIME')
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

-- XADDs `users.evicted` entries for `users` (deleted by this script), 1,000 per entry.
-- Returns the number of entries written.
local function announce_evicted(stream, server, event_id, source, users)
  if not stream or stream == '' or #users == 0 then return 0 end
  local at = mp_uint(now_ms())
  local entries = 0
  for first = 1, #users, EVICTED_PER_ENTRY do
    local last = math.min(first + EVICTED_PER_ENTRY - 1, #users)
    local list, k = {mp_array_header(last - first + 1)}, 1
    for i = first, last do
      -- The per-user hot path: a cached header and the id itself go into the list, so
      -- no string is made per user (table.concat below copies each once).
      local user = users[i]
      local n = #user
      local header = BIN8[n]
      if n < 256 and not header then
        header = '\196' .. string.char(n)
        BIN8[n] = header
      end
      if header then
        list[k + 1], list[k + 2] = header, user
        k = k + 2
      else
        list[k + 1] = mp_bin(user)
        k = k + 1
      end
    end
    local payload = mp_map({
      'v', mp_uint(1), 'source', mp_str(source), 'server_id', mp_str(server),
      'event_id', mp_str(event_id), 'users', table.concat(list), 'evicted_at_ms', at,
    })
    redis.call('XADD', stream, '*', 'type', 'users.evicted', 'payload', payload)
    entries = entries + 1
  end
  return entries
end

-- str 8 headers by length (fixstr under 32), made as met.
local STR8 = {}

-- Layout conns: XADDs `connections.evicted` entries for `members` (`<connection id>
-- <user id>`, whose entries this script deleted; split by conn_parts in owners.lua),
-- 1,000 pairs per entry: `connections` is an array of [user id (binary), connection id
-- (string)]. Returns the entries written.
local function announce_connections_evicted(stream, server, event_id, source, members)
  if not stream or stream == '' or #members == 0 then return 0 end
  local at = mp_uint(now_ms())
  local entries = 0
  for first = 1, #members, EVICTED_PER_ENTRY do
    local last = math.min(first + EVICTED_PER_ENTRY - 1, #members)
    -- As in announce_evicted: cached headers and the ids themselves go into the list,
    -- so no string is made per pair.
    local list, k, n = {}, 1, 0
    for i = first, last do
      local connection, user = conn_parts(members[i])
      if connection then
        n = n + 1
        local ul, cl = #user, #connection
        local uh = BIN8[ul]
        if ul < 256 and not uh then
          uh = '\196' .. string.char(ul)
          BIN8[ul] = uh
        end
        local ch = STR8[cl]
        if not ch then
          if cl < 32 then ch = string.char(160 + cl)
          elseif cl < 256 then ch = '\217' .. string.char(cl)
          elseif cl < 65536 then ch = '\218' .. mp_be(cl, 2)
          else ch = '\219' .. mp_be(cl, 4) end
          STR8[cl] = ch
        end
        list[k + 1] = '\146'
        list[k + 2] = uh or mp_bin(user)
        if uh then
          list[k + 3] = user
        else
          list[k + 3] = ''
        end
        list[k + 4], list[k + 5] = ch, connection
        k = k + 5
      end
    end
    if n > 0 then
      list[1] = mp_array_header(n)
      local payload = mp_map({
        'v', mp_uint(1), 'source', mp_str(source), 'server_id', mp_str(server),
        'event_id', mp_str(event_id), 'connections', table.concat(list),
        'evicted_at_ms', at,
      })
      redis.call('XADD', stream, '*', 'type', 'connections.evicted', 'payload', payload)
      entries = entries + 1
    end
  end
  return entries
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
