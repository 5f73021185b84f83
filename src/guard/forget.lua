-- Ends a hold, or changes its state, only if the standing hold is still the one of this
-- stream entry (a newer verdict for the same server is never touched).
--
-- KEYS[1] janitor:{guard}:held
-- ARGV[1] server id  ARGV[2] stream entry id  ARGV[3] '' to end the hold, or the new
-- state ('released')
-- Returns {1 if done else 0, holds left}.

local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current or cjson.decode(current).entry ~= ARGV[2] then
  return {0, redis.call('HLEN', KEYS[1])}
end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  -- The JSON as written by the janitor, with its state first: the text is changed, not
  -- decoded and encoded again (cjson would rewrite its numbers).
  local changed = string.gsub(current, '^{"state":"[a-z]+"', '{"state":"' .. ARGV[3] .. '"', 1)
  redis.call('HSET', KEYS[1], ARGV[1], changed)
end
return {1, redis.call('HLEN', KEYS[1])}
