-- Removes consumers that are gone: idle for at least ARGV[2] ms and with nothing
-- pending. The check and the removal are one script, so an entry delivered to the
-- consumer in between cannot be lost with it. A consumer with pending entries is never
-- removed: its entries wait for takeover.
--
-- `idle` is the right signal on every server, with one difference. On Redis 7.2+ (and
-- Valkey), `idle` counts from the consumer's last attempted read or claim, which a live
-- worker blocked on an empty stream refreshes every `block_ms`, so only a gone worker
-- grows idle (`inactive`, new in 7.2, counts from the last successful one: the wrong
-- signal here). On Redis 7.0, `idle` counts from the last successful interaction, so a
-- live worker blocked on an empty stream also looks idle; removing it is harmless
-- (nothing pending) and the worker registers itself again on its next claim round.
--
-- KEYS[1] events stream; ARGV[1] group; ARGV[2] idle threshold (ms).
-- Returns the names removed.

local function field(flat, name)
  for i = 1, #flat, 2 do
    if flat[i] == name then return flat[i + 1] end
  end
end

if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if not ok then return {} end -- no such group (yet)
local removed = {}
for _, c in ipairs(consumers) do
  if field(c, 'pending') == 0 and field(c, 'idle') >= tonumber(ARGV[2]) then
    local name = field(c, 'name')
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], name)
    removed[#removed + 1] = name
  end
end
return removed
