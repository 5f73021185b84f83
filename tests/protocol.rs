//! The connection-server protocol from another language: examples/connection_server.py
//! (Python, redis-py, loading protocol/*.lua) runs as a real process against a private
//! redis-server, and the Rust side checks what it wrote, that its routing agrees with
//! [`Registry::route`], and that a real worker's fence reaches it at its next heartbeat.
//!
//! examples/evictions_consumer.py (redis-py, msgpack) keeps a presence index in step with
//! the evictions stream that a real worker writes.
//!
//! Needs python3 (3.11+) with the `redis` and `msgpack` modules (`PYTHON` names another interpreter).
//! Without them the tests are skipped with a message, unless `CI` is set: then they fail.

mod common;

use std::{collections::HashMap, process::Stdio, time::Duration};

use common::*;
use registry_janitor::{config::Layout, event::ServerId, fence};
use tokio::{
    io::{AsyncBufReadExt, BufReader, Lines},
    process::{Child, ChildStdout, Command},
};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/connection_server.py");

/// The Python server's heartbeat interval.
const HEARTBEAT_MS: i64 = 100;
/// How much later than one heartbeat interval after the fence the Python server may
/// notice it: room for a busy machine (tests run in parallel), not a tolerance of the
/// protocol, which refuses the very next heartbeat.
const SLACK_MS: i64 = 2_000;

/// The Python interpreter, if it has the `redis` module; otherwise None (the test is
/// skipped), or a panic when `CI` is set.
fn python() -> Option<String> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let usable = std::process::Command::new(&python)
        .args([
            "-c",
            "import sys, redis, msgpack; sys.exit(sys.version_info < (3, 11))",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if usable {
        return Some(python);
    }
    let why = format!(
        "{python} (3.11+) with the redis and msgpack modules is needed to run examples/*.py \
         (python3 -m pip install 'redis>=5,<7' 'msgpack>=1,<2'; or set PYTHON to an \
         interpreter that has them)"
    );
    cannot_run(&why);
    None
}

/// `connection_server.py` with the fixture's Redis, key prefix and layout.
fn example(python: &str, f: &Fixture) -> Command {
    let mut cmd = Command::new(python);
    cmd.arg(SCRIPT)
        .args(["--redis-url", &f.redis.url()])
        .args(["--key-prefix", &f.settings.key_prefix])
        .args(["--layout", f.settings.layout.as_str()])
        .stdin(Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// `connection_server.py route <user>`: the owner it prints, or None for `none`.
async fn python_route(python: &str, f: &Fixture, user: &str) -> Option<String> {
    let out = example(python, f)
        .args(["route", user])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "route {user}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(stdout.trim().to_owned()).filter(|o| o != "none")
}

/// Routes `user` from Python and from Rust, asserts they agree, returns the answer.
async fn both_route(python: &str, f: &Fixture, user: &str) -> Option<String> {
    let from_python = python_route(python, f, user).await;
    let from_rust = f.registry.route(&f.conn, user.as_bytes()).await.unwrap();
    assert_eq!(from_python, from_rust, "route of {user}: Python vs Rust");
    from_rust
}

/// `connection_server.py run ...`: one JSON line on stdout per event, its log in a file.
struct PythonServer {
    child: Child,
    events: Lines<BufReader<ChildStdout>>,
    log: tempfile::NamedTempFile,
}

impl PythonServer {
    fn start(python: &str, f: &Fixture, args: &[&str]) -> Self {
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut child = example(python, f)
            .arg("run")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap();
        let events = BufReader::new(child.stdout.take().unwrap()).lines();
        PythonServer { child, events, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// The next event, which must be `kind`.
    async fn next(&mut self, kind: &str) -> serde_json::Value {
        let line = tokio::time::timeout(Duration::from_secs(30), self.events.next_line())
            .await
            .unwrap_or_else(|_| panic!("no `{kind}` from Python in 30 s; its log:\n{}", self.log()))
            .unwrap()
            .unwrap_or_else(|| panic!("Python exited before `{kind}`; its log:\n{}", self.log()));
        let event: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(event["event"], kind, "{line}\n{}", self.log());
        event
    }
}

/// connection_server.py as `old` with `users` users, `leaving` of them disconnected
/// again, heartbeating until it is fenced.
fn until_fenced(
    python: &str,
    f: &Fixture,
    old: &ServerId,
    users: usize,
    leaving: usize,
) -> PythonServer {
    PythonServer::start(
        python,
        f,
        &[
            "--server-id",
            old.as_str(),
            "--users",
            &users.to_string(),
            "--disconnect",
            &leaving.to_string(),
            "--heartbeat-ms",
            &HEARTBEAT_MS.to_string(),
            // A long TTL: a stalled heartbeat on a busy machine must not change a route
            // between the Python and the Rust lookup.
            "--ttl-ms",
            "60000",
            "--until-fenced",
        ],
    )
}

async fn python_server_is_fenced_and_comes_back(layout: Layout) {
    let Some(python) = python() else { return };
    let f = Fixture::new(layout);
    let (users, leaving) = (50, 5);
    let old = server("gw-py#1");
    let mut py = until_fenced(&python, &f, &old, users, leaving);
    py.next("ready").await;

    // What Python registered is what the Rust side reads.
    let staying = users - leaving;
    assert_eq!(f.still_pointing(&old, staying).await, staying);
    for n in staying..users {
        assert_eq!(f.owner(&user(&old, n)).await, None, "u{n} disconnected");
    }
    let members: usize = f
        .query(redis::cmd("SCARD").arg(f.keys.server_users(&old)))
        .await;
    assert_eq!(members, staying);

    // Routing agrees, for a live owner, a user who left, and a user never seen...
    let name = |n| String::from_utf8(user(&old, n)).unwrap();
    assert_eq!(
        both_route(&python, &f, &name(0)).await.as_deref(),
        Some(old.as_str())
    );
    assert_eq!(both_route(&python, &f, &name(users - 1)).await, None);
    assert_eq!(both_route(&python, &f, "nobody").await, None);
    // ...for an owner past its liveness (its entry stays: the reconciler decides)...
    let lapsed = server("gw-lapsed#1");
    f.registry.heartbeat(&f.conn, &lapsed, 1).await.unwrap();
    f.registry
        .register(&f.conn, b"on-lapsed", &lapsed)
        .await
        .unwrap();
    wait_until(
        &f.redis,
        "the liveness key lapsed",
        Duration::from_secs(10),
        || async {
            !f.query::<bool>(redis::cmd("EXISTS").arg(f.keys.server_alive(&lapsed)))
                .await
        },
    )
    .await;
    assert_eq!(both_route(&python, &f, "on-lapsed").await, None);
    assert_eq!(
        f.owner(b"on-lapsed").await.as_deref(),
        Some(lapsed.as_str())
    );
    // ...and for a fenced owner, whose entry either side deletes.
    let fenced = server("gw-fenced#1");
    f.registry
        .heartbeat(&f.conn, &fenced, 60_000)
        .await
        .unwrap();
    for u in ["on-fenced-a", "on-fenced-b"] {
        f.registry
            .register(&f.conn, u.as_bytes(), &fenced)
            .await
            .unwrap();
    }
    fence::record(&f.conn, &f.keys, &fenced, None, 60_000)
        .await
        .unwrap();
    assert_eq!(python_route(&python, &f, "on-fenced-a").await, None);
    assert_eq!(
        f.registry.route(&f.conn, b"on-fenced-b").await.unwrap(),
        None
    );
    // Route only reads: the entries are the janitor's to delete, and to announce.
    for u in ["on-fenced-a", "on-fenced-b"] {
        assert_eq!(
            f.owner(u.as_bytes()).await.as_deref(),
            Some(fenced.as_str()),
            "{u}"
        );
    }

    // A real worker takes server.dead for the Python server: fence first, then clean.
    let worker = spawn_worker(&f.settings);
    let entry = f.kill(&old).await;
    let report = py.next("fenced").await;
    f.wait_idle().await;
    worker.stop().await;
    let status = tokio::time::timeout(Duration::from_secs(10), py.child.wait())
        .await
        .expect("Python exits once fenced")
        .unwrap();
    assert!(status.success(), "{status}; its log:\n{}", py.log());
    assert!(
        py.log().contains("closing all its client sockets"),
        "{}",
        py.log()
    );

    let verdict: HashMap<String, String> = f
        .query(redis::cmd("HGETALL").arg(f.keys.server_fence(&old)))
        .await;
    assert_eq!(verdict.get("entry"), Some(&entry), "{verdict:?}");
    let fenced_at: i64 = verdict["fenced_at_ms"].parse().unwrap();
    let detected_at = report["detected_at_ms"].as_i64().unwrap();
    let lag = detected_at - fenced_at;
    println!("Python noticed the fence {lag} ms after it was recorded");
    assert!(
        lag <= HEARTBEAT_MS + SLACK_MS,
        "Python noticed the fence {lag} ms after it was recorded (heartbeat every \
         {HEARTBEAT_MS} ms): {report}"
    );
    assert_eq!(report["fenced_at_ms"].as_i64(), Some(fenced_at), "{report}");
    assert_eq!(report["fenced_after_ms"].as_i64(), Some(lag), "{report}");
    // It learnt at its first refused heartbeat and wrote nothing more as the old id.
    let notes: std::collections::HashMap<String, String> = f
        .query(redis::cmd("HGETALL").arg(f.keys.server_refusals(&old)))
        .await;
    assert_eq!(
        notes.get("heartbeat").map(String::as_str),
        Some("1"),
        "{notes:?}"
    );
    assert!(!notes.contains_key("register"), "{notes:?}");

    // Nothing points at the old id, and it is no longer a known server.
    assert_eq!(f.still_pointing(&old, users).await, 0);
    assert_eq!(both_route(&python, &f, &name(0)).await, None);
    let score: Option<f64> = f
        .query(redis::cmd("ZSCORE").arg(f.keys.servers()).arg(old.as_str()))
        .await;
    assert_eq!(
        score, None,
        "a refused heartbeat must not bring the old id back"
    );

    // It came back under a new id: alive, known, not fenced.
    let new = ServerId::parse(report["new_server_id"].as_str().unwrap()).unwrap();
    assert_ne!(new, old);
    assert!(new.as_str().starts_with("gw-py#"), "{new}");
    assert!(!fence::is_fenced(&f.conn, &f.keys, &new).await.unwrap());
    let alive: bool = f
        .query(redis::cmd("EXISTS").arg(f.keys.server_alive(&new)))
        .await;
    let score: Option<f64> = f
        .query(redis::cmd("ZSCORE").arg(f.keys.servers()).arg(new.as_str()))
        .await;
    assert!(alive && score.is_some(), "the new incarnation heartbeats");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_server_is_fenced_and_comes_back_hash_layout() {
    python_server_is_fenced_and_comes_back(Layout::Hash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_server_is_fenced_and_comes_back_keys_layout() {
    python_server_is_fenced_and_comes_back(Layout::Keys).await;
}

const CONSUMER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/examples/evictions_consumer.py"
);

/// examples/evictions_consumer.py (docs/specification.md, "The evictions stream"), run as a real
/// process after a real worker cleaned a dead server: the dead server's users leave
/// `presence:online` and their rooms; a user who came back after the eviction and the live
/// server's users stay; everything read is acknowledged; a second run finds nothing to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_evictions_consumer_keeps_presence_in_step() {
    let Some(python) = python() else { return };
    for layout in [Layout::Hash, Layout::Keys, Layout::Conns] {
        let f = Fixture::new(layout);
        let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
        const USERS: usize = 2_500;
        f.seed(&dead, USERS).await;
        f.seed(&live, 100).await;
        // What the presence service holds: every user online, each in two rooms.
        let mut pipe = redis::pipe();
        for (s, n) in [(&dead, USERS), (&live, 100)] {
            for i in 0..n {
                let u = user(s, i);
                pipe.zadd("presence:online", &u, 1).ignore();
                for room in [format!("r{}", i % 10), "lobby".to_owned()] {
                    pipe.sadd(format!("room:{room}:members"), &u).ignore();
                    let mut key = b"presence:rooms:".to_vec();
                    key.extend_from_slice(&u);
                    pipe.sadd(key, room).ignore();
                }
            }
        }
        let () = pipe.query_async(&mut f.conn.clone()).await.unwrap();
        let worker = spawn_worker(&f.settings);
        f.kill(&dead).await;
        f.wait_idle().await;
        worker.stop().await;
        // One user comes back after the eviction: the consumer must leave them online.
        // (Layout conns: the user's connection `c3` comes back, on the live server.)
        let back = user(&dead, 3);
        f.reconnect(&entry(layout, &dead, 3), &live).await;

        let run = || {
            let mut cmd = std::process::Command::new(&python);
            cmd.arg(CONSUMER)
                .args(["--redis-url", &f.redis.url()])
                .args(["--key-prefix", &f.settings.key_prefix])
                .args(["--layout", layout.as_str(), "--once"]);
            let out = cmd.output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
        };
        let summary = run();
        assert_eq!(summary["evicted"], USERS - 1, "{layout:?}: {summary}");
        assert_eq!(summary["skipped_back"], 1, "{layout:?}: {summary}");
        assert_eq!(summary["cleaned"], 1, "{layout:?}: {summary}");

        let online: Vec<Vec<u8>> = f
            .query(redis::cmd("ZRANGE").arg("presence:online").arg(0).arg(-1))
            .await;
        let mut expected: Vec<Vec<u8>> = (0..100).map(|i| user(&live, i)).collect();
        expected.push(back.clone());
        let (mut online, mut expected) = (online, expected);
        online.sort();
        expected.sort();
        assert_eq!(online, expected, "{layout:?}");
        let lobby: Vec<Vec<u8>> = f
            .query(redis::cmd("SMEMBERS").arg("room:lobby:members"))
            .await;
        let mut lobby = lobby;
        lobby.sort();
        assert_eq!(
            lobby, expected,
            "{layout:?}: the lobby keeps exactly who is online"
        );
        let pending: (u64, Option<String>, Option<String>, redis::Value) = f
            .query(
                redis::cmd("XPENDING")
                    .arg(f.keys.evictions().unwrap())
                    .arg("presence"),
            )
            .await;
        assert_eq!(pending.0, 0, "{layout:?}: everything read was acknowledged");
        // Idempotent and caught up: a second run has nothing to do.
        assert_eq!(run()["entries"], 0, "{layout:?}");
    }
}

/// Layout conns from Python: what connection_server.py registers (one connection `c<n>`
/// per user) is what the Rust side reads; its `route` (route_user.lua) agrees with Rust's
/// `route_user`, for a user with connections on two servers, on a fenced one and on none;
/// once a worker takes server.dead for it, Python is fenced, its connections are gone and
/// no user Hash is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_server_in_layout_conns() {
    let Some(python) = python() else { return };
    let f = Fixture::new(Layout::Conns);
    let (users, leaving) = (20, 4);
    let old = server("gw-py#1");
    let mut py = until_fenced(&python, &f, &old, users, leaving);
    py.next("ready").await;
    let staying = users - leaving;
    assert_eq!(f.still_pointing(&old, staying).await, staying);
    for n in staying..users {
        let gone: i64 = f
            .query(redis::cmd("EXISTS").arg(f.keys.user_conns(&user(&old, n))))
            .await;
        assert_eq!(gone, 0, "u{n} disconnected its only connection");
    }
    // A second connection of user 0 on another (Rust) server; routes agree.
    let other = server("gw-rs#1");
    f.registry.heartbeat(&f.conn, &other, 60_000).await.unwrap();
    let u0 = user(&old, 0);
    f.registry
        .register_connection(&f.conn, &u0, "laptop", &other)
        .await
        .unwrap();
    let both = |u: Vec<u8>| {
        let (python, f) = (python.clone(), &f);
        async move {
            let name = String::from_utf8(u.clone()).unwrap();
            let out = example(&python, f)
                .args(["route", &name])
                .output()
                .await
                .unwrap();
            assert!(out.status.success());
            let printed = String::from_utf8(out.stdout).unwrap();
            let from_python: Vec<String> = match printed.trim() {
                "none" => Vec::new(),
                line => line.split(' ').map(str::to_owned).collect(),
            };
            let from_rust = f.registry.route_user(&f.conn, &u).await.unwrap();
            assert_eq!(from_python, from_rust, "route of {name}: Python vs Rust");
            from_rust
        }
    };
    assert_eq!(both(u0.clone()).await, vec!["gw-py#1", "gw-rs#1"]);
    assert_eq!(both(b"nobody".to_vec()).await, Vec::<String>::new());

    let worker = spawn_worker(&f.settings);
    f.kill(&old).await;
    py.next("fenced").await;
    f.wait_idle().await;
    worker.stop().await;
    let status = tokio::time::timeout(Duration::from_secs(10), py.child.wait())
        .await
        .expect("Python exits once fenced")
        .unwrap();
    assert!(status.success(), "{status}; its log:\n{}", py.log());
    assert_eq!(f.still_pointing(&old, users).await, 0);
    assert_eq!(both(u0.clone()).await, vec!["gw-rs#1"]);
    let left: Vec<Vec<u8>> = f
        .query(redis::cmd("KEYS").arg(f.keys.user_conns_pattern()))
        .await;
    assert_eq!(
        left,
        vec![f.keys.user_conns(&u0)],
        "only user 0's laptop is left"
    );
}
