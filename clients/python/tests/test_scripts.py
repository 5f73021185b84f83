"""The package's copy of the protocol scripts is the repository's protocol/, byte for byte."""

import hashlib
import unittest
from importlib.resources import files

import harness
from registry_janitor_client import scripts
from registry_janitor_client.scripts import NAMES, SHAS, SOURCES

PROTOCOL = harness.REPO / "protocol"


class PackageCopy(unittest.TestCase):
    def test_copy_is_protocol_dir(self):
        if not PROTOCOL.is_dir():
            self.skipTest(f"not run from the repository (no {PROTOCOL})")
        shipped = files("registry_janitor_client").joinpath("protocol")
        want = {p.name: p.read_bytes() for p in PROTOCOL.glob("*.lua")}
        have = {p.name: p.read_bytes() for p in shipped.iterdir() if p.name.endswith(".lua")}
        self.assertEqual(sorted(want), sorted(have), "run: python3 clients/python/sync_protocol.py")
        for name, text in want.items():
            self.assertEqual(text, have[name], f"{name} differs from protocol/: run python3 clients/python/sync_protocol.py")

    def test_every_script_is_known_by_name(self):
        self.assertEqual(sorted(f"{n}.lua" for n in NAMES), sorted(p.name for p in PROTOCOL.glob("*.lua")))
        self.assertEqual(set(SOURCES), set(NAMES))
        for name, text in SOURCES.items():
            self.assertEqual(SHAS[name], hashlib.sha1(text.encode()).hexdigest())
        self.assertEqual(scripts.READ_ONLY, {"route", "route_user"})
        for name in scripts.READ_ONLY:
            self.assertTrue(SOURCES[name].startswith("#!lua flags=no-writes,no-cluster"))

    def test_redis_agrees_on_the_shas(self):
        server = harness.RedisServer()
        try:
            client = server.admin()
            for name, text in SOURCES.items():
                self.assertEqual(client.script_load(text), SHAS[name])
        finally:
            server.stop()


if __name__ == "__main__":
    unittest.main()
