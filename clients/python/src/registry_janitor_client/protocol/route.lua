#!lua flags=no-writes,no-cluster
-- registry-janitor connection-server protocol: where to route a message for a user.
--
-- Returns the owner server id only if that owner is neither fenced (declared dead) nor
-- past its liveness (its liveness key expired); otherwise nil. It reads only: an entry
-- whose owner is fenced is deleted by the janitor's cleanup (or its drift sweep), which
-- announces the user on the evictions stream; a delete here would go unannounced. An
-- owner that only missed its liveness keeps its entry: it may be a slow heartbeat, and
-- the reconciler decides.
--
-- Flags (Redis 7.0 or later, Valkey 7.2 or later):
-- - `no-writes`: it only reads, so it runs as EVAL_RO/EVALSHA_RO and on replicas.
-- - `no-cluster`: the owner's keys are read by name (built from ARGV[3] and the owner),
--   not given in KEYS, and lie in another slot than the forward entry, which a cluster
--   does not allow in one script. A Redis Cluster refuses to run it ("Can not run script
--   on cluster, 'no-cluster' flag is set"), whatever the owner. There, route in two
--   steps: HGET registry <user> (or GET user:<user>); then EXISTS
--   server:{<owner>}:fenced and EXISTS server:{<owner>}:alive (one slot).
--
-- KEYS[1] the forward entry: `registry` (layout hash) or `user:<user>` (layout keys)
-- ARGV[1] user id  ARGV[2] 'hash' or 'keys'  ARGV[3] key_prefix (may be empty)
-- Returns the owner server id, or nil

local forward, user, prefix = KEYS[1], ARGV[1], ARGV[3]
local owner
if ARGV[2] == 'hash' then
  owner = redis.call('HGET', forward, user)
else
  owner = redis.call('GET', forward)
end
-- Not a valid server id (1..200 printable ASCII bytes, no space, no braces): it has no
-- liveness key, and it never goes into a key name.
if not owner or #owner > 200 or not string.match(owner, '^[!-z|~]+$') then return false end
local base = prefix .. 'server:{' .. owner .. '}:'
if redis.call('EXISTS', base .. 'fenced') == 1 then return false end
if redis.call('EXISTS', base .. 'alive') == 0 then return false end
return owner
