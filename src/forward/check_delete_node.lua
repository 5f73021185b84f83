#!lua flags=allow-cross-slot-keys,allow-oom
-- Cluster cleanup, layout keys: the atomic check-and-delete of check_delete.lua for the
-- forward keys of many slots at once, all (by the caller's slot map) served by the node
-- that runs it. Redis 7.0+: allow-cross-slot-keys lets one script touch keys of several
-- slots of this node; allow-oom lets it run on a master over maxmemory, as
-- check_delete.lua (no shebang) does: it only reads and deletes, and frees memory. The keys are not declared (declared keys of several slots are refused
-- with CROSSSLOT), and each command names one key (a command across slots is refused
-- too); Redis still refuses each command on a key this node does not serve.
--
-- A key this node does not serve (its slot moved, or is moving and the key is not
-- here: MOVED or ASK for a plain command) makes GET fail; that key is left alone and
-- reported, and the caller checks it with the per-slot script (check_delete.lua), which
-- redis-rs routes and redirects. Since each key is read and deleted in this one script,
-- a key read here is served here until the script ends.
--
-- ARGV[1] dead server id  ARGV[2..] forward keys
-- Returns {entries deleted, entries kept, positions deleted, positions absent,
-- positions not served here}: positions 1-based in the keys given (ARGV[2] is 1).

local server = ARGV[1]
local deleted, kept = 0, 0
local deleted_at, absent_at, elsewhere_at = {}, {}, {}
for i = 2, #ARGV do
  local key = ARGV[i]
  local owner = redis.pcall('GET', key)
  if type(owner) == 'table' and owner.err then
    if string.sub(owner.err, 1, 9) == 'WRONGTYPE' then
      -- Not a forward entry: MGET in check_delete.lua reads it as none.
      absent_at[#absent_at + 1] = i - 1
    else
      elsewhere_at[#elsewhere_at + 1] = i - 1
    end
  elseif owner == server then
    local gone = redis.pcall('DEL', key)
    if type(gone) == 'number' then
      deleted = deleted + gone
      deleted_at[#deleted_at + 1] = i - 1
    else
      elsewhere_at[#elsewhere_at + 1] = i - 1
    end
  elseif owner then
    kept = kept + 1
  else
    absent_at[#absent_at + 1] = i - 1
  end
end
return {deleted, kept, deleted_at, absent_at, elsewhere_at}
