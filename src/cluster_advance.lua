-- Cluster cleanup, part 3 of a chunk (slot of {S}): moves the stored cursor from the one
-- the chunk was scanned at to the next, once the chunk's entries are deleted. If another
-- worker moved it first (a duplicate event), nothing changes. When the walk is complete
-- the reverse set and the progress hash are unlinked, unless ARGV[4] asks for one more
-- walk (the worker saw errors, and a failover may have lost acknowledged deletes).
--
-- KEYS[1] server:{S}:users  KEYS[2] server:{S}:cleanup
-- ARGV[1] cursor the chunk was scanned at  ARGV[2] next cursor  ARGV[3] members scanned
-- ARGV[4] '1' to walk again instead of finishing
-- Returns 'done', 'again', 'advanced' or 'raced'

if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2])
  return 'done'
end
local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
local progress = redis.call('HMGET', KEYS[2], 'cursor', 'run_id')
if (progress[1] or '0') ~= ARGV[1] or (progress[2] and progress[2] ~= run_id) then
  return 'raced'
end
if ARGV[2] == '0' then
  if ARGV[4] == '1' then
    redis.call('HSET', KEYS[2], 'cursor', '0', 'run_id', run_id, 'scanned', 0)
    return 'again'
  end
  redis.call('UNLINK', KEYS[1], KEYS[2])
  return 'done'
end
redis.call('HSET', KEYS[2], 'cursor', ARGV[2], 'run_id', run_id)
redis.call('HINCRBY', KEYS[2], 'scanned', ARGV[3])
return 'advanced'
