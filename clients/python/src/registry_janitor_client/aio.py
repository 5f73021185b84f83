"""The asyncio client: redis.asyncio.Redis (one node, or Sentinel's master_for) and
redis.asyncio.cluster.RedisCluster. The heartbeat runs on an asyncio task. Callbacks
may be plain functions or coroutine functions."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable, Iterable, Sequence

from redis import exceptions as rex

from ._core import RouterState, ServerState, leave_outcome, log, now_ms, report
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


class AsyncExecutor:
    """The asyncio twin of sync.Executor."""

    def __init__(self, client: Any, retry: RetryPolicy):
        self.client = client
        self.retry = retry
        self.read_only = True

    async def run(self, steps: Steps[T], retry: RetryPolicy | None = None) -> T:
        policy = retry or self.retry
        return await drive_async(steps, lambda op: retry_async(lambda: self._once(op), policy, self.client))

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

    async def __aenter__(self) -> "AsyncConnectionServer":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _run(self, steps: Steps[T], retry: RetryPolicy | None = None) -> T:
        try:
            return await self._executor.run(steps, retry)
        except Fenced as error:
            await self._fenced(error)
            raise

    async def _fenced(self, error: Fenced) -> None:
        if self._note_fenced(error):
            self._stop.set()
            await _report(self.on_fenced, error)

    async def start(self) -> None:
        """The first heartbeat (retried while Redis is unreachable or in a passing state;
        Fenced if this id is fenced), then one every heartbeat_interval_ms on a task."""
        self._mark_started()
        began = time.monotonic()
        try:
            await self._run(self._protocol.heartbeat(self._server_id, self.ttl_ms, now_ms()))
        except BaseException:
            with self._lock:
                self._started = self.fenced
            raise
        self._clock.succeeded()
        self._task = asyncio.create_task(self._beat(began), name=f"heartbeat {self._server_id}")

    async def _beat(self, began: float) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self._clock.next_delay(began))
                return
            except TimeoutError:
                pass
            began = time.monotonic()
            try:
                steps = self._protocol.heartbeat(self._server_id, self.ttl_ms, now_ms())
                await self._executor.run(steps, NO_RETRY)
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
        Fenced if this server was declared dead (nothing is written)."""
        entry = self._entry(user, connection)
        self._usable()
        self._track(entry, True)
        try:
            await self._run(self._protocol.register(self._server_id, *entry))
        except Fenced:
            self._track(entry, False)
            raise

    async def unregister(self, user: str | bytes, connection: str | None = None) -> bool:
        """A clean disconnect; True if the forward entry (layout conns: the connection's
        field) named this server and was deleted."""
        entry = self._entry(user, connection)
        if not self._usable(unregistering=True):
            return False
        deleted = await self._run(self._protocol.unregister(self._server_id, *entry))
        self._track(entry, False)
        return deleted

    async def close(self) -> None:
        """As ConnectionServer.close: stop the heartbeat, unregister what is held, leave."""
        if not self._mark_closed():
            return
        self._stop.set()
        if self._task is not None and self._task is not asyncio.current_task():
            await self._task
        if self.fenced or not self._started:
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
