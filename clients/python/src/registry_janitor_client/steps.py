"""The protocol's steps, as the specification orders them, for one node and for a Redis
Cluster; written once for the sync and the asyncio clients.

Each operation is a generator that yields what to send to Redis (a `Call`, a `Script`,
or a `Batch` of them sent in one pipeline) and receives the reply, or has the error
raised at its `yield`. `drive` (sync) and `drive_async` run them against a client.

On one node every write is one script holding every key. On a Redis Cluster the forward
entry and the server's keys are in different slots, so (docs/specification.md, "On a
Redis Cluster: the order of the steps"):

- register: EXISTS F; if fenced, the script with F, N, U only (it refuses) and no forward
  entry (should it accept, the fence having expired since, the steps go on); otherwise
  the forward entry, then the script with F, N, U only; on FENCED, release.lua takes the
  forward entry back;
- heartbeat: heartbeat.lua with F, N, A only, then ZADD servers;
- unregister: release.lua, then the script with F, N, U only;
- route: the owner(s), then EXISTS fenced and EXISTS alive of each (one slot each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generator, Iterable, Literal, NamedTuple, Sequence, TypeVar, Union

from redis import exceptions as rex

from .errors import Fenced, ProtocolError
from .ids import is_server_id
from .retry import is_transient
from .scripts import READ_ONLY, SHAS

T = TypeVar("T")
Layout = Literal["hash", "keys", "conns"]
LAYOUTS = ("hash", "keys", "conns")

#: Users (or entries) per pipeline in the batched calls.
BATCH = 1000


@dataclass(frozen=True, slots=True)
class Call:
    """One plain command."""

    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Script:
    """One protocol script, sent as EVALSHA (EVALSHA_RO for the read-only ones)."""

    name: str
    keys: tuple[bytes, ...]
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Batch:
    """Calls and scripts sent in one pipeline (they are idempotent: a batch may be sent
    again). The reply is a list in order, where an item that failed is its error."""

    ops: tuple[Call | Script, ...]


Op = Union[Call, Script, Batch]
Steps = Generator[Op, Any, T]


def command(op: Call | Script, read_only: bool) -> tuple[Any, ...]:
    """The command that sends `op` (EVALSHA_RO for a read-only script if `read_only`)."""
    if isinstance(op, Call):
        return op.args
    name = "EVALSHA_RO" if read_only and op.name in READ_ONLY else "EVALSHA"
    return (name, SHAS[op.name], len(op.keys), *op.keys, *op.args)


def drive(steps: Steps[T], execute: Callable[[Op], Any]) -> T:
    """Runs `steps`, sending each op with `execute`."""
    reply: Any = None
    error: BaseException | None = None
    try:
        while True:
            op = steps.throw(error) if error is not None else steps.send(reply)
            try:
                reply, error = execute(op), None
            except Exception as e:
                reply, error = None, e
    except StopIteration as stop:
        result: T = stop.value
        return result


async def drive_async(steps: Steps[T], execute: Callable[[Op], Awaitable[Any]]) -> T:
    """Runs `steps`, sending each op with `await execute(op)`."""
    reply: Any = None
    error: BaseException | None = None
    try:
        while True:
            op = steps.throw(error) if error is not None else steps.send(reply)
            try:
                reply, error = await execute(op), None
            except Exception as e:
                reply, error = None, e
    except StopIteration as stop:
        result: T = stop.value
        return result


# --- replies and errors -------------------------------------------------------------


def is_fenced(error: BaseException) -> bool:
    return isinstance(error, rex.ResponseError) and str(error).startswith("FENCED")


def translate(error: Exception) -> Exception:
    """The protocol's meaning of a Redis error: FENCED -> Fenced; a cluster reached
    through a plain client (route.lua's `no-cluster` refusal, MOVED, ASK, CROSSSLOT) ->
    ProtocolError; anything else as it is."""
    message = str(error)
    if is_fenced(error):
        words = message.split()
        return Fenced(words[2] if len(words) > 2 and words[1] == "server" else None, message)
    plain_client_on_cluster = isinstance(error, (rex.AskError, rex.ClusterCrossSlotError)) or (
        isinstance(error, rex.ResponseError) and "no-cluster" in message
    )
    if plain_client_on_cluster:
        return ProtocolError(
            f"this Redis is a cluster ({type(error).__name__}: {message}): pass a "
            "redis.cluster.RedisCluster (or redis.asyncio.cluster.RedisCluster) client, which "
            "takes the protocol's single-slot steps"
        )
    return error


def refuses_read_only(error: object) -> bool:
    """Whether an error of EVALSHA_RO may be a refusal of the command itself (unknown to
    a server or proxy, or not allowed to this ACL user): EVALSHA is then tried."""
    return (
        isinstance(error, rex.ResponseError)
        and not isinstance(error, rex.NoScriptError)
        and not is_transient(error)
        and translate(error) is error
    )


def read_only_refused(ops: Sequence[Call | Script], replies: Sequence[Any]) -> bool:
    """Whether a read-only script of a batch sent as EVALSHA_RO was refused the command."""
    return any(
        isinstance(op, Script) and op.name in READ_ONLY and refuses_read_only(reply)
        for op, reply in zip(ops, replies)
    )


def missing_scripts(ops: Sequence[Call | Script], replies: Sequence[Any]) -> list[str]:
    """The scripts a batch found missing (NOSCRIPT): loaded, then the batch sent again."""
    names = {op.name for op, r in zip(ops, replies) if isinstance(op, Script) and isinstance(r, rex.NoScriptError)}
    return sorted(names)


def settle(replies: Sequence[Any]) -> list[Any]:
    """A batch's replies as steps see them: a transient error is raised (the batch is
    sent again after a pause); other errors stay in place, translated."""
    for reply in replies:
        if isinstance(reply, Exception) and is_transient(reply):
            raise reply
    return [translate(r) if isinstance(r, Exception) else r for r in replies]


def value(reply: Any) -> Any:
    """A batch item's reply, or its error raised."""
    if isinstance(reply, Exception):
        raise reply
    return reply


def text(reply: Any) -> str | None:
    """A bulk string reply as str; None for nil (RESP2) or false (RESP3, a Lua false)."""
    if reply is None or reply is False:
        return None
    if isinstance(reply, (bytes, bytearray)):
        return bytes(reply).decode("utf-8", "replace")
    return str(reply)


def texts(replies: Iterable[Any]) -> list[str]:
    """The strings of an array reply (route_user.lua, HGETALL's values)."""
    return [t for t in map(text, replies) if t is not None]


def chunks(items: Sequence[T], size: int = BATCH) -> Iterable[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# --- keys ---------------------------------------------------------------------------


class Keys:
    """The key names of the specification ("Keys and their owners"), with the prefix."""

    def __init__(self, prefix: bytes):
        self.prefix = prefix
        self.servers = prefix + b"servers"
        self.registry = prefix + b"registry"

    def _server(self, server: str, what: bytes) -> bytes:
        return self.prefix + b"server:{" + server.encode("ascii") + b"}:" + what

    def fenced(self, server: str) -> bytes:
        return self._server(server, b"fenced")

    def refused(self, server: str) -> bytes:
        return self._server(server, b"refused")

    def users(self, server: str) -> bytes:
        return self._server(server, b"users")

    def alive(self, server: str) -> bytes:
        return self._server(server, b"alive")

    def user(self, user: bytes) -> bytes:
        return self.prefix + b"user:" + user

    def conns(self, user: bytes) -> bytes:
        return self.prefix + b"user:{" + user + b"}:conns"


# --- the operations -----------------------------------------------------------------


class Entry(NamedTuple):
    """What registering or unregistering one entry sends."""

    script: str  # register(_conn) or unregister(_conn)
    args: tuple[Any, ...]
    member_keys: tuple[bytes, bytes, bytes]  # F, N, U: the server's slot
    forward: bytes  # the forward entry's key: registry, user:<user> or user:{<user>}:conns
    write: Call  # the plain write of the forward entry (cluster)
    release: Script  # release.lua of the forward entry (cluster)


class Protocol:
    """The steps of each operation for one layout and key prefix, on one node or a
    cluster."""

    def __init__(self, layout: str, key_prefix: str | bytes, cluster: bool):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be 'hash', 'keys' or 'conns', not {layout!r}")
        self.layout = layout
        self.prefix = key_prefix.encode() if isinstance(key_prefix, str) else bytes(key_prefix)
        self.keys = Keys(self.prefix)
        self.cluster = cluster

    def _entry(self, server: str, user: bytes, connection: str | None, registering: bool) -> Entry:
        """What registering (or unregistering) one entry sends."""
        k = self.keys
        if self.layout == "conns":
            assert connection is not None
            forward = k.conns(user)
            name = "register_conn" if registering else "unregister_conn"
            args: tuple[Any, ...] = (user, server, connection)
            plain = Call(("HSET", forward, connection, server))
            release = Script("release", (forward,), (connection, server, "hash"))
        else:
            forward = k.registry if self.layout == "hash" else k.user(user)
            name = "register" if registering else "unregister"
            args = (user, server, self.layout)
            if self.layout == "hash":
                plain = Call(("HSET", forward, user, server))
            else:
                plain = Call(("SET", forward, server))
            release = Script("release", (forward,), (user, server, self.layout))
        member_keys = (k.fenced(server), k.refused(server), k.users(server))
        return Entry(name, args, member_keys, forward, plain, release)

    def heartbeat(self, server: str, ttl_ms: int, now_ms: int) -> Steps[None]:
        k = self.keys
        keys = (k.fenced(server), k.refused(server), k.alive(server))
        args = (server, ttl_ms, now_ms)
        if not self.cluster:
            yield Script("heartbeat", (*keys, k.servers), args)
            return
        yield Script("heartbeat", keys, args)  # FENCED is raised here: no ZADD
        yield Call(("ZADD", k.servers, now_ms, server))

    def register(self, server: str, user: bytes, connection: str | None) -> Steps[None]:
        e = self._entry(server, user, connection, True)
        if not self.cluster:
            yield Script(e.script, (*e.member_keys, e.forward), e.args)
            return
        if (yield Call(("EXISTS", e.member_keys[0]))):
            # Fenced already: no forward entry (it could replace the entry of a user now on
            # a live server). The script refuses and notes the refusal.
            yield Script(e.script, e.member_keys, e.args)
            # It took the member: the fence expired since it was read. The steps go on,
            # the forward entry first, then the script again.
        yield e.write
        try:
            yield Script(e.script, e.member_keys, e.args)
        except Fenced as refused:
            try:
                yield e.release
            except Exception:
                # Left behind, the entry names a fenced owner: route never returns it and
                # the janitor's drift sweep deletes it.
                pass
            raise refused

    def unregister(self, server: str, user: bytes, connection: str | None) -> Steps[bool]:
        e = self._entry(server, user, connection, False)
        if not self.cluster:
            return bool((yield Script(e.script, (*e.member_keys, e.forward), e.args)))
        deleted = yield e.release
        yield Script(e.script, e.member_keys, e.args)
        return bool(deleted)

    def unregister_all(
        self, server: str, entries: Sequence[tuple[bytes, str | None]]
    ) -> Steps[list[Any]]:
        """Unregisters many entries, pipelined; the reply of each (an error in place)."""
        results: list[Any] = []
        for chunk in chunks(entries):
            parts = [self._entry(server, user, conn, False) for user, conn in chunk]
            if not self.cluster:
                replies = yield Batch(tuple(Script(e.script, (*e.member_keys, e.forward), e.args) for e in parts))
            else:
                # The specification's order per entry: release.lua, then the member script,
                # only where the release went through (a member removed while its forward
                # entry stays would hide that entry from the janitor's walk). The error of
                # a release stays in place of its entry; FENCED is told apart by the caller.
                released = yield Batch(tuple(e.release for e in parts))
                done = [i for i, r in enumerate(released) if not isinstance(r, Exception)]
                members = (yield Batch(tuple(Script(parts[i].script, parts[i].member_keys, parts[i].args)
                                             for i in done))) if done else []
                replies = list(released)
                for i, member in zip(done, members):
                    replies[i] = member
            results.extend(replies)
        return results

    def leave(self, server: str) -> Steps[None]:
        """A graceful end: the liveness key and the `servers` member go."""
        k = self.keys
        for reply in (yield Batch((Call(("DEL", k.alive(server))), Call(("ZREM", k.servers, server))))):
            value(reply)

    def _live(self, servers: set[str]) -> Steps[set[str]]:
        """Of `servers`, those neither fenced nor past their liveness (cluster steps)."""
        ordered = sorted(servers)
        if not ordered:
            return set()
        k = self.keys
        ops = []
        for s in ordered:
            ops += [Call(("EXISTS", k.fenced(s))), Call(("EXISTS", k.alive(s)))]
        replies = [value(r) for r in (yield Batch(tuple(ops)))]
        return {s for i, s in enumerate(ordered) if not replies[2 * i] and replies[2 * i + 1]}

    def route_many(self, users: Sequence[bytes]) -> Steps[list[str | None]]:
        k, out = self.keys, list[str | None]()
        for chunk in chunks(users):
            if not self.cluster:
                ops = []
                for user in chunk:
                    forward = k.registry if self.layout == "hash" else k.user(user)
                    ops.append(Script("route", (forward,), (user, self.layout, self.prefix)))
                out += [text(value(r)) for r in (yield Batch(tuple(ops)))]
                continue
            if self.layout == "hash":
                owners = [text(o) for o in (yield Call(("HMGET", k.registry, *chunk)))]
            else:
                replies = yield Batch(tuple(Call(("GET", k.user(u))) for u in chunk))
                owners = [text(value(r)) for r in replies]
            live = yield from self._live({o for o in owners if o and is_server_id(o)})
            out += [o if o in live else None for o in owners]
        return out

    def route_users(self, users: Sequence[bytes]) -> Steps[list[list[str]]]:
        k, out = self.keys, list[list[str]]()
        for chunk in chunks(users):
            if not self.cluster:
                ops = tuple(Script("route_user", (k.conns(u),), (self.prefix,)) for u in chunk)
                out += [texts(value(r)) for r in (yield Batch(ops))]
                continue
            replies = yield Batch(tuple(Call(("HGETALL", k.conns(u))) for u in chunk))
            servers = [set(texts(_hash_values(value(r)))) for r in replies]
            candidates: set[str] = set().union(*servers)
            live = yield from self._live({s for s in candidates if is_server_id(s)})
            out += [sorted(s for s in each if s in live) for each in servers]
        return out


def _hash_values(reply: Any) -> list[Any]:
    """The values of an HGETALL reply (a dict, or a flat list without a callback)."""
    if isinstance(reply, dict):
        return list(reply.values())
    return list(reply[1::2])
