//! The `registry-janitor-lab` binary as a new user runs it: real processes, configured
//! through `JANITOR_*` variables only, against a real redis-server or a local cluster it
//! starts.

mod common;

use std::process::{Command, Stdio};

use common::*;
use registry_janitor::config::Layout;
use registry_janitor_testkit::RedisCluster;

fn run(cmd: &mut Command) -> (i32, String, String) {
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `demo`, as a new user runs it: on the test's own Redis (every layout), and with
/// `--local-cluster` on a private local cluster it starts itself. Each run seeds, kills,
/// cleans with users reconnecting meanwhile, verifies the registry and the evictions
/// stream, says `verified`, and leaves no key behind.
#[test]
fn the_demo_verifies_its_run_on_a_node_and_on_a_local_cluster() {
    let redis = redis();
    let small = ["--servers", "4", "--users", "3000", "--dead", "2"];
    let mut runs: Vec<(Layout, bool)> = vec![
        (Layout::Hash, false),
        (Layout::Keys, false),
        (Layout::Conns, false),
    ];
    if RedisCluster::supported() {
        runs.extend([
            (Layout::Hash, true),
            (Layout::Keys, true),
            (Layout::Conns, true),
        ]);
    } else {
        eprintln!("redis-server cannot run a local cluster here: the demo runs on one node only");
    }
    for (layout, cluster) in runs {
        let settings = settings(&redis, layout);
        let mut cmd = lab(&settings);
        for var in ["JANITOR_TEST_REDIS_SERVER", "JANITOR_TEST_REDIS_CLI"] {
            if let Some(value) = std::env::var_os(var) {
                cmd.env(var, value);
            }
        }
        cmd.arg("demo").args(small);
        if cluster {
            cmd.arg("--local-cluster");
        }
        let (code, stdout, stderr) = run(&mut cmd);
        let what = format!("{layout:?}, cluster {cluster}: {stdout}\n{stderr}");
        assert_eq!(code, 0, "{what}");
        assert!(stdout.contains("registry-janitor demo: verified"), "{what}");
        let figure = |label: &str| -> u64 {
            let line = stdout.lines().find(|l| l.trim_start().starts_with(label));
            line.and_then(|l| l.split_whitespace().nth(label.split(' ').count()))
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no `{label}` figure: {what}"))
        };
        assert_eq!(figure("deleted") + figure("kept"), 6000, "{what}");
        assert_eq!(figure("stale left"), 0, "{what}");
        assert_eq!(figure("live lost"), 0, "{what}");
        assert!(figure("evictions") >= figure("deleted"), "{what}");
        if cluster {
            assert!(stderr.contains("private Redis Cluster"), "{what}");
        } else {
            let keys: u64 = redis::cmd("DBSIZE")
                .query(&mut redis::Client::open(redis.url()).unwrap())
                .unwrap();
            assert_eq!(keys, 0, "the demo left keys behind: {what}");
        }
    }
}

/// `registry-janitor-lab --help` lists `demo`, `bench` and `nemesis`; the processes the
/// benchmark and the nemesis start (`worker`, `reconcile`, `bench-probe`) are hidden but
/// run.
#[test]
fn the_lab_lists_the_demo_the_bench_and_the_nemesis() {
    let out = Command::new(env!("CARGO_BIN_EXE_registry-janitor-lab"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let commands: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(commands, ["demo", "bench", "nemesis", "help"], "{help}");
    for hidden in ["worker", "reconcile", "bench-probe"] {
        let out = Command::new(env!("CARGO_BIN_EXE_registry-janitor-lab"))
            .args([hidden, "--help"])
            .output()
            .unwrap();
        assert!(out.status.success(), "`{hidden}` runs");
    }
}
