-- The reconciler's reachable-time record (see src/guard/reachable.rs), shared by every
-- reconciler replica and every `reconcile --once`.
--
-- Stores the run_ids of Redis as last seen, and the start of the current stretch of
-- reachable time: the greatest of the stored and the given value, so that an outage any
-- reconciler saw holds the verdicts of all. A stored value later than Redis's clock (the
-- clock stepped back) is replaced by the given one; neither may be later than now.
--
-- KEYS[1] janitor:{guard}:reachable
-- ARGV[1] run_ids (sorted, comma-separated; '' = unknown, the stored value stays)
-- ARGV[2] reachable_since_ms (Redis time, unix ms; 0 = no outage known)
-- Returns the stored reachable_since_ms.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stored = tonumber(redis.call('HGET', KEYS[1], 'reachable_since_ms') or '0') or 0
if stored > now then stored = 0 end
local since = math.max(stored, tonumber(ARGV[2]))
if since > now then since = now end
redis.call('HSET', KEYS[1], 'reachable_since_ms', string.format('%d', since))
if ARGV[1] ~= '' then redis.call('HSET', KEYS[1], 'run_ids', ARGV[1]) end
return since
