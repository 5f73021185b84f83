#!/usr/bin/env python3
"""Reacting to evictions: a presence service that drops the users of dead servers.

registry-janitor writes the evictions stream (`<prefix>registry:evictions`): one
`users.evicted` entry per cleanup step, naming the users whose registry entry it deleted,
and one `server.cleaned` entry per finished cleanup (schemas/users-evicted.schema.json,
schemas/server-cleaned.schema.json). This consumer, one of a consumer group of your own,
keeps a presence index in step with it:

    presence:online          Sorted Set: user -> last seen (unix ms)
    presence:rooms:<user>    Set: the rooms the user is in
    room:<room>:members      Set: the room's members

For each evicted user it removes the user from `presence:online` and from the member set
of each of their rooms, then forgets their room list. Handling is idempotent (removing
twice does nothing), so redeliveries and the cluster's at-least-once are harmless. A user
whose registry entry exists again (they reconnected after the eviction) is skipped: the
eviction is older than their new session.

Layout conns (a user with several connections): the entries are `connections.evicted`,
naming (user, connection) pairs (schemas/connections-evicted.schema.json). A user leaves
presence only once no connection is left (their Hash `user:{<user>}:conns` is gone): the
loss of one device of several changes nothing here. An entry is acknowledged (XACK) only once
handled; entries a crashed consumer left pending are taken over with XAUTOCLAIM.

Command line (Python 3.11, `pip install 'redis>=5,<7' 'msgpack>=1,<2'`):
    evictions_consumer.py [--redis-url URL] [--key-prefix P] [--layout hash|keys|conns]
        [--stream registry:evictions] [--group presence] [--consumer NAME] [--once]
`--once` handles what is there and exits (printing a JSON summary); otherwise it runs until
interrupted.
"""

import argparse
import json
import logging
import os
import socket

import msgpack
import redis

log = logging.getLogger("evictions_consumer")


class PresenceConsumer:
    def __init__(self, r, prefix, layout, stream, group, consumer, claim_idle_ms=30_000):
        self.r, self.prefix, self.layout = r, prefix, layout
        self.stream, self.group, self.consumer = prefix + stream, group, consumer
        self.claim_idle_ms = claim_idle_ms
        self.summary = {"entries": 0, "evicted": 0, "skipped_back": 0, "cleaned": 0}

    def ensure_group(self):
        # From the start of the stream: nothing written before the group existed is missed
        # (the janitor trims a stream without groups by age only).
        try:
            self.r.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def owner(self, user: bytes):
        if self.layout == "conns":
            # Any connection left: the user is still online somewhere.
            key = self.prefix.encode() + b"user:{" + user + b"}:conns"
            return self.r.exists(key) or None
        if self.layout == "hash":
            return self.r.hget(self.prefix + "registry", user)
        return self.r.get(self.prefix.encode() + b"user:" + user)

    def evict(self, user: bytes):
        if self.owner(user) is not None:
            # Back online since the eviction: their presence is newer than it.
            self.summary["skipped_back"] += 1
            return
        rooms_key = b"presence:rooms:" + user
        rooms = self.r.smembers(rooms_key)
        pipe = self.r.pipeline(transaction=True)
        pipe.zrem("presence:online", user)
        for room in rooms:
            pipe.srem(b"room:" + room + b":members", user)
        pipe.delete(rooms_key)
        pipe.execute()
        self.summary["evicted"] += 1

    def handle(self, entry_id, fields):
        kind = fields.get(b"type", b"").decode()
        if kind in ("users.evicted", "connections.evicted", "server.cleaned"):
            payload = msgpack.unpackb(fields[b"payload"], raw=False)
            if kind == "users.evicted":
                for user in payload["users"]:
                    self.evict(bytes(user))
            elif kind == "connections.evicted":
                # Each user once per entry, however many of their connections it names.
                for user in dict.fromkeys(bytes(u) for u, _connection in payload["connections"]):
                    self.evict(user)
            else:
                self.summary["cleaned"] += 1
                log.info("server %s clean: %s deleted, %s kept", payload["server_id"],
                         payload["deleted"], payload["kept"])
        # Unknown types are not ours: acknowledged and ignored.
        self.r.xack(self.stream, self.group, entry_id)
        self.summary["entries"] += 1

    def poll(self, block_ms):
        """Handles one batch: entries left pending by a crashed consumer, then new ones.
        Returns the number handled."""
        handled = 0
        _, claimed, *_ = self.r.xautoclaim(self.stream, self.group, self.consumer,
                                           self.claim_idle_ms, start_id="0-0", count=100)
        for entry_id, fields in claimed:
            if fields:  # trimmed entries come back empty
                self.handle(entry_id, fields)
                handled += 1
        for _, entries in self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                            count=100, block=block_ms) or []:
            for entry_id, fields in entries:
                self.handle(entry_id, fields)
                handled += 1
        return handled


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379"))
    p.add_argument("--key-prefix", default="")
    p.add_argument("--layout", choices=("hash", "keys", "conns"), default="hash")
    p.add_argument("--stream", default="registry:evictions")
    p.add_argument("--group", default="presence")
    p.add_argument("--consumer", default=f"{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--once", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    r = redis.Redis.from_url(args.redis_url)
    c = PresenceConsumer(r, args.key_prefix, args.layout, args.stream, args.group, args.consumer)
    c.ensure_group()
    if args.once:
        while c.poll(block_ms=None) > 0:
            pass
        print(json.dumps(c.summary))
        return
    while True:
        c.poll(block_ms=5_000)


if __name__ == "__main__":
    main()
