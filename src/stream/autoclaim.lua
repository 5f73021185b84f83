-- Takes over idle entries and reads the delivery count of each one it took, in one step:
-- XAUTOCLAIM, then XPENDING <id> <id> 1 per claimed entry. Asking by exact id (rather
-- than one XPENDING over the claimed range) cannot mix in this consumer's other pending
-- entries, and as one script no failure can fall between the claim and the counts: a
-- retry never finds entries already claimed but not yet counted.
--
-- KEYS[1] events stream.
-- ARGV[1] group; ARGV[2] consumer; ARGV[3] min idle ms; ARGV[4] start id (cursor);
-- ARGV[5] COUNT.
-- Returns {next cursor, claimed entries as XAUTOCLAIM gives them ({id, fields}),
-- ids deleted from the stream while pending (Redis 7), delivery counts}: the counts
-- line up with the claimed entries, this delivery included (0 where none is pending).

local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
local counts = {}
for i, entry in ipairs(reply[2]) do
  counts[i] = 0
  if type(entry) == 'table' then
    local row = redis.call('XPENDING', KEYS[1], ARGV[1], entry[1], entry[1], 1)
    if row[1] then
      counts[i] = row[1][4]
    end
  end
end
return {reply[1], reply[2], reply[3] or {}, counts}
