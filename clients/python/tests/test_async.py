"""One Redis node, the asyncio client (redis.asyncio): each layout, route's rules, close,
callbacks as coroutines; every test under RESP2 and RESP3."""

import asyncio
import time
import unittest

import harness
import redis
from registry_janitor_client import AsyncConnectionServer, AsyncRouter, Fenced, HeartbeatLost, new_server_id


def setUpModule():
    global SERVER
    SERVER = harness.RedisServer()


def tearDownModule():
    SERVER.stop()


class AsyncNodeTests:
    PROTOCOL = 2

    async def asyncSetUp(self):
        asyncio.get_running_loop().slow_callback_duration = 1.0  # debug mode on a busy machine
        SERVER.admin().flushall()
        self.admin = SERVER.admin()
        self.redis = SERVER.async_client(self.PROTOCOL)
        self.servers = []

    async def asyncTearDown(self):
        for server in self.servers:
            await server.close()
        await self.redis.aclose()

    async def server(self, layout, prefix="", **options):
        options.setdefault("ttl_ms", 60_000)
        server = AsyncConnectionServer(self.redis, new_server_id(f"agw-{len(self.servers)}"), layout=layout,
                                       key_prefix=prefix, **options)
        await server.start()
        self.servers.append(server)
        return server

    async def test_register_route_unregister(self):
        for layout in ("hash", "keys"):
            with self.subTest(layout=layout):
                s, t = await self.server(layout, "a:"), await self.server(layout, "a:")
                router = AsyncRouter(self.redis, layout=layout, key_prefix="a:")
                await s.register("alice")
                self.assertEqual(await router.route("alice"), s.server_id)
                await t.register("alice")
                self.assertFalse(await s.unregister("alice"))
                self.assertEqual(await router.route_many(["alice", "bob"]), [t.server_id, None])
                harness.fence(self.admin, t.server_id, "a:")
                self.assertIsNone(await router.route("alice"))

    async def test_conns_a_user_on_three_servers(self):
        a, b, c = [await self.server("conns") for _ in range(3)]
        router = AsyncRouter(self.redis, layout="conns")
        await a.register("alice", "phone")
        await a.register("alice", "tab-1")
        await b.register("alice", "tab-2")
        await c.register("alice", "laptop")
        self.assertEqual(await router.route_user("alice"), sorted([a.server_id, b.server_id, c.server_id]))
        harness.fence(self.admin, b.server_id)
        self.assertEqual(await router.route_users(["alice", "x"]), [sorted([a.server_id, c.server_id]), []])
        self.assertTrue(await c.unregister("alice", "laptop"))
        self.assertEqual(await router.route_user("alice"), [a.server_id])

    async def test_close_leaves_nothing_for_the_janitor(self):
        for layout, users in (("keys", 1001), ("conns", 20)):  # 1001: two batches of unregisters
            s = AsyncConnectionServer(self.redis, new_server_id("agw"), layout=layout, ttl_ms=60_000)
            async with s:
                for group in range(0, users, 50):  # concurrent registrations
                    await asyncio.gather(*(s.register(f"u{n}", "c" if layout == "conns" else None)
                                           for n in range(group, min(users, group + 50))))
            self.assertEqual(harness.snapshot(self.admin), {})

    async def test_fence_reaches_the_heartbeat_task_and_callbacks_may_be_coroutines(self):
        calls = []
        fenced = asyncio.Event()

        async def on_fenced(error):
            calls.append(error)
            await server.close()  # from inside the heartbeat task: must not wait on itself
            fenced.set()

        server = AsyncConnectionServer(self.redis, new_server_id("agw"), ttl_ms=600, heartbeat_interval_ms=200,
                                       on_fenced=on_fenced)
        await server.start()
        await server.register("alice")
        harness.fence(self.admin, server.server_id)
        await asyncio.wait_for(fenced.wait(), 10)
        self.assertEqual(len(calls), 1)
        self.assertIsInstance(calls[0], Fenced)
        self.assertTrue(server.fenced)
        with self.assertRaises(Fenced):
            await server.register("bob")
        self.assertEqual(self.admin.get("user:bob"), None)

    async def test_heartbeat_lost_and_restored(self):
        """The liveness key's writes refused (OOM) for longer than the TTL: lost once, then
        restored once they go through again."""
        lost, restored = [], []
        server = await self.server("keys", ttl_ms=600, heartbeat_interval_ms=200,
                                   on_heartbeat_lost=lost.append, on_heartbeat_restored=lambda: restored.append(1))
        self.admin.config_set("maxmemory", 1)
        try:
            start = time.time()
            await asyncio.sleep(2.0)
            self.assertEqual(len(lost), 1, lost)
            self.assertIsInstance(lost[0], HeartbeatLost)
            self.assertLessEqual(lost[0].since_ms, start * 1000 + 50)
            # The last failed heartbeat: refused (OOM), or, on a loaded machine, one that
            # got no reply within its interval while the writes were refused.
            self.assertIsInstance(lost[0].error, (redis.exceptions.OutOfMemoryError, redis.exceptions.TimeoutError))
        finally:
            self.admin.config_set("maxmemory", 0)
        await asyncio.sleep(1.0)
        self.assertEqual(restored, [1])
        self.assertEqual(len(lost), 1)
        self.assertFalse(server.fenced)
        self.assertEqual(self.admin.exists(f"server:{{{server.server_id}}}:alive"), 1)


class AsyncNodeResp2(AsyncNodeTests, unittest.IsolatedAsyncioTestCase):
    PROTOCOL = 2


class AsyncNodeResp3(AsyncNodeTests, unittest.IsolatedAsyncioTestCase):
    PROTOCOL = 3


if __name__ == "__main__":
    unittest.main()
