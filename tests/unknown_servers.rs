//! Verdicts on servers the registry does not know (no liveness key, no users, not in
//! `servers`): a monitoring that names servers of another registry, or a wrong id. Their
//! fences live `fence_unknown_ttl_ms`, carry `unknown`, are not indexed and are counted;
//! a registration or heartbeat racing the verdict is either before it (the server is
//! known: the full fence) or refused; a server that becomes known gets the full fence at
//! its next verdict; the guard never holds such a verdict.

mod common;

use std::time::Duration;

use common::*;
use registry_janitor::{
    config::Layout,
    conn::{self, RedisConn},
    error::Error,
    event::{ServerDead, ServerId},
    fence::{self, Lifetimes},
    guard::hold,
    keys::Keys,
    registry::Registry,
    stream,
};
use registry_janitor_testkit::RedisCluster;

/// The short lifetime of the tests that record fences themselves: long enough that none
/// expires before it is checked, on a loaded machine too.
const SHORT_MS: u64 = 30_000;
const FULL_MS: u64 = 600_000;
/// The short lifetime given to the worker where a test waits for the fences to expire.
const WORKER_SHORT_MS: u64 = 8_000;
const LIFETIMES: Lifetimes = Lifetimes {
    ttl_ms: FULL_MS,
    unknown_ttl_ms: SHORT_MS,
};

/// The fence of `s` as it stands: (remaining lifetime in ms, or -2 for none; its
/// `unknown` field; whether the index lists it).
async fn fence_of(conn: &RedisConn, keys: &Keys, s: &ServerId) -> (i64, bool, bool) {
    let mut c = conn.clone();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(keys.server_fence(s))
        .query_async(&mut c)
        .await
        .unwrap();
    let unknown: Option<String> = redis::cmd("HGET")
        .arg(keys.server_fence(s))
        .arg("unknown")
        .query_async(&mut c)
        .await
        .unwrap();
    let indexed: Option<f64> = redis::cmd("ZSCORE")
        .arg(keys.fences())
        .arg(s.as_str())
        .query_async(&mut c)
        .await
        .unwrap();
    (pttl, unknown.as_deref() == Some("1"), indexed.is_some())
}

/// A short fence: standing, at most the short lifetime, marked, not indexed.
fn is_short(fence: (i64, bool, bool)) -> bool {
    is_short_of(fence, SHORT_MS)
}

/// A short fence of lifetime `short_ms`.
fn is_short_of(fence: (i64, bool, bool), short_ms: u64) -> bool {
    fence.0 > 0 && fence.0 <= short_ms as i64 && fence.1 && !fence.2
}

/// A full fence: standing past the short lifetime, not marked, indexed.
fn is_full(fence: (i64, bool, bool)) -> bool {
    fence.0 > SHORT_MS as i64 && !fence.1 && fence.2
}

async fn used_memory(conn: &RedisConn) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// 200 verdicts on servers never seen, and one on a known server, through a worker: the
/// unknown ones get short fences, not indexed, counted; the known one the full fence. A
/// heartbeat of an unknown id is refused while its fence stands, and taken once it has
/// expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verdicts_on_unknown_servers_are_fenced_briefly_and_not_indexed() {
    let f = Fixture::with(Layout::Hash, |s| s.fence_unknown_ttl_ms = WORKER_SHORT_MS);
    let known = server("gw-known#1");
    f.seed(&known, 100).await;
    let unknown: Vec<ServerId> = (0..200)
        .map(|i| server(&format!("gw-never-seen-{i}#1")))
        .collect();
    let before = used_memory(&f.conn).await;
    let worker = spawn_worker(&f.settings);
    f.kill(&known).await;
    for s in &unknown {
        f.kill(s).await;
    }
    f.wait_idle().await;
    worker.settled().await;
    assert_eq!(worker.metrics.unknown_server_verdicts.get(), 200);
    assert!(is_full(fence_of(&f.conn, &f.keys, &known).await));
    assert_eq!(f.still_pointing(&known, 100).await, 0);
    for s in &unknown {
        let fence = fence_of(&f.conn, &f.keys, s).await;
        assert!(is_short_of(fence, WORKER_SHORT_MS), "{s}: {fence:?}");
    }
    let standing = fence::standing(&f.conn, &f.keys, None).await.unwrap();
    assert_eq!(
        standing
            .iter()
            .map(|f| f.server_id.as_str())
            .collect::<Vec<_>>(),
        vec![known.as_str()],
        "only the known server's fence is indexed"
    );
    // While the short fence stands, the id's writes are refused.
    let err = f
        .registry
        .heartbeat(&f.conn, &unknown[0], 60_000)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Fenced { .. }), "{err}");
    let after = used_memory(&f.conn).await;
    wait_until(
        &f.redis,
        "the short fences expired",
        Duration::from_secs(30),
        || async {
            let left: u64 = redis::cmd("EXISTS")
                .arg(
                    unknown
                        .iter()
                        .map(|s| f.keys.server_fence(s))
                        .collect::<Vec<_>>(),
                )
                .query_async(&mut f.conn.clone())
                .await
                .unwrap();
            left == 0
        },
    )
    .await;
    let expired = used_memory(&f.conn).await;
    eprintln!(
        "used_memory: {before} before, {after} after 200 verdicts on unknown servers \
         (events included), {expired} once their fences expired"
    );
    // Once it has expired, the id is a server like any other.
    f.registry
        .heartbeat(&f.conn, &unknown[1], 60_000)
        .await
        .unwrap();
    f.registry
        .register(&f.conn, &user(&unknown[1], 0), &unknown[1])
        .await
        .unwrap();
    worker.stop().await;
}

/// What registers a server: a liveness key, a reverse set, or a place in `servers`
/// (on a cluster, in another slot, read after the fence). Each makes the verdict's fence
/// a full one.
async fn known_in_each_way(conn: &RedisConn, keys: &Keys) {
    let (alive, users, listed) = (
        server("gw-alive#1"),
        server("gw-users#1"),
        server("gw-listed#1"),
    );
    let mut c = conn.clone();
    let _: () = redis::cmd("SET")
        .arg(keys.server_alive(&alive))
        .arg(1)
        .arg("PX")
        .arg(60_000)
        .query_async(&mut c)
        .await
        .unwrap();
    let _: () = redis::cmd("SADD")
        .arg(keys.server_users(&users))
        .arg("u1")
        .query_async(&mut c)
        .await
        .unwrap();
    let _: () = redis::cmd("ZADD")
        .arg(keys.servers())
        .arg(registry_janitor::now_ms())
        .arg(listed.as_str())
        .query_async(&mut c)
        .await
        .unwrap();
    for s in [&alive, &users, &listed] {
        let r = fence::record_verdict(conn, keys, s, Some("1-1"), LIFETIMES)
            .await
            .unwrap();
        assert!(!r.unknown, "{s}");
        assert!(is_full(fence_of(conn, keys, s).await), "{s}");
    }
    // A short fence becomes full once a verdict finds the server known; a full one is
    // never shortened, even once nothing of the server is left.
    let later = server("gw-later#1");
    let r = fence::record_verdict(conn, keys, &later, Some("2-1"), LIFETIMES)
        .await
        .unwrap();
    assert!(r.unknown);
    assert!(is_short(fence_of(conn, keys, &later).await));
    let _: () = redis::cmd("SADD")
        .arg(keys.server_users(&later))
        .arg("u1")
        .query_async(&mut c)
        .await
        .unwrap();
    let r = fence::record_verdict(conn, keys, &later, Some("3-1"), LIFETIMES)
        .await
        .unwrap();
    assert!(!r.unknown);
    assert!(is_full(fence_of(conn, keys, &later).await));
    let _: () = redis::cmd("DEL")
        .arg(keys.server_users(&later))
        .query_async(&mut c)
        .await
        .unwrap();
    let r = fence::record_verdict(conn, keys, &later, Some("4-1"), LIFETIMES)
        .await
        .unwrap();
    assert!(!r.unknown, "a full fence stays full");
    assert!(is_full(fence_of(conn, keys, &later).await));
}

/// Servers that register and heartbeat through the protocol while a verdict on each is
/// recorded at the same moment, in every order: a server whose fence is short wrote
/// nothing (every write refused, nothing of it in the registry); a server that wrote
/// anything before the fence has the full fence.
async fn registrations_race_verdicts(conn: &RedisConn, keys: &Keys, layout: Layout) {
    let registry = Registry::new(keys.clone(), layout);
    let tasks = (0..120).map(|i| {
        let (conn, keys, registry) = (conn.clone(), keys.clone(), registry.clone());
        tokio::spawn(async move {
            let s = server(&format!("gw-racing-{i}#1"));
            let writes = {
                let (conn, registry, s) = (conn.clone(), registry.clone(), s.clone());
                async move {
                    if i % 4 == 2 {
                        tokio::task::yield_now().await;
                    }
                    let mut taken = 0;
                    match registry.heartbeat(&conn, &s, 60_000).await {
                        Ok(()) => taken += 1,
                        Err(Error::Fenced { .. }) => return taken,
                        Err(e) => panic!("{s}: heartbeat: {e}"),
                    }
                    for n in 0..3 {
                        match registry.register(&conn, &entry(layout, &s, n), &s).await {
                            Ok(()) => taken += 1,
                            Err(Error::Fenced { .. }) => return taken,
                            Err(e) => panic!("{s}: register: {e}"),
                        }
                    }
                    taken
                }
            };
            let verdict = {
                let (conn, keys, s) = (conn.clone(), keys.clone(), s.clone());
                async move {
                    if i % 4 == 3 {
                        tokio::task::yield_now().await;
                    }
                    fence::record_verdict(&conn, &keys, &s, Some("1-1"), LIFETIMES)
                        .await
                        .unwrap()
                }
            };
            // One in four writes first, one in four records the verdict first (so that
            // both outcomes are met whatever the timing); the others race.
            let (taken, recorded) = match i % 4 {
                0 => {
                    let taken = writes.await;
                    (taken, verdict.await)
                }
                1 => {
                    let recorded = verdict.await;
                    (writes.await, recorded)
                }
                _ => tokio::join!(writes, verdict),
            };
            (s, taken, recorded)
        })
    });
    let (mut short, mut full) = (0, 0);
    for task in futures_util::future::join_all(tasks).await {
        let (s, taken, recorded) = task.unwrap();
        let fence = fence_of(conn, keys, &s).await;
        if recorded.unknown {
            short += 1;
            assert_eq!(
                taken, 0,
                "{s}: a short fence, yet {taken} writes were taken"
            );
            assert!(is_short(fence), "{s}: {fence:?}");
            let users: u64 = redis::cmd("EXISTS")
                .arg(keys.server_users(&s))
                .arg(keys.server_alive(&s))
                .query_async(&mut conn.clone())
                .await
                .unwrap();
            let score: Option<f64> = redis::cmd("ZSCORE")
                .arg(keys.servers())
                .arg(s.as_str())
                .query_async(&mut conn.clone())
                .await
                .unwrap();
            assert_eq!(
                (users, score),
                (0, None),
                "{s}: a short fence, yet it is known"
            );
            assert_eq!(still_pointing(&registry, conn, &s, 3).await, 0, "{s}");
        } else {
            full += 1;
            assert!(taken >= 1, "{s}: a full fence, yet nothing of it was taken");
            assert!(is_full(fence), "{s}: {fence:?}");
        }
    }
    eprintln!("{short} verdicts recorded first (short fences), {full} after a write (full fences)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_is_known_by_its_liveness_key_its_users_or_servers() {
    let f = Fixture::new(Layout::Hash);
    known_in_each_way(&f.conn, &f.keys).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_racing_verdicts_on_unknown_servers_are_refused_or_make_them_known() {
    let f = Fixture::new(Layout::Hash);
    registrations_race_verdicts(&f.conn, &f.keys, Layout::Hash).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_servers_on_a_cluster() {
    init_logs();
    if !RedisCluster::supported() {
        cannot_run("this redis-server cannot run a cluster (or redis-cli is missing)");
        return;
    }
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3, 0))
        .await
        .unwrap()
        .expect("start a local cluster");
    let settings = cluster_settings(&cluster, Layout::Keys);
    let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    let keys = Keys::for_settings(&settings);
    known_in_each_way(&conn, &keys).await;
    registrations_race_verdicts(&conn, &keys, Layout::Keys).await;
}

/// During a mass silence the guard holds the verdict on a silent known server, and lets
/// the verdict on a server the registry does not know go ahead: it has nothing to lose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verdict_on_an_unknown_server_is_never_held() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.heartbeat_grace_ms = 1_500;
        s.fence_unknown_ttl_ms = SHORT_MS;
    });
    // Twelve servers that heartbeated a second ago and whose liveness keys are gone.
    let fleet: Vec<ServerId> = (0..12)
        .map(|i| server(&format!("gw-quiet-{i}#1")))
        .collect();
    for s in &fleet {
        f.seed(s, 10).await;
        let _: () = f.query(redis::cmd("DEL").arg(f.keys.server_alive(s))).await;
        let _: () = f
            .query(
                redis::cmd("ZADD")
                    .arg(f.keys.servers())
                    .arg(registry_janitor::now_ms() - 1_000)
                    .arg(s.as_str()),
            )
            .await;
    }
    let stranger = server("gw-stranger#1");
    let worker = spawn_worker(&f.settings);
    for s in [&fleet[0], &stranger] {
        let event = ServerDead::new(s, Some("probe".into()), Some("monitoring".into()));
        stream::publish_event(&f.conn, &f.keys, &event.encode())
            .await
            .unwrap();
    }
    wait_until(
        &f.redis,
        "the known verdict held",
        Duration::from_secs(20),
        || async { hold::list(&f.conn, &f.keys).await.unwrap().len() == 1 },
    )
    .await;
    wait_until(
        &f.redis,
        "the unknown server's verdict executed",
        Duration::from_secs(20),
        || async { worker.metrics.unknown_server_verdicts.get() == 1 },
    )
    .await;
    let held = hold::list(&f.conn, &f.keys).await.unwrap();
    assert_eq!(held[0].server_id, fleet[0].as_str());
    assert!(is_short(fence_of(&f.conn, &f.keys, &stranger).await));
    assert_eq!(
        f.still_pointing(&fleet[0], 10).await,
        10,
        "the held one is intact"
    );
    worker.stop().await;
}
