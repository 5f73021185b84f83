//! Test harness: a real `redis-server` per test on a free port (never a fixed one, never
//! the machine's own Redis), a key prefix per test, workers run in-process or as real
//! processes, and waits that fail with the server's log attached.
#![allow(dead_code)]

pub mod monitoring;

use std::{
    future::Future,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use registry_janitor::conn::RedisConn;
use registry_janitor::{
    config::{Layout, Settings},
    conn,
    event::{ServerDead, ServerId},
    keys::Keys,
    metrics::Metrics,
    registry::Registry,
    status, stream,
    worker::Worker,
};
use registry_janitor_testkit::RedisServer;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Starts a private redis-server, or fails with a clear message.
pub fn redis() -> RedisServer {
    redis_with(&[])
}

pub use registry_janitor_testkit::cannot_run;

/// Worker logs go to the test's captured output, shown when a test fails.
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "registry_janitor=info".into()),
        )
        .with_test_writer()
        .try_init();
}

pub fn redis_with(args: &[&str]) -> RedisServer {
    init_logs();
    assert!(
        RedisServer::available(),
        "these tests need redis-server on PATH (Debian: apt-get install redis-server)"
    );
    RedisServer::start_with(args).expect("start redis-server")
}

/// The payload of [`Fixture::publish_junk`].
pub const JUNK_PAYLOAD: &[u8] = b"\x00junk";

/// A key prefix no other test uses.
pub fn prefix() -> String {
    format!("t{}:", ulid::Ulid::new())
}

/// Settings for a test: short waits so tests run fast, metrics listener off.
pub fn settings(server: &RedisServer, layout: Layout) -> Settings {
    let mut s = Settings::defaults();
    s.redis_url = server.url();
    s.key_prefix = prefix();
    s.layout = layout;
    s.block_ms = 200;
    s.claim_min_idle_ms = 1000;
    s.metrics_addr = "off".into();
    s.chunk_size = 500;
    s
}

/// [`settings`] for a local cluster: its first node, every node as a seed.
pub fn cluster_settings(
    cluster: &registry_janitor_testkit::RedisCluster,
    layout: Layout,
) -> Settings {
    let mut s = settings(&cluster.nodes[0], layout);
    s.redis_cluster = true;
    s.redis_cluster_seeds = cluster.seeds();
    s
}

pub fn connect(settings: &Settings) -> RedisConn {
    conn::shared(&conn::client(&settings.redis_url).unwrap()).unwrap()
}

pub fn server(name: &str) -> ServerId {
    ServerId::parse(name).unwrap()
}

pub fn user(server: &ServerId, n: usize) -> Vec<u8> {
    format!("u{n}@{server}").into_bytes()
}

/// The `n`th entry of `server` as the registry's calls take it: the user `user(server,
/// n)`, or in layout `conns` its connection `c<n>`, as the member `c<n> <user>`.
pub fn entry(layout: Layout, server: &ServerId, n: usize) -> Vec<u8> {
    match layout {
        Layout::Conns => registry_janitor::keys::conn_member(&format!("c{n}"), &user(server, n)),
        _ => user(server, n),
    }
}

/// `user` as the registry's calls take it: itself, or in layout `conns` its connection
/// `c`, as the member `c <user>`.
pub fn as_entry(layout: Layout, user: &[u8]) -> Vec<u8> {
    match layout {
        Layout::Conns => registry_janitor::keys::conn_member("c", user),
        _ => user.to_vec(),
    }
}

/// The plain write of `entry`'s forward entry naming `owner` (HSET registry, SET
/// user:<user>, or HSET of the connection's field in layout `conns`).
pub fn forward_write(keys: &Keys, layout: Layout, entry: &[u8], owner: &str) -> redis::Cmd {
    match keys.forward_of_member(layout, entry) {
        Some((key, Some(field))) => redis::cmd("HSET").arg(key).arg(field).arg(owner).to_owned(),
        Some((key, None)) => redis::cmd("SET").arg(key).arg(owner).to_owned(),
        None => panic!("{entry:?} is no entry of layout {layout:?}"),
    }
}

/// What almost every test starts with: a private Redis, settings under a fresh prefix,
/// a connection, the key names and the registry. Fields drop in order: Redis last.
pub struct Fixture {
    pub settings: Settings,
    pub conn: RedisConn,
    pub keys: Keys,
    pub registry: Registry,
    pub redis: RedisServer,
}

impl Fixture {
    pub fn new(layout: Layout) -> Self {
        Self::with(layout, |_| {})
    }

    /// A fixture whose settings `adjust` changes first.
    pub fn with(layout: Layout, adjust: impl FnOnce(&mut Settings)) -> Self {
        Self::on(redis(), layout, adjust)
    }

    /// A fixture on a given server (for example one started with extra arguments).
    pub fn on(redis: RedisServer, layout: Layout, adjust: impl FnOnce(&mut Settings)) -> Self {
        let mut settings = settings(&redis, layout);
        adjust(&mut settings);
        let keys = Keys::for_settings(&settings);
        Fixture {
            conn: connect(&settings),
            registry: Registry::new(keys.clone(), settings.layout),
            keys,
            settings,
            redis,
        }
    }

    pub async fn seed(&self, server: &ServerId, users: usize) {
        seed(&self.registry, &self.conn, server, users).await
    }

    /// Publishes `server.dead` for `server`.
    pub async fn kill(&self, server: &ServerId) -> String {
        kill(&self.conn, &self.keys, server).await
    }

    pub async fn wait_idle(&self) {
        wait_idle(&self.redis, &self.conn, &self.keys).await
    }

    pub async fn still_pointing(&self, server: &ServerId, users: usize) -> usize {
        still_pointing(&self.registry, &self.conn, server, users).await
    }

    pub async fn owner(&self, user: &[u8]) -> Option<String> {
        self.registry.owner(&self.conn, user).await.unwrap()
    }

    /// Moves `user` to `server`, as a reconnect does.
    pub async fn reconnect(&self, user: &[u8], server: &ServerId) {
        self.registry
            .register(&self.conn, user, server)
            .await
            .unwrap()
    }

    pub async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        cmd.query_async(&mut self.conn.clone()).await.unwrap()
    }

    /// Publishes a `server.dead` whose payload is not MessagePack: a worker dead-letters
    /// it. Returns the entry id.
    pub async fn publish_junk(&self) -> String {
        stream::publish(
            &self.conn,
            &self.keys.events(),
            &[(b"type", b"server.dead"), (b"payload", JUNK_PAYLOAD)],
        )
        .await
        .unwrap()
    }

    pub async fn dead_letters(&self) -> Vec<registry_janitor::event::Entry> {
        read_stream(&self.conn, &self.keys.dead_letters()).await
    }
}

/// Registers `users` users on `server` and heartbeats it.
pub async fn seed(registry: &Registry, conn: &RedisConn, server: &ServerId, users: usize) {
    registry.heartbeat(conn, server, 60_000).await.unwrap();
    let ids: Vec<Vec<u8>> = (0..users)
        .map(|n| entry(registry.layout(), server, n))
        .collect();
    registry
        .register_many(conn, ids.iter().map(Vec::as_slice), server, 1000)
        .await
        .unwrap();
}

/// `server` dies: its liveness key is gone (as when its TTL runs out), and monitoring
/// publishes `server.dead` for it; returns the entry id. (A verdict for a server whose
/// liveness key still stands is disputed, which the guard limits: see tests/guard.rs.)
pub async fn kill(conn: &RedisConn, keys: &Keys, server: &ServerId) -> String {
    let _: () = redis::cmd("DEL")
        .arg(keys.server_alive(server))
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let event = ServerDead::new(server, Some("test".into()), Some("test".into()));
    stream::publish_event(conn, keys, &event.encode())
        .await
        .unwrap()
}

/// An in-process worker and what it counted.
pub struct RunningWorker {
    pub stop: CancellationToken,
    pub handle: JoinHandle<registry_janitor::Result<()>>,
    pub metrics: Metrics,
    pub consumer: String,
}

impl RunningWorker {
    /// Waits until the worker holds no entry in hand. An entry is acknowledged before its
    /// handler returns and counts it, so a test that saw the stream idle waits for this
    /// before it reads the worker's counters.
    pub async fn settled(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.metrics.entries_in_hand.get() > 0 {
            assert!(Instant::now() < deadline, "the worker still holds entries");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub async fn stop(self) {
        self.stop.cancel();
        self.handle.await.unwrap().unwrap();
    }
}

pub fn spawn_worker(settings: &Settings) -> RunningWorker {
    let metrics = Metrics::new();
    let mut settings = settings.clone();
    let consumer = settings.consumer_name();
    settings.consumer_name = Some(consumer.clone());
    let stop = CancellationToken::new();
    let (m, token) = (metrics.clone(), stop.clone());
    let handle = tokio::spawn(async move { Worker::new(&settings, m).await?.run(token).await });
    RunningWorker {
        stop,
        handle,
        metrics,
        consumer,
    }
}

/// An in-process reconciler (`Reconciler::run`) and what it counted.
pub struct RunningReconciler {
    pub stop: CancellationToken,
    pub handle: JoinHandle<registry_janitor::Result<()>>,
    pub metrics: Metrics,
}

impl RunningReconciler {
    pub fn start(settings: &Settings) -> Self {
        let metrics = Metrics::new();
        let stop = CancellationToken::new();
        let (s, m, token) = (settings.clone(), metrics.clone(), stop.clone());
        let handle = tokio::spawn(async move {
            registry_janitor::reconcile::Reconciler::new(&s, m)
                .await?
                .run(token)
                .await
        });
        RunningReconciler {
            stop,
            handle,
            metrics,
        }
    }

    pub async fn stop(self) {
        self.stop.cancel();
        self.handle.await.unwrap().unwrap();
    }
}

/// The pending-list row of stream entry `id`: (owner, delivery count), or None once it
/// is acknowledged.
pub async fn pending_row(conn: &RedisConn, keys: &Keys, id: &str) -> Option<(String, u64)> {
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(keys.events())
        .arg(registry_janitor::keys::GROUP)
        .arg(id)
        .arg(id)
        .arg(1)
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    rows.into_iter().next().map(|(_, owner, _, n)| (owner, n))
}

/// Runs a `registry-janitor` command to its end; fails the test with its stderr unless
/// it succeeded. Returns its stdout.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Polls `check` until it returns true; on timeout fails with `what` and the server log.
pub async fn wait_until<F, Fut>(server: &RedisServer, what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        if Instant::now() > deadline {
            panic!(
                "timed out after {timeout:?} waiting for: {what}\n--- redis-server log ---\n{}",
                server.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Waits until every event was delivered and acknowledged.
pub async fn wait_idle(server: &RedisServer, conn: &RedisConn, keys: &Keys) {
    wait_until(
        server,
        "all events acknowledged",
        Duration::from_secs(60),
        || async {
            status::collect_from(conn, keys)
                .await
                .map(|s| s.is_idle())
                .unwrap_or(false)
        },
    )
    .await;
}

/// A new connection to what `settings` name: after a failover or a reshard it learns the
/// topology at once, where a long-lived one may still route to a dead master for a while.
pub async fn fresh_conn(settings: &Settings) -> RedisConn {
    conn::shared_for(&conn::target_for(settings).unwrap())
        .await
        .unwrap()
}

/// Counts `server`'s seeded users (0..users) whose forward entry still names it.
pub async fn still_pointing(
    registry: &Registry,
    conn: &RedisConn,
    server: &ServerId,
    users: usize,
) -> usize {
    let mut n = 0;
    for start in (0..users).step_by(1000) {
        let ids: Vec<Vec<u8>> = (start..users.min(start + 1000))
            .map(|i| entry(registry.layout(), server, i))
            .collect();
        let owners = registry.owners(conn, &ids).await.unwrap();
        n += owners
            .iter()
            .filter(|o| o.as_deref() == Some(server.as_str()))
            .count();
    }
    n
}

/// All entries of a stream as (id, fields) with byte fields.
pub async fn read_stream(conn: &RedisConn, stream: &str) -> Vec<registry_janitor::event::Entry> {
    let reply: redis::Value = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let redis::Value::Array(items) = reply else {
        panic!("XRANGE reply")
    };
    items
        .into_iter()
        .filter_map(|i| stream::parse_entry(i).unwrap())
        .collect()
}

/// The `registry-janitor` binary, configured only through `JANITOR_*` variables.
pub fn janitor(settings: &Settings) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_registry-janitor"));
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("JANITOR_REDIS_URL", &settings.redis_url)
        .env("JANITOR_KEY_PREFIX", &settings.key_prefix)
        .env("JANITOR_LAYOUT", settings.layout.as_str())
        .env("JANITOR_CHUNK_SIZE", settings.chunk_size.to_string())
        .env("JANITOR_BLOCK_MS", settings.block_ms.to_string())
        .env(
            "JANITOR_CLAIM_MIN_IDLE_MS",
            settings.claim_min_idle_ms.to_string(),
        )
        .env("JANITOR_METRICS_ADDR", &settings.metrics_addr)
        .env(
            "JANITOR_MAX_DELIVERIES",
            settings.max_deliveries.to_string(),
        )
        .env(
            "JANITOR_CHUNKS_IN_FLIGHT",
            settings.chunks_in_flight.to_string(),
        )
        .env(
            "JANITOR_DRAIN_TIMEOUT_MS",
            settings.drain_timeout_ms.to_string(),
        )
        .env(
            "JANITOR_GUARD_DISPUTED_LIMIT",
            settings.guard_disputed_limit.to_string(),
        )
        .env(
            "JANITOR_GUARD_HOLD_GRACE_MS",
            settings.guard_hold_grace_ms.to_string(),
        )
        .env("RUST_LOG", "info");
    cmd
}

/// A worker process, its log in a temporary file; killed on drop if still running.
pub struct WorkerProcess {
    pub child: Child,
    log: tempfile::NamedTempFile,
}

impl WorkerProcess {
    pub fn start(settings: &Settings) -> Self {
        Self::start_with(settings, &[])
    }

    /// A worker with extra `JANITOR_*` variables on top of `settings`.
    pub fn start_with(settings: &Settings, env: &[(&str, &str)]) -> Self {
        Self::start_command(settings, env, &["worker"])
    }

    /// `registry-janitor <args>` (for example `reconcile`), with extra `JANITOR_*`
    /// variables on top of `settings`.
    pub fn start_command(settings: &Settings, env: &[(&str, &str)], args: &[&str]) -> Self {
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = janitor(settings)
            .envs(env.iter().copied())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap();
        WorkerProcess { child, log }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([format!("-{sig}"), self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    /// Waits for exit up to `timeout`; returns the status and what it logged.
    pub fn wait(mut self, timeout: Duration) -> (Option<std::process::ExitStatus>, String) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        (status, self.log())
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback address with a port that was free a moment ago.
pub fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// A plain HTTP/1.0 GET (so that the body is never chunked); returns the status code and
/// the body ("" when not reachable).
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    if write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").is_err() {
        return (0, String::new());
    }
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// Events a worker handled with `outcome`, as its /metrics text says
/// (`registry_janitor_events_total{outcome=...}`; 0 before the first).
pub fn events_with(metrics: &Metrics, outcome: &str) -> u64 {
    counter_of(
        metrics,
        &format!("registry_janitor_events_total{{outcome=\"{outcome}\"}}"),
    )
}

/// One counter of a process's metrics, as its /metrics text says (0 before the first).
pub fn counter_of(metrics: &Metrics, series: &str) -> u64 {
    sample(&metrics.render(), series).unwrap_or(0.0) as u64
}

pub use registry_janitor_testkit::sample;

/// Waits until the cleanup of `server` has walked at least `members` members.
pub async fn wait_walked(
    redis: &RedisServer,
    conn: &RedisConn,
    keys: &Keys,
    server: &ServerId,
    members: u64,
) {
    let cleaner = registry_janitor::cleanup::Cleaner::new(keys.clone(), Layout::Hash, 1, 1);
    wait_until(
        redis,
        "the walk under way",
        Duration::from_secs(30),
        || async {
            cleaner
                .progress(conn, server)
                .await
                .ok()
                .flatten()
                .is_some_and(|n| n >= members)
        },
    )
    .await;
}

/// True while the stream entry `id` is pending (delivered, not acknowledged).
pub async fn is_pending(conn: &RedisConn, keys: &Keys, id: &str) -> bool {
    pending_row(conn, keys, id).await.is_some()
}

/// Plays a zombie `server`: registers new users on it, one by one, until the event `id`
/// is acknowledged. Returns the users whose registration finished while `id` was still
/// pending (the last one, which may have raced the acknowledgement, is left out).
pub async fn register_until_acked(
    registry: &Registry,
    conn: &RedisConn,
    keys: &Keys,
    server: &ServerId,
    id: &str,
) -> Vec<Vec<u8>> {
    let mut before_ack = Vec::new();
    for n in 0.. {
        let u = match registry.layout() {
            Layout::Conns => {
                registry_janitor::keys::conn_member("late", format!("late-{n}").as_bytes())
            }
            _ => format!("late-{n}").into_bytes(),
        };
        // The original protocol (no fence check): its late writes are cleaned before the
        // acknowledgement, though the writer is never told.
        registry.register_legacy(conn, &u, server).await.unwrap();
        if !is_pending(conn, keys, id).await {
            return before_ack;
        }
        before_ack.push(u);
        assert!(n < 1_000_000, "the cleanup never finished");
    }
    unreachable!()
}

/// Asserts that none of `users` (registered during a walk) still points at `server`.
pub async fn assert_none_point_at(
    registry: &Registry,
    conn: &RedisConn,
    users: &[Vec<u8>],
    server: &ServerId,
    at_least: usize,
) {
    assert!(
        users.len() >= at_least,
        "only {} registrations raced the walk: the test proves little",
        users.len()
    );
    let owners = registry.owners(conn, users).await.unwrap();
    let stale = owners
        .iter()
        .filter(|o| o.as_deref() == Some(server.as_str()))
        .count();
    assert_eq!(
        stale,
        0,
        "{stale} of {} users registered during the walk still point at the dead server",
        users.len()
    );
}

/// What a connection server saw of its heartbeats until one was refused as FENCED: when
/// each one started (unix ms; the refused one last), and when the refusal came back.
#[derive(Debug)]
pub struct Heartbeats {
    pub started: Vec<u64>,
    pub told_at: u64,
}

impl Heartbeats {
    /// Asserts that the server was told at its first heartbeat after `verdict` (the
    /// fence's `fenced_at_ms`): every heartbeat taken started before the verdict, and the
    /// refused one came back after it. (It may have *started* before: a heartbeat in
    /// flight when the fence is recorded is refused, so a start-time check would flake on
    /// a busy machine.)
    pub fn assert_told_at_the_first_after(&self, verdict: u64) {
        assert!(self.told_at >= verdict, "{self:?} {verdict}");
        let taken = &self.started[..self.started.len() - 1];
        assert!(
            taken.last().is_some_and(|&t| t <= verdict),
            "a heartbeat started after the verdict ({verdict}) was taken: {self:?}"
        );
    }
}

/// Plays a connection server that heartbeats `server` every `interval` until a heartbeat
/// is refused with `Error::Fenced` (any other error fails the test).
pub fn heartbeat_until_fenced(
    registry: &Registry,
    conn: &RedisConn,
    server: &ServerId,
    interval: Duration,
) -> JoinHandle<Heartbeats> {
    let (registry, conn, server) = (registry.clone(), conn.clone(), server.clone());
    tokio::spawn(async move {
        let mut started = Vec::new();
        loop {
            started.push(registry_janitor::now_ms());
            match registry.heartbeat(&conn, &server, 60_000).await {
                Ok(()) => {}
                Err(registry_janitor::error::Error::Fenced { server: named }) => {
                    assert_eq!(named, server.as_str());
                    let told_at = registry_janitor::now_ms();
                    return Heartbeats { started, told_at };
                }
                Err(e) => panic!("heartbeat failed: {e}"),
            }
            tokio::time::sleep(interval).await;
        }
    })
}

/// A reconnect that also tells what it replaced: the user's forward entry is set to `to`
/// (and the user joins `to`'s reverse set) atomically with reading the previous owner.
/// The oracle of the evictions tests: a previous owner of `None` means the janitor had
/// deleted the entry (so it must announce the user), the dead server means the entry was
/// still there (kept: it must never announce the user).
pub async fn reconnect_telling(
    conn: &RedisConn,
    keys: &Keys,
    layout: Layout,
    user: &[u8],
    to: &ServerId,
) -> Option<String> {
    static MOVE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
        redis::Script::new(
            r"
            local old
            if ARGV[3] == 'hash' then
              old = redis.call('HGET', KEYS[1], ARGV[1])
              redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
            elseif ARGV[3] == 'conns' then
              local at = string.find(ARGV[1], ' ', 1, true)
              local connection = string.sub(ARGV[1], 1, at - 1)
              old = redis.call('HGET', KEYS[1], connection)
              redis.call('HSET', KEYS[1], connection, ARGV[2])
            else
              old = redis.call('GET', KEYS[1])
              redis.call('SET', KEYS[1], ARGV[2])
            end
            redis.call('SADD', KEYS[2], ARGV[1])
            return old",
        )
    });
    let forward = keys
        .forward_of_member(layout, user)
        .expect("a member of the layout")
        .0;
    let mut call = MOVE.prepare_invoke();
    call.key(forward)
        .key(keys.server_users(to))
        .arg(user)
        .arg(to.as_str())
        .arg(layout.as_str());
    call.invoke_async(&mut conn.clone()).await.unwrap()
}

/// Every `users.evicted` of the evictions stream: (server_id, user) in stream order,
/// duplicates kept; and the `server.cleaned` entries.
pub async fn evictions(
    f: &Fixture,
) -> (
    Vec<(String, Vec<u8>)>,
    Vec<registry_janitor::evictions::Eviction>,
) {
    evictions_of(&f.conn, &f.keys).await
}

/// [`evictions`] of any connection (a cluster's too).
pub async fn evictions_of(
    conn: &RedisConn,
    keys: &Keys,
) -> (
    Vec<(String, Vec<u8>)>,
    Vec<registry_janitor::evictions::Eviction>,
) {
    use registry_janitor::evictions::Eviction;
    let (mut evicted, mut cleaned) = (Vec::new(), Vec::new());
    for (id, entry) in registry_janitor::evictions::read_all(conn, keys)
        .await
        .unwrap()
    {
        match entry {
            Some(Eviction::Evicted {
                server_id, users, ..
            }) => {
                assert!(
                    users.len() <= registry_janitor::evictions::MAX_USERS_PER_ENTRY,
                    "{id}: {} users in one entry",
                    users.len()
                );
                evicted.extend(users.into_iter().map(|u| (server_id.clone(), u)));
            }
            // Layout conns: each pair as the member `<connection> <user>`.
            Some(Eviction::ConnectionsEvicted {
                server_id,
                connections,
                ..
            }) => {
                assert!(
                    connections.len() <= registry_janitor::evictions::MAX_USERS_PER_ENTRY,
                    "{id}: {} connections in one entry",
                    connections.len()
                );
                evicted.extend(connections.into_iter().map(|(u, c)| {
                    (
                        server_id.clone(),
                        registry_janitor::keys::conn_member(&c, &u),
                    )
                }));
            }
            Some(c @ Eviction::Cleaned { .. }) => cleaned.push(c),
            None => panic!("entry {id} of the evictions stream does not decode"),
        }
    }
    (evicted, cleaned)
}

/// Asserts that the users announced as evicted from `server` are exactly `expected`, each
/// once (the single-node guarantee).
pub fn assert_announced_exactly_once(
    announced: &[(String, Vec<u8>)],
    server: &ServerId,
    expected: &std::collections::HashSet<Vec<u8>>,
) {
    let mut seen = std::collections::HashMap::<&[u8], usize>::new();
    for (s, u) in announced {
        if s == server.as_str() {
            *seen.entry(u).or_default() += 1;
        }
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).take(5).collect();
    assert!(
        twice.is_empty(),
        "{server}: announced more than once: {twice:?}"
    );
    let missing = expected
        .iter()
        .filter(|u| !seen.contains_key(u.as_slice()))
        .count();
    let extra = seen.keys().filter(|u| !expected.contains(**u)).count();
    assert_eq!(
        (missing, extra),
        (0, 0),
        "{server}: {missing} deleted users never announced, {extra} announced users \
         whose entry was not deleted ({} expected, {} announced)",
        expected.len(),
        seen.len()
    );
}

/// Layout `conns`: users with several connections on several servers, the way phones,
/// laptops and tabs spread. Built on the users `seed` put on `dead` (`user(dead, n)`,
/// each with its connection `c<n>` there); the first `with_more` of them get more
/// connections, by `n % 4`:
///
/// | n % 4 | besides `c<n>` on `dead` | after `dead`'s cleanup |
/// |---|---|---|
/// | 0 | nothing | no key |
/// | 1 | `d<n>` on `dead` | no key |
/// | 2 | `p<n>` on `live[0]` | `p<n>` |
/// | 3 | `d<n>` on `dead`, `p<n>` on `live[0]`, `t<n>` on `live[1]` | `p<n>`, `t<n>` |
///
/// The oracle of the conns variants: [`Devices::assert_end_state`] checks every user's
/// Hash against it.
pub struct Devices {
    pub dead: ServerId,
    /// Every user's connections as seeded: (connection id, server), sorted.
    pub by_user: std::collections::BTreeMap<Vec<u8>, Vec<(String, ServerId)>>,
}

impl Devices {
    /// Registers the connections of the table above (the servers in `live` heartbeat
    /// for 10 minutes, so that lookups route to them however long the test runs).
    pub async fn add(
        registry: &Registry,
        conn: &RedisConn,
        dead: &ServerId,
        live: [&ServerId; 2],
        users: usize,
        with_more: usize,
    ) -> Self {
        assert_eq!(registry.layout(), Layout::Conns);
        for s in live {
            registry.heartbeat(conn, s, 600_000).await.unwrap();
        }
        let mut by_user = std::collections::BTreeMap::new();
        let mut on: std::collections::HashMap<&ServerId, Vec<Vec<u8>>> = Default::default();
        for n in 0..users {
            let mut connections = vec![(format!("c{n}"), dead.clone())];
            if n < with_more {
                let more: &[(&str, &ServerId)] = match n % 4 {
                    0 => &[],
                    1 => &[("d", dead)],
                    2 => &[("p", live[0])],
                    _ => &[("d", dead), ("p", live[0]), ("t", live[1])],
                };
                for (kind, s) in more {
                    let id = format!("{kind}{n}");
                    let member = registry_janitor::keys::conn_member(&id, &user(dead, n));
                    on.entry(*s).or_default().push(member);
                    connections.push((id, (*s).clone()));
                }
            }
            connections.sort();
            by_user.insert(user(dead, n), connections);
        }
        for (s, members) in &on {
            registry
                .register_many(conn, members.iter().map(Vec::as_slice), s, 1000)
                .await
                .unwrap();
        }
        let devices = Devices {
            dead: dead.clone(),
            by_user,
        };
        // The registry holds what the oracle says (one user of each kind).
        for n in 0..with_more.min(users).min(4) {
            let u = user(dead, n);
            let as_seeded: Vec<(String, String)> = devices.by_user[&u]
                .iter()
                .map(|(c, s)| (c.clone(), s.as_str().to_owned()))
                .collect();
            assert_eq!(registry.connections(conn, &u).await.unwrap(), as_seeded);
        }
        devices
    }

    /// The members `<connection> <user>` of every connection seeded on the dead server.
    pub fn dead_members(&self) -> Vec<Vec<u8>> {
        self.by_user
            .iter()
            .flat_map(|(u, cs)| {
                cs.iter()
                    .filter(|(_, s)| s == &self.dead)
                    .map(|(c, _)| registry_janitor::keys::conn_member(c, u))
            })
            .collect()
    }

    /// The live servers of `user`'s connections (what `route_user` returns while the dead
    /// server is fenced or past its liveness, when nothing moved), sorted.
    pub fn live_servers_of(&self, user: &[u8]) -> Vec<String> {
        let mut servers: Vec<String> = self.by_user[user]
            .iter()
            .filter(|(_, s)| s != &self.dead)
            .map(|(_, s)| s.as_str().to_owned())
            .collect();
        servers.sort();
        servers.dedup();
        servers
    }

    /// Asserts every user's Hash after the dead server's cleanup: exactly the connections
    /// that were not on the dead server, plus those in `moved` (members that reconnected,
    /// with their new server). So no connection names the dead server, no live one is
    /// lost, and a user whose every connection was on the dead server has no key (Redis
    /// deletes a Hash with its last field: an empty `HGETALL` is no key).
    pub async fn assert_end_state(
        &self,
        registry: &Registry,
        conn: &RedisConn,
        moved: &[(Vec<u8>, ServerId)],
    ) {
        let moved: std::collections::HashMap<&[u8], &ServerId> =
            moved.iter().map(|(m, s)| (m.as_slice(), s)).collect();
        let users: Vec<&Vec<u8>> = self.by_user.keys().collect();
        let (mut stale, mut lost, mut keys_left, mut wrong) = (0, 0, 0, Vec::new());
        for batch in users.chunks(200) {
            let got =
                futures_util::future::join_all(batch.iter().map(|u| registry.connections(conn, u)))
                    .await;
            for (u, got) in batch.iter().zip(got) {
                let got: Vec<(String, String)> = got.unwrap();
                let mut expected: Vec<(String, String)> = self.by_user[*u]
                    .iter()
                    .filter_map(|(c, s)| {
                        let member = registry_janitor::keys::conn_member(c, u);
                        match moved.get(member.as_slice()) {
                            Some(to) => Some((c.clone(), to.as_str().to_owned())),
                            None => (s != &self.dead).then(|| (c.clone(), s.as_str().to_owned())),
                        }
                    })
                    .collect();
                expected.sort();
                if got == expected {
                    continue;
                }
                stale += got.iter().filter(|(_, s)| s == self.dead.as_str()).count();
                lost += expected.iter().filter(|e| !got.contains(e)).count();
                keys_left += usize::from(expected.is_empty());
                if wrong.len() < 5 {
                    wrong.push(format!(
                        "{}: {got:?}, expected {expected:?}",
                        String::from_utf8_lossy(u)
                    ));
                }
            }
        }
        assert!(
            wrong.is_empty(),
            "{stale} connections still name {}, {lost} live connections lost, {keys_left} \
             users of the dead server alone still have a key; for example:\n{}",
            self.dead,
            wrong.join("\n")
        );
    }
}

/// Every connection of layout `conns` on the Redis nodes at `urls` (one node, or every
/// master of a cluster) whose field names `server`, as (user Hash key, connection id):
/// a scan of every user's Hash, not only the users a test seeded.
pub async fn connections_naming(
    urls: &[String],
    keys: &Keys,
    server: &ServerId,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut naming = Vec::new();
    for url in urls {
        let mut c = redis::Client::open(url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let mut cursor = 0u64;
        loop {
            let (next, found): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(keys.user_conns_pattern())
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut c)
                .await
                .unwrap();
            if !found.is_empty() {
                let mut pipe = redis::pipe();
                for key in &found {
                    pipe.hgetall(key);
                }
                let all: Vec<Vec<(Vec<u8>, String)>> = pipe.query_async(&mut c).await.unwrap();
                for (key, fields) in found.iter().zip(all) {
                    naming.extend(
                        fields
                            .into_iter()
                            .filter(|(_, s)| s == server.as_str())
                            .map(|(field, _)| (key.clone(), field)),
                    );
                }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    naming
}
