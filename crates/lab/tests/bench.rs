//! A small `registry-janitor-lab bench` as a correctness check (no timing assertions): every
//! run verifies the registry afterwards, and the report must say so.

mod common;

use common::*;
use registry_janitor::config::{Layout, Settings};

/// `registry-janitor-lab bench <args> --repeat 1 --json` on `settings`: its JSON report (the
/// command must succeed).
fn bench_json(settings: &Settings, args: &[&str]) -> serde_json::Value {
    let out = lab(settings)
        .arg("bench")
        .args(args)
        .args(["--repeat", "1", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "bench {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn bench(layout: Layout) {
    let redis = redis();
    let settings = settings(&redis, layout);
    let report = bench_json(
        &settings,
        &[
            "--users",
            "20000",
            "--naive-sample",
            "500",
            "--baseline-users",
            "5000",
            "--route-lookups",
            "2000",
        ],
    );
    let run = |name: &str| {
        report["runs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap_or_else(|| panic!("no {name} run in {report}"))
            .clone()
    };
    for name in ["janitor", "janitor_baseline", "careful", "naive"] {
        let r = run(name);
        assert_eq!(r["stale_left"], 0, "{name}: {r}");
        assert_eq!(r["live_lost"], 0, "{name}: {r}");
        assert!(
            r["lookups"].as_u64().unwrap() > 0,
            "{name}: the lookup prober ran"
        );
    }
    assert_eq!(run("janitor")["users"], 20000);
    assert!(run("janitor")["worker_peak_rss_bytes"].as_u64().unwrap() > 1_000_000);
    // The ceiling is wrong on purpose: it deletes the entries of users who moved (1%).
    assert_eq!(run("unconditional")["live_lost"], 200);
    fencing_figures(&report, 2000);
    calibrated(&report);
    assert_eq!(report["layout"], layout.as_str());
    let keys: Vec<String> = {
        let client = redis::Client::open(redis.url()).unwrap();
        let mut c = client.get_connection().unwrap();
        redis::cmd("KEYS").arg("*").query(&mut c).unwrap()
    };
    assert!(keys.is_empty(), "the bench leaves no keys behind: {keys:?}");
}

/// The calibration figures, to compare invocations: a Redis that answered takes time.
fn calibrated(report: &serde_json::Value) {
    let c = &report["calibration"];
    for field in ["pipelined_cpu_us", "pipelined_wall_us", "script_cpu_us"] {
        assert!(c[field].as_f64().is_some_and(|us| us > 0.0), "{field}: {c}");
    }
}

/// The route cost and the stale window: every route-cost lookup got its live owner, and
/// no route started after the fence got the dead server (the dead server looked alive:
/// route got it before the verdict).
fn fencing_figures(report: &serde_json::Value, lookups: u64) {
    let cost = &report["route_cost"];
    for kind in ["route", "plain"] {
        assert_eq!(cost[kind]["lookups"].as_u64(), Some(lookups), "{cost}");
        assert_eq!(cost[kind]["wrong"], 0, "{kind}: {cost}");
    }
    let window = &report["stale_window"];
    assert_eq!(window["runs"], 1, "{window}");
    let route = &window["route"];
    assert_eq!(
        route["dead_after_verdict"], 0,
        "route after the fence: {window}"
    );
    // Each probe's first lookup is done before the event is published: the dead server
    // looked alive, to route too.
    for probe in [route, &window["plain"]] {
        assert!(
            probe["dead_before_verdict"].as_u64().unwrap() > 0,
            "the dead server looked alive before the verdict: {window}"
        );
    }
}

#[test]
fn bench_verifies_every_run_hash_layout() {
    bench(Layout::Hash);
}

#[test]
fn bench_verifies_every_run_keys_layout() {
    bench(Layout::Keys);
}

#[test]
fn bench_verifies_every_run_conns_layout() {
    bench(Layout::Conns);
}

/// The bench on a private local cluster (`--local-cluster`), layout keys (the per-slot
/// path): every run verified; the careful reference does not exist there.
#[test]
fn bench_verifies_every_run_on_a_local_cluster() {
    if !registry_janitor_testkit::RedisCluster::supported() {
        registry_janitor_testkit::cannot_run(
            "this redis-server cannot run a cluster (or redis-cli is missing)",
        );
        return;
    }
    let redis = redis(); // only for a settings template; the bench starts its own cluster
    let mut settings = settings(&redis, Layout::Keys);
    settings.redis_url = "redis://127.0.0.1:1".into();
    let report = bench_json(
        &settings,
        &[
            "--local-cluster",
            "--users",
            "5000",
            "--naive-sample",
            "300",
            "--baseline-users",
            "1000",
            "--route-lookups",
            "500",
        ],
    );
    let runs = report["runs"].as_array().unwrap();
    for name in ["janitor", "janitor_baseline", "naive"] {
        let r = runs.iter().find(|r| r["name"] == name).unwrap();
        assert_eq!(
            (r["stale_left"].as_u64(), r["live_lost"].as_u64()),
            (Some(0), Some(0)),
            "{name}: {r}"
        );
    }
    assert!(runs.iter().all(|r| r["name"] != "careful"));
    fencing_figures(&report, 500);
    assert!(report["ratios"]["redis_cpu_vs_careful"].is_null());
}

/// A small `bench --zone` as a correctness check (no timing assertions): several servers
/// die at once, two worker processes clean them (limiter off, then on, in both step
/// orders, with no core and with one core kept busy by another process), and each run
/// verifies the registry clean, the moved users kept and every event acknowledged; the
/// probe process measured lookups during the cleanup. No busy process outlives the bench.
#[test]
fn bench_zone_verifies_every_run() {
    let report = bench_zone(
        Layout::Hash,
        &[
            "--step-orders",
            "smallest_first,round_robin",
            "--busy-cores",
            "0,1",
        ],
        8,
    );
    let busy: Vec<u64> = report["settings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["busy_cores"].as_u64().unwrap())
        .collect();
    assert_eq!(busy, [0, 1, 0, 1, 0, 1, 0, 1], "{report}");
    assert_eq!(report["cluster_masters"], 0, "{report}");
    let left = busy_processes();
    assert!(left.is_empty(), "busy processes left running: {left:?}");
}

/// The processes of this build's `registry-janitor-lab busy` that are running.
fn busy_processes() -> Vec<String> {
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_registry-janitor-lab"));
    let exe = exe.canonicalize().unwrap_or(exe.to_path_buf());
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        let runs_exe = std::fs::read_link(entry.path().join("exe")).is_ok_and(|e| e == exe);
        if runs_exe && args.get(1) == Some(&&b"busy"[..]) {
            found.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    found
}

/// The same on a private local cluster (`--local-cluster`) whose masters have a replica
/// each, layout keys: the zone's check-and-delete goes to every master, limited and not,
/// and each walk ends with the replica wait on and off (`--replica-waits`, passed to the
/// workers as `JANITOR_CLUSTER_REPLICA_WAIT`, which their metrics show was honoured).
#[test]
fn bench_zone_verifies_every_run_on_a_local_cluster() {
    if !registry_janitor_testkit::RedisCluster::supported() {
        registry_janitor_testkit::cannot_run(
            "this redis-server cannot run a cluster (or redis-cli is missing)",
        );
        return;
    }
    let report = bench_zone(
        Layout::Keys,
        &[
            "--local-cluster",
            "--cluster-replicas",
            "1",
            "--replica-waits",
            "true,false",
        ],
        4,
    );
    let waits: Vec<bool> = report["settings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["replica_wait"].as_bool().unwrap())
        .collect();
    assert_eq!(waits, [true, false, true, false], "{report}");
    // The setting reaches the workers: every walk of a run with the wait on ends in it,
    // and no walk of a run with it off does.
    for setting in report["settings"].as_array().unwrap() {
        for run in setting["repeats"].as_array().unwrap() {
            let waited = run["replica_wait_seconds"].as_f64().unwrap();
            assert!(run["cleanup_seconds"].as_f64().unwrap() > 0.0, "{run}");
            if setting["replica_wait"].as_bool().unwrap() {
                assert!(waited > 0.0, "the wait is on, yet no walk waited: {run}");
            } else {
                assert_eq!(waited, 0.0, "the wait is off, yet a walk waited: {run}");
            }
        }
    }
}

/// `bench --zone 6` of 3,000 users per server, 2 workers, latency targets 0 and 1, with
/// `more` flags: `settings` settings in the report, each run verified; returns the report.
fn bench_zone(layout: Layout, more: &[&str], settings_count: usize) -> serde_json::Value {
    let redis = redis(); // only for a settings template; the zone bench starts its own
    let settings = settings(&redis, layout);
    let mut args = vec![
        "--zone",
        "6",
        "--zone-users",
        "3000",
        "--workers",
        "2",
        "--latency-targets",
        "0,1",
    ];
    args.extend_from_slice(more);
    let report = bench_json(&settings, &args);
    calibrated(&report);
    let settings_run = report["settings"].as_array().unwrap();
    assert_eq!(settings_run.len(), settings_count, "{report}");
    for s in settings_run {
        for run in s["repeats"].as_array().unwrap() {
            let servers = run["servers"].as_u64().unwrap();
            assert_eq!(run["acknowledged"].as_u64(), Some(servers), "{run}");
            assert_eq!(run["stale_left"], 0, "{run}");
            assert_eq!(run["live_lost"], 0, "{run}");
            assert_eq!(run["users"], 18_000, "{run}");
            assert!(run["worker_peak_rss_bytes"].as_u64().unwrap() > 1_000_000);
            assert!(run["stale_window_p99_ms"].as_f64().unwrap() > 0.0, "{run}");
        }
        assert_eq!(s["zone"]["servers"], 6);
        assert_eq!(s["zone"]["workers"], 2);
        assert_eq!(s["single"]["servers"], 1);
        assert!(s["throughput_vs_single"].as_f64().unwrap() > 0.0);
    }
    report
}
