"""The identifier rules of the specification, checked before anything is written."""

from __future__ import annotations

import re
import threading
import time

from .errors import InvalidId

SERVER_ID_RULE = (
    "server id must be 1 to 200 bytes of printable ASCII without whitespace, '{' or '}'"
)
CONNECTION_ID_RULE = (
    "connection id must be 1 to 200 bytes of printable ASCII without whitespace, '{' or '}'"
)
USER_ID_RULE = "user id must be 1 to 512 bytes (a str is taken as UTF-8)"

# 0x21..0x7e without '{' (0x7b) and '}' (0x7d): the character class route.lua checks too.
_ID = re.compile(r"[!-z|~]{1,200}")

UserId = str | bytes | bytearray | memoryview


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(value)} long)"  # type: ignore[arg-type]


def _ascii_id(value: object, kind: str, rule: str) -> str:
    text = value
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("ascii")
        except UnicodeDecodeError:
            raise InvalidId(kind, rule, value, _shown(value)) from None
    if not isinstance(text, str) or not _ID.fullmatch(text):
        raise InvalidId(kind, rule, value, _shown(value))
    return text


def server_id(value: object) -> str:
    """A valid server id as str, or InvalidId (kind "server id")."""
    return _ascii_id(value, "server id", SERVER_ID_RULE)


def connection_id(value: object) -> str:
    """A valid connection id as str, or InvalidId (kind "connection id")."""
    return _ascii_id(value, "connection id", CONNECTION_ID_RULE)


def user_id(value: object) -> bytes:
    """A valid user id as bytes (str is encoded as UTF-8), or InvalidId (kind "user id").

    Any bytes are allowed, spaces included, in every layout: in layout conns the reverse-set
    member is `<connection id> <user id>` and splits at its first space, and a connection
    id has none (docs/connections.md).
    """
    if isinstance(value, str):
        try:
            raw = value.encode("utf-8")
        except UnicodeEncodeError as error:
            # A lone surrogate ('\ud800', e.g. from os.fsdecode or surrogateescape): no UTF-8.
            shown = f"{_shown(value)}, which has no UTF-8 encoding ({error.reason} at {error.start})"
            raise InvalidId("user id", USER_ID_RULE, value, shown) from None
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
    else:
        raise TypeError(f"user id must be str or bytes, not {type(value).__name__}")
    if not 1 <= len(raw) <= 512:
        raise InvalidId("user id", USER_ID_RULE, value, _shown(value))
    return raw


def is_server_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None


_last_ms = 0
_last_lock = threading.Lock()


def new_server_id(base: str) -> str:
    """`gw-7` -> `gw-7#<unix ms>`: a new incarnation's id (checked against the rule). An
    id given as the base keeps its name only (`gw-7#1732181000123` -> `gw-7#<now>`, as the
    Node.js client), so that restarting from the last id does not grow it. Two calls in one
    process never get the same number (the second takes the next ms)."""
    global _last_ms
    name = base.partition("#")[0] if isinstance(base, str) else base
    with _last_lock:
        _last_ms = max(_last_ms + 1, time.time_ns() // 1_000_000)
        stamp = _last_ms
    return server_id(f"{name}#{stamp}")
