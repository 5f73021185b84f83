//! What `route` and a plain HGET/GET return while a fenced server that still looks alive
//! is being cleaned: lookups started before and after the fence was recorded.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use rand::{rngs::StdRng, Rng, SeedableRng};
use registry_janitor::{
    conn::{self, RedisConn},
    error::Result,
};
use serde::Serialize;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::Lookup;
use crate::bench::{scene::Scene, Bench};

/// What one probe saw of the dead server's users who did not move, split at the moment
/// the fence was seen to exist (a lookup counts as after the verdict only if it was
/// *started* after an EXISTS of `server:{dead}:fenced` had answered 1, so Redis ran it
/// after the fence was recorded).
#[derive(Debug, Clone, Default, Serialize)]
pub struct StaleCount {
    pub lookups_before_verdict: u64,
    /// Of those, lookups that returned the dead server (all of them, normally: it looks
    /// alive, so even route returns it until the verdict).
    pub dead_before_verdict: u64,
    pub lookups_after_verdict: u64,
    /// Of those, lookups that returned the dead server: 0 for route, or the fence leaks.
    pub dead_after_verdict: u64,
}

impl StaleCount {
    fn add(&mut self, other: &StaleCount) {
        self.lookups_before_verdict += other.lookups_before_verdict;
        self.dead_before_verdict += other.dead_before_verdict;
        self.lookups_after_verdict += other.lookups_after_verdict;
        self.dead_after_verdict += other.dead_after_verdict;
    }
}

/// The stale window of janitor runs in which the dead server looks alive (its liveness
/// key set for an hour: a false positive or a zombie, which only the fence can hide).
/// Two probes run for the whole cleanup, one lookup per millisecond each, on users of the
/// dead server who did not move: `route` and a plain HGET/GET.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StaleWindow {
    /// Janitor runs summed here (one for a run's own figures).
    pub runs: usize,
    /// From the fence seen to the probes stopped (the event acknowledged), summed.
    pub after_verdict_seconds: f64,
    pub route: StaleCount,
    pub plain: StaleCount,
}

impl StaleWindow {
    /// The sum of several runs' windows.
    pub(in crate::bench) fn total<'a>(
        windows: impl IntoIterator<Item = &'a StaleWindow>,
    ) -> Option<Self> {
        let mut total: Option<StaleWindow> = None;
        for w in windows {
            let t = total.get_or_insert_with(StaleWindow::default);
            t.runs += w.runs;
            t.after_verdict_seconds += w.after_verdict_seconds;
            t.route.add(&w.route);
            t.plain.add(&w.plain);
        }
        total
    }
}

/// The probes of a [`StaleWindow`], started before the event is published.
pub(in crate::bench) struct StaleProbes {
    stop: CancellationToken,
    /// When [`StaleProbes::stop`] was first called.
    stopped: std::sync::OnceLock<Instant>,
    watcher: JoinHandle<Result<Option<Instant>>>,
    route: JoinHandle<Result<StaleCount>>,
    plain: JoinHandle<Result<StaleCount>>,
}

impl StaleProbes {
    /// Makes the scene's dead server look alive, then starts the fence watcher and both
    /// probes, each on a connection of its own; returns once each probe has done its
    /// first lookup (so each has at least one before the event is published).
    pub(in crate::bench) async fn start(b: &Bench<'_>, scene: &Scene) -> Result<Self> {
        scene
            .registry
            .heartbeat(b.conn, &scene.dead, 3_600_000)
            .await?;
        let target = conn::target_for(b.settings)?;
        let stop = CancellationToken::new();
        let seen = Arc::new(AtomicBool::new(false));
        let watcher = {
            let c = conn::shared_for(&target).await?;
            let fence = scene.keys.server_fence(&scene.dead);
            let (stop, seen) = (stop.clone(), seen.clone());
            tokio::spawn(async move {
                while !stop.is_cancelled() {
                    let fenced: bool = redis::cmd("EXISTS")
                        .arg(&fence)
                        .query_async(&mut c.clone())
                        .await?;
                    if fenced {
                        seen.store(true, Ordering::SeqCst);
                        return Ok(Some(Instant::now()));
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Ok(None)
            })
        };
        let mut started = Vec::new();
        let mut probe = |lookup: Lookup, seed: u64| -> Result<JoinHandle<Result<StaleCount>>> {
            let target = conn::target_for(b.settings)?;
            let (scene, stop, seen) = (scene.clone(), stop.clone(), seen.clone());
            let (first, first_done) = tokio::sync::oneshot::channel();
            started.push(first_done);
            Ok(tokio::spawn(async move {
                let c = conn::shared_for(&target).await?;
                stale_probe(&c, &scene, lookup, seed, &seen, &stop, first).await
            }))
        };
        let route = probe(Lookup::Route, 1)?;
        let plain = probe(Lookup::Plain, 2)?;
        for first_done in started {
            // An error instead (the probe failed) is returned by `finish`.
            let _ = first_done.await;
        }
        Ok(StaleProbes {
            stop,
            stopped: std::sync::OnceLock::new(),
            watcher,
            route,
            plain,
        })
    }

    /// Stops the probes (call it as soon as the event is acknowledged).
    pub(in crate::bench) fn stop(&self) {
        self.stopped.get_or_init(Instant::now);
        self.stop.cancel();
    }

    /// Stops the probes if not yet done, and waits for them.
    pub(in crate::bench) async fn finish(self) -> Result<StaleWindow> {
        self.stop();
        let stopped = *self.stopped.get().expect("set by stop");
        let seen = self.watcher.await??;
        let route = self.route.await??;
        let plain = self.plain.await??;
        Ok(StaleWindow {
            runs: 1,
            after_verdict_seconds: seen
                .map_or(0.0, |t| stopped.saturating_duration_since(t).as_secs_f64()),
            route,
            plain,
        })
    }
}

/// One lookup per millisecond of a random user of the dead server who did not move,
/// until stopped; `first` is told when the first lookup is done.
async fn stale_probe(
    c: &RedisConn,
    scene: &Scene,
    lookup: Lookup,
    seed: u64,
    seen: &AtomicBool,
    stop: &CancellationToken,
    first: tokio::sync::oneshot::Sender<()>,
) -> Result<StaleCount> {
    let mut first = Some(first);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut count = StaleCount::default();
    while !stop.is_cancelled() {
        tick.tick().await;
        let Some(n) = scene.unmoved_near(rng.random_range(0..scene.users.max(1))) else {
            break; // every user moved: nothing to probe
        };
        let after = seen.load(Ordering::SeqCst);
        let owner = lookup
            .owner(&scene.registry, c, &scene.dead_user(n))
            .await?;
        let dead = u64::from(owner.as_deref() == Some(scene.dead.as_str()));
        if after {
            count.lookups_after_verdict += 1;
            count.dead_after_verdict += dead;
        } else {
            count.lookups_before_verdict += 1;
            count.dead_before_verdict += dead;
        }
        if let Some(first) = first.take() {
            let _ = first.send(());
        }
    }
    Ok(count)
}
