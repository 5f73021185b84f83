//! Crashes, restarts and hostile input, with real processes: workers killed with SIGKILL,
//! stopped with SIGTERM mid-cleanup, Redis killed and restarted under a running worker,
//! random entries on the stream. After each, the registry must be exactly right: no
//! entry left pointing at a dead server, no live entry lost, nothing pending.

mod common;

use std::{
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use common::*;
use rand::Rng;
use registry_janitor::{
    cleanup::Cleaner,
    config::Layout,
    event::{classify, Classified, Entry, ServerDead, ServerId},
    metrics::outcome,
    status, stream,
};

/// Users left on `servers` (0..users) that still point at them.
async fn stale(f: &Fixture, servers: &[ServerId], users: usize) -> usize {
    let mut n = 0;
    for s in servers {
        n += f.still_pointing(s, users).await;
    }
    n
}

/// Dead servers whose cleanup has not finished yet.
async fn unfinished(f: &Fixture, servers: &[ServerId]) -> u64 {
    let mut n = 0;
    for s in servers {
        n += u64::from(scanned(f, s).await.is_some());
    }
    n
}

/// Members of `server`'s reverse set scanned so far; None once it is clean.
async fn scanned(f: &Fixture, server: &ServerId) -> Option<u64> {
    let cleaner = Cleaner::new(f.keys.clone(), f.settings.layout, 1, 1);
    cleaner.progress(&f.conn, server).await.unwrap()
}

/// Several workers clean many servers while the test SIGKILLs them at random moments and
/// starts new ones, and users reconnect elsewhere at the same time. The evictions stream
/// announces every deleted user exactly once, and never a user whose entry was kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_sigkilled_workers_and_reconnecting_users() {
    chaos(Layout::Hash).await;
}

/// The same chaos in layout conns: connections move, workers die, every deleted
/// (user, connection) pair is announced exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_sigkilled_workers_and_reconnecting_users_conns_layout() {
    chaos(Layout::Conns).await;
}

async fn chaos(layout: Layout) {
    let f = Fixture::with(layout, |s| {
        s.chunk_size = 5;
        s.chunks_in_flight = 1;
        s.claim_min_idle_ms = 1000;
        s.max_deliveries = 1000; // kills are not the entries' fault here
    });
    const USERS: usize = 30_000;
    let dead: Vec<ServerId> = (0..8).map(|i| server(&format!("gw-{i}#1"))).collect();
    let live = server("gw-live#2");
    for s in dead.iter().chain([&live]) {
        f.seed(s, USERS).await;
    }
    let mut workers: Vec<WorkerProcess> =
        (0..3).map(|_| WorkerProcess::start(&f.settings)).collect();
    for s in &dead {
        f.kill(s).await;
    }

    // Reconnects racing the cleanup and the kills.
    let moving = Arc::new(AtomicBool::new(true));
    let moved_count = Arc::new(AtomicUsize::new(0));
    let mover = {
        let (keys, conn, dead, live) = (f.keys.clone(), f.conn.clone(), dead.clone(), live.clone());
        let (moving, moved_count) = (moving.clone(), moved_count.clone());
        tokio::spawn(async move {
            let mut moved = Vec::new();
            let mut n = 0;
            while moving.load(Ordering::Relaxed) && n < USERS {
                for s in &dead {
                    let u = entry(layout, s, n);
                    let was = reconnect_telling(&conn, &keys, layout, &u, &live).await;
                    moved.push((s.clone(), n, was));
                }
                moved_count.fetch_add(dead.len(), Ordering::Relaxed);
                n += 11;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            moved
        })
    };

    let mut kills = 0;
    let mut kills_mid_cleanup = 0;
    let chaos_until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < chaos_until {
        let pause = rand::rng().random_range(150..500);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let victim = rand::rng().random_range(0..workers.len());
        let left = unfinished(&f, &dead).await;
        workers[victim].signal("KILL");
        workers.remove(victim);
        kills += 1;
        if left > 0 {
            kills_mid_cleanup += 1;
        }
        workers.push(WorkerProcess::start(&f.settings));
    }
    moving.store(false, Ordering::Relaxed);
    let moved = mover.await.unwrap();
    wait_until(
        &f.redis,
        "every event acknowledged after the chaos",
        Duration::from_secs(120),
        || async {
            status::collect_from(&f.conn, &f.keys)
                .await
                .is_ok_and(|s| s.is_idle())
        },
    )
    .await;

    assert_eq!(stale(&f, &dead, USERS).await, 0, "stale entries left");
    assert_eq!(
        f.still_pointing(&live, USERS).await,
        USERS,
        "live server's entries lost"
    );
    for (s, n, _) in &moved {
        assert_eq!(
            f.owner(&entry(layout, s, *n)).await.as_deref(),
            Some(live.as_str()),
            "moved user lost"
        );
    }
    // Deleted: every user of a dead server but those whose reconnect found the entry
    // still naming the dead server (those were kept).
    let (announced, cleaned) = evictions(&f).await;
    for s in &dead {
        let kept: std::collections::HashSet<Vec<u8>> = moved
            .iter()
            .filter(|(d, _, was)| d == s && was.as_deref() == Some(s.as_str()))
            .map(|(_, n, _)| entry(layout, s, *n))
            .collect();
        let deleted = (0..USERS)
            .map(|n| entry(layout, s, n))
            .filter(|u| !kept.contains(u))
            .collect();
        assert_announced_exactly_once(&announced, s, &deleted);
    }
    assert_eq!(cleaned.len(), dead.len(), "one server.cleaned per event");
    assert_eq!(unfinished(&f, &dead).await, 0, "reverse sets gone");
    assert!(f.dead_letters().await.is_empty(), "nothing dead-lettered");
    assert!(
        kills_mid_cleanup >= 5,
        "only {kills_mid_cleanup} kills landed mid-cleanup"
    );
    eprintln!(
        "chaos ({layout:?}): {kills} SIGKILLs ({kills_mid_cleanup} mid-cleanup), {} users on {} dead servers, \
         {} reconnects during the chaos; stale 0, live lost 0, pending 0",
        USERS * dead.len(),
        dead.len(),
        moved.len()
    );
}

/// Redis is killed and restarted on the same port (with its append-only file, as a
/// persistent registry would be) while a worker process is mid-cleanup. The worker rides
/// out the outage and finishes; nothing is acknowledged that was not done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_under_a_running_worker() {
    redis_restarted_under_a_worker(Layout::Keys).await;
}

/// Layout conns: the users hold several connections on several servers ([`Devices`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_under_a_running_worker_conns_layout() {
    redis_restarted_under_a_worker(Layout::Conns).await;
}

async fn redis_restarted_under_a_worker(layout: Layout) {
    let mut f = Fixture::on(
        redis_with(&["--appendonly", "yes", "--appendfsync", "always"]),
        layout,
        |s| {
            s.chunk_size = 50;
            s.chunks_in_flight = 1;
        },
    );
    const USERS: usize = 60_000;
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    f.seed(&dead, USERS).await;
    f.seed(&live, 1_000).await;
    let devices = match layout {
        Layout::Conns => {
            let laptops = server("gw-laptops#1");
            Some(Devices::add(&f.registry, &f.conn, &dead, [&live, &laptops], USERS, 8_000).await)
        }
        _ => None,
    };
    let mut worker = WorkerProcess::start(&f.settings);
    f.kill(&dead).await;
    wait_until(
        &f.redis,
        "the cleanup under way",
        Duration::from_secs(30),
        || async {
            scanned(&f, &dead)
                .await
                .is_some_and(|n| n >= USERS as u64 / 10)
        },
    )
    .await;
    let left_before = scanned(&f, &dead)
        .await
        .map_or(0, |n| USERS as u64 - n.min(USERS as u64));
    assert!(
        left_before > 0,
        "the cleanup finished before Redis was killed; nothing was tested"
    );

    f.redis.kill();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(worker.is_running(), "the worker must survive the outage");
    f.redis.restart().unwrap();

    wait_until(
        &f.redis,
        "every event acknowledged after the restart",
        Duration::from_secs(60),
        || async {
            status::collect_from(&f.conn, &f.keys)
                .await
                .is_ok_and(|s| s.is_idle())
        },
    )
    .await;
    assert_eq!(
        f.still_pointing(&dead, USERS).await,
        0,
        "stale entries left"
    );
    assert_eq!(
        f.still_pointing(&live, 1_000).await,
        1_000,
        "live entries lost"
    );
    if let Some(devices) = &devices {
        devices.assert_end_state(&f.registry, &f.conn, &[]).await;
        assert_eq!(
            connections_naming(&[f.redis.url()], &f.keys, &dead).await,
            vec![]
        );
    }
    worker.signal("TERM");
    let (status, log) = worker.wait(Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(
        log.contains("recovered"),
        "the outage and the recovery are logged:\n{log}"
    );
    eprintln!(
        "redis restart ({layout:?}): killed with {left_before} of {USERS} users left; worker \
         recovered, stale 0"
    );
}

/// SIGTERM in the middle of a long cleanup: the worker stops within its drain timeout and
/// exits 0, the entry stays pending, and another worker takes it over and finishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_cleanup_leaves_the_rest_to_another_worker() {
    sigterm_mid_cleanup(Layout::Hash).await;
}

/// Layout conns: the users hold several connections on several servers ([`Devices`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_cleanup_leaves_the_rest_to_another_worker_conns_layout() {
    sigterm_mid_cleanup(Layout::Conns).await;
}

async fn sigterm_mid_cleanup(layout: Layout) {
    let f = Fixture::with(layout, |s| {
        s.chunk_size = 10;
        s.chunks_in_flight = 1;
        s.drain_timeout_ms = 300;
    });
    const USERS: usize = 60_000;
    let dead = server("gw-big#1");
    f.seed(&dead, USERS).await;
    let devices = match layout {
        Layout::Conns => {
            let (phones, laptops) = (server("gw-phones#1"), server("gw-laptops#1"));
            Some(
                Devices::add(
                    &f.registry,
                    &f.conn,
                    &dead,
                    [&phones, &laptops],
                    USERS,
                    8_000,
                )
                .await,
            )
        }
        _ => None,
    };
    let first = WorkerProcess::start(&f.settings);
    f.kill(&dead).await;
    wait_until(
        &f.redis,
        "the cleanup under way",
        Duration::from_secs(30),
        || async { scanned(&f, &dead).await.is_some_and(|n| n > 0) },
    )
    .await;
    let stopped_at = Instant::now();
    first.signal("TERM");
    let (status, log) = first.wait(Duration::from_secs(10));
    let took = stopped_at.elapsed();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(
        took < Duration::from_secs(3),
        "stopped in {took:?}, drain timeout 300 ms"
    );
    assert!(log.contains("abandoned"), "{log}");
    let pending = status::collect_from(&f.conn, &f.keys).await.unwrap();
    assert_eq!(pending.pending, 1, "the unfinished entry stays pending");
    let left = unfinished(&f, std::slice::from_ref(&dead)).await;
    assert!(
        left > 0,
        "the cleanup had finished; nothing was left to take over"
    );

    let second = WorkerProcess::start(&f.settings);
    f.wait_idle().await;
    assert_eq!(f.still_pointing(&dead, USERS).await, 0);
    if let Some(devices) = &devices {
        devices.assert_end_state(&f.registry, &f.conn, &[]).await;
        assert_eq!(
            connections_naming(&[f.redis.url()], &f.keys, &dead).await,
            vec![]
        );
    }
    second.signal("TERM");
    let (status, log) = second.wait(Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert!(log.contains("taking over an idle entry"), "{log}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 12, ..Default::default() })]

    /// Random bytes and random field sets as stream entries: no panic, every bad
    /// `server.dead` entry dead-lettered, every entry acknowledged, the group keeps moving.
    #[test]
    fn random_entries_never_block_the_group(batch in proptest::collection::vec(entry_strategy(), 1..25)) {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(random_entries(batch));
    }
}

fn entry_strategy() -> impl proptest::strategy::Strategy<Value = Vec<(Vec<u8>, Vec<u8>)>> {
    use proptest::prelude::*;
    let valid = ServerDead::new(&server("gw-prop#1"), Some("r".into()), None).encode();
    let payload = prop_oneof![
        Just(valid.clone()),
        proptest::collection::vec(any::<u8>(), 0..80),
        (0..valid.len(), any::<u8>()).prop_map(move |(i, b)| {
            let mut p = valid.clone();
            p[i] = b;
            p
        }),
    ];
    let key = prop_oneof![
        Just(b"type".to_vec()),
        Just(b"payload".to_vec()),
        proptest::collection::vec(any::<u8>(), 0..8),
    ];
    let kind = prop_oneof![
        Just(b"server.dead".to_vec()),
        Just(b"user.left".to_vec()),
        proptest::collection::vec(any::<u8>(), 0..12),
    ];
    proptest::collection::vec((key, kind, payload), 1..4).prop_map(|fields| {
        fields
            .into_iter()
            .map(|(k, kind, payload)| {
                let v = match k.as_slice() {
                    b"type" => kind,
                    _ => payload,
                };
                (k, v)
            })
            .collect()
    })
}

async fn random_entries(batch: Vec<Vec<(Vec<u8>, Vec<u8>)>>) {
    let f = Fixture::new(Layout::Hash);
    let mut expected_dead = 0;
    for fields in &batch {
        let pairs: Vec<(&[u8], &[u8])> = fields
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
            .collect();
        let id = stream::publish(&f.conn, &f.keys.events(), &pairs)
            .await
            .unwrap();
        // What Redis stored (a repeated field name is stored twice; the first one counts).
        let entry = Entry {
            id,
            fields: fields.clone(),
        };
        if matches!(
            classify(&entry, f.settings.max_payload_bytes),
            Classified::Malformed(_)
        ) {
            expected_dead += 1;
        }
    }
    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    // An entry is acknowledged before its handler counts it.
    worker.settled().await;
    let dead_letters = f.dead_letters().await;
    assert_eq!(dead_letters.len(), expected_dead);
    assert!(dead_letters
        .iter()
        .all(|d| d.field("error").is_some_and(|e| !e.is_empty())));
    let m = &worker.metrics;
    let handled = events_with(m, outcome::CLEANED)
        + events_with(m, outcome::IGNORED)
        + events_with(m, outcome::DEAD_LETTERED);
    assert_eq!(
        handled,
        batch.len() as u64,
        "every entry handled exactly once"
    );
    worker.stop().await;
}

/// A healthy worker on a long cleanup keeps its entry fresh: a second worker, ready to
/// take over anything idle for two seconds, never takes it. (The keep-alive touches the
/// entry every third of that: a stall of over a second on a busy machine would let it
/// look idle, so the idle time is not shorter.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_healthy_cleanup_is_not_taken_over() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.chunk_size = 2;
        s.chunks_in_flight = 1;
        s.claim_min_idle_ms = 2000;
    });
    const USERS: usize = 60_000;
    let dead = server("gw-huge#1");
    f.seed(&dead, USERS).await;
    let first = spawn_worker(&f.settings);
    f.kill(&dead).await;
    let started = Instant::now();
    wait_until(
        &f.redis,
        "the first worker has the entry",
        Duration::from_secs(10),
        || async {
            status::collect_from(&f.conn, &f.keys)
                .await
                .is_ok_and(|s| s.pending == 1)
        },
    )
    .await;
    let second = spawn_worker(&f.settings);
    f.wait_idle().await;
    let took = started.elapsed();
    second.settled().await;
    assert_eq!(
        second.metrics.entries_claimed.get(),
        0,
        "the healthy cleanup was taken over"
    );
    // Long enough that, without the keep-alive, the entry would have looked idle for
    // claim_min_idle_ms (2 s) and been claimed at the next round (every 500 ms).
    assert!(
        took > Duration::from_secs(3),
        "the cleanup took {took:?}: too short to prove anything"
    );
    first.settled().await;
    assert_eq!(events_with(&first.metrics, outcome::CLEANED), 1);
    assert_eq!(f.still_pointing(&dead, USERS).await, 0);
    first.stop().await;
    second.stop().await;
}

/// A cleanup that keeps failing (the registry key has the wrong type) stays pending, is
/// retried by takeover, and is dead-lettered after `max_deliveries` with its last error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanup_that_keeps_failing_is_dead_lettered_with_its_last_error() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.claim_min_idle_ms = 1000;
        s.max_deliveries = 2;
    });
    let dead = server("gw-broken#1");
    let _: () = f
        .query(redis::cmd("SADD").arg(f.keys.server_users(&dead)).arg("u1"))
        .await;
    let _: () = f
        .query(redis::cmd("SET").arg(f.keys.registry()).arg("not a hash"))
        .await;
    let worker = spawn_worker(&f.settings);
    f.kill(&dead).await;
    wait_until(
        &f.redis,
        "the entry dead-lettered",
        Duration::from_secs(30),
        || async { f.dead_letters().await.len() == 1 },
    )
    .await;
    f.wait_idle().await;
    let dl = &f.dead_letters().await[0];
    let error = String::from_utf8_lossy(dl.field("error").unwrap()).into_owned();
    assert!(error.contains("delivered 3 times"), "{error}");
    assert!(
        error.contains("WRONGTYPE"),
        "the last error is kept: {error}"
    );
    worker.settled().await;
    assert_eq!(events_with(&worker.metrics, outcome::FAILED), 2);
    worker.stop().await;
}

/// The stream (and with it the group) vanishes under a running worker, as after a Redis
/// restart without persistence: the worker creates the group again and carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_group_is_created_again_when_the_stream_vanishes() {
    let f = Fixture::new(Layout::Hash);
    let worker = spawn_worker(&f.settings);
    let first = server("gw-1#1");
    f.seed(&first, 100).await;
    f.kill(&first).await;
    f.wait_idle().await;
    let _: () = f.query(redis::cmd("DEL").arg(f.keys.events())).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let second = server("gw-2#1");
    f.seed(&second, 100).await;
    f.kill(&second).await;
    f.wait_idle().await;
    assert_eq!(f.still_pointing(&second, 100).await, 0);
    worker.settled().await;
    assert_eq!(events_with(&worker.metrics, outcome::CLEANED), 2);
    worker.stop().await;
}

/// SCRIPT FLUSH in the middle of cleanups (as after a restart or failover): the scripts
/// are loaded again and the work finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_are_loaded_again_after_script_flush() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.chunk_size = 20;
        s.chunks_in_flight = 1;
    });
    const USERS: usize = 20_000;
    let dead = server("gw-flush#1");
    f.seed(&dead, USERS).await;
    let worker = spawn_worker(&f.settings);
    f.kill(&dead).await;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _: () = f.query(&redis::cmd("SCRIPT").arg("FLUSH").to_owned()).await;
    }
    f.wait_idle().await;
    assert_eq!(f.still_pointing(&dead, USERS).await, 0);
    worker.settled().await;
    assert_eq!(events_with(&worker.metrics, outcome::CLEANED), 1);
    assert_eq!(events_with(&worker.metrics, outcome::FAILED), 0);
    worker.stop().await;
}

/// A pending entry deleted from the stream (XDEL) is dropped and counted by the takeover,
/// not retried forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_entry_deleted_from_the_stream_is_counted_and_dropped() {
    let f = Fixture::new(Layout::Hash);
    stream::ensure_group(&f.conn, &f.keys).await.unwrap();
    let id = f.kill(&server("gw-gone#1")).await;
    stream::read_new(&f.conn, &f.keys, "crashed", 1, 100)
        .await
        .unwrap();
    let _: () = f
        .query(redis::cmd("XDEL").arg(f.keys.events()).arg(&id))
        .await;
    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    worker.settled().await;
    assert_eq!(worker.metrics.entries_vanished.get(), 1);
    assert_eq!(worker.metrics.entries_claimed.get(), 0);
    worker.stop().await;
}

/// Entries taken over are handled with their true delivery counts, even when the worker
/// already holds entries of its own between them in the pending list (here: B, pending to
/// the worker's consumer, between A and C). A and C were delivered 10 times before; the
/// takeover makes 11, past `max_deliveries`: both are dead-lettered with that count, and
/// their servers are left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claimed_entries_are_handled_with_their_true_delivery_counts() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.claim_min_idle_ms = 3000;
        s.max_deliveries = 5;
        s.consumer_name = Some("w1".into());
    });
    let (a, b, c) = (server("gw-a#1"), server("gw-b#1"), server("gw-c#1"));
    stream::ensure_group(&f.conn, &f.keys).await.unwrap();
    let mut ids = Vec::new();
    for s in [&a, &b, &c] {
        f.seed(s, 50).await;
        ids.push(f.kill(s).await);
    }
    let read = stream::read_new(&f.conn, &f.keys, "ghost", 3, 100)
        .await
        .unwrap();
    assert_eq!(read.len(), 3);
    let group = registry_janitor::keys::GROUP;
    // A and C: delivered 10 times to a consumer that died long ago.
    let _: () = f
        .query(
            redis::cmd("XCLAIM")
                .arg(f.keys.events())
                .arg(group)
                .arg("ghost")
                .arg(0)
                .arg(&ids[0])
                .arg(&ids[2])
                .arg("IDLE")
                .arg(3_600_000)
                .arg("RETRYCOUNT")
                .arg(10)
                .arg("JUSTID"),
        )
        .await;
    // B: the worker's own, recently active (as a cleanup in hand would be).
    let _: () = f
        .query(
            redis::cmd("XCLAIM")
                .arg(f.keys.events())
                .arg(group)
                .arg("w1")
                .arg(0)
                .arg(&ids[1])
                .arg("JUSTID"),
        )
        .await;
    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    worker.stop().await;

    let letters = f.dead_letters().await;
    let mut errors: Vec<(String, String)> = letters
        .iter()
        .map(|dl| {
            let (_, server) = ServerDead::decode(dl.field("payload").unwrap(), 65536).unwrap();
            let error = String::from_utf8_lossy(dl.field("error").unwrap()).into_owned();
            (server.to_string(), error)
        })
        .collect();
    errors.sort();
    assert_eq!(errors.len(), 2, "{errors:?}");
    for ((server, error), want) in errors.iter().zip([&a, &c]) {
        assert_eq!(server, want.as_str());
        assert!(error.contains("delivered 11 times"), "{error}");
    }
    assert_eq!(
        f.still_pointing(&a, 50).await,
        50,
        "a was dead-lettered, not cleaned"
    );
    assert_eq!(
        f.still_pointing(&c, 50).await,
        50,
        "c was dead-lettered, not cleaned"
    );
    assert_eq!(f.still_pointing(&b, 50).await, 0, "b was cleaned");
}

/// A rolling deploy: a long cleanup is handed over at SIGTERM (drain timeout reached) more
/// times than `max_deliveries`, each time to a new worker process. Graceful hand-offs are
/// not failed deliveries: the cleanup is never dead-lettered, and the last worker finishes
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_hand_offs_do_not_count_toward_max_deliveries() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.chunk_size = 2;
        s.chunks_in_flight = 1;
        s.drain_timeout_ms = 50;
        s.claim_min_idle_ms = 1000;
        s.max_deliveries = 2;
    });
    const USERS: usize = 60_000;
    const RESTARTS: usize = 4;
    let dead = server("gw-rolling#1");
    f.seed(&dead, USERS).await;
    stream::ensure_group(&f.conn, &f.keys).await.unwrap();
    let id = f.kill(&dead).await;
    let owner = || async {
        let rows: Vec<(String, String, u64, u64)> = f
            .query(
                redis::cmd("XPENDING")
                    .arg(f.keys.events())
                    .arg(registry_janitor::keys::GROUP)
                    .arg(&id)
                    .arg(&id)
                    .arg(1),
            )
            .await;
        rows.into_iter().next().map(|(_, consumer, _, _)| consumer)
    };
    for round in 0..RESTARTS {
        let name = format!("rolling-{round}");
        let worker = WorkerProcess::start_with(&f.settings, &[("JANITOR_CONSUMER_NAME", &name)]);
        wait_until(
            &f.redis,
            &format!("{name} has the entry (or it is no longer pending)"),
            Duration::from_secs(30),
            || async {
                match owner().await {
                    Some(o) => o == name,
                    // Not pending: delivered and settled, or not delivered yet.
                    None => status::collect_from(&f.conn, &f.keys)
                        .await
                        .is_ok_and(|s| s.lag == Some(0)),
                }
            },
        )
        .await;
        worker.signal("TERM");
        let (status, log) = worker.wait(Duration::from_secs(10));
        assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
        assert!(
            owner().await.is_some(),
            "after {} graceful hand-off(s) the entry is no longer pending; dead letters: {:?}\n{log}",
            round + 1,
            f.dead_letters()
                .await
                .iter()
                .map(|dl| String::from_utf8_lossy(dl.field("error").unwrap_or_default()).into_owned())
                .collect::<Vec<_>>()
        );
        assert!(log.contains("abandoned"), "{log}");
    }
    assert!(
        f.still_pointing(&dead, USERS).await > 0,
        "the cleanup had finished before the last restart: nothing was handed off"
    );
    let last = WorkerProcess::start_with(&f.settings, &[("JANITOR_CHUNK_SIZE", "1000")]);
    f.wait_idle().await;
    assert_eq!(f.still_pointing(&dead, USERS).await, 0);
    assert_eq!(owner().await, None, "acknowledged");
    assert!(
        f.dead_letters().await.is_empty(),
        "{:?}",
        f.dead_letters().await
    );
    last.signal("TERM");
    let (status, log) = last.wait(Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
}
