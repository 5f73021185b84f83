-- One step of cleaning a dead server, on a single Redis node (see cleanup.rs).
--
-- Deletes the next chunk of forward entries that still point at the dead server; the
-- check and the delete run inside this one script, so a user who reconnected elsewhere
-- (forward entry now names another server) is never deleted.
--
-- Where the members come from, in this order:
-- 1. `moved`: members the reverse-index sweep set aside while S looked alive (popped).
-- 2. `walking`: S's reverse set, renamed away from `users` when a walk starts (RENAME in
--    one hash tag is O(1)). A member added to `users` during the walk (a zombie S, a
--    false-positive death, a registration in two steps) lands in a new `users` set,
--    which is renamed and walked in turn once `walking` is done. SSCAN alone would not
--    do: it does not promise to return members added during the scan.
-- S is clean when `moved`, `walking` and `users` are all gone, as seen by one atomic
-- step: that step unlinks the progress record, removes S from `servers` and, when given
-- an entry id, acknowledges the event in the same script, so no member added before
-- the acknowledgement is missed.
--
-- Two ways to walk `walking`:
-- - 'scan' (the default): SSCAN from a cursor stored in the progress hash, tied to the
--   run_id of the Redis that issued it (a cursor means nothing to another process: after
--   a restart or a failover the walk starts again from 0). The set is not modified while
--   it is walked (an SREM per member would cost Redis about a third more).
-- - 'pop': SPOP the chunk. Needs no cursor and writes nothing that takes memory, so it is
--   used once a step was refused with OOM (the cleanup is what frees memory) and when
--   INFO gives no run_id (some proxies and managed services), where a cursor could not be
--   trusted. Safe on one node because the pop and the deletes are one atomic script.
--   (Redis 7.0 refuses a script's command that takes memory only while the script has
--   written nothing; a step's first write is the ZPOPMIN of `moved`, which takes none, so
--   there a step out of memory is not refused and writes its cursor.)
-- The two may alternate or run side by side (workers on duplicate events): SSCAN still
-- returns every member that stays in the set, and popped members were handled.
--
-- The cursor fields are `walk_cursor` and `walk_run_id`: a cursor of the `walking` set,
-- never of `users`.
--
-- The data format (format/mod.rs): before anything else, the step checks that the
-- worker's build works under the format in use (KEYS[8], absent: 1) and under the format
-- the progress record was written under (its field `format`, absent: 1), and refuses
-- otherwise with the error code FORMAT, writing nothing: a worker older than the format
-- in use makes no step once the format moved on (the check and the step are one
-- script). Every format of a build's range walks the same way so far; a release that
-- adds a format branches here on `in_use` (what it writes) and `stamp` (what it reads).
-- A step that writes the progress record stamps it with the format in use when the
-- record says another (a record without the field is in format 1).
--
-- KEYS[1] server:{S}:users   KEYS[2] server:{S}:walking   KEYS[3] server:{S}:moved
-- KEYS[4] server:{S}:cleanup KEYS[5] servers   KEYS[6] registry (layout hash)
-- KEYS[7] events stream   KEYS[8] janitor:{format}:in_use
-- KEYS[9] the evictions stream (absent when switched off)
-- ARGV[1] server id   ARGV[2] chunk size   ARGV[3] 'hash', 'keys' or 'conns'
-- ARGV[4] forward key prefix for layouts keys and conns (<key_prefix>user:)   ARGV[5] 'scan' or 'pop'
-- ARGV[6] consumer group   ARGV[7] entry id to acknowledge when clean ('' for none)
-- ARGV[8] the event's event_id, for the evictions stream ('' for none)
-- ARGV[9] the worker's format   ARGV[10] the oldest format it works under
-- Returns {done (0/1), members handled, entries deleted, entries kept, mode used,
--          evictions entries written, this script's execution time in microseconds}
-- The execution time (TIME at the start and at the end) lets the worker tell how long
-- the step waited in Redis' queue: its round trip minus this (see cleanup/limiter.rs).
--
-- Layout conns: a member is `<connection id> <user id>`; its entry is the connection's
-- field in the user's Hash, deleted only if it still names S (check_delete_conns, below;
-- owners.lua has the rule).
--
-- Evictions: the users this step deleted are announced in `users.evicted` entries of
-- KEYS[9] (announce.lua; layout conns: `connections.evicted`, the (user, connection)
-- pairs), in this script, so each deleted user is announced exactly once
-- and a kept one never. The step that acknowledges the event (XACK answered 1: only one
-- step can) announces `server.cleaned` with the totals of the cleanup, counted in the
-- progress hash (`evicted`, `kept`).

local started = redis.call('TIME')
TIME_READ = started -- the evictions entries' instant (announce.lua)
local function elapsed_us()
  local now = redis.call('TIME')
  local us = tonumber(now[2]) - tonumber(started[2])
  -- The seconds are parsed only when they differ (a step mostly ends in the second it
  -- started).
  if now[1] ~= started[1] then
    us = us + (tonumber(now[1]) - tonumber(started[1])) * 1000000
  end
  -- TIME is the wall clock: never negative if it is stepped back during the script.
  return math.max(0, us)
end

local users_key, walking_key, moved_key = KEYS[1], KEYS[2], KEYS[3]
local progress_key, servers_key, registry_key, events_key = KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local server, count, user_prefix = ARGV[1], ARGV[2], ARGV[4]
-- The chunk size as the commands get it: ARGV[2] itself when it is the digits Redis makes
-- of the number (no sign, no leading zero, at most 9 digits), which spares turning a Lua
-- number into a string in each command; else the number.
if not (count and string.find(count, '^[1-9]%d?%d?%d?%d?%d?%d?%d?%d?$')) then
  count = tonumber(count)
end
local layout = ARGV[3]
local mode = ARGV[5]
local evictions, event_id = KEYS[9], ARGV[8] or ''
local announced = 0

local build_format, build_min = tonumber(ARGV[9]), tonumber(ARGV[10])
local in_use_value = redis.call('GET', KEYS[8])
local in_use = 1
if in_use_value then in_use = tonumber(in_use_value) end
if not in_use then
  return redis.error_reply('ERR ' .. KEYS[8] .. ' holds ' .. in_use_value .. ', not a format number')
end
-- The progress record's fields this step uses, read once: what the step writes back it
-- keeps here too, so it never reads what it wrote (an absent field is nil; the
-- constructor makes the table at its full size).
local values = redis.call('HMGET', progress_key, 'format', 'walk_cursor', 'walk_run_id',
  'scanned', 'evicted', 'kept')
local record = {
  format = values[1] or nil, walk_cursor = values[2] or nil, walk_run_id = values[3] or nil,
  scanned = values[4] or nil, evicted = values[5] or nil, kept = values[6] or nil,
}
local recorded = (values[1] or values[2] or values[3] or values[4] or values[5] or values[6])
  and true or false
-- A record may hold none of them (only `last_error`, record_failure.lua).
if not recorded then recorded = redis.call('EXISTS', progress_key) == 1 end
-- The format the record is in: a record without the field (or not written yet) is in
-- format 1; a record not written yet is never refused.
local stamp = 1
if recorded and record.format then
  stamp = tonumber(record.format) or 0
end
-- The refusal names the formats this worker works under (made only when refusing).
local function refuse(why)
  return redis.error_reply('FORMAT ' .. why .. '; this worker works under formats '
    .. build_min .. ' to ' .. build_format)
end
if in_use > build_format or in_use < build_min then
  return refuse('format ' .. in_use .. ' is in use')
end
if recorded and (stamp > build_format or stamp < build_min) then
  return refuse('the cleanup of ' .. server .. ' was written under format ' .. stamp)
end
-- Writes `pairs_` (field, value, ...) to the progress record in one HSET, with the
-- format in use when the record says another (the stamp goes only where the step writes
-- the record anyway).
local function write_record(pairs_)
  if stamp ~= in_use then
    pairs_[#pairs_ + 1] = 'format'
    pairs_[#pairs_ + 1] = in_use
    stamp = in_use
  end
  redis.call('HSET', progress_key, unpack(pairs_))
end

-- The record's counters (a field that is absent or not a number counts as 0).
local function counter(name)
  local value = record[name]
  if not value then return 0 end
  return tonumber(value) or 0
end

local check = check_evictions_stream(evictions)
if check then return check end

local run_id
if mode == 'scan' then
  local info = redis.pcall('INFO', 'server')
  -- A plain search (no pattern) for the field, then its 40 hex digits (a pattern anchored
  -- where they start).
  local at = type(info) == 'string' and string.find(info, 'run_id:', 1, true)
  if at and string.find(info,
    '^%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x',
    at + 7) then
    run_id = string.sub(info, at + 7, at + 46)
  end
  if not run_id then mode = 'pop' end
end

-- The members of members[first..] whose owner (owners[i], for members[first + i - 1]) is
-- S: nil when all are (the common case: no list is made, the range is the answer), else
-- a list of them; then how many owners name another server; then, given `keys` (layout
-- keys: the entries' keys, keys[i] for owners[i]), the list of the doomed ones' keys.
local function doomed_of(members, first, owners, keys)
  local n = #owners
  local i = 1
  while i <= n and owners[i] == server do i = i + 1 end
  if i > n then return nil, 0 end
  local doomed, d, kept = {}, i - 1, 0
  local doomed_keys = keys and {}
  for j = 1, d do doomed[j] = members[first + j - 1] end
  if keys then
    for j = 1, d do doomed_keys[j] = keys[j] end
  end
  for j = i, n do
    local owner = owners[j]
    if owner == server then
      d = d + 1
      doomed[d] = members[first + j - 1]
      if keys then doomed_keys[d] = keys[j] end
    elseif owner then
      kept = kept + 1
    end
  end
  return doomed, kept, doomed_keys
end

-- Totals for `server.cleaned`, in one HSET. Only after a write of this step (a pop or
-- a delete), so that out of memory they are let through, and never on a finished
-- cleanup's record. Returns `deleted` and `kept`.
local function record_totals(deleted, kept)
  if deleted > 0 then record.evicted = counter('evicted') + deleted end
  if kept > 0 then record.kept = counter('kept') + kept end
  if deleted > 0 and kept > 0 then
    write_record({'evicted', record.evicted, 'kept', record.kept})
  elseif deleted > 0 then
    write_record({'evicted', record.evicted})
  elseif kept > 0 then
    write_record({'kept', record.kept})
  end
  return deleted, kept
end

-- Layout conns: check_delete's checks, deletes and announcement, in one pass per batch
-- that splits each member once and keeps its parts by position (no table keyed by
-- member, no call per member but Redis's): what owners_of, delete_forward and
-- announce_members do for this layout, at a fraction of the Lua work per member (which
-- cost Redis more than the HGET and the HDEL themselves, under callgrind). A member is
-- split by CONN_MEMBER and CONN_ID_MAX (owners.lua), as conn_parts does: a member that
-- is not one of this layout has no entry. Per batch the reads come first, then the
-- deletes of the entries that name S, as check_delete does. Returns the entries deleted
-- and kept.
local function check_delete_conns(members)
  local match, pcall_, call = string.match, redis.pcall, redis.call
  local deleted, kept = 0, 0
  -- The doomed entries' parts, of every batch (d of them), for the deletes and the
  -- announcement.
  local keys, conns, users, d = {}, {}, {}, 0
  for first = 1, #members, BATCH do
    local last = math.min(first + BATCH - 1, #members)
    local batch_start = d + 1
    for i = first, last do
      local connection, user = match(members[i], CONN_MEMBER)
      if connection and #connection <= CONN_ID_MAX then
        local key = user_prefix .. '{' .. user .. '}:conns'
        -- A key of another type is no entry of this layout (MGET reads it so too).
        local owner = pcall_('HGET', key, connection)
        if owner == server then
          d = d + 1
          keys[d], conns[d], users[d] = key, connection, user
        elseif type(owner) == 'string' then
          kept = kept + 1
        end
      end
    end
    for j = batch_start, d do
      deleted = deleted + call('HDEL', keys[j], conns[j])
    end
  end
  announced = announced + announce_connection_pairs(evictions, server, event_id, 'cleanup',
    users, conns, d)
  return deleted, kept
end

local function check_delete(members)
  if layout == 'conns' then return record_totals(check_delete_conns(members)) end
  local deleted, kept = 0, 0
  local evicted = {}
  for first = 1, #members, BATCH do
    local last = math.min(first + BATCH - 1, #members)
    local owners, keys = owners_of(members, first, last, layout, registry_key, user_prefix)
    local doomed, others, doomed_keys = doomed_of(members, first, owners, keys)
    kept = kept + others
    if not doomed then
      deleted = deleted + delete_forward(members, layout, registry_key, user_prefix, first, last,
        keys)
    else
      deleted = deleted + delete_forward(doomed, layout, registry_key, user_prefix, nil, nil,
        doomed_keys)
    end
    if #members <= BATCH then
      evicted = doomed or members -- one batch: its doomed are all the step's
    else
      local from = doomed or members
      local a, b = 1, #from
      if not doomed then a, b = first, last end
      for i = a, b do evicted[#evicted + 1] = from[i] end
    end
  end
  announced = announced + announce_members(evictions, server, event_id, 'cleanup', evicted, layout)
  return record_totals(deleted, kept)
end

-- Clean if nothing is left anywhere; then the bookkeeping goes and the event is acked.
local function finish_if_clean()
  if redis.call('EXISTS', users_key, walking_key, moved_key) > 0 then return 0 end
  redis.call('UNLINK', progress_key)
  redis.call('ZREM', servers_key, server)
  if ARGV[7] ~= '' and redis.call('XACK', events_key, ARGV[6], ARGV[7]) == 1 then
    announce_cleaned(evictions, server, event_id, counter('evicted'), counter('kept'))
  end
  return 1
end

-- ZPOPMIN of an absent key pops and writes nothing: no EXISTS before it.
local popped = redis.call('ZPOPMIN', moved_key, count)
if #popped > 0 then
  local members = {}
  for i = 1, #popped, 2 do members[#members + 1] = popped[i] end
  local deleted, kept = check_delete(members)
  return {finish_if_clean(), #members, deleted, kept, mode, announced, elapsed_us()}
end

-- 'scan' mode (every mode but 'pop'): the SSCAN of `walking` from the cursor, only where
-- it was issued (by this Redis process: its run_id, read by this step), else from 0. The
-- SSCAN (a read) comes before the question whether `walking` exists: a reply with members
-- or with a cursor other than 0 answers it (a set that exists is never empty), and only
-- an empty last reply asks EXISTS. A walk that starts here is scanned from 0. A stored
-- cursor that is not the digits SSCAN takes (a record written by hand, or damaged) is
-- no cursor: the walk starts again from 0, rather than every step failing on it.
local scan
if mode ~= 'pop' then
  local cursor = '0'
  if record.walk_run_id == run_id then
    local stored = record.walk_cursor
    if stored and #stored <= 19 and not string.find(stored, '%D') then cursor = stored end
  end
  scan = redis.call('SSCAN', walking_key, cursor, 'COUNT', count)
end
if not (scan and (scan[1] ~= '0' or #scan[2] > 0))
  and redis.call('EXISTS', walking_key) == 0 then
  if redis.call('EXISTS', users_key) == 0 then
    return {finish_if_clean(), 0, 0, 0, mode, announced, elapsed_us()}
  end
  redis.call('RENAME', users_key, walking_key)
  -- HDEL takes no memory: a new walk starts from cursor 0 even in 'pop' mode.
  redis.call('HDEL', progress_key, 'walk_cursor', 'walk_run_id')
  record.walk_cursor, record.walk_run_id = nil, nil
  -- While anything of S is left to walk, S stays in `servers` (score kept if it has one):
  -- a walk that started after another step had finished S (members a zombie added) and
  -- was then abandoned is reported again by the reconciler, not left forever.
  redis.pcall('ZADD', servers_key, 'NX', 0, server)
  if scan then scan = redis.call('SSCAN', walking_key, '0', 'COUNT', count) end
end

local members, walked
if mode == 'pop' then
  members = redis.call('SPOP', walking_key, count)
  walked = redis.call('EXISTS', walking_key) == 0
else
  members = scan[2]
  walked = scan[1] == '0'
  -- The cursor and the count walked, in one HSET (the step's first write).
  local scanned = counter('scanned') + #members
  if walked then
    write_record({'scanned', scanned})
  else
    write_record({'scanned', scanned, 'walk_cursor', scan[1], 'walk_run_id', run_id})
  end
end
local deleted, kept = check_delete(members)

if walked then
  redis.call('UNLINK', walking_key)
  redis.call('HDEL', progress_key, 'walk_cursor', 'walk_run_id')
  return {finish_if_clean(), #members, deleted, kept, mode, announced, elapsed_us()}
end
return {0, #members, deleted, kept, mode, announced, elapsed_us()}
