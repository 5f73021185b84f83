-- Dead-letters one entry: writes the dead letter, then acknowledges the entry. Redis runs
-- no transaction rollback, but a script stops at its first failing call: when the XADD
-- fails (a dead-letter key of the wrong type, a full stream), nothing is acknowledged and
-- the entry stays pending. Single node only: the two streams are in different slots on a
-- cluster (see stream.rs).
--
-- KEYS[1] events stream; KEYS[2] dead-letter stream.
-- ARGV[1] group; ARGV[2] entry id; ARGV[3..] the dead letter's field, value, ...
-- Returns the dead letter's id.

local dead = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return dead
