"""A Redis Cluster of three masters: the spec's order of the steps (read off MONITOR on
every node), the release of a forward entry whose member step is refused, the fence by
the real worker connected as a cluster; sync and asyncio, RESP2 and RESP3."""

import asyncio
import shlex
import subprocess
import sys
import threading
import time
import unittest
import warnings

import harness
import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import LoadBalancingStrategy, RedisCluster
from registry_janitor_client import (
    SCRIPTS,
    AsyncConnectionServer,
    AsyncRouter,
    ConnectionServer,
    Fenced,
    ProtocolError,
    Router,
    new_server_id,
)
from registry_janitor_client.scripts import SHAS

NAME_OF_SHA = {sha: name for name, sha in SHAS.items()}


def setUpModule():
    global CLUSTER
    CLUSTER = harness.Cluster()


def tearDownModule():
    CLUSTER.stop()


class Monitor:
    """MONITOR on every node (redis-cli); the commands clients sent, in time order."""

    def __init__(self):
        self.files, self.procs = [], []
        for node in CLUSTER.nodes:
            out = open(node.dir / f"monitor-{time.monotonic_ns()}.log", "w+")
            self.files.append(out)
            self.procs.append(subprocess.Popen([harness.REDIS_CLI, "-p", str(node.port), "monitor"], stdout=out,
                                               stderr=subprocess.DEVNULL, start_new_session=True))
        self._mark("monitor-start")

    def _mark(self, marker):
        for node, out in zip(CLUSTER.nodes, self.files):
            def seen():
                node.admin().echo(marker)
                out.seek(0)
                return marker in out.read()
            harness.wait_for(seen, 10, f"MONITOR on {node.port}", every=0.1)

    def stop(self):
        self._mark("monitor-end")
        for proc in self.procs:
            proc.terminate()
            proc.wait()
        events = []
        for out in self.files:
            out.seek(0)
            for line in out:
                stamp, _, rest = line.partition(" [")
                source, _, command = rest.partition("] ")
                if " lua" in source or not command:
                    continue  # a script's own calls
                try:
                    args = shlex.split(command)
                except ValueError:
                    continue
                events.append((float(stamp), args))
            out.close()
        return [args for _, args in sorted(events, key=lambda e: e[0])]


def steps(events, marker):
    """The commands that name `marker` in a key or an argument, as (command, keys...)."""
    out = []
    for args in events:
        if not any(marker in a for a in args):
            continue
        name = args[0].upper()
        if name in ("EVALSHA", "EVALSHA_RO"):
            count = int(args[2])
            out.append((f"{name} {NAME_OF_SHA.get(args[1], args[1])}", *args[3 : 3 + count]))
        elif name == "SCRIPT":
            continue
        else:
            out.append((name, args[1]))
    return out


class ClusterTests:
    PROTOCOL = 2

    def setUp(self):
        self.redis = CLUSTER.client(self.PROTOCOL)
        self.servers = []

    def tearDown(self):
        for server in self.servers:
            server.close()
        self.redis.close()

    def server(self, layout, prefix, client=None, **options):
        options.setdefault("ttl_ms", 120_000)
        options.setdefault("heartbeat_interval_ms", 60_000)
        server = ConnectionServer(client or self.redis, new_server_id("cgw"), layout=layout, key_prefix=prefix, **options)
        self.servers.append(server)
        return server

    def test_register_route_unregister_in_each_layout(self):
        for layout in ("hash", "keys", "conns"):
            with self.subTest(layout=layout):
                prefix = f"each{self.PROTOCOL}{layout}:"
                s, t = self.server(layout, prefix), self.server(layout, prefix)
                s.start()
                t.start()
                self.assertTrue(s.cluster)
                router = Router(self.redis, layout=layout, key_prefix=prefix)
                users = [f"user-{n}" for n in range(50)]
                conn = "c1" if layout == "conns" else None
                for user in users:
                    s.register(user, conn)
                t.register(users[0], "c2" if conn else None)
                if layout == "conns":
                    got = router.route_users(users + ["nobody"])
                    self.assertEqual(got[0], sorted([s.server_id, t.server_id]))
                    self.assertEqual(got[1:], [[s.server_id]] * 49 + [[]])
                    harness.fence(self.redis, t.server_id, prefix)
                    self.assertEqual(router.route_user(users[0]), [s.server_id])
                else:
                    got = router.route_many(users + ["nobody"])
                    self.assertEqual(got, [t.server_id] + [s.server_id] * 49 + [None])
                    self.assertEqual(router.route(users[1]), s.server_id)
                    harness.fence(self.redis, t.server_id, prefix)
                    self.assertIsNone(router.route(users[0]))
                self.assertTrue(s.unregister(users[1], conn))
                self.assertFalse(s.unregister(users[1], conn))
                s.close()
                t.close()
                self.assertEqual(router.route_users(users) if conn else router.route_many(users),
                                 [[] if conn else None] * 50)
                self.assertEqual(self.redis.exists(f"{prefix}server:{{{s.server_id}}}:alive"), 0)
                self.assertIsNone(self.redis.zscore(f"{prefix}servers", s.server_id))

    def test_the_order_of_the_steps(self):
        prefix = f"order{self.PROTOCOL}:"
        for layout in ("keys", "hash", "conns"):
            with self.subTest(layout=layout):
                s = self.server(layout, prefix + layout + ":")
                p = prefix + layout + ":"
                router = Router(self.redis, layout=layout, key_prefix=p)
                sid = s.server_id
                F, N, U, A = (f"{p}server:{{{sid}}}:{k}" for k in ("fenced", "refused", "users", "alive"))
                conn = "phone" if layout == "conns" else None
                R = {"keys": f"{p}user:alice", "hash": f"{p}registry", "conns": f"{p}user:{{alice}}:conns"}[layout]
                write = "SET" if layout == "keys" else "HSET"
                member = "register_conn" if conn else "register"
                monitor = Monitor()
                s.start()
                s.register("alice", conn)
                if conn:
                    router.route_user("alice")
                else:
                    router.route("alice")
                s.unregister("alice", conn)
                got = steps(monitor.stop(), p)
                want = [
                    ("EVALSHA heartbeat", F, N, A), ("ZADD", f"{p}servers"),      # heartbeat
                    ("EXISTS", F), (write, R), (f"EVALSHA {member}", F, N, U),     # register
                    ("HGETALL" if conn else "GET" if layout == "keys" else "HMGET", R),  # route
                    ("EXISTS", F), ("EXISTS", A),
                    ("EVALSHA release", R), (f"EVALSHA un{member}", F, N, U),      # unregister
                ]
                self.assertEqual(got, want)

    def test_a_registration_refused_at_its_member_step_takes_its_forward_entry_back(self):
        for layout in ("keys", "hash", "conns"):
            with self.subTest(layout=layout):
                prefix = f"race{self.PROTOCOL}{layout}:"
                admin = CLUSTER.client()
                conn = "phone" if layout == "conns" else None
                forward = {"keys": f"{prefix}user:alice", "hash": f"{prefix}registry", "conns": f"{prefix}user:{{alice}}:conns"}[layout]

                class VerdictInBetween(RedisCluster):
                    """The verdict lands between EXISTS F and the member: right after the
                    forward entry's write."""

                    def execute_command(inner, *args, **options):
                        reply = super().execute_command(*args, **options)
                        if args[0] in ("SET", "HSET") and args[1] == forward.encode():
                            harness.fence(admin, server_id, prefix)
                        return reply

                client = VerdictInBetween(host="127.0.0.1", port=CLUSTER.nodes[0].port, protocol=self.PROTOCOL)
                calls = []
                s = self.server(layout, prefix, client=client, on_fenced=calls.append)
                server_id = s.server_id
                s.start()
                with self.assertRaises(Fenced):
                    s.register("alice", conn)
                self.assertEqual(len(calls), 1)
                self.assertEqual(admin.exists(forward), 0, "the forward entry was not taken back")
                self.assertEqual(admin.exists(f"{prefix}server:{{{server_id}}}:users"), 0)
                self.assertEqual(admin.hget(f"{prefix}server:{{{server_id}}}:refused", "register"), b"1")
                client.close()

    def test_a_fence_expired_between_its_read_and_the_member_step_registers_whole(self):
        for layout in ("keys", "hash", "conns"):
            with self.subTest(layout=layout):
                prefix = f"expired{self.PROTOCOL}{layout}:"
                admin = CLUSTER.client()
                conn = "phone" if layout == "conns" else None
                forward = {"keys": f"{prefix}user:alice", "hash": f"{prefix}registry", "conns": f"{prefix}user:{{alice}}:conns"}[layout]
                field = {"keys": None, "hash": "alice", "conns": "phone"}[layout]

                class FenceExpiresInBetween(RedisCluster):
                    """The fence goes (as when its TTL runs out) right after EXISTS F saw it."""

                    def execute_command(inner, *args, **options):
                        reply = super().execute_command(*args, **options)
                        if args[0] == "EXISTS" and reply and args[1] in (fence, fence.encode()):
                            admin.delete(fence)
                        return reply

                client = FenceExpiresInBetween(host="127.0.0.1", port=CLUSTER.nodes[0].port, protocol=self.PROTOCOL)
                s = self.server(layout, prefix, client=client)
                server_id = s.server_id
                fence = f"{prefix}server:{{{server_id}}}:fenced"
                s.start()
                harness.fence(admin, server_id, prefix)
                s.register("alice", conn)
                owner = admin.get(forward) if field is None else admin.hget(forward, field)
                self.assertEqual(owner, server_id.encode(), "registered without its forward entry")
                self.assertEqual(admin.sismember(f"{prefix}server:{{{server_id}}}:users", "phone alice" if conn else "alice"), 1)
                s.close()
                client.close()

    def test_an_already_fenced_server_writes_no_forward_entry(self):
        prefix = f"zombie{self.PROTOCOL}:"
        live, zombie = self.server("keys", prefix), self.server("keys", prefix)
        live.start()
        zombie.start()
        live.register("alice")
        harness.fence(self.redis, zombie.server_id, prefix)
        monitor = Monitor()
        with self.assertRaises(Fenced):
            zombie.register("alice")
        got = steps(monitor.stop(), prefix)
        F, N, U = (f"{prefix}server:{{{zombie.server_id}}}:{k}" for k in ("fenced", "refused", "users"))
        self.assertEqual(got, [("EXISTS", F), ("EVALSHA register", F, N, U)])
        self.assertEqual(self.redis.get(f"{prefix}user:alice"), live.server_id.encode())
        self.assertEqual(Router(self.redis, key_prefix=prefix).route("alice"), live.server_id)

    def test_a_plain_client_given_a_cluster_node(self):
        plain = CLUSTER.nodes[0].client(self.PROTOCOL)
        router = Router(plain, key_prefix="plain:")
        for user in ("alice", "bob", "carol", "dave"):  # keys in slots of every node
            with self.assertRaises(ProtocolError) as caught:
                router.route(user)
            self.assertIn("RedisCluster", str(caught.exception))
        server = ConnectionServer(plain, new_server_id("plain"), key_prefix="plain:", ttl_ms=60_000)
        with self.assertRaises(ProtocolError):
            server.start()
        plain.close()

    def test_close_releases_before_the_member_scripts(self):
        """close(): an entry whose release.lua fails keeps its member (the janitor finds the
        entry through it); the others go; the error is raised, the liveness left."""
        prefix = f"closeorder{self.PROTOCOL}:"
        s = self.server("keys", prefix)
        s.start()
        s.register("alice")
        s.register("bob")
        self.redis.delete(f"{prefix}user:bob")
        self.redis.rpush(f"{prefix}user:bob", "not an owner")  # release.lua: WRONGTYPE
        with self.assertRaises(redis.exceptions.ResponseError) as caught:
            s.close()
        self.assertIn("WRONGTYPE", str(caught.exception))
        self.assertEqual(self.redis.smembers(f"{prefix}server:{{{s.server_id}}}:users"), {b"bob"},
                         "a member was removed while its forward entry could not be released")
        self.assertIsNone(self.redis.get(f"{prefix}user:alice"))
        self.assertEqual(self.redis.exists(f"{prefix}server:{{{s.server_id}}}:alive"), 1)

    def test_close_of_a_fenced_server_with_a_failed_release_reports_fenced(self):
        prefix = f"closefenced{self.PROTOCOL}:"
        calls = []
        s = self.server("keys", prefix, on_fenced=calls.append)
        s.start()
        s.register("alice")
        s.register("bob")
        self.redis.delete(f"{prefix}user:bob")
        self.redis.rpush(f"{prefix}user:bob", "not an owner")
        harness.fence(self.redis, s.server_id, prefix)
        s.close()  # FENCED wins over bob's error: on_fenced, nothing raised
        self.assertEqual(len(calls), 1)
        self.assertTrue(s.fenced)

    def test_noscript_on_a_cluster(self):
        prefix = f"noscript{self.PROTOCOL}:"
        s = self.server("keys", prefix)
        s.start()
        for node in CLUSTER.nodes:
            node.admin().script_flush()
        s.register("alice")
        self.assertTrue(s.unregister("alice"))


class ClusterResp2(ClusterTests, unittest.TestCase):
    PROTOCOL = 2


class ClusterResp3(ClusterTests, unittest.TestCase):
    PROTOCOL = 3


class ClusterWorker(unittest.TestCase):
    def test_the_worker_fences_a_heartbeating_server_on_a_cluster(self):
        prefix, interval = "cw:", 500
        worker = harness.Worker(CLUSTER.url, "keys", prefix, cluster=True)
        try:
            client = CLUSTER.client()
            done = threading.Event()
            learned = []
            server = ConnectionServer(client, new_server_id("cgw"), key_prefix=prefix, ttl_ms=3 * interval,
                                      heartbeat_interval_ms=interval, on_fenced=lambda e: (learned.append(time.time()), done.set()))
            server.start()
            for n in range(300):
                server.register(f"u{n}")
            emitted = time.time()
            worker.emit_dead(server.server_id)
            self.assertTrue(done.wait(30), f"on_fenced was not called; worker log:\n{worker.log()}")
            fenced_ms = int(client.hget(f"{prefix}server:{{{server.server_id}}}:fenced", "fenced_at_ms"))
            print(f"\n  [figure] cluster, interval {interval} ms: emit -> on_fenced {(learned[0] - emitted) * 1000:.0f} ms, "
                  f"fence written -> on_fenced {(learned[0] - fenced_ms / 1000) * 1000:.0f} ms", file=sys.stderr, end="")
            self.assertLess(learned[0] - fenced_ms / 1000, interval / 1000 + 2.0)
            router = Router(client, key_prefix=prefix)
            self.assertEqual(router.route_many([f"u{n}" for n in range(300)]), [None] * 300)
            harness.wait_for(lambda: all(v is None for v in
                                         (client.get(f"{prefix}user:u{n}") for n in range(300))), 30, "the cleanup")
            server.close()
        finally:
            worker.stop()


class ReplicaReads(unittest.TestCase):
    """One master and a replica that lags: a RedisCluster that reads from replicas would
    miss the fence (route a fenced owner, register past EXISTS F): it is refused; the
    default client reads from the master."""

    @classmethod
    def setUpClass(cls):
        cls.cluster = harness.ReplicaCluster()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.stop()

    def test_a_cluster_client_that_reads_from_replicas_is_refused(self):
        c = self.cluster
        primary = c.client()
        s = ConnectionServer(primary, new_server_id("rgw"), key_prefix="rr:", ttl_ms=60_000)
        s.start()
        s.register("alice")
        harness.wait_for(lambda: c.replica_exists("rr:user:alice"), 10, "alice on the replica")
        c.lag()
        try:
            harness.fence(primary, s.server_id, "rr:")
            fence = f"rr:server:{{{s.server_id}}}:fenced"
            self.assertEqual((primary.exists(fence), c.replica_exists(fence)), (1, 0), "the replica does not lag")
            for options in ({"load_balancing_strategy": LoadBalancingStrategy.ROUND_ROBIN_REPLICAS},
                            {"load_balancing_strategy": LoadBalancingStrategy.ROUND_ROBIN},
                            {"read_from_replicas": True}):
                with self.subTest(**{k: str(v) for k, v in options.items()}):
                    with warnings.catch_warnings():  # read_from_replicas is deprecated in redis-py 5.3+
                        warnings.simplefilter("ignore", DeprecationWarning)
                        replicas, areplicas = c.client(**options), c.async_client(**options)
                    for make in (lambda: Router(replicas, key_prefix="rr:"),
                                 lambda: ConnectionServer(replicas, new_server_id("rgw"), key_prefix="rr:")):
                        with self.assertRaises(ValueError) as caught:
                            routed = make()
                            if isinstance(routed, Router):  # not refused: what it would answer
                                self.fail(f"not refused; route(alice) -> {[routed.route('alice') for _ in range(4)]}")
                        self.assertIn("reads from replicas", str(caught.exception))
                    replicas.close()
                    for make in (lambda: AsyncRouter(areplicas), lambda: AsyncConnectionServer(areplicas, "a#1")):
                        with self.assertRaises(ValueError):
                            make()
            # The default client reads from the master, which has the fence.
            self.assertIsNone(Router(primary, key_prefix="rr:").route("alice"))
            with self.assertRaises(Fenced):
                s.register("bob")
            self.assertIsNone(primary.get("rr:user:bob"))
        finally:
            c.catch_up()
            s.close()
            primary.close()


class AsyncClusterTests:
    PROTOCOL = 2

    async def asyncSetUp(self):
        asyncio.get_running_loop().slow_callback_duration = 1.0  # the cluster client's start-up, in debug mode

    async def test_each_layout_and_the_release(self):
        client = CLUSTER.async_client(self.PROTOCOL)
        try:
            for layout in ("keys", "hash", "conns"):
                prefix = f"async{self.PROTOCOL}{layout}:"
                conn = "tab" if layout == "conns" else None
                s = AsyncConnectionServer(client, new_server_id("acgw"), layout=layout, key_prefix=prefix, ttl_ms=60_000)
                self.assertTrue(s.cluster)
                async with s:
                    router = AsyncRouter(client, layout=layout, key_prefix=prefix)
                    await s.register("alice", conn)
                    await s.register("bob", conn)
                    if conn:
                        self.assertEqual(await router.route_users(["alice", "x"]), [[s.server_id], []])
                    else:
                        self.assertEqual(await router.route_many(["alice", "x"]), [s.server_id, None])
                    self.assertTrue(await s.unregister("alice", conn))
                    await asyncio.to_thread(harness.fence, CLUSTER.client(), s.server_id, prefix)
                    with self.assertRaises(Fenced):
                        await s.register("carol", conn)
                    self.assertTrue(s.fenced)
                    with self.assertRaises(Fenced):
                        await s.unregister("bob", conn)
        finally:
            await client.aclose()


class AsyncClusterResp2(AsyncClusterTests, unittest.IsolatedAsyncioTestCase):
    PROTOCOL = 2


class AsyncClusterResp3(AsyncClusterTests, unittest.IsolatedAsyncioTestCase):
    PROTOCOL = 3


if __name__ == "__main__":
    unittest.main()
