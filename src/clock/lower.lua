-- Lowers the `servers` scores that lie in the future to Redis's time, and returns that
-- time (see clock.rs). A score later than Redis's time plus the tolerance was written
-- with a clock that runs ahead (a writer that scores with its own clock: an older copy
-- of heartbeat.lua, a plain writer, a cluster client's own ZADD); left as it is, it
-- would keep a dead server "recent" for as long as its clock is ahead. Lowered to now,
-- it says what is certain: the last heartbeat was no later than now. A heartbeat that
-- comes after writes its own score again. Writes are allowed to fail (an ACL without
-- ZADD on `servers`, a Redis out of memory): the score then stays, and the reply says so.
--
-- KEYS[1] servers
-- ARGV[1] tolerance (ms)  ARGV[2] most scores lowered by this call
-- ARGV[3...] server ids: only these are looked at (none: every score in the future, up
--            to ARGV[2] of them)
-- Returns {Redis's time (unix ms), scores lowered, scores that could not be lowered,
--          the scores of the server ids given (after lowering; false for none)}

local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local limit = now + tonumber(ARGV[1])
local servers = KEYS[1]
local lowered, refused = 0, 0

local function lower(member, score)
  if tonumber(score) <= limit then return score end
  local r = redis.pcall('ZADD', servers, 'XX', now, member)
  if type(r) == 'table' and r.err then
    refused = refused + 1
    return score
  end
  lowered = lowered + 1
  return tostring(now)
end

local scores = {}
if #ARGV > 2 then
  for i = 3, #ARGV do
    local score = redis.call('ZSCORE', servers, ARGV[i])
    if score then score = lower(ARGV[i], score) end
    scores[i - 2] = score or false
  end
else
  local ahead = redis.call('ZRANGEBYSCORE', servers, '(' .. limit, '+inf', 'WITHSCORES',
    'LIMIT', 0, tonumber(ARGV[2]))
  for i = 1, #ahead, 2 do lower(ahead[i], ahead[i + 1]) end
end
return {now, lowered, refused, scores}
