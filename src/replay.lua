-- Replays one dead letter: publishes its original fields on the events stream, then
-- deletes the dead letter. A script stops at its first failing call: when the XADD fails,
-- the dead letter stays. Single node only: the two streams are in different slots on a
-- cluster (see dead_letters.rs).
--
-- KEYS[1] events stream; KEYS[2] dead-letter stream.
-- ARGV[1] dead letter id; ARGV[2..] the original field, value, ...
-- Returns the new entry's id on the events stream.

local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('XDEL', KEYS[2], ARGV[1])
return id
