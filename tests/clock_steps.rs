//! A step forward of Redis's clock never declares a live server dead.
//!
//! Liveness is judged on Redis's clock alone, so the two checks of a verdict (the
//! liveness key is gone, the score is older than the grace) move with that one clock: a
//! step forward past the grace expires the liveness keys (Redis keeps expiries as
//! absolute times) and ages every score at once. The guard's clock-jump check sees a step
//! only at its next observation, while a verdict reads the stepped TIME at once (the
//! liveness keys' expiry notifications start checks right after the step). So the
//! verdict checks its own TIME against the guard's bound (the last observation's TIME
//! plus the monotonic time since, plus the tolerance) and refuses to judge past it; on a
//! cluster the guard watches the master of `servers`' slot, whose clock judges scores.
//!
//! A redis-server's clock is stepped with a small LD_PRELOAD library (built at test time
//! with `cc`; the test says so and does nothing where `cc` is missing) that adds the
//! offset found in `$SKEW_DIR/<pid>` to gettimeofday and clock_gettime(CLOCK_REALTIME).

mod common;

use std::{path::PathBuf, process::Command, time::Duration};

use common::*;
use registry_janitor::{
    conn::{self, key_slot},
    keys::Keys,
    metrics::Metrics,
    reconcile::{Reconciler, Verdict},
    registry::Registry,
};
use registry_janitor_testkit::RedisCluster;

const SKEW_C: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long offset_ms(void) {
    static long long cached = 0;
    static struct timespec last = {0, 0};
    static int (*real_clock)(clockid_t, struct timespec *) = 0;
    if (!real_clock) real_clock = dlsym(RTLD_NEXT, "clock_gettime");
    struct timespec now;
    real_clock(CLOCK_MONOTONIC, &now);
    long long since = (now.tv_sec - last.tv_sec) * 1000LL + (now.tv_nsec - last.tv_nsec) / 1000000;
    if (last.tv_sec == 0 || since >= 20) {
        last = now;
        const char *dir = getenv("SKEW_DIR");
        cached = 0;
        if (dir) {
            char path[512];
            snprintf(path, sizeof path, "%s/%d", dir, (int)getpid());
            FILE *f = fopen(path, "r");
            if (f) {
                if (fscanf(f, "%lld", &cached) != 1) cached = 0;
                fclose(f);
            }
        }
    }
    return cached;
}

int gettimeofday(struct timeval *tv, void *tz) {
    static int (*real)(struct timeval *, void *) = 0;
    if (!real) real = dlsym(RTLD_NEXT, "gettimeofday");
    int r = real(tv, tz);
    if (r == 0 && tv) {
        long long us = tv->tv_sec * 1000000LL + tv->tv_usec + offset_ms() * 1000LL;
        tv->tv_sec = us / 1000000;
        tv->tv_usec = us % 1000000;
    }
    return r;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *) = 0;
    if (!real) real = dlsym(RTLD_NEXT, "clock_gettime");
    int r = real(id, ts);
    if (r == 0 && ts && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        long long ns = ts->tv_sec * 1000000000LL + ts->tv_nsec + offset_ms() * 1000000LL;
        ts->tv_sec = ns / 1000000000LL;
        ts->tv_nsec = ns % 1000000000LL;
    }
    return r;
}
"#;

/// Builds the clock-stepping library; `None` where no C compiler is found.
fn build_skew(dir: &std::path::Path) -> Option<PathBuf> {
    let src = dir.join("skew.c");
    let lib = dir.join("libskew.so");
    std::fs::write(&src, SKEW_C).ok()?;
    let ok = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg("-ldl")
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(lib)
}

/// Builds the library once and puts it in the environment the redis-servers of this test
/// binary inherit (offset 0 until a file says more); the directory of the offset files.
fn skew_dir() -> Option<PathBuf> {
    static DIR: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("clock-steps-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let lib = build_skew(&dir)?;
        std::env::set_var("LD_PRELOAD", &lib);
        std::env::set_var("SKEW_DIR", &dir);
        Some(dir)
    })
    .clone()
}

/// `live` heartbeats a few times, and the reconciler sees it alive each time (its guard
/// observing meanwhile).
async fn heartbeats_seen_alive(
    registry: &Registry,
    conn: &conn::RedisConn,
    reconciler: &Reconciler,
    live: &registry_janitor::event::ServerId,
) {
    for _ in 0..5 {
        registry.heartbeat(conn, live, TTL_MS).await.unwrap();
        let verdict = reconciler.check(live).await.unwrap();
        assert!(
            matches!(verdict, Verdict::Alive | Verdict::TooRecent { .. }),
            "{verdict:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

const GRACE_MS: u64 = 4_000;
const TTL_MS: u64 = 2_000;
/// The step forward of the clock of the master of `servers`: past the grace and the
/// liveness TTL, well under the cluster's node timeout (no node is flagged failing).
const STEP_MS: u64 = 10_000;

/// The live server's verdict right after the clock of the master of `servers` stepped
/// forward; `servers` on the first master by address (`first`) or on another. `None`
/// where the test cannot run here.
async fn verdict_after_a_step(first_master: bool) -> Option<Verdict> {
    init_logs();
    if !RedisCluster::supported() {
        cannot_run("this redis-server cannot run a cluster (or redis-cli is missing)");
        return None;
    }
    let Some(dir) = skew_dir() else {
        cannot_run("no C compiler (cc) to build the clock-stepping library");
        return None;
    };
    let cluster = tokio::task::spawn_blocking(|| {
        RedisCluster::start_with(3, 0, || {
            vec!["--cluster-node-timeout".to_owned(), "60000".to_owned()]
        })
    })
    .await
    .unwrap()
    .expect("start a local cluster");

    let mut settings = cluster_settings(&cluster, registry_janitor::config::Layout::Keys);
    settings.heartbeat_grace_ms = GRACE_MS;
    let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    // The first master by address.
    let first = conn::cluster_masters(&conn).await.unwrap()[0].1;
    // A key prefix that puts `servers` on that master, or on another.
    let keys = loop {
        let k = Keys::for_settings(&settings);
        let on = cluster
            .master_of(k.servers().as_bytes())
            .expect("a master serves `servers`");
        if (cluster.nodes[on].port() == first) == first_master {
            break k;
        }
        settings.key_prefix = format!("{}x", settings.key_prefix);
    };
    let stepped = cluster.master_of(keys.servers().as_bytes()).unwrap();
    // A live server whose own keys are on that master too.
    let live = (0..)
        .map(|n| server(&format!("gw-live#{n}")))
        .find(|s| cluster.master_of(keys.server_alive(s).as_bytes()) == Some(stepped))
        .unwrap();
    assert_eq!(
        key_slot(keys.server_alive(&live).as_bytes()),
        key_slot(keys.server_users(&live).as_bytes())
    );
    let registry = Registry::new(keys.clone(), registry_janitor::config::Layout::Keys);
    let reconciler = Reconciler::new(&settings, Metrics::new()).await.unwrap();

    // The live server heartbeats; the reconciler sees it alive, and its guard watches.
    heartbeats_seen_alive(&registry, &conn, &reconciler, &live).await;

    // It heartbeats once more; right then the clock of the master of `servers` steps
    // forward.
    registry.heartbeat(&conn, &live, TTL_MS).await.unwrap();
    let pid = cluster.nodes[stepped].pid().unwrap();
    std::fs::write(dir.join(pid.to_string()), STEP_MS.to_string()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let verdict = reconciler.check(&live).await.unwrap();
    let _ = std::fs::remove_file(dir.join(pid.to_string()));

    Some(verdict)
}

/// `verdict` is no `server.dead` for the server that heartbeated 100 ms before the step.
fn assert_not_declared_dead(verdict: Option<Verdict>) {
    let Some(verdict) = verdict else {
        return;
    };
    assert!(
        !matches!(verdict, Verdict::Published(_)),
        "a server that heartbeated 100 ms ago was declared dead (server.dead published) \
         after the clock of the master of `servers` stepped {STEP_MS} ms forward: {verdict:?}"
    );
}

/// A step of the clock of the master of `servers`, which is not the first master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_step_on_the_master_of_servers_declares_no_live_server_dead() {
    assert_not_declared_dead(verdict_after_a_step(false).await);
}

/// The same, `servers` on the first master by address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_step_on_the_first_master_declares_no_live_server_dead() {
    assert_not_declared_dead(verdict_after_a_step(true).await);
}

/// One node: the same step, checked by report_dead.lua, which reads TIME in the same
/// script as the liveness key and the score. The verdict waits; once a full grace of
/// reachable time has passed with the server heartbeating, it is still alive; a server
/// that stops heartbeating is then declared dead as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_step_on_one_node_declares_no_live_server_dead() {
    init_logs();
    let Some(dir) = skew_dir() else {
        cannot_run("no C compiler (cc) to build the clock-stepping library");
        return;
    };
    let redis = registry_janitor_testkit::RedisServer::start().expect("start redis-server");
    let mut settings = settings(&redis, registry_janitor::config::Layout::Keys);
    settings.heartbeat_grace_ms = GRACE_MS;
    let conn = conn::shared_for(&conn::target_for(&settings).unwrap())
        .await
        .unwrap();
    let keys = Keys::for_settings(&settings);
    let registry = Registry::new(keys.clone(), registry_janitor::config::Layout::Keys);
    let reconciler = Reconciler::new(&settings, Metrics::new()).await.unwrap();
    let live = server("gw-live#1");
    heartbeats_seen_alive(&registry, &conn, &reconciler, &live).await;
    registry.heartbeat(&conn, &live, TTL_MS).await.unwrap();
    let pid = redis.pid().unwrap();
    let offset_file = dir.join(pid.to_string());
    std::fs::write(&offset_file, STEP_MS.to_string()).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let verdict = reconciler.check(&live).await.unwrap();
    assert!(
        matches!(verdict, Verdict::Waiting { .. }),
        "right after a {STEP_MS} ms step forward of Redis's clock, a server that \
         heartbeated 100 ms ago: {verdict:?}"
    );
    // The clock stays stepped; the server heartbeats on: alive, for longer than a grace.
    let until = std::time::Instant::now() + Duration::from_millis(GRACE_MS * 2);
    while std::time::Instant::now() < until {
        registry.heartbeat(&conn, &live, TTL_MS).await.unwrap();
        let verdict = reconciler.check(&live).await.unwrap();
        assert!(
            !matches!(verdict, Verdict::Published(_)),
            "a heartbeating server declared dead after the step: {verdict:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // It stops heartbeating: dead once its key and a grace are past, on the stepped clock.
    let dead = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Verdict::Published(_) = reconciler.check(&live).await.unwrap() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    })
    .await;
    let _ = std::fs::remove_file(&offset_file);
    assert!(
        dead.is_ok(),
        "a server silent for a minute was never declared dead"
    );
}
