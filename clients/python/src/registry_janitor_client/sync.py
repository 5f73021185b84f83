"""The sync client: redis.Redis (one node, or Sentinel's master_for) and
redis.cluster.RedisCluster. The heartbeat runs on a daemon thread."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Sequence

from redis import exceptions as rex

from ._core import RouterState, ServerState, leave_outcome, log, now_ms, report
from .errors import Fenced
from .retry import NO_RETRY, RetryPolicy, retry_sync, stale_primary_pool
from .scripts import READ_ONLY, SOURCES
from .steps import (
    Batch,
    Call,
    Op,
    Script,
    Steps,
    T,
    command,
    drive,
    missing_scripts,
    read_only_refused,
    refuses_read_only,
    settle,
    translate,
)


class Executor:
    """Sends the steps' ops to one client: EVALSHA with a NOSCRIPT fallback (SCRIPT LOAD,
    then again), EVALSHA_RO for the read-only scripts with a fallback to EVALSHA where
    it is refused, and retries of states that pass."""

    def __init__(self, client: Any, retry: RetryPolicy):
        self.client = client
        self.retry = retry
        self.read_only = True  # False once EVALSHA_RO was refused and EVALSHA answered

    def run(self, steps: Steps[T], retry: RetryPolicy | None = None) -> T:
        policy = retry or self.retry
        return drive(steps, lambda op: retry_sync(lambda: self._once(op), policy, self.client))

    def _once(self, op: Op) -> Any:
        try:
            if isinstance(op, Batch):
                return self._batch(op.ops)
            if isinstance(op, Call):
                return self.client.execute_command(*op.args)
            return self._script(op)
        except rex.ResponseError as error:
            meant = translate(error)
            if meant is error:
                raise
            raise meant from error

    def _load(self, name: str) -> None:
        self.client.execute_command("SCRIPT LOAD", SOURCES[name])

    def _evalsha(self, op: Script, read_only: bool) -> Any:
        args = command(op, read_only)
        try:
            return self.client.execute_command(*args)
        except rex.NoScriptError:
            self._load(op.name)
            return self.client.execute_command(*args)

    def _script(self, op: Script) -> Any:
        read_only = self.read_only and op.name in READ_ONLY
        try:
            return self._evalsha(op, read_only)
        except rex.ResponseError as error:
            if not (read_only and refuses_read_only(error)):
                raise
        reply = self._evalsha(op, False)
        self.read_only = False
        return reply

    def _pipeline(self, ops: Sequence[Call | Script], read_only: bool) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for op in ops:
            pipe.execute_command(*command(op, read_only))
        replies: list[Any] = pipe.execute(raise_on_error=False)
        return replies

    def _send(self, ops: Sequence[Call | Script], read_only: bool) -> list[Any]:
        replies = self._pipeline(ops, read_only)
        missing = missing_scripts(ops, replies)
        for name in missing:
            self._load(name)
        return self._pipeline(ops, read_only) if missing else replies

    def _batch(self, ops: Sequence[Call | Script]) -> list[Any]:
        read_only = self.read_only
        replies = self._send(ops, read_only)
        if read_only and read_only_refused(ops, replies):
            replies = self._send(ops, False)
            if not read_only_refused(ops, replies):
                self.read_only = False
        return settle(replies)


class ConnectionServer(ServerState):
    """One incarnation of a connection server: heartbeats, registers and unregisters its
    users (or, layout conns, their connections) by the protocol's scripts.

        server = ConnectionServer(redis.Redis(), ConnectionServer.new_server_id("gw-7"),
                                  on_fenced=lambda err: close_all_sockets())
        server.start()                 # first heartbeat, then one every interval
        server.register("alice")
        server.unregister("alice")     # -> True if the entry was deleted
        server.close()                 # unregisters what is left, leaves the fleet

    Thread-safe: register/unregister may be called from several threads.
    """

    def __init__(self, redis: Any, server_id: str, **options: Any):
        super().__init__(redis, server_id, **options)
        self._executor = Executor(redis, self.retry)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "ConnectionServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, steps: Steps[T], retry: RetryPolicy | None = None) -> T:
        try:
            return self._executor.run(steps, retry)
        except Fenced as error:
            self._fenced(error)
            raise

    def _fenced(self, error: Fenced) -> None:
        if self._note_fenced(error):
            self._stop.set()
            report(self.on_fenced, error)

    def start(self) -> None:
        """The first heartbeat (retried while Redis is unreachable or in a passing state;
        Fenced if this id is fenced), then one every heartbeat_interval_ms on a thread."""
        self._mark_started()
        began = time.monotonic()
        try:
            self._run(self._protocol.heartbeat(self._server_id, self.ttl_ms, now_ms()))
        except BaseException:
            with self._lock:
                self._started = self.fenced
            raise
        self._clock.succeeded()
        self._thread = threading.Thread(
            target=self._beat, args=(began,), name=f"heartbeat {self._server_id}", daemon=True
        )
        self._thread.start()

    def _beat(self, began: float) -> None:
        while not self._stop.wait(self._clock.next_delay(began)):
            began = time.monotonic()
            try:
                self._executor.run(self._protocol.heartbeat(self._server_id, self.ttl_ms, now_ms()), NO_RETRY)
            except Fenced as error:
                self._fenced(error)
                return
            except Exception as error:
                pool = stale_primary_pool(self.redis, error)
                if pool is not None:
                    pool.disconnect()
                lost = self._clock.failed(error)
                log.debug("heartbeat of %s failed: %r", self._server_id, error)
                if lost is not None:
                    log.warning("heartbeats of %s lost since %d: %r", self._server_id, lost.since_ms, error)
                    report(self.on_heartbeat_lost, lost)
            else:
                if self._clock.succeeded():
                    log.info("heartbeats of %s restored", self._server_id)
                    report(self.on_heartbeat_restored)

    def register(self, user: str | bytes, connection: str | None = None) -> None:
        """A user connected (layout conns: connection `connection` of the user opened).
        Fenced if this server was declared dead (nothing is written)."""
        entry = self._entry(user, connection)
        self._usable()
        self._track(entry, True)
        try:
            self._run(self._protocol.register(self._server_id, *entry))
        except Fenced:
            self._track(entry, False)
            raise

    def unregister(self, user: str | bytes, connection: str | None = None) -> bool:
        """A clean disconnect; True if the forward entry (layout conns: the connection's
        field) named this server and was deleted. After close(): False, sending nothing
        (close() unregistered everything)."""
        entry = self._entry(user, connection)
        if not self._usable(unregistering=True):
            return False
        deleted = self._run(self._protocol.unregister(self._server_id, *entry))
        self._track(entry, False)
        return deleted

    def close(self) -> None:
        """Stops the heartbeat; then, unless fenced, unregisters every entry still held and
        removes the liveness key and the `servers` member, so that the janitor has nothing
        to clean. If an entry cannot be unregistered, its error is raised and the liveness
        key is left to expire (the janitor then cleans what is left)."""
        if not self._mark_closed():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self.fenced or not self._started:
            return
        entries = self._held_entries()
        results = self._run(self._protocol.unregister_all(self._server_id, entries)) if entries else []
        fenced, other = leave_outcome(results)
        if fenced is not None:
            self._fenced(fenced)
            return
        if other is not None:
            raise other
        with self._lock:
            self._entries.clear()
        self._run(self._protocol.leave(self._server_id))


class Router:
    """Where to send a user's messages: never to a fenced server or one past its liveness.
    Any client will do (a Sentinel `slave_for` client too: the lookups only read)."""

    def __init__(self, redis: Any, *, layout: str = "keys", key_prefix: str = "", retry: RetryPolicy | None = None):
        self._state = RouterState(redis, layout=layout, key_prefix=key_prefix, retry=retry)
        self._executor = Executor(redis, self._state.retry)

    @property
    def layout(self) -> str:
        return self._state.layout

    def route(self, user: str | bytes) -> str | None:
        """The user's server (layouts hash and keys), or None."""
        return self.route_many([user])[0]

    def route_many(self, users: Iterable[str | bytes]) -> list[str | None]:
        """route for many users, pipelined; in order."""
        return self._executor.run(self._state._protocol.route_many(self._state._users(users, False)))

    def route_user(self, user: str | bytes) -> list[str]:
        """Layout conns: the distinct live servers of the user's connections, sorted."""
        return self.route_users([user])[0]

    def route_users(self, users: Iterable[str | bytes]) -> list[list[str]]:
        """route_user for many users, pipelined; in order."""
        return self._executor.run(self._state._protocol.route_users(self._state._users(users, True)))


__all__ = ["ConnectionServer", "Router"]
