"""The protocol's Lua scripts, by name.

The package ships a copy of the repository's protocol/ directory (package data,
copied by clients/python/sync_protocol.py; a test fails when the two differ), so that an
installed package needs no repository. They run as EVALSHA with the SHA1 computed here,
loaded with SCRIPT LOAD on NOSCRIPT; never as EVAL.
"""

from __future__ import annotations

import hashlib
from importlib.resources import files
from types import MappingProxyType
from typing import Mapping

NAMES = (
    "heartbeat",
    "heartbeat_servers",
    "register",
    "unregister",
    "release",
    "route",
    "register_conn",
    "unregister_conn",
    "route_user",
)

#: Scripts that only read (`#!lua flags=no-writes,no-cluster`): sent as EVALSHA_RO.
READ_ONLY = frozenset({"route", "route_user"})

_DIR = files(__package__).joinpath("protocol")

#: The Lua source of each script, by name.
SOURCES: Mapping[str, str] = MappingProxyType(
    {name: _DIR.joinpath(f"{name}.lua").read_text(encoding="utf-8") for name in NAMES}
)

#: The SHA1 Redis knows each script by.
SHAS: Mapping[str, str] = MappingProxyType(
    {name: hashlib.sha1(text.encode("utf-8")).hexdigest() for name, text in SOURCES.items()}
)
