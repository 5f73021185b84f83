-- Hands an entry over gracefully: this consumer stops working on it (shutdown, drain
-- timeout reached) without having failed. The delivery it got is given back, so that a
-- hand-off does not count toward max_deliveries (the next takeover counts it again),
-- and the entry is made to look idle for ARGV[4] ms, so that the next claim round of any
-- worker takes it at once instead of after claim_min_idle_ms. Only if this consumer
-- still owns the entry: one taken over meanwhile is left alone.
--
-- XCLAIM ... IDLE sets the idle time (Redis uses "now" for a value past the epoch, so
-- ARGV[4] stays small); RETRYCOUNT sets the delivery counter; JUSTID adds nothing to it.
--
-- KEYS[1] events stream; ARGV[1] group; ARGV[2] consumer; ARGV[3] entry id;
-- ARGV[4] idle time to set, in ms.
-- Returns the delivery count left on the entry, or -1 if the entry is no longer ours.

local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 1 and p[1][2] == ARGV[2] then
  local count = p[1][4]
  if count > 0 then
    count = count - 1
  end
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3],
    'IDLE', ARGV[4], 'RETRYCOUNT', count, 'JUSTID')
  return count
end
return -1
