-- One step of the reverse-index sweep of a live server: removes members of its set whose
-- forward entry now names another server (the user moved and the old server missed its
-- SREM). Read and removal are one atomic script, so a user who reconnects to this
-- server at the same moment (forward entry and SADD in one MULTI) is never dropped.
--
-- KEYS[1] server:{S}:users  KEYS[2] registry
-- ARGV[1] server id  ARGV[2] cursor  ARGV[3] COUNT  ARGV[4] 'hash' or 'keys'
-- ARGV[5] forward key prefix (<key_prefix>user:)
-- Returns {next cursor, members scanned, members removed}

local hash_layout = ARGV[4] == 'hash'
local r = redis.call('SSCAN', KEYS[1], ARGV[2], 'COUNT', ARGV[3])
local members = r[2]
local removed = 0
for first = 1, #members, BATCH do
  local last = math.min(first + BATCH - 1, #members)
  local owners = owners_of(members, first, last, hash_layout, KEYS[2], ARGV[5])
  local moved = {}
  for i = 1, #owners do
    if owners[i] and owners[i] ~= ARGV[1] then moved[#moved + 1] = members[first + i - 1] end
  end
  if #moved > 0 then removed = removed + redis.call('SREM', KEYS[1], unpack(moved)) end
end
return {r[1], #members, removed}
