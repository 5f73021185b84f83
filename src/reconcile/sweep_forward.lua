-- One step of the drift sweep over the forward registry (see reconcile.rs).
--
-- Scans the next COUNT entries (HSCAN of `registry`, SCAN of `user:*`, or
-- SCAN of the Hashes `user:{*}:conns`, each entry a connection) from the cursor
-- stored in the sweep hash, and deletes every entry whose owner is dead: fenced (declared
-- dead for good), or no liveness key and no heartbeat in `servers` within the grace, by
-- Redis's time (TIME: the protocol writes scores with it). Such entries are stale whether or
-- not an index still lists them (their reverse set may have been lost). Owner lookups
-- are cached per step; the owner check and the delete are this one atomic script.
--
-- The users whose entry it deletes are announced on the evictions stream (KEYS[4],
-- absent when switched off), one `users.evicted` per dead owner, source `sweep`, with an
-- empty event_id (no `server.dead` caused it), in this same script.
--
-- KEYS[1] registry  KEYS[2] sweep hash (janitor's own)  KEYS[3] servers  KEYS[4] evictions
-- ARGV[1] 'hash', 'keys' or 'conns'  ARGV[2] COUNT  ARGV[3] key prefix
-- ARGV[4] heartbeat_grace_ms, or -1 while silence proves nothing (a mass silence): then
--         only owners without any heartbeat in `servers` (or fenced) are dead
-- ARGV[5] MATCH pattern of forward keys (layouts keys and conns)  ARGV[6] cursor, or '' for the stored one
-- ARGV[7] '1' while Redis has not been reachable for a full grace since its last outage
--         (src/guard/reachable.rs): only entries of fenced owners are deleted then
-- ARGV[8] the latest Redis time (unix ms) this call may read if Redis's clock has not
--         stepped forward and the call has not waited in Redis's queue since the guard
--         last observed Redis ('' for no bound): past it, the step holds as under ARGV[7]
-- Returns {next cursor, entries scanned, entries removed, evictions entries written,
--          Redis's time (unix ms) if it was past ARGV[8], else 0}

local registry_key, sweep_key, servers_key = KEYS[1], KEYS[2], KEYS[3]
local layout = ARGV[1]
local prefix, grace = ARGV[3], tonumber(ARGV[4])
local cutoff = 0
local holding = ARGV[7] == '1'
local past_bound = 0
if grace >= 0 then
  local t = redis.call('TIME')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  cutoff = now - grace
  if not holding and ARGV[8] ~= '' and now > tonumber(ARGV[8]) then
    holding, past_bound = true, now
  end
end
local cursor = ARGV[6]
local evictions = KEYS[4]
local check = check_evictions_stream(evictions)
if check then return check end
if cursor == '' then cursor = redis.call('HGET', sweep_key, 'cursor') or '0' end

local users, owners = {}, {}
local next_cursor
if layout == 'hash' then
  local r = redis.call('HSCAN', registry_key, cursor, 'COUNT', ARGV[2])
  next_cursor = r[1]
  for i = 1, #r[2], 2 do
    users[#users + 1] = r[2][i]
    owners[#owners + 1] = r[2][i + 1]
  end
elseif layout == 'conns' then
  -- Each user's Hash `user:{<user>}:conns`, read whole (a user holds a few connections);
  -- its entries go on as members `<connection id> <user id>`, as the reverse sets hold them.
  local r = redis.call('SCAN', cursor, 'MATCH', ARGV[5], 'COUNT', ARGV[2], 'TYPE', 'hash')
  next_cursor = r[1]
  local head = #prefix + #'user:{' + 1
  for i = 1, #r[2] do
    local key = r[2][i]
    local user = string.sub(key, head, #key - #'}:conns')
    -- Only a key of this layout (MATCH is a glob): exactly <prefix>user:{<user>}:conns.
    if prefix .. 'user:{' .. user .. '}:conns' == key then
      local fields = redis.call('HGETALL', key)
      for j = 1, #fields, 2 do
        -- A field that is no connection id (a space would split the member elsewhere) is
        -- never read as an entry of another user.
        if is_conn_id(fields[j]) then
          users[#users + 1] = fields[j] .. ' ' .. user
          owners[#owners + 1] = fields[j + 1]
        end
      end
    end
  end
else
  local r = redis.call('SCAN', cursor, 'MATCH', ARGV[5], 'COUNT', ARGV[2], 'TYPE', 'string')
  next_cursor = r[1]
  local user_prefix = prefix .. 'user:'
  for i = 1, #r[2] do users[i] = string.sub(r[2][i], #user_prefix + 1) end
  for first = 1, #r[2], BATCH do
    local last = math.min(first + BATCH - 1, #r[2])
    local values = redis.call('MGET', unpack(r[2], first, last))
    for i = 1, #values do owners[first + i - 1] = values[i] end
  end
end

local dead = {}
local function is_dead(owner)
  if dead[owner] == nil then
    if not valid_server_id(owner) then
      dead[owner] = false
    elseif redis.call('EXISTS', prefix .. 'server:{' .. owner .. '}:fenced') == 1 then
      dead[owner] = true
    elseif holding or redis.call('EXISTS', prefix .. 'server:{' .. owner .. '}:alive') == 1 then
      dead[owner] = false
    else
      local score = redis.call('ZSCORE', servers_key, owner)
      dead[owner] = (not score) or tonumber(score) <= cutoff
    end
  end
  return dead[owner]
end

local doomed, by_owner, owner_order = {}, {}, {}
for i = 1, #users do
  local owner = owners[i]
  if owner and is_dead(owner) then
    doomed[#doomed + 1] = users[i]
    if not by_owner[owner] then
      by_owner[owner] = {}
      owner_order[#owner_order + 1] = owner
    end
    table.insert(by_owner[owner], users[i])
  end
end
local removed = 0
for first = 1, #doomed, BATCH do
  local batch = {unpack(doomed, first, math.min(first + BATCH - 1, #doomed))}
  removed = removed + delete_forward(batch, layout, registry_key, prefix .. 'user:')
end
-- Every doomed entry was read in this script and deleted by it: announce them all.
local announced = 0
for _, owner in ipairs(owner_order) do
  announced = announced + announce_members(evictions, owner, '', 'sweep', by_owner[owner], layout)
end
redis.call('HSET', sweep_key, 'cursor', next_cursor)
return {next_cursor, #users, removed, announced, past_bound}
