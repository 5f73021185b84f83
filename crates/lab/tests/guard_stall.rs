//! A whole machine paused: Redis, the connection servers, the worker and the reconciler
//! all stopped together (SIGSTOP) for longer than the grace, then resumed. Nobody could
//! heartbeat, so every liveness key expired; yet no call failed, no reply was slow and no
//! clock stepped, so only the reconciler's own stall shows that nobody watched Redis
//! meanwhile. No live server may be declared dead, fenced or lose an entry; the server
//! that crashed just before the pause is still found, a full grace after the reconciler
//! ran again.
//!
//! The connection servers are `registry-janitor-lab heartbeats`, a process of their own
//! so that they can be paused with the rest; the worker and the reconciler are the lab's
//! `worker` and `reconcile`, the service's code.

mod common;

use std::{
    collections::BTreeSet,
    fs::File,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::*;
use registry_janitor::{
    config::{Layout, Settings},
    conn::{self, RedisConn},
    event::{ServerDead, ServerId},
    keys::Keys,
    registry::Registry,
};
use registry_janitor_testkit::{wait_for, RedisServer};

const GRACE_MS: u64 = 2_000;
const LIVE: usize = 20;
const USERS: usize = 50;

fn live_servers() -> Vec<String> {
    (0..LIVE).map(|n| format!("gw-live-{n}#1")).collect()
}

fn user(server: &str, n: usize) -> Vec<u8> {
    format!("u{n}@{server}").into_bytes()
}

/// A child process, its output in a file of its own.
struct Proc {
    child: Child,
    out: tempfile::NamedTempFile,
}

impl Proc {
    fn start(mut cmd: Command) -> Proc {
        let out = tempfile::NamedTempFile::new().unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(File::create(out.path()).unwrap())
            .stderr(File::create(out.path().with_extension("err")).unwrap())
            .spawn()
            .unwrap();
        Proc { child, out }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal}");
    }

    /// What it printed on stdout, and on stderr (its log).
    fn output(&self) -> (String, String) {
        let read = |p: &std::path::Path| std::fs::read_to_string(p).unwrap_or_default();
        (
            read(self.out.path()),
            read(&self.out.path().with_extension("err")),
        )
    }

    fn stop(mut self) -> (String, String) {
        self.signal("CONT");
        self.signal("TERM");
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.wait();
        let out = self.output();
        let _ = std::fs::remove_file(self.out.path().with_extension("err"));
        out
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(self.out.path().with_extension("err"));
    }
}

/// The lab, with the guard's timings: a grace of 2 s, a pass every 500 ms.
fn janitor(settings: &Settings, command: &str) -> Command {
    let mut cmd = lab(settings);
    cmd.env("JANITOR_HEARTBEAT_GRACE_MS", GRACE_MS.to_string())
        .env("JANITOR_RECONCILE_INTERVAL_MS", "500")
        .arg(command);
    cmd
}

fn heartbeats(settings: &Settings, servers: &[String]) -> Proc {
    let mut cmd = lab(settings);
    cmd.args(["heartbeats", "--interval-ms", "200", "--ttl-ms", "700"]);
    for s in servers {
        cmd.args(["--server", s]);
    }
    Proc::start(cmd)
}

/// The servers of the `server.dead` events on the stream, with each event's Redis time.
async fn published(conn: &RedisConn, keys: &Keys) -> Vec<(String, u64)> {
    let entries: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
        .arg(keys.events())
        .arg("-")
        .arg("+")
        .query_async(&mut conn.clone())
        .await
        .unwrap_or_default();
    entries
        .ids
        .iter()
        .map(|e| {
            let payload: Vec<u8> = e.get("payload").unwrap();
            let event = ServerDead::decode(&payload, 65536).unwrap().0;
            let ms = e.id.split('-').next().unwrap().parse().unwrap();
            (event.server_id, ms)
        })
        .collect()
}

fn names(events: &[(String, u64)]) -> BTreeSet<String> {
    events.iter().map(|(s, _)| s.clone()).collect()
}

/// Users of `server` whose entry still names it.
async fn pointing(registry: &Registry, conn: &RedisConn, server: &str) -> usize {
    let mut n = 0;
    for u in 0..USERS {
        let owner = registry.owner(conn, &user(server, u)).await.unwrap();
        n += usize::from(owner.as_deref() == Some(server));
    }
    n
}

async fn exists(conn: &RedisConn, key: String) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<bool>(&mut conn.clone())
        .await
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_paused_whole_fences_no_live_server() {
    let redis = RedisServer::start_with(&["--notify-keyspace-events", "Ex"]).unwrap();
    let mut settings = settings(&redis, Layout::Hash);
    settings.heartbeat_grace_ms = GRACE_MS;
    let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    let keys = Keys::for_settings(&settings);
    let registry = Registry::new(keys.clone(), settings.layout);
    let crashed = "gw-crashed#1".to_string();
    let mut all = live_servers();
    all.push(crashed.clone());
    for s in &all {
        let ids: Vec<Vec<u8>> = (0..USERS).map(|n| user(s, n)).collect();
        registry
            .register_many(
                &conn,
                ids.iter().map(Vec::as_slice),
                &ServerId::parse(s).unwrap(),
                USERS,
            )
            .await
            .unwrap();
    }
    let fleet = heartbeats(&settings, &live_servers());
    let crashing = heartbeats(&settings, std::slice::from_ref(&crashed));
    wait_for(
        "every server heartbeating",
        Duration::from_secs(30),
        || async {
            for s in &all {
                if !exists(&conn, keys.server_alive(&ServerId::parse(s).unwrap())).await {
                    return false;
                }
            }
            true
        },
    )
    .await;
    let reconciler = Proc::start(janitor(&settings, "reconcile"));
    let worker = Proc::start(janitor(&settings, "worker"));
    // Steady state: the reconciler has observed Redis and passed a few times.
    wait_for("the guard's record", Duration::from_secs(30), || async {
        exists(&conn, keys.guard_reachable()).await
    })
    .await;
    tokio::time::sleep(Duration::from_millis(2 * GRACE_MS)).await; // passes, nothing dead
    assert!(published(&conn, &keys).await.is_empty());

    drop(crashing); // SIGKILL: its heartbeats stop
    for p in [&fleet, &reconciler, &worker] {
        p.signal("STOP");
    }
    redis.signal("STOP").unwrap();
    std::thread::sleep(Duration::from_millis(5_000)); // the pause, not a wait for a result
                                                      // Before anything runs again: whatever the reconciler reads of Redis's clock after
                                                      // the pause is later.
    let resumed_ms = registry_janitor::now_ms();
    redis.signal("CONT").unwrap();
    reconciler.signal("CONT");
    worker.signal("CONT");
    // The connection servers get the CPU back last, as some processes of a paused
    // machine do: the reconciler runs first, with every liveness key expired.
    std::thread::sleep(Duration::from_millis(600));
    fleet.signal("CONT");

    wait_for(
        "the crashed server published",
        Duration::from_secs(60),
        || async { names(&published(&conn, &keys).await).contains(&crashed) },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(2 * GRACE_MS)).await; // more passes, to be sure
    let events = published(&conn, &keys).await;
    assert_eq!(
        names(&events),
        BTreeSet::from([crashed.clone()]),
        "only the crashed server is declared dead\n{}",
        reconciler.output().1
    );
    wait_for(
        "the crashed server cleaned",
        Duration::from_secs(60),
        || async { pointing(&registry, &conn, &crashed).await == 0 },
    )
    .await;
    let (fleet_out, _) = fleet.stop();
    let (_, reconciler_log) = reconciler.stop();
    worker.stop();
    assert_eq!(fleet_out, "", "a live server was told it is fenced");
    for s in live_servers() {
        let id = ServerId::parse(&s).unwrap();
        assert!(!exists(&conn, keys.server_fence(&id)).await, "{s} fenced");
        assert_eq!(
            pointing(&registry, &conn, &s).await,
            USERS,
            "{s} lost entries"
        );
    }
    assert!(
        events[0].1 >= resumed_ms + GRACE_MS,
        "the crashed server was declared dead {} ms after the machine resumed, before a full grace",
        events[0].1 as i64 - resumed_ms as i64
    );
    // Seen as its own stall; or, when the pause caught an observation on its way, as a
    // reply that came too late.
    assert!(
        reconciler_log.contains("did not run")
            || reconciler_log.contains("Redis took too long to answer"),
        "{reconciler_log}"
    );
}
