"""The fence, with the real janitor worker: `registry-janitor emit server-dead <S>`, the
worker fences and cleans S, and the client learns it."""

import asyncio
import random
import sys
import threading
import time
import unittest

import harness
import redis
from registry_janitor_client import AsyncConnectionServer, AsyncRouter, ConnectionServer, Fenced, Router, new_server_id


def setUpModule():
    harness.janitor_bin()  # fails with how to build it
    global SERVER
    SERVER = harness.RedisServer()


def tearDownModule():
    SERVER.stop()


def figure(text):
    print(f"\n  [figure] {text}", file=sys.stderr, end="")


class CountingRedis(redis.Redis):
    sent = 0

    def execute_command(self, *args, **options):
        self.sent += 1
        return super().execute_command(*args, **options)

    def pipeline(self, *args, **options):
        self.sent += 1
        return super().pipeline(*args, **options)


def fenced_at_ms(admin, server_id, prefix):
    value = admin.hget(f"{prefix}server:{{{server_id}}}:fenced", "fenced_at_ms")
    return int(value) if value else None


def clean(admin, server_id, prefix):
    keys = [f"{prefix}server:{{{server_id}}}:{k}" for k in ("users", "walking", "cleanup")]
    return admin.exists(*keys) == 0


class Fence(unittest.TestCase):
    INTERVAL_MS = 500

    def setUp(self):
        self.admin = SERVER.admin()
        self.workers = []

    def tearDown(self):
        for worker in self.workers:
            worker.stop()

    def worker(self, layout, prefix, chunk_size=1000):
        worker = harness.Worker(SERVER.url, layout, prefix, chunk_size)
        self.workers.append(worker)
        return worker

    def test_fence_reaches_a_heartbeating_server_within_an_interval(self):
        prefix = "fence1:"
        worker = self.worker("keys", prefix)
        calls, done = [], threading.Event()

        def on_fenced(error):
            calls.append((time.time(), error))
            done.set()

        server = ConnectionServer(SERVER.client(), new_server_id("gw"), key_prefix=prefix, ttl_ms=3 * self.INTERVAL_MS,
                                  heartbeat_interval_ms=self.INTERVAL_MS, on_fenced=on_fenced)
        server.start()
        for n in range(100):
            server.register(f"u{n}")
        router = Router(SERVER.client(), key_prefix=prefix)
        self.assertEqual(router.route("u1"), server.server_id)
        emitted = time.time()
        worker.emit_dead(server.server_id)
        self.assertTrue(done.wait(30), "on_fenced was not called within 30 s")
        learned, error = calls[0]
        fence_ms = fenced_at_ms(self.admin, server.server_id, prefix)
        emit_to_fenced = learned - emitted
        fence_to_fenced = learned - fence_ms / 1000
        figure(f"interval {self.INTERVAL_MS} ms: emit -> on_fenced {emit_to_fenced * 1000:.0f} ms, "
               f"fence written -> on_fenced {fence_to_fenced * 1000:.0f} ms")
        # About one interval; the slack is for a busy machine (worker pickup, scheduling).
        self.assertLess(fence_to_fenced, self.INTERVAL_MS / 1000 + 2.0)
        self.assertLess(emit_to_fenced, self.INTERVAL_MS / 1000 + 5.0)
        self.assertIsInstance(error, Fenced)
        self.assertTrue(server.fenced)
        self.assertIsNone(router.route("u1"))
        harness.wait_for(lambda: clean(self.admin, server.server_id, prefix), 30, "the cleanup")
        self.assertEqual(router.route_many([f"u{n}" for n in range(100)]), [None] * 100)
        self.assertEqual(self.admin.mget([f"{prefix}user:u{n}" for n in range(100)]), [None] * 100)
        time.sleep(2 * self.INTERVAL_MS / 1000)
        self.assertEqual(len(calls), 1)
        self.assertEqual(self.admin.hget(f"{prefix}server:{{{server.server_id}}}:refused", "heartbeat"), b"1")
        server.close()

    def test_a_zombies_registrations_are_refused(self):
        prefix = "zombie:"
        worker = self.worker("hash", prefix)
        calls = []
        client = CountingRedis(port=SERVER.port, socket_timeout=5)
        # A zombie: it heartbeats too rarely to learn of the verdict before it writes.
        server = ConnectionServer(client, new_server_id("zombie"), layout="hash", key_prefix=prefix, ttl_ms=180_000,
                                  heartbeat_interval_ms=60_000, on_fenced=calls.append)
        server.start()
        server.register("alice")
        worker.emit_dead(server.server_id)
        harness.wait_for(lambda: fenced_at_ms(self.admin, server.server_id, prefix), 30, "the fence")
        harness.wait_for(lambda: clean(self.admin, server.server_id, prefix), 30, "the cleanup")
        self.assertIsNone(self.admin.hget(f"{prefix}registry", "alice"))
        before = harness.snapshot(self.admin)
        with self.assertRaises(Fenced) as caught:
            server.register("bob")
        self.assertEqual(caught.exception.server_id, server.server_id)
        self.assertEqual(len(calls), 1)
        self.assertTrue(server.fenced)
        self.assertIsNone(self.admin.hget(f"{prefix}registry", "bob"))
        self.assertEqual(self.admin.exists(f"{prefix}server:{{{server.server_id}}}:users"), 0)
        self.assertEqual(self.admin.hget(f"{prefix}server:{{{server.server_id}}}:refused", "register"), b"1")
        after = harness.snapshot(self.admin)
        refused = f"{prefix}server:{{{server.server_id}}}:refused".encode()
        self.assertEqual({k: v for k, v in after.items() if k != refused},
                         {k: v for k, v in before.items() if k != refused}, "a refused registration wrote")
        sent = client.sent
        with self.assertRaises(Fenced):
            server.register("carol")
        with self.assertRaises(Fenced):
            server.unregister("alice")
        server.close()
        self.assertEqual(client.sent, sent, "the fenced server went on writing")
        self.assertEqual(len(calls), 1)

    def test_route_never_returns_a_fenced_owner_during_a_long_cleanup(self):
        prefix, users = "long:", 50_000
        worker = self.worker("keys", prefix, chunk_size=20)
        fenced = threading.Event()
        server = ConnectionServer(SERVER.client(), new_server_id("big"), key_prefix=prefix, ttl_ms=3000,
                                  on_fenced=lambda e: fenced.set())
        live = ConnectionServer(SERVER.client(), new_server_id("live"), key_prefix=prefix, ttl_ms=60_000)
        server.start()
        live.start()
        names = [f"user-{n}" for n in range(users)]
        # Bulk load as a connection server would have registered them over time.
        pipe = self.admin.pipeline(transaction=False)
        for n, name in enumerate(names):
            pipe.set(f"{prefix}user:{name}", server.server_id)
            if n % 5000 == 4999:
                pipe.sadd(f"{prefix}server:{{{server.server_id}}}:users", *names[n - 4999 : n + 1])
                pipe.execute()
        for n in range(200):
            server.register(f"reg-{n}")
            live.register(f"live-{n}")
        router = Router(SERVER.client(), key_prefix=prefix)
        self.assertEqual(router.route(names[0]), server.server_id)

        worker.emit_dead(server.server_id)
        harness.wait_for(lambda: fenced_at_ms(self.admin, server.server_id, prefix), 30, "the fence", every=0.005)
        started = time.monotonic()
        lookups = returned_s = shielded = 0
        others = []
        reader = SERVER.client()
        while True:
            done = clean(self.admin, server.server_id, prefix)
            sample = random.sample(names, 200)
            owners = router.route_many(sample)
            plain = reader.mget([f"{prefix}user:{u}" for u in sample])
            lookups += len(sample) + 1
            returned_s += sum(o == server.server_id for o in owners)
            shielded += sum(p == server.server_id.encode() for p in plain)  # a plain read still saw S
            others.append(router.route(f"live-{random.randrange(200)}"))
            if done or time.monotonic() - started > 120:
                break
        elapsed = time.monotonic() - started
        figure(f"cleanup of {users} entries (chunk 20) ran {elapsed:.1f} s; {lookups} routes during it, "
               f"{shielded} of them on entries a plain read still showed naming the fenced server; route returned it 0 times")
        self.assertTrue(done, "the cleanup did not finish within 120 s")
        self.assertEqual(returned_s, 0, "route returned a fenced owner")
        self.assertGreater(shielded, 0, "the cleanup ended before any lookup ran during it")
        self.assertEqual(set(others), {live.server_id})
        self.assertTrue(fenced.wait(10))
        self.assertEqual(router.route_many([f"reg-{n}" for n in range(200)]), [None] * 200)
        live.close()
        server.close()

    def test_async_fence_reaches_the_heartbeat_task(self):
        prefix = "afence:"
        worker = self.worker("conns", prefix)

        async def scenario():
            client = SERVER.async_client(protocol=3)
            learned = asyncio.get_running_loop().create_future()

            async def on_fenced(error):
                learned.set_result(time.time())

            server = AsyncConnectionServer(client, new_server_id("agw"), layout="conns", key_prefix=prefix,
                                           ttl_ms=3 * self.INTERVAL_MS, heartbeat_interval_ms=self.INTERVAL_MS,
                                           on_fenced=on_fenced)
            other = AsyncConnectionServer(client, new_server_id("agw-other"), layout="conns", key_prefix=prefix)
            await server.start()
            await other.start()
            await server.register("alice", "phone")
            await other.register("alice", "laptop")
            router = AsyncRouter(client, layout="conns", key_prefix=prefix)
            self.assertEqual(await router.route_user("alice"), sorted([server.server_id, other.server_id]))
            emitted = time.time()
            await asyncio.to_thread(worker.emit_dead, server.server_id)
            at = await asyncio.wait_for(learned, 30)
            fence_ms = fenced_at_ms(self.admin, server.server_id, prefix)
            figure(f"asyncio, interval {self.INTERVAL_MS} ms: emit -> on_fenced {(at - emitted) * 1000:.0f} ms, "
                   f"fence written -> on_fenced {(at - fence_ms / 1000) * 1000:.0f} ms")
            self.assertLess(at - fence_ms / 1000, self.INTERVAL_MS / 1000 + 2.0)
            self.assertEqual(await router.route_user("alice"), [other.server_id])
            with self.assertRaises(Fenced):
                await server.register("bob", "phone")
            await server.close()
            await other.close()
            await client.aclose()

        asyncio.run(scenario())


if __name__ == "__main__":
    unittest.main()
