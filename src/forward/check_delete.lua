-- Cluster cleanup, part 2 of a chunk: the atomic check-and-delete, in one slot. Deletes
-- each forward entry that still names the dead server; counts those that name another.
-- (Layout keys: check_delete_node.lua does this per master; this per-slot script takes
-- the keys a master did not serve, its slot moving.)
--
-- Layout hash: KEYS[1] registry, ARGV[3..] user ids.
-- Layout keys: KEYS = forward keys (all in one slot).
-- Layout conns: KEYS = the users' Hashes `user:{<user>}:conns` (all in one slot), one per
--   member, ARGV[3..] the members' connection ids, in the same order.
-- ARGV[1] dead server id  ARGV[2] 'hash', 'keys' or 'conns'
-- Returns {entries deleted, entries kept, positions deleted, positions absent, execution
-- time in microseconds}: the positions (1-based, in the order given) of the users whose
-- entry this call deleted, and of those that had no entry (the evictions stream on a
-- cluster announces both: an absent entry may be one whose delete was done by an attempt
-- that never announced it). A key of another type than the layout's (no entry of the
-- layout, never deleted) is in neither. The execution time (TIME at the start and the
-- end) is what the step limiter compares the round trip with.

local started = redis.call('TIME')
local server, hash_layout, conns_layout = ARGV[1], ARGV[2] == 'hash', ARGV[2] == 'conns'
local names = {}
if hash_layout or conns_layout then
  for i = 3, #ARGV do names[i - 2] = ARGV[i] end
else
  names = KEYS
end
local deleted, kept = 0, 0
local deleted_at, absent_at = {}, {}
-- The owner read for a key of another type than the layout's: no entry.
local NOT_ENTRY = {}
for first = 1, #names, BATCH do
  local last = math.min(first + BATCH - 1, #names)
  local owners
  if hash_layout then
    owners = redis.call('HMGET', KEYS[1], unpack(names, first, last))
  elseif conns_layout then
    owners = {}
    for i = first, last do
      local owner = redis.pcall('HGET', KEYS[i], names[i])
      if type(owner) == 'table' then
        owner = NOT_ENTRY -- WRONGTYPE
      elseif type(owner) ~= 'string' then
        owner = false
      end
      owners[#owners + 1] = owner
    end
  else
    owners = redis.call('MGET', unpack(names, first, last))
    -- MGET reads a key of another type as none: told from an absent key by EXISTS.
    for i = 1, #owners do
      if not owners[i] and redis.call('EXISTS', names[first + i - 1]) == 1 then
        owners[i] = NOT_ENTRY
      end
    end
  end
  local doomed, n = {}, 0
  for i = 1, #owners do
    if owners[i] == NOT_ENTRY then
      -- Neither deleted, kept nor absent.
    elseif owners[i] == server then
      n = n + 1
      doomed[n] = names[first + i - 1]
      deleted_at[#deleted_at + 1] = first + i - 1
    elseif owners[i] then
      kept = kept + 1
    else
      absent_at[#absent_at + 1] = first + i - 1
    end
  end
  if n > 0 then
    if hash_layout then
      deleted = deleted + redis.call('HDEL', KEYS[1], unpack(doomed))
    elseif conns_layout then
      for i = first, last do
        if owners[i - first + 1] == server then
          deleted = deleted + redis.call('HDEL', KEYS[i], names[i])
        end
      end
    else
      deleted = deleted + redis.call('DEL', unpack(doomed))
    end
  end
end
local ended = redis.call('TIME')
-- Never negative, should the clock be stepped back meanwhile.
local us = math.max(0, (ended[1] - started[1]) * 1000000 + (ended[2] - started[2]))
return {deleted, kept, deleted_at, absent_at, us}
