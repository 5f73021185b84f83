-- Notes a cleanup's last error in its progress record, only while the cleanup is
-- unfinished: written after another worker finished, the note would re-create the
-- record, and nothing would ever remove it.
--
-- KEYS[1] server:{S}:users  KEYS[2] server:{S}:walking  KEYS[3] server:{S}:moved
-- KEYS[4] server:{S}:cleanup   ARGV[1] the error
-- Returns 1 if noted, 0 if the cleanup is finished.

if redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[3]) == 0 then return 0 end
redis.call('HSET', KEYS[4], 'last_error', ARGV[1])
return 1
