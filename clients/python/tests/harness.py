"""Test harness: real redis-server processes (a node, Sentinel, a 3-master cluster) on
free ports in temporary directories, and the real janitor binary. Everything started
here is stopped by the test classes, and at exit whatever is left."""

from __future__ import annotations

import atexit
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

REPO = Path(__file__).resolve().parents[3]
REDIS_SERVER = shutil.which("redis-server") or "redis-server"
REDIS_CLI = shutil.which("redis-cli") or "redis-cli"

_running: list["Process"] = []
_dirs: list[Path] = []


def janitor_bin() -> str:
    path = Path(os.environ.get("REGISTRY_JANITOR_BIN", REPO / "target" / "debug" / "registry-janitor"))
    if not path.is_file():
        raise RuntimeError(
            f"the registry-janitor binary is missing at {path}: build it with "
            f"`cd {REPO} && cargo build -p registry-janitor`, or set REGISTRY_JANITOR_BIN"
        )
    return str(path)


def wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """Polls `check` until it returns something true; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (redis.RedisError, OSError) as error:
            last = error
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(bus: bool = False) -> int:
    """A port free now (and, for a cluster node, its bus port +10000 too)."""
    while True:
        port = random.randrange(20000, 55000)
        if _bindable(port) and (not bus or _bindable(port + 10000)):
            return port


class Process:
    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.args, self.log = args, log
        self._out = open(log, "ab")
        self.proc = subprocess.Popen(
            args, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )
        _running.append(self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> None:
        if self.alive():
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        if self in _running:
            _running.remove(self)


@atexit.register
def _stop_everything() -> None:
    for process in list(_running):
        process.stop(signal.SIGKILL)
    for path in _dirs:
        shutil.rmtree(path, ignore_errors=True)


def _temp_dir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _dirs.append(path)
    return path


CLIENT_OPTIONS: dict[str, Any] = {"socket_timeout": 5, "socket_connect_timeout": 2, "retry": Retry(NoBackoff(), 1)}


class RedisServer:
    """One redis-server on a free port, in its own temporary directory."""

    def __init__(self, *extra: str, cluster: bool = False, conf: str | None = None, sentinel: bool = False):
        self.extra, self.cluster, self.sentinel = list(extra), cluster, sentinel
        self.dir = _temp_dir("rjc-redis-")
        self.conf = conf
        self.process: Process | None = None
        self.port = 0
        for _ in range(5):
            self.port = free_port(bus=cluster)
            if self._launch():
                return
        raise RuntimeError(f"redis-server did not start; see {self.dir}")

    def _launch(self) -> bool:
        if self.conf is not None:
            conf = self.dir / "redis.conf"
            conf.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n{self.conf}")
            args = [REDIS_SERVER, str(conf)] + (["--sentinel"] if self.sentinel else [])
        else:
            args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                    "--save", "", "--appendonly", "no", "--protected-mode", "no"]
            if self.cluster:
                args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf"),
                         "--cluster-node-timeout", "2000"]
        self.process = Process(args + self.extra, self.dir / "redis.log")
        try:
            wait_for(lambda: self.process.alive() and self.admin().ping(), 10, f"redis-server on {self.port}")
            return True
        except AssertionError:
            self.process.stop(signal.SIGKILL)
            return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def admin(self, **options: Any) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=10, **options)

    def client(self, protocol: int = 2, **options: Any) -> redis.Redis:
        """A client as the README recommends: timeouts, and one immediate retry of its own
        (the connection server's RetryPolicy does the waiting)."""
        return redis.Redis(port=self.port, protocol=protocol, **{**CLIENT_OPTIONS, **options})

    def async_client(self, protocol: int = 2, **options: Any) -> redis.asyncio.Redis:
        from redis.asyncio.retry import Retry as AsyncRetry

        options = {**CLIENT_OPTIONS, "retry": AsyncRetry(NoBackoff(), 1), **options}
        return redis.asyncio.Redis(port=self.port, protocol=protocol, **options)

    def kill(self) -> None:
        assert self.process is not None
        self.process.stop(signal.SIGKILL)

    def restart(self) -> None:
        """Starts it again on the same port (after kill())."""
        if not self._launch():
            raise RuntimeError(f"redis-server did not restart on {self.port}; see {self.dir}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


class Cluster:
    """Three masters, no replicas, slots spread by redis-cli --cluster create."""

    def __init__(self) -> None:
        self.nodes: list[RedisServer] = []
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        for _ in range(3):
            self.nodes.append(RedisServer(cluster=True))
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([REDIS_CLI, "--cluster", "create", *addresses, "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)

        def ok() -> bool:
            return all(n.admin().cluster("info").get("cluster_state") == "ok" for n in self.nodes)

        wait_for(ok, 30, "cluster_state:ok on every node", every=0.2)
        wait_for(lambda: self.client().ping(), 10, "a cluster client")

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def client(self, protocol: int = 2, **options: Any) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port, protocol=protocol,
                            socket_timeout=5, socket_connect_timeout=2, **options)

    def async_client(self, protocol: int = 2, **options: Any) -> AsyncRedisCluster:
        return AsyncRedisCluster(host="127.0.0.1", port=self.nodes[0].port, protocol=protocol,
                                 socket_timeout=5, socket_connect_timeout=2, **options)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class ReplicaCluster:
    """A cluster of one master (every slot) and its replica, whose replication can be
    held back (`lag()`): the replica stays up and serves what it had, behind the master."""

    # A replica is listed (CLUSTER SLOTS) once its replication offset is above 0: the
    # master's pings of its replicas (every repl-ping-replica-period s) move it.
    OPTIONS = ("--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1")

    def __init__(self) -> None:
        self.master = RedisServer(*self.OPTIONS, cluster=True)
        try:
            self.replica = RedisServer(*self.OPTIONS, cluster=True)
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        m, r = self.master.admin(), self.replica.admin()
        m.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        r.execute_command("CLUSTER", "MEET", "127.0.0.1", self.master.port)
        master_id = m.execute_command("CLUSTER", "MYID")
        master_id = master_id.decode() if isinstance(master_id, bytes) else master_id
        wait_for(lambda: all(int(n.admin().cluster("info").get("cluster_known_nodes", 0)) == 2
                             for n in (self.master, self.replica)), 10, "the nodes meeting")
        r.execute_command("CLUSTER", "REPLICATE", master_id)
        wait_for(lambda: r.info("replication").get("master_link_status") == "up", 30, "the replica in sync")
        wait_for(lambda: all(n.admin().cluster("info").get("cluster_state") == "ok" for n in (self.master, self.replica))
                 and len(RedisCluster(host="127.0.0.1", port=self.master.port).get_replicas()) == 1,
                 30, "cluster_state:ok and the replica known", every=0.2)

    def client(self, protocol: int = 2, **options: Any) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.master.port, protocol=protocol,
                            socket_timeout=5, socket_connect_timeout=2, **options)

    def async_client(self, protocol: int = 2, **options: Any) -> AsyncRedisCluster:
        return AsyncRedisCluster(host="127.0.0.1", port=self.master.port, protocol=protocol,
                                 socket_timeout=5, socket_connect_timeout=2, **options)

    def lag(self) -> None:
        """The replica falls behind: the master refuses it replication (ACL) and drops
        its link; the replica keeps serving the data it had."""
        m = self.master.admin()
        m.execute_command("ACL", "SETUSER", "default", "-psync", "-sync", "-replconf")
        m.execute_command("CLIENT", "KILL", "TYPE", "replica")
        wait_for(lambda: self.replica.admin().info("replication").get("master_link_status") == "down",
                 10, "the replica's link down")

    def catch_up(self) -> None:
        self.master.admin().execute_command("ACL", "SETUSER", "default", "+@all")
        wait_for(lambda: self.replica.admin().info("replication").get("master_link_status") == "up",
                 30, "the replica in sync again")

    def replica_exists(self, key: str) -> int:
        """EXISTS on the replica itself (READONLY), not redirected to the master."""
        connection = self.replica.admin().connection_pool.get_connection()
        try:
            connection.send_command("READONLY")
            connection.read_response()
            connection.send_command("EXISTS", key)
            return int(connection.read_response())
        finally:
            connection.disconnect()

    def stop(self) -> None:
        for node in (self.master, getattr(self, "replica", None)):
            if node is not None:
                node.stop()


class Proxy:
    """A TCP proxy to 127.0.0.1:<port>, to cut a client off Redis. cut(): its connections
    are closed and new ones closed at once (errors at once, as a restart or a reset
    gives); swallow(): connections stay open and every byte is dropped, both ways, new
    connections too (a partition without a reset: no reply, no error); heal() ends
    either."""

    def __init__(self, port: int):
        self.target = port
        self.mode = "pass"
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name=f"proxy {self.port}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode == "cut":
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                if self.mode == "pass":
                    b.sendall(data)
                elif self.mode == "cut":
                    break
                # swallow: dropped
        except OSError:
            pass
        for s in (a, b):
            _close(s)

    def _close_all(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            _close(s)

    def cut(self) -> None:
        self.mode = "cut"
        self._close_all()

    def swallow(self) -> None:
        self.mode = "swallow"

    def heal(self) -> None:
        self.mode = "pass"

    def stop(self) -> None:
        self.mode = "cut"
        _close(self._listener)
        self._close_all()


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


class SentinelSet:
    """One primary, one replica and three sentinels monitoring them as `mymaster`."""

    NAME = "mymaster"

    def __init__(self, *extra: str) -> None:
        self.sentinels: list[RedisServer] = []
        self.primary = RedisServer(*extra)
        try:
            self._start(extra)
        except BaseException:
            self.stop()
            raise

    def _start(self, extra: tuple[str, ...]) -> None:
        self.replica = RedisServer(*extra, "--replicaof", "127.0.0.1", str(self.primary.port))
        wait_for(lambda: self.replica.admin().info("replication").get("master_link_status") == "up",
                 20, "the replica in sync")
        conf = (
            f"sentinel monitor {self.NAME} 127.0.0.1 {self.primary.port} 2\n"
            f"sentinel down-after-milliseconds {self.NAME} 1000\n"
            f"sentinel failover-timeout {self.NAME} 5000\n"
            f"sentinel parallel-syncs {self.NAME} 1\n"
        )
        for _ in range(3):
            self.sentinels.append(RedisServer(conf=conf, sentinel=True))

        def known() -> bool:
            for s in self.sentinels:
                a = s.admin()
                replicas = a.execute_command("SENTINEL", "REPLICAS", self.NAME)
                if len(replicas) < 1 or len(a.execute_command("SENTINEL", "SENTINELS", self.NAME)) < 2:
                    return False
            return True

        wait_for(known, 30, "sentinels that know the replica and each other", every=0.2)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", s.port) for s in self.sentinels]

    def primary_port(self) -> int:
        host, port = self.sentinels[0].admin().execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.NAME)
        return int(port)

    def node(self, port: int) -> RedisServer:
        return next(n for n in (self.primary, self.replica) if n.port == port)

    def stop(self) -> None:
        for server in (*self.sentinels, self.primary, getattr(self, "replica", None)):
            if server is not None:
                server.stop()


class Worker:
    """`registry-janitor worker`: fences and cleans the servers of `server.dead` events."""

    def __init__(self, url: str, layout: str, key_prefix: str = "", chunk_size: int = 1000, cluster: bool = False):
        self.dir = _temp_dir("rjc-worker-")
        self.env = janitor_env(cluster)
        self.settings = ["--redis-url", url, "--layout", layout, "--key-prefix", key_prefix]
        self.process = Process(
            [janitor_bin(), "worker", *self.settings, "--chunk-size", str(chunk_size), "--metrics-addr", "off"],
            self.dir / "worker.log", env=self.env,
        )

    def emit_dead(self, server_id: str) -> str:
        """`registry-janitor emit server-dead <S>`; the stream entry id."""
        done = subprocess.run(
            [janitor_bin(), "emit", *self.settings, "server-dead", server_id, "--reason", "test"],
            capture_output=True, text=True, timeout=30, env={**os.environ, **self.env},
        )
        if done.returncode != 0:
            raise RuntimeError(f"emit failed: {done.stderr}")
        return done.stdout.strip()

    def log(self) -> str:
        return (self.dir / "worker.log").read_text(errors="replace")

    def stop(self) -> None:
        self.process.stop(signal.SIGTERM, timeout=15)
        shutil.rmtree(self.dir, ignore_errors=True)


def janitor_env(cluster: bool) -> dict[str, str]:
    # The guard would hold a verdict against a server that still heartbeats once more than
    # a few are disputed: these tests fence heartbeating servers on purpose.
    return {"JANITOR_GUARD": "false", "JANITOR_REDIS_CLUSTER": "true" if cluster else "false",
            "JANITOR_LOG_FORMAT": "text", "RUST_LOG": os.environ.get("RUST_LOG", "info")}


def snapshot(client: Any) -> dict[bytes, bytes]:
    """Every key and its DUMP (value, not TTL) on one node."""
    return {key: client.dump(key) for key in client.scan_iter(count=1000)}


def fence(client: Any, server_id: str, key_prefix: str = "") -> None:
    """Writes a fence as a worker does (for tests of route's rules; the fence tests use
    the real worker)."""
    client.hset(f"{key_prefix}server:{{{server_id}}}:fenced", mapping={"fenced_at_ms": int(time.time() * 1000), "entry": "0-1"})
