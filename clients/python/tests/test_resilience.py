"""States that pass: Redis restarted, a slow script (BUSY), the retry budget; the heartbeat
reports a lost stretch and its end, and never stops on them."""

import asyncio
import threading
import time
import unittest

import harness
import redis
from registry_janitor_client import (
    AsyncConnectionServer,
    ConnectionServer,
    HeartbeatLost,
    RetryPolicy,
    Router,
    new_server_id,
)


def setUpModule():
    global SERVER
    SERVER = harness.RedisServer("--busy-reply-threshold", "100")


def tearDownModule():
    SERVER.stop()


class Resilience(unittest.TestCase):
    def setUp(self):
        SERVER.admin().flushall()

    def test_redis_restart_while_registering(self):
        lost, restored = [], threading.Event()
        server = ConnectionServer(SERVER.client(socket_timeout=1), new_server_id("gw"), ttl_ms=600,
                                  heartbeat_interval_ms=200, on_heartbeat_lost=lost.append,
                                  on_heartbeat_restored=restored.set)
        impatient = ConnectionServer(SERVER.client(socket_timeout=1), new_server_id("gw"), ttl_ms=60_000,
                                     retry=RetryPolicy(attempts=3, max_delay_ms=100))
        server.start()
        impatient.start()
        server.register("before")
        killed_ms = time.time() * 1000
        SERVER.kill()
        outcome = {}

        def register_during_outage():
            started = time.monotonic()
            try:
                server.register("during")
                outcome["ok"] = time.monotonic() - started
            except Exception as error:
                outcome["error"] = error

        thread = threading.Thread(target=register_during_outage)
        thread.start()
        started = time.monotonic()
        with self.assertRaises(redis.exceptions.ConnectionError):
            impatient.register("gives-up")
        self.assertLess(time.monotonic() - started, 10)
        time.sleep(1.5)  # longer than the TTL
        SERVER.restart()  # empty: no persistence
        thread.join(30)
        self.assertIn("ok", outcome, outcome)
        self.assertTrue(restored.wait(10), "on_heartbeat_restored was not called")
        self.assertEqual(len(lost), 1, lost)
        self.assertIsInstance(lost[0], HeartbeatLost)
        self.assertLessEqual(lost[0].since_ms, killed_ms)
        self.assertGreater(lost[0].for_ms, 600)
        self.assertIsInstance(lost[0].error, redis.exceptions.ConnectionError)
        self.assertFalse(server.fenced)
        admin = SERVER.admin()
        harness.wait_for(lambda: admin.exists(f"server:{{{server.server_id}}}:alive"), 5, "a heartbeat after the restart")
        self.assertEqual(Router(SERVER.client()).route("during"), server.server_id)
        server.register("after")
        self.assertEqual(Router(SERVER.client()).route("after"), server.server_id)
        server.close()
        impatient.close()

    def test_a_busy_script_is_waited_out(self):
        """A script runs longer than busy-reply-threshold: other calls get BUSY until it ends."""
        server = ConnectionServer(SERVER.client(), new_server_id("gw"), ttl_ms=60_000)
        once = ConnectionServer(SERVER.client(), new_server_id("gw"), ttl_ms=60_000, retry=RetryPolicy(attempts=1))
        server.start()
        once.start()
        busy = "local t = redis.call('TIME'); local s = t[1] + t[2] / 1e6; " \
               "repeat t = redis.call('TIME') until t[1] + t[2] / 1e6 - s > 1.5; return 1"
        runner = threading.Thread(target=lambda: SERVER.admin().eval(busy, 0))
        runner.start()
        time.sleep(0.4)
        with self.assertRaises(redis.exceptions.ResponseError) as caught:
            once.register("not-now")
        self.assertTrue(str(caught.exception).startswith("BUSY"), caught.exception)
        server.register("alice")  # retried until the script is done
        runner.join()
        self.assertEqual(Router(SERVER.client()).route("alice"), server.server_id)
        server.close()
        once.close()

    def test_async_restart(self):
        async def scenario():
            lost, restored = [], asyncio.Event()
            client = SERVER.async_client(socket_timeout=1)
            server = AsyncConnectionServer(client, new_server_id("agw"), ttl_ms=600, heartbeat_interval_ms=200,
                                           on_heartbeat_lost=lost.append, on_heartbeat_restored=restored.set)
            await server.start()
            killed_ms = time.time() * 1000
            SERVER.kill()
            during = asyncio.create_task(server.register("during"))
            await asyncio.sleep(1.5)
            await asyncio.to_thread(SERVER.restart)
            await asyncio.wait_for(during, 30)
            await asyncio.wait_for(restored.wait(), 10)
            self.assertEqual(len(lost), 1)
            self.assertLessEqual(lost[0].since_ms, killed_ms)
            self.assertEqual(SERVER.admin().get("user:during"), server.server_id.encode())
            await server.close()
            await client.aclose()

        asyncio.run(scenario())


class Partition(unittest.TestCase):
    """A partition that drops bytes without a reset (the proxy swallows them), with
    redis-py's default client: no socket_timeout, so a call waits for a reply for ever."""

    def setUp(self):
        SERVER.admin().flushall()
        self.proxy = harness.Proxy(SERVER.port)

    def tearDown(self):
        self.proxy.stop()  # also ends the calls still blocked on its connections

    def test_a_blocked_heartbeat_is_reported_and_close_does_not_hang(self):
        lost = []
        with self.assertLogs("registry_janitor_client", "WARNING") as logs:
            server = ConnectionServer(redis.Redis(port=self.proxy.port), new_server_id("gw"), ttl_ms=1000,
                                      heartbeat_interval_ms=300, on_heartbeat_lost=lost.append)
        self.assertIn("no socket_timeout", logs.output[0])
        server.start()
        server.register("alice")
        self.proxy.swallow()
        swallowed = time.monotonic()
        harness.wait_for(lambda: lost, 8, "on_heartbeat_lost while the heartbeat is blocked")
        self.assertLess(time.monotonic() - swallowed, 3)
        self.assertEqual(len(lost), 1)
        self.assertIsInstance(lost[0].error, redis.exceptions.TimeoutError)
        self.assertIn("no reply", str(lost[0].error))
        self.assertGreater(lost[0].for_ms, 1000)
        self.proxy.heal()  # the heartbeat's own connection stays blocked: its bytes are gone
        closing = threading.Thread(target=server.close, daemon=True)
        closing.start()
        closing.join(10)
        self.assertFalse(closing.is_alive(), "close() hangs on the blocked heartbeat thread")
        admin = SERVER.admin()
        self.assertIsNone(admin.get("user:alice"))
        self.assertEqual(admin.exists(f"server:{{{server.server_id}}}:alive"), 0)
        self.assertIsNone(admin.zscore("servers", server.server_id))

    def test_a_client_with_socket_timeout_gets_no_warning(self):
        with self.assertNoLogs("registry_janitor_client", "WARNING"):
            ConnectionServer(SERVER.client(), new_server_id("gw"))

    def test_async_heartbeat_is_bounded_by_the_interval(self):
        async def scenario():
            lost, restored = [], asyncio.Event()
            client = redis.asyncio.Redis(port=self.proxy.port)
            with self.assertLogs("registry_janitor_client", "WARNING"):
                server = AsyncConnectionServer(client, new_server_id("agw"), ttl_ms=1000, heartbeat_interval_ms=300,
                                               on_heartbeat_lost=lost.append, on_heartbeat_restored=restored.set)
            await server.start()
            await server.register("alice")
            self.proxy.swallow()
            await asyncio.to_thread(harness.wait_for, lambda: lost, 8, "on_heartbeat_lost")
            self.assertIsInstance(lost[0].error, redis.exceptions.TimeoutError)
            self.proxy.heal()
            await asyncio.wait_for(restored.wait(), 10)
            await asyncio.wait_for(server.close(), 10)
            self.assertEqual(SERVER.admin().exists(f"server:{{{server.server_id}}}:alive", "user:alice"), 0)
            await client.aclose()

        asyncio.run(scenario())


if __name__ == "__main__":
    unittest.main()
