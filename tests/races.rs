//! State that changes while the janitor walks it, on a single node: registrations that
//! land on a dead server during its cleanup, a registration in flight while the
//! reverse-index sweep runs, a Redis out of memory, a Redis whose INFO is refused, and a
//! failure note that must not outlive its cleanup. Real redis-server processes; each test
//! asserts the registry's end state and what was acknowledged.

mod common;

use std::time::Duration;

use common::*;
use registry_janitor::{
    cleanup::Cleaner, config::Layout, event::ServerId, fence, metrics::Metrics,
    reconcile::Reconciler,
};
use tokio_util::sync::CancellationToken;

/// Users registered on `dead` while a worker cleans it: every one whose registration
/// finished while the event was still unacknowledged must be gone once it is acknowledged.
async fn registrations_during_the_walk(layout: Layout) {
    let f = Fixture::with(layout, |s| {
        s.chunk_size = 5;
        s.chunks_in_flight = 1;
    });
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    const USERS: usize = 20_000;
    f.seed(&dead, USERS).await;
    f.seed(&live, 100).await;
    let worker = spawn_worker(&f.settings);
    let id = f.kill(&dead).await;
    wait_walked(&f.redis, &f.conn, &f.keys, &dead, 1).await;
    // A zombie (or a false-positive death) keeps registering users on `dead`.
    let before_ack = register_until_acked(&f.registry, &f.conn, &f.keys, &dead, &id).await;
    f.wait_idle().await;
    assert_none_point_at(&f.registry, &f.conn, &before_ack, &dead, 50).await;
    assert_eq!(f.still_pointing(&dead, USERS).await, 0);
    assert_eq!(f.still_pointing(&live, 100).await, 100, "live entries lost");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_during_the_walk_are_cleaned_before_the_ack_hash_layout() {
    registrations_during_the_walk(Layout::Hash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_during_the_walk_are_cleaned_before_the_ack_keys_layout() {
    registrations_during_the_walk(Layout::Keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_during_the_walk_are_cleaned_before_the_ack_conns_layout() {
    registrations_during_the_walk(Layout::Conns).await;
}

/// Writes `user`'s forward entry naming `owner`, as the second half of a registration.
async fn write_forward(f: &Fixture, user: &[u8], owner: &ServerId) {
    let cmd = match f.settings.layout {
        Layout::Hash => redis::cmd("HSET")
            .arg(f.keys.registry())
            .arg(user)
            .arg(owner.as_str())
            .to_owned(),
        Layout::Keys => redis::cmd("SET")
            .arg(f.keys.user(user))
            .arg(owner.as_str())
            .to_owned(),
        Layout::Conns => {
            let (key, field) = f.keys.forward_of_member(Layout::Conns, user).unwrap();
            redis::cmd("HSET")
                .arg(key)
                .arg(field)
                .arg(owner.as_str())
                .to_owned()
        }
    };
    let _: () = f.query(&cmd).await;
}

/// A connection server that writes SADD first and the forward entry second: the sweep
/// runs between the two writes (the member is already in the set from an old session, so
/// the SADD changes nothing). The user must still be found when the server dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_in_flight_survives_the_reverse_sweep() {
    registration_in_flight_survives_the_reverse_sweep(Layout::Hash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_in_flight_survives_the_reverse_sweep_conns_layout() {
    registration_in_flight_survives_the_reverse_sweep(Layout::Conns).await;
}

async fn registration_in_flight_survives_the_reverse_sweep(layout: Layout) {
    let f = Fixture::new(layout);
    let (s, other) = (server("gw-s#1"), server("gw-other#1"));
    f.seed(&s, 10).await;
    f.seed(&other, 10).await;
    let u = entry(layout, &s, 0);
    // `u` moved to `other` earlier; `s` missed the SREM, so `u` is still in its set.
    f.reconnect(&u, &other).await;
    // `u` comes back to `s`: SADD (no change), then the sweep, then the forward entry.
    let _: i64 = f
        .query(redis::cmd("SADD").arg(f.keys.server_users(&s)).arg(&u))
        .await;
    let r = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();
    let report = r.run_once().await.unwrap();
    assert_eq!(report.sweep.members_removed, 1, "{report}");
    write_forward(&f, &u, &s).await;
    // `s` dies and is cleaned.
    let worker = spawn_worker(&f.settings);
    f.kill(&s).await;
    f.wait_idle().await;
    assert_eq!(
        f.owner(&u).await,
        None,
        "the user's entry survived the cleanup"
    );
    assert_eq!(f.still_pointing(&s, 10).await, 0);
    assert_eq!(f.still_pointing(&other, 10).await, 10);
    worker.stop().await;
}

/// Members set aside by the sweep are settled after the grace period: back in the set if
/// their entry names the server by then, dropped if it names another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_set_aside_are_settled_after_the_grace_period() {
    members_set_aside_are_settled(Layout::Keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_set_aside_are_settled_after_the_grace_period_conns_layout() {
    members_set_aside_are_settled(Layout::Conns).await;
}

async fn members_set_aside_are_settled(layout: Layout) {
    let f = Fixture::with(layout, |s| s.heartbeat_grace_ms = 300);
    let (s, other) = (server("gw-s#1"), server("gw-other#1"));
    f.seed(&s, 10).await;
    f.seed(&other, 10).await;
    let (back, gone) = (entry(layout, &s, 0), entry(layout, &s, 1));
    f.reconnect(&back, &other).await;
    f.reconnect(&gone, &other).await;
    let r = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();
    assert_eq!(r.run_once().await.unwrap().sweep.members_removed, 2);
    // A server that leaves `servers` now (a clean shutdown) is swept no more: its set
    // aside members go with the key's expiry, not never.
    let ttl: i64 = f
        .query(redis::cmd("PTTL").arg(f.keys.server_moved(&s)))
        .await;
    assert!(
        ttl > 0 && ttl <= 7 * 24 * 3_600_000,
        "members set aside without an expiry: PTTL {ttl}"
    );
    // `back` finishes a registration on `s` (SADD first, long ago; the entry now).
    write_forward(&f, &back, &s).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    r.run_once().await.unwrap();
    let members: Vec<Vec<u8>> = f
        .query(redis::cmd("SMEMBERS").arg(f.keys.server_users(&s)))
        .await;
    assert!(
        members.contains(&back),
        "a finished registration lost its member"
    );
    assert!(!members.contains(&gone));
    let aside: u64 = f
        .query(redis::cmd("ZCARD").arg(f.keys.server_moved(&s)))
        .await;
    assert_eq!(aside, 0, "settled members stay set aside");
}

/// With Redis out of memory (maxmemory reached, noeviction), the cleanup still deletes:
/// it is what frees memory, and it walks with commands that need none. Its fence, which
/// takes memory, is recorded once memory allows, and the cleanup (and so the event's
/// acknowledgement) waits for it. (Meanwhile OOM refuses S's writes anyway.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanup_finishes_while_redis_is_out_of_memory() {
    for layout in [Layout::Hash, Layout::Keys, Layout::Conns] {
        let f = Fixture::new(layout);
        let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
        f.seed(&dead, 3_000).await;
        f.seed(&live, 100).await;
        let _: () = f
            .query(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("1"))
            .await;
        let refused: redis::RedisResult<()> = redis::cmd("SET")
            .arg("probe")
            .arg("1")
            .query_async(&mut f.conn.clone())
            .await;
        assert_eq!(refused.unwrap_err().code(), Some("OOM"), "Redis is not OOM");
        let cleaner = Cleaner::new(f.keys.clone(), layout, 100, 2);
        let cleaning = {
            let (cleaner, conn, dead) = (cleaner.clone(), f.conn.clone(), dead.clone());
            tokio::spawn(async move {
                cleaner
                    .clean(&conn, &dead, &CancellationToken::new(), |_| {})
                    .await
            })
        };
        // The deletes go ahead under OOM (they are what frees memory)...
        wait_until(
            &f.redis,
            "the entries deleted",
            Duration::from_secs(60),
            || async { f.still_pointing(&dead, 3_000).await == 0 },
        )
        .await;
        assert_eq!(f.still_pointing(&live, 100).await, 100);
        // ...but the cleanup is not over before its fence stands, which takes memory.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!cleaning.is_finished(), "finished without a fence");
        assert!(!fence::is_fenced(&f.conn, &f.keys, &dead).await.unwrap());
        let _: () = f
            .query(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("0"))
            .await;
        let report = tokio::time::timeout(Duration::from_secs(60), cleaning)
            .await
            .expect("the cleanup finishes once memory allows the fence")
            .unwrap()
            .unwrap();
        assert_eq!(report.deleted, 3_000);
        assert!(fence::is_fenced(&f.conn, &f.keys, &dead).await.unwrap());
        assert_eq!(cleaner.progress(&f.conn, &dead).await.unwrap(), None);
    }
}

/// A Redis whose INFO is refused (renamed away, as some proxies and managed services do):
/// no cursor can be tied to a run_id there, so the walk pops the set instead; the
/// cleanup is complete, never a silent skip of members.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cleanup_is_complete_where_info_is_refused() {
    cleanup_where_info_is_refused(Layout::Hash).await;
}

/// Layout conns: the users hold several connections on several servers ([`Devices`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cleanup_is_complete_where_info_is_refused_conns_layout() {
    cleanup_where_info_is_refused(Layout::Conns).await;
}

async fn cleanup_where_info_is_refused(layout: Layout) {
    let f = Fixture::on(redis_with(&["--rename-command", "INFO", ""]), layout, |s| {
        s.chunk_size = 50
    });
    let refused: redis::RedisResult<String> = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut f.conn.clone())
        .await;
    assert!(refused.is_err(), "INFO still answers");
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    f.seed(&dead, 2_000).await;
    f.seed(&live, 100).await;
    let devices = match layout {
        Layout::Conns => {
            let laptops = server("gw-laptops#1");
            Some(Devices::add(&f.registry, &f.conn, &dead, [&live, &laptops], 2_000, 2_000).await)
        }
        _ => None,
    };
    for n in 0..100 {
        f.reconnect(&entry(layout, &dead, n), &live).await;
    }
    let worker = spawn_worker(&f.settings);
    f.kill(&dead).await;
    f.wait_idle().await;
    assert_eq!(f.still_pointing(&dead, 2_000).await, 0);
    assert_eq!(f.still_pointing(&live, 100).await, 100);
    for n in 0..100 {
        assert_eq!(
            f.owner(&entry(layout, &dead, n)).await.as_deref(),
            Some("gw-live#1")
        );
    }
    if let Some(devices) = devices {
        let moved: Vec<_> = (0..100)
            .map(|n| (entry(layout, &dead, n), live.clone()))
            .collect();
        devices.assert_end_state(&f.registry, &f.conn, &moved).await;
        assert_eq!(
            connections_naming(&[f.redis.url()], &f.keys, &dead).await,
            vec![]
        );
    }
    worker.stop().await;
}

/// A failure noted after another worker finished the server must not re-create its
/// progress record (nothing would ever remove it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_failure_note_leaves_no_key_behind() {
    late_failure_note(Layout::Hash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_failure_note_leaves_no_key_behind_conns_layout() {
    late_failure_note(Layout::Conns).await;
}

async fn late_failure_note(layout: Layout) {
    let f = Fixture::new(layout);
    let dead = server("gw-dead#1");
    f.seed(&dead, 50).await;
    let cleaner = Cleaner::new(f.keys.clone(), layout, 1000, 1);
    cleaner
        .record_failure(&f.conn, &dead, "while under way")
        .await;
    assert_eq!(
        cleaner.last_failure(&f.conn, &dead).await.as_deref(),
        Some("while under way")
    );
    cleaner
        .clean(&f.conn, &dead, &CancellationToken::new(), |_| {})
        .await
        .unwrap();
    cleaner.record_failure(&f.conn, &dead, "too late").await;
    let left: u64 = f
        .query(
            redis::cmd("EXISTS")
                .arg(f.keys.server_cleanup(&dead))
                .arg(f.keys.server_walking(&dead))
                .arg(f.keys.server_users(&dead)),
        )
        .await;
    assert_eq!(left, 0, "a janitor key outlived the cleanup");
    assert_eq!(f.still_pointing(&dead, 50).await, 0);
}

/// A walk that starts after S was finished (members a zombie added), then is abandoned,
/// leaves S in `servers`, so that the reconciler reports it again: the set being walked
/// is never left to nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_walk_started_after_the_finish_keeps_the_server_reported() {
    walk_started_after_the_finish(Layout::Hash).await;
}

/// Layout conns: the zombie's members are connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_walk_started_after_the_finish_keeps_the_server_reported_conns_layout() {
    walk_started_after_the_finish(Layout::Conns).await;
}

async fn walk_started_after_the_finish(layout: Layout) {
    let f = Fixture::new(layout);
    let dead = server("gw-dead#1");
    f.seed(&dead, 20).await;
    let cleaner = Cleaner::new(f.keys.clone(), layout, 2, 1);
    cleaner
        .clean(&f.conn, &dead, &CancellationToken::new(), |_| {})
        .await
        .unwrap();
    let score = || async {
        let s: Option<f64> = f
            .query(
                redis::cmd("ZSCORE")
                    .arg(f.keys.servers())
                    .arg(dead.as_str()),
            )
            .await;
        s
    };
    assert_eq!(score().await, None, "a clean server leaves `servers`");
    // More members than a set keeps in a listpack (128 by default on Redis 7.2+ and
    // Valkey, where SSCAN returns a small set whole, whatever its COUNT), so one step
    // cannot walk them all on any server.
    for n in 0..300 {
        // A writer of the original protocol: a fenced S's own writes would be refused.
        f.registry
            .register_legacy(
                &f.conn,
                &as_entry(layout, format!("zombie-{n}").as_bytes()),
                &dead,
            )
            .await
            .unwrap();
    }
    // One step of a new walk, then the worker is gone.
    let step = cleaner.step(&f.conn, &dead).await.unwrap();
    assert!(!step.done);
    assert!(
        score().await.is_some(),
        "an unfinished walk of S left S unreported"
    );
}

/// A stored cursor that SSCAN would refuse (a progress record written by hand, or
/// damaged) is no cursor: the walk starts again from 0 and the cleanup ends, whether the
/// record names the Redis's own run_id with the walk under way or before it started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_cursor_sscan_refuses_restarts_the_walk() {
    let f = Fixture::new(Layout::Hash);
    let info: String = f.query(redis::cmd("INFO").arg("server")).await;
    let run_id = info
        .lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .expect("INFO server names the run_id")
        .trim()
        .to_owned();
    const USERS: usize = 300;
    let cleaner = Cleaner::new(f.keys.clone(), Layout::Hash, 10, 1);
    let damage = |dead: &ServerId, cursor: &str| {
        redis::cmd("HSET")
            .arg(f.keys.server_cleanup(dead))
            .arg("walk_cursor")
            .arg(cursor)
            .arg("walk_run_id")
            .arg(&run_id)
            .to_owned()
    };
    for (name, cursor) in [
        ("gw-under-way#1", "abc"),
        ("gw-under-way#2", "99999999999999999999999"),
        ("gw-not-started#1", " 5"),
    ] {
        let dead = server(name);
        f.seed(&dead, USERS).await;
        if name.starts_with("gw-under-way") {
            for _ in 0..3 {
                let step = cleaner.step(&f.conn, &dead).await.unwrap();
                assert!(!step.done, "{name}: {step:?}");
            }
        }
        let _: () = f.query(&damage(&dead, cursor)).await;
        cleaner
            .clean(&f.conn, &dead, &CancellationToken::new(), |_| {})
            .await
            .unwrap_or_else(|e| panic!("{name}, cursor {cursor:?}: {e}"));
        assert_eq!(f.still_pointing(&dead, USERS).await, 0, "{name}");
    }
}
