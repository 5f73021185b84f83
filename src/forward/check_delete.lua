-- Cluster cleanup, part 2 of a chunk: the atomic check-and-delete, in one slot. Deletes
-- each forward entry that still names the dead server; counts those that name another.
--
-- Layout hash: KEYS[1] registry, ARGV[3..] user ids.
-- Layout keys: KEYS = forward keys (all in one slot).
-- ARGV[1] dead server id  ARGV[2] 'hash' or 'keys'
-- Returns {entries deleted, entries kept}

local server, hash_layout = ARGV[1], ARGV[2] == 'hash'
local names = {}
if hash_layout then
  for i = 3, #ARGV do names[i - 2] = ARGV[i] end
else
  names = KEYS
end
local deleted, kept = 0, 0
for first = 1, #names, BATCH do
  local last = math.min(first + BATCH - 1, #names)
  local owners
  if hash_layout then
    owners = redis.call('HMGET', KEYS[1], unpack(names, first, last))
  else
    owners = redis.call('MGET', unpack(names, first, last))
  end
  local doomed, n = {}, 0
  for i = 1, #owners do
    if owners[i] == server then
      n = n + 1
      doomed[n] = names[first + i - 1]
    elseif owners[i] then
      kept = kept + 1
    end
  end
  if n > 0 then
    if hash_layout then
      deleted = deleted + redis.call('HDEL', KEYS[1], unpack(doomed))
    else
      deleted = deleted + redis.call('DEL', unpack(doomed))
    end
  end
end
return {deleted, kept}
