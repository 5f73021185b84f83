-- Keeps an entry that this consumer is still working on from looking idle, so that it is
-- not taken over while the (long) cleanup is healthy. XCLAIM ... JUSTID resets the idle
-- time without counting a delivery. Only if this consumer still owns it: an entry that
-- was taken over meanwhile is not claimed back.
--
-- KEYS[1] events stream; ARGV[1] group; ARGV[2] consumer; ARGV[3] entry id.
-- Returns 1 if touched, 0 if the entry is no longer ours (acknowledged or taken over).

local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 1 and p[1][2] == ARGV[2] then
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
  return 1
end
return 0
