"""What the sync and the asyncio clients share: settings, the state of one server
incarnation (started, fenced, closed, the entries it holds) and the heartbeat clock."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

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
    """When to send the next heartbeat, and when a stretch of failures becomes lost."""

    def __init__(self, ttl_ms: int, interval_ms: int):
        self.ttl_s = ttl_ms / 1000
        self.interval_s = interval_ms / 1000
        self.failures = 0
        self.lost = False
        self.last_ok_ms = now_ms()
        self._last_ok = time.monotonic()

    def succeeded(self) -> bool:
        """Notes a heartbeat that went through; True if it ends a lost stretch."""
        self.last_ok_ms, self._last_ok = now_ms(), time.monotonic()
        restored, self.failures, self.lost = self.lost, 0, False
        return restored

    def failed(self, error: BaseException) -> HeartbeatLost | None:
        """Notes a failed heartbeat; a HeartbeatLost the first time a stretch passes the TTL."""
        self.failures += 1
        if self.lost or time.monotonic() - self._last_ok <= self.ttl_s:
            return None
        self.lost = True
        return HeartbeatLost(self.last_ok_ms, now_ms() - self.last_ok_ms, error)

    def next_delay(self, started: float) -> float:
        """Seconds until the next heartbeat: one interval after the start of the last, or
        sooner after a failure (50 ms doubling, at most an interval)."""
        if self.failures:
            return min(self.interval_s, 0.05 * 2.0 ** (self.failures - 1))
        return max(0.0, self.interval_s - (time.monotonic() - started))


def is_cluster(client: Any) -> bool:
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

    return isinstance(client, (RedisCluster, AsyncRedisCluster))


def check_retry(retry: RetryPolicy | None) -> RetryPolicy:
    if retry is None:
        return RetryPolicy()
    if not isinstance(retry, RetryPolicy):
        raise TypeError("retry must be a RetryPolicy")
    return retry


class ServerState:
    """One incarnation of a connection server as the registry sees it; the I/O is the
    subclasses' (sync: a heartbeat thread; asyncio: a heartbeat task)."""

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
        self._started = False
        self._closed = False
        self._fenced_error: Fenced | None = None
        # Entries registered and not unregistered (also those whose registration failed
        # with an error after which it may have been written): close() unregisters them.
        self._entries: set[tuple[bytes, str | None]] = set()
        self._clock = HeartbeatClock(self.ttl_ms, interval)

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
        state = "fenced" if self.fenced else "closed" if self._closed else "started" if self._started else "new"
        return f"<{type(self).__name__} {self._server_id} layout={self.layout} {state}>"

    def _entry(self, user: object, connection: object) -> tuple[bytes, str | None]:
        """The validated (user, connection) of a register/unregister call."""
        raw = ids.user_id(user)
        if self.layout == "conns":
            return raw, ids.connection_id(connection)
        if connection is not None:
            raise ValueError(f"a connection id is for layout conns only (this server is layout {self.layout})")
        return raw, None

    def _usable(self, unregistering: bool = False) -> bool:
        """Whether register/unregister may go to Redis now; raises if it may not. False
        for an unregister after close() (close() unregistered everything already)."""
        if self._fenced_error is not None:
            raise Fenced(self._server_id, str(self._fenced_error))
        if self._closed:
            if unregistering:
                return False
            raise Closed(f"connection server {self._server_id} is closed")
        if not self._started:
            raise RuntimeError(f"connection server {self._server_id}: call start() first (the heartbeat goes before the first user)")
        return True

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
        with self._lock:
            if self._fenced_error is not None:
                raise Fenced(self._server_id, str(self._fenced_error))
            if self._closed:
                raise Closed(f"connection server {self._server_id} is closed")
            if self._started:
                raise RuntimeError(f"connection server {self._server_id} was already started")
            self._started = True

    def _mark_closed(self) -> bool:
        """True the first time close() is called."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def _track(self, entry: tuple[bytes, str | None], held: bool) -> None:
        with self._lock:
            (self._entries.add if held else self._entries.discard)(entry)

    def _held_entries(self) -> list[tuple[bytes, str | None]]:
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
