-- One step of cleaning a dead server, on a single Redis node (see cleanup.rs).
--
-- Takes the next chunk of the server's reverse set with SSCAN from the cursor stored
-- in the progress hash, deletes each forward entry that still points at the dead
-- server, and stores the next cursor. The check and the delete run inside this one
-- script, so they are atomic: a user who reconnected elsewhere (forward entry now names
-- another server) is never deleted.
--
-- Progress is the stored cursor (with the run_id of the Redis that issued it, and a
-- count of members scanned, for progress displays),
-- so a step may be repeated, run by two workers at once, or resumed after a crash, and
-- the end state is the same. The reverse set is not modified while it is walked (no
-- SREM per member: that would cost Redis a third of the work); a dead server's set no
-- longer grows, so one complete SSCAN pass sees every member. When the cursor comes back
-- to 0 the step UNLINKs the set (freed off Redis' main thread), drops the progress hash
-- and the server's `servers` entry: the server is clean.
--
-- KEYS[1] server:{S}:users   KEYS[2] server:{S}:cleanup   KEYS[3] servers
-- KEYS[4] registry (layout hash; unused for layout keys)
-- ARGV[1] server id   ARGV[2] SSCAN COUNT   ARGV[3] 'hash' or 'keys'
-- ARGV[4] forward key prefix for layout keys (<key_prefix>user:)
-- Returns {done (0/1), members scanned, entries deleted, entries kept (moved elsewhere)}

local users_key, progress_key, servers_key, registry_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local server, count, user_prefix = ARGV[1], ARGV[2], ARGV[4]
local hash_layout = ARGV[3] == 'hash'

-- A SCAN cursor means something only to the Redis process that issued it: after a
-- restart or a failover the set is rebuilt with another hash seed, and an old cursor
-- would skip members. The cursor is stored with the run_id of its Redis; under another
-- run_id the walk starts again from 0 (repeating steps is harmless).
local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
local progress = redis.call('HMGET', progress_key, 'cursor', 'run_id')
local cursor = progress[1] or '0'
if progress[2] ~= run_id then
  cursor = '0'
  redis.call('HSET', progress_key, 'scanned', 0)
end
local scan = redis.call('SSCAN', users_key, cursor, 'COUNT', count)
local next_cursor, members = scan[1], scan[2]

local deleted, kept = 0, 0
for first = 1, #members, BATCH do
  local last = math.min(first + BATCH - 1, #members)
  local owners = owners_of(members, first, last, hash_layout, registry_key, user_prefix)
  local doomed = {}
  for i = 1, #owners do
    local owner = owners[i]
    if owner == server then
      doomed[#doomed + 1] = members[first + i - 1]
    elseif owner then
      kept = kept + 1
    end
  end
  deleted = deleted + delete_forward(doomed, hash_layout, registry_key, user_prefix)
end

if next_cursor == '0' then
  redis.call('UNLINK', users_key, progress_key)
  redis.call('ZREM', servers_key, server)
  return {1, #members, deleted, kept}
end
redis.call('HSET', progress_key, 'cursor', next_cursor, 'run_id', run_id)
redis.call('HINCRBY', progress_key, 'scanned', #members)
return {0, #members, deleted, kept}
