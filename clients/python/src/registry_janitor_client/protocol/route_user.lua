#!lua flags=no-writes,no-cluster
-- registry-janitor connection-server protocol, layout conns: where to route a message for
-- a user: the server of every live connection.
--
-- Returns the distinct servers named by the user's connections (`user:{<user>}:conns`)
-- that are neither fenced (declared dead) nor past their liveness (liveness key expired),
-- sorted, each once however many connections it holds; an empty array when none. It
-- reads only, as route.lua: a connection of a fenced server is deleted (and announced) by
-- the janitor's cleanup or its drift sweep; one whose server only missed its liveness
-- keeps its entry (a slow heartbeat; the reconciler decides).
--
-- Flags (Redis 7.0 or later, Valkey 7.2 or later): `no-writes` (EVAL_RO/EVALSHA_RO, runs
-- on replicas) and `no-cluster`: the servers' keys are read by name, in other slots than
-- the user's Hash. On a Redis Cluster route in single-slot steps: HGETALL
-- user:{<user>}:conns; then for each distinct server, EXISTS server:{<server>}:fenced and
-- EXISTS server:{<server>}:alive (one slot).
--
-- KEYS[1] the user's Hash `user:{<user>}:conns`  ARGV[1] key_prefix (may be empty)
-- Returns an array of server ids (possibly empty)

local prefix = ARGV[1] or ''
local fields = redis.call('HGETALL', KEYS[1])
local seen, live = {}, {}
for i = 2, #fields, 2 do
  local server = fields[i]
  if not seen[server] then
    seen[server] = true
    -- Not a valid server id (1..200 printable ASCII bytes, no space, no braces): it has
    -- no liveness key, and it never goes into a key name.
    if #server <= 200 and string.match(server, '^[!-z|~]+$') then
      local base = prefix .. 'server:{' .. server .. '}:'
      if redis.call('EXISTS', base .. 'fenced') == 0 and redis.call('EXISTS', base .. 'alive') == 1 then
        live[#live + 1] = server
      end
    end
  end
end
table.sort(live)
return live
