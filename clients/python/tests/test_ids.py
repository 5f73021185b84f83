"""Identifiers are refused before anything is sent to Redis, with an error naming the rule."""

import re
import unittest

import harness
import redis
from registry_janitor_client import ConnectionServer, InvalidId, Router, new_server_id


class CountingRedis(redis.Redis):
    """A real client that counts the commands it sends."""

    sent = 0

    def execute_command(self, *args, **options):
        self.sent += 1
        return super().execute_command(*args, **options)

    def pipeline(self, *args, **options):
        self.sent += 1
        return super().pipeline(*args, **options)


BAD_SERVER_IDS = ["", "gw 7", "gw\t7", "gw{7}", "gw}", "x" * 201, "gw-é", "gw\x7f", b"gw\xff"]
BAD_CONNECTION_IDS = ["", "ph one", "tab{1}", "c" * 201, "ç", None, "a\nb"]
BAD_USER_IDS = ["", b"", "u" * 513, b"\x00" * 513, "é" * 257, "\ud800", "alice\udcff"]  # lone surrogates: no UTF-8


def setUpModule():
    global SERVER
    SERVER = harness.RedisServer()


def tearDownModule():
    SERVER.stop()


class ServerIds(unittest.TestCase):
    def test_refused_by_the_constructor(self):
        client = CountingRedis(port=SERVER.port)
        for bad in BAD_SERVER_IDS:
            with self.subTest(server_id=bad):
                with self.assertRaises(InvalidId) as caught:
                    ConnectionServer(client, bad)
                self.assertEqual(caught.exception.kind, "server id")
                self.assertIn("server id must be 1 to 200 bytes of printable ASCII without whitespace, '{' or '}'", str(caught.exception))
                self.assertEqual(caught.exception.rule, "server id must be 1 to 200 bytes of printable ASCII without whitespace, '{' or '}'")
                self.assertEqual(caught.exception.value, bad)
                self.assertIn("got", str(caught.exception))
        self.assertEqual(client.sent, 0)

    def test_accepted(self):
        client = CountingRedis(port=SERVER.port)
        for good in ["gw-7#1732181000123", "x" * 200, "!~|", "a"]:
            self.assertEqual(ConnectionServer(client, good).server_id, good)
        self.assertEqual(client.sent, 0)

    def test_new_server_id(self):
        sid = new_server_id("gw-7")
        self.assertRegex(sid, r"^gw-7#\d{13}$")
        self.assertEqual(ConnectionServer.new_server_id("gw-7").split("#")[0], "gw-7")
        with self.assertRaises(InvalidId):
            new_server_id("gw 7")

    def test_new_server_id_of_an_id_replaces_its_suffix(self):
        """Restarting from the last id: 'gw-7#1732181000123' -> 'gw-7#<now>', never longer."""
        sid = "gw-7#1732181000123"
        for _ in range(3):
            sid = new_server_id(sid)
            self.assertRegex(sid, r"^gw-7#\d{13}$")
        self.assertRegex(ConnectionServer.new_server_id("x" * 185 + "#1732181000123"), r"^x{185}#\d{13}$")


class UserAndConnectionIds(unittest.TestCase):
    def servers(self, client):
        made = {}
        for layout in ("hash", "keys", "conns"):
            server = ConnectionServer(client, f"ids-{layout}#1", layout=layout, key_prefix="ids:",
                                      ttl_ms=600_000, heartbeat_interval_ms=300_000)
            server.start()
            made[layout] = server
        return made

    def test_refused_before_any_write(self):
        client = CountingRedis(port=SERVER.port)
        servers = self.servers(client)
        try:
            before, sent = harness.snapshot(SERVER.admin()), client.sent
            for layout, server in servers.items():
                connection = "phone" if layout == "conns" else None
                for bad in BAD_USER_IDS:
                    for call in (server.register, server.unregister):
                        with self.subTest(layout=layout, user=bad[:8], call=call.__name__):
                            with self.assertRaises(InvalidId) as caught:
                                call(bad, connection)
                            self.assertEqual(caught.exception.kind, "user id")
                            self.assertIn("user id must be 1 to 512 bytes", str(caught.exception))
            for bad in BAD_CONNECTION_IDS:
                for call in (servers["conns"].register, servers["conns"].unregister):
                    with self.subTest(connection=bad, call=call.__name__):
                        with self.assertRaises(InvalidId) as caught:
                            call("alice", bad)
                        self.assertEqual(caught.exception.kind, "connection id")
                        self.assertTrue(re.search(r"connection id must be 1 to 200 bytes of printable ASCII", str(caught.exception)))
            router = Router(client, layout="keys", key_prefix="ids:")
            for bad in BAD_USER_IDS:
                with self.assertRaises(InvalidId):
                    router.route(bad)
            self.assertEqual(client.sent, sent, "a refused id sent something to Redis")
            self.assertEqual(harness.snapshot(SERVER.admin()), before)
        finally:
            for server in servers.values():
                server.close()

    def test_a_str_without_utf8_is_refused_with_the_rule(self):
        from registry_janitor_client import ids

        with self.assertRaises(InvalidId) as caught:
            ids.user_id("alice\ud800")
        self.assertEqual(caught.exception.kind, "user id")
        self.assertEqual(caught.exception.rule, ids.USER_ID_RULE)
        self.assertEqual(caught.exception.value, "alice\ud800")
        self.assertIn("no UTF-8 encoding", str(caught.exception))

    def test_limits_are_inclusive_and_any_bytes_go(self):
        client = redis.Redis(port=SERVER.port)
        servers = self.servers(client)
        try:
            users = ["u" * 512, b"\x00\xff x y", "é" * 256, "with space", "{braces}"]
            for layout, server in servers.items():
                connection = "c" * 200 if layout == "conns" else None
                router = Router(client, layout=layout, key_prefix="ids:")
                for user in users:
                    server.register(user, connection)
                    if layout == "conns":
                        self.assertEqual(router.route_user(user), [server.server_id])
                    else:
                        self.assertEqual(router.route(user), server.server_id)
                    self.assertTrue(server.unregister(user, connection))
        finally:
            for server in servers.values():
                server.close()

    def test_connection_argument_follows_the_layout(self):
        client = CountingRedis(port=SERVER.port)
        servers = self.servers(client)
        try:
            sent = client.sent
            with self.assertRaises(InvalidId):
                servers["conns"].register("alice")  # layout conns: a connection id is required
            for layout in ("hash", "keys"):
                with self.assertRaises(ValueError):
                    servers[layout].register("alice", "phone")
            with self.assertRaises(ValueError):
                Router(client, layout="conns").route("alice")
            with self.assertRaises(ValueError):
                Router(client, layout="keys").route_user("alice")
            with self.assertRaises(ValueError):
                ConnectionServer(client, "gw#1", layout="list")
            self.assertEqual(client.sent, sent)
        finally:
            for server in servers.values():
                server.close()


if __name__ == "__main__":
    unittest.main()
