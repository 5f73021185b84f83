"""The errors of the client."""

from __future__ import annotations


class RegistryJanitorError(Exception):
    """Base class of this package's errors (Redis' own errors pass through as they are)."""


class InvalidId(RegistryJanitorError, ValueError):
    """An identifier breaks its rule; raised before anything is sent to Redis.

    `kind` is ``"server id"``, ``"user id"`` or ``"connection id"``; `rule` is the rule as
    a sentence (the message is the rule and the value refused); `value` is that value.
    """

    def __init__(self, kind: str, rule: str, value: object, shown: str):
        super().__init__(f"{rule}: got {shown}")
        self.kind = kind
        self.rule = rule
        self.value = value


class Fenced(RegistryJanitorError):
    """This server id was declared dead (the protocol's error ``FENCED``).

    Close the server's sockets (its clients reconnect) and start again under a new
    server id; never retry the write. Every later register/unregister of the same
    ConnectionServer raises it at once, without touching Redis.
    """

    code = "FENCED"

    def __init__(self, server_id: str | None, message: str):
        super().__init__(message)
        self.server_id = server_id


class Closed(RegistryJanitorError, RuntimeError):
    """register() on a ConnectionServer after close()."""


class ProtocolError(RegistryJanitorError):
    """Redis refused a protocol call for a reason no retry fixes (e.g. route.lua sent to a
    Redis Cluster through a plain, non-cluster client)."""
