-- Cluster cleanup, part 3 of a chunk (slot of {S}): moves the stored cursor from the one
-- the chunk was scanned at to the next, once the chunk's entries are deleted. If another
-- worker moved it first (a duplicate event), nothing changes.
--
-- At the end of a walk of `walking`:
-- - if the cluster's epoch differs from the one stored when the walk started (a failover
--   may have lost deletes that the old master acknowledged), or the worker saw errors,
--   the same set is walked again (at most 3 re-walks per set; the stored epoch moves on);
-- - otherwise `walking` is unlinked, and a `users` set that grew meanwhile is walked next;
-- - with neither left, the progress hash goes: 'done'.
--
-- KEYS[1] server:{S}:users  KEYS[2] server:{S}:walking  KEYS[3] server:{S}:cleanup
-- ARGV[1] cursor the chunk was scanned at  ARGV[2] next cursor  ARGV[3] members scanned
-- ARGV[4] the cluster's current_epoch now  ARGV[5] '1' if the worker saw errors
-- Returns 'done', 'again', 'advanced' or 'raced'

if redis.call('EXISTS', KEYS[2]) == 0 then
  if redis.call('EXISTS', KEYS[1]) == 1 then return 'advanced' end
  redis.call('DEL', KEYS[3])
  return 'done'
end
local info = redis.pcall('INFO', 'server')
local run_id = type(info) == 'string' and string.match(info, 'run_id:(%x+)')
local progress = redis.call('HMGET', KEYS[3], 'cursor', 'run_id', 'epoch', 'rewalks')
if (progress[1] or '0') ~= ARGV[1] or progress[2] ~= run_id then
  return 'raced'
end
if ARGV[2] == '0' then
  local rewalks = tonumber(progress[4] or '0')
  if (progress[3] ~= ARGV[4] or ARGV[5] == '1') and rewalks < 3 then
    redis.call('HSET', KEYS[3], 'cursor', '0', 'scanned', 0, 'epoch', ARGV[4],
      'rewalks', rewalks + 1)
    return 'again'
  end
  redis.call('UNLINK', KEYS[2])
  if redis.call('EXISTS', KEYS[1]) == 1 then
    redis.call('HDEL', KEYS[3], 'cursor')
    return 'advanced'
  end
  redis.call('UNLINK', KEYS[3])
  return 'done'
end
redis.call('HSET', KEYS[3], 'cursor', ARGV[2])
redis.call('HINCRBY', KEYS[3], 'scanned', ARGV[3])
return 'advanced'
