-- Publishes the `server.dead` of one alert, once: the first call for an alert publishes
-- and records the entry id under the alert's key (with a TTL); every later call while the
-- record stands returns that id and publishes nothing. Whatever the number of receivers
-- and however often Alertmanager sends the alert, one alert is one event.
--
-- The XADD comes before the record: a script that fails part-way keeps what it wrote, and
-- a record written before a failed XADD would refuse the alert's every retry (an event
-- lost). In this order a failure leaves nothing, and the retry publishes.
--
-- KEYS[1] receiver:alert:{<events>}:<alert>  KEYS[2] registry:events (the same slot)
-- ARGV[1] the event's MessagePack payload  ARGV[2] the record's TTL (ms)
-- Returns {1, entry id} when published now, {0, entry id} when published before.

local id = redis.call('GET', KEYS[1])
if id then return {0, id} end
id = redis.call('XADD', KEYS[2], '*', 'type', 'server.dead', 'payload', ARGV[1])
redis.call('SET', KEYS[1], id, 'PX', ARGV[2])
return {1, id}
