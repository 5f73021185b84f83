//! The reconciler against a real redis-server: dead servers found from heartbeats (with
//! and without expiry notifications), drift repaired, live servers never touched.

mod common;

use std::time::{Duration, Instant};

use common::*;
use registry_janitor::{
    config::Layout,
    event::{ServerDead, ServerId},
    metrics::Metrics,
    reconcile::{Reconciler, Verdict},
};

/// Events on the stream, decoded: (server id, source).
async fn events(f: &Fixture) -> Vec<(String, Option<String>)> {
    read_stream(&f.conn, &f.keys.events())
        .await
        .iter()
        .map(|e| {
            let (ev, _) = ServerDead::decode(e.field("payload").unwrap(), 65536).unwrap();
            (ev.server_id, ev.source)
        })
        .collect()
}

/// A server that heartbeats once with a short TTL, then "crashes" (stops heartbeating).
async fn crashing_server(f: &Fixture, name: &str, users: usize, ttl_ms: u64) -> ServerId {
    let s = server(name);
    f.seed(&s, users).await;
    f.registry.heartbeat(&f.conn, &s, ttl_ms).await.unwrap();
    s
}

async fn wait_clean(f: &Fixture, s: &ServerId, users: usize, within: Duration) -> Duration {
    let started = Instant::now();
    wait_until(&f.redis, "the crashed server cleaned", within, || async {
        f.still_pointing(s, users).await == 0
    })
    .await;
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_notifications_a_crashed_server_is_cleaned_long_before_the_next_pass() {
    let f = Fixture::on(
        redis_with(&["--notify-keyspace-events", "Ex"]),
        Layout::Hash,
        |s| {
            s.reconcile_interval_ms = 120_000;
            s.heartbeat_grace_ms = 200;
        },
    );
    let live = server("gw-live#1");
    f.seed(&live, 500).await;
    f.registry.heartbeat(&f.conn, &live, 600_000).await.unwrap();
    let crashed = crashing_server(&f, "gw-crash#1", 2_000, 700).await;
    let reconciler = RunningReconciler::start(&f.settings);
    let worker = spawn_worker(&f.settings);
    // The first pass ran at start, while the server was alive; the next is 2 minutes away.
    let took = wait_clean(&f, &crashed, 2_000, Duration::from_secs(20)).await;
    assert!(
        reconciler.metrics.expiry_hints.get() >= 1,
        "the expiry hint was received"
    );
    assert_eq!(
        events(&f).await,
        vec![("gw-crash#1".to_owned(), Some("reconciler".to_owned()))]
    );
    assert_eq!(
        f.still_pointing(&live, 500).await,
        500,
        "the live server is untouched"
    );
    eprintln!("expiry hint: cleaned {took:?} after the crash (TTL 700 ms, grace 200 ms)");
    reconciler.stop().await;
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_notifications_the_periodic_pass_finds_the_crashed_server() {
    let f = Fixture::with(Layout::Keys, |s| {
        s.reconcile_interval_ms = 500;
        s.heartbeat_grace_ms = 200;
    });
    let notify: Vec<String> = f
        .query(
            redis::cmd("CONFIG")
                .arg("GET")
                .arg("notify-keyspace-events"),
        )
        .await;
    assert_eq!(notify[1], "", "notifications are off in this test");
    let crashed = crashing_server(&f, "gw-crash#2", 1_000, 300).await;
    let reconciler = RunningReconciler::start(&f.settings);
    let worker = spawn_worker(&f.settings);
    wait_clean(&f, &crashed, 1_000, Duration::from_secs(20)).await;
    assert_eq!(reconciler.metrics.expiry_hints.get(), 0);
    assert!(reconciler.metrics.reconcile_dead_found.get() >= 1);
    reconciler.stop().await;
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_may_turn_notifications_on_itself() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.reconcile_interval_ms = 120_000;
        s.heartbeat_grace_ms = 200;
        s.keyspace_events_auto = true;
    });
    let reconciler = RunningReconciler::start(&f.settings);
    wait_until(
        &f.redis,
        "notify-keyspace-events turned on",
        Duration::from_secs(10),
        || async {
            let v: Vec<String> = f
                .query(
                    redis::cmd("CONFIG")
                        .arg("GET")
                        .arg("notify-keyspace-events"),
                )
                .await;
            v[1].contains('E') && v[1].contains('x')
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await; // let the subscription settle
    let crashed = crashing_server(&f, "gw-crash#3", 500, 300).await;
    let worker = spawn_worker(&f.settings);
    wait_clean(&f, &crashed, 500, Duration::from_secs(20)).await;
    assert!(reconciler.metrics.expiry_hints.get() >= 1);
    reconciler.stop().await;
    worker.stop().await;
}

/// Redis down when the reconciler starts, then restarted (which forgets a CONFIG SET):
/// notifications are turned on when it comes back, and hints work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_are_turned_on_when_redis_comes_back() {
    let mut f = Fixture::with(Layout::Hash, |s| {
        s.reconcile_interval_ms = 120_000;
        s.heartbeat_grace_ms = 200;
        s.keyspace_events_auto = true;
    });
    f.redis.kill();
    let reconciler = RunningReconciler::start(&f.settings);
    tokio::time::sleep(Duration::from_millis(500)).await; // it starts while Redis is down
    f.redis.restart().unwrap();
    wait_until(
        &f.redis,
        "notify-keyspace-events turned on",
        Duration::from_secs(20),
        || async {
            let v: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
                .arg("GET")
                .arg("notify-keyspace-events")
                .query_async(&mut f.conn.clone())
                .await;
            v.is_ok_and(|v| v[1].contains('E') && v[1].contains('x'))
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await; // let the subscription settle
    let crashed = crashing_server(&f, "gw-crash#4", 500, 300).await;
    let worker = spawn_worker(&f.settings);
    wait_clean(&f, &crashed, 500, Duration::from_secs(20)).await;
    assert!(reconciler.metrics.expiry_hints.get() >= 1);
    reconciler.stop().await;
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_an_old_heartbeat_and_no_key_is_declared_dead_and_a_live_one_never() {
    let f = Fixture::with(Layout::Hash, |s| s.heartbeat_grace_ms = 30_000);
    let r = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();
    let (old, fresh, keyed) = (
        server("gw-old#1"),
        server("gw-fresh#1"),
        server("gw-keyed#1"),
    );
    let an_hour_ago = registry_janitor::now_ms() - 3_600_000;
    let _: () = f
        .query(
            redis::cmd("ZADD")
                .arg(f.keys.servers())
                .arg(an_hour_ago)
                .arg(old.as_str())
                .arg(registry_janitor::now_ms())
                .arg(fresh.as_str())
                .arg(an_hour_ago)
                .arg(keyed.as_str()),
        )
        .await;
    // `keyed` has an old score but its liveness key exists: it is alive.
    let _: () = f
        .query(
            redis::cmd("SET")
                .arg(f.keys.server_alive(&keyed))
                .arg(1)
                .arg("PX")
                .arg(60_000),
        )
        .await;

    assert!(matches!(
        r.check(&old).await.unwrap(),
        Verdict::Published(_)
    ));
    assert_eq!(r.check(&old).await.unwrap(), Verdict::AlreadyReported);
    assert!(matches!(
        r.check(&fresh).await.unwrap(),
        Verdict::TooRecent { .. }
    ));
    assert_eq!(r.check(&keyed).await.unwrap(), Verdict::Alive);
    let report = r.pass().await.unwrap();
    assert_eq!(
        (report.candidates, report.alive, report.already_reported),
        (2, 1, 1)
    );
    assert_eq!(
        events(&f).await,
        vec![("gw-old#1".to_owned(), Some("reconciler".to_owned()))]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_reconcilers_at_once_publish_each_death_once() {
    let f = Fixture::new(Layout::Hash);
    let dead: Vec<ServerId> = (0..5).map(|i| server(&format!("gw-{i}#1"))).collect();
    for s in &dead {
        let _: () = f
            .query(
                redis::cmd("ZADD")
                    .arg(f.keys.servers())
                    .arg(1)
                    .arg(s.as_str()),
            )
            .await;
    }
    let passes = (0..4).map(|_| {
        let settings = f.settings.clone();
        tokio::spawn(async move {
            Reconciler::new(&settings, Metrics::new())
                .await
                .unwrap()
                .pass()
                .await
                .unwrap()
        })
    });
    let published: u64 = futures_util::future::join_all(passes)
        .await
        .into_iter()
        .map(|r| r.unwrap().published)
        .sum();
    assert_eq!(published, 5);
    assert_eq!(events(&f).await.len(), 5);
}

async fn drift_fixture(layout: Layout) -> (Fixture, ServerId, ServerId) {
    let f = Fixture::new(layout);
    let (live, other) = (server("gw-live#1"), server("gw-other#1"));
    for s in [&live, &other] {
        f.seed(s, 1_000).await;
        f.registry.heartbeat(&f.conn, s, 600_000).await.unwrap();
    }
    // Entries of a server no index knows: no reverse set, no `servers` entry, no key.
    let ghost = server("gw-ghost#1");
    for n in 0..700 {
        let _: () = f
            .query(&forward_write(
                &f.keys,
                layout,
                &entry(layout, &ghost, n),
                ghost.as_str(),
            ))
            .await;
    }
    // An owner that is not a valid server id is never used in a key, and left alone.
    let odd = as_entry(layout, b"odd-user");
    f.reconnect(&odd, &server("gw-live#1")).await;
    let _: () = f
        .query(&forward_write(&f.keys, layout, &odd, "bad{owner}"))
        .await;
    // 50 users of `live` moved to `other`, and `live` missed the SREM.
    for n in 0..50 {
        f.reconnect(&entry(layout, &live, n), &other).await;
    }
    (f, live, other)
}

async fn drift_is_repaired(layout: Layout) {
    let (f, live, other) = drift_fixture(layout).await;
    let r = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();
    let report = r.run_once().await.unwrap();
    assert_eq!(report.sweep.entries_removed, 700, "{report}");
    // The 50 movers, and odd-user: its entry names another (invalid) owner now.
    assert_eq!(report.sweep.members_removed, 51, "{report}");
    assert_eq!(report.sweep.live_servers, 2);
    assert_eq!(f.still_pointing(&server("gw-ghost#1"), 700).await, 0);
    assert_eq!(f.still_pointing(&live, 1_000).await, 950);
    assert_eq!(f.still_pointing(&other, 1_000).await, 1_000);
    for n in 0..50 {
        assert_eq!(
            f.owner(&entry(layout, &live, n)).await.as_deref(),
            Some("gw-other#1")
        );
    }
    assert_eq!(
        f.owner(&as_entry(layout, b"odd-user")).await.as_deref(),
        Some("bad{owner}")
    );
    let members: u64 = f
        .query(redis::cmd("SCARD").arg(f.keys.server_users(&live)))
        .await;
    assert_eq!(
        members, 950,
        "the 50 movers and odd-user are gone from the set"
    );
    assert!(events(&f).await.is_empty(), "no live server declared dead");
    // A second sweep finds nothing left.
    let again = r.run_once().await.unwrap();
    assert_eq!(
        (again.sweep.entries_removed, again.sweep.members_removed),
        (0, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_is_repaired_hash_layout() {
    drift_is_repaired(Layout::Hash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_is_repaired_keys_layout() {
    drift_is_repaired(Layout::Keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_is_repaired_conns_layout() {
    drift_is_repaired(Layout::Conns).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_resumes_from_its_stored_cursor() {
    let f = Fixture::with(Layout::Hash, |s| s.sweep_count = 50);
    let s = server("gw-live#1");
    f.seed(&s, 5_000).await;
    f.registry.heartbeat(&f.conn, &s, 600_000).await.unwrap();
    let r = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();
    let (first, _, _) = r.sweep_step(Some("0")).await.unwrap();
    assert_ne!(first, "0");
    let stored: String = f
        .query(redis::cmd("HGET").arg(f.keys.sweep()).arg("cursor"))
        .await;
    assert_eq!(stored, first, "the cursor is kept in Redis");
    let (second, _, _) = r.sweep_step(None).await.unwrap();
    assert_ne!(
        second, first,
        "a new reconciler continues from the stored cursor"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_once_from_the_command_line() {
    let (f, _, _) = drift_fixture(Layout::Hash).await;
    let _: () = f
        .query(
            redis::cmd("ZADD")
                .arg(f.keys.servers())
                .arg(1)
                .arg("gw-long-dead#1"),
        )
        .await;
    let out = janitor(&f.settings)
        .args(["reconcile", "--once"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("1 published"), "{stdout}");
    assert!(stdout.contains("700 of"), "{stdout}");
    assert_eq!(
        events(&f).await,
        vec![("gw-long-dead#1".to_owned(), Some("reconciler".to_owned()))]
    );
}

/// SIGTERM in the middle of a slow sweep (a big reverse set, small steps, long pauses):
/// the reconciler exits 0 within a second or so, not after the sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_stops_on_sigterm_mid_sweep() {
    let f = Fixture::new(Layout::Hash);
    // A live server with a big reverse set: its sweep takes 500 steps of 10 members,
    // two seconds apart.
    let live = server("gw-live#1");
    f.registry.heartbeat(&f.conn, &live, 600_000).await.unwrap();
    for chunk in (0..5_000).collect::<Vec<_>>().chunks(1000) {
        let members: Vec<Vec<u8>> = chunk.iter().map(|&n| user(&live, n)).collect();
        f.query::<()>(
            redis::cmd("SADD")
                .arg(f.keys.server_users(&live))
                .arg(members),
        )
        .await;
    }
    let reconciler = WorkerProcess::start_command(
        &f.settings,
        &[
            ("JANITOR_SWEEP_COUNT", "10"),
            ("JANITOR_SWEEP_PAUSE_MS", "2000"),
            ("RUST_LOG", "registry_janitor=debug"),
        ],
        &["reconcile"],
    );
    wait_until(
        &f.redis,
        "the reverse-set sweep to be under way",
        Duration::from_secs(20),
        || {
            let started = reconciler
                .log()
                .contains("sweeping the reverse sets of live servers");
            async move { started }
        },
    )
    .await;
    // Into the first pause between two steps (not an assertion: where the signal lands).
    tokio::time::sleep(Duration::from_millis(700)).await;
    reconciler.signal("TERM");
    let sent = Instant::now();
    let (status, log) = reconciler.wait(Duration::from_secs(10));
    let took = sent.elapsed();
    eprintln!("stopped {took:?} after SIGTERM");
    assert!(
        status.is_some_and(|s| s.success()),
        "exit status {status:?} after {took:?}\n{log}"
    );
    assert!(
        took < Duration::from_secs(3),
        "took {took:?} to stop after SIGTERM\n{log}"
    );
    assert!(log.contains("reconciler stopped"), "{log}");
}

/// Servers leave `servers` while a pass walks it (their cleanups finish): the pass still
/// checks every server that stayed. Paging by offset skipped the servers that moved up
/// into the pages already read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_checks_every_server_while_others_leave() {
    let f = Fixture::new(Layout::Hash);
    const SERVERS: usize = 2_500;
    let names: Vec<String> = (0..SERVERS).map(|i| format!("gw-{i:05}#1")).collect();
    let mut pipe = redis::pipe();
    for (i, name) in names.iter().enumerate() {
        // Old heartbeats, oldest first: the first 1,000 are the first page of a pass.
        pipe.zadd(f.keys.servers(), name, 1_000 + i).ignore();
    }
    let _: () = pipe.query_async(&mut f.conn.clone()).await.unwrap();
    let r = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();
    let leaving: Vec<String> = names[..500].to_vec();
    let remover = {
        let (conn, keys) = (f.conn.clone(), f.keys.clone());
        tokio::spawn(async move {
            // Once the pass has published its first event (its first page is read), the
            // 500 oldest servers leave `servers`, as finished cleanups do.
            loop {
                let n: u64 = redis::cmd("XLEN")
                    .arg(keys.events())
                    .query_async(&mut conn.clone())
                    .await
                    .unwrap();
                if n > 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let _: u64 = redis::cmd("ZREM")
                .arg(keys.servers())
                .arg(&leaving)
                .query_async(&mut conn.clone())
                .await
                .unwrap();
        })
    };
    r.pass().await.unwrap();
    remover.await.unwrap();
    let reported: std::collections::HashSet<String> =
        events(&f).await.into_iter().map(|(s, _)| s).collect();
    let missed: Vec<&String> = names[500..]
        .iter()
        .filter(|n| !reported.contains(*n))
        .collect();
    assert!(
        missed.is_empty(),
        "{} servers that stayed in `servers` were never checked, e.g. {:?}",
        missed.len(),
        missed.first()
    );
}
