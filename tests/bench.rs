//! A small `registry-janitor bench` as a correctness check (no timing assertions): every
//! run verifies the registry afterwards, and the report must say so.

mod common;

use common::*;
use registry_janitor::config::Layout;

fn bench(layout: Layout) {
    let redis = redis();
    let settings = settings(&redis, layout);
    let out = janitor(&settings)
        .args([
            "bench",
            "--users",
            "20000",
            "--naive-sample",
            "500",
            "--baseline-users",
            "5000",
        ])
        .args(["--repeat", "1", "--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
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
    assert_eq!(
        report["layout"],
        if layout == Layout::Hash {
            "hash"
        } else {
            "keys"
        }
    );
    let keys: Vec<String> = {
        let client = redis::Client::open(redis.url()).unwrap();
        let mut c = client.get_connection().unwrap();
        redis::cmd("KEYS").arg("*").query(&mut c).unwrap()
    };
    assert!(keys.is_empty(), "the bench leaves no keys behind: {keys:?}");
}

#[test]
fn bench_verifies_every_run_hash_layout() {
    bench(Layout::Hash);
}

#[test]
fn bench_verifies_every_run_keys_layout() {
    bench(Layout::Keys);
}

/// The bench on a private local cluster (`--local-cluster`), layout keys (the per-slot
/// path): every run verified; the careful reference does not exist there.
#[test]
fn bench_verifies_every_run_on_a_local_cluster() {
    if !registry_janitor::testkit::RedisCluster::supported() {
        eprintln!("SKIPPED: this redis-server cannot run a cluster");
        return;
    }
    let redis = redis(); // only for a settings template; the bench starts its own cluster
    let mut settings = settings(&redis, Layout::Keys);
    settings.redis_url = "redis://127.0.0.1:1".into();
    let out = janitor(&settings)
        .args([
            "bench",
            "--local-cluster",
            "--users",
            "5000",
            "--naive-sample",
            "300",
        ])
        .args(["--baseline-users", "1000", "--repeat", "1", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
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
    assert!(report["ratios"]["redis_cpu_vs_careful"].is_null());
}
