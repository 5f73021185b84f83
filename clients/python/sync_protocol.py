#!/usr/bin/env python3
"""Copies the protocol's Lua scripts from the repository's protocol/ into the package.

The scripts in <repo>/protocol/ are the one source of truth; the package ships a copy
(package data), so that an installed wheel works without the repository. Run this after
any change to protocol/:

    python3 clients/python/sync_protocol.py          # copy
    python3 clients/python/sync_protocol.py --check  # exit 1 if the copy differs

tests/test_scripts.py fails while the copy differs.
"""

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent.parent / "protocol"
TARGET = HERE / "src" / "registry_janitor_client" / "protocol"


def differences() -> list[str]:
    """Names of the scripts whose copy is missing, different or left over."""
    want = {p.name: p.read_bytes() for p in SOURCE.glob("*.lua")}
    have = {p.name: p.read_bytes() for p in TARGET.glob("*.lua")}
    return sorted(n for n in want.keys() | have.keys() if want.get(n) != have.get(n))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = parser.parse_args()
    if not SOURCE.is_dir():
        print(f"no protocol/ directory at {SOURCE}", file=sys.stderr)
        return 2
    changed = differences()
    if args.check:
        for name in changed:
            print(f"differs from protocol/: {name}", file=sys.stderr)
        return 1 if changed else 0
    TARGET.mkdir(parents=True, exist_ok=True)
    for name in changed:
        source = SOURCE / name
        if source.exists():
            (TARGET / name).write_bytes(source.read_bytes())
            print(f"copied {name}")
        else:
            (TARGET / name).unlink()
            print(f"removed {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
