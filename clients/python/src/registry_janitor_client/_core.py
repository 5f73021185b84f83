"""What the sync and the asyncio clients share: settings, the state of one server
incarnation (started, running, fenced, closed, the entries it holds, the calls in
flight and their order per entry) and the heartbeat clock."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from redis import exceptions as rex

from . import ids
from .errors import Closed, Fenced
from .retry import RetryPolicy
from .steps import LAYOUTS, Protocol

log = logging.getLogger("registry_janitor_client")
log.addHandler(logging.NullHandler())


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class HeartbeatLost:
    """Given to `on_heartbeat_lost`: heartbeats have not reached Redis for longer than the
    liveness TTL. `since_ms` is the unix ms of the last heartbeat that did (or of
    start()): the liveness key expired at about since_ms + ttl_ms, and route no longer
    returns this server. `for_ms`: how long heartbeats have failed; `error`: the latest
    failure."""

    since_ms: int
    for_ms: int
    error: BaseException


class HeartbeatClock:
    """When to send the next heartbeat, and when a stretch of failures becomes lost.
    Thread-safe: the sync client's watchdog reads it while a heartbeat is in progress."""

    def __init__(self, ttl_ms: int, interval_ms: int):
        self.ttl_s = ttl_ms / 1000
        self.interval_s = interval_ms / 1000
        self.failures = 0
        self.lost = False
        self.last_ok_ms = now_ms()
        self._last_ok = time.monotonic()
        self._beating_since: float | None = None  # monotonic start of the heartbeat in progress
        self._lock = threading.Lock()

    def begin(self) -> None:
        """Notes a heartbeat sent now (in progress until succeeded() or failed())."""
        with self._lock:
            self._beating_since = time.monotonic()

    def succeeded(self) -> bool:
        """Notes a heartbeat that went through; True if it ends a lost stretch."""
        with self._lock:
            self.last_ok_ms, self._last_ok, self._beating_since = now_ms(), time.monotonic(), None
            restored, self.failures, self.lost = self.lost, 0, False
            return restored

    def failed(self, error: BaseException) -> HeartbeatLost | None:
        """Notes a failed heartbeat; a HeartbeatLost the first time a stretch passes the TTL."""
        with self._lock:
            self.failures += 1
            self._beating_since = None
            if self.lost or time.monotonic() - self._last_ok <= self.ttl_s:
                return None
            self.lost = True
            return HeartbeatLost(self.last_ok_ms, now_ms() - self.last_ok_ms, error)

    def overdue(self) -> HeartbeatLost | None:
        """The watchdog's check: a HeartbeatLost if a heartbeat has been in progress past the
        TTL since the last success (blocked in a call: no reply, no timeout) and the
        stretch was not reported yet. A heartbeat that failed is failed()'s to report."""
        with self._lock:
            if self.lost or self._beating_since is None or time.monotonic() - self._last_ok <= self.ttl_s:
                return None
            self.lost = True
            waited_ms = int((time.monotonic() - self._beating_since) * 1000)
            error = rex.TimeoutError(
                f"a heartbeat sent {waited_ms} ms ago has had no reply (is the Redis client's socket_timeout set?)"
            )
            return HeartbeatLost(self.last_ok_ms, now_ms() - self.last_ok_ms, error)

    def watch_delay(self) -> float:
        """Seconds until the watchdog looks again: when the TTL passes since the last
        success, at most one interval."""
        with self._lock:
            left = self.ttl_s - (time.monotonic() - self._last_ok)
        return self.interval_s if left <= 0 else min(self.interval_s, left + 0.005)

    def next_delay(self, started: float) -> float:
        """Seconds until the next heartbeat: one interval after the start of the last, or
        sooner after a failure (50 ms doubling, at most an interval)."""
        with self._lock:
            failures = self.failures
        if failures:
            return min(self.interval_s, 0.05 * 2.0 ** (failures - 1))
        return max(0.0, self.interval_s - (time.monotonic() - started))


def is_cluster(client: Any) -> bool:
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

    return isinstance(client, (RedisCluster, AsyncRedisCluster))


def check_primary_reads(client: Any) -> None:
    """Refuses a RedisCluster that sends reads to replicas (read_from_replicas, or a
    load_balancing_strategy): the cluster steps' reads (EXISTS F before a registration,
    the owners and their fence in route) must see the fence, which a replica has only
    after its replication delay."""
    if not is_cluster(client):
        return
    replicas = getattr(client, "read_from_replicas", False)
    strategy = getattr(client, "load_balancing_strategy", None)
    if replicas or strategy is not None:
        setting = f"load_balancing_strategy={strategy}" if strategy is not None else "read_from_replicas=True"
        raise ValueError(
            f"this RedisCluster reads from replicas ({setting}): a replica lags behind a fence, so "
            "a registration could miss it and route could return a fenced server. Pass a "
            "RedisCluster that reads from the primaries (the default: no read_from_replicas, no "
            "load_balancing_strategy), e.g. a second client for the registry"
        )


def socket_timeout_missing(client: Any) -> bool:
    """Whether the client's connections have no socket_timeout (redis-py's default): a
    call can then wait for ever on a connection whose bytes are dropped."""
    getter = getattr(client, "get_connection_kwargs", None)
    try:
        kwargs = getter() if callable(getter) else None
    except Exception:
        return False
    return isinstance(kwargs, dict) and kwargs.get("socket_timeout") is None


def check_retry(retry: RetryPolicy | None) -> RetryPolicy:
    if retry is None:
        return RetryPolicy()
    if not isinstance(retry, RetryPolicy):
        raise TypeError("retry must be a RetryPolicy")
    return retry


class Superseded(Exception):
    """Internal: an attempt of register() not sent, because an unregister() of the same
    entry (`by_close` False) or close() (True) was called after that register()."""

    def __init__(self, by_close: bool):
        super().__init__("closed" if by_close else "unregistered")
        self.by_close = by_close


Entry = tuple[bytes, "str | None"]


class EntryOrder:
    """The calls of one entry in flight: `lock` is held by each register attempt and by
    a whole unregister; `generation` counts the unregisters made, so that a register
    made before one of them sends no further attempt."""

    __slots__ = ("lock", "generation", "calls")

    def __init__(self, lock: Any):
        self.lock = lock
        self.generation = 0
        self.calls = 0


class ServerState:
    """One incarnation of a connection server as the registry sees it; the I/O is the
    subclasses' (sync: a heartbeat thread; asyncio: a heartbeat task).

    Order per entry (user, or user and connection in layout conns): an unregister()
    supersedes the register() calls of the same entry made before it (they send no
    further attempt) and sends its own script only once their attempt in flight has
    returned; a register() made after an unregister() sends its first attempt once that
    unregister() has returned. close() supersedes every register() and waits for the
    calls in flight before it collects what to unregister."""

    def __init__(
        self,
        redis: Any,
        server_id: str,
        *,
        layout: str = "keys",
        key_prefix: str = "",
        ttl_ms: int = 3000,
        heartbeat_interval_ms: int | None = None,
        on_fenced: Callable[[Fenced], Any] | None = None,
        on_heartbeat_lost: Callable[[HeartbeatLost], Any] | None = None,
        on_heartbeat_restored: Callable[[], Any] | None = None,
        retry: RetryPolicy | None = None,
    ):
        self._server_id = ids.server_id(server_id)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be 'hash', 'keys' or 'conns', not {layout!r}")
        if int(ttl_ms) < 1:
            raise ValueError("ttl_ms must be at least 1")
        interval = int(ttl_ms) // 3 if heartbeat_interval_ms is None else int(heartbeat_interval_ms)
        if not 1 <= interval < int(ttl_ms):
            raise ValueError("heartbeat_interval_ms must be at least 1 and below ttl_ms")
        check_primary_reads(redis)
        self.redis = redis
        self.layout = layout
        self.key_prefix = key_prefix
        self.ttl_ms = int(ttl_ms)
        self.heartbeat_interval_ms = interval
        self.retry = check_retry(retry)
        self.on_fenced = on_fenced
        self.on_heartbeat_lost = on_heartbeat_lost
        self.on_heartbeat_restored = on_heartbeat_restored
        self._protocol = Protocol(layout, key_prefix, is_cluster(redis))
        self._lock = threading.Lock()
        self._started = False  # start() was called (and did not fail)
        self._running = False  # start()'s first heartbeat went through: register() is open
        self._heartbeat_sent = False  # a heartbeat may have been written: close() leaves
        self._closed = False
        self._left = False  # close() sent (or is sending) DEL alive / ZREM servers
        self._fenced_error: Fenced | None = None
        # Entries registered and not unregistered (also those whose registration failed
        # with an error after which it may have been written): close() unregisters them.
        self._entries: set[Entry] = set()
        self._order: dict[Entry, EntryOrder] = {}
        self._calls = 0  # start, register and unregister calls in flight
        self._idle = self._new_event()
        self._idle.set()
        self._clock = HeartbeatClock(self.ttl_ms, interval)
        if socket_timeout_missing(redis):
            log.warning(
                "connection server %s: the Redis client has no socket_timeout, so a call to Redis "
                "can wait for ever where a partition drops its bytes (the heartbeat is bounded and "
                "watched; register, unregister and close are not): give the client a socket_timeout "
                "below ttl_ms (%d ms)", self._server_id, self.ttl_ms,
            )

    # The sync and asyncio primitives (threading or asyncio).
    def _new_lock(self) -> Any:
        raise NotImplementedError

    def _new_event(self) -> Any:
        raise NotImplementedError

    @staticmethod
    def new_server_id(base: str) -> str:
        """`gw-7` -> `gw-7#<unix ms>`: the id of a new incarnation."""
        return ids.new_server_id(base)

    @property
    def server_id(self) -> str:
        return self._server_id

    @property
    def fenced(self) -> bool:
        return self._fenced_error is not None

    @property
    def cluster(self) -> bool:
        return self._protocol.cluster

    def __repr__(self) -> str:
        state = (
            "fenced" if self.fenced else "closed" if self._closed else "running" if self._running
            else "starting" if self._started else "new"
        )
        return f"<{type(self).__name__} {self._server_id} layout={self.layout} {state}>"

    def _entry(self, user: object, connection: object) -> Entry:
        """The validated (user, connection) of a register/unregister call."""
        raw = ids.user_id(user)
        if self.layout == "conns":
            return raw, ids.connection_id(connection)
        if connection is not None:
            raise ValueError(f"a connection id is for layout conns only (this server is layout {self.layout})")
        return raw, None

    def _closed_error(self) -> Closed:
        return Closed(f"connection server {self._server_id} is closed")

    def _usable(self, unregistering: bool = False) -> bool:
        """Whether register/unregister may go to Redis now; raises if it may not. False
        for an unregister after close() (close() unregistered everything already).
        Called with self._lock held."""
        if self._fenced_error is not None:
            raise Fenced(self._server_id, str(self._fenced_error))
        if self._closed:
            if unregistering:
                return False
            raise self._closed_error()
        if not self._running:
            when = "has not completed its first heartbeat" if self._started else "was not called"
            raise RuntimeError(
                f"connection server {self._server_id}: start() {when}; call start() first and "
                "register once it has returned (the heartbeat goes before the first user)"
            )
        return True

    def _begin_call(self) -> None:
        """Counts a call in flight (with self._lock held): close() waits for it."""
        self._calls += 1
        self._idle.clear()

    def _end_call(self) -> None:
        with self._lock:
            self._calls -= 1
            if self._calls == 0:
                self._idle.set()

    def _begin(self, entry: Entry, registering: bool) -> tuple[EntryOrder, int] | None:
        """Admits a register (or unregister) call of `entry`: its order and the generation
        it was made in; an unregister supersedes the registers made before it. None: an
        unregister with nothing to do (after close())."""
        with self._lock:
            if not self._usable(unregistering=not registering):
                return None
            order = self._order.get(entry)
            if order is None:
                order = self._order[entry] = EntryOrder(self._new_lock())
            order.calls += 1
            if not registering:
                order.generation += 1
            self._begin_call()
            return order, order.generation

    def _end(self, entry: Entry, order: EntryOrder) -> None:
        with self._lock:
            order.calls -= 1
            if order.calls == 0 and self._order.get(entry) is order:
                del self._order[entry]
        self._end_call()

    def _admit(self, entry: Entry, order: EntryOrder, generation: int) -> None:
        """Before each attempt of a register (order.lock held): Superseded if an
        unregister of the entry or close() came after it; else the entry is held (close()
        unregisters it, as the attempt may be written even if its reply is lost)."""
        with self._lock:
            if order.generation != generation:
                raise Superseded(by_close=False)
            if self._closed:
                raise Superseded(by_close=True)
            self._entries.add(entry)

    def _note_fenced(self, error: Fenced) -> bool:
        """Marks this server fenced; True the first time (the caller then stops the
        heartbeat and calls on_fenced)."""
        error.server_id = self._server_id
        with self._lock:
            if self._fenced_error is not None:
                return False
            self._fenced_error = error
        log.warning("connection server %s is fenced: %s", self._server_id, error)
        return True

    def _mark_started(self) -> None:
        """start() begins: counted as a call in flight until _end_call()."""
        with self._lock:
            if self._fenced_error is not None:
                raise Fenced(self._server_id, str(self._fenced_error))
            if self._closed:
                raise self._closed_error()
            if self._started:
                raise RuntimeError(f"connection server {self._server_id} was already started")
            self._started = True
            self._heartbeat_sent = True
            self._begin_call()

    def _start_failed(self) -> None:
        with self._lock:
            self._started = self.fenced  # start() may be called again, unless fenced

    def _mark_running(self) -> bool:
        """start()'s first heartbeat went through: register() is open. False if close()
        was called meanwhile (it waits for start() and then leaves)."""
        with self._lock:
            if self._closed or self._fenced_error is not None:
                return False
            self._running = True
            return True

    def _check_starting(self) -> None:
        """Before each attempt of start()'s first heartbeat: none after close()."""
        if self._closed:
            raise self._closed_error()

    def _mark_closed(self) -> bool:
        """True the first time close() is called."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def _must_leave(self) -> bool:
        """After the calls in flight ended: whether close() unregisters and leaves (not if
        fenced, nor if no heartbeat was ever sent)."""
        with self._lock:
            return self._fenced_error is None and self._heartbeat_sent

    def _track(self, entry: Entry, held: bool) -> None:
        with self._lock:
            (self._entries.add if held else self._entries.discard)(entry)

    def _held_entries(self) -> list[Entry]:
        with self._lock:
            return sorted(self._entries, key=lambda e: (e[0], e[1] or ""))


def leave_outcome(results: list[Any]) -> tuple[Fenced | None, Exception | None]:
    """What close() learns from unregistering its entries: FENCED, or another error (then
    it leaves the liveness key to expire, so that the janitor cleans what is left)."""
    fenced = next((r for r in results if isinstance(r, Fenced)), None)
    others = [r for r in results if isinstance(r, Exception) and not isinstance(r, Fenced)]
    if others:
        others[0].add_note(
            f"close(): {len(others)} of {len(results)} entries could not be unregistered; the "
            "liveness key is left to expire, and the janitor cleans up after this server"
        )
    return fenced, others[0] if others else None


def report(callback: Callable[..., Any] | None, *args: Any) -> Any:
    """Calls an application callback; its errors are logged, never raised into the client."""
    if callback is None:
        return None
    try:
        return callback(*args)
    except Exception:
        log.exception("registry_janitor_client: callback %r failed", callback)
        return None


class RouterState:
    """Settings of a Router (sync or asyncio)."""

    def __init__(self, redis: Any, *, layout: str = "keys", key_prefix: str = "", retry: RetryPolicy | None = None):
        check_primary_reads(redis)
        self.redis = redis
        self.layout = layout
        self.key_prefix = key_prefix
        self.retry = check_retry(retry)
        self._protocol = Protocol(layout, key_prefix, is_cluster(redis))

    @property
    def cluster(self) -> bool:
        return self._protocol.cluster

    def _users(self, users: Any, conns: bool) -> list[bytes]:
        """Validated user ids for route (conns False) or route_user (conns True)."""
        if conns and self.layout != "conns":
            raise ValueError(f"route_user and route_users are for layout conns (this router is layout {self.layout}); use route")
        if not conns and self.layout == "conns":
            raise ValueError("layout conns routes with route_user or route_users (a user may have several servers)")
        if isinstance(users, (str, bytes, bytearray, memoryview)):
            raise TypeError("users must be a list of user ids, not one user id")
        return [ids.user_id(u) for u in users]
