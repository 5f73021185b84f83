-- Ends a hold, or changes its state, only if the standing hold is still the one of this
-- stream entry (a newer verdict for the same server is never touched) and, where one is
-- named, in the expected state.
--
-- KEYS[1] janitor:{guard}:held
-- ARGV[1] server id  ARGV[2] stream entry id  ARGV[3] '' to end the hold, or the new
-- state ('released', 'discarding')  ARGV[4] the state it must be in, or '' for any
-- Returns {1 if done else 0, holds left}.

local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current then return {0, redis.call('HLEN', KEYS[1])} end
local hold = cjson.decode(current)
if hold.entry ~= ARGV[2] or (ARGV[4] ~= '' and hold.state ~= ARGV[4]) then
  return {0, redis.call('HLEN', KEYS[1])}
end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  -- The JSON as written by the janitor, with its state first: the text is changed, not
  -- decoded and encoded again (cjson would rewrite its numbers).
  local changed, n = string.gsub(current, '^{"state":"[a-z_]+"', '{"state":"' .. ARGV[3] .. '"', 1)
  if n ~= 1 then return redis.error_reply('ERR hold of ' .. ARGV[1] .. ' does not start with its state') end
  redis.call('HSET', KEYS[1], ARGV[1], changed)
end
return {1, redis.call('HLEN', KEYS[1])}
