#!/usr/bin/env python3
"""A connection server in Python that keeps to registry-janitor's protocol.

The protocol is the set of Lua scripts in ../protocol/ (each file's header names its keys
and arguments). This example loads them with redis-py's register_script (EVALSHA, with
EVAL as the fallback) and wraps them in a small class:

    r = redis.Redis.from_url("redis://127.0.0.1:6379")
    server = ConnectionServer(r, "gw-7#1732181000123")
    server.heartbeat(ttl_ms=3000)   # before the first user, then well inside the TTL
    server.register(b"alice")       # a user connected
    route(r, b"alice")              # -> "gw-7#1732181000123", or None
    server.unregister(b"alice")     # a clean disconnect

Layout conns (a user with several connections, docs/connections.md): the same class with
`layout="conns"` takes a connection id too, and `route_user` returns every live server:

    server = ConnectionServer(r, "gw-7#1732181000123", layout="conns")
    server.register(b"alice", "phone-1")
    route_user(r, b"alice")         # -> ["gw-7#1732181000123", ...], the live ones
    server.unregister(b"alice", "phone-1")

Fencing: once the janitor takes `server.dead` for a server id, every register, heartbeat
and unregister of that id is refused with the Redis error FENCED, raised here as
`Fenced`. Wherever it comes from, the answer is the same (see `run`): close every socket
(the clients reconnect, here or elsewhere) and come back under a new server id, a new
incarnation. A quiet server learns the verdict at its next heartbeat.

This is for one Redis node. On a Redis Cluster the forward entry (`registry`, or
`user:<user>`) and the server's keys (`server:{<id>}:...`, one slot) are in different
slots, so no one script call can hold both; the Lua headers say what to do instead
(F = server:{<id>}:fenced, N = server:{<id>}:refused, all in the server's one slot):
  - heartbeat: heartbeat.lua with KEYS F, N, server:{<id>}:alive only; if it answered 1,
    heartbeat_servers.lua with KEYS servers (the score is Redis's time, never ours);
  - register: EXISTS F first; if fenced, call register.lua with KEYS F, N,
    server:{<id>}:users only (it refuses and notes it) and write no forward entry.
    Otherwise HSET registry <user> <id> (or SET user:<user> <id>), then register.lua
    with KEYS F, N, server:{<id>}:users only; on FENCED, undo the forward entry with
    release.lua;
  - unregister: release.lua on the forward entry first, then unregister.lua with KEYS F,
    N, server:{<id>}:users only;
  - route: HGET registry <user> (or GET user:<user>), then EXISTS on the owner's
    `fenced` and `alive` keys (one slot); the owner only if not fenced and alive.

Command line (Python 3.11, `pip install 'redis>=5,<7'`):
    connection_server.py [--redis-url URL] [--key-prefix P] [--layout hash|keys|conns] \\
        run --server-id gw-7 --users 3 [--heartbeat-ms 1000] [--until-fenced]
    connection_server.py route u0@gw-7      (layout conns: every live server, or `none`)
"""

import argparse
import json
import logging
import os
import re
import time
from pathlib import Path

import redis

PROTOCOL = Path(__file__).resolve().parent.parent / "protocol"
LUA = {
    name: (PROTOCOL / f"{name}.lua").read_text()
    for name in (
        "register", "heartbeat", "unregister", "route",
        "register_conn", "unregister_conn", "route_user",
    )
}

# 1 to 200 bytes of printable ASCII, no whitespace, no braces (they are a cluster hash tag).
SERVER_ID = re.compile(r"[!-z|~]{1,200}")

log = logging.getLogger("connection_server")


class Fenced(Exception):
    """This server id was declared dead: close its sockets, start again under a new id."""

    def __init__(self, server_id: str, message: str):
        super().__init__(message)
        self.server_id = server_id


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def forward_key(user: bytes, layout: str = "hash", key_prefix: str = "") -> bytes:
    """The key of a user's forward entry: the `registry` Hash, `user:<user>`, or (layout
    conns) the user's connections `user:{<user>}:conns`."""
    prefix = key_prefix.encode()
    if layout == "conns":
        return prefix + b"user:{" + user + b"}:conns"
    return prefix + b"registry" if layout == "hash" else prefix + b"user:" + user


def route(
    redis_client: redis.Redis, user: bytes, layout: str = "hash", key_prefix: str = ""
) -> str | None:
    """The server to send `user`'s messages to; None if it has none, or its owner is
    fenced (the entry is then deleted) or past its liveness."""
    script = redis_client.register_script(LUA["route"])
    owner = script(keys=[forward_key(user, layout, key_prefix)], args=[user, layout, key_prefix])
    return owner.decode() if owner is not None else None


def route_user(redis_client: redis.Redis, user: bytes, key_prefix: str = "") -> list[str]:
    """Layout conns: the servers of every live connection of `user` (none fenced or past
    its liveness), each once, sorted; empty if none."""
    script = redis_client.register_script(LUA["route_user"])
    servers = script(keys=[forward_key(user, "conns", key_prefix)], args=[key_prefix])
    return [s.decode() for s in servers]


def new_incarnation(server_id: str) -> str:
    """`gw-7#1732181000123` -> `gw-7#<now ms>`: the same machine, a new server id."""
    base = server_id.partition("#")[0]
    while (new := f"{base}#{now_ms()}") == server_id:
        time.sleep(0.001)
    return new


class ConnectionServer:
    """One incarnation of a connection server, as the registry sees it."""

    def __init__(
        self, redis_client: redis.Redis, server_id: str, layout: str = "hash", key_prefix: str = ""
    ):
        if not SERVER_ID.fullmatch(server_id):
            raise ValueError(f"invalid server id {server_id!r}")
        if layout not in ("hash", "keys", "conns"):
            raise ValueError(f"layout must be hash, keys or conns, not {layout!r}")
        self.redis, self.server_id = redis_client, server_id
        self.layout, self.key_prefix = layout, key_prefix
        self._scripts = {name: redis_client.register_script(text) for name, text in LUA.items()}

    def _key(self, what: str) -> str:
        return f"{self.key_prefix}server:{{{self.server_id}}}:{what}"

    def _user_keys(self, user: bytes) -> list:
        forward = forward_key(user, self.layout, self.key_prefix)
        return [self._key("fenced"), self._key("refused"), self._key("users"), forward]

    def _call(self, name: str, keys: list, args: list):
        try:
            return self._scripts[name](keys=keys, args=args)
        except redis.exceptions.ResponseError as e:
            # The scripts answer redis.error_reply('FENCED server <id> was declared dead: ...').
            if str(e).startswith("FENCED"):
                raise Fenced(self.server_id, str(e)) from e
            raise

    def heartbeat(self, ttl_ms: int) -> None:
        """Refreshes `server:{id}:alive` (TTL `ttl_ms`) and this server's `servers` score
        (Redis's time: the script does not use the time sent as its third argument)."""
        keys = [self._key("fenced"), self._key("refused"), self._key("alive"), f"{self.key_prefix}servers"]
        self._call("heartbeat", keys, [self.server_id, ttl_ms, now_ms()])

    def register(self, user: bytes, connection: str | None = None) -> None:
        """A user connected: the forward entry names this server, the user joins its set.
        Layout conns: connection `connection` of the user (register_conn.lua)."""
        if self.layout == "conns":
            self._call("register_conn", self._user_keys(user), [user, self.server_id, connection])
            return
        self._call("register", self._user_keys(user), [user, self.server_id, self.layout])

    def unregister(self, user: bytes, connection: str | None = None) -> None:
        """A clean disconnect: the forward entry goes if it still names this server.
        Layout conns: connection `connection` of the user (unregister_conn.lua)."""
        if self.layout == "conns":
            self._call("unregister_conn", self._user_keys(user), [user, self.server_id, connection])
            return
        self._call("unregister", self._user_keys(user), [user, self.server_id, self.layout])

    def route(self, user: bytes) -> str | None:
        return route(self.redis, user, self.layout, self.key_prefix)

    def fenced_at_ms(self) -> int | None:
        """When the verdict against this id was recorded (the janitor's fence), if it was."""
        value = self.redis.hget(self._key("fenced"), "fenced_at_ms")
        return int(value) if value is not None else None


def close_all_sockets(server_id: str) -> None:
    """Stands in for the real thing: every client connected to this incarnation is cut
    off, reconnects (here, under the new id, or elsewhere) and registers again."""
    log.warning("server %s is fenced: closing all its client sockets", server_id)


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def run(r: redis.Redis, args: argparse.Namespace) -> int:
    """Heartbeats, connects `--users` simulated users (u<n>@<server id>; layout conns:
    each with its connection c<n>) and disconnects the last `--disconnect` of them, then
    heartbeats every `--heartbeat-ms` until fenced."""
    ttl_ms = args.ttl_ms or 3 * args.heartbeat_ms
    server = ConnectionServer(r, args.server_id, args.layout, args.key_prefix)
    server.heartbeat(ttl_ms)  # liveness first: the janitor must see the server before its users
    users = [(f"u{n}@{server.server_id}".encode(), f"c{n}") for n in range(args.users)]
    for user, connection in users:
        server.register(user, connection)
    for user, connection in users[len(users) - args.disconnect:]:
        server.unregister(user, connection)
    emit(event="ready", server_id=server.server_id, users=len(users), disconnected=args.disconnect)
    while True:
        time.sleep(args.heartbeat_ms / 1000)
        try:
            server.heartbeat(ttl_ms)
        except Fenced:
            detected_at_ms = now_ms()
            close_all_sockets(server.server_id)
            # For the log only: the fence's time is Redis's clock, ours may differ.
            fenced_at_ms = server.fenced_at_ms()
            old = server.server_id
            server = ConnectionServer(r, new_incarnation(old), args.layout, args.key_prefix)
            server.heartbeat(ttl_ms)
            emit(
                event="fenced",
                server_id=old,
                new_server_id=server.server_id,
                detected_at_ms=detected_at_ms,
                fenced_at_ms=fenced_at_ms,
                fenced_after_ms=None if fenced_at_ms is None else detected_at_ms - fenced_at_ms,
            )
            if args.until_fenced:
                return 0
            log.info("now serving as %s", server.server_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379")
    parser.add_argument("--key-prefix", default="")
    parser.add_argument("--layout", choices=("hash", "keys", "conns"), default="hash")
    commands = parser.add_subparsers(dest="command", required=True)
    run_cmd = commands.add_parser("run", help="play one connection server until stopped")
    run_cmd.add_argument("--server-id", required=True, help="e.g. gw-7#1732181000123")
    run_cmd.add_argument("--users", type=int, default=3, help="simulated users to connect")
    run_cmd.add_argument("--disconnect", type=int, default=0, help="of those, how many leave")
    run_cmd.add_argument("--heartbeat-ms", type=int, default=1000)
    run_cmd.add_argument("--ttl-ms", type=int, default=0, help="liveness TTL (3 heartbeats)")
    run_cmd.add_argument("--until-fenced", action="store_true", help="exit once fenced")
    route_cmd = commands.add_parser("route", help="print a user's owner, or `none`")
    route_cmd.add_argument("user")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    r = redis.Redis.from_url(args.redis_url)
    if args.command == "route":
        if args.layout == "conns":
            print(" ".join(route_user(r, os.fsencode(args.user), args.key_prefix)) or "none")
        else:
            print(route(r, os.fsencode(args.user), args.layout, args.key_prefix) or "none")
        return 0
    if not 0 <= args.disconnect <= args.users:
        parser.error("--disconnect must be between 0 and --users")
    return run(r, args)


if __name__ == "__main__":
    raise SystemExit(main())
