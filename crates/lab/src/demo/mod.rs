//! `registry-janitor-lab demo`: the whole story on one machine, verified.
//!
//! 1. Finds a Redis: the one at `redis_url`, or a private `redis-server` it starts; with
//!    `--local-cluster`, a private local Redis Cluster of 3 masters, and with
//!    `redis_cluster` set, the configured cluster.
//! 2. Seeds a registry under a key prefix of its own (it never touches other keys):
//!    `servers` x `users` entries, every server heartbeating.
//! 3. Declares `dead` servers dead with real `server.dead` events; before that, a few of
//!    their users reconnect elsewhere, and more keep reconnecting while the workers run,
//!    racing the cleanup.
//! 4. Runs `workers` workers in this process (each its own consumer) with a progress bar.
//! 5. Verifies every seeded user: entries of users still on a dead server are gone,
//!    users who moved kept their new entry, users of live servers kept theirs.
//! 6. Deletes every key it created.
//!
//! In layout `conns` each seeded entry is a connection: the users of three consecutive
//! servers are the same people (connection `c-<server>-<n>` of user `user-<n>-g<i/3>`),
//! so most users hold 2-3 connections on different servers; a mover is a connection
//! that moves. The verification also reads every user Hash left: none may name a dead
//! server (nor be empty, which Redis does not keep).

mod verify;

use std::{
    collections::HashMap,
    fmt,
    time::{Duration, Instant},
};

use indicatif::{ProgressBar, ProgressStyle};
use rand::{seq::SliceRandom, Rng};
use registry_janitor::{
    cleanup::Cleaner,
    config::{Layout, Settings},
    conn::{self, RedisConn},
    error::{Error, Result},
    event::{ServerDead, ServerId},
    keys::Keys,
    metrics::Metrics,
    registry::Registry,
    status, stream,
    worker::Worker,
};
use tokio_util::sync::CancellationToken;

use crate::{cli::DemoOptions as Options, private::redis_for};
use verify::{check_evictions, verify};

/// What the demo found when it verified the registry.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub servers: usize,
    pub users_per_server: usize,
    pub dead: usize,
    /// Entries of dead servers that are gone, as they should be.
    pub deleted: u64,
    /// Users who moved to a live server and kept that entry.
    pub kept: u64,
    /// Of those, how many moved while the cleanup was running.
    pub moved_during: u64,
    /// Entries still pointing at a dead server (must be 0).
    pub stale: u64,
    /// Entries of live users that are missing or wrong (must be 0).
    pub lost: u64,
    /// Forward entries the workers say they deleted.
    pub reported_deleted: u64,
    /// `users.evicted` entries written, and the users in them (None: stream switched off).
    pub evicted: Option<(u64, u64)>,
    /// Of the users announced, those who reconnected after their eviction (their new
    /// entry counts as kept above).
    pub evicted_then_back: u64,
    /// Announcements that do not match the deletes: a deleted user not announced, one
    /// announced twice, or one announced whose entry was never deleted (must be 0).
    pub evicted_wrong: u64,
    /// Layout conns: user Hashes left, and the connections in them (None: another layout,
    /// or a cluster, where the demo does not scan them).
    pub user_hashes: Option<(u64, u64)>,
    /// From the first event published to the last one acknowledged.
    pub elapsed: Duration,
}

impl Summary {
    pub fn verified(&self) -> bool {
        self.stale == 0 && self.lost == 0 && self.evicted_wrong == 0
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total = self.deleted + self.kept;
        let secs = self.elapsed.as_secs_f64();
        writeln!(
            f,
            "registry-janitor demo: {}",
            if self.verified() {
                "verified"
            } else {
                "VERIFICATION FAILED"
            }
        )?;
        writeln!(
            f,
            "  registry       {} servers x {} users, {} dead ({} entries to resolve)",
            self.servers, self.users_per_server, self.dead, total
        )?;
        writeln!(
            f,
            "  deleted        {:>10}  entries that pointed at a dead server",
            self.deleted
        )?;
        writeln!(
            f,
            "  kept           {:>10}  users who had reconnected elsewhere ({} during the cleanup)",
            self.kept, self.moved_during
        )?;
        if let Some((entries, users)) = self.evicted {
            writeln!(
                f,
                "  evictions      {users:>10}  users announced in {entries} entries of the evictions stream \
                 (= deleted + {} who came back after their eviction; {} wrong, must be 0)",
                self.evicted_then_back, self.evicted_wrong
            )?;
        }
        if let Some((hashes, connections)) = self.user_hashes {
            writeln!(
                f,
                "  users          {hashes:>10}  user Hashes left (layout conns), {connections} connections, none naming a dead server"
            )?;
        }
        writeln!(f, "  stale left     {:>10}  (must be 0)", self.stale)?;
        writeln!(f, "  live lost      {:>10}  (must be 0)", self.lost)?;
        writeln!(
            f,
            "  time           {:>10.2} s  ({:.0} entries/s, events in to acks out)",
            secs,
            total as f64 / secs.max(1e-9)
        )
    }
}

/// Runs the demo and prints its progress and summary.
pub async fn run(settings: &Settings, options: &Options) -> Result<Summary> {
    if options.dead > options.servers || options.servers < 2 || options.dead == 0 {
        return Err(Error::Setting {
            name: "demo".into(),
            reason: "needs at least 2 servers and 1 to servers-1 dead ones".into(),
        });
    }
    let (mut settings, _private) = redis_for(
        settings,
        options
            .local_cluster
            .then_some(crate::private::ClusterShape::SMALL),
    )
    .await?;
    settings.key_prefix = format!("{}janitor-demo:{}:", settings.key_prefix, ulid::Ulid::new());
    let conn = conn::shared_for(&conn::target_for(&settings)?).await?;
    let keys = Keys::for_settings(&settings);
    eprintln!(
        "demo keys live under `{}` and are deleted at the end",
        keys.prefix()
    );

    let result = run_in(&settings, options, &conn, &keys).await;
    let removed = conn::delete_prefixed(&settings, &conn, keys.prefix()).await;
    let summary = result?;
    removed?;
    println!("{summary}");
    Ok(summary)
}

async fn run_in(
    settings: &Settings,
    options: &Options,
    conn: &RedisConn,
    keys: &Keys,
) -> Result<Summary> {
    let registry = Registry::new(keys.clone(), settings.layout);
    let epoch = registry_janitor::now_ms();
    let servers: Vec<ServerId> = (0..options.servers)
        .map(|i| ServerId::parse(&format!("demo-gw-{i}#{epoch}")).expect("valid id"))
        .collect();
    let (dead, live) = servers.split_at(options.dead);
    seed(&registry, conn, &servers, options.users).await?;

    let (movers, racing) = movers(options, settings.layout, dead, live);
    for (user, to) in &movers {
        registry.register(conn, user, to).await?;
    }

    let stop = CancellationToken::new();
    let mut workers = Vec::new();
    let mut metrics = Vec::new();
    for _ in 0..options.workers {
        let m = Metrics::new();
        metrics.push(m.clone());
        let w = Worker::new(settings, m).await?;
        workers.push(tokio::spawn(w.run(stop.child_token())));
    }
    let started = Instant::now();
    kill(conn, keys, dead).await?;
    let mover = {
        let (registry, conn) = (registry.clone(), conn.clone());
        tokio::spawn(async move {
            for (user, to) in &racing {
                registry.register(&conn, user, to).await?;
                tokio::task::yield_now().await;
            }
            Ok::<_, Error>(racing)
        })
    };
    wait_with_progress(conn, keys, dead, options.users as u64).await?;
    let elapsed = started.elapsed();
    let racing = mover.await??;
    stop.cancel();
    for w in workers {
        w.await??;
    }

    let moved: HashMap<Vec<u8>, ServerId> = movers.iter().chain(racing.iter()).cloned().collect();
    let mut summary = verify(&registry, conn, dead, live, options.users, &moved).await?;
    summary.moved_during = racing.len() as u64;
    summary.servers = options.servers;
    summary.users_per_server = options.users;
    summary.dead = options.dead;
    summary.elapsed = elapsed;
    summary.reported_deleted = metrics.iter().map(|m| m.entries_deleted.get()).sum();
    if registry.keys().evictions().is_some() {
        check_evictions(&mut summary, &registry, conn, dead, options.users, &moved).await?;
    }
    Ok(summary)
}

/// A moved user: who, and the live server they reconnected to.
type Mover = (Vec<u8>, ServerId);

/// Users of dead servers who reconnect elsewhere (`moved_percent` of each dead server's):
/// half before the events, half racing the cleanup (the second list).
fn movers(
    options: &Options,
    layout: Layout,
    dead: &[ServerId],
    live: &[ServerId],
) -> (Vec<Mover>, Vec<Mover>) {
    let mut rng = rand::rng();
    let share = ((options.users as f64 * options.moved_percent / 100.0).round() as usize)
        .min(options.users);
    let mut movers: Vec<Mover> = Vec::new();
    for server in dead {
        for n in rand::seq::index::sample(&mut rng, options.users, share) {
            let to = live[rng.random_range(0..live.len())].clone();
            movers.push((user_id(layout, server, n), to));
        }
    }
    movers.shuffle(&mut rng);
    let racing = movers.split_off(movers.len() / 2);
    (movers, racing)
}

/// The `dead` servers die: each one's liveness key runs out (here, at once), then
/// monitoring notices and publishes `server.dead`. A verdict for a server whose liveness
/// key stands would be disputed.
async fn kill(conn: &RedisConn, keys: &Keys, dead: &[ServerId]) -> Result<()> {
    for server in dead {
        let _: () = redis::cmd("DEL")
            .arg(keys.server_alive(server))
            .query_async(&mut conn.clone())
            .await?;
        let event = ServerDead::new(
            server,
            Some("demo: server killed".into()),
            Some("demo".into()),
        );
        stream::publish_event(conn, keys, &event.encode()).await?;
    }
    Ok(())
}

/// The `n`th seeded entry of `server`: the user `user-<server>-<n>`; in layout `conns`
/// the member of connection `c-<server>-<n>` of user `user-<n>-g<i/3>` (`i` the server's
/// number), so that three consecutive servers hold connections of the same users.
fn user_id(layout: Layout, server: &ServerId, n: usize) -> Vec<u8> {
    let short = server.as_str().split('#').next().unwrap_or("");
    if layout == Layout::Conns {
        let i: usize = short
            .rsplit('-')
            .next()
            .and_then(|i| i.parse().ok())
            .unwrap_or(0);
        let user = format!("user-{n}-g{}", i / 3);
        return registry_janitor::keys::conn_member(&format!("c-{short}-{n}"), user.as_bytes());
    }
    format!("user-{short}-{n}").into_bytes()
}

async fn seed(
    registry: &Registry,
    conn: &RedisConn,
    servers: &[ServerId],
    users: usize,
) -> Result<()> {
    let bar = bar((servers.len() * users) as u64, "seeding");
    for server in servers {
        registry.heartbeat(conn, server, 60_000).await?;
        for start in (0..users).step_by(10_000) {
            let ids: Vec<Vec<u8>> = (start..users.min(start + 10_000))
                .map(|n| user_id(registry.layout(), server, n))
                .collect();
            registry
                .register_many(conn, ids.iter().map(Vec::as_slice), server, 1000)
                .await?;
            bar.inc(ids.len() as u64);
        }
    }
    bar.finish();
    Ok(())
}

/// Shows cleanup progress until every event is acknowledged.
async fn wait_with_progress(
    conn: &RedisConn,
    keys: &Keys,
    dead: &[ServerId],
    users: u64,
) -> Result<()> {
    let total = users * dead.len() as u64;
    let bar = bar(total, "cleaning");
    // The progress record is the same in every layout.
    let cleaner = Cleaner::new(keys.clone(), Layout::Hash, 1, 1);
    loop {
        let mut done = 0;
        let mut all_clean = true;
        for server in dead {
            match cleaner.progress(conn, server).await? {
                Some(scanned) => {
                    done += scanned.min(users);
                    all_clean = false;
                }
                None => done += users,
            }
        }
        bar.set_position(done);
        if all_clean && status::collect_from(conn, keys).await?.is_idle() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bar.finish();
    Ok(())
}

fn bar(len: u64, what: &'static str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix:>9} [{bar:40}] {pos}/{len} entries {per_sec} {elapsed}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_prefix(what);
    bar
}
