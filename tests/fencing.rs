//! Fencing, against real redis-servers: once a worker takes `server.dead` for S, S's
//! writes through the connection-server protocol are refused (`Error::Fenced`), a routing
//! lookup never returns S, and the reconciler agrees.

mod common;

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use common::*;
use registry_janitor::{
    config::Layout, error::Error, event::ServerId, fence, metrics::Metrics, reconcile::Reconciler,
    registry::Registry,
};

/// The fence's `fenced_at_ms`, once it stands.
async fn fenced_at(f: &Fixture, s: &ServerId) -> Option<u64> {
    f.query(
        redis::cmd("HGET")
            .arg(f.keys.server_fence(s))
            .arg("fenced_at_ms"),
    )
    .await
}

/// A connection server that keeps heartbeating through a false-positive verdict learns
/// it is fenced at its first heartbeat after the verdict (so within one interval), and
/// comes back under a new incarnation whose users route to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_server_declared_dead_is_told_at_its_next_heartbeat() {
    for layout in [Layout::Hash, Layout::Keys, Layout::Conns] {
        let f = Fixture::new(layout);
        let s = server("gw-7#1");
        const USERS: usize = 3_000;
        const INTERVAL_MS: u64 = 100;
        f.seed(&s, USERS).await;
        // The connection server: one heartbeat every INTERVAL_MS until it is told.
        let interval = Duration::from_millis(INTERVAL_MS);
        let beats = heartbeat_until_fenced(&f.registry, &f.conn, &s, interval);
        tokio::time::sleep(Duration::from_millis(3 * INTERVAL_MS)).await;
        let worker = spawn_worker(&f.settings);
        f.kill(&s).await; // monitoring lost sight of a live server
        let beats = tokio::time::timeout(Duration::from_secs(30), beats)
            .await
            .expect("the server was never told")
            .unwrap();
        let verdict = fenced_at(&f, &s).await.expect("a fence stands");
        beats.assert_told_at_the_first_after(verdict);
        eprintln!(
            "{layout:?}: told {} ms after the verdict (heartbeat every {INTERVAL_MS} ms)",
            beats.told_at.saturating_sub(verdict)
        );
        // Its writes are refused from now on, and none of them lands.
        let late = as_entry(layout, b"late-user");
        assert!(matches!(
            f.registry.register(&f.conn, &late, &s).await,
            Err(Error::Fenced { .. })
        ));
        assert!(matches!(
            f.registry
                .unregister(&f.conn, &entry(layout, &s, 0), &s)
                .await,
            Err(Error::Fenced { .. })
        ));
        f.wait_idle().await;
        assert_eq!(f.owner(&late).await, None, "{layout:?}");
        assert_eq!(f.still_pointing(&s, USERS).await, 0, "{layout:?}");
        // It comes back under a new incarnation; its users reconnect to it.
        let again = server("gw-7#2");
        f.registry.heartbeat(&f.conn, &again, 60_000).await.unwrap();
        for n in 0..10 {
            f.reconnect(&entry(layout, &s, n), &again).await;
            let routed = f
                .registry
                .route(&f.conn, &entry(layout, &s, n))
                .await
                .unwrap();
            assert_eq!(routed.as_deref(), Some("gw-7#2"), "{layout:?}");
        }
        worker.stop().await;
    }
}

/// A zombie registers users before, during and after the cleanup of its incarnation:
/// every registration is either refused or cleaned before the acknowledgement, and no
/// entry names S afterwards; the users of a live server are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_registering_through_the_cleanup_leaves_nothing() {
    for layout in [Layout::Hash, Layout::Keys, Layout::Conns] {
        let f = Fixture::with(layout, |s| {
            s.chunk_size = 20;
            s.chunks_in_flight = 1;
        });
        let (dead, live) = (server("gw-zombie#1"), server("gw-live#1"));
        const USERS: usize = 10_000;
        f.seed(&dead, USERS).await;
        f.seed(&live, 200).await;
        // Stops once it has been refused `after` more times than `stop_after` says.
        let stop_after = Arc::new(AtomicU64::new(u64::MAX));
        let refusals = Arc::new(AtomicU64::new(0));
        let zombie = {
            let (registry, conn, dead) = (f.registry.clone(), f.conn.clone(), dead.clone());
            let (stop_after, refusals) = (stop_after.clone(), refusals.clone());
            tokio::spawn(async move {
                let (mut taken, mut tried) = (0u64, Vec::new());
                for n in 0.. {
                    let u = as_entry(layout, format!("zombie-{n}").as_bytes());
                    tried.push(u.clone());
                    match registry.register(&conn, &u, &dead).await {
                        Ok(()) => {
                            let refused = refusals.load(Ordering::Relaxed);
                            assert_eq!(refused, 0, "a write was taken after one was refused");
                            taken += 1;
                        }
                        Err(Error::Fenced { .. }) => {
                            let refused = refusals.fetch_add(1, Ordering::Relaxed) + 1;
                            if refused >= stop_after.load(Ordering::Relaxed) {
                                return (taken, refused, tried);
                            }
                        }
                        Err(e) => panic!("register failed: {e}"),
                    }
                }
                unreachable!()
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let worker = spawn_worker(&f.settings);
        f.kill(&dead).await;
        f.wait_idle().await;
        // And on after the acknowledgement.
        stop_after.store(refusals.load(Ordering::Relaxed) + 500, Ordering::Relaxed);
        let (taken, refused, tried) = tokio::time::timeout(Duration::from_secs(120), zombie)
            .await
            .expect("the zombie never got fenced")
            .unwrap();
        f.wait_idle().await;
        assert!(taken > 0 && refused > 0, "{layout:?}: {taken} {refused}");
        assert_none_point_at(&f.registry, &f.conn, &tried, &dead, 1000).await;
        assert_eq!(f.still_pointing(&dead, USERS).await, 0, "{layout:?}");
        assert_eq!(
            f.still_pointing(&live, 200).await,
            200,
            "{layout:?}: live lost"
        );
        let left: i64 = f
            .query(redis::cmd("EXISTS").arg(&f.keys.server_members_left(&dead)))
            .await;
        assert_eq!(left, 0, "{layout:?}: a reverse set of the zombie is left");
        worker.stop().await;
    }
}

/// Route against a plain HGET/GET: once the verdict stands, route never returns the dead
/// owner (even one whose liveness key is still there: a false positive), while the plain
/// read does until the cleanup reaches the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_never_returns_a_fenced_owner_during_a_long_cleanup() {
    for layout in [Layout::Hash, Layout::Keys, Layout::Conns] {
        // Small steps: a cleanup long enough for many lookups, on a busy machine too.
        let f = Fixture::with(layout, |s| {
            s.chunk_size = 20;
            s.chunks_in_flight = 1;
        });
        let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
        const USERS: usize = 40_000;
        f.seed(&dead, USERS).await; // its liveness key stays: only the fence tells
        f.seed(&live, 100).await;
        // Before the verdict route returns the owner; the fence alone changes that.
        let first = entry(layout, &dead, 0);
        assert_eq!(
            f.registry.route(&f.conn, &first).await.unwrap().as_deref(),
            Some(dead.as_str())
        );
        let worker = spawn_worker(&f.settings);
        let id = f.kill(&dead).await;
        wait_until(&f.redis, "the fence", Duration::from_secs(30), || async {
            fence::is_fenced(&f.conn, &f.keys, &dead).await.unwrap()
        })
        .await;
        let (mut routed_dead, mut read_dead, mut lookups) = (0, 0, 0);
        let mut n = USERS - 1;
        while is_pending(&f.conn, &f.keys, &id).await {
            let u = entry(layout, &dead, n);
            n = (n + USERS - 7) % USERS;
            // A plain read first: it sees the entry while the cleanup has not reached it.
            read_dead += usize::from(f.owner(&u).await.as_deref() == Some(dead.as_str()));
            let routed = f.registry.route(&f.conn, &u).await.unwrap();
            routed_dead += usize::from(routed.as_deref() == Some(dead.as_str()));
            if layout == Layout::Conns {
                // The user lookup of the layout: every live connection, never the dead one.
                let (_, uid) = registry_janitor::keys::split_conn_member(&u).unwrap();
                let servers = f.registry.route_user(&f.conn, uid).await.unwrap();
                routed_dead += usize::from(servers.iter().any(|s| s == dead.as_str()));
            }
            lookups += 1;
        }
        eprintln!(
            "{layout:?}: {lookups} lookups after the verdict: route returned the dead owner \
             {routed_dead} times, a plain read {read_dead} times"
        );
        assert_eq!(routed_dead, 0, "{layout:?}");
        assert!(
            read_dead > 0,
            "{layout:?}: the cleanup was too fast to show anything"
        );
        f.wait_idle().await;
        assert_eq!(f.still_pointing(&dead, USERS).await, 0);
        assert_eq!(f.still_pointing(&live, 100).await, 100, "live lost");
        for n in 0..100 {
            let routed = f
                .registry
                .route(&f.conn, &entry(layout, &live, n))
                .await
                .unwrap();
            assert_eq!(routed.as_deref(), Some(live.as_str()));
        }
        worker.stop().await;
    }
}

/// What route does with each kind of owner: alive (returned), past its liveness (none,
/// entry kept: it may be a slow heartbeat), fenced (none; route only reads, the entry is
/// the janitor's to delete and announce), no entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_returns_only_a_live_unfenced_owner() {
    for layout in [Layout::Hash, Layout::Keys, Layout::Conns] {
        let f = Fixture::new(layout);
        let (alive, expired, fenced) = (server("a#1"), server("b#1"), server("c#1"));
        for s in [&alive, &expired, &fenced] {
            f.seed(s, 1).await;
        }
        let _: i64 = f
            .query(redis::cmd("DEL").arg(f.keys.server_alive(&expired)))
            .await;
        fence::record(&f.conn, &f.keys, &fenced, None, 60_000)
            .await
            .unwrap();
        let route = |s: &ServerId| {
            let u = entry(layout, s, 0);
            let (registry, conn) = (f.registry.clone(), f.conn.clone());
            async move { registry.route(&conn, &u).await.unwrap() }
        };
        assert_eq!(route(&alive).await.as_deref(), Some("a#1"), "{layout:?}");
        assert_eq!(route(&expired).await, None, "{layout:?}");
        assert_eq!(
            f.owner(&entry(layout, &expired, 0)).await.as_deref(),
            Some("b#1")
        );
        assert_eq!(route(&fenced).await, None, "{layout:?}");
        assert_eq!(
            f.owner(&entry(layout, &fenced, 0)).await.as_deref(),
            Some("c#1"),
            "{layout:?}"
        );
        assert_eq!(
            f.registry
                .route(&f.conn, &as_entry(layout, b"nobody"))
                .await
                .unwrap(),
            None
        );
    }
}

/// The reconciler and the fence agree: a fenced, clean server is not reported again even
/// though a writer of the original protocol still heartbeats for it (and so put it back
/// in `servers`); members such a
/// writer adds make it reported again until it is clean; the drift sweep treats a fenced
/// owner as dead, liveness key or not. Refused writes are counted by operation, and
/// `status` lists the fenced server that still tries to write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_treats_a_fenced_server_as_dead_for_good() {
    fenced_for_good(Layout::Hash).await;
}

/// Layout conns: the late writes are connections, and the orphan's user holds another
/// connection on a live server, which the drift sweep keeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_treats_a_fenced_server_as_dead_for_good_conns_layout() {
    fenced_for_good(Layout::Conns).await;
}

async fn fenced_for_good(layout: Layout) {
    let f = Fixture::with(layout, |s| s.reconcile_interval_ms = 100);
    let s = server("gw-fenced#1");
    f.seed(&s, 50).await;
    let worker = spawn_worker(&f.settings);
    f.kill(&s).await;
    f.wait_idle().await;
    // A connection server of the original protocol: plain SET/ZADD heartbeats.
    let legacy_heartbeat = || async {
        let _: () = redis::pipe()
            .set_ex(f.keys.server_alive(&s), 1, 600)
            .ignore()
            .zadd(f.keys.servers(), s.as_str(), registry_janitor::now_ms())
            .ignore()
            .query_async(&mut f.conn.clone())
            .await
            .unwrap();
    };
    legacy_heartbeat().await;
    let metrics = Metrics::new();
    let reconciler = Reconciler::new(&f.settings, metrics.clone()).await.unwrap();
    let pass = reconciler.pass().await.unwrap();
    assert_eq!((pass.published, pass.fenced_clean), (0, 1), "{pass:?}");
    // Its late members (original protocol, so not refused) make it reported again.
    let late = |n: usize| as_entry(layout, format!("late-{n}").as_bytes());
    for n in 0..5 {
        f.registry
            .register_legacy(&f.conn, &late(n), &s)
            .await
            .unwrap();
    }
    legacy_heartbeat().await;
    let pass = reconciler.pass().await.unwrap();
    assert_eq!(pass.published, 1, "{pass:?}");
    f.wait_idle().await;
    for n in 0..5 {
        assert_eq!(f.owner(&late(n)).await, None);
    }
    // A forward entry naming the fenced owner that no index knows: the drift sweep
    // removes it although the owner's liveness key is there.
    let orphan = as_entry(layout, b"orphan");
    let live = server("gw-live#1");
    if layout == Layout::Conns {
        f.registry.heartbeat(&f.conn, &live, 600_000).await.unwrap();
        f.registry
            .register_connection(&f.conn, b"orphan", "phone", &live)
            .await
            .unwrap();
    }
    let () = f
        .query(&forward_write(&f.keys, layout, &orphan, s.as_str()))
        .await;
    legacy_heartbeat().await;
    let once = reconciler.run_once().await.unwrap();
    assert_eq!(once.sweep.entries_removed, 1, "{once}");
    assert_eq!(f.owner(&orphan).await, None);
    if layout == Layout::Conns {
        assert_eq!(
            f.registry.connections(&f.conn, b"orphan").await.unwrap(),
            vec![("phone".to_owned(), live.as_str().to_owned())],
            "the user's live connection went with the orphan"
        );
    }
    // Refused writes of the protocol: counted by operation, and listed by status.
    for _ in 0..3 {
        let refused = f.registry.heartbeat(&f.conn, &s, 1000).await;
        assert!(matches!(refused, Err(Error::Fenced { .. })));
    }
    let refused = f
        .registry
        .register(&f.conn, &as_entry(layout, b"again"), &s)
        .await;
    assert!(matches!(refused, Err(Error::Fenced { .. })));
    reconciler.pass().await.unwrap();
    let by_op = |op: &str| metrics.fence_refused_writes.with_label_values(&[op]).get();
    assert_eq!((by_op("heartbeat"), by_op("register")), (3, 1));
    assert_eq!(metrics.fenced_servers_writing.get(), 1);
    let status = registry_janitor::status::collect(&f.settings)
        .await
        .unwrap();
    assert_eq!(status.fenced, Some(1));
    let writing: Vec<&str> = status
        .fenced_still_writing
        .iter()
        .map(|f| f.server_id.as_str())
        .collect();
    assert_eq!(writing, [s.as_str()]);
    worker.stop().await;
}

/// Recording a fence twice keeps the first verdict's time, and a fence stands for
/// `fence_ttl_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_recorded_twice_keeps_its_first_verdict() {
    let f = Fixture::new(Layout::Hash);
    let s = server("gw-1#1");
    let first = fence::record(&f.conn, &f.keys, &s, Some("1-1"), 600_000)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let second = fence::record(&f.conn, &f.keys, &s, Some("2-1"), 600_000)
        .await
        .unwrap();
    assert_eq!(first, second);
    let ttl: i64 = f
        .query(redis::cmd("PTTL").arg(f.keys.server_fence(&s)))
        .await;
    assert!((500_000..=600_000).contains(&ttl), "{ttl}");
    let standing = fence::standing(&f.conn, &f.keys, Some(600_000))
        .await
        .unwrap();
    assert_eq!(standing.len(), 1);
    assert_eq!(standing[0].entry.as_deref(), Some("1-1"));
}

/// Heartbeats of many live servers are not disturbed by a verdict against another, and
/// a connection server's protocol writes go on while the janitor cleans.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_servers_write_on_through_a_cleanup() {
    live_servers_write_on(Layout::Hash).await;
}

/// Layout conns: the live server also opens connections for users of the dead server
/// while it is cleaned: they keep those, and only those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_servers_write_on_through_a_cleanup_conns_layout() {
    live_servers_write_on(Layout::Conns).await;
}

async fn live_servers_write_on(layout: Layout) {
    let f = Fixture::new(layout);
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    const USERS: usize = 5_000;
    f.seed(&dead, USERS).await;
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let writer = {
        let (registry, conn, live) = (f.registry.clone(), f.conn.clone(), live.clone());
        let dead = dead.clone();
        let (stop, written) = (stop.clone(), written.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                registry.heartbeat(&conn, &live, 60_000).await.unwrap();
                let u = format!("l{n}").into_bytes();
                if layout == Layout::Conns {
                    registry
                        .register_connection(&conn, &u, "phone", &live)
                        .await
                        .unwrap();
                    if (n as usize) < USERS {
                        // A user of the dead server opens a second connection.
                        registry
                            .register_connection(&conn, &user(&dead, n as usize), "laptop", &live)
                            .await
                            .unwrap();
                    }
                } else {
                    registry.register(&conn, &u, &live).await.unwrap();
                }
                n += 1;
                written.store(n, Ordering::Relaxed);
            }
            n
        })
    };
    let worker = spawn_worker(&f.settings);
    f.kill(&dead).await;
    f.wait_idle().await;
    stop.store(true, Ordering::Relaxed);
    let n = writer.await.unwrap();
    assert!(n > 0);
    let r = Registry::new(f.keys.clone(), layout);
    for i in 0..n {
        let u = format!("l{i}").into_bytes();
        if layout == Layout::Conns {
            assert_eq!(r.route_user(&f.conn, &u).await.unwrap(), [live.as_str()]);
        } else {
            let routed = r.route(&f.conn, &u).await.unwrap();
            assert_eq!(routed.as_deref(), Some(live.as_str()));
        }
    }
    if layout == Layout::Conns {
        assert_eq!(f.still_pointing(&dead, USERS).await, 0);
        for i in 0..USERS {
            let expected: Vec<(String, String)> = if (i as u64) < n {
                vec![("laptop".to_owned(), live.as_str().to_owned())]
            } else {
                vec![]
            };
            assert_eq!(
                r.connections(&f.conn, &user(&dead, i)).await.unwrap(),
                expected,
                "user {i}"
            );
        }
    }
    worker.stop().await;
}

/// unregister.lua answers the number of forward entries it deleted (its header and the
/// specification's table, docs/specification.md): a user who reconnected elsewhere has no entry of ours, so 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_answers_the_number_of_entries_it_deleted() {
    let f = Fixture::new(Layout::Hash);
    let (old, new) = (server("gw-old#1"), server("gw-new#1"));
    let u = b"moved-user".to_vec();
    f.registry.register(&f.conn, &u, &old).await.unwrap();
    f.registry.register(&f.conn, &u, &new).await.unwrap();
    let script = redis::Script::new(include_str!("../protocol/unregister.lua"));
    let unregister = |s: &ServerId| {
        let mut call = script.prepare_invoke();
        call.key(f.keys.server_fence(s))
            .key(f.keys.server_refusals(s))
            .key(f.keys.server_users(s))
            .key(f.keys.registry())
            .arg(&u)
            .arg(s.as_str())
            .arg("hash");
        let mut conn = f.conn.clone();
        async move { call.invoke_async::<i64>(&mut conn).await.unwrap() }
    };
    assert_eq!(unregister(&old).await, 0, "nothing of gw-old was deleted");
    assert_eq!(f.owner(&u).await.as_deref(), Some(new.as_str()));
    assert_eq!(unregister(&new).await, 1);
    assert_eq!(f.owner(&u).await, None);
}

/// Layout conns: unregister_conn.lua answers the number of fields it deleted: a
/// connection that moved to another server is not ours, so 0; the user's other
/// connection, on a third server, is untouched either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_answers_the_number_of_entries_it_deleted_conns_layout() {
    let f = Fixture::new(Layout::Conns);
    let (old, new, other) = (server("gw-old#1"), server("gw-new#1"), server("gw-other#1"));
    let r = &f.registry;
    r.register_connection(&f.conn, b"moved-user", "tab", &old)
        .await
        .unwrap();
    r.register_connection(&f.conn, b"moved-user", "tab", &new)
        .await
        .unwrap();
    r.register_connection(&f.conn, b"moved-user", "phone", &other)
        .await
        .unwrap();
    let script = redis::Script::new(include_str!("../protocol/unregister_conn.lua"));
    let unregister = |s: &ServerId| {
        let mut call = script.prepare_invoke();
        call.key(f.keys.server_fence(s))
            .key(f.keys.server_refusals(s))
            .key(f.keys.server_users(s))
            .key(f.keys.user_conns(b"moved-user"))
            .arg("moved-user")
            .arg(s.as_str())
            .arg("tab");
        let mut conn = f.conn.clone();
        async move { call.invoke_async::<i64>(&mut conn).await.unwrap() }
    };
    assert_eq!(unregister(&old).await, 0, "nothing of gw-old was deleted");
    assert_eq!(
        r.connections(&f.conn, b"moved-user").await.unwrap(),
        vec![
            ("phone".to_owned(), other.as_str().to_owned()),
            ("tab".to_owned(), new.as_str().to_owned()),
        ]
    );
    assert_eq!(unregister(&new).await, 1);
    assert_eq!(
        r.connections(&f.conn, b"moved-user").await.unwrap(),
        vec![("phone".to_owned(), other.as_str().to_owned())]
    );
}

/// Out of memory (maxmemory reached, noeviction), a fenced server is still told FENCED:
/// the refusal is decided before any write, and its note is best effort. A live server's
/// write meanwhile fails with OOM, a state that passes, never with FENCED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_server_is_told_so_even_when_redis_is_out_of_memory() {
    for layout in [Layout::Hash, Layout::Keys, Layout::Conns] {
        let f = Fixture::new(layout);
        let registry = Registry::new(f.keys.clone(), layout);
        let (fenced, live) = (server("gw-fenced#1"), server("gw-live#1"));
        registry.heartbeat(&f.conn, &fenced, 60_000).await.unwrap();
        fence::record(&f.conn, &f.keys, &fenced, Some("1-1"), 600_000)
            .await
            .unwrap();
        let _: () = f
            .query(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("1"))
            .await;
        let register = registry
            .register(&f.conn, &as_entry(layout, b"late"), &fenced)
            .await;
        let heartbeat = registry.heartbeat(&f.conn, &fenced, 60_000).await;
        let unregister = registry
            .unregister(&f.conn, &as_entry(layout, b"late"), &fenced)
            .await;
        let live_write = registry
            .register(&f.conn, &as_entry(layout, b"someone"), &live)
            .await;
        let _: () = f
            .query(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("0"))
            .await;
        for answer in [&register, &heartbeat] {
            assert!(matches!(answer, Err(Error::Fenced { .. })), "{answer:?}");
        }
        assert!(
            matches!(unregister, Err(Error::Fenced { .. })),
            "{unregister:?}"
        );
        let live_write = live_write.expect_err("a write out of memory must fail");
        assert!(
            !matches!(live_write, Error::Fenced { .. }) && live_write.to_string().contains("OOM"),
            "{live_write:?}"
        );
        assert_eq!(
            f.owner(&as_entry(layout, b"late")).await,
            None,
            "{layout:?}"
        );
        // Memory back, the live server registers as usual; the fenced one stays refused.
        registry
            .register(&f.conn, &as_entry(layout, b"someone"), &live)
            .await
            .unwrap();
        assert_eq!(
            registry
                .route(&f.conn, &as_entry(layout, b"someone"))
                .await
                .unwrap(),
            None,
            "gw-live has no liveness key yet, and route returns only a live owner"
        );
        registry.heartbeat(&f.conn, &live, 60_000).await.unwrap();
        assert_eq!(
            registry
                .route(&f.conn, &as_entry(layout, b"someone"))
                .await
                .unwrap()
                .as_deref(),
            Some(live.as_str())
        );
    }
}

/// route.lua only reads (`no-writes`): on a read-only replica it answers as EVALSHA_RO,
/// and for an ACL user without EVALSHA_RO as plain EVALSHA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_answers_on_a_read_only_replica_with_or_without_evalsha_ro() {
    let f = Fixture::new(Layout::Hash);
    let live = server("gw-live#1");
    f.registry.register(&f.conn, b"u1", &live).await.unwrap();
    f.registry.heartbeat(&f.conn, &live, 600_000).await.unwrap();
    let port = f.redis.port().to_string();
    let replica = redis_with(&["--replicaof", "127.0.0.1", &port]);
    let on_replica =
        registry_janitor::conn::shared(&registry_janitor::conn::client(&replica.url()).unwrap())
            .unwrap();
    let mut copied = false;
    for _ in 0..200 {
        let owner: Option<String> = redis::cmd("HGET")
            .arg(f.keys.registry())
            .arg("u1")
            .query_async(&mut on_replica.clone())
            .await
            .unwrap_or(None);
        if owner.is_some() && f.registry.route(&on_replica, b"u1").await.is_ok() {
            copied = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(copied, "the replica never had the entry");
    let registry = Registry::new(f.keys.clone(), Layout::Hash);
    assert_eq!(
        registry.route(&on_replica, b"u1").await.unwrap().as_deref(),
        Some("gw-live#1")
    );
    // A user allowed EVALSHA but not EVALSHA_RO.
    let p = f.settings.key_prefix.clone();
    let rules = format!(
        "cs reset on >pw ~{p}registry ~{p}user:* ~{p}server:* -@all +ping +select +evalsha +eval +script|load +exists +hget +get"
    );
    let mut acl = redis::cmd("ACL");
    acl.arg("SETUSER");
    for rule in rules.split(' ') {
        acl.arg(rule);
    }
    let _: () = acl.query_async(&mut on_replica.clone()).await.unwrap();
    let as_cs = registry_janitor::conn::shared(
        &registry_janitor::conn::client(&format!("redis://cs:pw@127.0.0.1:{}", replica.port()))
            .unwrap(),
    )
    .unwrap();
    let registry = Registry::new(f.keys.clone(), Layout::Hash);
    for _ in 0..2 {
        assert_eq!(
            registry.route(&as_cs, b"u1").await.unwrap().as_deref(),
            Some("gw-live#1")
        );
    }
}

/// Layout conns: route_user.lua only reads (`no-writes`): on a read-only replica it
/// answers as EVALSHA_RO, and for an ACL user without EVALSHA_RO as plain EVALSHA, with
/// every live server of the user's connections (a fenced one left out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_user_answers_on_a_read_only_replica_with_or_without_evalsha_ro() {
    let f = Fixture::new(Layout::Conns);
    let (a, b, fenced) = (server("gw-a#1"), server("gw-b#1"), server("gw-fenced#1"));
    for (connection, s) in [("phone", &a), ("laptop", &b), ("tab", &fenced)] {
        f.registry.heartbeat(&f.conn, s, 600_000).await.unwrap();
        f.registry
            .register_connection(&f.conn, b"u1", connection, s)
            .await
            .unwrap();
    }
    fence::record(&f.conn, &f.keys, &fenced, None, 600_000)
        .await
        .unwrap();
    let port = f.redis.port().to_string();
    let replica = redis_with(&["--replicaof", "127.0.0.1", &port]);
    let on_replica =
        registry_janitor::conn::shared(&registry_janitor::conn::client(&replica.url()).unwrap())
            .unwrap();
    let expected = vec![a.as_str().to_owned(), b.as_str().to_owned()];
    let mut copied = false;
    for _ in 0..200 {
        // The fence is the last write: once the replica has it, it has the rest.
        let has_fence: bool = redis::cmd("EXISTS")
            .arg(f.keys.server_fence(&fenced))
            .query_async(&mut on_replica.clone())
            .await
            .unwrap_or(false);
        if has_fence && f.registry.route_user(&on_replica, b"u1").await.is_ok() {
            copied = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(copied, "the replica never had the entries");
    assert_eq!(
        f.registry.route_user(&on_replica, b"u1").await.unwrap(),
        expected
    );
    // A user allowed EVALSHA but not EVALSHA_RO.
    let p = f.settings.key_prefix.clone();
    let rules = format!(
        "cs reset on >pw ~{p}user:* ~{p}server:* -@all +ping +select +evalsha +eval +script|load +exists +hgetall"
    );
    let mut acl = redis::cmd("ACL");
    acl.arg("SETUSER");
    for rule in rules.split(' ') {
        acl.arg(rule);
    }
    let _: () = acl.query_async(&mut on_replica.clone()).await.unwrap();
    let as_cs = registry_janitor::conn::shared(
        &registry_janitor::conn::client(&format!("redis://cs:pw@127.0.0.1:{}", replica.port()))
            .unwrap(),
    )
    .unwrap();
    for _ in 0..2 {
        assert_eq!(
            f.registry.route_user(&as_cs, b"u1").await.unwrap(),
            expected
        );
    }
}
