"""Python client of registry-janitor's connection-server protocol.

Sync (redis.Redis, Sentinel's master_for, redis.cluster.RedisCluster) and asyncio
(redis.asyncio) objects with one API; the protocol's Lua scripts are shipped with the
package. See README.md.
"""

from ._core import HeartbeatLost
from .aio import AsyncConnectionServer, AsyncRouter
from .errors import Closed, Fenced, InvalidId, ProtocolError, RegistryJanitorError
from .ids import new_server_id
from .retry import RetryPolicy, is_transient
from .scripts import SOURCES as SCRIPTS
from .sync import ConnectionServer, Router

__all__ = [
    "SCRIPTS",
    "AsyncConnectionServer",
    "AsyncRouter",
    "Closed",
    "ConnectionServer",
    "Fenced",
    "HeartbeatLost",
    "InvalidId",
    "ProtocolError",
    "RegistryJanitorError",
    "RetryPolicy",
    "Router",
    "is_transient",
    "new_server_id",
]
__version__ = "0.1.0"
