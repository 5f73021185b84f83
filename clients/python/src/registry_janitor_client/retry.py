"""Which Redis errors pass, and the capped exponential backoff that waits them out."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator, TypeVar

from redis import exceptions as rex

T = TypeVar("T")

#: Error codes of states that pass (a restart, a failover, a slow script, memory freed).
TRANSIENT_CODES = frozenset(
    {"LOADING", "BUSY", "READONLY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "NOREPLICAS", "OOM", "MISCONF"}
)

# redis-py turns some codes into classes and strips the code from the message.
_TRANSIENT_CLASSES = (
    rex.ConnectionError,  # also BusyLoadingError (LOADING), Sentinel's MasterNotFoundError
    rex.TimeoutError,
    rex.ReadOnlyError,
    rex.OutOfMemoryError,
    rex.TryAgainError,
    rex.ClusterDownError,  # also MasterDownError
    rex.ClusterError,  # RedisCluster gave up after its own retries ("TTL exhausted")
    rex.SlotNotCoveredError,
)


def is_transient(error: BaseException) -> bool:
    """Whether `error` is a state that passes: worth another try after a pause."""
    if isinstance(error, (rex.AuthenticationError, rex.AuthorizationError)):
        return False
    if isinstance(error, _TRANSIENT_CLASSES):
        return True
    if isinstance(error, rex.ResponseError):
        return str(error).split(" ", 1)[0] in TRANSIENT_CODES
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How register, unregister, route and start wait out a state that passes.

    `attempts` tries in all; between two, a pause doubling from `base_delay_ms` up to
    `max_delay_ms` (each pause drawn between half and all of that); no new attempt once
    `timeout_ms` have passed since the first began (None: no limit). The defaults give
    up after about 5 to 10 s. One attempt's own time is bounded by the Redis client's
    `socket_timeout`.
    """

    attempts: int = 10
    max_delay_ms: int = 2000
    base_delay_ms: int = 50
    timeout_ms: int | None = 10_000

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.max_delay_ms < 0 or self.base_delay_ms < 0 or (self.timeout_ms or 0) < 0:
            raise ValueError("retry: attempts must be at least 1, delays and timeout at least 0")

    def delays(self) -> Iterator[float]:
        """The pauses (seconds) before the 2nd, 3rd, ... attempt, cut short by timeout_ms
        (counted from this call)."""
        deadline = None if self.timeout_ms is None else time.monotonic() + self.timeout_ms / 1000
        return self._pauses(deadline)

    def _pauses(self, deadline: float | None) -> Iterator[float]:
        for n in range(self.attempts - 1):
            ceiling = min(self.max_delay_ms, self.base_delay_ms * 2**n) / 1000
            pause = ceiling / 2 + random.uniform(0, ceiling / 2)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                pause = min(pause, left)
            yield pause


NO_RETRY = RetryPolicy(attempts=1)


def sentinel_primary_pool(client: object) -> Any:
    """The connection pool of a Sentinel `master_for` client (sync or asyncio), else None."""
    from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
    from redis.sentinel import SentinelConnectionPool

    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, (SentinelConnectionPool, AsyncSentinelPool)) and pool.is_master:
        return pool
    return None


def from_stale_primary(error: BaseException) -> bool:
    """An error of a node that may no longer be the primary Sentinel names: a demoted one
    (READONLY), or one cut off from its replicas (NOREPLICAS, MASTERDOWN)."""
    if isinstance(error, (rex.ReadOnlyError, rex.MasterDownError)):
        return True
    return isinstance(error, rex.ResponseError) and str(error).split(" ", 1)[0] in ("NOREPLICAS", "MASTERDOWN")


def stale_primary_pool(client: object, error: BaseException) -> Any:
    """The Sentinel pool to drop after `error`, if it came from a stale primary."""
    return sentinel_primary_pool(client) if from_stale_primary(error) else None


def retry_sync(call: Callable[[], T], policy: RetryPolicy, client: object = None) -> T:
    """`call`, tried again after a pause while it fails with a state that passes. Behind
    Sentinel, an error of a stale primary drops the pool's connections first, so that the
    next try asks the sentinels for the primary again."""
    delays = policy.delays()
    while True:
        try:
            return call()
        except Exception as error:
            delay = next(delays, None) if is_transient(error) else None
            if delay is None:
                raise
            pool = stale_primary_pool(client, error)
            if pool is not None:
                pool.disconnect()
        time.sleep(delay)


async def retry_async(call: Callable[[], Awaitable[T]], policy: RetryPolicy, client: object = None) -> T:
    """retry_sync for asyncio."""
    delays = policy.delays()
    while True:
        try:
            return await call()
        except Exception as error:
            delay = next(delays, None) if is_transient(error) else None
            if delay is None:
                raise
            pool = stale_primary_pool(client, error)
            if pool is not None:
                await pool.disconnect()
        await asyncio.sleep(delay)
