//! The guard's verdict hold: a monitoring mistake, or a fleet cut off from Redis, never
//! fences a live fleet; a real zone outage is never held. Each test runs a fleet of
//! connection servers that heartbeat through the protocol (heartbeat.lua) with users on
//! every server, and asserts what users rely on: fences, the registry's entries, what was
//! acknowledged, held or dead-lettered.

mod common;

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use common::*;
use registry_janitor::{
    config::Layout,
    conn::RedisConn,
    event::{ServerDead, ServerId},
    guard::{hold, Doubt, HoldState, HELD_CONSUMER},
    keys::Keys,
    reconcile::Reconciler,
    stream,
};
use tokio::task::JoinHandle;

const USERS: usize = 20;
/// Liveness TTL of the fleet's heartbeats (over six periods, inside the grace period of
/// `guard_settings`, as a deployment sets it), and their period.
const TTL_MS: u64 = 1_000;
const BEAT: Duration = Duration::from_millis(150);

/// A fleet of connection servers heartbeating through the protocol, each of which can be
/// silenced (its heartbeats stop, as when it dies or is cut off) and brought back.
struct Fleet {
    servers: Vec<ServerId>,
    silent: Vec<Arc<AtomicBool>>,
    beats: Vec<JoinHandle<()>>,
}

impl Fleet {
    async fn start(f: &Fixture, name: &str, n: usize) -> Fleet {
        let servers: Vec<ServerId> = (0..n).map(|i| server(&format!("{name}-{i}#1"))).collect();
        let mut silent = Vec::new();
        let mut beats = Vec::new();
        for s in &servers {
            f.seed(s, USERS).await;
            let flag = Arc::new(AtomicBool::new(false));
            silent.push(flag.clone());
            let (registry, conn, s) = (f.registry.clone(), f.conn.clone(), s.clone());
            beats.push(tokio::spawn(async move {
                loop {
                    if !flag.load(Ordering::SeqCst) {
                        // A fenced server stops here: it would close its sockets and
                        // start again under a new id.
                        if let Err(registry_janitor::Error::Fenced { .. }) =
                            registry.heartbeat(&conn, &s, TTL_MS).await
                        {
                            return;
                        }
                    }
                    tokio::time::sleep(BEAT).await;
                }
            }));
        }
        // Every seeded liveness key now has the fleet's short TTL.
        tokio::time::sleep(BEAT * 3).await;
        Fleet {
            servers,
            silent,
            beats,
        }
    }

    fn silence(&self, range: std::ops::Range<usize>) {
        for flag in &self.silent[range] {
            flag.store(true, Ordering::SeqCst);
        }
    }

    fn resume(&self, range: std::ops::Range<usize>) {
        for flag in &self.silent[range] {
            flag.store(false, Ordering::SeqCst);
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for b in &self.beats {
            b.abort();
        }
    }
}

/// Publishes a verdict for `server` as monitoring does, leaving its liveness alone.
async fn verdict(conn: &RedisConn, keys: &Keys, server: &ServerId) -> String {
    let event = ServerDead::new(
        server,
        Some("probe failed".into()),
        Some("monitoring".into()),
    );
    stream::publish_event(conn, keys, &event.encode())
        .await
        .unwrap()
}

async fn fenced(f: &Fixture, servers: &[ServerId]) -> Vec<ServerId> {
    let mut out = Vec::new();
    for s in servers {
        if registry_janitor::fence::is_fenced(&f.conn, &f.keys, s)
            .await
            .unwrap()
        {
            out.push(s.clone());
        }
    }
    out
}

async fn held(f: &Fixture) -> Vec<hold::Hold> {
    hold::list(&f.conn, &f.keys).await.unwrap()
}

/// Users of `servers` whose entry still names their server.
async fn entries_left(f: &Fixture, servers: &[ServerId]) -> usize {
    let mut n = 0;
    for s in servers {
        n += f.still_pointing(s, USERS).await;
    }
    n
}

/// Every entry id of `ids` is pending with the guard's consumer.
async fn all_parked(f: &Fixture, ids: &[String]) -> bool {
    for id in ids {
        let owner = pending_row(&f.conn, &f.keys, id).await.map(|(o, _)| o);
        if owner.as_deref() != Some(HELD_CONSUMER) {
            return false;
        }
    }
    true
}

/// A grace period well past the fleet's liveness TTL (as a deployment sets it): a
/// server's liveness key is gone well before its verdict may come.
fn guard_settings(s: &mut registry_janitor::config::Settings) {
    s.heartbeat_grace_ms = 1_500;
    s.reconcile_interval_ms = 300;
    s.sweep_pause_ms = 10;
}

/// 60 verdicts at once for 60 servers that heartbeat the whole time (a monitoring host
/// cut off from the fleet): at most `guard_disputed_limit` are fenced, the others held
/// with their entries intact and their events pending; discarding them dead-letters the
/// events and changes nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_disputed_verdicts_fence_at_most_the_limit() {
    let f = Fixture::with(Layout::Hash, guard_settings);
    let fleet = Fleet::start(&f, "gw", 60).await;
    let w = spawn_worker(&f.settings);
    let mut ids = Vec::new();
    for s in &fleet.servers {
        ids.push(verdict(&f.conn, &f.keys, s).await);
    }
    let limit = f.settings.guard_disputed_limit as usize;
    wait_until(
        &f.redis,
        "every verdict executed or held",
        Duration::from_secs(60),
        || async { held(&f).await.len() + fenced(&f, &fleet.servers).await.len() == 60 },
    )
    .await;
    let fenced_now = fenced(&f, &fleet.servers).await;
    assert_eq!(
        fenced_now.len(),
        limit,
        "the limit's worth go ahead, no more"
    );
    let holds = held(&f).await;
    assert_eq!(holds.len(), 60 - limit);
    assert!(holds
        .iter()
        .all(|h| h.doubt == Doubt::Disputed && h.state == HoldState::Held));
    let held_servers: Vec<ServerId> = holds.iter().map(|h| server(&h.server_id)).collect();
    // A few seconds on: still held, entries intact, events pending with the guard.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(held(&f).await.len(), 60 - limit);
    assert_eq!(entries_left(&f, &held_servers).await, (60 - limit) * USERS);
    let held_ids: Vec<String> = holds.iter().map(|h| h.entry.clone()).collect();
    assert!(all_parked(&f, &held_ids).await, "held events stay pending");
    assert!(f.dead_letters().await.is_empty());
    assert!(fenced(&f, &held_servers).await.is_empty());
    // The status and the readiness name them.
    let status = registry_janitor::status::collect(&f.settings)
        .await
        .unwrap();
    assert_eq!(status.held.len(), 60 - limit);

    // An operator discards them: dead letters with the reason, nothing fenced or deleted.
    run_ok(janitor(&f.settings).args(["held", "discard", "--all"]));
    assert!(held(&f).await.is_empty());
    let letters = f.dead_letters().await;
    assert_eq!(letters.len(), 60 - limit);
    for l in &letters {
        let error = String::from_utf8_lossy(l.field("error").unwrap()).into_owned();
        assert!(error.contains("discarded from the guard's hold"), "{error}");
    }
    f.wait_idle().await;
    assert_eq!(entries_left(&f, &held_servers).await, (60 - limit) * USERS);
    assert!(fenced(&f, &held_servers).await.is_empty());
    w.stop().await;
}

/// A zone outage, 60 servers of 180 silent at once: every verdict goes ahead at once,
/// none is held, and the zone is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_zone_of_one_in_three_is_never_held() {
    let f = Fixture::with(Layout::Keys, guard_settings);
    let fleet = Fleet::start(&f, "zone", 180).await;
    let zone: Vec<ServerId> = fleet.servers[..60].to_vec();
    fleet.silence(0..60);
    let w = spawn_worker(&f.settings);
    let reconciler = RunningReconciler::start(&f.settings);
    wait_until(
        &f.redis,
        "the zone cleaned",
        Duration::from_secs(60),
        || async { entries_left(&f, &zone).await == 0 && fenced(&f, &zone).await.len() == 60 },
    )
    .await;
    assert!(held(&f).await.is_empty());
    let held_count = w
        .metrics
        .guard_verdicts
        .with_label_values(&[registry_janitor::metrics::guard_decision::HELD])
        .get();
    assert_eq!(held_count, 0, "no verdict of a zone outage is held");
    assert_eq!(
        entries_left(&f, &fleet.servers[60..]).await,
        120 * USERS,
        "the live servers keep every entry"
    );
    reconciler.stop().await;
    w.stop().await;
}

/// The whole fleet falls silent for longer than the grace period (the path between the
/// fleet and Redis cut, Redis and the janitor running on), then comes back: the
/// reconciler's verdicts are held, then dropped; nothing fenced, no entry deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_whole_fleet_silent_past_grace_then_back_loses_nothing() {
    let f = Fixture::with(Layout::Hash, guard_settings);
    let fleet = Fleet::start(&f, "all", 30).await;
    let w = spawn_worker(&f.settings);
    let reconciler = RunningReconciler::start(&f.settings);
    fleet.silence(0..30);
    wait_until(
        &f.redis,
        "the reconciler's verdicts held",
        Duration::from_secs(30),
        || async { held(&f).await.len() == 30 },
    )
    .await;
    assert!(held(&f).await.iter().all(|h| h.doubt == Doubt::MassSilence));
    // Silent well past the grace period, the sweep running meanwhile.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(fenced(&f, &fleet.servers).await.is_empty());
    assert_eq!(entries_left(&f, &fleet.servers).await, 30 * USERS);
    fleet.resume(0..30);
    wait_until(
        &f.redis,
        "every held verdict dropped",
        Duration::from_secs(30),
        || async { held(&f).await.is_empty() },
    )
    .await;
    f.wait_idle().await;
    assert!(fenced(&f, &fleet.servers).await.is_empty());
    assert_eq!(entries_left(&f, &fleet.servers).await, 30 * USERS);
    assert!(f.dead_letters().await.is_empty());
    reconciler.stop().await;
    w.stop().await;
}

/// A zone dies while monitoring also disputes live servers: the zone is cleaned, the
/// disputed verdicts beyond the limit are held.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_zone_outage_and_a_monitoring_mistake_at_once() {
    let f = Fixture::with(Layout::Hash, guard_settings);
    let fleet = Fleet::start(&f, "mix", 90).await;
    let (zone, live) = (&fleet.servers[..30], &fleet.servers[30..60]);
    fleet.silence(0..30);
    let w = spawn_worker(&f.settings);
    // Wait for the zone's liveness keys to run out, then publish both kinds at once.
    tokio::time::sleep(Duration::from_millis(TTL_MS + 300)).await;
    for (dead, alive) in zone.iter().zip(live) {
        verdict(&f.conn, &f.keys, dead).await;
        verdict(&f.conn, &f.keys, alive).await;
    }
    let limit = f.settings.guard_disputed_limit as usize;
    wait_until(
        &f.redis,
        "the zone cleaned and the disputed verdicts decided",
        Duration::from_secs(60),
        || async {
            entries_left(&f, zone).await == 0
                && held(&f).await.len() + fenced(&f, live).await.len() == 30
        },
    )
    .await;
    assert_eq!(fenced(&f, zone).await.len(), 30);
    assert_eq!(fenced(&f, live).await.len(), limit);
    let holds = held(&f).await;
    assert_eq!(holds.len(), 30 - limit);
    let held_servers: Vec<ServerId> = holds.iter().map(|h| server(&h.server_id)).collect();
    assert!(held_servers.iter().all(|s| live.contains(s)));
    assert_eq!(entries_left(&f, &held_servers).await, (30 - limit) * USERS);
    assert_eq!(entries_left(&f, &fleet.servers[60..]).await, 30 * USERS);
    w.stop().await;
}

/// A hold stands across a worker's SIGKILL and a takeover by a new worker after
/// `claim_min_idle_ms`; an operator's release then lets the verdicts proceed: fenced and
/// cleaned.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hold_survives_a_worker_restart_and_an_operator_releases_it() {
    let f = Fixture::with(Layout::Keys, |s| {
        guard_settings(s);
        s.guard_disputed_limit = 0;
    });
    let fleet = Fleet::start(&f, "rs", 8).await;
    let worker = WorkerProcess::start(&f.settings);
    let mut ids = Vec::new();
    for s in &fleet.servers {
        ids.push(verdict(&f.conn, &f.keys, s).await);
    }
    wait_until(
        &f.redis,
        "all 8 verdicts held",
        Duration::from_secs(30),
        || async { held(&f).await.len() == 8 },
    )
    .await;
    worker.signal("KILL");
    let (_, log) = worker.wait(Duration::from_secs(10));
    assert!(log.contains("guard: a hold started"), "{log}");
    // No worker for well past claim_min_idle_ms: the parked entries look idle.
    tokio::time::sleep(Duration::from_millis(f.settings.claim_min_idle_ms * 2)).await;
    let second = WorkerProcess::start(&f.settings);
    // The new worker takes them over and parks them again: still held, nothing fenced.
    tokio::time::sleep(Duration::from_millis(f.settings.claim_min_idle_ms * 2)).await;
    assert_eq!(held(&f).await.len(), 8);
    assert!(fenced(&f, &fleet.servers).await.is_empty());
    assert!(f.dead_letters().await.is_empty());
    wait_until(
        &f.redis,
        "the held entries parked again",
        Duration::from_secs(20),
        || async { all_parked(&f, &ids).await },
    )
    .await;
    assert_eq!(entries_left(&f, &fleet.servers).await, 8 * USERS);

    run_ok(janitor(&f.settings).args(["held", "release", "--all"]));
    wait_until(
        &f.redis,
        "the released verdicts executed",
        Duration::from_secs(30),
        || async { entries_left(&f, &fleet.servers).await == 0 },
    )
    .await;
    f.wait_idle().await;
    assert_eq!(fenced(&f, &fleet.servers).await.len(), 8);
    wait_until(
        &f.redis,
        "the holds forgotten",
        Duration::from_secs(10),
        || async { held(&f).await.is_empty() },
    )
    .await;
    assert!(f.dead_letters().await.is_empty());
    drop(second);
}

/// A mass silence that does not end: its held verdicts proceed by themselves once their
/// servers have been silent for `guard_hold_grace_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn held_verdicts_proceed_once_silent_past_the_hold_grace() {
    let f = Fixture::with(Layout::Hash, |s| {
        guard_settings(s);
        s.guard_hold_grace_ms = 4_000;
        // Six servers: a mass silence only with a lower minimum than the default.
        s.guard_silence_min = 3;
    });
    let fleet = Fleet::start(&f, "gone", 6).await;
    fleet.silence(0..6);
    let w = spawn_worker(&f.settings);
    tokio::time::sleep(Duration::from_millis(TTL_MS + 300)).await;
    for s in &fleet.servers {
        verdict(&f.conn, &f.keys, s).await;
    }
    wait_until(
        &f.redis,
        "the verdicts held",
        Duration::from_secs(20),
        || async { held(&f).await.len() == 6 },
    )
    .await;
    assert!(fenced(&f, &fleet.servers).await.is_empty());
    wait_until(
        &f.redis,
        "the servers cleaned after the hold's grace",
        Duration::from_secs(40),
        || async { entries_left(&f, &fleet.servers).await == 0 },
    )
    .await;
    f.wait_idle().await;
    assert_eq!(fenced(&f, &fleet.servers).await.len(), 6);
    wait_until(
        &f.redis,
        "the holds forgotten",
        Duration::from_secs(10),
        || async { held(&f).await.is_empty() },
    )
    .await;
    w.stop().await;
}

/// The drift sweep does not delete entries of silent owners while a mass silence lasts,
/// even with no worker running to hold the verdicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sweep_deletes_nothing_on_silence_during_a_mass_silence() {
    let f = Fixture::with(Layout::Hash, guard_settings);
    let fleet = Fleet::start(&f, "sw", 10).await;
    fleet.silence(0..10);
    tokio::time::sleep(Duration::from_millis(
        f.settings.heartbeat_grace_ms + TTL_MS + 300,
    ))
    .await;
    // Their reverse sets lost: only the sweep could find their entries.
    for s in &fleet.servers {
        let _: () = f.query(redis::cmd("DEL").arg(f.keys.server_users(s))).await;
    }
    let r = Reconciler::new(&f.settings, registry_janitor::metrics::Metrics::new())
        .await
        .unwrap();
    let report = r.run_once().await.unwrap();
    assert_eq!(report.sweep.entries_removed, 0, "{report}");
    assert_eq!(entries_left(&f, &fleet.servers).await, 10 * USERS);
}

/// Servers seeded with users and a standing liveness key, not heartbeating.
async fn quiet_fleet(f: &Fixture, name: &str, n: usize) -> Vec<ServerId> {
    let mut out = Vec::new();
    for i in 0..n {
        let s = server(&format!("{name}-{i}#1"));
        f.seed(&s, USERS).await;
        out.push(s);
    }
    out
}

/// `servers` fell silent `ago_ms` ago: liveness keys gone, last heartbeats then.
async fn silent_since(f: &Fixture, servers: &[ServerId], ago_ms: u64) {
    let at = registry_janitor::now_ms() - ago_ms;
    for s in servers {
        let _: () = f.query(redis::cmd("DEL").arg(f.keys.server_alive(s))).await;
        let _: () = f
            .query(
                redis::cmd("ZADD")
                    .arg(f.keys.servers())
                    .arg(at)
                    .arg(s.as_str()),
            )
            .await;
    }
}

/// A silence longer than `guard_window_ms` (but shorter than the hold's grace) is still
/// a mass silence: the census looks back as far as the hold's grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silence_longer_than_the_window_is_still_a_mass_silence() {
    let f = Fixture::with(Layout::Hash, guard_settings);
    let window = f.settings.guard_window();
    assert!(window < f.settings.guard_hold_grace());
    let all = quiet_fleet(&f, "cut", 30).await;
    let cut = &all[..20];
    silent_since(&f, cut, window + 10_000).await;
    let w = spawn_worker(&f.settings);
    verdict(&f.conn, &f.keys, &cut[0]).await;
    wait_until(
        &f.redis,
        "the verdict held",
        Duration::from_secs(20),
        || async { held(&f).await.len() == 1 },
    )
    .await;
    assert_eq!(held(&f).await[0].doubt, Doubt::MassSilence);
    assert!(fenced(&f, &cut[..1]).await.is_empty());
    assert_eq!(entries_left(&f, &cut[..1]).await, USERS);
    w.stop().await;
}

/// The hold's grace counts from the hold's start: after a gap longer than the grace
/// (silent servers whose last heartbeat is older than it), a new hold still waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_hold_waits_its_grace_even_after_a_long_gap() {
    let f = Fixture::with(Layout::Hash, |s| {
        guard_settings(s);
        s.guard_hold_grace_ms = 60_000;
    });
    let all = quiet_fleet(&f, "long", 30).await;
    let cut = &all[..20];
    silent_since(&f, cut, 90_000).await;
    let w = spawn_worker(&f.settings);
    verdict(&f.conn, &f.keys, &cut[0]).await;
    wait_until(
        &f.redis,
        "the verdict held",
        Duration::from_secs(20),
        || async { held(&f).await.len() == 1 },
    )
    .await;
    // Several upkeep rounds later: still held, nothing fenced.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(held(&f).await.len(), 1);
    assert!(fenced(&f, &cut[..1]).await.is_empty());
    w.stop().await;
}

/// A held verdict whose stream entry is deleted (XDEL by someone) is not lost: it is
/// written to the dead-letter stream from the hold, with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_verdict_whose_entry_is_deleted_is_dead_lettered() {
    let f = Fixture::with(Layout::Hash, |s| {
        guard_settings(s);
        s.guard_disputed_limit = 0;
    });
    let all = quiet_fleet(&f, "del", 1).await;
    let w = spawn_worker(&f.settings);
    let id = verdict(&f.conn, &f.keys, &all[0]).await;
    wait_until(&f.redis, "held", Duration::from_secs(20), || async {
        held(&f).await.len() == 1
    })
    .await;
    let _: i64 = f
        .query(redis::cmd("XDEL").arg(f.keys.events()).arg(&id))
        .await;
    wait_until(
        &f.redis,
        "the hold over",
        Duration::from_secs(20),
        || async { held(&f).await.is_empty() },
    )
    .await;
    let letters = f.dead_letters().await;
    assert_eq!(letters.len(), 1);
    let error = String::from_utf8_lossy(letters[0].field("error").unwrap()).into_owned();
    assert!(error.contains("deleted from the stream"), "{error}");
    let payload = letters[0].field("payload").unwrap();
    let (event, _) = ServerDead::decode(payload, 64 * 1024).unwrap();
    assert_eq!(event.server_id, all[0].as_str());
    assert!(fenced(&f, &all).await.is_empty());
    w.stop().await;
}

/// While disputed verdicts are held, the disputed budget does not refill: a new disputed
/// verdict after the window rolled over is held too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_disputed_verdict_goes_ahead_while_others_are_held() {
    let f = Fixture::with(Layout::Hash, guard_settings);
    let limit = f.settings.guard_disputed_limit as usize;
    let all = quiet_fleet(&f, "mon", limit + 7).await;
    let w = spawn_worker(&f.settings);
    for s in &all[..limit + 6] {
        verdict(&f.conn, &f.keys, s).await;
    }
    wait_until(
        &f.redis,
        "the limit fenced, 6 held",
        Duration::from_secs(30),
        || async { held(&f).await.len() == 6 },
    )
    .await;
    // The window rolls over: the budget's record ages out.
    let _: () = f
        .query(redis::cmd("DEL").arg(f.keys.guard_disputed()))
        .await;
    let last = &all[limit + 6];
    verdict(&f.conn, &f.keys, last).await;
    wait_until(
        &f.redis,
        "the new verdict decided",
        Duration::from_secs(20),
        || async {
            !fenced(&f, std::slice::from_ref(last)).await.is_empty() || held(&f).await.len() == 7
        },
    )
    .await;
    assert!(fenced(&f, std::slice::from_ref(last)).await.is_empty());
    assert_eq!(fenced(&f, &all).await.len(), limit);
    w.stop().await;
}
