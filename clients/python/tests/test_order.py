"""The order of one entry's calls while they retry (an unregister supersedes the register
made before it; a register made after an unregister waits for it), close() and the
calls in flight, register() before start() has completed. Sync and asyncio."""

import asyncio
import threading
import time
import unittest

import harness
import redis
from registry_janitor_client import (
    AsyncConnectionServer,
    Closed,
    ConnectionServer,
    RetryPolicy,
    Router,
    new_server_id,
)
from registry_janitor_client.scripts import SHAS

NAME_OF_SHA = {sha: name for name, sha in SHAS.items()}
PATIENT = RetryPolicy(attempts=200, base_delay_ms=20, max_delay_ms=100, timeout_ms=20_000)


def setUpModule():
    global SERVER
    SERVER = harness.RedisServer()


def tearDownModule():
    SERVER.stop()


def oom_errors(admin) -> int:
    return int(admin.info("errorstats").get("errorstat_OOM", {}).get("count", 0))


class Outage(redis.Redis):
    """A real client whose scripts named in `down` meet an outage: their EVALSHA raises a
    connection error without being sent, and is counted in `refused`."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.down, self.refused = set(), 0

    def execute_command(self, *args, **options):
        if args[0] == "EVALSHA" and NAME_OF_SHA.get(args[1]) in self.down:
            self.refused += 1
            raise redis.exceptions.ConnectionError(f"outage of {NAME_OF_SHA[args[1]]} (injected)")
        return super().execute_command(*args, **options)


class LostHeartbeatReply(redis.Redis):
    """A real client that loses the reply of every heartbeat: the script runs, then a
    timeout is raised as if the reply never came."""

    def execute_command(self, *args, **options):
        reply = super().execute_command(*args, **options)
        if args[0] == "EVALSHA" and NAME_OF_SHA.get(args[1]) == "heartbeat":
            raise redis.exceptions.TimeoutError("the heartbeat's reply was lost (injected)")
        return reply


class Call(threading.Thread):
    """A call on its own thread; its result or error."""

    def __init__(self, function, *args):
        super().__init__(daemon=True)
        self.function, self.args, self.result, self.error = function, args, None, None
        self.start()

    def run(self):
        try:
            self.result = self.function(*self.args)
        except Exception as error:
            self.error = error

    def outcome(self, timeout=30):
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"{self.function.__name__} still running after {timeout} s")
        return self.error if self.error is not None else self.result


class Order(unittest.TestCase):
    def setUp(self):
        self.admin = SERVER.admin()
        self.admin.flushall()
        self.admin.config_set("maxmemory", 0)
        self.closing = []

    def tearDown(self):
        self.admin.config_set("maxmemory", 0)
        for thing in reversed(self.closing):
            thing()

    def test_a_register_after_an_unregister_is_applied_after_it(self):
        """alice's old socket on S closes (unregister) and she reconnects to S (register)
        while the unregister retries: the register lands after it, alice keeps an entry."""
        client = Outage(port=SERVER.port, **harness.CLIENT_OPTIONS)
        s = ConnectionServer(client, new_server_id("gw"), ttl_ms=60_000, retry=PATIENT)
        self.closing.append(s.close)
        s.start()
        s.register("alice")                                     # her first socket
        client.down = {"unregister"}
        old_socket = Call(s.unregister, "alice")                # closes: retries through the outage
        harness.wait_for(lambda: client.refused >= 2, 10, "the unregister retrying")
        new_socket = Call(s.register, "alice")                  # she is back, on S again
        time.sleep(0.5)                                         # (a register not held back lands now)
        client.down = set()
        self.assertIs(old_socket.outcome(), True)
        self.assertIsNone(new_socket.outcome())
        self.assertEqual(Router(self.admin).route("alice"), s.server_id, "a connected user has no entry")
        self.assertEqual(self.admin.smembers(f"server:{{{s.server_id}}}:users"), {b"alice"})

    def test_an_unregister_supersedes_a_register_still_retrying(self):
        """register(alice) retries through OOM; her socket closes (unregister), then the server
        closes: no attempt of the register is sent afterwards, nothing is left."""
        s = ConnectionServer(SERVER.client(), new_server_id("gw"), ttl_ms=60_000, retry=PATIENT)
        self.closing.append(s.close)
        s.start()
        s.register("bob")
        self.admin.config_set("maxmemory", 1)                   # writes are refused (OOM)
        errors = oom_errors(self.admin)
        register = Call(s.register, "alice")
        harness.wait_for(lambda: oom_errors(self.admin) > errors, 10, "the register retrying")
        self.assertFalse(s.unregister("alice"))                 # nothing was written
        self.assertIsNone(register.outcome(5), "the register did not stop at the unregister")
        s.close()
        self.admin.config_set("maxmemory", 0)                   # memory is back
        time.sleep(0.5)                                         # (a retry still due would land now)
        self.assertEqual(harness.snapshot(self.admin), {}, "a register landed after unregister() and close()")

    def test_a_user_who_moved_keeps_the_entry_of_their_new_server(self):
        """S's register(alice) retries through a cut connection; her socket on S closes and
        she registers on T: S's register must not take her entry back from T."""
        proxy = harness.Proxy(SERVER.port)
        self.closing.append(proxy.stop)
        s = ConnectionServer(redis.Redis(port=proxy.port, **harness.CLIENT_OPTIONS), new_server_id("S"),
                             ttl_ms=60_000, retry=PATIENT)
        t = ConnectionServer(SERVER.client(), new_server_id("T"), ttl_ms=60_000)
        self.closing += [s.close, t.close]
        s.start()
        t.start()
        proxy.cut()
        on_s = Call(s.register, "alice")
        time.sleep(0.3)
        closed_on_s = Call(s.unregister, "alice")
        time.sleep(0.1)
        t.register("alice")
        proxy.heal()
        self.assertIsNone(on_s.outcome())
        self.assertIs(closed_on_s.outcome(), False)             # the entry names T
        self.assertEqual(Router(self.admin).route("alice"), t.server_id)
        self.assertEqual(self.admin.smembers(f"server:{{{s.server_id}}}:users"), set())
        self.assertEqual(self.admin.smembers(f"server:{{{t.server_id}}}:users"), {b"alice"})

    def test_layout_conns_orders_per_connection(self):
        """The order is per (user, connection): an unregister of one connection does not
        stop the register of another."""
        s = ConnectionServer(SERVER.client(), new_server_id("gw"), layout="conns", ttl_ms=60_000, retry=PATIENT)
        self.closing.append(s.close)
        s.start()
        self.admin.config_set("maxmemory", 1)
        errors = oom_errors(self.admin)
        phone = Call(s.register, "alice", "phone")
        harness.wait_for(lambda: oom_errors(self.admin) > errors, 10, "the register retrying")
        self.assertFalse(s.unregister("alice", "tablet"))       # another connection
        self.admin.config_set("maxmemory", 0)
        self.assertIsNone(phone.outcome())
        self.assertEqual(self.admin.hgetall("user:{alice}:conns"), {b"phone": s.server_id.encode()})

    def test_close_waits_for_a_register_in_flight(self):
        """close() while register(alice) retries: the register stops (Closed) and close()
        unregisters what it may have written; nothing lands afterwards."""
        s = ConnectionServer(SERVER.client(), new_server_id("gw"), ttl_ms=60_000, retry=PATIENT)
        self.closing.append(s.close)
        s.start()
        self.admin.config_set("maxmemory", 1)
        errors = oom_errors(self.admin)
        register = Call(s.register, "alice")
        harness.wait_for(lambda: oom_errors(self.admin) > errors, 10, "the register retrying")
        s.close()
        self.assertIsInstance(register.outcome(5), Closed)
        self.admin.config_set("maxmemory", 0)
        time.sleep(0.5)
        self.assertEqual(harness.snapshot(self.admin), {}, "a register landed after close()")

    def test_register_waits_for_start_to_complete(self):
        """register() while start() still retries its first heartbeat: RuntimeError, nothing
        sent; once start() has failed, close() cleans up."""
        proxy = harness.Proxy(SERVER.port)
        self.closing.append(proxy.stop)
        proxy.cut()
        s = ConnectionServer(redis.Redis(port=proxy.port, **harness.CLIENT_OPTIONS), new_server_id("gw"),
                             retry=RetryPolicy(attempts=100, max_delay_ms=100, timeout_ms=1500))
        starting = Call(s.start)
        time.sleep(0.3)
        began = time.monotonic()
        with self.assertRaises(RuntimeError) as caught:
            s.register("alice")
        self.assertLess(time.monotonic() - began, 0.5)
        self.assertIn("start()", str(caught.exception))
        self.assertIsInstance(starting.outcome(), redis.exceptions.ConnectionError)
        proxy.heal()
        with self.assertRaises(RuntimeError):
            s.register("alice")                                 # start() failed: still not running
        s.close()
        self.assertEqual(harness.snapshot(self.admin), {})

    def test_close_after_a_failed_start_cleans_up(self):
        """start()'s heartbeat was written but its replies were lost: start() fails, and
        close() still removes the liveness key and the `servers` member."""
        s = ConnectionServer(LostHeartbeatReply(port=SERVER.port, **harness.CLIENT_OPTIONS), new_server_id("gw"),
                             ttl_ms=60_000, retry=RetryPolicy(attempts=2, base_delay_ms=10))
        with self.assertRaises(redis.exceptions.TimeoutError):
            s.start()
        self.assertEqual(self.admin.exists(f"server:{{{s.server_id}}}:alive"), 1)
        s.close()
        self.assertEqual(harness.snapshot(self.admin), {}, "close() after a failed start() left its heartbeat")

    def test_close_during_start(self):
        """close() while start() retries: start() sends no further attempt (Closed), no
        heartbeat thread starts, and close() leaves once Redis is back."""
        proxy = harness.Proxy(SERVER.port)
        self.closing.append(proxy.stop)
        proxy.cut()
        s = ConnectionServer(redis.Redis(port=proxy.port, **harness.CLIENT_OPTIONS), new_server_id("gw"),
                             retry=RetryPolicy(attempts=1000, max_delay_ms=100, timeout_ms=60_000))
        starting = Call(s.start)
        time.sleep(0.3)
        closing = Call(s.close)
        self.assertIsInstance(starting.outcome(5), Closed)
        proxy.heal()
        self.assertIsNone(closing.outcome())
        self.assertIsNone(s._thread)
        self.assertEqual(harness.snapshot(self.admin), {})


class AsyncOrder(unittest.IsolatedAsyncioTestCase):
    async def asyncSetUp(self):
        asyncio.get_running_loop().slow_callback_duration = 1.0  # the admin client's calls are sync
        self.admin = SERVER.admin()
        await asyncio.to_thread(self.admin.flushall)
        await asyncio.to_thread(self.admin.config_set, "maxmemory", 0)

    async def asyncTearDown(self):
        self.admin.config_set("maxmemory", 0)

    async def wait_oom(self, errors):
        await asyncio.to_thread(harness.wait_for, lambda: oom_errors(self.admin) > errors, 10, "a retry")

    async def test_an_unregister_supersedes_a_register_still_retrying(self):
        client = SERVER.async_client()
        s = AsyncConnectionServer(client, new_server_id("agw"), ttl_ms=60_000, retry=PATIENT)
        await s.start()
        self.admin.config_set("maxmemory", 1)
        errors = oom_errors(self.admin)
        register = asyncio.create_task(s.register("alice"))
        await self.wait_oom(errors)
        self.assertFalse(await s.unregister("alice"))
        self.assertIsNone(await asyncio.wait_for(register, 5))
        await s.close()
        self.admin.config_set("maxmemory", 0)
        await asyncio.sleep(0.5)
        self.assertEqual(harness.snapshot(self.admin), {})
        await client.aclose()

    async def test_a_register_after_an_unregister_is_applied_after_it(self):
        client = SERVER.async_client()
        s = AsyncConnectionServer(client, new_server_id("agw"), ttl_ms=60_000, retry=PATIENT)
        await s.start()
        await s.register("alice")
        release = asyncio.Event()
        original = client.execute_command

        async def held_unregister(*args, **options):
            if args[0] == "EVALSHA" and NAME_OF_SHA.get(args[1]) == "unregister":
                await release.wait()
            return await original(*args, **options)

        client.execute_command = held_unregister  # the unregister's attempt is in flight until release
        old_socket = asyncio.create_task(s.unregister("alice"))
        await asyncio.sleep(0.1)
        new_socket = asyncio.create_task(s.register("alice"))
        await asyncio.sleep(0.3)
        release.set()
        self.assertIs(await asyncio.wait_for(old_socket, 10), True)
        self.assertIsNone(await asyncio.wait_for(new_socket, 10))
        self.assertEqual(self.admin.get("user:alice"), s.server_id.encode())
        await s.close()
        await client.aclose()

    async def test_close_waits_for_a_register_in_flight(self):
        client = SERVER.async_client()
        s = AsyncConnectionServer(client, new_server_id("agw"), ttl_ms=60_000, retry=PATIENT)
        await s.start()
        self.admin.config_set("maxmemory", 1)
        errors = oom_errors(self.admin)
        register = asyncio.create_task(s.register("alice"))
        await self.wait_oom(errors)
        await s.close()
        with self.assertRaises(Closed):
            await asyncio.wait_for(register, 5)
        self.admin.config_set("maxmemory", 0)
        await asyncio.sleep(0.5)
        self.assertEqual(harness.snapshot(self.admin), {})
        await client.aclose()

    async def test_register_waits_for_start_to_complete(self):
        proxy = harness.Proxy(SERVER.port)
        proxy.cut()
        client = redis.asyncio.Redis(port=proxy.port, socket_timeout=5, socket_connect_timeout=2)
        s = AsyncConnectionServer(client, new_server_id("agw"),
                                  retry=RetryPolicy(attempts=100, max_delay_ms=100, timeout_ms=1500))
        starting = asyncio.create_task(s.start())
        await asyncio.sleep(0.3)
        with self.assertRaises(RuntimeError):
            await asyncio.wait_for(s.register("alice"), 0.5)
        with self.assertRaises(redis.exceptions.ConnectionError):
            await starting
        proxy.heal()
        await s.close()
        self.assertEqual(harness.snapshot(self.admin), {})
        await client.aclose()
        proxy.stop()


if __name__ == "__main__":
    unittest.main()
