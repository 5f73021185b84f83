-- Cluster cleanup, part 1 of a chunk (slot of {S}): the next members of the dead
-- server's reverse set, from the stored cursor. Writes no progress: the cursor moves only
-- after the chunk's entries are deleted (cluster_advance.lua), so a crash in between just
-- repeats the chunk. As in clean_step.lua, a cursor stored under another run_id (restart,
-- failover) is not trusted: the walk starts again from 0.
--
-- KEYS[1] server:{S}:users  KEYS[2] server:{S}:cleanup   ARGV[1] SSCAN COUNT
-- Returns {cursor used, next cursor, members}

local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
local progress = redis.call('HMGET', KEYS[2], 'cursor', 'run_id')
local cursor = progress[1] or '0'
if progress[2] ~= run_id then
  cursor = '0'
  if redis.call('EXISTS', KEYS[1]) == 1 then
    redis.call('HSET', KEYS[2], 'cursor', '0', 'run_id', run_id, 'scanned', 0)
  end
end
local scan = redis.call('SSCAN', KEYS[1], cursor, 'COUNT', ARGV[1])
return {cursor, scan[1], scan[2]}
