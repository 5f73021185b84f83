//! The fault schedule: every fault of a run and when it starts, drawn from the seed before
//! the run begins, so that `--seed` replays the same schedule.
//!
//! The draw keeps the schedule coherent, not the run: faults on Redis itself (restart,
//! BUSY, out of memory) never overlap one another, a worker takes one fault at a time,
//! and a connection server slot takes one fault at a time with at least four slots live
//! (somewhere for users to reconnect to). Whether a fault still applies when its time
//! comes (the slot's server may not be back yet) is decided by the run, and said.
//!
//! Network partitions, where the run can make them, are drawn after the other faults from
//! a stream of random numbers of their own ([`PARTITION_STREAM`]): the other faults of a
//! seed are the same with partitions and without.

use std::{fmt, time::Duration};

use rand::{rngs::StdRng, Rng, SeedableRng};

/// The kinds of faults, each with its weight in the draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    WorkerKill,
    WorkerPause,
    RedisRestart,
    Busy,
    OomSqueeze,
    Zombie,
    ServerCrash,
    ZoneOutage,
    DeadUnknown,
    DeadAgain,
    Malformed,
    SentinelFailover,
    ClusterFailover,
    ClusterManualFailover,
    Partition,
}

impl Kind {
    /// Every kind a single node takes in the draw of [`Schedule::draw`] (failovers need
    /// topologies of their own; network partitions are drawn apart, on one node only).
    pub const NODE: [Kind; 11] = [
        Kind::WorkerKill,
        Kind::WorkerPause,
        Kind::RedisRestart,
        Kind::Busy,
        Kind::OomSqueeze,
        Kind::Zombie,
        Kind::ServerCrash,
        Kind::ZoneOutage,
        Kind::DeadUnknown,
        Kind::DeadAgain,
        Kind::Malformed,
    ];

    /// Every kind a Sentinel group takes: a failover of the primary instead of a restart
    /// of the one node, and no BUSY script. A primary that answers BUSY for longer than
    /// the sentinels' `down-after-milliseconds` is down for them: they kill the script
    /// and fail over, and the writes the old primary takes between the script's end and
    /// its demotion are lost by Redis, whatever the janitor does.
    pub const SENTINEL: [Kind; 10] = [
        Kind::WorkerKill,
        Kind::WorkerPause,
        Kind::SentinelFailover,
        Kind::OomSqueeze,
        Kind::Zombie,
        Kind::ServerCrash,
        Kind::ZoneOutage,
        Kind::DeadUnknown,
        Kind::DeadAgain,
        Kind::Malformed,
    ];

    /// Every kind a Redis Cluster takes: a failover of a master once its replica holds
    /// every write it acknowledged (SIGKILL, or `CLUSTER FAILOVER` from its replica)
    /// instead of a restart; a BUSY script and a memory squeeze hit one master. A master
    /// restarted without a failover would come back with its slots and no replica in
    /// sync: the restart is left to the failover, which brings the old master back as a
    /// replica.
    pub const CLUSTER: [Kind; 12] = [
        Kind::WorkerKill,
        Kind::WorkerPause,
        Kind::ClusterFailover,
        Kind::ClusterManualFailover,
        Kind::Busy,
        Kind::OomSqueeze,
        Kind::Zombie,
        Kind::ServerCrash,
        Kind::ZoneOutage,
        Kind::DeadUnknown,
        Kind::DeadAgain,
        Kind::Malformed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::WorkerKill => "worker-kill",
            Kind::WorkerPause => "worker-pause",
            Kind::RedisRestart => "redis-restart",
            Kind::Busy => "busy-script",
            Kind::OomSqueeze => "oom-squeeze",
            Kind::Zombie => "zombie-server",
            Kind::ServerCrash => "server-crash",
            Kind::ZoneOutage => "zone-outage",
            Kind::DeadUnknown => "dead-unknown",
            Kind::DeadAgain => "dead-again",
            Kind::Malformed => "malformed-entries",
            Kind::SentinelFailover => "sentinel-failover",
            Kind::ClusterFailover => "cluster-failover",
            Kind::ClusterManualFailover => "cluster-manual-failover",
            Kind::Partition => "partition",
        }
    }

    fn weight(self) -> u32 {
        match self {
            Kind::WorkerKill | Kind::ServerCrash => 3,
            Kind::WorkerPause | Kind::SentinelFailover | Kind::ClusterFailover => 2,
            _ => 1,
        }
    }

    /// A fault on Redis itself: such faults never overlap.
    fn on_redis(self) -> bool {
        matches!(
            self,
            Kind::RedisRestart
                | Kind::Busy
                | Kind::OomSqueeze
                | Kind::SentinelFailover
                | Kind::ClusterFailover
                | Kind::ClusterManualFailover
        )
    }
}

/// The shapes of malformed stream entries; `Foreign` is a well-formed entry of another
/// type (acknowledged and ignored, never dead-lettered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    JunkPayload,
    NoPayload,
    NoType,
    BadServerId,
    Truncated,
    FutureVersion,
    Foreign,
}

impl Shape {
    const ALL: [Shape; 7] = [
        Shape::JunkPayload,
        Shape::NoPayload,
        Shape::NoType,
        Shape::BadServerId,
        Shape::Truncated,
        Shape::FutureVersion,
        Shape::Foreign,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Shape::JunkPayload => "junk-payload",
            Shape::NoPayload => "no-payload",
            Shape::NoType => "no-type",
            Shape::BadServerId => "bad-server-id",
            Shape::Truncated => "truncated-payload",
            Shape::FutureVersion => "future-version",
            Shape::Foreign => "foreign-type",
        }
    }
}

/// One fault and its parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// SIGKILL a worker process; a new one starts after `back_after` (as Kubernetes
    /// restarts a pod). Worker 0 is never killed, so that one process lives the whole run
    /// (its memory is the flat-memory check's best witness).
    WorkerKill { worker: usize, back_after: Duration },
    /// SIGSTOP a worker process, SIGCONT after `pause` (longer than `claim_min_idle_ms`:
    /// its entries are taken over, and its late steps land after).
    WorkerPause { worker: usize, pause: Duration },
    /// SIGKILL redis-server, start it again after `down` with its append-only file.
    RedisRestart { down: Duration },
    /// A Lua busy loop from another client for `busy`: every other command gets BUSY.
    /// On a cluster, on one master: the `master`-th (modulo) of the masters then, in the
    /// order of the nodes.
    Busy { busy: Duration, master: Option<u32> },
    /// `maxmemory` below what Redis uses (`hard`) or just above it, for `squeeze`; then
    /// back to no limit. On a cluster, on one master, as for `Busy`.
    OomSqueeze {
        squeeze: Duration,
        hard: bool,
        master: Option<u32>,
    },
    /// The server of `slot` stops heartbeating and writing (a hung process); once its
    /// fence stands it wakes up, must be refused (FENCED), and starts again under a new
    /// id.
    Zombie { slot: usize },
    /// The server of `slot` crashes; its users reconnect elsewhere; a new incarnation
    /// starts after `back_after`. With `monitoring`, monitoring publishes its
    /// `server.dead` once its liveness TTL has passed (otherwise the reconciler finds it).
    ServerCrash {
        slot: usize,
        back_after: Duration,
        monitoring: bool,
    },
    /// Every server of `zone` crashes at once.
    ZoneOutage {
        zone: usize,
        back_after: Duration,
        monitoring: bool,
    },
    /// `server.dead` for servers that never existed.
    DeadUnknown { count: usize },
    /// `server.dead` again for a server already cleaned (the `pick`-th of them, modulo).
    DeadAgain { pick: u32 },
    /// Malformed entries on the events stream.
    Malformed { shapes: Vec<Shape> },
    /// The Sentinel group's primary is SIGKILLed once its replicas hold every write it
    /// acknowledged (its clients paused meanwhile); the sentinels promote a replica; the
    /// old primary starts again `down` after the kill (not before the promotion), as a
    /// replica of the new one.
    SentinelFailover { down: Duration },
    /// A cluster master (the `master`-th, modulo, of the masters then) is SIGKILLed once
    /// its replica holds every write it acknowledged (its clients paused meanwhile); the
    /// replica is promoted; the old master starts again `down` after the kill (not before
    /// the promotion) and joins as a replica of the new one.
    ClusterFailover { master: u32, down: Duration },
    /// `CLUSTER FAILOVER` on the replica of a master: the master stops its clients, the
    /// replica catches up and takes over, the old master becomes its replica. Nothing is
    /// killed.
    ClusterManualFailover { master: u32 },
    /// A worker (`worker`), or the reconciler (`None`), is cut off from Redis for `cut`:
    /// the host end of its network namespace's link goes down, so that nothing it sends
    /// arrives and nothing answers (no RST); then the link is up again.
    Partition {
        worker: Option<usize>,
        cut: Duration,
    },
}

impl Fault {
    pub fn kind(&self) -> Kind {
        match self {
            Fault::WorkerKill { .. } => Kind::WorkerKill,
            Fault::WorkerPause { .. } => Kind::WorkerPause,
            Fault::RedisRestart { .. } => Kind::RedisRestart,
            Fault::Busy { .. } => Kind::Busy,
            Fault::OomSqueeze { .. } => Kind::OomSqueeze,
            Fault::Zombie { .. } => Kind::Zombie,
            Fault::ServerCrash { .. } => Kind::ServerCrash,
            Fault::ZoneOutage { .. } => Kind::ZoneOutage,
            Fault::DeadUnknown { .. } => Kind::DeadUnknown,
            Fault::DeadAgain { .. } => Kind::DeadAgain,
            Fault::Malformed { .. } => Kind::Malformed,
            Fault::SentinelFailover { .. } => Kind::SentinelFailover,
            Fault::ClusterFailover { .. } => Kind::ClusterFailover,
            Fault::ClusterManualFailover { .. } => Kind::ClusterManualFailover,
            Fault::Partition { .. } => Kind::Partition,
        }
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.kind().name();
        match self {
            Fault::WorkerKill { worker, back_after } => {
                write!(
                    f,
                    "{name} worker-{worker}, a new one after {}",
                    secs(*back_after)
                )
            }
            Fault::WorkerPause { worker, pause } => {
                write!(f, "{name} worker-{worker} for {}", secs(*pause))
            }
            Fault::RedisRestart { down } => write!(f, "{name}, down {}", secs(*down)),
            Fault::Busy { busy, master } => {
                write!(f, "{name} for {}{}", secs(*busy), on_master(*master))
            }
            Fault::OomSqueeze {
                squeeze,
                hard,
                master,
            } => write!(
                f,
                "{name} for {} ({}){}",
                secs(*squeeze),
                if *hard { "below use" } else { "at the edge" },
                on_master(*master)
            ),
            Fault::Zombie { slot } => write!(f, "{name} slot {slot}"),
            Fault::ServerCrash {
                slot,
                back_after,
                monitoring,
            } => write!(
                f,
                "{name} slot {slot}, back after {}{}",
                secs(*back_after),
                if *monitoring {
                    ", monitoring reports"
                } else {
                    ""
                }
            ),
            Fault::ZoneOutage {
                zone,
                back_after,
                monitoring,
            } => write!(
                f,
                "{name} zone {zone}, back after {}{}",
                secs(*back_after),
                if *monitoring {
                    ", monitoring reports"
                } else {
                    ""
                }
            ),
            Fault::DeadUnknown { count } => write!(f, "{name} x{count}"),
            Fault::SentinelFailover { down } => {
                write!(f, "{name}, the old primary back after {}", secs(*down))
            }
            Fault::ClusterFailover { master, down } => write!(
                f,
                "{name} of master #{master}, the old master back after {}",
                secs(*down)
            ),
            Fault::ClusterManualFailover { master } => write!(f, "{name} of master #{master}"),
            Fault::DeadAgain { pick } => write!(f, "{name} (pick {pick})"),
            Fault::Partition { worker, cut } => write!(
                f,
                "{name} {} from Redis for {}",
                worker.map_or_else(|| "reconciler".to_owned(), |w| format!("worker-{w}")),
                secs(*cut)
            ),
            Fault::Malformed { shapes } => {
                let names: Vec<&str> = shapes.iter().map(|s| s.name()).collect();
                write!(f, "{name} [{}]", names.join(", "))
            }
        }
    }
}

/// ` on master #N` on a cluster.
fn on_master(master: Option<u32>) -> String {
    master.map_or_else(String::new, |m| format!(" on master #{m}"))
}

/// One fault and its offset from the start of the run.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub at: Duration,
    pub fault: Fault,
}

/// The shape of the run the schedule is drawn for.
#[derive(Debug, Clone)]
pub struct RunShape {
    pub duration: Duration,
    pub workers: usize,
    pub slots: usize,
    pub zones: usize,
    pub kinds: Vec<Kind>,
    /// Network partitions are drawn too (one node, root, `ip netns`).
    pub partitions: bool,
}

/// The faults of one run, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub seed: u64,
    pub faults: Vec<Planned>,
    /// Whether network partitions were drawn.
    pub partitions: bool,
}

/// Time before the first fault: the fleet and the janitor settle first.
const WARM_UP: Duration = Duration::from_secs(4);
/// A zombie holds its slot this long in the draw (it wakes when fenced, a few seconds).
const ZOMBIE_HOLD: Duration = Duration::from_secs(30);
/// Slots kept live whatever the draw: users need somewhere to reconnect to.
const MIN_LIVE_SLOTS: usize = 4;
/// The partitions' stream of random numbers is the seed's with these bits flipped.
const PARTITION_STREAM: u64 = 0x7061_7274_6974_696f;

fn ms(rng: &mut StdRng, lo: u64, hi: u64) -> Duration {
    Duration::from_millis(rng.random_range(lo..hi))
}

impl Schedule {
    /// The schedule of `seed` for a run of `shape`.
    pub fn draw(seed: u64, shape: &RunShape) -> Schedule {
        let mut rng = StdRng::seed_from_u64(seed);
        let total: u32 = shape.kinds.iter().map(|k| k.weight()).sum();
        let mut redis_free = Duration::ZERO;
        let mut worker_free = vec![Duration::ZERO; shape.workers];
        let mut slot_free = vec![Duration::ZERO; shape.slots];
        let zone_of = |slot: usize| slot % shape.zones.max(1);
        // On a cluster a fault on Redis picks its master; elsewhere nothing more is drawn
        // (the schedules of the other topologies stay what their seeds drew).
        let cluster = shape.kinds.contains(&Kind::ClusterFailover);
        let mut faults = Vec::new();
        let mut t = WARM_UP;
        while t < shape.duration {
            let mut pick = rng.random_range(0..total.max(1));
            let kind = *shape
                .kinds
                .iter()
                .find(|k| {
                    if pick < k.weight() {
                        true
                    } else {
                        pick -= k.weight();
                        false
                    }
                })
                .expect("a kind");
            let free_slots: Vec<usize> = (0..shape.slots).filter(|&s| slot_free[s] <= t).collect();
            let fault = match kind {
                _ if kind.on_redis() && redis_free > t => None,
                Kind::WorkerKill => {
                    let free: Vec<usize> = (1..shape.workers)
                        .filter(|&w| worker_free[w] <= t)
                        .collect();
                    (!free.is_empty()).then(|| {
                        let worker = free[rng.random_range(0..free.len())];
                        let back_after = ms(&mut rng, 300, 3000);
                        worker_free[worker] = t + back_after + Duration::from_secs(1);
                        Fault::WorkerKill { worker, back_after }
                    })
                }
                Kind::WorkerPause => {
                    let free: Vec<usize> = (0..shape.workers)
                        .filter(|&w| worker_free[w] <= t)
                        .collect();
                    (!free.is_empty()).then(|| {
                        let worker = free[rng.random_range(0..free.len())];
                        let pause = ms(&mut rng, 1500, 6000);
                        worker_free[worker] = t + pause + Duration::from_secs(1);
                        Fault::WorkerPause { worker, pause }
                    })
                }
                Kind::RedisRestart => {
                    let down = ms(&mut rng, 300, 4000);
                    redis_free = t + down + Duration::from_secs(4);
                    Some(Fault::RedisRestart { down })
                }
                Kind::Busy => {
                    // On a cluster at most 3 s: a master that answers nothing for the
                    // cluster's node timeout (5 s) may be failed over by the cluster.
                    let busy = ms(&mut rng, 500, if cluster { 3000 } else { 4500 });
                    redis_free = t + busy + Duration::from_secs(3);
                    let master = cluster.then(|| rng.random_range(0..1000));
                    Some(Fault::Busy { busy, master })
                }
                Kind::OomSqueeze => {
                    let squeeze = ms(&mut rng, 1000, 6000);
                    let hard = rng.random_bool(0.5);
                    redis_free = t + squeeze + Duration::from_secs(3);
                    let master = cluster.then(|| rng.random_range(0..1000));
                    Some(Fault::OomSqueeze {
                        squeeze,
                        hard,
                        master,
                    })
                }
                Kind::ClusterFailover => {
                    let master = rng.random_range(0..1000);
                    let down = ms(&mut rng, 4000, 10000);
                    // The promotion takes the node timeout (5 s) and an election; the next
                    // fault on Redis comes once the old master is back and in sync.
                    redis_free = t + down + Duration::from_secs(12);
                    Some(Fault::ClusterFailover { master, down })
                }
                Kind::ClusterManualFailover => {
                    let master = rng.random_range(0..1000);
                    redis_free = t + Duration::from_secs(8);
                    Some(Fault::ClusterManualFailover { master })
                }
                Kind::Zombie | Kind::ServerCrash if free_slots.len() > MIN_LIVE_SLOTS => {
                    let slot = free_slots[rng.random_range(0..free_slots.len())];
                    if kind == Kind::Zombie {
                        slot_free[slot] = t + ZOMBIE_HOLD;
                        Some(Fault::Zombie { slot })
                    } else {
                        let back_after = ms(&mut rng, 2000, 9000);
                        slot_free[slot] = t + back_after + Duration::from_secs(1);
                        Some(Fault::ServerCrash {
                            slot,
                            back_after,
                            monitoring: rng.random_bool(0.4),
                        })
                    }
                }
                Kind::ZoneOutage => {
                    let zone = rng.random_range(0..shape.zones.max(1));
                    let in_zone: Vec<usize> =
                        (0..shape.slots).filter(|&s| zone_of(s) == zone).collect();
                    let all_free = in_zone.iter().all(|s| free_slots.contains(s));
                    (all_free && free_slots.len() >= in_zone.len() + MIN_LIVE_SLOTS).then(|| {
                        let back_after = ms(&mut rng, 3000, 10000);
                        for s in in_zone {
                            slot_free[s] = t + back_after + Duration::from_secs(1);
                        }
                        Fault::ZoneOutage {
                            zone,
                            back_after,
                            monitoring: rng.random_bool(0.4),
                        }
                    })
                }
                Kind::SentinelFailover => {
                    let down = ms(&mut rng, 4000, 10000);
                    // The promotion takes the sentinels' `down-after-milliseconds` (5 s)
                    // and an election; the next fault on Redis comes once the old primary
                    // is back and in sync.
                    redis_free = t + down + Duration::from_secs(10);
                    Some(Fault::SentinelFailover { down })
                }
                Kind::DeadUnknown => Some(Fault::DeadUnknown {
                    count: rng.random_range(1..4),
                }),
                Kind::DeadAgain => Some(Fault::DeadAgain {
                    pick: rng.random_range(0..1000),
                }),
                Kind::Malformed => {
                    let n = rng.random_range(1..4);
                    let shapes = (0..n)
                        .map(|_| Shape::ALL[rng.random_range(0..Shape::ALL.len())])
                        .collect();
                    Some(Fault::Malformed { shapes })
                }
                // Drawn apart ([`draw_partitions`]), never among `shape.kinds`.
                Kind::Zombie | Kind::ServerCrash | Kind::Partition => None,
            };
            if let Some(fault) = fault {
                faults.push(Planned { at: t, fault });
            }
            t += ms(&mut rng, 1500, 5000);
        }
        if shape.partitions {
            let partitions = draw_partitions(seed, shape, &faults);
            faults.extend(partitions);
            faults.sort_by_key(|p| p.at);
        }
        Schedule {
            seed,
            faults,
            partitions: shape.partitions,
        }
    }

    /// The faults of each kind, in the order of [`Kind`].
    pub fn counts(&self) -> std::collections::BTreeMap<Kind, usize> {
        let mut counts = std::collections::BTreeMap::new();
        for p in &self.faults {
            *counts.entry(p.fault.kind()).or_default() += 1;
        }
        counts
    }
}

/// The partitions of `seed` for a run of `shape` whose other faults are `faults`: one
/// process cut off at a time, for 1 to 25 s, the next 2 to 20 s after the heal; a
/// worker only while no other fault of the schedule holds it (a worker takes one fault
/// at a time). The first comes 0 to 10 s after the warm-up.
fn draw_partitions(seed: u64, shape: &RunShape, faults: &[Planned]) -> Vec<Planned> {
    let mut rng = StdRng::seed_from_u64(seed ^ PARTITION_STREAM);
    let mut held: Vec<Vec<(Duration, Duration)>> = vec![Vec::new(); shape.workers];
    for p in faults {
        match p.fault {
            Fault::WorkerKill { worker, back_after } => {
                held[worker].push((p.at, p.at + back_after + Duration::from_secs(1)));
            }
            Fault::WorkerPause { worker, pause } => {
                held[worker].push((p.at, p.at + pause + Duration::from_secs(1)));
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    let mut t = WARM_UP + ms(&mut rng, 0, 10_000);
    while t < shape.duration {
        let cut = ms(&mut rng, 1000, 25_000);
        let until = t + cut + Duration::from_secs(1);
        // The workers free all along, and the reconciler (None), which takes no other
        // fault.
        let free: Vec<Option<usize>> = (0..shape.workers)
            .filter(|&w| held[w].iter().all(|&(from, to)| to <= t || from >= until))
            .map(Some)
            .chain([None])
            .collect();
        let worker = free[rng.random_range(0..free.len())];
        out.push(Planned {
            at: t,
            fault: Fault::Partition { worker, cut },
        });
        t = until + ms(&mut rng, 2000, 20_000);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> RunShape {
        RunShape {
            duration: Duration::from_secs(600),
            workers: 3,
            slots: 12,
            zones: 3,
            kinds: Kind::NODE.to_vec(),
            partitions: false,
        }
    }

    fn with_partitions() -> RunShape {
        RunShape {
            partitions: true,
            ..shape()
        }
    }

    /// FNV-1a over the Debug text of every fault of the schedules of `seeds`.
    fn fingerprint(seeds: std::ops::Range<u64>, shape: &RunShape) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for seed in seeds {
            for p in &Schedule::draw(seed, shape).faults {
                for b in format!("{p:?}").bytes() {
                    h ^= u64::from(b);
                    h = h.wrapping_mul(0x0100_0000_01b3);
                }
            }
        }
        h
    }

    /// Without partitions, the schedules of seeds 0 to 99 on every topology are the ones
    /// drawn before partitions existed (their fingerprints then), so that a seed
    /// replays on a machine without partitions or with `--no-partitions`.
    #[test]
    fn without_partitions_every_seed_draws_the_schedule_it_drew_before() {
        let sentinel = RunShape {
            kinds: Kind::SENTINEL.to_vec(),
            ..shape()
        };
        let cluster = RunShape {
            kinds: Kind::CLUSTER.to_vec(),
            ..shape()
        };
        assert_eq!(fingerprint(0..100, &shape()), 0x314f_e7f3_2d2e_ffd1);
        assert_eq!(fingerprint(0..100, &sentinel), 0xd2b5_bc79_5ac8_9464);
        assert_eq!(fingerprint(0..100, &cluster), 0x34d7_5f62_cc01_010c);
        let s = Schedule::draw(
            20,
            &RunShape {
                duration: Duration::from_secs(120),
                ..shape()
            },
        );
        assert_eq!(s.faults.len(), 34);
        assert!(!s.counts().contains_key(&Kind::Partition));
    }

    #[test]
    fn partitions_leave_the_other_faults_of_a_seed_as_they_were() {
        for seed in 0..50 {
            let with = Schedule::draw(seed, &with_partitions());
            assert_eq!(with, Schedule::draw(seed, &with_partitions()), "{seed}");
            let others: Vec<Planned> = with
                .faults
                .iter()
                .filter(|p| p.fault.kind() != Kind::Partition)
                .cloned()
                .collect();
            assert_eq!(others, Schedule::draw(seed, &shape()).faults, "{seed}");
            assert!(with.faults.windows(2).all(|w| w[0].at <= w[1].at), "{seed}");
        }
    }

    /// Partitions cut one process at a time, for 1 to 25 s; a worker only while no other
    /// fault holds it; each worker and the reconciler in turn.
    #[test]
    fn partitions_are_drawn_one_at_a_time_and_never_on_a_worker_held_by_another_fault() {
        let mut targets = std::collections::BTreeSet::new();
        for seed in 0..50 {
            let s = Schedule::draw(seed, &with_partitions());
            let mut held: Vec<(usize, Duration, Duration)> = Vec::new();
            for p in &s.faults {
                match p.fault {
                    Fault::WorkerKill {
                        worker,
                        back_after: d,
                    }
                    | Fault::WorkerPause { worker, pause: d } => {
                        held.push((worker, p.at, p.at + d + Duration::from_secs(1)));
                    }
                    _ => {}
                }
            }
            let mut cut_until = Duration::ZERO;
            let mut n = 0;
            for p in &s.faults {
                let Fault::Partition { worker, cut } = p.fault else {
                    continue;
                };
                n += 1;
                targets.insert(worker);
                assert!(
                    (Duration::from_secs(1)..Duration::from_secs(25)).contains(&cut),
                    "{seed}: {cut:?}"
                );
                assert!(
                    p.at >= cut_until,
                    "{seed}: partitions overlap at {:?}",
                    p.at
                );
                cut_until = p.at + cut + Duration::from_secs(1);
                if let Some(w) = worker {
                    for &(_, from, to) in held.iter().filter(|h| h.0 == w) {
                        assert!(
                            to <= p.at || from >= cut_until,
                            "{seed}: worker-{w} partitioned at {:?} while held",
                            p.at
                        );
                    }
                }
            }
            assert!(n >= 15, "{seed}: {n} partitions in 600 s");
        }
        assert_eq!(targets, [None, Some(0), Some(1), Some(2)].into());
    }

    #[test]
    fn a_seed_draws_the_same_schedule_every_time() {
        assert_eq!(Schedule::draw(7, &shape()), Schedule::draw(7, &shape()));
        assert_ne!(Schedule::draw(7, &shape()), Schedule::draw(8, &shape()));
    }

    /// The suite's two-minute run (`crates/lab/tests/nemesis.rs`) uses seed 20: every
    /// kind of fault in two minutes, Redis faults of each kind, two zone outages.
    #[test]
    fn the_suites_seed_draws_every_kind_in_two_minutes() {
        let s = Schedule::draw(
            20,
            &RunShape {
                duration: Duration::from_secs(120),
                ..shape()
            },
        );
        let counts = s.counts();
        for kind in Kind::NODE {
            assert!(counts.get(&kind).copied().unwrap_or(0) > 0, "no {kind:?}");
        }
        assert!(counts[&Kind::ZoneOutage] >= 2, "{counts:?}");
    }

    /// The suite's Sentinel run (`crates/lab/tests/nemesis.rs`) uses seed 482: three
    /// failovers in 45 s, among eight kinds of faults.
    #[test]
    fn the_suites_sentinel_seed_draws_three_failovers_in_45_s() {
        let s = Schedule::draw(
            482,
            &RunShape {
                duration: Duration::from_secs(45),
                kinds: Kind::SENTINEL.to_vec(),
                ..shape()
            },
        );
        let counts = s.counts();
        assert_eq!(counts.get(&Kind::SentinelFailover), Some(&3), "{counts:?}");
        assert!(counts.len() >= 8, "{counts:?}");
    }

    /// The suite's partition run (`crates/lab/tests/nemesis.rs`) uses seed 1760: four
    /// partitions in 40 s, three of a worker and one of the reconciler, the last healed
    /// before the end; with partitions, the two-minute run's seed 20 draws five.
    #[test]
    fn the_suites_partition_seed_draws_four_in_40_s() {
        let s = Schedule::draw(
            1760,
            &RunShape {
                duration: Duration::from_secs(40),
                ..with_partitions()
            },
        );
        let cuts: Vec<(Duration, Option<usize>, Duration)> = s
            .faults
            .iter()
            .filter_map(|p| match p.fault {
                Fault::Partition { worker, cut } => Some((p.at, worker, cut)),
                _ => None,
            })
            .collect();
        assert_eq!(cuts.len(), 4, "{cuts:?}");
        assert_eq!(cuts.iter().filter(|c| c.1.is_none()).count(), 1, "{cuts:?}");
        assert!(
            cuts.iter()
                .all(|&(at, _, cut)| at + cut < Duration::from_secs(40)),
            "{cuts:?}"
        );
        let two_minutes = Schedule::draw(
            20,
            &RunShape {
                duration: Duration::from_secs(120),
                ..with_partitions()
            },
        );
        assert_eq!(two_minutes.counts().get(&Kind::Partition), Some(&5));
    }

    #[test]
    fn a_sentinel_schedule_fails_over_and_never_restarts_or_blocks_the_primary() {
        for seed in 0..50 {
            let s = Schedule::draw(
                seed,
                &RunShape {
                    kinds: Kind::SENTINEL.to_vec(),
                    ..shape()
                },
            );
            let counts = s.counts();
            assert!(counts[&Kind::SentinelFailover] >= 8, "{seed}: {counts:?}");
            assert!(!counts.contains_key(&Kind::RedisRestart), "{seed}");
            assert!(!counts.contains_key(&Kind::Busy), "{seed}");
            let mut redis_until = Duration::ZERO;
            for p in &s.faults {
                let d = match &p.fault {
                    // The failover's own steps take a few seconds past `down`.
                    Fault::SentinelFailover { down } => *down + Duration::from_secs(10),
                    Fault::OomSqueeze { squeeze, .. } => *squeeze,
                    _ => continue,
                };
                assert!(
                    p.at >= redis_until,
                    "{seed}: Redis faults overlap at {:?}",
                    p.at
                );
                redis_until = p.at + d;
            }
        }
    }

    /// The suite's cluster run (`crates/lab/tests/nemesis.rs`) uses seed 36: every kind
    /// of fault of a cluster in 90 s, three failovers by SIGKILL and one manual.
    #[test]
    fn the_suites_cluster_seed_draws_every_kind_in_90_s() {
        let s = Schedule::draw(
            36,
            &RunShape {
                duration: Duration::from_secs(90),
                kinds: Kind::CLUSTER.to_vec(),
                ..shape()
            },
        );
        let counts = s.counts();
        for kind in Kind::CLUSTER {
            assert!(counts.get(&kind).copied().unwrap_or(0) > 0, "no {kind:?}");
        }
        assert_eq!(counts.get(&Kind::ClusterFailover), Some(&3), "{counts:?}");
    }

    #[test]
    fn a_cluster_schedule_fails_over_picks_masters_and_never_restarts_a_node() {
        for seed in 0..50 {
            let s = Schedule::draw(
                seed,
                &RunShape {
                    kinds: Kind::CLUSTER.to_vec(),
                    ..shape()
                },
            );
            let counts = s.counts();
            assert!(counts[&Kind::ClusterFailover] >= 5, "{seed}: {counts:?}");
            assert!(
                counts[&Kind::ClusterManualFailover] >= 1,
                "{seed}: {counts:?}"
            );
            assert!(!counts.contains_key(&Kind::RedisRestart), "{seed}");
            assert!(!counts.contains_key(&Kind::SentinelFailover), "{seed}");
            let mut redis_until = Duration::ZERO;
            for p in &s.faults {
                let d = match &p.fault {
                    Fault::ClusterFailover { down, .. } => *down + Duration::from_secs(12),
                    Fault::ClusterManualFailover { .. } => Duration::from_secs(8),
                    Fault::Busy { busy, master } => {
                        assert!(master.is_some() && *busy <= Duration::from_secs(3));
                        *busy
                    }
                    Fault::OomSqueeze {
                        squeeze, master, ..
                    } => {
                        assert!(master.is_some());
                        *squeeze
                    }
                    _ => continue,
                };
                assert!(
                    p.at >= redis_until,
                    "{seed}: Redis faults overlap at {:?}",
                    p.at
                );
                redis_until = p.at + d;
            }
        }
    }

    #[test]
    fn the_draw_keeps_the_schedule_coherent() {
        for seed in 0..50 {
            let s = Schedule::draw(seed, &shape());
            let counts = s.counts();
            assert!(s.faults.len() > 100, "{seed}: {} faults", s.faults.len());
            for kind in Kind::NODE {
                assert!(
                    counts.get(&kind).copied().unwrap_or(0) > 0,
                    "{seed}: no {kind:?}"
                );
            }
            let mut redis_until = Duration::ZERO;
            for p in &s.faults {
                match &p.fault {
                    Fault::RedisRestart { down: d }
                    | Fault::Busy { busy: d, .. }
                    | Fault::OomSqueeze { squeeze: d, .. } => {
                        assert!(
                            p.at >= redis_until,
                            "{seed}: Redis faults overlap at {:?}",
                            p.at
                        );
                        redis_until = p.at + *d;
                    }
                    Fault::WorkerKill { worker, .. } => assert_ne!(*worker, 0),
                    _ => {}
                }
            }
        }
    }
}
