//! The cleanup pipeline end to end against a real redis-server: events in, registry
//! cleaned, acknowledgements out. Workers run in this process; `cli.rs` runs them as
//! real processes.

mod common;

use std::time::Duration;

use common::*;
use registry_janitor::{
    config::Layout,
    event::{ServerDead, EVENT_TYPE},
    keys::GROUP,
    metrics::outcome,
    stream,
};

/// (the entry's fields, what its dead letter's `error` must mention)
type Case = (Vec<(Vec<u8>, Vec<u8>)>, &'static str);

async fn cleans_dead_servers(layout: Layout) {
    let f = Fixture::new(layout);
    let (a, b, live) = (server("gw-a#1"), server("gw-b#1"), server("gw-live#1"));
    for s in [&a, &b, &live] {
        f.seed(s, 5_000).await;
    }
    // Two of a's users reconnected to the live server before the event.
    f.reconnect(&entry(layout, &a, 7), &live).await;
    f.reconnect(&entry(layout, &a, 4_999), &live).await;

    let worker = spawn_worker(&f.settings);
    f.kill(&a).await;
    f.kill(&b).await;
    f.wait_idle().await;

    assert_eq!(f.still_pointing(&a, 5_000).await, 0);
    assert_eq!(f.still_pointing(&b, 5_000).await, 0);
    assert_eq!(f.still_pointing(&live, 5_000).await, 5_000);
    assert_eq!(
        f.owner(&entry(layout, &a, 7)).await.as_deref(),
        Some("gw-live#1")
    );
    assert_eq!(
        f.owner(&entry(layout, &a, 4_999)).await.as_deref(),
        Some("gw-live#1")
    );
    assert_eq!(f.owner(&entry(layout, &a, 8)).await, None);
    let k = &f.keys;
    let sets: u64 = f
        .query(
            redis::cmd("EXISTS")
                .arg(k.server_users(&a))
                .arg(k.server_users(&b)),
        )
        .await;
    let progress: u64 = f
        .query(
            redis::cmd("EXISTS")
                .arg(k.server_cleanup(&a))
                .arg(k.server_cleanup(&b)),
        )
        .await;
    assert_eq!(
        (sets, progress),
        (0, 0),
        "reverse sets and progress records are gone"
    );
    let scores: Vec<Option<f64>> = f
        .query(
            redis::cmd("ZMSCORE")
                .arg(k.servers())
                .arg(a.as_str())
                .arg(b.as_str())
                .arg(live.as_str()),
        )
        .await;
    assert_eq!(scores[..2], [None, None], "dead servers left `servers`");
    assert!(scores[2].is_some(), "the live server is still known");
    worker.settled().await;
    assert_eq!(events_with(&worker.metrics, outcome::CLEANED), 2);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleans_dead_servers_conns_layout() {
    cleans_dead_servers(Layout::Conns).await;
}

/// Users reconnect elsewhere while their old server is being cleaned; every one of them
/// keeps the new entry, whatever the interleaving.
async fn reconnects_race_the_cleanup(layout: Layout) {
    let f = Fixture::with(layout, |s| s.chunk_size = 100);
    let (dead, live) = (server("gw-dead#1"), server("gw-new#1"));
    const USERS: usize = 40_000;
    f.seed(&dead, USERS).await;

    let worker = spawn_worker(&f.settings);
    f.kill(&dead).await;
    // Move every 7th user, from the end of the id range backwards, while the worker runs.
    let mut moved_while_cleaning = 0;
    let mut moved = Vec::new();
    for n in (0..USERS).rev().step_by(7) {
        f.reconnect(&entry(layout, &dead, n), &live).await;
        moved.push(n);
        let left: u64 = f
            .query(redis::cmd("EXISTS").arg(&f.keys.server_members_left(&dead)))
            .await;
        if left > 0 {
            moved_while_cleaning += 1;
        }
    }
    f.wait_idle().await;
    assert!(
        moved_while_cleaning > 0,
        "no reconnect overlapped the cleanup; the test proves nothing"
    );
    for n in &moved {
        assert_eq!(
            f.owner(&entry(layout, &dead, *n)).await.as_deref(),
            Some("gw-new#1"),
            "user {n} moved to gw-new#1 and must keep that entry"
        );
    }
    assert_eq!(f.still_pointing(&dead, USERS).await, 0);
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
async fn reconnects_race_the_cleanup_conns_layout() {
    reconnects_race_the_cleanup(Layout::Conns).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_no_users_is_cleaned() {
    let f = Fixture::new(Layout::Hash);
    let empty = server("gw-empty#1");
    f.registry.heartbeat(&f.conn, &empty, 60_000).await.unwrap();
    let worker = spawn_worker(&f.settings);
    f.kill(&empty).await;
    f.wait_idle().await;
    let score: Option<f64> = f
        .query(
            redis::cmd("ZSCORE")
                .arg(f.keys.servers())
                .arg(empty.as_str()),
        )
        .await;
    assert_eq!(score, None);
    worker.settled().await;
    assert_eq!(events_with(&worker.metrics, outcome::CLEANED), 1);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_events_give_the_same_end_state() {
    let f = Fixture::with(Layout::Hash, |s| s.concurrency = 3);
    let (dead, live) = (server("gw-dup#1"), server("gw-live#1"));
    f.seed(&dead, 3_000).await;
    f.seed(&live, 1_000).await;
    f.reconnect(&user(&dead, 1), &live).await;
    // The same payload twice (a producer retry), and a second event for the same server.
    let payload = ServerDead::new(&dead, None, Some("monitoring".into())).encode();
    stream::publish_event(&f.conn, &f.keys, &payload)
        .await
        .unwrap();
    stream::publish_event(&f.conn, &f.keys, &payload)
        .await
        .unwrap();
    f.kill(&dead).await;
    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    worker.settled().await;
    assert_eq!(events_with(&worker.metrics, outcome::CLEANED), 3);
    assert_eq!(f.still_pointing(&dead, 3_000).await, 0);
    assert_eq!(f.still_pointing(&live, 1_000).await, 1_000);
    assert_eq!(f.owner(&user(&dead, 1)).await.as_deref(), Some("gw-live#1"));
    // Each entry was deleted once, whichever event's steps did it.
    assert_eq!(worker.metrics.entries_deleted.get(), 2_999);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_share_one_stream() {
    let f = Fixture::with(Layout::Keys, |s| s.concurrency = 1);
    let dead: Vec<_> = (0..6).map(|i| server(&format!("gw-{i}#1"))).collect();
    for s in &dead {
        f.seed(s, 4_000).await;
    }
    let one = spawn_worker(&f.settings);
    let two = spawn_worker(&f.settings);
    assert_ne!(
        one.consumer, two.consumer,
        "each worker has its own consumer name"
    );
    for s in &dead {
        f.kill(s).await;
    }
    f.wait_idle().await;
    for s in &dead {
        assert_eq!(f.still_pointing(s, 4_000).await, 0, "{s}");
    }
    // Each worker counts its cleanups once it has the reply of the step that
    // acknowledged: wait for both.
    one.settled().await;
    two.settled().await;
    let cleaned =
        events_with(&one.metrics, outcome::CLEANED) + events_with(&two.metrics, outcome::CLEANED);
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
    let f = Fixture::new(Layout::Hash);
    let good = server("gw-good#1");
    f.seed(&good, 1_000).await;

    let valid = ServerDead::new(&good, None, None);
    let with = |change: &dyn Fn(&mut ServerDead)| {
        let mut e = valid.clone();
        change(&mut e);
        rmp_serde::to_vec_named(&e).unwrap()
    };
    let ours = |payload: Vec<u8>| {
        vec![
            (b"type".to_vec(), EVENT_TYPE.as_bytes().to_vec()),
            (b"payload".to_vec(), payload),
        ]
    };
    let cases: Vec<Case> = vec![
        (ours(b"not msgpack".to_vec()), "MessagePack"),
        (
            vec![(b"type".to_vec(), EVENT_TYPE.as_bytes().to_vec())],
            "no `payload` field",
        ),
        (
            vec![(b"payload".to_vec(), valid.encode())],
            "no `type` field",
        ),
        (ours(with(&|e| e.server_id = "gw-{x}".into())), "server_id"),
        (ours(with(&|e| e.v = 2)), "v=2"),
        (ours(with(&|e| e.event_id = String::new())), "event_id"),
        (ours(vec![0x80; 70_000]), "limit"),
        (
            vec![
                (b"type".to_vec(), EVENT_TYPE.as_bytes().to_vec()),
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
        stream::publish(&f.conn, &f.keys.events(), &fields)
            .await
            .unwrap();
    }
    f.kill(&good).await;

    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    let dead_letters = f.dead_letters().await;
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
    }
    worker.settled().await;
    assert_eq!(
        events_with(&worker.metrics, outcome::DEAD_LETTERED),
        cases.len() as u64
    );
    assert_eq!(
        events_with(&worker.metrics, outcome::CLEANED),
        1,
        "the valid event after them was cleaned"
    );
    assert_eq!(f.still_pointing(&good, 1_000).await, 0);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_types_are_acknowledged_not_dead_lettered() {
    let f = Fixture::new(Layout::Hash);
    for kind in ["user.joined", "server.alive", ""] {
        stream::publish(
            &f.conn,
            &f.keys.events(),
            &[(b"type", kind.as_bytes()), (b"payload", b"\x90")],
        )
        .await
        .unwrap();
    }
    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    worker.settled().await;
    assert_eq!(events_with(&worker.metrics, outcome::IGNORED), 3);
    assert!(f.dead_letters().await.is_empty());
    worker.stop().await;
}

/// A consumer took an entry and died without acknowledging it: another worker takes it
/// over once it has been idle for `claim_min_idle_ms`, and cleans the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_left_by_a_crashed_consumer_is_taken_over() {
    let f = Fixture::new(Layout::Hash);
    let dead = server("gw-orphan#1");
    f.seed(&dead, 2_000).await;
    stream::ensure_group(&f.conn, &f.keys).await.unwrap();
    f.kill(&dead).await;
    let taken = stream::read_new(&f.conn, &f.keys, "crashed-consumer", 10, 100)
        .await
        .unwrap();
    assert_eq!(taken.len(), 1);

    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    worker.settled().await;
    assert_eq!(worker.metrics.entries_claimed.get(), 1);
    assert_eq!(events_with(&worker.metrics, outcome::CLEANED), 1);
    assert_eq!(f.still_pointing(&dead, 2_000).await, 0);
    worker.stop().await;
}

/// An entry that keeps failing (here: delivered and abandoned over and over) is
/// dead-lettered once it has been delivered more than `max_deliveries` times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_delivered_too_often_is_dead_lettered() {
    let f = Fixture::with(Layout::Hash, |s| s.max_deliveries = 3);
    stream::ensure_group(&f.conn, &f.keys).await.unwrap();
    let id = f.kill(&server("gw-poison#1")).await;
    stream::read_new(&f.conn, &f.keys, "crashed-1", 1, 100)
        .await
        .unwrap();
    for n in 2..=3 {
        // Each XCLAIM by a new consumer counts as one more delivery.
        let _: redis::Value = f
            .query(
                redis::cmd("XCLAIM")
                    .arg(f.keys.events())
                    .arg(GROUP)
                    .arg(format!("crashed-{n}"))
                    .arg(0)
                    .arg(&id),
            )
            .await;
    }
    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    let dead_letters = f.dead_letters().await;
    assert_eq!(dead_letters.len(), 1);
    let error = String::from_utf8_lossy(dead_letters[0].field("error").unwrap()).into_owned();
    assert!(error.contains("delivered 4 times"), "{error}");
    assert_eq!(dead_letters[0].field("type"), Some(EVENT_TYPE.as_bytes()));
    worker.settled().await;
    assert_eq!(events_with(&worker.metrics, outcome::CLEANED), 0);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_published_before_the_first_worker_are_processed() {
    let f = Fixture::new(Layout::Hash);
    let early = server("gw-early#1");
    f.seed(&early, 500).await;
    f.kill(&early).await; // the stream exists, the group does not
    tokio::time::sleep(Duration::from_millis(50)).await;
    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    assert_eq!(f.still_pointing(&early, 500).await, 0);
    worker.settled().await;
    assert_eq!(events_with(&worker.metrics, outcome::CLEANED), 1);
    worker.stop().await;
}

/// User ids are 1 to 512 arbitrary bytes: glob characters, braces, spaces, newlines,
/// invalid UTF-8 and the longest allowed id all go through the cleanup like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_ids_with_any_bytes_are_cleaned() {
    for layout in [Layout::Hash, Layout::Keys] {
        let f = Fixture::new(layout);
        let (dead, live) = (server("gw-bytes#1"), server("gw-live#1"));
        let odd: Vec<Vec<u8>> = vec![
            b"*".to_vec(),
            b"user:{x}".to_vec(),
            b"a b\nc\r\n".to_vec(),
            vec![0xff, 0xfe, 0x00, 0x01],
            b"?[]\\".to_vec(),
            vec![b'x'; 512],
            b"moved \xff".to_vec(),
        ];
        for u in &odd {
            f.registry.register(&f.conn, u, &dead).await.unwrap();
        }
        f.reconnect(b"moved \xff", &live).await;
        let worker = spawn_worker(&f.settings);
        f.kill(&dead).await;
        f.wait_idle().await;
        for u in &odd[..6] {
            assert_eq!(f.owner(u).await, None, "{layout:?}: {u:?} still registered");
        }
        assert_eq!(
            f.owner(b"moved \xff").await.as_deref(),
            Some("gw-live#1"),
            "{layout:?}"
        );
        worker.settled().await;
        assert_eq!(worker.metrics.entries_deleted.get(), 6);
        worker.stop().await;
    }
}

/// The connection-server API's clean disconnect: the forward entry goes only if it still
/// names the server; the reverse-set member goes either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_removes_only_an_entry_that_is_still_ours() {
    for layout in [Layout::Hash, Layout::Keys] {
        let f = Fixture::new(layout);
        let (gw, other) = (server("gw-1#1"), server("gw-2#1"));
        f.seed(&gw, 2).await;
        let (staying, moved) = (user(&gw, 0), user(&gw, 1));
        f.reconnect(&moved, &other).await; // moved before gw-1 saw the disconnect
        for u in [&staying, &moved] {
            f.registry.unregister(&f.conn, u, &gw).await.unwrap();
        }
        assert_eq!(f.owner(&staying).await, None, "{layout:?}");
        assert_eq!(
            f.owner(&moved).await.as_deref(),
            Some("gw-2#1"),
            "{layout:?}"
        );
        let members: u64 = f
            .query(redis::cmd("SCARD").arg(f.keys.server_users(&gw)))
            .await;
        assert_eq!(members, 0, "{layout:?}");
    }
}

/// The contract requires the payload to be a MessagePack map with named keys. A positional
/// payload (an array of the values in field order, as `rmp_serde::to_vec` writes it) and a
/// map keyed by field numbers are dead-lettered with an error naming the problem, and the
/// registry is left untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn positional_payloads_are_dead_lettered_and_the_registry_is_untouched() {
    let f = Fixture::new(Layout::Hash);
    let s = server("gw-positional#1");
    f.seed(&s, 200).await;
    let event = ServerDead::new(&s, None, None);
    let array = rmpv::Value::Array(vec![
        1.into(),
        event.event_id.as_str().into(),
        s.as_str().into(),
        event.detected_at_ms.into(),
    ]);
    let numbered = rmpv::Value::Map(vec![
        (0.into(), 1.into()),
        (1.into(), event.event_id.as_str().into()),
        (2.into(), s.as_str().into()),
        (3.into(), event.detected_at_ms.into()),
    ]);
    let encode = |v: &rmpv::Value| {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    };
    let cases = [
        (
            encode(&array),
            "payload is a MessagePack array; a map with named keys is required",
        ),
        (rmp_serde::to_vec(&event).unwrap(), "MessagePack array"),
        (
            encode(&numbered),
            "key 1 of the payload map is a MessagePack integer; keys must be strings",
        ),
    ];
    for (payload, _) in &cases {
        stream::publish(
            &f.conn,
            &f.keys.events(),
            &[(b"type", EVENT_TYPE.as_bytes()), (b"payload", payload)],
        )
        .await
        .unwrap();
    }
    let worker = spawn_worker(&f.settings);
    f.wait_idle().await;
    worker.stop().await;
    let letters = f.dead_letters().await;
    assert_eq!(
        letters.len(),
        cases.len(),
        "every positional payload refused"
    );
    for (payload, why) in &cases {
        let dl = letters
            .iter()
            .find(|dl| dl.field("payload") == Some(payload.as_slice()))
            .unwrap_or_else(|| panic!("no dead letter for {why:?}"));
        let error = String::from_utf8_lossy(dl.field("error").unwrap()).into_owned();
        assert!(
            error.contains(why),
            "error {error:?} should mention {why:?}"
        );
    }
    assert_eq!(
        f.still_pointing(&s, 200).await,
        200,
        "the registry was touched"
    );
    let members: u64 = f
        .query(redis::cmd("SCARD").arg(f.keys.server_users(&s)))
        .await;
    assert_eq!(members, 200);
}

/// The step limiter (`latency_target_ms`) shares one window between the worker's cleanups:
/// the end state is the same as without it, every step went through it (its queue delay
/// observed), and no permit is left taken.
async fn limited_worker_cleans(order: &str) {
    let order = order.to_owned();
    let f = Fixture::with(Layout::Hash, move |s| {
        s.concurrency = 4;
        s.chunk_size = 500;
        s.latency_target_ms = 1;
        s.step_order = serde_json::from_value(serde_json::json!(order)).unwrap();
    });
    let live = server("gw-live#1");
    f.seed(&live, 1_000).await;
    // Servers of different sizes, so that smallest_first has something to order.
    let dead: Vec<_> = (0..6).map(|i| server(&format!("gw-{i}#1"))).collect();
    for (i, s) in dead.iter().enumerate() {
        f.seed(s, 1_000 * (i + 1)).await;
    }
    f.reconnect(&user(&dead[3], 11), &live).await;
    let worker = spawn_worker(&f.settings);
    for s in &dead {
        f.kill(s).await;
    }
    f.wait_idle().await;
    for (i, s) in dead.iter().enumerate() {
        assert_eq!(f.still_pointing(s, 1_000 * (i + 1)).await, 0, "{s}");
    }
    assert_eq!(f.still_pointing(&live, 1_000).await, 1_000);
    assert_eq!(
        f.owner(&user(&dead[3], 11)).await.as_deref(),
        Some("gw-live#1")
    );
    worker.settled().await;
    let m = &worker.metrics;
    assert_eq!(events_with(m, outcome::CLEANED), 6);
    assert_eq!(m.entries_deleted.get(), 21_000 - 1);
    assert_eq!(m.entries_kept.get(), 1);
    // 21,000 members in chunks of 500: at least 42 steps, each measured.
    assert!(
        m.steps.queue_delay.get_sample_count() >= 42,
        "{}",
        m.steps.queue_delay.get_sample_count()
    );
    assert_eq!(m.steps.in_flight.get(), 0, "every permit was given back");
    let window = m.steps.window.get();
    assert!((1..=8).contains(&window), "window {window}");
    let text = m.render();
    assert!(text.contains("registry_janitor_step_window_cuts_total"));
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_worker_cleans_smallest_first() {
    limited_worker_cleans("smallest_first").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_worker_cleans_round_robin() {
    limited_worker_cleans("round_robin").await;
}

/// Under RESP3 (`?protocol=resp3`) the scripts' replies decode as under RESP2: a cleanup
/// runs to its end, and route answers the owner, or none (Lua `false`, a boolean there).
#[tokio::test]
async fn cleans_and_routes_under_resp3() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.redis_url = format!("{}?protocol=resp3", s.redis_url)
    });
    let client: String = f.query(redis::cmd("CLIENT").arg("INFO")).await;
    assert!(client.contains("resp=3"), "{client}");
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    f.seed(&dead, 1_000).await;
    f.registry
        .register(&f.conn, b"u-live", &live)
        .await
        .unwrap();
    f.registry.heartbeat(&f.conn, &live, 60_000).await.unwrap();
    assert_eq!(
        f.registry
            .route(&f.conn, b"u-live")
            .await
            .unwrap()
            .as_deref(),
        Some("gw-live#1")
    );
    assert_eq!(f.registry.route(&f.conn, b"nobody").await.unwrap(), None);

    let worker = spawn_worker(&f.settings);
    f.kill(&dead).await;
    f.wait_idle().await;
    assert_eq!(f.still_pointing(&dead, 1_000).await, 0);
    assert_eq!(
        f.registry.route(&f.conn, &user(&dead, 1)).await.unwrap(),
        None
    );
    worker.settled().await;
    assert_eq!(events_with(&worker.metrics, outcome::CLEANED), 1);
    assert_eq!(worker.metrics.entries_deleted.get(), 1_000);
    worker.stop().await;
}
