//! The evictions stream, against real redis-servers: a user is announced in
//! `users.evicted` exactly when their forward entry was deleted (exactly once on one
//! node), a user whose entry was kept never; `server.cleaned` once per acknowledged
//! event, with the totals; the drift sweep announces what it removes; retention keeps what
//! a consumer group has not read. (The SIGKILL chaos run of tests/failures.rs and the
//! cluster tests check the stream too.)

mod common;

use std::{
    collections::HashSet,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use common::*;
use registry_janitor::{
    config::Layout,
    evictions::{self, Eviction},
    maintenance,
    metrics::Metrics,
    reconcile::Reconciler,
};

/// Two workers, every event published twice, users reconnecting elsewhere while the
/// cleanup runs: the users announced are exactly those whose entry was deleted, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_deleted_user_is_announced_exactly_once() {
    for layout in [Layout::Hash, Layout::Keys, Layout::Conns] {
        // Steps of 1,500 members: a step that deletes more than 1,000 writes two entries.
        let f = Fixture::with(layout, |s| {
            s.chunk_size = 1500;
            s.chunks_in_flight = 2;
        });
        const USERS: usize = 20_000;
        let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
        f.seed(&dead, USERS).await;
        f.seed(&live, 1_000).await;
        let moving = Arc::new(AtomicBool::new(true));
        let mover = {
            let (conn, keys, dead, live, moving) = (
                f.conn.clone(),
                f.keys.clone(),
                dead.clone(),
                live.clone(),
                moving.clone(),
            );
            tokio::spawn(async move {
                let mut moved = Vec::new();
                let mut n = 0;
                while moving.load(Ordering::Relaxed) && n < USERS {
                    let u = entry(layout, &dead, n);
                    let was = reconnect_telling(&conn, &keys, layout, &u, &live).await;
                    moved.push((u, was));
                    n += 7;
                    tokio::task::yield_now().await;
                }
                moved
            })
        };
        let workers = [spawn_worker(&f.settings), spawn_worker(&f.settings)];
        f.kill(&dead).await;
        f.kill(&dead).await;
        f.wait_idle().await;
        moving.store(false, Ordering::Relaxed);
        let moved = mover.await.unwrap();
        for w in workers {
            w.stop().await;
        }

        let kept: HashSet<Vec<u8>> = moved
            .iter()
            .filter(|(_, was)| was.as_deref() == Some(dead.as_str()))
            .map(|(u, _)| u.clone())
            .collect();
        let deleted: HashSet<Vec<u8>> = (0..USERS)
            .map(|n| entry(layout, &dead, n))
            .filter(|u| !kept.contains(u))
            .collect();
        assert!(
            moved.iter().any(|(_, was)| was.is_none()) || !kept.is_empty(),
            "{layout:?}: no reconnect raced the cleanup"
        );
        assert_eq!(f.still_pointing(&dead, USERS).await, 0);
        let (announced, cleaned) = evictions(&f).await;
        assert_announced_exactly_once(&announced, &dead, &deleted);
        assert!(
            announced.iter().all(|(s, _)| s == dead.as_str()),
            "{layout:?}: a live server's user was announced"
        );
        // One server.cleaned per event; their totals add up to what was deleted.
        assert_eq!(cleaned.len(), 2, "{layout:?}: {cleaned:?}");
        let total: u64 = cleaned
            .iter()
            .map(|c| match c {
                Eviction::Cleaned {
                    server_id, deleted, ..
                } => {
                    assert_eq!(server_id, dead.as_str());
                    *deleted
                }
                _ => unreachable!(),
            })
            .sum();
        assert_eq!(total as usize, deleted.len(), "{layout:?}");
        eprintln!(
            "{layout:?}: {} announced exactly once, {} kept never announced, {} reconnects \
             raced the cleanup",
            deleted.len(),
            kept.len(),
            moved.len()
        );
    }
}

/// The payload of each kind, decoded as a consumer in another language would: a map with
/// named keys, user ids as binary, the `server.dead`'s event_id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_payloads_carry_the_contract_fields() {
    let f = Fixture::new(Layout::Hash);
    let dead = server("gw-7#1");
    f.seed(&dead, 10).await;
    // Any bytes are a user id.
    let odd = b"\xff\x00odd user\xfe".to_vec();
    f.registry.register(&f.conn, &odd, &dead).await.unwrap();
    let worker = spawn_worker(&f.settings);
    let before = registry_janitor::now_ms();
    f.kill(&dead).await;
    f.wait_idle().await;
    worker.stop().await;
    let event = read_stream(&f.conn, &f.keys.events()).await.remove(0);
    let event_id =
        registry_janitor::event::ServerDead::decode(event.field("payload").unwrap(), 1 << 16)
            .unwrap()
            .0
            .event_id;

    let entries = evictions::read_all(&f.conn, &f.keys).await.unwrap();
    assert_eq!(entries.len(), 2, "{entries:?}");
    match &entries[0].1 {
        Some(Eviction::Evicted {
            source,
            server_id,
            event_id: e,
            users,
            evicted_at_ms,
        }) => {
            assert_eq!(source.as_deref(), Some("cleanup"));
            assert_eq!(server_id, "gw-7#1");
            assert_eq!(e, &event_id);
            assert_eq!(users.len(), 11);
            assert!(users.contains(&odd));
            assert!(*evicted_at_ms >= before - 1000, "{evicted_at_ms}");
        }
        other => panic!("{other:?}"),
    }
    match &entries[1].1 {
        Some(Eviction::Cleaned {
            server_id,
            event_id: e,
            deleted,
            kept,
            ..
        }) => {
            assert_eq!(
                (server_id.as_str(), e, *deleted, *kept),
                ("gw-7#1", &event_id, 11, 0)
            );
        }
        other => panic!("{other:?}"),
    }
    // The raw payload is a MessagePack map with string keys; `users` holds binaries.
    let raw: Vec<redis::Value> = f
        .query(
            redis::cmd("XRANGE")
                .arg(f.keys.evictions().unwrap())
                .arg("-")
                .arg("+")
                .arg("COUNT")
                .arg(1),
        )
        .await;
    let redis::Value::Array(entry) = &raw[0] else {
        panic!("{raw:?}")
    };
    let redis::Value::Array(fields) = &entry[1] else {
        panic!("{entry:?}")
    };
    let redis::Value::BulkString(payload) = &fields[3] else {
        panic!("{fields:?}")
    };
    let value = rmpv::decode::read_value(&mut payload.as_slice()).unwrap();
    let map = value.as_map().unwrap();
    let keys: Vec<&str> = map.iter().map(|(k, _)| k.as_str().unwrap()).collect();
    assert_eq!(
        keys,
        [
            "v",
            "source",
            "server_id",
            "event_id",
            "users",
            "evicted_at_ms"
        ]
    );
    let users = map
        .iter()
        .find(|(k, _)| k.as_str() == Some("users"))
        .unwrap();
    assert!(users
        .1
        .as_array()
        .unwrap()
        .iter()
        .all(|u| matches!(u, rmpv::Value::Binary(_))));
}

/// Switched off, nothing is written, and the cleanup is the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switched_off_the_stream_is_never_written() {
    let f = Fixture::with(Layout::Keys, |s| s.evictions = false);
    let dead = server("gw-1#1");
    f.seed(&dead, 2_000).await;
    let worker = spawn_worker(&f.settings);
    f.kill(&dead).await;
    f.wait_idle().await;
    worker.stop().await;
    assert_eq!(f.still_pointing(&dead, 2_000).await, 0);
    let exists: u64 = f
        .query(redis::cmd("EXISTS").arg(format!("{}registry:evictions", f.keys.prefix())))
        .await;
    assert_eq!(exists, 0);
}

/// The drift sweep announces the entries it removes (source `sweep`, no event_id), and
/// only those: a live server's entries, and a dead owner's entry that moved, are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drift_sweep_announces_what_it_removes() {
    for layout in [Layout::Hash, Layout::Keys, Layout::Conns] {
        let f = Fixture::with(layout, |s| s.heartbeat_grace_ms = 1);
        let (ghost, live) = (server("gw-ghost#1"), server("gw-live#1"));
        f.seed(&ghost, 700).await;
        f.seed(&live, 300).await;
        // The ghost's reverse set and its liveness are lost, and it left `servers`: only
        // the forward sweep can find its entries.
        let _: () = f
            .query(
                redis::cmd("DEL")
                    .arg(f.keys.server_users(&ghost))
                    .arg(f.keys.server_alive(&ghost)),
            )
            .await;
        let _: () = f
            .query(redis::cmd("ZREM").arg(f.keys.servers()).arg(ghost.as_str()))
            .await;
        f.reconnect(&entry(layout, &ghost, 0), &live).await;
        let reconciler = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();
        let mut cursor: Option<String> = None;
        loop {
            let (next, _, _) = reconciler.sweep_step(cursor.as_deref()).await.unwrap();
            if next == "0" {
                break;
            }
            cursor = Some(next);
        }
        assert_eq!(f.still_pointing(&ghost, 700).await, 0, "{layout:?}");
        let (announced, cleaned) = evictions(&f).await;
        assert!(cleaned.is_empty());
        let expected = (1..700).map(|n| entry(layout, &ghost, n)).collect();
        assert_announced_exactly_once(&announced, &ghost, &expected);
        for (_, entry) in evictions::read_all(&f.conn, &f.keys).await.unwrap() {
            let (Some(Eviction::Evicted {
                source, event_id, ..
            })
            | Some(Eviction::ConnectionsEvicted {
                source, event_id, ..
            })) = entry
            else {
                panic!("{entry:?}")
            };
            assert_eq!((source.as_deref(), event_id.as_str()), (Some("sweep"), ""));
        }
    }
}

/// Retention: an acknowledged entry older than retention_ms goes; one that a consumer
/// group has not read, or read and not acknowledged, stays, however old. A stream that no
/// group reads is trimmed by age.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_keeps_what_a_slow_group_has_not_read() {
    let f = Fixture::new(Layout::Hash);
    let stream = f.keys.evictions().unwrap().to_owned();
    let clean = |name: &'static str| {
        let f = &f;
        async move {
            let s = server(name);
            f.seed(&s, 10).await;
            let worker = spawn_worker(&f.settings);
            f.kill(&s).await;
            f.wait_idle().await;
            worker.stop().await;
        }
    };
    clean("gw-1#1").await;
    let len = |f: &Fixture| {
        let stream = stream.clone();
        let conn = f.conn.clone();
        async move {
            let n: u64 = redis::cmd("XLEN")
                .arg(stream)
                .query_async(&mut conn.clone())
                .await
                .unwrap();
            n
        }
    };
    assert_eq!(len(&f).await, 2);
    // No group: trimmed by age alone (retention 1 hour keeps, 0 removes).
    maintenance::trim_acknowledged(&f.conn, &f.keys, Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(len(&f).await, 2);
    maintenance::trim_acknowledged(&f.conn, &f.keys, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(len(&f).await, 0);

    // A slow group (created at the start of the stream) reads one entry and acknowledges
    // nothing: retention 0 trims nothing it still needs.
    let _: () = f
        .query(
            redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&stream)
                .arg("presence")
                .arg("0"),
        )
        .await;
    clean("gw-2#1").await;
    clean("gw-3#1").await;
    assert_eq!(len(&f).await, 4);
    let read: redis::Value = f
        .query(
            redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg("presence")
                .arg("c1")
                .arg("COUNT")
                .arg(1)
                .arg("STREAMS")
                .arg(&stream)
                .arg(">"),
        )
        .await;
    let first = evictions::read_all(&f.conn, &f.keys).await.unwrap()[0]
        .0
        .clone();
    assert!(format!("{read:?}").contains(&first), "{read:?}");
    maintenance::trim_acknowledged(&f.conn, &f.keys, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(len(&f).await, 4, "pending and unread entries were trimmed");
    // Acknowledged, the first goes; the unread ones stay.
    let _: u64 = f
        .query(redis::cmd("XACK").arg(&stream).arg("presence").arg(&first))
        .await;
    maintenance::trim_acknowledged(&f.conn, &f.keys, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(len(&f).await, 3);
}

/// A key of another type where the stream should be: the step is refused before any
/// delete (an XADD failing after them would leave them unannounced), and the cleanup
/// waits; once the key is fixed it finishes, and every user is announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_type_at_the_stream_name_refuses_the_step_before_any_delete() {
    let f = Fixture::new(Layout::Hash);
    let stream = f.keys.evictions().unwrap().to_owned();
    let _: () = f.query(redis::cmd("SET").arg(&stream).arg("oops")).await;
    let dead = server("gw-1#1");
    f.seed(&dead, 500).await;
    let cleaner = registry_janitor::cleanup::Cleaner::new(f.keys.clone(), Layout::Hash, 100, 1);
    let refused = cleaner.step(&f.conn, &dead).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("evictions stream")),
        "{refused:?}"
    );
    assert_eq!(f.still_pointing(&dead, 500).await, 500, "nothing deleted");
    let _: () = f.query(redis::cmd("DEL").arg(&stream)).await;
    let worker = spawn_worker(&f.settings);
    f.kill(&dead).await;
    f.wait_idle().await;
    worker.stop().await;
    let (announced, _) = evictions(&f).await;
    let expected = (0..500).map(|n| user(&dead, n)).collect();
    assert_announced_exactly_once(&announced, &dead, &expected);
}

/// MessagePack -> the JSON equivalent that schemas/*.schema.json describe (binary as
/// base64).
fn json_of(v: &rmpv::Value) -> serde_json::Value {
    use rmpv::Value as Mp;
    use serde_json::Value as Json;
    fn base64(bytes: &[u8]) -> String {
        const ABC: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let n =
                chunk.iter().fold(0u32, |n, b| n << 8 | u32::from(*b)) << (8 * (3 - chunk.len()));
            for i in 0..4 {
                out.push(if i <= chunk.len() {
                    ABC[(n >> (18 - 6 * i) & 63) as usize] as char
                } else {
                    '='
                });
            }
        }
        out
    }
    match v {
        Mp::Integer(i) => Json::from(i.as_u64().expect("unsigned")),
        Mp::String(s) => Json::String(s.as_str().expect("UTF-8").to_owned()),
        Mp::Binary(b) => Json::String(base64(b)),
        Mp::Array(items) => Json::Array(items.iter().map(json_of).collect()),
        Mp::Map(pairs) => Json::Object(
            pairs
                .iter()
                .map(|(k, v)| (k.as_str().expect("string keys").to_owned(), json_of(v)))
                .collect(),
        ),
        other => panic!("not in the payloads: {other:?}"),
    }
}

/// What the Lua step (one node) and the Rust encoder (cluster) write is valid per
/// schemas/users-evicted.schema.json and schemas/server-cleaned.schema.json.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_encoders_write_what_the_schemas_describe() {
    let evicted: serde_json::Value =
        serde_json::from_str(include_str!("../schemas/users-evicted.schema.json")).unwrap();
    let cleaned: serde_json::Value =
        serde_json::from_str(include_str!("../schemas/server-cleaned.schema.json")).unwrap();
    let (evicted, cleaned) = (
        jsonschema::validator_for(&evicted).unwrap(),
        jsonschema::validator_for(&cleaned).unwrap(),
    );
    assert_eq!(base64_check(), "YWxpY2U=");
    let f = Fixture::new(Layout::Hash);
    let dead = server("gw-7#1");
    f.seed(&dead, 2_500).await;
    f.registry
        .register(&f.conn, b"\xff\x00\x01", &dead)
        .await
        .unwrap();
    let worker = spawn_worker(&f.settings);
    f.kill(&dead).await;
    f.wait_idle().await;
    worker.stop().await;
    type Fields = Vec<(String, Vec<u8>)>;
    let raw: Vec<(String, Fields)> = f
        .query(
            redis::cmd("XRANGE")
                .arg(f.keys.evictions().unwrap())
                .arg("-")
                .arg("+"),
        )
        .await;
    let mut payloads: Vec<(String, Vec<u8>)> = raw
        .into_iter()
        .map(|(_, fields)| {
            let get = |n: &str| fields.iter().find(|(k, _)| k == n).unwrap().1.clone();
            (String::from_utf8(get("type")).unwrap(), get("payload"))
        })
        .collect();
    let kinds: Vec<&str> = payloads.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(kinds.last(), Some(&"server.cleaned"), "{kinds:?}");
    assert!(
        kinds.len() >= 4,
        "2,501 users take 3 entries at least: {kinds:?}"
    );
    let users: Vec<Vec<u8>> = vec![b"alice".to_vec(), vec![0xff, 0, 1], vec![b'x'; 512]];
    payloads.push((
        "users.evicted".into(),
        evictions::evicted_payload(&dead, "01J", evictions::Source::Sweep, &users, 1),
    ));
    payloads.push((
        "server.cleaned".into(),
        evictions::cleaned_payload(&dead, "01J", 5, 1, 2),
    ));
    for (kind, payload) in &payloads {
        let value = rmpv::decode::read_value(&mut payload.as_slice()).unwrap();
        let json = json_of(&value);
        let validator = if kind == "users.evicted" {
            &evicted
        } else {
            &cleaned
        };
        let errors: Vec<String> = validator
            .iter_errors(&json)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{kind}: {errors:?}");
        assert!(evictions::decode(kind, payload).is_some(), "{kind}");
    }
}

fn base64_check() -> String {
    match json_of(&rmpv::Value::Binary(b"alice".to_vec())) {
        serde_json::Value::String(s) => s,
        other => panic!("{other:?}"),
    }
}

/// Layout conns: the `connections.evicted` payloads, written by the cleanup script and by
/// the Rust encoder (the cluster's path), are what connections-evicted.schema.json says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_evicted_payloads_match_their_schema() {
    let schema: serde_json::Value =
        serde_json::from_str(include_str!("../schemas/connections-evicted.schema.json")).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let f = Fixture::new(Layout::Conns);
    let dead = server("gw-7#1");
    f.seed(&dead, 1_200).await;
    f.registry
        .register_connection(&f.conn, b"\xff\x00 \x01", "tab-1", &dead)
        .await
        .unwrap();
    let worker = spawn_worker(&f.settings);
    f.kill(&dead).await;
    f.wait_idle().await;
    worker.stop().await;
    type Fields = Vec<(String, Vec<u8>)>;
    let raw: Vec<(String, Fields)> = f
        .query(
            redis::cmd("XRANGE")
                .arg(f.keys.evictions().unwrap())
                .arg("-")
                .arg("+"),
        )
        .await;
    let mut payloads: Vec<Vec<u8>> = raw
        .into_iter()
        .filter_map(|(_, fields)| {
            let get = |n: &str| fields.iter().find(|(k, _)| k == n).unwrap().1.clone();
            (get("type") == b"connections.evicted").then(|| get("payload"))
        })
        .collect();
    assert!(payloads.len() >= 2, "1,201 pairs take 2 entries at least");
    let user: &[u8] = &[0xff, 0, 1];
    payloads.push(evictions::connections_evicted_payload(
        &dead,
        "01J",
        evictions::Source::Sweep,
        &[(user, "c-1"), (b"alice", "phone")],
        1,
    ));
    let mut pairs = 0;
    for payload in &payloads {
        let value = rmpv::decode::read_value(&mut payload.as_slice()).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&json_of(&value))
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{errors:?}");
        let Some(Eviction::ConnectionsEvicted { connections, .. }) =
            evictions::decode("connections.evicted", payload)
        else {
            panic!("does not decode")
        };
        pairs += connections.len();
    }
    assert_eq!(pairs, 1_201 + 2);
}

/// User ids of many lengths in one step (runs of one length, lone ones, the bin 8 / bin
/// 16 boundary at 256 bytes, bytes that are not UTF-8): each deleted user is announced
/// once, byte for byte, in payloads the schema accepts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_ids_of_every_length_are_announced_byte_for_byte() {
    let schema: serde_json::Value =
        serde_json::from_str(include_str!("../schemas/users-evicted.schema.json")).unwrap();
    let schema = jsonschema::validator_for(&schema).unwrap();
    let f = Fixture::with(Layout::Hash, |s| s.chunk_size = 1000);
    let dead = server("gw-lengths#1");
    let mut users: Vec<Vec<u8>> = Vec::new();
    for n in 0..600 {
        users.push(format!("fixed-width-{n:05}").into_bytes()); // one long run
    }
    for len in [1, 2, 31, 32, 254, 255, 256, 257, 300, 512] {
        for k in 0..3u8 {
            let mut id = vec![b'a' + k; len];
            id[0] = 0xff; // not UTF-8
            users.push(id);
        }
    }
    for n in 0..200 {
        users.push(format!("u{n}").into_bytes()); // lengths 2 to 4, mixed
    }
    f.registry.heartbeat(&f.conn, &dead, 60_000).await.unwrap();
    f.registry
        .register_many(&f.conn, users.iter().map(Vec::as_slice), &dead, 1000)
        .await
        .unwrap();
    let worker = spawn_worker(&f.settings);
    f.kill(&dead).await;
    f.wait_idle().await;
    worker.stop().await;
    let (announced, _) = evictions(&f).await;
    let expected: HashSet<Vec<u8>> = users.into_iter().collect();
    assert_announced_exactly_once(&announced, &dead, &expected);
    type Fields = Vec<(String, Vec<u8>)>;
    let raw: Vec<(String, Fields)> = f
        .query(
            redis::cmd("XRANGE")
                .arg(f.keys.evictions().unwrap())
                .arg("-")
                .arg("+"),
        )
        .await;
    for (_, fields) in raw {
        let get = |n: &str| fields.iter().find(|(k, _)| k == n).unwrap().1.clone();
        if get("type") == b"users.evicted" {
            let payload = get("payload");
            let value = rmpv::decode::read_value(&mut payload.as_slice()).unwrap();
            let errors: Vec<String> = schema
                .iter_errors(&json_of(&value))
                .map(|e| e.to_string())
                .collect();
            assert!(errors.is_empty(), "{errors:?}");
        }
    }
}
