//! The command line of `registry-janitor-lab`: `demo`, `bench`, `nemesis`, and the hidden
//! `worker`, `reconcile`, `bench-probe` and `busy` that the benchmark and the nemesis start
//! as processes of their own (and `heartbeats`, which a test starts). The settings flags are the service's
//! ([`registry_janitor::service::SettingsFlags`]).

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use registry_janitor::service::SettingsFlags;

#[derive(Parser)]
#[command(
    name = "registry-janitor-lab",
    version,
    about = "The demo, the benchmark and the nemesis of registry-janitor, each on a private redis-server when no Redis answers"
)]
pub struct Cli {
    #[command(flatten)]
    pub settings: SettingsFlags,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// The whole story on one machine: seed, kill servers, clean, verify.
    Demo(DemoOptions),
    /// The throughput and latency benchmark, with references measured in the same run.
    Bench(BenchOptions),
    /// A randomized fault schedule drawn from a seed, with the janitor's invariants checked
    /// while it runs, on a private redis-server.
    Nemesis(NemesisOptions),
    /// The lookup probe of `bench --zone`, in a process of its own (internal).
    #[command(hide = true)]
    BenchProbe(ProbeOptions),
    /// The service's worker, the same code as `registry-janitor worker`: the benchmark's
    /// worker processes (internal).
    #[command(hide = true)]
    Worker,
    /// The service's reconciler, the same code as `registry-janitor reconcile`: the
    /// nemesis's reconciler process (internal).
    #[command(hide = true)]
    Reconcile,
    /// Connection servers that only heartbeat, until SIGTERM: the guard's stall test
    /// pauses them with Redis and the janitor (internal).
    #[command(hide = true)]
    Heartbeats(HeartbeatOptions),
    /// Keeps one core busy until killed: another process's load beside `bench --zone
    /// --busy-cores` (internal).
    #[command(hide = true)]
    Busy,
}

/// The servers of `heartbeats` and their timing.
#[derive(Debug, Clone, clap::Args)]
pub struct HeartbeatOptions {
    /// A server id (repeated, one per server).
    #[arg(long, required = true)]
    pub server: Vec<String>,
    /// Time between two heartbeats of a server, and before a failed one is tried again.
    #[arg(long, default_value_t = 200)]
    pub interval_ms: u64,
    /// The liveness key's TTL each heartbeat sets.
    #[arg(long, default_value_t = 700)]
    pub ttl_ms: u64,
}

/// Where the nemesis runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TopologyName {
    /// One private redis-server.
    Node,
    /// A private Sentinel group: a primary, two replicas and three sentinels; the
    /// janitor reaches it through the sentinels only.
    Sentinel,
    /// A private Redis Cluster: three masters with a replica each; the janitor is
    /// pointed at it with `redis_cluster` and the nodes as seeds.
    Cluster,
}

/// A nemesis run. It always starts its own Redis; the janitor's processes run with the
/// nemesis's own timings (docs/nemesis.md), and take only `layout`, `key_prefix`,
/// `latency_target_ms`, `step_order`, `evictions_stream` and `max_payload_bytes` from
/// the lab's settings.
#[derive(Debug, Clone, clap::Args)]
pub struct NemesisOptions {
    /// The seed of the fault schedule (and of the load's choices); default: one from the
    /// clock, printed. The same seed draws the same schedule.
    #[arg(long)]
    pub seed: Option<u64>,
    /// How long faults are injected (e.g. 120s, 10m); a quiet end follows, until every
    /// event is settled.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub duration: std::time::Duration,
    /// Where Redis runs.
    #[arg(long, value_enum, default_value = "node")]
    pub topology: TopologyName,
    /// Worker processes (worker-0 is paused but never killed: one process lives the
    /// whole run).
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// Connection-server slots (each runs one incarnation at a time), in `--zones` zones.
    #[arg(long, default_value_t = 12)]
    pub servers: usize,
    /// Zones the slots are spread over (slot s is in zone s % zones): a zone outage takes
    /// one down.
    #[arg(long, default_value_t = 3)]
    pub zones: usize,
    /// Registry entries the load plays with (users; in layout conns, connections, two
    /// per user).
    #[arg(long, default_value_t = 2000)]
    pub entries: usize,
    /// Load operations per second: registrations, moves, unregisters, lookups.
    #[arg(long, default_value_t = 150)]
    pub rate: u32,
    /// How long a dead server may take to be cleaned, and the quiet end to settle,
    /// before that counts as a violation.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub deadline: std::time::Duration,
    /// Start the workers and the reconciler from this `registry-janitor` binary (its
    /// `worker` and `reconcile` commands); default: this binary's own, the same code.
    #[arg(long, value_name = "FILE")]
    pub janitor_exe: Option<PathBuf>,
    /// Keep the processes' logs in this directory (default: a temporary one, kept when
    /// a violation is found).
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    /// Draw no network partitions. They are drawn on one node where the run is root and
    /// `ip netns` works; with this flag, such a machine draws the schedule of a seed as
    /// a machine without them does (the other faults are the same either way).
    #[arg(long)]
    pub no_partitions: bool,
}

/// A duration such as `120s`, `10m`, `500ms` or `90` (seconds).
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(at) => text.split_at(at),
        None => (text, "s"),
    };
    let n: f64 = number
        .parse()
        .map_err(|_| format!("{text:?}: expected a number and a unit (ms, s, m, h)"))?;
    let seconds = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{text:?}: the unit must be ms, s, m or h")),
    };
    if !(seconds.is_finite() && seconds > 0.0) {
        return Err(format!("{text:?}: must be more than zero"));
    }
    Ok(std::time::Duration::from_secs_f64(seconds))
}

/// What the lookup probe of `bench --zone` looks up.
#[derive(Debug, Clone, clap::Args)]
pub struct ProbeOptions {
    /// Live users `live0` .. `live<N-1>` under `key_prefix`, looked up in turn.
    #[arg(long, default_value_t = 10_000)]
    pub users: usize,
}

/// Demo size and shape.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoOptions {
    /// Connection servers to seed.
    #[arg(long, default_value_t = 10)]
    pub servers: usize,
    /// Users per server.
    #[arg(long, default_value_t = 100_000)]
    pub users: usize,
    /// Servers that die.
    #[arg(long, default_value_t = 3)]
    pub dead: usize,
    /// Workers run in this process, each its own consumer in the group.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Percent of a dead server's users that reconnect elsewhere: half before the event,
    /// half while the cleanup runs.
    #[arg(long, default_value_t = 1.0)]
    pub moved_percent: f64,
    /// Run on a private local Redis Cluster of 3 masters (all on this machine) instead.
    #[arg(long)]
    pub local_cluster: bool,
}

/// Benchmark size and shape.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchOptions {
    /// Users on the dead server.
    #[arg(long, default_value_t = 1_000_000)]
    pub users: usize,
    /// Percent of them reconnected to a live server before the cleanup (must survive).
    #[arg(long, default_value_t = 1.0)]
    pub moved_percent: f64,
    /// Users of the naive per-user loop (it is slow: a sample is enough for its rate).
    #[arg(long, default_value_t = 20_000)]
    pub naive_sample: usize,
    /// Users of the second janitor run, for the memory-growth ratio (0 skips it).
    #[arg(long, default_value_t = 100_000)]
    pub baseline_users: usize,
    /// Times each of janitor, unconditional and careful is run (interleaved); the report
    /// gives the median run of each, so one noisy run cannot decide a ratio.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Lookups of each kind in the route-cost runs (`route` against a plain HGET/GET,
    /// interleaved `repeat` times); 0 skips them.
    #[arg(long, default_value_t = 100_000)]
    pub route_lookups: usize,
    /// No stale-window probes during the janitor runs (the dead server is then not made
    /// to look alive).
    #[arg(long)]
    pub no_stale_window: bool,
    /// Run on a private local Redis Cluster (all on this machine) instead: of
    /// `--cluster-masters` masters with `--cluster-replicas` replicas each.
    #[arg(long)]
    pub local_cluster: bool,
    /// Masters of the `--local-cluster` (at least 3, as Redis Cluster requires).
    #[arg(long, default_value_t = 3, requires = "local_cluster", value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(3..))]
    pub cluster_masters: usize,
    /// Replicas of each master of the `--local-cluster`.
    #[arg(long, default_value_t = 0, requires = "local_cluster")]
    pub cluster_replicas: usize,
    /// A zone outage instead: this many servers die at once, their events are published
    /// together, `--workers` worker processes clean them while a probe process looks up
    /// live users every millisecond; then one server of the same total size, one worker.
    /// On a private redis-server, or with `--local-cluster` a private local cluster.
    #[arg(long, value_name = "D")]
    pub zone: Option<usize>,
    /// Users of each server of the zone.
    #[arg(long, default_value_t = 10_000)]
    pub zone_users: usize,
    /// Worker processes of the zone run.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Start the workers from this `registry-janitor` binary (its `worker` command), e.g.
    /// another build to compare with; default: this binary's own worker, the same code.
    #[arg(long, value_name = "FILE")]
    pub worker_exe: Option<PathBuf>,
    /// Zone: run once per `latency_target_ms` of this list (e.g. 0,1,2,5); default: the
    /// setting.
    #[arg(long, value_delimiter = ',')]
    pub latency_targets: Vec<u64>,
    /// Zone: run once per `step_order` of this list (smallest_first,round_robin); default:
    /// the setting.
    #[arg(long, value_delimiter = ',')]
    pub step_orders: Vec<String>,
    /// Zone: run once per `cluster_replica_wait` of this list (true,false); default: the
    /// setting. Makes a difference on a cluster with replicas (`--cluster-replicas`).
    #[arg(long, value_delimiter = ',')]
    pub replica_waits: Vec<bool>,
    /// Zone: run once per count of this list (e.g. 0,1), with that many cores kept busy by
    /// processes of their own (`registry-janitor-lab busy`, a spinning loop at normal
    /// priority) through both the zone and the single-server runs; default: 0.
    #[arg(long, value_delimiter = ',')]
    pub busy_cores: Vec<usize>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

impl BenchOptions {
    /// The private local cluster to run on, with `--local-cluster`.
    pub(crate) fn cluster_shape(&self) -> Option<crate::private::ClusterShape> {
        self.local_cluster.then_some(crate::private::ClusterShape {
            masters: self.cluster_masters,
            replicas: self.cluster_replicas,
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::Cli;

    #[test]
    fn a_local_cluster_of_fewer_than_three_masters_is_refused_naming_the_flag() {
        let parse = |masters: &str| {
            Cli::try_parse_from([
                "registry-janitor-lab",
                "bench",
                "--local-cluster",
                "--cluster-masters",
                masters,
            ])
        };
        let err = parse("2").err().expect("2 masters refused").to_string();
        assert!(err.contains("--cluster-masters"), "{err}");
        assert!(parse("3").is_ok());
        assert!(parse("6").is_ok());
    }
}
