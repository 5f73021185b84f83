#!lua
-- The guard's write probe, run on each master of a cluster at every observation. It
-- writes nothing, but declares that it may write (no `no-writes` flag) and does not run
-- over maxmemory (no `allow-oom`): so a master refuses it (OOM, MISCONF, NOREPLICAS) or
-- holds it (CLIENT PAUSE WRITE) whenever it would refuse or hold a connection server's
-- heartbeat. Such a master answers reads, so TIME and INFO alone would not show that the
-- servers whose slot it serves cannot heartbeat.
return 1
