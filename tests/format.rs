//! The data format: workers of two builds that differ only in their format number
//! (`REGISTRY_JANITOR_FORMAT`), as real processes side by side under load, then the older
//! one gone, then a rollback; a worker behind the format in use; steps refused once the
//! format moved on, on one node and on a cluster; the announcements and `format set`.

mod common;

use std::{
    collections::{HashMap, HashSet},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use common::*;
use rand::Rng;
use registry_janitor::{
    cleanup::Cleaner,
    config::Layout,
    conn::RedisConn,
    error::Error,
    event::ServerId,
    format::{self, Build},
    keys::Keys,
    registry::Registry,
    status,
};

/// The live bound of these tests' workers (`claim_min_idle_ms`): announcements are
/// refreshed every third of it. Long enough that a busy machine does not make a live
/// worker look gone.
const LIVE_MS: u64 = 5_000;

/// A worker process of format `format` (the override), consumer `name`, serving its
/// metrics on `addr`.
fn worker_of_format(
    settings: &registry_janitor::config::Settings,
    format: u32,
    name: &str,
    addr: &str,
) -> WorkerProcess {
    let format = format.to_string();
    WorkerProcess::start_with(
        settings,
        &[
            (format::OVERRIDE_ENV, format.as_str()),
            ("JANITOR_CONSUMER_NAME", name),
            ("JANITOR_METRICS_ADDR", addr),
        ],
    )
}

async fn in_use(f: &Fixture) -> u32 {
    format::in_use(&f.conn, &f.keys).await.unwrap()
}

/// `registry-janitor format set <n> [--force]`: (exit code, stdout, stderr).
fn format_set(f: &Fixture, n: u32, force: bool) -> (i32, String, String) {
    let mut cmd = janitor(&f.settings);
    cmd.args(["format", "set", &n.to_string()]);
    if force {
        cmd.arg("--force");
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `registry-janitor format status --json`.
fn format_status(f: &Fixture) -> serde_json::Value {
    let out = run_ok(janitor(&f.settings).args(["format", "status", "--json"]));
    serde_json::from_str(&out).unwrap()
}

/// The live workers `format status` lists, as (consumer, format).
fn live_workers(status: &serde_json::Value) -> Vec<(String, u64)> {
    let mut live: Vec<(String, u64)> = status["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["live"] == true)
        .map(|w| {
            (
                w["consumer"].as_str().unwrap().to_owned(),
                w["format"].as_u64().unwrap(),
            )
        })
        .collect();
    live.sort();
    live
}

/// What the load did: every user it moved to a live server (the last move wins) and
/// every user it registered, with the live server that must hold each at the end.
#[derive(Default)]
struct Oracle {
    owners: HashMap<Vec<u8>, String>,
    moves: usize,
    registrations: usize,
}

/// Connection servers at work while the workers clean: users of the servers that die (or
/// will) move to live servers (a reconnect), new users register on live servers through
/// the protocol, and the live servers heartbeat.
fn start_load(
    conn: RedisConn,
    keys: Keys,
    registry: Registry,
    dying: Vec<ServerId>,
    live: Vec<ServerId>,
    users: usize,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Oracle> {
    tokio::spawn(async move {
        let mut oracle = Oracle::default();
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let (d, u, l, l2) = {
                let mut rng = rand::rng();
                (
                    rng.random_range(0..dying.len()),
                    rng.random_range(0..users),
                    rng.random_range(0..live.len()),
                    rng.random_range(0..live.len()),
                )
            };
            let moved = user(&dying[d], u);
            reconnect_telling(&conn, &keys, Layout::Hash, &moved, &live[l]).await;
            oracle.owners.insert(moved, live[l].to_string());
            oracle.moves += 1;
            if n % 3 == 0 {
                let fresh = format!("fresh-{n}@{}", live[l2]).into_bytes();
                registry.register(&conn, &fresh, &live[l2]).await.unwrap();
                oracle.owners.insert(fresh, live[l2].to_string());
                oracle.registrations += 1;
            }
            if n % 500 == 0 {
                for s in &live {
                    registry.heartbeat(&conn, s, 60_000).await.unwrap();
                }
            }
            n += 1;
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        oracle
    })
}

/// Waits until `/readyz` of `addr` answers `code`, with a body that says `saying` (a
/// worker may be unready for other reasons a moment first, as before its first format
/// round); returns the body.
async fn wait_ready(f: &Fixture, addr: &str, code: u16, saying: &str, what: &str) -> String {
    let mut body = String::new();
    wait_until(&f.redis, what, Duration::from_secs(30), || {
        let (status, text) = http_get(addr, "/readyz");
        let hit = status == code && text.contains(saying);
        if hit {
            body = text;
        }
        async move { hit }
    })
    .await;
    body
}

fn metric(addr: &str, series: &str) -> Option<f64> {
    sample(&http_get(addr, "/metrics").1, series)
}

/// The acceptance test: two builds that differ only in their format number, as worker
/// processes side by side under load (moves, registrations, dead servers); then the older
/// one stopped, and the newer moves the format forward; then an older worker started again
/// (behind: not ready, takes nothing), and a rollback to its format; then the newer one
/// stopped. Every event is acknowledged, no entry names a dead server (0 stale), and every
/// live entry is where the connection servers put it (0 lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_formats_side_by_side_under_load_then_the_old_one_gone_then_a_rollback() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.claim_min_idle_ms = LIVE_MS;
        s.chunk_size = 20;
        s.chunks_in_flight = 1;
        s.drain_timeout_ms = 300;
    });
    const USERS: usize = 3_000;
    let dying: Vec<ServerId> = (0..12)
        .map(|i| server(&format!("gw-dying-{i}#1")))
        .collect();
    let live: Vec<ServerId> = (0..4).map(|i| server(&format!("gw-live-{i}#1"))).collect();
    for s in &dying {
        f.seed(s, USERS).await;
    }
    for s in &live {
        f.seed(s, 200).await;
    }
    let stop_load = Arc::new(AtomicBool::new(false));
    let load = start_load(
        f.conn.clone(),
        f.keys.clone(),
        f.registry.clone(),
        dying.clone(),
        live.clone(),
        USERS,
        stop_load.clone(),
    );
    let mut killed: Vec<String> = Vec::new();
    let mut dead = dying.iter();
    let mut kill_next = |n: usize| {
        let batch: Vec<ServerId> = dead.by_ref().take(n).cloned().collect();
        let (conn, keys) = (f.conn.clone(), f.keys.clone());
        async move {
            let mut ids = Vec::new();
            for s in &batch {
                ids.push(kill(&conn, &keys, s).await);
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            ids
        }
    };

    // Side by side: format 1 and format 2 (which works under 1 to 2) under format 1.
    let (old_addr, new_addr) = (free_addr(), free_addr());
    let old = worker_of_format(&f.settings, 1, "old-1", &old_addr);
    let new = worker_of_format(&f.settings, 2, "new-2", &new_addr);
    wait_ready(&f, &old_addr, 200, "ready", "the format-1 worker ready").await;
    wait_ready(&f, &new_addr, 200, "ready", "the format-2 worker ready").await;
    killed.extend(kill_next(4).await);
    // Longer than the live bound: the format-2 worker could move the format forward by
    // now, but the format-1 worker is announced.
    tokio::time::sleep(Duration::from_millis(LIVE_MS + 2_000)).await;
    assert_eq!(
        in_use(&f).await,
        1,
        "the format moved while a format-1 worker was live"
    );
    assert_eq!(
        live_workers(&format_status(&f)),
        vec![("new-2".to_owned(), 2), ("old-1".to_owned(), 1)]
    );
    assert_eq!(
        metric(&new_addr, "registry_janitor_format_in_use"),
        Some(1.0)
    );

    // The format-1 worker goes (a rolling update's last old pod): the format moves to 2.
    killed.extend(kill_next(2).await);
    let cleaned = r#"registry_janitor_events_total{outcome="cleaned"}"#;
    let cleaned_by_old = metric(&old_addr, cleaned).unwrap_or(0.0);
    old.signal("TERM");
    let (code, log) = old.wait(Duration::from_secs(20));
    assert_eq!(code.and_then(|c| c.code()), Some(0), "{log}");
    wait_until(
        &f.redis,
        "the format moved forward to 2",
        Duration::from_secs(30),
        || async { in_use(&f).await == 2 },
    )
    .await;
    wait_until(
        &f.redis,
        "the move logged",
        Duration::from_secs(10),
        || async { new.log().contains("moved the format in use forward") },
    )
    .await;
    killed.extend(kill_next(1).await);
    // A rollback refused: the format-2 worker would move the format forward again.
    let (code, _, stderr) = format_set(&f, 1, false);
    assert_ne!(code, 0, "format set 1 went through: {stderr}");
    assert!(
        stderr.contains("would move the format forward again"),
        "{stderr}"
    );
    assert_eq!(in_use(&f).await, 2);

    // An older worker started now is behind: not ready, saying why; takes nothing.
    let again_addr = free_addr();
    let again = worker_of_format(&f.settings, 1, "old-1-again", &again_addr);
    let why = wait_ready(
        &f,
        &again_addr,
        503,
        "format 2 is in use",
        "the format-1 worker not ready",
    )
    .await;
    assert!(
        why.contains("format 2 is in use") && why.contains("takes no work"),
        "{why}"
    );
    assert_eq!(
        metric(&again_addr, "registry_janitor_format_behind"),
        Some(1.0)
    );
    let behind_ids = kill_next(2).await;
    for id in &behind_ids {
        wait_until(
            &f.redis,
            "an event cleaned while a worker is behind",
            Duration::from_secs(60),
            || async { !is_pending(&f.conn, &f.keys, id).await },
        )
        .await;
    }
    killed.extend(behind_ids);
    assert_eq!(
        metric(&again_addr, cleaned),
        Some(0.0),
        "a worker behind cleaned"
    );
    assert!(
        again.log().contains("taking no new work"),
        "{}",
        again.log()
    );

    // The rollback: to format 1, with a worker of format 1 announced, the format-2 worker
    // works on under format 1 and cannot move it forward again.
    let (code, stdout, stderr) = format_set(&f, 1, false);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("2 -> 1"), "{stdout}");
    wait_ready(
        &f,
        &again_addr,
        200,
        "ready",
        "the format-1 worker ready after the rollback",
    )
    .await;
    assert_eq!(
        metric(&again_addr, "registry_janitor_format_behind"),
        Some(0.0)
    );
    killed.extend(kill_next(1).await);
    tokio::time::sleep(Duration::from_millis(LIVE_MS + 2_000)).await;
    assert_eq!(
        in_use(&f).await,
        1,
        "the format moved forward again after the rollback"
    );
    // The format-2 worker goes; the format-1 worker cleans the rest alone.
    let cleaned_by_new = metric(&new_addr, cleaned).unwrap_or(0.0);
    new.signal("TERM");
    let (code, log) = new.wait(Duration::from_secs(20));
    assert_eq!(code.and_then(|c| c.code()), Some(0), "{log}");
    let last = kill_next(2).await;
    killed.extend(last);
    assert_eq!(killed.len(), dying.len());

    f.wait_idle().await;
    stop_load.store(true, Ordering::Relaxed);
    let oracle = load.await.unwrap();
    f.wait_idle().await;
    // Counted right after each acknowledgement.
    wait_until(
        &f.redis,
        "the format-1 worker cleaned after the rollback",
        Duration::from_secs(10),
        || async { metric(&again_addr, cleaned).unwrap_or(0.0) >= 2.0 },
    )
    .await;
    assert_eq!(in_use(&f).await, 1);

    // Every event acknowledged, nothing dead-lettered.
    for id in &killed {
        assert!(!is_pending(&f.conn, &f.keys, id).await, "{id} pending");
    }
    let s = status::collect_from(&f.conn, &f.keys).await.unwrap();
    assert!(s.is_idle(), "{s:?}");
    assert!(f.dead_letters().await.is_empty(), "dead letters");
    // 0 stale: no entry names a server whose event is acknowledged, and nothing of
    // theirs is left to walk.
    let registry: HashMap<Vec<u8>, String> =
        f.query(redis::cmd("HGETALL").arg(f.keys.registry())).await;
    let dead_names: HashSet<&str> = dying.iter().map(|s| s.as_str()).collect();
    let stale = registry
        .values()
        .filter(|owner| dead_names.contains(owner.as_str()))
        .count();
    assert_eq!(stale, 0, "entries naming dead servers");
    for s in &dying {
        let left: u64 = f
            .query(redis::cmd("EXISTS").arg(&f.keys.server_members_left(s)))
            .await;
        assert_eq!(left, 0, "{s}: members left to walk");
    }
    // 0 lost: every live entry where the connection servers put it.
    for s in &live {
        assert_eq!(
            f.still_pointing(s, 200).await,
            200,
            "{s}: live entries lost"
        );
    }
    let lost: Vec<_> = oracle
        .owners
        .iter()
        .filter(|(u, owner)| registry.get(*u) != Some(*owner))
        .take(5)
        .collect();
    assert!(lost.is_empty(), "live entries lost: {lost:?}");
    assert!(
        oracle.moves > 500 && oracle.registrations > 100,
        "too little load to prove anything: {} moves, {} registrations",
        oracle.moves,
        oracle.registrations
    );
    let cleaned_by_again = metric(&again_addr, cleaned).unwrap_or(0.0);
    again.signal("TERM");
    let (code, log) = again.wait(Duration::from_secs(20));
    assert_eq!(code.and_then(|c| c.code()), Some(0), "{log}");
    let announced: u64 = f
        .query(redis::cmd("HLEN").arg(f.keys.format_workers()))
        .await;
    assert_eq!(
        announced, 0,
        "workers that exit withdraw their announcement"
    );
    eprintln!(
        "format: {} events (cleaned: {cleaned_by_old} by the format-1 worker, \
         {cleaned_by_new} by the format-2 worker, {cleaned_by_again} by the format-1 worker \
         started again), {} moves, {} registrations, across format 1 and 2 side by side, \
         the move to 2 and the rollback to 1; stale 0, lost 0, pending 0",
        killed.len(),
        oracle.moves,
        oracle.registrations
    );
}

/// A worker mid-cleanup when the format moves on (forced here, since the worker is live):
/// its next step is refused, it hands the cleanup over and takes no more work, and a
/// worker of the new format takes the cleanup over at once and finishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_workers_cleanup_is_handed_over_when_the_format_moves_on() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.claim_min_idle_ms = LIVE_MS;
        s.chunk_size = 2;
        s.chunks_in_flight = 1;
    });
    const USERS: usize = 40_000;
    let (dead, live) = (server("gw-long#1"), server("gw-live#1"));
    f.seed(&dead, USERS).await;
    f.seed(&live, 500).await;
    let old_addr = free_addr();
    let old = worker_of_format(&f.settings, 1, "old-1", &old_addr);
    wait_ready(&f, &old_addr, 200, "ready", "the format-1 worker ready").await;
    let id = f.kill(&dead).await;
    wait_walked(&f.redis, &f.conn, &f.keys, &dead, 200).await;

    // Refused while the format-1 worker is live: it cannot work under format 2.
    let (code, _, stderr) = format_set(&f, 2, false);
    assert_ne!(code, 0);
    assert!(
        stderr.contains("old-1") && stderr.contains("cannot work under format 2"),
        "{stderr}"
    );
    let (code, stdout, stderr) = format_set(&f, 2, true);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("old-1"),
        "the forced set names who stops: {stdout}"
    );

    let why = wait_ready(
        &f,
        &old_addr,
        503,
        "format 2 is in use",
        "the format-1 worker behind",
    )
    .await;
    assert!(why.contains("format 2 is in use"), "{why}");
    wait_until(
        &f.redis,
        "the cleanup handed back",
        Duration::from_secs(30),
        || async { old.log().contains("entry handed back") },
    )
    .await;
    assert!(
        old.log()
            .contains("does not work under the data format in use"),
        "{}",
        old.log()
    );
    let left = f.still_pointing(&dead, USERS).await;
    assert!(
        left > 0,
        "the cleanup finished before the format moved: nothing was tested"
    );
    // The progress stands still: no step of the format-1 worker goes through now.
    let scanned = || async {
        f.query::<Option<u64>>(
            redis::cmd("HGET")
                .arg(f.keys.server_cleanup(&dead))
                .arg("scanned"),
        )
        .await
    };
    let before = scanned().await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(
        scanned().await,
        before,
        "a step of the worker behind went through"
    );
    assert!(is_pending(&f.conn, &f.keys, &id).await);

    let new_addr = free_addr();
    let new = worker_of_format(&f.settings, 2, "new-2", &new_addr);
    f.wait_idle().await;
    assert!(
        new.log().contains("taking over an idle entry"),
        "{}",
        new.log()
    );
    assert_eq!(f.still_pointing(&dead, USERS).await, 0, "stale entries");
    assert_eq!(f.still_pointing(&live, 500).await, 500, "live entries lost");
    assert!(f.dead_letters().await.is_empty());
    assert_eq!(
        metric(
            &old_addr,
            r#"registry_janitor_events_total{outcome="cleaned"}"#
        ),
        Some(0.0)
    );
    for w in [old, new] {
        w.signal("TERM");
        let (code, log) = w.wait(Duration::from_secs(20));
        assert_eq!(code.and_then(|c| c.code()), Some(0), "{log}");
    }
}

/// On one node the step itself checks the format, in the same script: a step of a build
/// older than the format in use is refused and writes nothing; a newer build's steps stamp
/// the progress record with the format in use; after a rollback, a step of the older build
/// is refused on a record stamped newer, until a newer build's step stamps it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_is_refused_once_the_format_moved_on() {
    let f = Fixture::new(Layout::Hash);
    const USERS: usize = 200;
    let dead = server("gw-step#1");
    f.seed(&dead, USERS).await;
    let cleaner = |build: Build| Cleaner::new(f.keys.clone(), Layout::Hash, 10, 1).format(build);
    let (old, new, newest) = (Build::new(1, 1), Build::new(2, 1), Build::new(3, 3));
    let progress = || async {
        let fields: HashMap<String, String> = f
            .query(redis::cmd("HGETALL").arg(f.keys.server_cleanup(&dead)))
            .await;
        fields
    };
    let step = cleaner(old).step(&f.conn, &dead).await.unwrap();
    assert!(step.scanned > 0 && !step.done);
    assert!(
        !progress().await.contains_key("format"),
        "format 1 needs no stamp"
    );

    let moved = format::set(&f.conn, &f.keys, 2, LIVE_MS, false)
        .await
        .unwrap();
    assert!(moved.set, "no worker is announced: {moved:?}");
    let (before, pointing) = (progress().await, f.still_pointing(&dead, USERS).await);
    let refused = cleaner(old).step(&f.conn, &dead).await.unwrap_err();
    assert!(
        matches!(&refused, Error::Format(why) if why.contains("format 2 is in use")),
        "{refused}"
    );
    assert_eq!(progress().await, before, "a refused step wrote");
    assert_eq!(
        f.still_pointing(&dead, USERS).await,
        pointing,
        "a refused step deleted"
    );
    // Too new a build is refused as well (format 1 in use would be older than it takes).
    format::set(&f.conn, &f.keys, 1, LIVE_MS, false)
        .await
        .unwrap();
    assert!(matches!(
        cleaner(newest).step(&f.conn, &dead).await,
        Err(Error::Format(_))
    ));
    format::set(&f.conn, &f.keys, 2, LIVE_MS, false)
        .await
        .unwrap();

    // The newer build works under format 2 and stamps the record.
    cleaner(new).step(&f.conn, &dead).await.unwrap();
    assert_eq!(
        progress().await.get("format").map(String::as_str),
        Some("2")
    );
    // Rolled back to 1: the older build does not read a record written under format 2...
    format::set(&f.conn, &f.keys, 1, LIVE_MS, false)
        .await
        .unwrap();
    let refused = cleaner(old).step(&f.conn, &dead).await.unwrap_err();
    assert!(
        matches!(&refused, Error::Format(why) if why.contains("written under format 2")),
        "{refused}"
    );
    // ...until the newer build, working under format 1, writes it in format 1.
    cleaner(new).step(&f.conn, &dead).await.unwrap();
    assert_eq!(
        progress().await.get("format").map(String::as_str),
        Some("1")
    );
    let report = cleaner(old)
        .clean(&f.conn, &dead, &Default::default(), |_| {})
        .await
        .unwrap();
    assert!(report.steps > 0);
    assert_eq!(f.still_pointing(&dead, USERS).await, 0);
}

/// The format stamped on `dead`'s progress record (None: no stamp).
async fn record_format(f: &Fixture, dead: &ServerId) -> Option<String> {
    f.query(
        redis::cmd("HGET")
            .arg(f.keys.server_cleanup(dead))
            .arg("format"),
    )
    .await
}

/// A cleanup whose progress record is not written yet is never refused for the record's
/// format (a record without the field is in format 1): a build that works only under
/// format 2, with format 2 in use, takes the first step and stamps the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_step_is_not_refused_for_a_record_not_written_yet() {
    let f = Fixture::new(Layout::Hash);
    const USERS: usize = 50;
    let dead = server("gw-first#1");
    f.seed(&dead, USERS).await;
    let moved = format::set(&f.conn, &f.keys, 2, LIVE_MS, false)
        .await
        .unwrap();
    assert!(moved.set, "no worker is announced: {moved:?}");
    let step = Cleaner::new(f.keys.clone(), Layout::Hash, 10, 1)
        .format(Build::new(2, 2))
        .step(&f.conn, &dead)
        .await
        .unwrap();
    assert!(step.scanned > 0, "{step:?}");
    assert_eq!(record_format(&f, &dead).await.as_deref(), Some("2"));
}

/// The announcements: the format moves forward only to the announcing worker's own
/// format, only once it has been announced for the live bound, and never while a worker
/// of an older format was seen within the bound; old announcements are removed.
/// Deterministic: the announcements are written with times relative to Redis's clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_format_moves_forward_only_when_no_older_worker_is_announced() {
    let f = Fixture::new(Layout::Hash);
    let (old, new) = (Build::new(1, 1), Build::new(2, 1));
    let now = || async {
        let (s, us): (u64, u64) = f.query(&redis::cmd("TIME")).await;
        s * 1000 + us / 1000
    };
    let put = |consumer: &'static str, value: String| {
        let (conn, key) = (f.conn.clone(), f.keys.format_workers());
        async move {
            let _: () = redis::cmd("HSET")
                .arg(key)
                .arg(consumer)
                .arg(value)
                .query_async(&mut conn.clone())
                .await
                .unwrap();
        }
    };
    let announce = |consumer: &'static str, build: Build| {
        let (conn, keys) = (f.conn.clone(), f.keys.clone());
        async move {
            format::announce(&conn, &keys, consumer, build, LIVE_MS, 3_600_000, true)
                .await
                .unwrap()
        }
    };

    // A newer worker just started: it waits a live bound before any move.
    let first = announce("new", new).await;
    assert_eq!((first.in_use, first.moved, first.older), (1, false, None));

    // Announced for long, with an older worker seen just now: stays.
    let t = now().await;
    put("new", format!("2:1:{}:{}", t - 60_000, t - 100)).await;
    put("old", format!("1:1:{}:{t}", t - 60_000)).await;
    let blocked = announce("new", new).await;
    assert_eq!(blocked.in_use, 1);
    assert!(!blocked.moved);
    assert_eq!(blocked.older, Some(("old".to_owned(), 1)));
    // The older worker is still announced and sees the format it works under.
    assert_eq!(announce("old", old).await.in_use, 1);

    // The older worker last seen longer ago than the bound: gone; the format moves.
    let t = now().await;
    put("old", format!("1:1:{}:{}", t - 60_000, t - LIVE_MS - 1_000)).await;
    put("gone-long-ago", format!("1:1:1:{}", t - 7_200_000)).await;
    let moved = announce("new", new).await;
    assert_eq!((moved.in_use, moved.moved, moved.older), (2, true, None));
    assert_eq!(in_use(&f).await, 2);
    let gone: bool = f
        .query(
            redis::cmd("HEXISTS")
                .arg(f.keys.format_workers())
                .arg("gone-long-ago"),
        )
        .await;
    assert!(
        !gone,
        "an announcement older than the forget bound is removed"
    );
    // A newer worker that comes back after a gap longer than the bound starts its wait
    // again; moving forward needs its own format to be newer anyway.
    let t = now().await;
    put(
        "newest",
        format!("3:2:{}:{}", t - 60_000, t - LIVE_MS - 1_000),
    )
    .await;
    let again = announce("newest", Build::new(3, 2)).await;
    assert_eq!((again.in_use, again.moved), (2, false));
    // An older build, announced now, is told it is behind (the format in use is newer).
    let behind = announce("old", old).await;
    assert_eq!(
        old.stance(behind.in_use),
        format::Stance::Behind { in_use: 2 }
    );
    format::withdraw(&f.conn, &f.keys, "old").await.unwrap();
    let status = format::status(&f.conn, &f.keys, new, LIVE_MS)
        .await
        .unwrap();
    let names: Vec<&str> = status.workers.iter().map(|w| w.consumer.as_str()).collect();
    assert!(!names.contains(&"old"), "{names:?}");
}

/// `format set`: refused while a live worker cannot work under the format asked for, or
/// while live workers of a newer format would move it forward again at once (none of that
/// format announced); forced, set whatever the workers; gone workers do not count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn format_set_refuses_what_live_workers_would_undo_or_cannot_work_under() {
    let f = Fixture::new(Layout::Hash);
    let (s, us): (u64, u64) = f.query(&redis::cmd("TIME")).await;
    let t = s * 1000 + us / 1000;
    let put = |consumer: &str, value: String| {
        redis::cmd("HSET")
            .arg(f.keys.format_workers())
            .arg(consumer)
            .arg(value)
            .to_owned()
    };
    let _: () = f.query(&put("new", format!("2:1:{t}:{t}"))).await;
    let _: () = f
        .query(&put("long-gone", format!("3:3:1:{}", t - 60_000)))
        .await;
    format::set(&f.conn, &f.keys, 2, LIVE_MS, true)
        .await
        .unwrap();

    let back = format::set(&f.conn, &f.keys, 1, LIVE_MS, false)
        .await
        .unwrap();
    assert!(
        !back.set && back.moves_back && back.cannot.is_empty(),
        "{back:?}"
    );
    assert_eq!(in_use(&f).await, 2);
    let _: () = f.query(&put("old", format!("1:1:{t}:{t}"))).await;
    let back = format::set(&f.conn, &f.keys, 1, LIVE_MS, false)
        .await
        .unwrap();
    assert!(back.set && back.previous == 2, "{back:?}");
    let forward = format::set(&f.conn, &f.keys, 2, LIVE_MS, false)
        .await
        .unwrap();
    assert!(!forward.set, "{forward:?}");
    assert_eq!(forward.cannot, vec![("old".to_owned(), 1, 1)]);
    let forced = format::set(&f.conn, &f.keys, 2, LIVE_MS, true)
        .await
        .unwrap();
    assert!(forced.set && forced.cannot.len() == 1, "{forced:?}");
    assert_eq!(in_use(&f).await, 2);
    assert!(format::set(&f.conn, &f.keys, 0, LIVE_MS, true)
        .await
        .is_err());
}

/// On a cluster the format in use is in another slot than the cleanup's: the worker
/// checks it before each chunk, and the chunk's scripts refuse a progress record written
/// under a format the worker does not work under (as a newer worker's chunks leave it),
/// before any write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_chunk_is_refused_once_the_format_moved_on() {
    init_logs();
    if !registry_janitor_testkit::RedisCluster::supported() {
        cannot_run("this redis-server cannot run a cluster (or redis-cli is missing)");
        return;
    }
    let cluster =
        tokio::task::spawn_blocking(|| registry_janitor_testkit::RedisCluster::start(3, 0))
            .await
            .unwrap()
            .expect("start a local cluster");
    let settings = cluster_settings(&cluster, Layout::Keys);
    let conn = fresh_conn(&settings).await;
    let keys = Keys::for_settings(&settings);
    let registry = Registry::new(keys.clone(), Layout::Keys);
    const USERS: usize = 500;
    let dead = server("gw-cluster#1");
    seed(&registry, &conn, &dead, USERS).await;
    let cleaner = |build: Build| Cleaner::new(keys.clone(), Layout::Keys, 50, 1).format(build);
    let stop = Default::default();

    // The format in use moved on: the worker's own check, before the chunk.
    format::set(&conn, &keys, 2, LIVE_MS, false).await.unwrap();
    let refused = cleaner(Build::new(1, 1))
        .clean(&conn, &dead, &stop, |_| {})
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, Error::Format(why) if why.contains("format 2 is in use")),
        "{refused}"
    );
    // A worker that read format 1 before the move, on a record a newer worker's chunk
    // stamped: the scan refuses it before any write.
    format::set(&conn, &keys, 1, LIVE_MS, false).await.unwrap();
    let _: () = redis::cmd("HSET")
        .arg(keys.server_cleanup(&dead))
        .arg("format")
        .arg(2)
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let refused = cleaner(Build::new(1, 1))
        .clean(&conn, &dead, &stop, |_| {})
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, Error::Format(why) if why.contains("written under format 2")),
        "{refused}"
    );
    assert_eq!(still_pointing(&registry, &conn, &dead, USERS).await, USERS);
    let walking: u64 = redis::cmd("EXISTS")
        .arg(keys.server_walking(&dead))
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    assert_eq!(walking, 0, "the refused scan renamed the set");
    // A build that works under both cleans, and writes the record in the format in use.
    let report = cleaner(Build::new(2, 1))
        .clean(&conn, &dead, &stop, |_| {})
        .await
        .unwrap();
    assert!(report.steps > 0);
    assert_eq!(still_pointing(&registry, &conn, &dead, USERS).await, 0);
    // `format status` reads the cluster (the two keys share a slot; TIME from any node).
    let status = format::status(&conn, &keys, Build::new(2, 1), LIVE_MS)
        .await
        .unwrap();
    assert_eq!((status.in_use, status.recorded), (1, true));
}

/// After a rollback, a cleanup whose progress a newer worker wrote in the newer format:
/// an older worker, which works under the format in use, does not read it and counts a
/// failed delivery (it stays ready, and is not behind), so the entry is dead-lettered with
/// the reason past `max_deliveries`; replayed while a newer worker runs, it is finished,
/// the record written back in the format in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_rollback_a_cleanup_written_in_the_newer_format_goes_to_a_newer_worker() {
    let f = Fixture::with(Layout::Hash, |s| {
        s.claim_min_idle_ms = 1_000;
        s.max_deliveries = 2;
        s.chunk_size = 50;
    });
    const USERS: usize = 2_000;
    let (dead, live) = (server("gw-rolled#1"), server("gw-live#1"));
    f.seed(&dead, USERS).await;
    f.seed(&live, 100).await;
    // A worker of format 2 made a few steps under format 2, then the rollback.
    format::set(&f.conn, &f.keys, 2, LIVE_MS, false)
        .await
        .unwrap();
    let newer = Cleaner::new(f.keys.clone(), Layout::Hash, 50, 1).format(Build::new(2, 1));
    for _ in 0..3 {
        newer.step(&f.conn, &dead).await.unwrap();
    }
    assert_eq!(record_format(&f, &dead).await.as_deref(), Some("2"));
    format::set(&f.conn, &f.keys, 1, LIVE_MS, false)
        .await
        .unwrap();

    let old_addr = free_addr();
    let old = worker_of_format(&f.settings, 1, "old-1", &old_addr);
    wait_ready(&f, &old_addr, 200, "ready", "the format-1 worker ready").await;
    f.kill(&dead).await;
    wait_until(
        &f.redis,
        "the cleanup dead-lettered",
        Duration::from_secs(60),
        || async { f.dead_letters().await.len() == 1 },
    )
    .await;
    let letter = &f.dead_letters().await[0];
    let error = String::from_utf8_lossy(letter.field("error").unwrap()).into_owned();
    assert!(error.contains("written under format 2"), "{error}");
    wait_ready(
        &f,
        &old_addr,
        200,
        "ready",
        "the older worker ready: not behind",
    )
    .await;
    assert_eq!(
        metric(&old_addr, "registry_janitor_format_behind"),
        Some(0.0)
    );

    let new_addr = free_addr();
    let new = worker_of_format(&f.settings, 2, "new-2", &new_addr);
    wait_ready(&f, &new_addr, 200, "ready", "the format-2 worker ready").await;
    old.signal("TERM");
    let (code, log) = old.wait(Duration::from_secs(20));
    assert_eq!(code.and_then(|c| c.code()), Some(0), "{log}");
    run_ok(janitor(&f.settings).args(["dead-letters", "replay", "--all"]));
    f.wait_idle().await;
    assert!(f.dead_letters().await.is_empty());
    assert_eq!(f.still_pointing(&dead, USERS).await, 0, "stale entries");
    assert_eq!(f.still_pointing(&live, 100).await, 100, "live entries lost");
    new.signal("TERM");
    let (code, log) = new.wait(Duration::from_secs(20));
    assert_eq!(code.and_then(|c| c.code()), Some(0), "{log}");
}
