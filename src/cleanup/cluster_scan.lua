#!lua flags=allow-oom
-- Cluster cleanup, part 1 of a chunk (slot of {S}): the next members of the dead
-- server's reverse set, from the stored cursor. As in clean_step.lua, the set is renamed
-- to `walking` when a walk starts, so that members added during the walk land in a new
-- `users` set that is walked next; and a cursor stored under another run_id (restart,
-- failover) is not trusted: the walk starts again from 0.
--
-- The walk's bookkeeping lives in the progress hash, not in a worker's memory, so that it
-- survives a takeover: `walk` numbers the walks (a new set, a walk again, a restart after
-- a failover each take a new number, so that an advance from an earlier walk, which may
-- carry the same cursor, is refused), `epoch` is the cluster's epoch (greatest config epoch) when the
-- walk started (a failover since then may have lost acknowledged deletes:
-- cluster_advance.lua then walks the set again), `rewalks` how often this set has been
-- walked again.
--
-- Members the reverse-index sweep set aside while S looked alive (`moved`, a Sorted Set)
-- join `users` before a walk starts, a bounded batch (COUNT) per call, so that no call
-- holds Redis long (the reply is then an empty chunk, cursor 'fold'); the walk starts
-- once `moved` is empty, and checks them like any member (deleted only if their entry
-- still names S). Members are added before the walk, never during it: SSCAN promises only
-- the members present for the whole scan.
--
-- `allow-oom`: the bookkeeping writes here are small, and must go through when Redis is
-- out of memory, since the cleanup is what frees it (on one node clean_step.lua's
-- deletes come first, which Redis does not refuse).
--
-- Moves no cursor: the cursor moves only after the chunk's entries are deleted
-- (cluster_advance.lua), so a crash in between just repeats the chunk.
--
-- The data format (format/mod.rs): the format in use lives in another slot, so the
-- worker reads it before each chunk (ARGV[5]) and stops when its build does not work
-- under it; this script refuses, with the error code FORMAT and before any write, a
-- chunk whose progress record was written under a format the worker's build does not
-- work under (its field `format`, absent: 1), as a newer worker's steps leave it once the
-- format moved on. A record this script writes is stamped with the format in use.
--
-- KEYS[1] server:{S}:users  KEYS[2] server:{S}:walking  KEYS[3] server:{S}:cleanup
-- KEYS[4] server:{S}:moved
-- ARGV[1] SSCAN COUNT  ARGV[2] the cluster's epoch as the worker last read it
-- ARGV[3] the worker's format  ARGV[4] the oldest format it works under
-- ARGV[5] the format in use, as the worker read it before this chunk
-- Returns {walk number, cursor used, next cursor, members};
-- {'', '', '0', {}} when there is nothing to walk

-- The format the record is in: a record without the field (or not written yet) is in
-- format 1; a record not written yet is never refused.
local in_use = tonumber(ARGV[5])
local stamp = 1
local recorded = redis.call('EXISTS', KEYS[3]) == 1
if recorded then
  stamp = tonumber(redis.call('HGET', KEYS[3], 'format') or '1') or 0
end
if recorded and (stamp > tonumber(ARGV[3]) or stamp < tonumber(ARGV[4])) then
  return redis.error_reply('FORMAT the cleanup was written under format ' .. stamp
    .. '; this worker works under formats ' .. ARGV[4] .. ' to ' .. ARGV[3])
end
local function stamp_format()
  if stamp ~= in_use then redis.call('HSET', KEYS[3], 'format', in_use) end
end

local info = redis.pcall('INFO', 'server')
local run_id = type(info) == 'string' and string.match(info, 'run_id:(%x+)')
if not run_id then
  return redis.error_reply('ERR INFO gives no run_id: the cleanup on a cluster needs it')
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  if redis.call('EXISTS', KEYS[1], KEYS[4]) == 0 then return {'', '', '0', {}} end
  local aside = redis.call('ZRANGE', KEYS[4], 0, tonumber(ARGV[1]) - 1)
  if #aside > 0 then
    for first = 1, #aside, 1000 do
      local last = math.min(first + 999, #aside)
      redis.call('SADD', KEYS[1], unpack(aside, first, last))
      redis.call('ZREM', KEYS[4], unpack(aside, first, last))
    end
    return {'', '', 'fold', {}}
  end
  redis.call('RENAME', KEYS[1], KEYS[2])
  redis.call('HDEL', KEYS[3], 'walk_cursor', 'rewalks')
  redis.call('HSET', KEYS[3], 'walk_run_id', run_id, 'epoch', ARGV[2], 'scanned', 0)
  redis.call('HINCRBY', KEYS[3], 'walk', 1)
  stamp_format()
end
local progress = redis.call('HMGET', KEYS[3], 'walk_cursor', 'walk_run_id', 'epoch')
local cursor = progress[1] or '0'
if progress[2] ~= run_id then
  -- A walk restarted from 0 after a failover of this slot. A walk whose start epoch is
  -- unknown is compared against 'unknown' at the end, so it is walked again.
  cursor = '0'
  redis.call('HDEL', KEYS[3], 'walk_cursor')
  redis.call('HSET', KEYS[3], 'walk_run_id', run_id, 'scanned', 0)
  redis.call('HINCRBY', KEYS[3], 'walk', 1)
  if not progress[3] then redis.call('HSET', KEYS[3], 'epoch', 'unknown') end
  stamp_format()
end
local walk = redis.call('HGET', KEYS[3], 'walk')
local scan = redis.call('SSCAN', KEYS[2], cursor, 'COUNT', ARGV[1])
return {walk, cursor, scan[1], scan[2]}
