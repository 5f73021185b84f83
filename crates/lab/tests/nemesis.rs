//! `registry-janitor-lab nemesis` as the suite runs it: two minutes of faults drawn from a
//! fixed seed (every kind of fault of a single node), 40 s with four network partitions
//! (root and `ip netns`), a shorter run from a seed of the clock, printed so that a
//! failure can be replayed, 45 s on a Sentinel group with three failovers, and 90 s on a
//! Redis Cluster with four. Each run starts its own redis-server, worker processes and
//! reconciler, and checks the invariants while the faults run; it exits non-zero on any
//! violation, with the seed, the schedule up to it and the keys involved.

use std::{
    process::{Command, Stdio},
    sync::Mutex,
};

use registry_janitor_testkit::{cannot_run, RedisCluster, RedisServer};

/// The runs one after the other: each is a whole deployment in miniature.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs the nemesis; returns its exit code and what it printed (stdout, stderr).
fn nemesis(seed: u64, duration: &str, more: &[&str]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_registry-janitor-lab"));
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("JANITOR_")
            && !key.to_string_lossy().starts_with("JANITOR_TEST_")
        {
            cmd.env_remove(key);
        }
    }
    let out = cmd
        .args([
            "nemesis",
            "--seed",
            &seed.to_string(),
            "--duration",
            duration,
        ])
        .args(more)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The figure after `label` on the summary line that starts with it (`faults 37 drawn,
/// 35 applied` -> `figure(out, "faults", 2)` = 35).
fn figure(stdout: &str, label: &str, nth: usize) -> u64 {
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no `{label}` line:\n{stdout}"));
    line.split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty())
        .nth(nth)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no figure {nth} on `{line}`"))
}

/// The partitions of the summary: (applied, drawn), from `partition 4/4`; (0, 0) if none
/// were drawn.
fn partitions(stdout: &str) -> (u64, u64) {
    let summary = stdout
        .split_once("nemesis summary")
        .map_or("", |(_, after)| after);
    summary
        .split([',', '\n'])
        .find_map(|part| {
            let (applied, drawn) = part.trim().strip_prefix("partition ")?.split_once('/')?;
            Some((applied.parse().ok()?, drawn.parse().ok()?))
        })
        .unwrap_or((0, 0))
}

/// Why this machine cannot make the nemesis's partitions (not root, or no namespace and
/// veth pair can be made), or None.
fn no_partitions_here() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1));
    if euid != Some("0") {
        return Some("the test is not root".into());
    }
    // A namespace and a veth pair of the test's own, made and removed: root alone is not
    // enough in a container without CAP_SYS_ADMIN or CAP_NET_ADMIN.
    let ip = |args: &[&str]| match Command::new("ip").args(args).output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!("`ip` did not run: {e}")),
    };
    let pid = std::process::id();
    let (netns, host, peer) = (
        format!("rjtn{pid}"),
        format!("rjth{pid}"),
        format!("rjtp{pid}"),
    );
    let made = ip(&["netns", "add", &netns])
        .and_then(|()| ip(&["link", "add", &host, "type", "veth", "peer", "name", &peer]));
    let _ = ip(&["link", "delete", &host]);
    let _ = ip(&["netns", "delete", &netns]);
    made.err()
}

fn assert_clean_run(seed: u64, code: i32, stdout: &str, stderr: &str) {
    assert_clean_run_of(seed, code, stdout, stderr, "evictions exactly once")
}

/// [`assert_clean_run`] with the evictions invariant of the topology (on a cluster,
/// `evictions at least once`).
fn assert_clean_run_of(seed: u64, code: i32, stdout: &str, stderr: &str, evictions: &str) {
    let what = format!(
        "seed {seed}, exit code {code}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    );
    assert_eq!(code, 0, "{what}");
    assert!(stdout.contains("  violations  0"), "{what}");
    assert!(stdout.contains("  settled     "), "{what}");
    for invariant in [
        "live entries kept",
        "acknowledged servers clean",
        evictions,
        "processes stay up",
        "memory flat",
        "route never names a fenced server",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(invariant))
            .unwrap_or_else(|| panic!("no checks of `{invariant}`: {what}"));
        assert!(!line.trim_end().ends_with(" 0 checks"), "{line}: {what}");
    }
    assert!(figure(stdout, "servers", 1) > 0, "no server died: {what}");
}

/// Two minutes of every kind of fault (seed 20 draws each: worker SIGKILL and
/// SIGSTOP/SIGCONT, Redis SIGKILL and restart from its append-only file, BUSY scripts,
/// memory squeezes, zombies, crashes, zone outages, events for unknown and cleaned
/// servers, malformed entries, and where the run is root five partitions) under load,
/// with every invariant checked all along.
#[test]
fn two_minutes_of_faults_from_a_fixed_seed_break_no_invariant() {
    if !RedisServer::available() {
        cannot_run("the nemesis needs redis-server on PATH");
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let seed = 20;
    let (code, stdout, stderr) = nemesis(seed, "120s", &[]);
    assert_clean_run(seed, code, &stdout, &stderr);
    assert!(figure(&stdout, "faults", 1) >= 25, "{stdout}");
    assert!(
        figure(&stdout, "events", 2) > 0,
        "no malformed entry: {stdout}"
    );
    let (applied, drawn) = partitions(&stdout);
    assert_eq!(applied, drawn, "{stdout}");
    eprintln!("{stdout}");
}

/// 40 s on one node from seed 1760, which draws four partitions (three of a worker, one
/// of the reconciler, each cut off from Redis for 1.3 to 6.6 s with no RST) among worker
/// kills, Redis restarts, a BUSY script, a zombie, a crash and events: every worker and
/// the reconciler runs in a network namespace of its own, a worker started again after
/// a kill too. Every invariant holds, every partition is applied, and no namespace or
/// link of the run is left. Partitions need root and `ip netns`.
#[test]
fn partitions_of_workers_and_the_reconciler_break_no_invariant() {
    if !RedisServer::available() {
        cannot_run("the nemesis needs redis-server on PATH");
        return;
    }
    if let Some(why) = no_partitions_here() {
        cannot_run(&format!(
            "the nemesis's partitions need root and `ip netns`: {why}"
        ));
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let seed = 1760;
    let (code, stdout, stderr) = nemesis(seed, "40s", &[]);
    assert_clean_run(seed, code, &stdout, &stderr);
    assert!(stdout.contains("partitions drawn"), "{stdout}");
    assert_eq!(partitions(&stdout), (4, 4), "{stdout}");
    // `(rjn<pid>-0..`: the run's namespaces and host ends are gone.
    let pid = stdout
        .split_once("(rjn")
        .and_then(|(_, rest)| rest.split_once('-'))
        .map(|(pid, _)| pid.to_owned())
        .unwrap_or_else(|| panic!("no namespace named: {stdout}"));
    let list = |args: &[&str]| {
        String::from_utf8_lossy(&Command::new("ip").args(args).output().unwrap().stdout)
            .into_owned()
    };
    let namespaces = list(&["netns", "list"]);
    assert!(!namespaces.contains(&format!("rjn{pid}-")), "{namespaces}");
    let links = list(&["-o", "link", "show"]);
    assert!(!links.contains(&format!("rjh{pid}-")), "{links}");
    eprintln!("{stdout}");
}

/// A shorter run from a seed of the clock: another schedule every time, printed so that a
/// failure replays with `registry-janitor-lab nemesis --seed <seed>`.
#[test]
fn a_seed_from_the_clock_breaks_no_invariant() {
    if !RedisServer::available() {
        cannot_run("the nemesis needs redis-server on PATH");
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        % 1_000_000_000;
    eprintln!(
        "nemesis seed {seed} (replay: registry-janitor-lab nemesis --seed {seed} --duration 45s)"
    );
    let (code, stdout, stderr) = nemesis(seed, "45s", &[]);
    assert_clean_run(seed, code, &stdout, &stderr);
    eprintln!("{stdout}");
}

/// 45 s on a Sentinel group (a primary, two replicas, three sentinels; the janitor
/// configured with the sentinels only): seed 482 draws three failovers, each a SIGKILL of
/// the primary once its replicas hold every write it acknowledged, among worker kills, a
/// pause, a zombie, a crash, a zone outage, an event for a cleaned server and malformed
/// entries. Every invariant holds as strictly as on one node, across the failovers.
#[test]
fn three_sentinel_failovers_under_load_break_no_invariant() {
    if !RedisServer::available() {
        cannot_run("the nemesis needs redis-server on PATH");
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let seed = 482;
    let (code, stdout, stderr) = nemesis(seed, "45s", &["--topology", "sentinel"]);
    assert_clean_run(seed, code, &stdout, &stderr);
    // The failovers were made: one is given up only when the replicas do not catch up
    // within 15 s (a starved machine); at least two of the three must have been made.
    assert!(figure(&stdout, "redis", 0) >= 2, "{stdout}");
    eprintln!("{stdout}");
}

/// 90 s on a Redis Cluster (3 masters with a replica each; the janitor pointed at it with
/// `redis_cluster` and the nodes as seeds): seed 36 draws three `cluster-failover`s (a
/// master SIGKILLed once its replica holds every write it acknowledged) and a
/// `cluster-manual-failover`, among every other kind of fault of a cluster: worker kills
/// and pauses, a BUSY script and a memory squeeze on one master, zombies, crashes, a zone
/// outage, events for unknown and cleaned servers, malformed entries. The invariants as
/// the cluster holds them: evictions at least once, acknowledged servers clean after the
/// drift sweep's passes, every other one as strict as on one node.
#[test]
fn cluster_failovers_under_load_break_no_invariant() {
    if !RedisServer::available() || !RedisCluster::supported() {
        cannot_run(
            "the nemesis's cluster run needs a redis-server that runs a cluster, and redis-cli",
        );
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let seed = 36;
    let (code, stdout, stderr) = nemesis(seed, "90s", &["--topology", "cluster"]);
    assert_clean_run_of(seed, code, &stdout, &stderr, "evictions at least once");
    // A failover is given up only when the replica does not catch up within 15 s (a
    // starved machine): at least two of the three must have been made.
    assert!(figure(&stdout, "redis", 0) >= 2, "{stdout}");
    eprintln!("{stdout}");
}
