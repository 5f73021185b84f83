"""The sync client: redis.Redis (one node, or Sentinel's master_for) and
redis.cluster.RedisCluster. The heartbeat runs on a daemon thread."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Sequence

from redis import exceptions as rex

from ._core import HeartbeatLost, RouterState, ServerState, Superseded, leave_outcome, log, now_ms, report
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


#: Wraps one attempt of an op: runs it (call()) or raises instead.
Guard = Callable[[Callable[[], Any]], Any]


class Executor:
    """Sends the steps' ops to one client: EVALSHA with a NOSCRIPT fallback (SCRIPT LOAD,
    then again), EVALSHA_RO for the read-only scripts with a fallback to EVALSHA where
    it is refused, and retries of states that pass."""

    def __init__(self, client: Any, retry: RetryPolicy):
        self.client = client
        self.retry = retry
        self.read_only = True  # False once EVALSHA_RO was refused and EVALSHA answered

    def run(self, steps: Steps[T], retry: RetryPolicy | None = None, guard: Guard | None = None) -> T:
        """Runs `steps`; each attempt of each op through `guard` (which may refuse it)."""
        policy = retry or self.retry

        def attempt(op: Op) -> Any:
            return self._once(op) if guard is None else guard(lambda: self._once(op))

        return drive(steps, lambda op: retry_sync(lambda: attempt(op), policy, self.client))

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
        self._watchdog: threading.Thread | None = None

    def _new_lock(self) -> Any:
        return threading.Lock()

    def _new_event(self) -> Any:
        return threading.Event()

    def __enter__(self) -> "ConnectionServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, steps: Steps[T], retry: RetryPolicy | None = None, guard: Guard | None = None) -> T:
        try:
            return self._executor.run(steps, retry, guard)
        except Fenced as error:
            self._fenced(error)
            raise

    def _fenced(self, error: Fenced) -> None:
        if self._note_fenced(error):
            self._stop.set()
            report(self.on_fenced, error)

    def start(self) -> None:
        """The first heartbeat (retried while Redis is unreachable or in a passing state;
        Fenced if this id is fenced), then one every heartbeat_interval_ms on a thread.
        register() is open once it has returned."""
        self._mark_started()
        try:
            began = time.monotonic()

            def unless_closed(call: Callable[[], Any]) -> Any:
                self._check_starting()
                return call()

            try:
                self._run(self._protocol.heartbeat(self._server_id, self.ttl_ms, now_ms()), guard=unless_closed)
            except BaseException:
                self._start_failed()
                raise
            self._clock.succeeded()
            if not self._mark_running():
                return  # closed meanwhile: close() waits for this call, then leaves
            name = f"heartbeat {self._server_id}"
            self._thread = threading.Thread(target=self._beat, args=(began,), name=name, daemon=True)
            self._watchdog = threading.Thread(target=self._watch, name=f"{name} watchdog", daemon=True)
            self._thread.start()
            self._watchdog.start()
        finally:
            self._end_call()

    def _beat(self, began: float) -> None:
        while not self._stop.wait(self._clock.next_delay(began)):
            began = time.monotonic()
            self._clock.begin()
            try:
                self._executor.run(self._protocol.heartbeat(self._server_id, self.ttl_ms, now_ms()), NO_RETRY)
            except Fenced as error:
                self._fenced(error)
                return
            except Exception as error:
                self._leave_again()
                pool = stale_primary_pool(self.redis, error)
                if pool is not None:
                    pool.disconnect()
                lost = self._clock.failed(error)
                log.debug("heartbeat of %s failed: %r", self._server_id, error)
                if lost is not None:
                    self._lost(lost)
            else:
                self._leave_again()
                if self._clock.succeeded():
                    log.info("heartbeats of %s restored", self._server_id)
                    report(self.on_heartbeat_restored)

    def _watch(self) -> None:
        """The watchdog: reports a lost stretch while a heartbeat is blocked in a call that
        neither answers nor times out (a client without socket_timeout, a partition that
        drops bytes)."""
        while not self._stop.wait(self._clock.watch_delay()):
            lost = self._clock.overdue()
            if lost is not None and not self._stop.is_set():
                self._lost(lost)

    def _lost(self, lost: HeartbeatLost) -> None:
        log.warning("heartbeats of %s lost since %d: %r", self._server_id, lost.since_ms, lost.error)
        report(self.on_heartbeat_lost, lost)

    def _leave_again(self) -> None:
        """A heartbeat that was blocked while close() left may have landed after it: leave
        once more, so that the closed server is not taken for a dead one."""
        if not self._left:
            return
        try:
            self._executor.run(self._protocol.leave(self._server_id), NO_RETRY)
        except Exception as error:
            log.debug("%s: leaving again after a late heartbeat failed: %r", self._server_id, error)

    def register(self, user: str | bytes, connection: str | None = None) -> None:
        """A user connected (layout conns: connection `connection` of the user opened).
        Fenced if this server was declared dead (nothing is written). Returns without
        writing further if an unregister() of the same entry is called meanwhile;
        Closed if close() is."""
        entry = self._entry(user, connection)
        admitted = self._begin(entry, registering=True)
        assert admitted is not None
        order, generation = admitted

        def in_order(call: Callable[[], Any]) -> Any:
            with order.lock:
                self._admit(entry, order, generation)
                return call()

        try:
            self._run(self._protocol.register(self._server_id, *entry), guard=in_order)
        except Superseded as superseded:
            if superseded.by_close:
                raise self._closed_error() from None
        except Fenced:
            self._track(entry, False)
            raise
        finally:
            self._end(entry, order)

    def unregister(self, user: str | bytes, connection: str | None = None) -> bool:
        """A clean disconnect; True if the forward entry (layout conns: the connection's
        field) named this server and was deleted. After close(): False, sending nothing
        (close() unregistered everything)."""
        entry = self._entry(user, connection)
        admitted = self._begin(entry, registering=False)
        if admitted is None:
            return False
        order, _ = admitted
        try:
            with order.lock:  # after the attempt in flight of a register made before
                deleted = self._run(self._protocol.unregister(self._server_id, *entry))
                self._track(entry, False)
                return deleted
        finally:
            self._end(entry, order)

    def close(self) -> None:
        """Stops the heartbeat; waits for the calls in flight (a register() still retrying
        sends no further attempt and raises Closed); then, unless fenced, unregisters
        every entry still held and removes the liveness key and the `servers` member, so
        that the janitor has nothing to clean. If an entry cannot be unregistered, its
        error is raised and the liveness key is left to expire (the janitor then cleans
        what is left)."""
        if not self._mark_closed():
            return
        self._stop.set()
        if not self.fenced:  # from on_fenced, inside a call in flight: nothing to wait for
            self._idle.wait()
        self._join_heartbeat()
        if not self._must_leave():
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
        self._left = True
        self._run(self._protocol.leave(self._server_id))

    def _join_heartbeat(self) -> None:
        """Waits for the heartbeat thread, at most ttl_ms: one blocked in a call to Redis
        (no socket_timeout) is left behind, and stops once that call returns."""
        for thread in (self._watchdog, self._thread):
            if thread is None or thread is threading.current_thread():
                continue
            thread.join(self.ttl_ms / 1000)
            if thread.is_alive():
                log.warning(
                    "close() of %s: the heartbeat thread is still blocked in a call to Redis after "
                    "%d ms; going on without it (give the Redis client a socket_timeout)",
                    self._server_id, self.ttl_ms,
                )


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
