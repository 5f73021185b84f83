#!lua flags=allow-oom
-- Cluster cleanup, part 3 of a chunk (slot of {S}): moves the stored cursor from the one
-- the chunk was scanned at to the next, once the chunk's entries are deleted. If another
-- worker moved it first (a duplicate event), or the walk the chunk belongs to is over
-- (its number, see cluster_scan.lua, is not the current one), nothing changes.
--
-- At the end of a walk of `walking`:
-- - if the cluster's epoch differs from the one stored when the walk started (a failover
--   may have lost deletes that the old master acknowledged), or the worker saw errors,
--   the same set is walked again (at most 3 re-walks per set; the stored epoch moves on);
-- - otherwise `walking` is unlinked, and a `users` set that grew meanwhile is walked next;
-- - with neither left, the progress hash goes: 'done'.
--
-- KEYS[1] server:{S}:users  KEYS[2] server:{S}:walking  KEYS[3] server:{S}:cleanup
-- KEYS[4] server:{S}:moved (members the reverse-index sweep set aside meanwhile: walked
-- next, as a grown `users` set is)
-- ARGV[1] walk number  ARGV[2] cursor the chunk was scanned at  ARGV[3] next cursor
-- ARGV[4] members scanned  ARGV[5] the cluster's epoch now (greatest config epoch)
-- ARGV[6] '1' if the worker saw errors
-- ARGV[7], ARGV[8] the entries the chunk deleted and kept, added to the cleanup's totals
-- (`evicted`, `kept` in the progress hash) whatever the answer: a chunk raced by a
-- duplicate worker deleted other users than the winner's.
-- ARGV[9] the worker's format  ARGV[10] the oldest format it works under
-- ARGV[11] the format in use, as the worker read it before this chunk
-- ARGV[12] the chunk's token (unique to the chunk, the same on every retry of its
-- advance): stored in `advance` with the chunk's counts, which are added only while
-- `advance` holds another token, so a retried advance whose first attempt ran counts
-- the chunk once.
-- Returns {'done', 'again', 'advanced' or 'raced', total deleted, total kept}: the totals
-- of the cleanup so far, for server.cleaned (before the progress hash goes, on 'done').
--
-- The data format (format/mod.rs), as in cluster_scan.lua: a chunk whose progress record
-- was written meanwhile under a format the worker's build does not work under (a newer
-- worker's steps, once the format moved on) is refused with the error code FORMAT before
-- any write; a cursor this script moves is stamped with the format in use.

-- The format the record is in: a record without the field (or not written yet) is in
-- format 1; a record not written yet is never refused.
local in_use = tonumber(ARGV[11])
local stamp = 1
local recorded = redis.call('EXISTS', KEYS[3]) == 1
if recorded then
  stamp = tonumber(redis.call('HGET', KEYS[3], 'format') or '1') or 0
end
if recorded and (stamp > tonumber(ARGV[9]) or stamp < tonumber(ARGV[10])) then
  return redis.error_reply('FORMAT the cleanup was written under format ' .. stamp
    .. '; this worker works under formats ' .. ARGV[10] .. ' to ' .. ARGV[9])
end
local function stamp_format()
  if stamp ~= in_use then redis.call('HSET', KEYS[3], 'format', in_use) end
end

local function counted(answer)
  local totals = redis.call('HMGET', KEYS[3], 'evicted', 'kept')
  return {answer, tonumber(totals[1] or '0'), tonumber(totals[2] or '0')}
end
-- `allow-oom`: these small bookkeeping writes go through when Redis is out of memory,
-- since the cleanup is what frees it. The totals are informative, and best effort
-- (pcall) all the same.
if recorded and redis.call('HGET', KEYS[3], 'advance') ~= ARGV[12] then
  if tonumber(ARGV[7]) > 0 then redis.pcall('HINCRBY', KEYS[3], 'evicted', ARGV[7]) end
  if tonumber(ARGV[8]) > 0 then redis.pcall('HINCRBY', KEYS[3], 'kept', ARGV[8]) end
  redis.pcall('HSET', KEYS[3], 'advance', ARGV[12])
end

if redis.call('EXISTS', KEYS[2]) == 0 then
  if redis.call('EXISTS', KEYS[1], KEYS[4]) > 0 then return counted('advanced') end
  local answer = counted('done')
  redis.call('DEL', KEYS[3])
  return answer
end
local info = redis.pcall('INFO', 'server')
local run_id = type(info) == 'string' and string.match(info, 'run_id:(%x+)')
if not run_id then
  return redis.error_reply('ERR INFO gives no run_id: the cleanup on a cluster needs it')
end
local progress = redis.call('HMGET', KEYS[3], 'walk_cursor', 'walk_run_id', 'epoch',
  'rewalks', 'walk')
if progress[5] ~= ARGV[1] or (progress[1] or '0') ~= ARGV[2] or progress[2] ~= run_id then
  return counted('raced')
end
if ARGV[3] == '0' then
  local rewalks = tonumber(progress[4] or '0')
  if (progress[3] ~= ARGV[5] or ARGV[6] == '1') and rewalks < 3 then
    redis.call('HDEL', KEYS[3], 'walk_cursor')
    redis.call('HSET', KEYS[3], 'scanned', 0, 'epoch', ARGV[5], 'rewalks', rewalks + 1)
    redis.call('HINCRBY', KEYS[3], 'walk', 1)
    stamp_format()
    return counted('again')
  end
  redis.call('UNLINK', KEYS[2])
  if redis.call('EXISTS', KEYS[1], KEYS[4]) > 0 then
    redis.call('HDEL', KEYS[3], 'walk_cursor')
    return counted('advanced')
  end
  local answer = counted('done')
  redis.call('UNLINK', KEYS[3])
  return answer
end
redis.call('HSET', KEYS[3], 'walk_cursor', ARGV[3])
redis.call('HINCRBY', KEYS[3], 'scanned', ARGV[4])
stamp_format()
return counted('advanced')
