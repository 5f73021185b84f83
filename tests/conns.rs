//! Layout `conns`: a user with several connections, on several servers. The protocol
//! (register_conn.lua, unregister_conn.lua, route_user.lua), the cleanup of a dead server
//! on one node, moves during the cleanup, and the evictions stream's pairs. Real
//! redis-server processes; each test asserts the registry's end state.

mod common;

use std::time::Duration;

use common::*;
use registry_janitor::{
    cleanup::Cleaner, config::Layout, error::Error, evictions::Eviction, fence, keys::conn_member,
};
use tokio_util::sync::CancellationToken;

async fn keys_of_user(f: &Fixture, user: &[u8]) -> i64 {
    f.query(redis::cmd("EXISTS").arg(f.keys.user_conns(user)))
        .await
}

/// A user with three connections on three servers; one server dies: its connection is
/// gone, the two others stay and route; a user whose every connection was on the dead
/// server has no key left; the evictions stream names the (user, connection) pairs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_server_of_three_dies() {
    let f = Fixture::new(Layout::Conns);
    let (a, b, dead) = (server("gw-a#1"), server("gw-b#1"), server("gw-dead#1"));
    for s in [&a, &b, &dead] {
        f.registry.heartbeat(&f.conn, s, 60_000).await.unwrap();
    }
    let r = &f.registry;
    r.register_connection(&f.conn, b"alice", "phone", &a)
        .await
        .unwrap();
    r.register_connection(&f.conn, b"alice", "laptop", &b)
        .await
        .unwrap();
    r.register_connection(&f.conn, b"alice", "tab-1", &dead)
        .await
        .unwrap();
    // Two connections of one user on one server: routed once.
    r.register_connection(&f.conn, b"alice", "tab-2", &b)
        .await
        .unwrap();
    r.register_connection(&f.conn, b"bob", "phone", &dead)
        .await
        .unwrap();
    r.register_connection(&f.conn, b"bob", "laptop", &dead)
        .await
        .unwrap();
    assert_eq!(
        r.route_user(&f.conn, b"alice").await.unwrap(),
        vec!["gw-a#1", "gw-b#1", "gw-dead#1"]
    );
    let _: () = f
        .query(redis::cmd("DEL").arg(f.keys.server_alive(&dead)))
        .await;
    // Past its liveness: never routed, though its entries stay until the cleanup.
    assert_eq!(
        r.route_user(&f.conn, b"alice").await.unwrap(),
        vec!["gw-a#1", "gw-b#1"]
    );
    assert_eq!(
        r.route_user(&f.conn, b"bob").await.unwrap(),
        Vec::<String>::new()
    );
    let report = Cleaner::new(f.keys.clone(), Layout::Conns, 1, 1)
        .clean(&f.conn, &dead, &CancellationToken::new(), |_| {})
        .await
        .unwrap();
    assert_eq!((report.deleted, report.kept), (3, 0));
    assert_eq!(
        r.connections(&f.conn, b"alice").await.unwrap(),
        vec![
            ("laptop".to_owned(), "gw-b#1".to_owned()),
            ("phone".to_owned(), "gw-a#1".to_owned()),
            ("tab-2".to_owned(), "gw-b#1".to_owned()),
        ]
    );
    assert_eq!(
        r.route_user(&f.conn, b"alice").await.unwrap(),
        vec!["gw-a#1", "gw-b#1"]
    );
    assert_eq!(
        keys_of_user(&f, b"bob").await,
        0,
        "bob's empty Hash is left"
    );
    for key in f.keys.server_members_left(&dead) {
        assert_eq!(f.query::<i64>(redis::cmd("EXISTS").arg(key)).await, 0);
    }
    let (announced, _) = evictions(&f).await;
    let mut pairs: Vec<_> = announced.into_iter().map(|(_, m)| m).collect();
    pairs.sort();
    assert_eq!(
        pairs,
        vec![
            b"laptop bob".to_vec(),
            b"phone bob".to_vec(),
            b"tab-1 alice".to_vec()
        ]
    );
    let entries = registry_janitor::evictions::read_all(&f.conn, &f.keys)
        .await
        .unwrap();
    assert!(entries
        .iter()
        .all(|(_, e)| !matches!(e, Some(Eviction::Evicted { .. }))));
}

/// Connections that move to another server while the dead one's cleanup walks are kept,
/// and name the new server; those that stayed are gone; no user Hash is left empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_moving_during_the_cleanup_is_kept() {
    let f = Fixture::new(Layout::Conns);
    let (dead, live) = (server("gw-dead#1"), server("gw-live#1"));
    const N: usize = 3_000;
    f.seed(&dead, N).await;
    f.registry.heartbeat(&f.conn, &live, 60_000).await.unwrap();
    // Moved before the walk: the member stays in the dead server's set.
    let early = entry(Layout::Conns, &dead, 0);
    f.reconnect(&early, &live).await;
    let cleaner = Cleaner::new(f.keys.clone(), Layout::Conns, 20, 1);
    let cleaning = {
        let (cleaner, conn, dead) = (cleaner.clone(), f.conn.clone(), dead.clone());
        tokio::spawn(async move {
            cleaner
                .clean(&conn, &dead, &CancellationToken::new(), |_| {})
                .await
        })
    };
    let mut moved = vec![early];
    for n in (1..N).rev().step_by(7) {
        if cleaning.is_finished() {
            break;
        }
        let e = entry(Layout::Conns, &dead, n);
        f.reconnect(&e, &live).await;
        moved.push(e);
    }
    let report = tokio::time::timeout(Duration::from_secs(60), cleaning)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        moved.len() > 10,
        "only {} moves raced the walk",
        moved.len()
    );
    assert_eq!(report.deleted + report.kept, N as u64);
    let owners = f.registry.owners(&f.conn, &moved).await.unwrap();
    assert!(owners.iter().all(|o| o.as_deref() == Some("gw-live#1")));
    assert_eq!(f.still_pointing(&dead, N).await, 0);
    let left: Vec<Vec<u8>> = f
        .query(redis::cmd("KEYS").arg(f.keys.user_conns_pattern()))
        .await;
    assert_eq!(
        left.len(),
        moved.len(),
        "a user Hash left without its moved connection, or empty"
    );
}

/// A fenced server's register_connection is refused with FENCED and writes nothing; its
/// unregister_connection still drops its own field; the lookup never returns a fenced
/// server, nor one whose liveness key expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_server_writes_nothing_and_is_never_routed() {
    let f = Fixture::new(Layout::Conns);
    let (live, gone) = (server("gw-live#1"), server("gw-gone#1"));
    for s in [&live, &gone] {
        f.registry.heartbeat(&f.conn, s, 60_000).await.unwrap();
    }
    let r = &f.registry;
    r.register_connection(&f.conn, b"u", "c1", &live)
        .await
        .unwrap();
    r.register_connection(&f.conn, b"u", "c2", &gone)
        .await
        .unwrap();
    fence::record(&f.conn, &f.keys, &gone, Some("1-0"), 60_000)
        .await
        .unwrap();
    // Fenced, though its liveness key still stands: never routed.
    assert_eq!(
        r.route_user(&f.conn, b"u").await.unwrap(),
        vec!["gw-live#1"]
    );
    let refused = r.register_connection(&f.conn, b"v", "c9", &gone).await;
    assert!(matches!(refused, Err(Error::Fenced { .. })), "{refused:?}");
    assert_eq!(keys_of_user(&f, b"v").await, 0);
    let members: Vec<Vec<u8>> = f
        .query(redis::cmd("SMEMBERS").arg(f.keys.server_users(&gone)))
        .await;
    assert_eq!(members, vec![b"c2 u".to_vec()]);
    // Moving a connection onto a fenced server is refused and leaves it where it was.
    let refused = r.register_connection(&f.conn, b"u", "c1", &gone).await;
    assert!(matches!(refused, Err(Error::Fenced { .. })));
    assert_eq!(
        r.route_user(&f.conn, b"u").await.unwrap(),
        vec!["gw-live#1"]
    );
    let refused = r.unregister_connection(&f.conn, b"u", "c2", &gone).await;
    assert!(matches!(refused, Err(Error::Fenced { .. })));
    assert_eq!(
        r.connections(&f.conn, b"u").await.unwrap(),
        vec![("c1".to_owned(), "gw-live#1".to_owned())]
    );
    // Expired liveness: not routed either.
    let _: () = f
        .query(redis::cmd("DEL").arg(f.keys.server_alive(&live)))
        .await;
    assert_eq!(
        r.route_user(&f.conn, b"u").await.unwrap(),
        Vec::<String>::new()
    );
    // The refusals are noted as for the other layouts.
    let noted: Option<i64> = f
        .query(
            redis::cmd("HGET")
                .arg(f.keys.server_refusals(&gone))
                .arg("register"),
        )
        .await;
    assert_eq!(noted, Some(2));
}

/// Unregistering the last connection leaves no key; a connection that moved away is not
/// deleted by the old server's unregister; bad connection ids are refused before any
/// write, by the Registry and by the scripts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregister_and_connection_ids() {
    let f = Fixture::new(Layout::Conns);
    let (a, b) = (server("gw-a#1"), server("gw-b#1"));
    let r = &f.registry;
    r.register_connection(&f.conn, b"u", "c1", &a)
        .await
        .unwrap();
    r.register_connection(&f.conn, b"u", "c1", &b)
        .await
        .unwrap();
    r.unregister_connection(&f.conn, b"u", "c1", &a)
        .await
        .unwrap();
    assert_eq!(
        r.connections(&f.conn, b"u").await.unwrap(),
        vec![("c1".to_owned(), "gw-b#1".to_owned())]
    );
    r.unregister_connection(&f.conn, b"u", "c1", &b)
        .await
        .unwrap();
    assert_eq!(keys_of_user(&f, b"u").await, 0);
    for bad in ["", "a b", "a{b", &"x".repeat(201), "tab\t1"] {
        let refused = r.register_connection(&f.conn, b"u", bad, &a).await;
        assert!(
            matches!(refused, Err(Error::Protocol(_))),
            "{bad:?}: {refused:?}"
        );
    }
    // The script refuses too (a connection server in another language).
    let script = redis::Script::new(include_str!("../protocol/register_conn.lua"));
    let mut call = script.prepare_invoke();
    call.key(f.keys.server_fence(&a))
        .key(f.keys.server_refusals(&a))
        .key(f.keys.server_users(&a))
        .key(f.keys.user_conns(b"u"))
        .arg("u")
        .arg(a.as_str())
        .arg("a b");
    let refused: redis::RedisResult<i64> = call.invoke_async(&mut f.conn.clone()).await;
    assert_eq!(refused.unwrap_err().code(), Some("BADCONN"));
    assert_eq!(keys_of_user(&f, b"u").await, 0);
    assert_eq!(
        f.query::<i64>(redis::cmd("EXISTS").arg(f.keys.server_users(&a)))
            .await,
        0
    );
    assert_eq!(conn_member("c", b"u v"), b"c u v".to_vec());
}

/// route_user.lua's reply (an array of server ids, possibly empty) decodes under RESP2
/// and RESP3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_user_decodes_under_resp2_and_resp3() {
    let f = Fixture::new(Layout::Conns);
    let a = server("gw-a#1");
    f.registry.heartbeat(&f.conn, &a, 60_000).await.unwrap();
    f.registry
        .register_connection(&f.conn, b"u", "c1", &a)
        .await
        .unwrap();
    for protocol in ["resp2", "resp3"] {
        let url = format!("{}?protocol={protocol}", f.redis.url());
        let conn =
            registry_janitor::conn::shared(&registry_janitor::conn::client(&url).unwrap()).unwrap();
        assert_eq!(
            f.registry.route_user(&conn, b"u").await.unwrap(),
            vec!["gw-a#1"],
            "{protocol}"
        );
        assert_eq!(
            f.registry.route_user(&conn, b"nobody").await.unwrap(),
            Vec::<String>::new(),
            "{protocol}"
        );
    }
}

/// Every sweep step to the end of one cycle of the drift sweep.
async fn sweep_cycle(r: &registry_janitor::reconcile::Reconciler) {
    let mut cursor: Option<String> = None;
    loop {
        let (next, _, _) = r.sweep_step(cursor.as_deref()).await.unwrap();
        if next == "0" {
            break;
        }
        cursor = Some(next);
    }
}

/// The drift sweep reads only the Hashes of this layout, `user:{<user>}:conns`: an
/// application's Hashes under `user:` (`user:1000`, `user:@alice:status`) are not a user's
/// connections, and a field that is no connection id (`a b`, written by no protocol
/// writer) is never read as another user's entry: nothing live is deleted, nothing that
/// was never a connection is announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drift_sweep_reads_only_this_layouts_entries() {
    use registry_janitor::{metrics::Metrics, reconcile::Reconciler};
    let f = Fixture::with(Layout::Conns, |s| s.heartbeat_grace_ms = 1);
    let live = server("gw-live#1");
    f.registry.heartbeat(&f.conn, &live, 60_000).await.unwrap();
    f.registry
        .register_connection(&f.conn, b"alice", "phone", &live)
        .await
        .unwrap();
    f.registry
        .register_connection(&f.conn, b"b c", "a", &live)
        .await
        .unwrap();
    let p = f.keys.prefix().to_owned();
    for (key, field, value) in [
        (
            format!("{p}user:1000").into_bytes(),
            "email",
            "john@example.com",
        ),
        (
            format!("{p}user:@alice:status").into_bytes(),
            "phone",
            "away",
        ),
        (f.keys.user_conns(b"c"), "a b", "gw-ghost#1"),
    ] {
        let _: () = f
            .query(redis::cmd("HSET").arg(key).arg(field).arg(value))
            .await;
    }
    let r = Reconciler::new(&f.settings, Metrics::new()).await.unwrap();
    sweep_cycle(&r).await;
    sweep_cycle(&r).await;
    let (announced, _) = evictions(&f).await;
    assert!(announced.is_empty(), "announced: {announced:?}");
    assert_eq!(
        f.registry.connections(&f.conn, b"alice").await.unwrap(),
        vec![("phone".to_owned(), "gw-live#1".to_owned())]
    );
    assert_eq!(
        f.registry.connections(&f.conn, b"b c").await.unwrap(),
        vec![("a".to_owned(), "gw-live#1".to_owned())]
    );
    let app: i64 = f
        .query(
            redis::cmd("EXISTS")
                .arg(format!("{p}user:1000"))
                .arg(format!("{p}user:@alice:status")),
        )
        .await;
    assert_eq!(app, 2, "the application's Hashes are left as they are");
}

/// With the reconciler's ACL of the example (HGETALL only on `user:*:conns`), an
/// application Hash under `user:` does not stop the drift sweep: it never reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drift_sweep_runs_under_the_reconcilers_acl_beside_other_hashes() {
    use registry_janitor::{metrics::Metrics, reconcile::Reconciler};
    let f = Fixture::with(Layout::Conns, |s| {
        s.key_prefix = String::new();
        s.heartbeat_grace_ms = 1;
    });
    let conf = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/k8s/redis-acl.example.conf"
    ))
    .unwrap();
    let line = conf
        .lines()
        .find(|l| l.starts_with("user janitor-reconciler "))
        .expect("the reconciler's ACL user");
    let mut rules: Vec<String> = line.split_whitespace().skip(2).map(str::to_owned).collect();
    for rule in rules.iter_mut().filter(|r| r.starts_with('#')) {
        *rule = ">pw".into();
    }
    let _: () = f
        .query(
            redis::cmd("ACL")
                .arg("SETUSER")
                .arg("janitor-reconciler")
                .arg(&rules),
        )
        .await;
    let _: () = f
        .query(redis::cmd("HSET").arg("user:1000").arg("name").arg("John"))
        .await;
    let mut s = f.settings.clone();
    s.redis_url = f
        .redis
        .url()
        .replace("redis://", "redis://janitor-reconciler:pw@");
    let r = Reconciler::new(&s, Metrics::new()).await.unwrap();
    sweep_cycle(&r).await;
}

/// Members whose connection id breaks the rule (too long, not ASCII), written by a plain
/// writer that ignores the protocol, are not entries of this layout: the cleanup finishes,
/// touches none of them, and every `connections.evicted` entry decodes, with the valid
/// connection in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_that_break_the_connection_id_rule_are_not_entries() {
    let f = Fixture::new(Layout::Conns);
    let dead = server("gw-dead#1");
    let long = "x".repeat(300);
    // The longest connection id the rule allows, and one byte more.
    let (longest, over) = ("y".repeat(200), "z".repeat(201));
    let mut pipe = redis::pipe();
    for (connection, user) in [
        (long.as_bytes(), &b"bob"[..]),
        (b"c\xff", b"eve"),
        (b"c{x}", b"frank"),
        (over.as_bytes(), b"dave"),
        (longest.as_bytes(), b"carol"),
        (b"phone", b"alice"),
    ] {
        let mut member = connection.to_vec();
        member.push(b' ');
        member.extend_from_slice(user);
        pipe.hset(f.keys.user_conns(user), connection, dead.as_str())
            .ignore()
            .sadd(f.keys.server_users(&dead), member)
            .ignore();
    }
    let () = pipe.query_async(&mut f.conn.clone()).await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(30),
        Cleaner::new(f.keys.clone(), Layout::Conns, 100, 1).clean(
            &f.conn,
            &dead,
            &CancellationToken::new(),
            |_| {},
        ),
    )
    .await
    .expect("the cleanup finishes")
    .unwrap();
    for user in [&b"alice"[..], b"carol"] {
        assert_eq!(
            keys_of_user(&f, user).await,
            0,
            "the valid connection is cleaned"
        );
    }
    for (user, field) in [
        (&b"bob"[..], long.as_bytes()),
        (b"eve", b"c\xff"),
        (b"frank", b"c{x}"),
        (b"dave", over.as_bytes()),
    ] {
        let left: Option<String> = f
            .query(redis::cmd("HGET").arg(f.keys.user_conns(user)).arg(field))
            .await;
        assert_eq!(
            left.as_deref(),
            Some("gw-dead#1"),
            "not an entry of this layout: left as it is"
        );
    }
    let entries = registry_janitor::evictions::read_all(&f.conn, &f.keys)
        .await
        .unwrap();
    assert!(
        !entries.is_empty() && entries.iter().all(|(_, e)| e.is_some()),
        "{entries:?}"
    );
}
