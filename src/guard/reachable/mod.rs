//! Reachable time: Redis's own absence is never a server's silence.
//!
//! A server is declared dead when its liveness key is gone and its last heartbeat is older
//! than `heartbeat_grace_ms`. While nobody can reach Redis (down, restarting, loading a
//! large RDB, failing over, paused, refusing writes), no server can heartbeat either: its
//! liveness key expires and its score ages, and the first pass after Redis comes back
//! would take the whole fleet for dead. So a server counts as silent past the grace only
//! if
//!
//! ```text
//! now - max(last_heartbeat(S), reachable_since) >= heartbeat_grace_ms
//! ```
//!
//! where `reachable_since` is the start of the current stretch of time during which Redis
//! has been continuously reachable and stable. The condition splits in two: the
//! heartbeat's age (the score against Redis's TIME, see [`crate::clock`]), and the
//! reachable time, measured on **Redis's clock** alone
//! (`reachable_since` and "now" both come from TIME), so that no skew between the
//! reconciler and Redis can shorten it. While the reachable time is shorter than the
//! grace, verdicts on silent servers wait ([`Hold::Waiting`]); fenced servers stay dead.
//!
//! `reachable_since` moves to "now" when:
//! - **failed calls**: any call of the reconciler fails in a way that means Redis is away
//!   or not serving (refused, reset, timed out, LOADING, BUSY, MASTERDOWN, TRYAGAIN,
//!   CLUSTERDOWN, READONLY, OOM...: the transient errors of [`crate::error`], less those
//!   that only mean "ask elsewhere or again": MOVED, ASK, NOSCRIPT, UNBLOCKED), or an
//!   observation takes longer than [`Reachable::step`] to answer. On a cluster, each
//!   observation also runs a write probe on every master (`write_probe.lua`), which a
//!   master refuses (OOM, MISCONF, NOREPLICAS) or holds (CLIENT PAUSE WRITE) whenever it
//!   would refuse or hold a heartbeat: such a master still answers reads, while the
//!   servers whose `{S}` slot it serves cannot heartbeat. The first successful
//!   observation after that starts the new stretch;
//! - **restart**: the run_ids of Redis (every master of a cluster; behind Sentinel, the
//!   primary) differ from those recorded in `janitor:{guard}:reachable` or seen last by
//!   this process (a restart, or a failover: a promoted replica has another run_id). The
//!   record lives
//!   in Redis, so every reconciler replica and every `reconcile --once` shares it, and a
//!   restart that reloads it from an RDB or AOF still shows the old run_id. With no
//!   record at all (a first run ever), a Redis that loaded data from disk at start
//!   (`rdb_last_load_keys_loaded` > 0, or AOF on: Redis 7.0 reports no count of keys
//!   loaded from an AOF) and is younger than the grace counts from its start;
//! - **clock jump**: between two observations of this process, Redis's TIME (or the
//!   reconciler's own wall clock) advanced more than the monotonic clock could account
//!   for, plus the tracker's `tolerance_ms`: a step forward makes every score look old
//!   (and expires liveness keys early). A step between two observations is caught by the
//!   verdict itself: the script that checks a server reads TIME and refuses to judge when
//!   it is past [`Reachable::time_bound_ms`] (the last observation's TIME plus the
//!   monotonic time since, plus the tolerance); the reconciler then calls
//!   [`Reachable::verdict_past_bound`]. On a cluster, TIME is read on the master of
//!   `servers`' slot, whose clock the scores are judged by;
//! - **stall**: while [`Reachable::watch`] runs, the time from the end of one attempt to
//!   observe to the start of the next is longer than a step plus the bound's slack. This
//!   process did not run meanwhile (its host paused, or starved it), so it cannot tell
//!   that Redis stayed reachable; and a host paused whole (a virtual machine, a machine
//!   that runs Redis, the connection servers and the reconciler together) stops the
//!   heartbeats too, without a failed call, a slow reply or a clock step to show it.
//!   A stall after the last observation is caught by the verdict: while the watch runs,
//!   [`Reachable::time_bound_ms`] counts monotonic time only up to when the watch was due
//!   to look again. A stall holds this process's verdicts only (it is not stored in the
//!   shared record): a replica that did not stall saw for itself whether Redis answered.
//!   `reconcile --once` runs no watch: its observations are as far apart as its work
//!   puts them.
//!
//! `reachable_since` is also stored in `janitor:{guard}:reachable` (the greatest known
//! value wins), so an outage that one replica saw holds the verdicts of all of them (a
//! stall excepted, as said above).
//!
//! The cost: after any outage, a server that really died is found up to one grace later.

use std::{
    collections::HashMap,
    sync::{atomic::AtomicBool, Mutex},
    time::{Duration, Instant},
};

use tracing::{info, warn};

use crate::{
    config::Settings,
    conn::RedisConn,
    error::{Error, Result},
    metrics::Metrics,
};

mod observation;

pub use observation::recorded_since;
mod tracker;

use tracker::CONNECTING_MS;
pub use tracker::{Cause, Hold, Record, Seen, Tracker};

/// True for an error that means Redis is away or not serving (see the module docs).
pub fn is_outage(e: &Error) -> bool {
    let Error::Redis(r) = e else {
        return false;
    };
    if !crate::error::redis_error_is_retryable(r) {
        return false;
    }
    !matches!(r.code(), Some("MOVED" | "ASK" | "NOSCRIPT" | "UNBLOCKED"))
}

/// The reconciler's reachable-time guard: a [`Tracker`] fed by observations of Redis
/// (TIME, INFO, `janitor:{guard}:reachable`) and by the reconciler's failed calls.
pub struct Reachable {
    grace_ms: u64,
    /// How often the running reconciler observes Redis, and how long an observation may
    /// take before Redis counts as not answering.
    step: Duration,
    /// `janitor:{guard}:reachable` under the key prefix.
    key: String,
    /// For clients of the cluster's masters.
    settings: Settings,
    metrics: Metrics,
    /// Zero of the monotonic clock the tracker is given.
    started: Instant,
    tracker: Mutex<Tracker>,
    /// One observation at a time; those who waited find it fresh.
    observing: tokio::sync::Mutex<()>,
    /// A cluster's masters, by address, kept between observations.
    nodes: Mutex<HashMap<(String, u16), RedisConn>>,
    /// INFO was refused once (logged once): run_ids are unknown.
    info_refused: AtomicBool,
    /// The write probe was refused once (logged once).
    probe_refused: AtomicBool,
    /// `janitor:{guard}:reachable` was refused once (logged once): the record is this process's.
    record_refused: AtomicBool,
    /// The outage in progress (failed calls): when it began, on the monotonic clock (it
    /// was logged then), and what observations found meanwhile. Its end is logged once,
    /// with its duration and those findings, by the first observation that succeeds with
    /// no call failed since it was sent.
    outage: Mutex<Option<(Instant, Vec<&'static str>)>>,
}

impl Reachable {
    pub fn new(settings: &Settings, metrics: Metrics) -> Self {
        let grace_ms = settings.heartbeat_grace_ms;
        let step = Duration::from_millis((grace_ms / 4).clamp(250, 1000));
        Reachable {
            grace_ms,
            step,
            key: crate::keys::Keys::for_settings(settings).guard_reachable(),
            settings: settings.clone(),
            metrics,
            started: Instant::now(),
            tracker: Mutex::new(Tracker::new(grace_ms, step.as_millis() as u64)),
            observing: tokio::sync::Mutex::new(()),
            nodes: Mutex::default(),
            info_refused: AtomicBool::new(false),
            probe_refused: AtomicBool::new(false),
            record_refused: AtomicBool::new(false),
            outage: Mutex::new(None),
        }
    }

    /// A quarter of the grace, between 250 ms and 1 s: how often [`Reachable::watch`]
    /// observes, the longest an observation may take, and the oldest observation a
    /// verdict relies on. A pause of Redis longer than two steps is always seen, and a
    /// pause shorter than that cannot age a live server past the grace unless its
    /// heartbeat interval exceeds half the grace.
    pub fn step(&self) -> Duration {
        self.step
    }

    fn mono_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn tracker(&self) -> std::sync::MutexGuard<'_, Tracker> {
        self.tracker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A call of the reconciler failed: an outage if the error says Redis is away.
    pub fn failed(&self, e: &Error) {
        if is_outage(e) {
            self.note_failure(&e.to_string());
        }
    }

    /// Redis is away or not answering (`why`). Logged once per outage: at the first
    /// failure since the last successful observation.
    pub fn note_failure(&self, why: &str) {
        if self.tracker().failed() {
            self.outage
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert_with(|| (Instant::now(), Vec::new()));
            self.metrics
                .reconcile_outages
                .with_label_values(&[Cause::FailedCalls.label()])
                .inc();
            self.metrics.reconcile_reachable_seconds.set(0.0);
            warn!(
                cause = Cause::FailedCalls.label(),
                error = %why,
                grace_ms = self.grace_ms,
                "Redis outage: verdicts on silent servers wait until Redis has been reachable for a full grace"
            );
        }
    }

    /// May verdicts on silent servers be taken now? Observes Redis first if the last
    /// observation is older than [`Reachable::step`] or a call failed since.
    pub async fn hold(&self, conn: &RedisConn) -> Result<Hold> {
        let stale = {
            let t = self.tracker();
            t.must_observe() || t.age_ms(self.mono_ms()).is_none_or(|a| a > self.step_ms())
        };
        if stale {
            self.observe(conn).await?;
        }
        Ok(self.current())
    }

    /// The latest Redis time (unix ms) a verdict may read now, if Redis's clock has not
    /// stepped forward since the last observation ([`Tracker::redis_time_bound`]). A
    /// verdict that reads a later TIME in the same script as its checks refuses to
    /// judge, and calls [`Reachable::verdict_past_bound`]: a step of Redis's clock between
    /// two observations ages every score and expires liveness keys early, and the next
    /// observation would see it too late for a verdict already taken.
    pub fn time_bound_ms(&self) -> Option<u64> {
        self.tracker().redis_time_bound(self.mono_ms())
    }

    /// Whether `redis_ms`, read by a verdict that was given `bound` (taken before it was
    /// sent), is past it; if so, [`Reachable::verdict_past_bound`] is noted.
    pub fn past_bound(&self, bound: Option<u64>, redis_ms: u64) -> bool {
        let past = bound.is_some_and(|b| redis_ms > b);
        if past {
            self.verdict_past_bound(redis_ms);
        }
        past
    }

    /// Whether a verdict taken in several round trips, perhaps on several masters of a
    /// cluster, took longer than the slack of [`Reachable::time_bound_ms`] from the moment
    /// its bound was taken to its last reply (`took`); if so, the verdict is noted as past
    /// its bound (cause `failed_calls`: Redis took too long). A verdict that reads TIME in
    /// one script learns a stall from Redis's own clock; one made of steps on several
    /// nodes cannot compare their clocks, so it times itself on the monotonic clock: a
    /// master that stalled during any step (so that a live server's liveness key expired
    /// meanwhile, its heartbeats blocked) makes it longer than that.
    pub fn took_too_long(&self, took: Duration) -> bool {
        let slack = self.tracker().bound_slack_ms();
        let late = took.as_millis() as u64 > slack;
        if late {
            self.verdict_held(
                Cause::FailedCalls,
                &format!(
                    "Redis took {} ms to answer it, more than its slack of {slack} ms",
                    took.as_millis()
                ),
            );
        }
        late
    }

    /// A verdict read Redis's time `redis_ms`, past the bound it was given
    /// ([`Reachable::time_bound_ms`], taken before it was sent). Verdicts on silent
    /// servers wait until the next observation starts a new stretch of reachable time, a
    /// full grace. Past the bound taken now, after the reply, Redis's clock stepped
    /// forward (cause `clock_jump`); within it, the verdict waited in Redis's queue longer
    /// than the tolerance, which cannot be told from a step (cause `failed_calls`, as a
    /// slow answer).
    ///
    /// While the watch runs, the bound counts monotonic time only up to when the watch was
    /// due to look again: a verdict past it, whose TIME is within the bound without that
    /// limit, while the watch is overdue now and no call has failed since its last
    /// observation, comes after a stall of this process (cause `stall`; held by this
    /// process alone, as the watch's own stalls are).
    pub fn verdict_past_bound(&self, redis_ms: u64) {
        let mono = self.mono_ms();
        let (stepped, overdue) = {
            let t = self.tracker();
            let stepped = t
                .redis_time_bound_unwatched(mono)
                .is_none_or(|now| redis_ms > now);
            // Not while calls fail: the watch ran, and the outage it saw explains the late
            // TIME (the verdict waited in a paused Redis's queue).
            (stepped, t.watch_overdue(mono))
        };
        let (cause, what) = if stepped {
            (Cause::ClockJump, "Redis's clock stepped forward")
        } else if overdue {
            (
                Cause::Stall,
                "the reconciler did not run when its watch was due",
            )
        } else {
            (Cause::FailedCalls, "Redis took too long to run it")
        };
        self.verdict_held(cause, &format!("{what}: Redis time {redis_ms} ms"));
    }

    /// A verdict found an outage (`cause`, `what`): counted, and logged once per outage.
    fn verdict_held(&self, cause: Cause, what: &str) {
        let first = match cause {
            Cause::Stall => self.tracker().stalled(),
            _ => self.tracker().failed(),
        };
        self.metrics
            .reconcile_outages
            .with_label_values(&[cause.label()])
            .inc();
        self.metrics.reconcile_reachable_seconds.set(0.0);
        if first {
            warn!(
                cause = cause.label(),
                grace_ms = self.grace_ms,
                "Redis outage ({what}, seen by a verdict): verdicts on silent servers wait until Redis has been reachable for a full grace"
            );
        }
    }

    /// The hold as of the last observation, without observing.
    pub fn current(&self) -> Hold {
        let now = self.mono_ms();
        let (hold, resumed, reachable_for) = {
            let mut t = self.tracker();
            (t.hold(now), t.resumed(now), t.reachable_for_ms(now))
        };
        self.metrics
            .reconcile_reachable_seconds
            .set(reachable_for as f64 / 1000.0);
        if resumed {
            info!(
                grace_ms = self.grace_ms,
                "Redis has been reachable for a full grace since its last outage: verdicts on silent servers resume"
            );
        }
        hold
    }

    fn step_ms(&self) -> u64 {
        self.step.as_millis() as u64
    }

    /// Observes Redis now: TIME, the run_ids, the shared record; stores the record if it
    /// changes. A failure that means an outage is noted.
    pub async fn observe(&self, conn: &RedisConn) -> Result<()> {
        let _one = self.observing.lock().await;
        let failures_before = self.tracker().failures();
        let seen = match self.read(conn).await {
            Ok(seen) => seen,
            Err(e) => {
                self.tracker().attempt_ended(self.mono_ms());
                self.failed(&e);
                return Err(e);
            }
        };
        let (redis_ms, run_ids) = (seen.redis_ms, seen.run_ids.clone());
        let (out, failed_since_sent) = {
            let mut t = self.tracker();
            let out = t.observed(seen, failures_before);
            (out, t.failures() != failures_before)
        };
        // What this observation found, each counted under its cause and logged once
        // together: as the start of an outage, or, when it ends one that failed calls
        // began (logged then), in the line that says so.
        let mut found = Vec::new();
        let mut report = |cause: Cause, what: &'static str| {
            self.metrics
                .reconcile_outages
                .with_label_values(&[cause.label()])
                .inc();
            found.push((cause.label(), what));
        };
        if out.slow {
            report(Cause::FailedCalls, "Redis took too long to answer");
        }
        if out.restart {
            report(
                Cause::Restart,
                "another run_id: Redis restarted or failed over",
            );
        }
        if out.started_recently {
            report(
                Cause::Restart,
                "Redis started less than a grace ago with data from disk",
            );
        }
        if out.clock_jump {
            report(Cause::ClockJump, "a clock stepped forward");
        }
        if let Some(gap_ms) = out.stalled_ms {
            warn!(
                gap_ms,
                limit_ms = self.step_ms() + self.tracker().bound_slack_ms(),
                "the reconciler did not run for {gap_ms} ms: its host paused or starved it, and the connection servers may have been stopped with it"
            );
            report(
                Cause::Stall,
                "the reconciler itself did not run for longer than its watch allows",
            );
        }
        let ended = {
            let mut outage = self.outage.lock().unwrap_or_else(|e| e.into_inner());
            match outage.as_mut() {
                Some((_, seen)) => {
                    for (_, what) in &found {
                        if !seen.contains(what) {
                            seen.push(what);
                        }
                    }
                    found.clear();
                    if failed_since_sent {
                        None
                    } else {
                        outage.take()
                    }
                }
                None => None,
            }
        };
        let causes = found.iter().map(|(c, _)| *c).collect::<Vec<_>>().join(",");
        let what = found.iter().map(|(_, w)| *w).collect::<Vec<_>>().join("; ");
        if let Some((began, seen)) = ended {
            let outage_ms = began.elapsed().as_millis() as u64;
            info!(
                outage_ms,
                also = %seen.join("; "),
                grace_ms = self.grace_ms,
                "Redis reachable again after an outage of {:.1} s: verdicts on silent servers wait until it has been reachable for a full grace",
                outage_ms as f64 / 1000.0
            );
        } else if !found.is_empty() {
            warn!(
                cause = %causes,
                redis_time_ms = redis_ms,
                run_ids = run_ids.as_deref().unwrap_or("unknown"),
                grace_ms = self.grace_ms,
                "Redis outage ({what}): verdicts on silent servers wait until Redis has been reachable for a full grace"
            );
        }
        if out.adopted {
            info!(
                reachable_since_ms = self.tracker().reachable_since_ms(),
                "another reconciler recorded a Redis outage: verdicts on silent servers wait for its grace"
            );
        }
        if let Some(record) = out.store {
            self.store(conn, &record).await?;
        }
        // The attempt ends once its record is stored: the watch's next one is a step
        // after this.
        self.tracker().attempt_ended(self.mono_ms());
        self.current();
        Ok(())
    }

    /// Runs [`Reachable::observe`] every [`Reachable::step`] until `stop`; an observation
    /// that takes longer than a step counts as an outage. Between passes this is what
    /// sees a Redis that does not answer (a pause), which no other call may meet. While
    /// it runs, a gap between two observations longer than a step plus the slack of
    /// [`Reachable::time_bound_ms`] is an outage too (cause `stall`): this process did
    /// not run meanwhile, so it cannot tell that Redis, and the servers, did.
    pub async fn watch(&self, conn: RedisConn, stop: tokio_util::sync::CancellationToken) {
        self.tracker().watching(self.step_ms());
        loop {
            let limit = match self.tracker().last {
                Some(_) => self.step,
                None => self.step + Duration::from_millis(CONNECTING_MS),
            };
            let observed = tokio::select! {
                r = tokio::time::timeout(limit, self.observe(&conn)) => r,
                _ = stop.cancelled() => return,
            };
            if observed.is_err() {
                self.tracker().attempt_ended(self.mono_ms());
                self.note_failure(&format!(
                    "no answer to TIME and INFO within {} ms",
                    limit.as_millis()
                ));
            }
            tokio::select! {
                _ = tokio::time::sleep(self.step) => {}
                _ = stop.cancelled() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{observation::NodeInfo, *};

    const GRACE: u64 = 2000;

    /// An observation at Redis time `redis_ms`, sent at monotonic `mono_ms` and answered
    /// 5 ms later; the local clock agrees with Redis's.
    fn seen(redis_ms: u64, mono_ms: u64, run_id: &str, record: Option<Record>) -> Seen {
        Seen {
            redis_ms,
            sent_mono_ms: mono_ms,
            received_mono_ms: mono_ms + 5,
            local_ms: redis_ms,
            run_ids: Some(run_id.into()),
            uptime_ms: Some(3_600_000),
            loaded_from_disk: false,
            record,
        }
    }

    fn record(run_id: &str, since: u64) -> Option<Record> {
        Some(Record {
            run_ids: Some(run_id.into()),
            reachable_since_ms: since,
        })
    }

    const T0: u64 = 1_800_000_000_000;

    #[test]
    fn a_fresh_redis_without_a_record_holds_nothing() {
        let mut t = Tracker::new(GRACE, 500);
        assert_eq!(t.hold(0), Hold::Unreachable, "nothing observed yet");
        let out = t.observed(seen(T0, 0, "a", None), 0);
        assert_eq!(t.hold(10), Hold::Ready);
        assert_eq!(out.store, record("a", 0), "the run_id is recorded");
        assert!(!out.restart && !out.started_recently);
    }

    #[test]
    fn failed_calls_hold_verdicts_for_a_grace_after_the_first_success() {
        let mut t = Tracker::new(GRACE, 500);
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        assert!(t.failed(), "the first failure starts an outage");
        assert!(!t.failed(), "the next ones are the same outage");
        assert_eq!(t.hold(100), Hold::Unreachable);
        // Redis answers again 5 s later.
        let before = t.failures();
        let out = t.observed(seen(T0 + 5000, 5000, "a", record("a", 0)), before);
        assert!(out.after_failures);
        assert_eq!(t.reachable_since_ms(), T0 + 5000);
        assert_eq!(t.hold(5005 + 1500), Hold::Waiting { remaining_ms: 500 });
        assert_eq!(t.hold(5005 + 2000), Hold::Ready);
        assert_eq!(out.store, record("a", T0 + 5000), "shared with the others");
    }

    #[test]
    fn a_failure_during_an_observation_keeps_the_hold() {
        let mut t = Tracker::new(GRACE, 500);
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        let before = t.failures();
        t.failed(); // while the observation was on its way
        t.observed(seen(T0 + 100, 100, "a", record("a", 0)), before);
        assert_eq!(t.hold(200), Hold::Unreachable);
    }

    #[test]
    fn another_run_id_is_a_restart_or_a_failover() {
        let mut t = Tracker::new(GRACE, 500);
        // Recorded by another reconciler before a restart that reloaded the record.
        let out = t.observed(seen(T0, 0, "b", record("a", 0)), 0);
        assert!(out.restart);
        assert_eq!(t.hold(1000), Hold::Waiting { remaining_ms: 1005 });
        assert_eq!(out.store, record("b", T0));
        // Seen by this process: the record already updated by another replica.
        let mut t = Tracker::new(GRACE, 500);
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        let out = t.observed(seen(T0 + 1000, 1000, "b", record("b", T0 + 900)), 0);
        assert!(out.restart);
        assert_eq!(t.reachable_since_ms(), T0 + 1000);
    }

    #[test]
    fn an_outage_another_reconciler_recorded_holds_this_one_too() {
        let mut t = Tracker::new(GRACE, 500);
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        let out = t.observed(seen(T0 + 1000, 1000, "a", record("a", T0 + 800)), 0);
        assert!(out.adopted && !out.restart);
        assert_eq!(t.hold(1005), Hold::Waiting { remaining_ms: 1800 });
        assert_eq!(out.store, None, "nothing to change");
    }

    #[test]
    fn a_first_run_on_a_redis_that_loaded_data_counts_from_its_start() {
        let mut t = Tracker::new(GRACE, 500);
        let mut s = seen(T0, 0, "a", None);
        s.loaded_from_disk = true;
        s.uptime_ms = Some(1000);
        let out = t.observed(s.clone(), 0);
        assert!(out.started_recently);
        assert_eq!(t.reachable_since_ms(), T0 - 1000);
        assert_eq!(t.hold(5), Hold::Waiting { remaining_ms: 1000 });
        // Up for longer than the grace: nothing to wait for.
        let mut t = Tracker::new(GRACE, 500);
        s.uptime_ms = Some(GRACE);
        t.observed(s.clone(), 0);
        assert_eq!(t.hold(5), Hold::Ready);
        // Nothing loaded (a fresh Redis): nothing to wait for.
        let mut t = Tracker::new(GRACE, 500);
        s.uptime_ms = Some(1000);
        s.loaded_from_disk = false;
        t.observed(s, 0);
        assert_eq!(t.hold(5), Hold::Ready);
    }

    #[test]
    fn a_step_of_redis_clock_is_a_clock_jump() {
        let mut t = Tracker::new(GRACE, 500);
        assert_eq!(t.tolerance_ms, 500);
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        // 1 s of monotonic time; Redis's clock moved 1 s + the tolerance + the round trip:
        // within the bound (from the first send to the second reply).
        let mut s = seen(T0 + 1000 + 500 + 5, 1000, "a", record("a", 0));
        s.local_ms = T0 + 1005;
        let out = t.observed(s, 0);
        assert!(!out.clock_jump, "{out:?}");
        assert_eq!(t.hold(1010), Hold::Ready);
        // Then 10 s at once, in 1 s of monotonic time.
        let mut s = seen(T0 + 12_505, 2000, "a", record("a", 0));
        s.local_ms = T0 + 2005;
        let out = t.observed(s, 0);
        assert!(out.clock_jump);
        assert_eq!(t.reachable_since_ms(), T0 + 12_505);
        assert_eq!(t.hold(2005 + 1000), Hold::Waiting { remaining_ms: 1000 });
        assert_eq!(t.hold(2005 + 2000), Hold::Ready);
    }

    #[test]
    fn a_step_of_the_reconcilers_own_clock_is_a_clock_jump() {
        let mut t = Tracker::new(GRACE, 500);
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        let mut s = seen(T0 + 1000, 1000, "a", record("a", 0));
        s.local_ms = T0 + 60_000;
        assert!(t.observed(s, 0).clock_jump);
    }

    #[test]
    fn a_first_observation_may_take_a_connection_longer() {
        let mut t = Tracker::new(GRACE, 500);
        let mut s = seen(T0, 0, "a", None);
        s.received_mono_ms = 1500;
        assert!(!t.observed(s, 0).slow);
        assert_eq!(t.hold(1500), Hold::Ready);
    }

    #[test]
    fn a_slow_reply_is_no_clock_jump_but_a_long_silence() {
        let mut t = Tracker::new(GRACE, 500);
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        // Redis paused 5 s while the observation waited: its clock moved with the
        // monotonic one, but it did not answer.
        let mut s = seen(T0 + 5000, 100, "a", record("a", 0));
        s.received_mono_ms = 5100;
        s.local_ms = T0 + 5100;
        let out = t.observed(s, 0);
        assert!(out.slow && !out.clock_jump, "{out:?}");
        assert_eq!(t.hold(5100), Hold::Waiting { remaining_ms: 2000 });
    }

    #[test]
    fn a_watch_that_did_not_run_is_a_stall() {
        let mut t = Tracker::new(GRACE, 500);
        t.watching(500);
        assert_eq!(t.watch_gap_ms, Some(1000), "a step plus the slack");
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        // The next attempt a step after the last ended, and a late one within the slack.
        let out = t.observed(seen(T0 + 505, 505, "a", record("a", 0)), 0);
        assert_eq!(out.stalled_ms, None);
        let out = t.observed(seen(T0 + 1510, 1510, "a", record("a", 0)), 0);
        assert_eq!(out.stalled_ms, None);
        assert_eq!(t.hold(1515), Hold::Ready);
        // Then 5 s without an attempt: the whole machine paused, Redis's clock and the
        // monotonic one moved together, and the reply is quick.
        let out = t.observed(seen(T0 + 6515, 6515, "a", record("a", 0)), 0);
        assert_eq!(out.stalled_ms, Some(5000));
        assert!(!out.clock_jump && !out.slow, "{out:?}");
        assert_eq!(t.hold(6520), Hold::Waiting { remaining_ms: 2000 });
        assert_eq!(t.reachable_for_ms(6520), 0);
        // This process's own: another replica that did not stall saw Redis answer, or
        // not, by itself.
        assert_eq!(t.reachable_since_ms(), 0);
        assert_eq!(out.store, None, "not shared");
        assert!(!t.resumed(7000));
        assert!(t.resumed(8520), "verdicts resume a grace later");
    }

    #[test]
    fn a_verdict_after_a_stall_since_the_last_observation_is_past_its_bound() {
        let mut t = Tracker::new(GRACE, 500);
        t.watching(500);
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        // Within the watch's step: the monotonic time since the observation counts.
        assert_eq!(t.redis_time_bound(500), Some(T0 + 500 + 500));
        // 5 s later, no observation since (the process was stopped right after its
        // reply): the bound counts only up to when the watch was due, so a verdict reading
        // Redis's TIME now is past it.
        assert_eq!(t.redis_time_bound(6000), Some(T0 + 1005 + 500));
        assert_eq!(t.redis_time_bound_unwatched(6000), Some(T0 + 6000 + 500));
        assert!(t.stalled(), "the first report");
        assert!(!t.stalled(), "the same stall");
        assert!(t.must_observe());
        assert_eq!(t.hold(6000), Hold::Unreachable);
        // The watch ran again just before (so the next observation is no stall of its
        // own): the pending stall alone starts the grace.
        t.attempt_ended(5990);
        let out = t.observed(seen(T0 + 6010, 6010, "a", record("a", 0)), 0);
        assert_eq!(out.stalled_ms, None);
        assert_eq!(out.store, None, "this process's own");
        assert!(!t.must_observe());
        assert_eq!(t.hold(6015), Hold::Waiting { remaining_ms: 2000 });
        // Without a watch (`reconcile --once`) the bound is not limited.
        let mut t = Tracker::new(GRACE, 500);
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        assert_eq!(t.redis_time_bound(6000), Some(T0 + 6000 + 500));
    }

    #[test]
    fn a_failed_attempt_is_no_stall_and_without_a_watch_nothing_is() {
        let mut t = Tracker::new(GRACE, 500);
        t.watching(500);
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        // Redis did not answer for 3 s: each attempt failed, a step apart.
        for at in [505, 1510, 2515] {
            t.failed();
            t.attempt_ended(at);
        }
        let before = t.failures();
        let out = t.observed(seen(T0 + 3020, 3020, "a", record("a", 0)), before);
        assert!(out.after_failures);
        assert_eq!(
            out.stalled_ms, None,
            "the watch ran: an outage, not a stall"
        );
        // `reconcile --once` runs no watch: its observations may be far apart.
        let mut t = Tracker::new(GRACE, 500);
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        let out = t.observed(seen(T0 + 9000, 9000, "a", record("a", 0)), 0);
        assert_eq!(out.stalled_ms, None);
        assert_eq!(t.hold(9005), Hold::Ready);
    }

    #[test]
    fn a_clock_stepped_back_waits_a_grace_from_now_not_from_the_future() {
        let mut t = Tracker::new(GRACE, 500);
        // The record says an outage at T0 + 1 h: Redis's clock has since gone back.
        let out = t.observed(seen(T0, 0, "a", record("a", T0 + 3_600_000)), 0);
        assert_eq!(t.hold(5), Hold::Waiting { remaining_ms: 2000 });
        assert_eq!(t.hold(2005), Hold::Ready, "not an hour");
        assert_eq!(out.store, record("a", T0), "the record is set back to now");
    }

    #[test]
    fn the_outage_is_over_once_announced_and_its_grace_passed() {
        let mut t = Tracker::new(GRACE, 500);
        t.observed(seen(T0, 0, "a", record("a", 0)), 0);
        assert!(!t.resumed(10));
        t.failed();
        let before = t.failures();
        t.observed(seen(T0 + 1000, 1000, "a", record("a", 0)), before);
        assert!(!t.resumed(2000));
        assert!(t.resumed(3005));
        assert!(!t.resumed(4000), "once");
    }

    #[test]
    fn info_gives_the_run_id_uptime_and_loads() {
        let server = "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\nuptime_in_seconds:7\r\n";
        let rdb = "# Persistence\r\nloading:0\r\nrdb_last_load_keys_loaded:12\r\naof_enabled:0\r\n";
        let fresh =
            "# Persistence\r\nloading:0\r\nrdb_last_load_keys_loaded:0\r\naof_enabled:0\r\n";
        let aof = "# Persistence\r\nrdb_last_load_keys_loaded:0\r\naof_enabled:1\r\n";
        let info = NodeInfo::parse(server, rdb);
        assert_eq!(info.run_id.as_deref(), Some("abc123"));
        assert_eq!(info.uptime_ms, Some(7000));
        assert!(info.loaded_from_disk);
        assert!(!NodeInfo::parse(server, fresh).loaded_from_disk);
        assert!(NodeInfo::parse(server, aof).loaded_from_disk);
        assert_eq!(NodeInfo::parse("", "").run_id, None);
    }

    #[test]
    fn only_errors_of_an_absent_redis_are_outages() {
        let reply = |line: &str| {
            Error::Redis(
                redis::parse_redis_value(format!("-{line}\r\n").as_bytes())
                    .unwrap()
                    .extract_error()
                    .unwrap_err(),
            )
        };
        for outage in [
            "LOADING Redis is loading the dataset in memory",
            "BUSY Redis is busy running a script.",
            "MASTERDOWN Link with MASTER is down",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "CLUSTERDOWN The cluster is down",
            "READONLY You can't write against a read only replica.",
        ] {
            assert!(is_outage(&reply(outage)), "{outage}");
        }
        let refused: redis::RedisError =
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        assert!(is_outage(&Error::Redis(refused)));
        for not in [
            "MOVED 3999 127.0.0.1:6381",
            "NOSCRIPT No matching script.",
            "WRONGTYPE Operation against a key holding the wrong kind of value",
        ] {
            assert!(!is_outage(&reply(not)), "{not}");
        }
        assert!(!is_outage(&Error::Cancelled));
    }
}
