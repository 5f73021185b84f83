"""One Redis node, the sync client: each layout, route's rules, close, the script
fallbacks; every test under RESP2 and RESP3."""

import threading
import time
import unittest

import harness
import redis
from registry_janitor_client import Closed, ConnectionServer, Fenced, Router, new_server_id


def setUpModule():
    global SERVER
    SERVER = harness.RedisServer()


def tearDownModule():
    SERVER.stop()


class CountingRedis(redis.Redis):
    sent = 0

    def execute_command(self, *args, **options):
        self.sent += 1
        return super().execute_command(*args, **options)

    def pipeline(self, *args, **options):
        self.sent += 1
        return super().pipeline(*args, **options)


class NodeTests:
    PROTOCOL = 2

    def setUp(self):
        SERVER.admin().flushall()
        self.redis = SERVER.client(self.PROTOCOL)
        self.admin = SERVER.admin()
        self.servers = []

    def tearDown(self):
        for server in self.servers:
            server.close()
        self.redis.close()

    def server(self, layout, prefix="", **options):
        options.setdefault("ttl_ms", 60_000)
        server = ConnectionServer(self.redis, new_server_id(f"gw-{len(self.servers)}"), layout=layout,
                                  key_prefix=prefix, **options)
        server.start()
        self.servers.append(server)
        return server

    def test_register_route_unregister(self):
        for layout, prefix in (("hash", ""), ("keys", ""), ("hash", "app1:"), ("keys", "app1:")):
            with self.subTest(layout=layout, prefix=prefix):
                s, t = self.server(layout, prefix), self.server(layout, prefix)
                router = Router(self.redis, layout=layout, key_prefix=prefix)
                forward = (lambda: self.admin.hget(f"{prefix}registry", "alice")) if layout == "hash" \
                    else (lambda: self.admin.get(f"{prefix}user:alice"))
                self.assertIsNone(router.route("alice"))
                s.register("alice")
                self.assertEqual(router.route("alice"), s.server_id)
                self.assertEqual(forward(), s.server_id.encode())
                self.assertTrue(self.admin.sismember(f"{prefix}server:{{{s.server_id}}}:users", "alice"))
                alive_ms = self.admin.pttl(f"{prefix}server:{{{s.server_id}}}:alive")
                self.assertTrue(0 < alive_ms <= 60_000, alive_ms)
                self.assertIsNotNone(self.admin.zscore(f"{prefix}servers", s.server_id))
                t.register(b"alice")  # the user moves to t
                self.assertEqual(router.route("alice"), t.server_id)
                self.assertFalse(s.unregister("alice"))  # the entry names t: kept
                self.assertFalse(self.admin.sismember(f"{prefix}server:{{{s.server_id}}}:users", "alice"))
                self.assertEqual(router.route("alice"), t.server_id)
                self.assertTrue(t.unregister("alice"))
                self.assertIsNone(router.route("alice"))
                self.assertIsNone(forward())

    def test_conns_a_user_on_three_servers(self):
        a, b, c = (self.server("conns", "c:") for _ in range(3))
        router = Router(self.redis, layout="conns", key_prefix="c:")
        a.register("alice", "phone")
        a.register("alice", "tab-1")
        b.register("alice", "tab-2")
        c.register("alice", "laptop")
        b.register("bob", "phone")
        self.assertEqual(router.route_user("alice"), sorted([a.server_id, b.server_id, c.server_id]))
        self.assertEqual(self.admin.hgetall("c:user:{alice}:conns"), {
            b"phone": a.server_id.encode(), b"tab-1": a.server_id.encode(),
            b"tab-2": b.server_id.encode(), b"laptop": c.server_id.encode()})
        self.assertEqual(self.admin.smembers(f"c:server:{{{a.server_id}}}:users"), {b"phone alice", b"tab-1 alice"})
        harness.fence(self.admin, c.server_id, "c:")
        self.assertEqual(router.route_user("alice"), sorted([a.server_id, b.server_id]))
        self.admin.delete(f"c:server:{{{b.server_id}}}:alive")  # b missed its liveness
        self.assertEqual(router.route_user("alice"), [a.server_id])
        self.assertEqual(router.route_users(["alice", "bob", "nobody"]), [[a.server_id], [], []])
        self.assertTrue(a.unregister("alice", "phone"))
        self.assertFalse(a.unregister("alice", "phone"))
        self.assertEqual(router.route_user("alice"), [a.server_id])
        self.assertTrue(a.unregister("alice", "tab-1"))
        self.assertEqual(router.route_user("alice"), [])

    def test_route_never_returns_a_fenced_or_expired_owner(self):
        s, t = self.server("keys"), self.server("keys")
        router = Router(self.redis, layout="keys")
        s.register("u1")
        t.register("u2")
        harness.fence(self.admin, s.server_id)
        self.assertIsNone(router.route("u1"))
        self.assertEqual(self.admin.get("user:u1"), s.server_id.encode())  # a plain read still names it
        self.admin.delete(f"server:{{{t.server_id}}}:alive")
        self.assertIsNone(router.route("u2"))
        self.admin.set("user:u3", "not a server id")
        self.assertIsNone(router.route("u3"))

    def test_route_many_in_order(self):
        s, t = self.server("hash"), self.server("hash")
        users = [f"user-{n}" for n in range(2500)]
        for n, user in enumerate(users[:2000]):
            (s if n % 2 else t).register(user)
        harness.fence(self.admin, t.server_id)
        got = Router(self.redis, layout="hash").route_many(users + [b"nobody"])
        want = [s.server_id if n < 2000 and n % 2 else None for n in range(2500)] + [None]
        self.assertEqual(got, want)
        self.assertEqual(Router(self.redis, layout="hash").route_many([]), [])

    def test_close_leaves_nothing_for_the_janitor(self):
        for layout in ("keys", "hash", "conns"):
            with self.subTest(layout=layout):
                SERVER.admin().flushall()
                s = ConnectionServer(self.redis, new_server_id("gw-close"), layout=layout, ttl_ms=60_000)
                s.start()
                connection = "c1" if layout == "conns" else None
                for n in range(1500):
                    s.register(f"u{n}", connection)
                for n in range(10):
                    s.unregister(f"u{n}", connection)
                s.close()
                s.close()  # a second close does nothing
                self.assertEqual(harness.snapshot(self.admin), {})
                with self.assertRaises(Closed):
                    s.register("late", connection)
                self.assertFalse(s.unregister("u20", connection))  # a socket closed during the shutdown
                self.assertEqual(harness.snapshot(self.admin), {})

    def test_close_keeps_users_that_moved(self):
        s, t = self.server("keys"), self.server("keys")
        s.register("alice")
        t.register("alice")
        s.close()
        self.assertEqual(Router(self.redis).route("alice"), t.server_id)
        self.assertEqual(self.admin.exists(f"server:{{{s.server_id}}}:users", f"server:{{{s.server_id}}}:alive"), 0)

    def test_start_first(self):
        s = ConnectionServer(self.redis, new_server_id("gw"))
        with self.assertRaises(RuntimeError):
            s.register("alice")
        s.start()
        with self.assertRaises(RuntimeError):
            s.start()
        s.close()

    def test_decode_responses_client(self):
        client = SERVER.client(self.PROTOCOL, decode_responses=True)
        s = ConnectionServer(client, new_server_id("gw"), layout="conns", ttl_ms=60_000)
        s.start()
        s.register("alice", "phone")
        self.assertEqual(Router(client, layout="conns").route_user("alice"), [s.server_id])
        self.assertTrue(s.unregister("alice", "phone"))
        s.close()
        k = ConnectionServer(client, new_server_id("gw"), layout="keys", ttl_ms=60_000)
        with k:
            k.register("bob")
            self.assertEqual(Router(client).route("bob"), k.server_id)
        self.assertEqual(harness.snapshot(self.admin), {})

    def test_noscript_falls_back_to_script_load(self):
        s = self.server("keys")
        router = Router(self.redis)
        s.register("alice")
        self.admin.script_flush()
        s.register("bob")
        self.admin.script_flush()
        self.assertEqual(router.route("alice"), s.server_id)
        self.admin.script_flush()
        self.assertEqual(router.route_many(["alice", "bob"]), [s.server_id] * 2)
        self.admin.script_flush()
        self.assertTrue(s.unregister("alice"))
        stats = self.admin.info("commandstats")
        self.assertNotIn("cmdstat_eval", stats)  # never EVAL, only EVALSHA(_RO) and SCRIPT LOAD
        self.assertIn("cmdstat_evalsha_ro", stats)

    def test_evalsha_ro_refused_falls_back_to_evalsha(self):
        s = self.server("keys")
        s.register("alice")
        self.admin.acl_setuser("no-ro", enabled=True, passwords=["+pw"], keys=["*"],
                               commands=["+@all", "-evalsha_ro", "-eval_ro"])
        client = SERVER.client(self.PROTOCOL, username="no-ro", password="pw")
        router = Router(client)
        self.assertEqual(router.route("alice"), s.server_id)
        self.assertEqual(router.route_many(["alice", "bob"]), [s.server_id, None])
        self.assertFalse(router._executor.read_only)
        conns = self.server("conns")
        conns.register("alice", "phone")
        self.assertEqual(Router(client, layout="conns").route_user("alice"), [conns.server_id])
        full = Router(self.redis)
        self.assertEqual(full.route("alice"), s.server_id)
        self.assertTrue(full._executor.read_only)
        client.close()

    def test_heartbeats_keep_the_liveness_key(self):
        s = self.server("keys", ttl_ms=900, heartbeat_interval_ms=300)
        first = self.admin.zscore("servers", s.server_id)
        time.sleep(2.0)  # more than two TTLs
        self.assertEqual(self.admin.exists(f"server:{{{s.server_id}}}:alive"), 1)
        self.assertGreater(self.admin.zscore("servers", s.server_id), first)

    def test_fence_reaches_the_heartbeat_thread(self):
        """The fence as a worker writes it (the worker itself: test_fence.py)."""
        client = CountingRedis(port=SERVER.port, protocol=self.PROTOCOL, socket_timeout=5)
        calls, done = [], threading.Event()

        def on_fenced(error):
            calls.append(error)
            done.set()

        s = ConnectionServer(client, new_server_id("gw"), ttl_ms=600, heartbeat_interval_ms=200, on_fenced=on_fenced)
        s.start()
        s.register("alice")
        harness.fence(self.admin, s.server_id)
        self.assertTrue(done.wait(10), "on_fenced was not called")
        self.assertTrue(s.fenced)
        self.assertIsInstance(calls[0], Fenced)
        self.assertEqual(calls[0].server_id, s.server_id)
        self.assertEqual(calls[0].code, "FENCED")
        self.assertEqual(self.admin.hget(f"server:{{{s.server_id}}}:refused", "heartbeat"), b"1")
        sent = client.sent
        with self.assertRaises(Fenced):
            s.register("bob")
        with self.assertRaises(Fenced):
            s.unregister("alice")
        s.close()
        self.assertEqual(client.sent, sent, "a fenced server sent something")
        self.assertEqual(len(calls), 1)
        time.sleep(0.5)
        self.assertEqual(self.admin.hget(f"server:{{{s.server_id}}}:refused", "heartbeat"), b"1")  # stopped


class NodeResp2(NodeTests, unittest.TestCase):
    PROTOCOL = 2


class NodeResp3(NodeTests, unittest.TestCase):
    PROTOCOL = 3


if __name__ == "__main__":
    unittest.main()
