-- Parks a held verdict's stream entry with the guard's own consumer, or makes a released
-- one claimable. XCLAIM ... JUSTID moves it without counting a delivery, RETRYCOUNT 0
-- starts its count afresh (a hold is no failed delivery) and IDLE sets how long it looks
-- idle: 0 keeps it from takeover while held; claim_min_idle_ms lets the next claim
-- round of any worker take a released one at once.
--
-- KEYS[1] events stream; ARGV[1] group; ARGV[2] the guard's consumer; ARGV[3] entry id;
-- ARGV[4] idle time to set (ms).
-- Returns 1, or 0 if the entry is no longer pending (acknowledged or gone).

local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3],
  'IDLE', ARGV[4], 'RETRYCOUNT', 0, 'JUSTID')
return 1
