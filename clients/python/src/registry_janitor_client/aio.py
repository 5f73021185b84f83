"""The asyncio client: redis.asyncio.Redis (one node, or Sentinel's master_for) and
redis.asyncio.cluster.RedisCluster. The heartbeat runs on an asyncio task. Callbacks
may be plain functions or coroutine functions."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Awaitable, Callable, Iterable, Sequence

from redis import exceptions as rex

from ._core import RouterState, ServerState, Superseded, leave_outcome, log, now_ms, report
from .errors import Fenced
from .retry import NO_RETRY, RetryPolicy, retry_async, stale_primary_pool
from .scripts import READ_ONLY, SOURCES
from .steps import (
    Batch,
    Call,
    Op,
    Script,
    Steps,
    T,
    command,
    drive_async,
    missing_scripts,
    read_only_refused,
    refuses_read_only,
    settle,
    translate,
)


async def _report(callback: Callable[..., Any] | None, *args: Any) -> None:
    result = report(callback, *args)
    if inspect.isawaitable(result):
        try:
            await result
        except Exception:
            log.exception("registry_janitor_client: callback %r failed", callback)


#: Wraps one attempt of an op: awaits it (call()) or raises instead.
AsyncGuard = Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]


class AsyncExecutor:
    """The asyncio twin of sync.Executor."""

    def __init__(self, client: Any, retry: RetryPolicy):
        self.client = client
        self.retry = retry
        self.read_only = True

    async def run(self, steps: Steps[T], retry: RetryPolicy | None = None, guard: AsyncGuard | None = None) -> T:
        """Runs `steps`; each attempt of each op through `guard` (which may refuse it)."""
        policy = retry or self.retry

        def attempt(op: Op) -> Awaitable[Any]:
            return self._once(op) if guard is None else guard(lambda: self._once(op))

        return await drive_async(steps, lambda op: retry_async(lambda: attempt(op), policy, self.client))

    async def _once(self, op: Op) -> Any:
        try:
            if isinstance(op, Batch):
                return await self._batch(op.ops)
            if isinstance(op, Call):
                return await self.client.execute_command(*op.args)
            return await self._script(op)
        except rex.ResponseError as error:
            meant = translate(error)
            if meant is error:
                raise
            raise meant from error

    async def _load(self, name: str) -> None:
        await self.client.execute_command("SCRIPT LOAD", SOURCES[name])

    async def _evalsha(self, op: Script, read_only: bool) -> Any:
        args = command(op, read_only)
        try:
            return await self.client.execute_command(*args)
        except rex.NoScriptError:
            await self._load(op.name)
            return await self.client.execute_command(*args)

    async def _script(self, op: Script) -> Any:
        read_only = self.read_only and op.name in READ_ONLY
        try:
            return await self._evalsha(op, read_only)
        except rex.ResponseError as error:
            if not (read_only and refuses_read_only(error)):
                raise
        reply = await self._evalsha(op, False)
        self.read_only = False
        return reply

    async def _pipeline(self, ops: Sequence[Call | Script], read_only: bool) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for op in ops:
            pipe.execute_command(*command(op, read_only))
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies

    async def _send(self, ops: Sequence[Call | Script], read_only: bool) -> list[Any]:
        replies = await self._pipeline(ops, read_only)
        missing = missing_scripts(ops, replies)
        for name in missing:
            await self._load(name)
        return await self._pipeline(ops, read_only) if missing else replies

    async def _batch(self, ops: Sequence[Call | Script]) -> list[Any]:
        read_only = self.read_only
        replies = await self._send(ops, read_only)
        if read_only and read_only_refused(ops, replies):
            replies = await self._send(ops, False)
            if not read_only_refused(ops, replies):
                self.read_only = False
        return settle(replies)


class AsyncConnectionServer(ServerState):
    """ConnectionServer for asyncio: the same API, awaited.

        async with AsyncConnectionServer(redis.asyncio.Redis(), server_id) as server:
            await server.register("alice")
    """

    def __init__(self, redis: Any, server_id: str, **options: Any):
        super().__init__(redis, server_id, **options)
        self._executor = AsyncExecutor(redis, self.retry)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def _new_lock(self) -> Any:
        return asyncio.Lock()

    def _new_event(self) -> Any:
        return asyncio.Event()

    async def __aenter__(self) -> "AsyncConnectionServer":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _run(self, steps: Steps[T], retry: RetryPolicy | None = None, guard: AsyncGuard | None = None) -> T:
        try:
            return await self._executor.run(steps, retry, guard)
        except Fenced as error:
            await self._fenced(error)
            raise

    async def _fenced(self, error: Fenced) -> None:
        if self._note_fenced(error):
            self._stop.set()
            await _report(self.on_fenced, error)

    async def start(self) -> None:
        """The first heartbeat (retried while Redis is unreachable or in a passing state;
        Fenced if this id is fenced), then one every heartbeat_interval_ms on a task.
        register() is open once it has returned."""
        self._mark_started()
        try:
            began = time.monotonic()

            async def unless_closed(call: Callable[[], Awaitable[Any]]) -> Any:
                self._check_starting()
                return await call()

            try:
                await self._run(self._protocol.heartbeat(self._server_id, self.ttl_ms, now_ms()), guard=unless_closed)
            except BaseException:
                self._start_failed()
                raise
            self._clock.succeeded()
            if not self._mark_running():
                return  # closed meanwhile: close() waits for this call, then leaves
            self._task = asyncio.create_task(self._beat(began), name=f"heartbeat {self._server_id}")
        finally:
            self._end_call()

    async def _heartbeat(self) -> None:
        """One heartbeat, bounded by the interval: without a socket_timeout, a call on a
        connection whose bytes are dropped would otherwise never end."""
        steps = self._protocol.heartbeat(self._server_id, self.ttl_ms, now_ms())
        try:
            await asyncio.wait_for(self._executor.run(steps, NO_RETRY), self.heartbeat_interval_ms / 1000)
        except TimeoutError:
            raise rex.TimeoutError(
                f"heartbeat: no reply within {self.heartbeat_interval_ms} ms (the interval)"
            ) from None

    async def _beat(self, began: float) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self._clock.next_delay(began))
                return
            except TimeoutError:
                pass
            began = time.monotonic()
            self._clock.begin()
            try:
                await self._heartbeat()
            except Fenced as error:
                await self._fenced(error)
                return
            except Exception as error:
                pool = stale_primary_pool(self.redis, error)
                if pool is not None:
                    await pool.disconnect()
                lost = self._clock.failed(error)
                log.debug("heartbeat of %s failed: %r", self._server_id, error)
                if lost is not None:
                    log.warning("heartbeats of %s lost since %d: %r", self._server_id, lost.since_ms, error)
                    await _report(self.on_heartbeat_lost, lost)
            else:
                if self._clock.succeeded():
                    log.info("heartbeats of %s restored", self._server_id)
                    await _report(self.on_heartbeat_restored)

    async def register(self, user: str | bytes, connection: str | None = None) -> None:
        """A user connected (layout conns: connection `connection` of the user opened).
        Fenced if this server was declared dead (nothing is written). Returns without
        writing further if an unregister() of the same entry is called meanwhile;
        Closed if close() is."""
        entry = self._entry(user, connection)
        admitted = self._begin(entry, registering=True)
        assert admitted is not None
        order, generation = admitted

        async def in_order(call: Callable[[], Awaitable[Any]]) -> Any:
            async with order.lock:
                self._admit(entry, order, generation)
                return await call()

        try:
            await self._run(self._protocol.register(self._server_id, *entry), guard=in_order)
        except Superseded as superseded:
            if superseded.by_close:
                raise self._closed_error() from None
        except Fenced:
            self._track(entry, False)
            raise
        finally:
            self._end(entry, order)

    async def unregister(self, user: str | bytes, connection: str | None = None) -> bool:
        """A clean disconnect; True if the forward entry (layout conns: the connection's
        field) named this server and was deleted."""
        entry = self._entry(user, connection)
        admitted = self._begin(entry, registering=False)
        if admitted is None:
            return False
        order, _ = admitted
        try:
            async with order.lock:  # after the attempt in flight of a register made before
                deleted = await self._run(self._protocol.unregister(self._server_id, *entry))
                self._track(entry, False)
                return deleted
        finally:
            self._end(entry, order)

    async def close(self) -> None:
        """As ConnectionServer.close: stop the heartbeat, wait for the calls in flight,
        unregister what is held, leave."""
        if not self._mark_closed():
            return
        self._stop.set()
        if not self.fenced:  # from on_fenced, inside a call in flight: nothing to wait for
            await self._idle.wait()
        if self._task is not None and self._task is not asyncio.current_task():
            await self._task  # a heartbeat in progress ends within an interval
        if not self._must_leave():
            return
        entries = self._held_entries()
        results = await self._run(self._protocol.unregister_all(self._server_id, entries)) if entries else []
        fenced, other = leave_outcome(results)
        if fenced is not None:
            await self._fenced(fenced)
            return
        if other is not None:
            raise other
        with self._lock:
            self._entries.clear()
        self._left = True
        await self._run(self._protocol.leave(self._server_id))


class AsyncRouter:
    """Router for asyncio: the same API, awaited."""

    def __init__(self, redis: Any, *, layout: str = "keys", key_prefix: str = "", retry: RetryPolicy | None = None):
        self._state = RouterState(redis, layout=layout, key_prefix=key_prefix, retry=retry)
        self._executor = AsyncExecutor(redis, self._state.retry)

    @property
    def layout(self) -> str:
        return self._state.layout

    async def route(self, user: str | bytes) -> str | None:
        return (await self.route_many([user]))[0]

    async def route_many(self, users: Iterable[str | bytes]) -> list[str | None]:
        return await self._executor.run(self._state._protocol.route_many(self._state._users(users, False)))

    async def route_user(self, user: str | bytes) -> list[str]:
        return (await self.route_users([user]))[0]

    async def route_users(self, users: Iterable[str | bytes]) -> list[list[str]]:
        return await self._executor.run(self._state._protocol.route_users(self._state._users(users, True)))
