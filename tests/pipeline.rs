//! The cleanup pipeline end to end against a real redis-server: events in, registry
//! cleaned, acknowledgements out. Workers run in this process; `cli.rs` runs them as
//! real processes.

mod common;

use std::time::Duration;

use common::*;
use registry_janitor::{
    config::Layout,
    event::{ServerDead, EVENT_TYPE},
    keys::{Keys, GROUP},
    metrics::outcome,
    registry::Registry,
    stream,
};

type Fields = Vec<(Vec<u8>, Vec<u8>)>;

async fn cleans_dead_servers(layout: Layout) {
    let redis = redis();
    let settings = settings(&redis, layout);
    let conn = connect(&settings);
    let keys = Keys::new(settings.key_prefix.clone());
    let registry = Registry::new(keys.clone(), layout);
    let (a, b, live) = (server("gw-a#1"), server("gw-b#1"), server("gw-live#1"));
    for s in [&a, &b, &live] {
        seed(&registry, &conn, s, 5_000).await;
    }
    // Two of a's users reconnected to the live server before the event.
    registry.register(&conn, &user(&a, 7), &live).await.unwrap();
    registry
        .register(&conn, &user(&a, 4_999), &live)
        .await
        .unwrap();

    let worker = spawn_worker(&settings);
    kill(&conn, &keys, &a).await;
    kill(&conn, &keys, &b).await;
    wait_idle(&redis, &conn, &keys).await;

    assert_eq!(still_pointing(&registry, &conn, &a, 5_000).await, 0);
    assert_eq!(still_pointing(&registry, &conn, &b, 5_000).await, 0);
    assert_eq!(still_pointing(&registry, &conn, &live, 5_000).await, 5_000);
    assert_eq!(
        registry
            .owner(&conn, &user(&a, 7))
            .await
            .unwrap()
            .as_deref(),
        Some("gw-live#1")
    );
    assert_eq!(
        registry
            .owner(&conn, &user(&a, 4_999))
            .await
            .unwrap()
            .as_deref(),
        Some("gw-live#1")
    );
    assert_eq!(registry.owner(&conn, &user(&a, 8)).await.unwrap(), None);
    let mut c = conn.clone();
    let (sets, progress, dead_scores, live_score): (u64, u64, Vec<Option<f64>>, Option<f64>) =
        redis::pipe()
            .exists(&[keys.server_users(&a), keys.server_users(&b)])
            .exists(&[keys.server_cleanup(&a), keys.server_cleanup(&b)])
            .cmd("ZMSCORE")
            .arg(keys.servers())
            .arg(a.as_str())
            .arg(b.as_str())
            .zscore(keys.servers(), live.as_str())
            .query_async(&mut c)
            .await
            .unwrap();
    assert_eq!(
        (sets, progress),
        (0, 0),
        "reverse sets and progress records are gone"
    );
    assert_eq!(dead_scores, vec![None, None], "dead servers left `servers`");
    assert!(live_score.is_some(), "the live server is still known");
    assert_eq!(worker.metrics.events_with(outcome::CLEANED), 2);
    assert_eq!(worker.metrics.entries_deleted.get(), 9_998);
    assert_eq!(worker.metrics.entries_kept.get(), 2);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleans_dead_servers_hash_layout() {
    cleans_dead_servers(Layout::Hash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleans_dead_servers_keys_layout() {
    cleans_dead_servers(Layout::Keys).await;
}

/// Users reconnect elsewhere while their old server is being cleaned; every one of them
/// keeps the new entry, whatever the interleaving.
async fn reconnects_race_the_cleanup(layout: Layout) {
    let redis = redis();
    let mut settings = settings(&redis, layout);
    settings.chunk_size = 100;
    let conn = connect(&settings);
    let keys = Keys::new(settings.key_prefix.clone());
    let registry = Registry::new(keys.clone(), layout);
    let (dead, live) = (server("gw-dead#1"), server("gw-new#1"));
    const USERS: usize = 40_000;
    seed(&registry, &conn, &dead, USERS).await;

    let worker = spawn_worker(&settings);
    kill(&conn, &keys, &dead).await;
    // Move every 7th user, from the end of the id range backwards, while the worker runs.
    let mut moved_while_cleaning = 0;
    let mut moved = Vec::new();
    for n in (0..USERS).rev().step_by(7) {
        registry
            .register(&conn, &user(&dead, n), &live)
            .await
            .unwrap();
        moved.push(n);
        let left: u64 = redis::cmd("SCARD")
            .arg(keys.server_users(&dead))
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        if left > 0 {
            moved_while_cleaning += 1;
        }
    }
    wait_idle(&redis, &conn, &keys).await;
    assert!(
        moved_while_cleaning > 0,
        "no reconnect overlapped the cleanup; the test proves nothing"
    );
    for n in &moved {
        assert_eq!(
            registry
                .owner(&conn, &user(&dead, *n))
                .await
                .unwrap()
                .as_deref(),
            Some("gw-new#1"),
            "user {n} moved to gw-new#1 and must keep that entry"
        );
    }
    assert_eq!(still_pointing(&registry, &conn, &dead, USERS).await, 0);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_race_the_cleanup_hash_layout() {
    reconnects_race_the_cleanup(Layout::Hash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_race_the_cleanup_keys_layout() {
    reconnects_race_the_cleanup(Layout::Keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_no_users_is_cleaned() {
    let redis = redis();
    let settings = settings(&redis, Layout::Hash);
    let conn = connect(&settings);
    let keys = Keys::new(settings.key_prefix.clone());
    let registry = Registry::new(keys.clone(), Layout::Hash);
    let empty = server("gw-empty#1");
    registry.heartbeat(&conn, &empty, 60_000).await.unwrap();
    let worker = spawn_worker(&settings);
    kill(&conn, &keys, &empty).await;
    wait_idle(&redis, &conn, &keys).await;
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(keys.servers())
        .arg(empty.as_str())
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    assert_eq!(score, None);
    assert_eq!(worker.metrics.events_with(outcome::CLEANED), 1);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_events_give_the_same_end_state() {
    let redis = redis();
    let settings = settings(&redis, Layout::Hash);
    let conn = connect(&settings);
    let keys = Keys::new(settings.key_prefix.clone());
    let registry = Registry::new(keys.clone(), Layout::Hash);
    let (dead, live) = (server("gw-dup#1"), server("gw-live#1"));
    seed(&registry, &conn, &dead, 3_000).await;
    seed(&registry, &conn, &live, 1_000).await;
    registry
        .register(&conn, &user(&dead, 1), &live)
        .await
        .unwrap();
    // The same payload twice (a producer retry), and a second event for the same server.
    let payload = ServerDead::new(&dead, None, Some("monitoring".into())).encode();
    stream::publish_event(&conn, &keys, &payload).await.unwrap();
    stream::publish_event(&conn, &keys, &payload).await.unwrap();
    kill(&conn, &keys, &dead).await;
    let mut settings = settings;
    settings.concurrency = 3;
    let worker = spawn_worker(&settings);
    wait_idle(&redis, &conn, &keys).await;
    assert_eq!(worker.metrics.events_with(outcome::CLEANED), 3);
    assert_eq!(still_pointing(&registry, &conn, &dead, 3_000).await, 0);
    assert_eq!(still_pointing(&registry, &conn, &live, 1_000).await, 1_000);
    assert_eq!(
        registry
            .owner(&conn, &user(&dead, 1))
            .await
            .unwrap()
            .as_deref(),
        Some("gw-live#1")
    );
    // Each entry was deleted once, whichever event's steps did it.
    assert_eq!(worker.metrics.entries_deleted.get(), 2_999);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_share_one_stream() {
    let redis = redis();
    let mut settings = settings(&redis, Layout::Keys);
    settings.concurrency = 1;
    let conn = connect(&settings);
    let keys = Keys::new(settings.key_prefix.clone());
    let registry = Registry::new(keys.clone(), Layout::Keys);
    let dead: Vec<_> = (0..6).map(|i| server(&format!("gw-{i}#1"))).collect();
    for s in &dead {
        seed(&registry, &conn, s, 4_000).await;
    }
    let one = spawn_worker(&settings);
    let two = spawn_worker(&settings);
    assert_ne!(
        one.consumer, two.consumer,
        "each worker has its own consumer name"
    );
    for s in &dead {
        kill(&conn, &keys, s).await;
    }
    wait_idle(&redis, &conn, &keys).await;
    for s in &dead {
        assert_eq!(still_pointing(&registry, &conn, s, 4_000).await, 0, "{s}");
    }
    let cleaned =
        one.metrics.events_with(outcome::CLEANED) + two.metrics.events_with(outcome::CLEANED);
    assert_eq!(
        cleaned, 6,
        "every event cleaned exactly once across the two workers"
    );
    assert_eq!(
        one.metrics.entries_deleted.get() + two.metrics.entries_deleted.get(),
        24_000
    );
    one.stop().await;
    two.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_entries_are_dead_lettered_and_the_group_moves_on() {
    let redis = redis();
    let settings = settings(&redis, Layout::Hash);
    let conn = connect(&settings);
    let keys = Keys::new(settings.key_prefix.clone());
    let registry = Registry::new(keys.clone(), Layout::Hash);
    let good = server("gw-good#1");
    seed(&registry, &conn, &good, 1_000).await;

    let valid = ServerDead::new(&good, None, None);
    let with = |f: &dyn Fn(&mut ServerDead)| {
        let mut e = valid.clone();
        f(&mut e);
        rmp_serde::to_vec_named(&e).unwrap()
    };
    let t = EVENT_TYPE.as_bytes();
    // (the entry's fields, what its dead letter's `error` must mention)
    let cases: Vec<(Fields, &str)> = vec![
        (
            vec![
                (b"type".to_vec(), t.to_vec()),
                (b"payload".to_vec(), b"not msgpack".to_vec()),
            ],
            "MessagePack",
        ),
        (vec![(b"type".to_vec(), t.to_vec())], "no `payload` field"),
        (
            vec![(b"payload".to_vec(), valid.encode())],
            "no `type` field",
        ),
        (
            vec![
                (b"type".to_vec(), t.to_vec()),
                (
                    b"payload".to_vec(),
                    with(&|e| e.server_id = "gw-{x}".into()),
                ),
            ],
            "server_id",
        ),
        (
            vec![
                (b"type".to_vec(), t.to_vec()),
                (b"payload".to_vec(), with(&|e| e.v = 2)),
            ],
            "v=2",
        ),
        (
            vec![
                (b"type".to_vec(), t.to_vec()),
                (b"payload".to_vec(), with(&|e| e.event_id = String::new())),
            ],
            "event_id",
        ),
        (
            vec![
                (b"type".to_vec(), t.to_vec()),
                (b"payload".to_vec(), vec![0x80; 70_000]),
            ],
            "limit",
        ),
        (
            vec![
                (b"type".to_vec(), t.to_vec()),
                (b"\xff\xfe".to_vec(), b"\x00".to_vec()),
            ],
            "no `payload` field",
        ),
    ];
    for (fields, _) in &cases {
        let fields: Vec<(&[u8], &[u8])> = fields
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
            .collect();
        stream::publish(&conn, &keys.events(), &fields)
            .await
            .unwrap();
    }
    kill(&conn, &keys, &good).await;

    let worker = spawn_worker(&settings);
    wait_idle(&redis, &conn, &keys).await;
    let dead_letters = read_stream(&conn, &keys.dead_letters()).await;
    assert_eq!(dead_letters.len(), cases.len());
    for (fields, why) in &cases {
        // Entries are handled concurrently: find each case's dead letter by its fields.
        let dl = dead_letters
            .iter()
            .find(|dl| {
                fields.iter().all(|f| dl.fields.contains(f)) && dl.fields.len() == fields.len() + 2
            })
            .unwrap_or_else(|| panic!("no dead letter for the case {why:?}"));
        let error = String::from_utf8(dl.field("error").unwrap().to_vec()).unwrap();
        assert!(
            error.contains(why),
            "error {error:?} should mention {why:?}"
        );
        let failed_at: u64 = std::str::from_utf8(dl.field("failed_at_ms").unwrap())
            .unwrap()
            .parse()
            .unwrap();
        assert!(failed_at > 1_700_000_000_000);
        for (k, v) in fields {
            assert!(
                dl.fields.contains(&(k.clone(), v.clone())),
                "original field {k:?} kept"
            );
        }
    }
    assert_eq!(
        worker.metrics.events_with(outcome::DEAD_LETTERED),
        cases.len() as u64
    );
    assert_eq!(
        worker.metrics.events_with(outcome::CLEANED),
        1,
        "the valid event after them was cleaned"
    );
    assert_eq!(still_pointing(&registry, &conn, &good, 1_000).await, 0);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_types_are_acknowledged_not_dead_lettered() {
    let redis = redis();
    let settings = settings(&redis, Layout::Hash);
    let conn = connect(&settings);
    let keys = Keys::new(settings.key_prefix.clone());
    for kind in ["user.joined", "server.alive", ""] {
        stream::publish(
            &conn,
            &keys.events(),
            &[(b"type", kind.as_bytes()), (b"payload", b"\x90")],
        )
        .await
        .unwrap();
    }
    let worker = spawn_worker(&settings);
    wait_idle(&redis, &conn, &keys).await;
    assert_eq!(worker.metrics.events_with(outcome::IGNORED), 3);
    let dead: u64 = redis::cmd("XLEN")
        .arg(keys.dead_letters())
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    assert_eq!(dead, 0);
    worker.stop().await;
}

/// A consumer took an entry and died without acknowledging it: another worker takes it
/// over once it has been idle for `claim_min_idle_ms`, and cleans the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_left_by_a_crashed_consumer_is_taken_over() {
    let redis = redis();
    let settings = settings(&redis, Layout::Hash);
    let conn = connect(&settings);
    let keys = Keys::new(settings.key_prefix.clone());
    let registry = Registry::new(keys.clone(), Layout::Hash);
    let dead = server("gw-orphan#1");
    seed(&registry, &conn, &dead, 2_000).await;
    stream::ensure_group(&conn, &keys).await.unwrap();
    kill(&conn, &keys, &dead).await;
    let taken = stream::read_new(&conn, &keys, "crashed-consumer", 10, 100)
        .await
        .unwrap();
    assert_eq!(taken.len(), 1);

    let worker = spawn_worker(&settings);
    wait_idle(&redis, &conn, &keys).await;
    assert_eq!(worker.metrics.entries_claimed.get(), 1);
    assert_eq!(worker.metrics.events_with(outcome::CLEANED), 1);
    assert_eq!(still_pointing(&registry, &conn, &dead, 2_000).await, 0);
    worker.stop().await;
}

/// An entry that keeps failing (here: delivered and abandoned over and over) is
/// dead-lettered once it has been delivered more than `max_deliveries` times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_delivered_too_often_is_dead_lettered() {
    let redis = redis();
    let mut settings = settings(&redis, Layout::Hash);
    settings.max_deliveries = 3;
    let conn = connect(&settings);
    let keys = Keys::new(settings.key_prefix.clone());
    stream::ensure_group(&conn, &keys).await.unwrap();
    let id = kill(&conn, &keys, &server("gw-poison#1")).await;
    stream::read_new(&conn, &keys, "crashed-1", 1, 100)
        .await
        .unwrap();
    for n in 2..=3 {
        // Each XCLAIM by a new consumer counts as one more delivery.
        let _: redis::Value = redis::cmd("XCLAIM")
            .arg(keys.events())
            .arg(GROUP)
            .arg(format!("crashed-{n}"))
            .arg(0)
            .arg(&id)
            .query_async(&mut conn.clone())
            .await
            .unwrap();
    }
    let worker = spawn_worker(&settings);
    wait_idle(&redis, &conn, &keys).await;
    let dead_letters = read_stream(&conn, &keys.dead_letters()).await;
    assert_eq!(dead_letters.len(), 1);
    let error = String::from_utf8_lossy(dead_letters[0].field("error").unwrap()).into_owned();
    assert!(error.contains("delivered 4 times"), "{error}");
    assert_eq!(dead_letters[0].field("type"), Some(EVENT_TYPE.as_bytes()));
    assert_eq!(worker.metrics.events_with(outcome::CLEANED), 0);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_published_before_the_first_worker_are_processed() {
    let redis = redis();
    let settings = settings(&redis, Layout::Hash);
    let conn = connect(&settings);
    let keys = Keys::new(settings.key_prefix.clone());
    let registry = Registry::new(keys.clone(), Layout::Hash);
    let early = server("gw-early#1");
    seed(&registry, &conn, &early, 500).await;
    kill(&conn, &keys, &early).await; // the stream exists, the group does not
    tokio::time::sleep(Duration::from_millis(50)).await;
    let worker = spawn_worker(&settings);
    wait_idle(&redis, &conn, &keys).await;
    assert_eq!(still_pointing(&registry, &conn, &early, 500).await, 0);
    assert_eq!(worker.metrics.events_with(outcome::CLEANED), 1);
    worker.stop().await;
}
