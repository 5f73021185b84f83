-- `registry-janitor format set <N>`: sets the format in use, the check and the write in
-- one step. Refused, unless forced, when a live worker (announced within the live bound)
-- cannot work under N (N is newer than its format or older than the oldest it works
-- under: it would take no more work), or when live workers of a newer format are
-- announced and none of format N (they would move the format forward again at once).
--
-- KEYS[1] janitor:{format}:in_use  KEYS[2] janitor:{format}:workers
-- ARGV[1] N  ARGV[2] the live bound (ms)  ARGV[3] '1' to set it whatever the workers
-- Returns {'set' or 'refused', the format in use before, {'<consumer> <format> <min>' of
--          each live worker that cannot work under N}, 1 if newer live workers would move
--          it forward again else 0}

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n, live = tonumber(ARGV[1]), tonumber(ARGV[2])
local in_use = redis.call('GET', KEYS[1])
local previous = tonumber(in_use or '1') or 0

local cannot, newer, same = {}, false, false
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local f, m, _, seen = string.match(all[i + 1], '^(%d+):(%d+):(%d+):(%d+)')
  f, m, seen = tonumber(f), tonumber(m), tonumber(seen)
  if f and now - seen <= live then
    if n > f or n < m then cannot[#cannot + 1] = all[i] .. ' ' .. f .. ' ' .. m end
    if f > n then newer = true elseif f == n then same = true end
  end
end
local moves_back = (newer and not same) and 1 or 0
if ARGV[3] ~= '1' and (#cannot > 0 or moves_back == 1) then
  return {'refused', previous, cannot, moves_back}
end
redis.call('SET', KEYS[1], n)
return {'set', previous, cannot, moves_back}
