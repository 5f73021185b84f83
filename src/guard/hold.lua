-- The guard's decision on one verdict, atomic across workers: is a verdict for this
-- server held already, and if not, may a doubtful one go ahead?
--
-- KEYS[1] janitor:{guard}:held (Hash: server id -> the hold as JSON)
-- KEYS[2] janitor:{guard}:disputed (ZSet: server id -> unix ms, disputed verdicts let through)
-- ARGV[1] server id  ARGV[2] stream entry id  ARGV[3] doubt: 'none', 'disputed' or 'mass'
-- ARGV[4] the hold to record, as JSON  ARGV[5] now (unix ms)  ARGV[6] window (ms)
-- ARGV[7] disputed verdicts let through per window
-- Returns {'recorded', <the standing hold's JSON>}: a hold for this server exists (of
-- this entry or of another); {'proceed', ''}; or {'hold', <holds before this one>}.

local held, disputed = KEYS[1], KEYS[2]
local server, entry, doubt = ARGV[1], ARGV[2], ARGV[3]
local current = redis.call('HGET', held, server)
if current then return {'recorded', current} end
if doubt == 'none' then return {'proceed', ''} end
-- While any verdict is held, the guard already knows monitoring and the fleet disagree:
-- no disputed verdict goes ahead on the budget until the hold is over.
if doubt == 'disputed' and redis.call('HLEN', held) == 0 then
  local now, window = tonumber(ARGV[5]), tonumber(ARGV[6])
  redis.call('ZREMRANGEBYSCORE', disputed, '-inf', '(' .. (now - window))
  -- A server let through once (a verdict taken over after a crash, a second producer's
  -- verdict for it) is not counted again.
  if redis.call('ZSCORE', disputed, server) then return {'proceed', ''} end
  if redis.call('ZCARD', disputed) < tonumber(ARGV[7]) then
    redis.call('ZADD', disputed, now, server)
    redis.call('PEXPIRE', disputed, window)
    return {'proceed', ''}
  end
end
local before = redis.call('HLEN', held)
redis.call('HSET', held, server, ARGV[4])
return {'hold', tostring(before)}
