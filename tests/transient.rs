//! Redis states that pass (BUSY, NOREPLICAS, OOM, MISCONF, connection refused) are waited
//! out by the real processes: a worker and a reconciler started in such a state, or meeting
//! it while running, stay up, `/healthz` stays 200, `/readyz` answers 503 while it lasts,
//! each failing loop logs one line when it starts failing and one when it recovers, and
//! the work resumes: published `server.dead` events are cleaned and acknowledged.
//!
//! The states are made with real server settings, never mocked: a Lua busy loop past
//! `busy-reply-threshold` (BUSY), `min-replicas-to-write 1` without replicas (NOREPLICAS),
//! `maxmemory 1` under `noeviction` (OOM), a background save that fails with
//! `stop-writes-on-bgsave-error yes` (MISCONF).

mod common;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use common::*;
use registry_janitor::{config::Layout, event::ServerId, status};

#[derive(Debug, Clone, Copy)]
enum State {
    Busy,
    NoReplicas,
    Oom,
    Misconf,
}

/// A state being held; [`leave`] ends it.
struct Held {
    state: State,
    /// The connection running the busy script (BUSY only).
    busy_script: Option<std::thread::JoinHandle<()>>,
}

async fn config_set(f: &Fixture, name: &str, value: &str) {
    f.query::<()>(redis::cmd("CONFIG").arg("SET").arg(name).arg(value))
        .await
}

/// Puts `f.redis` into `state`, and returns once the server answers with it.
async fn enter(f: &Fixture, state: State) -> Held {
    let mut busy_script = None;
    let code = match state {
        State::Busy => {
            config_set(f, "busy-reply-threshold", "100").await;
            let url = f.settings.redis_url.clone();
            busy_script = Some(std::thread::spawn(move || {
                let mut c = redis::Client::open(url).unwrap().get_connection().unwrap();
                // Runs until SCRIPT KILL; then Redis answers this connection with an error.
                let killed = redis::cmd("EVAL")
                    .arg("while true do end")
                    .arg(0)
                    .query::<()>(&mut c);
                assert!(killed.is_err());
            }));
            "BUSY"
        }
        State::NoReplicas => {
            config_set(f, "min-replicas-to-write", "1").await;
            "NOREPLICAS"
        }
        State::Oom => {
            config_set(f, "maxmemory", "1").await;
            "OOM"
        }
        State::Misconf => {
            // The RDB file's name is taken by a directory: the save's final rename fails.
            let dir: Vec<String> = f.query(redis::cmd("CONFIG").arg("GET").arg("dir")).await;
            let rdb = std::path::Path::new(&dir[1]).join("dump.rdb");
            let _ = std::fs::remove_file(&rdb);
            std::fs::create_dir(&rdb).unwrap();
            config_set(f, "save", "3600 1").await;
            f.query::<()>(&redis::cmd("BGSAVE")).await;
            "MISCONF"
        }
    };
    let probe_key = format!("{}probe", f.keys.prefix());
    let c = f.conn.clone();
    wait_until(
        &f.redis,
        &format!("the server to answer writes with {code}"),
        Duration::from_secs(20),
        || {
            let (mut c, key) = (c.clone(), probe_key.clone());
            async move {
                let probe: redis::RedisResult<()> = redis::cmd("SET")
                    .arg(key)
                    .arg("x")
                    .query_async(&mut c)
                    .await;
                probe.is_err_and(|e| e.code() == Some(code))
            }
        },
    )
    .await;
    Held { state, busy_script }
}

/// Ends the state the way it ends in production: the script is killed, the replica
/// comes back, memory is freed, a background save succeeds.
async fn leave(f: &Fixture, held: Held) {
    match held.state {
        State::Busy => {
            f.query::<()>(redis::cmd("SCRIPT").arg("KILL")).await;
            let script = held.busy_script.unwrap();
            tokio::task::spawn_blocking(move || script.join().unwrap())
                .await
                .unwrap();
        }
        State::NoReplicas => config_set(f, "min-replicas-to-write", "0").await,
        State::Oom => config_set(f, "maxmemory", "0").await,
        State::Misconf => {
            let dir: Vec<String> = f.query(redis::cmd("CONFIG").arg("GET").arg("dir")).await;
            std::fs::remove_dir(std::path::Path::new(&dir[1]).join("dump.rdb")).unwrap();
            f.query::<()>(&redis::cmd("BGSAVE")).await;
        }
    }
    wait_until(
        &f.redis,
        "the server to take writes again",
        Duration::from_secs(20),
        || {
            let mut c = f.conn.clone();
            let key = format!("{}probe", f.keys.prefix());
            async move {
                redis::cmd("SET")
                    .arg(key)
                    .arg("x")
                    .query_async::<()>(&mut c)
                    .await
                    .is_ok()
            }
        },
    )
    .await;
}

/// A worker and a reconciler process, each with its own metrics listener.
struct Processes {
    worker: WorkerProcess,
    worker_addr: String,
    reconciler: WorkerProcess,
    reconciler_addr: String,
}

impl Processes {
    fn start(f: &Fixture) -> Self {
        let (worker_addr, reconciler_addr) = (free_addr(), free_addr());
        let start = |addr: &str, command: &str| {
            let env = [
                ("JANITOR_HEARTBEAT_GRACE_MS", "1000"),
                ("JANITOR_RECONCILE_INTERVAL_MS", "1000"),
                ("JANITOR_METRICS_ADDR", addr),
            ];
            WorkerProcess::start_command(&f.settings, &env, &[command])
        };
        Processes {
            worker: start(&worker_addr, "worker"),
            reconciler: start(&reconciler_addr, "reconcile"),
            worker_addr,
            reconciler_addr,
        }
    }

    fn addrs(&self) -> [(&'static str, &str); 2] {
        [
            ("worker", &self.worker_addr),
            ("reconciler", &self.reconciler_addr),
        ]
    }

    fn logs(&self) -> String {
        format!(
            "--- worker log ---\n{}\n--- reconciler log ---\n{}",
            self.worker.log(),
            self.reconciler.log()
        )
    }

    /// Waits until both answer `/readyz` with `status`.
    async fn wait_ready(&self, f: &Fixture, status: u16) {
        for (name, addr) in self.addrs() {
            wait_until(
                &f.redis,
                &format!("the {name}'s /readyz to answer {status}"),
                Duration::from_secs(30),
                || async move { http_get(addr, "/readyz").0 == status },
            )
            .await;
        }
    }

    /// For `how_long`: both processes run, `/healthz` answers 200 and `/readyz` 503.
    async fn hold_out(&mut self, how_long: Duration, what: &str) {
        let until = Instant::now() + how_long;
        while Instant::now() < until {
            assert!(
                self.worker.is_running(),
                "{what}: the worker exited\n{}",
                self.logs()
            );
            assert!(
                self.reconciler.is_running(),
                "{what}: the reconciler exited\n{}",
                self.logs()
            );
            for (name, addr) in self.addrs() {
                assert_eq!(http_get(addr, "/healthz").0, 200, "{what}: {name} /healthz");
                let (status, body) = http_get(addr, "/readyz");
                assert_eq!(status, 503, "{what}: {name} /readyz said {body}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// SIGTERM to both: each exits 0. Returns their logs.
    fn stop(self) -> (String, String) {
        self.worker.signal("TERM");
        self.reconciler.signal("TERM");
        let (status, worker_log) = self.worker.wait(Duration::from_secs(15));
        assert!(
            status.is_some_and(|s| s.success()),
            "worker: {status:?}\n{worker_log}"
        );
        let (status, reconciler_log) = self.reconciler.wait(Duration::from_secs(15));
        assert!(
            status.is_some_and(|s| s.success()),
            "reconciler: {status:?}\n{reconciler_log}"
        );
        (worker_log, reconciler_log)
    }
}

/// A server that died: its users registered, its liveness key gone, its heartbeat old.
async fn dead_server(f: &Fixture, name: &str, users: usize) -> ServerId {
    let s = server(name);
    f.seed(&s, users).await;
    f.query::<()>(redis::cmd("DEL").arg(f.keys.server_alive(&s)))
        .await;
    f.query::<()>(
        redis::cmd("ZADD")
            .arg(f.keys.servers())
            .arg(1)
            .arg(s.as_str()),
    )
    .await;
    s
}

/// Waits until none of `servers`' users still point at them, every event is acknowledged
/// and nothing is pending.
async fn wait_cleaned(f: &Fixture, servers: &[&ServerId], users: usize, p: &Processes) {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let mut stale = 0;
        for s in servers {
            stale += f.still_pointing(s, users).await;
        }
        let st = status::collect_from(&f.conn, &f.keys).await.unwrap();
        if stale == 0 && st.is_idle() && st.pending == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not cleaned: {stale} stale entries, {st:?}\n{}\n--- redis ---\n{}",
            p.logs(),
            f.redis.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Each loop that failed logged one line when it started failing and one when it
/// recovered, per episode (`episodes` of them at most), not one per attempt.
fn assert_one_line_per_change(log: &str, episodes: usize) {
    let mut failing: BTreeMap<String, usize> = BTreeMap::new();
    let mut recovered: BTreeMap<String, usize> = BTreeMap::new();
    // Worker logs go to a file: no colour codes (cli::text_logs_to_a_file_*).
    for line in log.lines() {
        if let Some(at) = line.find(" failing, retrying with backoff") {
            let what = line[..at].rsplit(": ").next().unwrap().to_owned();
            *failing.entry(what).or_default() += 1;
        } else if let Some(head) = line.strip_suffix(" recovered") {
            let what = head.rsplit(": ").next().unwrap().to_owned();
            *recovered.entry(what).or_default() += 1;
        }
    }
    assert!(!failing.is_empty(), "no loop said it was failing:\n{log}");
    for (what, n) in &failing {
        assert!(
            *n <= episodes,
            "`{what}` logged failing {n} times in {episodes} episode(s):\n{log}"
        );
        assert_eq!(
            recovered.get(what),
            Some(n),
            "`{what}` failed {n} times but recovered {:?} times:\n{log}",
            recovered.get(what)
        );
    }
}

const USERS: usize = 300;

/// Both processes start while Redis is in `state`, then meet it again while running.
async fn processes_wait_out(state: State) {
    let f = Fixture::new(Layout::Hash);
    // Cleaned by the worker from an event published before the state.
    let reported = server("gw-reported#1");
    f.seed(&reported, USERS).await;
    f.kill(&reported).await;
    // Found by the reconciler (stale heartbeat, no liveness key), then cleaned.
    let silent = dead_server(&f, "gw-silent#1", USERS).await;

    // At start-up: the consumer group cannot be created, the pass cannot publish.
    let held = enter(&f, state).await;
    let mut p = Processes::start(&f);
    p.wait_ready(&f, 503).await;
    p.hold_out(Duration::from_secs(3), &format!("{state:?} at start-up"))
        .await;
    leave(&f, held).await;
    wait_cleaned(&f, &[&reported, &silent], USERS, &p).await;
    p.wait_ready(&f, 200).await;

    // While running: the reads, the sweep and the probes meet the state.
    let held = enter(&f, state).await;
    p.wait_ready(&f, 503).await;
    p.hold_out(Duration::from_secs(2), &format!("{state:?} while running"))
        .await;
    leave(&f, held).await;
    let later = server("gw-later#1");
    f.seed(&later, USERS).await;
    f.kill(&later).await;
    wait_cleaned(&f, &[&later], USERS, &p).await;
    p.wait_ready(&f, 200).await;

    let (worker_log, reconciler_log) = p.stop();
    assert_one_line_per_change(&worker_log, 2);
    assert_one_line_per_change(&reconciler_log, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_scripts_are_waited_out() {
    processes_wait_out(State::Busy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noreplicas_is_waited_out() {
    processes_wait_out(State::NoReplicas).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_is_waited_out() {
    processes_wait_out(State::Oom).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misconf_is_waited_out() {
    processes_wait_out(State::Misconf).await;
}

/// Both processes start before their redis-server exists on that port, then it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_refused_at_start_up_is_waited_out() {
    let mut f = Fixture::new(Layout::Hash);
    f.redis.kill();
    let mut p = Processes::start(&f);
    p.wait_ready(&f, 503).await;
    p.hold_out(Duration::from_secs(3), "connection refused at start-up")
        .await;
    f.redis.restart().unwrap();
    let s = server("gw-after#1");
    wait_until(
        &f.redis,
        "the fixture to reconnect",
        Duration::from_secs(20),
        || async {
            let mut c = f.conn.clone();
            redis::cmd("PING")
                .query_async::<String>(&mut c)
                .await
                .is_ok()
        },
    )
    .await;
    f.seed(&s, USERS).await;
    f.kill(&s).await;
    wait_cleaned(&f, &[&s], USERS, &p).await;
    p.wait_ready(&f, 200).await;
    let (worker_log, reconciler_log) = p.stop();
    assert_one_line_per_change(&worker_log, 1);
    assert_one_line_per_change(&reconciler_log, 1);
}

/// `reconcile --once` (a cron job) started during a state waits it out, then finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_once_waits_out_a_transient_state() {
    let f = Fixture::new(Layout::Hash);
    let silent = dead_server(&f, "gw-silent#1", USERS).await;
    let held = enter(&f, State::NoReplicas).await;
    let mut once = WorkerProcess::start_command(
        &f.settings,
        &[("JANITOR_HEARTBEAT_GRACE_MS", "1000")],
        &["reconcile", "--once"],
    );
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        assert!(once.is_running(), "it gave up:\n{}", once.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    leave(&f, held).await;
    let (status, log) = once.wait(Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "{status:?}\n{log}");
    let published: Vec<String> = read_stream(&f.conn, &f.keys.events())
        .await
        .iter()
        .map(|e| {
            let payload = e.field("payload").unwrap();
            registry_janitor::event::ServerDead::decode(payload, 65536)
                .unwrap()
                .0
                .server_id
        })
        .collect();
    assert_eq!(published, vec![silent.as_str().to_owned()], "{log}");
    assert_one_line_per_change(&log, 1);
}
