#!lua flags=allow-cross-slot-keys,allow-oom
-- Cluster cleanup, layouts keys and conns: the atomic check-and-delete of check_delete.lua for the
-- forward keys of many slots at once, all (by the caller's slot map) served by the node
-- that runs it. Redis 7.0+: allow-cross-slot-keys lets one script touch keys of several
-- slots of this node; allow-oom lets it run on a master over maxmemory, as
-- check_delete.lua (no shebang) does: it only reads and deletes, and frees memory. The keys are not declared (declared keys of several slots are refused
-- with CROSSSLOT), and each command names one key (a command across slots is refused
-- too); Redis still refuses each command on a key this node does not serve.
--
-- A key this node does not serve (its slot moved, or is moving and the key is not
-- here: MOVED or ASK for a plain command) makes GET (HGET) fail; that key is left alone and
-- reported, and the caller checks it with the per-slot script (check_delete.lua), which
-- redis-rs routes and redirects. Since each key is read and deleted in this one script,
-- a key read here is served here until the script ends.
--
-- ARGV[1] dead server id  ARGV[2] 'keys' or 'conns'
-- Layout keys: ARGV[3..] forward keys.
-- Layout conns: ARGV[3..] pairs: a user's Hash `user:{<user>}:conns`, then a connection
--   id; the entry is that field (HGET, HDEL: Redis deletes the Hash with its last field).
-- Returns {entries deleted, entries kept, positions deleted, positions absent,
-- positions not served here, execution time in microseconds}: positions 1-based in the
-- entries given (the first key, or the first pair, is 1); a key of another type (no
-- entry of the layout) is in none of them. The execution time (TIME at the start and the
-- end) is what the step limiter compares the round trip with.

local started = redis.call('TIME')
local server, conns = ARGV[1], ARGV[2] == 'conns'
local step = conns and 2 or 1
local deleted, kept = 0, 0
local deleted_at, absent_at, elsewhere_at = {}, {}, {}
local at = 0
for i = 3, #ARGV, step do
  at = at + 1
  local key = ARGV[i]
  local owner
  if conns then
    owner = redis.pcall('HGET', key, ARGV[i + 1])
  else
    owner = redis.pcall('GET', key)
  end
  if type(owner) == 'table' and owner.err then
    -- A key of another type (WRONGTYPE) is no forward entry: neither deleted, kept nor
    -- absent (the caller announces absent entries), as in check_delete.lua. Any other
    -- error: the key is not served here.
    if string.sub(owner.err, 1, 9) ~= 'WRONGTYPE' then
      elsewhere_at[#elsewhere_at + 1] = at
    end
  elseif owner == server then
    local gone
    if conns then
      gone = redis.pcall('HDEL', key, ARGV[i + 1])
    else
      gone = redis.pcall('DEL', key)
    end
    if type(gone) == 'number' then
      deleted = deleted + gone
      deleted_at[#deleted_at + 1] = at
    else
      elsewhere_at[#elsewhere_at + 1] = at
    end
  elseif owner then
    kept = kept + 1
  else
    absent_at[#absent_at + 1] = at
  end
end
local ended = redis.call('TIME')
-- Never negative, should the clock be stepped back meanwhile.
local us = math.max(0, (ended[1] - started[1]) * 1000000 + (ended[2] - started[2]))
return {deleted, kept, deleted_at, absent_at, elsewhere_at, us}
