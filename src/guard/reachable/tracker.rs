//! The reachable-time tracker: what the observations of Redis (and the failed calls)
//! say about since when Redis has been reachable, with no I/O of its own (see the
//! parent module).

use crate::metrics::outage_cause;

/// What a process's first observation may take on top of [`super::Reachable::step`]: it opens
/// the connection (the connect timeout is 2 s).
pub(super) const CONNECTING_MS: u64 = 2000;

/// What an observation found that starts a new stretch of reachable time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// A call failed, or Redis took too long to answer.
    FailedCalls,
    /// Redis restarted or failed over (another run_id), or started recently from disk.
    Restart,
    /// Redis's clock (or the reconciler's) stepped forward.
    ClockJump,
    /// The reconciler itself did not run for longer than its watch allows (its host
    /// paused or starved): nobody watched Redis meanwhile.
    Stall,
}

impl Cause {
    /// Its label value of `registry_janitor_reconcile_outages_total`.
    pub fn label(self) -> &'static str {
        match self {
            Cause::FailedCalls => outage_cause::FAILED_CALLS,
            Cause::Restart => outage_cause::RESTART,
            Cause::ClockJump => outage_cause::CLOCK_JUMP,
            Cause::Stall => outage_cause::STALL,
        }
    }
}

/// What `janitor:{guard}:reachable` holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    /// The run_ids of Redis when a reconciler last looked (sorted, comma-separated; every
    /// master of a cluster). `None` where INFO gives none.
    pub run_ids: Option<String>,
    /// Redis time (unix ms) at which the current stretch of reachable time began; 0 for
    /// none known.
    pub reachable_since_ms: u64,
}

/// One successful observation of Redis.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    /// Redis's TIME (unix ms); on a cluster, that of the master of `servers`' slot, the
    /// clock the heartbeats' scores are judged by.
    pub redis_ms: u64,
    /// This process's monotonic clock (ms) when the observation was sent...
    pub sent_mono_ms: u64,
    /// ...and when its last reply came back.
    pub received_mono_ms: u64,
    /// This process's wall clock (unix ms) when the reply came back.
    pub local_ms: u64,
    /// Sorted, comma-separated run_ids (every master of a cluster); `None` where INFO is
    /// refused or names none.
    pub run_ids: Option<String>,
    /// The shortest uptime among the nodes (ms), if INFO gave one.
    pub uptime_ms: Option<u64>,
    /// Some node loaded data from disk when it started.
    pub loaded_from_disk: bool,
    /// `janitor:{guard}:reachable` as read; `None` when it does not exist.
    pub record: Option<Record>,
}

/// What one observation changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Failed calls (already reported by [`Tracker::failed`]) ended with this observation.
    pub after_failures: bool,
    /// The observation itself took longer than the step to answer.
    pub slow: bool,
    pub restart: bool,
    pub clock_jump: bool,
    /// The watch had not observed Redis for longer than it allows (this many ms since
    /// its previous attempt ended): the reconciler did not run meanwhile.
    pub stalled_ms: Option<u64>,
    /// No record, and Redis started recently with data from disk.
    pub started_recently: bool,
    /// The record's `reachable_since_ms` (another reconciler's) is later than this
    /// process's.
    pub adopted: bool,
    /// What to store in `janitor:{guard}:reachable`, if it differs.
    pub store: Option<Record>,
}

/// May verdicts on silent (not fenced) servers be taken now?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Redis has been reachable for a full grace.
    Ready,
    /// Reachable, but not for a full grace yet: this much longer.
    Waiting { remaining_ms: u64 },
    /// A call failed and no observation has succeeded since (or none ever did).
    Unreachable,
}

impl Hold {
    pub fn is_ready(self) -> bool {
        self == Hold::Ready
    }

    /// How long verdicts still wait at least (the grace while unreachable).
    pub fn remaining_ms(self, grace_ms: u64) -> u64 {
        match self {
            Hold::Ready => 0,
            Hold::Waiting { remaining_ms } => remaining_ms,
            Hold::Unreachable => grace_ms,
        }
    }
}

/// The least slack of [`Tracker::redis_time_bound`] whatever the grace: the clocks are
/// read in whole milliseconds and a script waits its turn in Redis's queue, so a bound
/// without slack (a grace of a few ms) would hold every verdict.
const BOUND_SLACK_FLOOR_MS: u64 = 250;

/// The reachable-time state machine, without I/O: every time is given to it, so that
/// the tests can move clocks.
#[derive(Debug)]
pub struct Tracker {
    pub(super) grace_ms: u64,
    /// A step of Redis's clock within this is ignored (see [`Tracker::new`]).
    pub(super) tolerance_ms: u64,
    /// An observation slower than this counts as "not answering".
    pub(super) slow_ms: u64,
    /// Failed calls so far.
    pub(super) failures: u64,
    /// Failed calls accounted for by a successful observation; fewer than `failures`
    /// means Redis is unreachable now.
    pub(super) seen_failures: u64,
    /// The last successful observation.
    pub(super) last: Option<Seen>,
    /// Redis time (unix ms) at which the current reachable stretch began.
    pub(super) reachable_since_ms: u64,
    /// An outage was reported and its grace has not been seen to end yet (for the
    /// "verdicts resume" log line).
    pub(super) holding: bool,
    /// While a watch runs: the longest time (ms) from the end of one attempt to observe
    /// to the start of the next. Longer, this process did not run (a stall).
    pub(super) watch_gap_ms: Option<u64>,
    /// When the last attempt to observe ended, succeeded or not (monotonic ms).
    pub(super) attempt_ended_ms: Option<u64>,
    /// Redis time (unix ms) at which this process last found that it had stalled: its
    /// own verdicts wait a grace from it. Kept apart from `reachable_since_ms`, which is
    /// shared: another replica either saw Redis fail to answer meanwhile or stalled and
    /// saw it itself, so one starved replica holds no one else's verdicts.
    pub(super) stalled_since_ms: u64,
    /// A verdict found a stall ([`Tracker::stalled`]) that no observation has seen since.
    pub(super) stall_pending: bool,
}

impl Tracker {
    /// The clock-jump tolerance is a quarter of the grace, at most 1 s: a live server's
    /// heartbeat is at most one heartbeat interval old, which must be well under the
    /// grace anyway, so a smaller step cannot take a live server past the grace; NTP's
    /// slewing moves a clock by at most 0.5 ms per second, far below it. The monotonic
    /// bound already includes the round trips, so a slow reply is no jump.
    pub fn new(grace_ms: u64, slow_ms: u64) -> Self {
        Tracker {
            grace_ms,
            tolerance_ms: (grace_ms / 4).min(1000),
            slow_ms,
            failures: 0,
            seen_failures: 0,
            last: None,
            reachable_since_ms: 0,
            holding: false,
            watch_gap_ms: None,
            attempt_ended_ms: None,
            stalled_since_ms: 0,
            stall_pending: false,
        }
    }

    /// A watch observes every `step_ms` from now on: a longer gap between two attempts
    /// than the step plus the slack of [`Tracker::redis_time_bound`] means that this
    /// process did not run meanwhile.
    pub fn watching(&mut self, step_ms: u64) {
        self.watch_gap_ms = Some(step_ms + self.bound_slack_ms());
    }

    /// An attempt to observe ended at monotonic `mono_ms`, succeeded or not.
    pub fn attempt_ended(&mut self, mono_ms: u64) {
        self.attempt_ended_ms = Some(self.attempt_ended_ms.map_or(mono_ms, |e| e.max(mono_ms)));
    }

    /// A call failed with an outage error; true if Redis was taken as reachable until now
    /// (the start of an outage).
    pub fn failed(&mut self) -> bool {
        let first = self.failures == self.seen_failures;
        self.failures += 1;
        self.holding = true;
        first
    }

    /// Failed calls so far: taken before an observation is sent, and given back to
    /// [`Tracker::observed`].
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// An observation sent when [`Tracker::failures`] was `failures_before` succeeded.
    pub fn observed(&mut self, seen: Seen, failures_before: u64) -> Observed {
        let now = seen.redis_ms;
        // A process's first observation also opens its connection.
        let slow_ms = match self.last {
            Some(_) => self.slow_ms,
            None => self.slow_ms + CONNECTING_MS,
        };
        let mut out = Observed {
            after_failures: failures_before != self.seen_failures,
            slow: seen.received_mono_ms.saturating_sub(seen.sent_mono_ms) > slow_ms,
            ..Observed::default()
        };
        self.seen_failures = self.seen_failures.max(failures_before);
        if let Some(current) = &seen.run_ids {
            let recorded = seen.record.as_ref().and_then(|r| r.run_ids.as_ref());
            let previous = self.last.as_ref().and_then(|l| l.run_ids.as_ref());
            out.restart = [recorded, previous]
                .into_iter()
                .flatten()
                .any(|known| known != current);
        }
        if let Some(p) = &self.last {
            let redis_delta = now.saturating_sub(p.redis_ms);
            let redis_bound = seen.received_mono_ms.saturating_sub(p.sent_mono_ms);
            let local_delta = seen.local_ms.saturating_sub(p.local_ms);
            let local_bound = seen.received_mono_ms.saturating_sub(p.received_mono_ms);
            out.clock_jump = redis_delta > redis_bound + self.tolerance_ms
                || local_delta > local_bound + self.tolerance_ms;
        }
        // A stall of this process: when nothing observed Redis for longer than the watch
        // allows, this process cannot tell that Redis stayed reachable, nor that the
        // servers could heartbeat meanwhile (a paused machine stops them all, and they
        // and Redis may come back before or after this process).
        if let (Some(due), Some(ended)) = (self.watch_due_ms(), self.attempt_ended_ms) {
            out.stalled_ms =
                (seen.sent_mono_ms > due && !out.after_failures).then(|| seen.sent_mono_ms - ended);
        }
        let mut since = self.reachable_since_ms;
        if seen.record.is_none() && seen.loaded_from_disk {
            if let Some(up) = seen.uptime_ms.filter(|&up| up < self.grace_ms) {
                out.started_recently = true;
                since = since.max(now.saturating_sub(up));
            }
        }
        let stalled = out.stalled_ms.is_some();
        if stalled || self.stall_pending {
            self.stalled_since_ms = now;
            self.stall_pending = false;
        }
        if out.after_failures || out.slow || out.restart || out.clock_jump {
            since = now;
        }
        // A record from the future (Redis's clock stepped back) is not honoured.
        let recorded = seen
            .record
            .as_ref()
            .map_or(0, |r| r.reachable_since_ms)
            .min(now);
        if recorded > since {
            out.adopted = recorded > self.reachable_since_ms;
            since = recorded;
        }
        // Redis's clock stepped back past the stretch's start: a full grace from now.
        if since > now {
            since = now;
        }
        self.reachable_since_ms = since;
        let stored = seen.record.clone().unwrap_or_default();
        let wanted = Record {
            run_ids: seen.run_ids.clone().or(stored.run_ids.clone()),
            reachable_since_ms: since,
        };
        if seen.record.is_none() || wanted != stored {
            out.store = Some(wanted);
        }
        if out.slow
            || out.restart
            || out.clock_jump
            || stalled
            || out.started_recently
            || out.adopted
        {
            self.holding = true;
        }
        self.attempt_ended(seen.received_mono_ms);
        self.last = Some(seen);
        out
    }

    /// The store wrote `reachable_since_ms` (the greatest known): adopted.
    pub fn stored(&mut self, reachable_since_ms: u64) {
        let now = self.last.as_ref().map_or(u64::MAX, |l| l.redis_ms);
        if reachable_since_ms > self.reachable_since_ms && reachable_since_ms <= now {
            self.reachable_since_ms = reachable_since_ms;
        }
    }

    /// Redis time now, as estimated from the last observation (a lower bound: the
    /// monotonic time since its reply came back).
    fn redis_now(&self, mono_now_ms: u64) -> Option<u64> {
        let l = self.last.as_ref()?;
        Some(l.redis_ms + mono_now_ms.saturating_sub(l.received_mono_ms))
    }

    /// The latest Redis time (unix ms) that can be read at monotonic time `mono_now_ms`
    /// if Redis's clock has not stepped forward since the last observation: its TIME
    /// then, plus all the monotonic time since it was sent, plus the tolerance (at least
    /// 250 ms). `None`
    /// before any observation.
    ///
    /// While a watch runs, the monotonic time counted is at most up to when the watch was
    /// due to look again (the last reply plus the longest gap it allows): a verdict
    /// reading a later TIME comes after a stall of this process since the last
    /// observation, which only the next observation would see, too late for it.
    pub fn redis_time_bound(&self, mono_now_ms: u64) -> Option<u64> {
        let until = self
            .watch_due_ms()
            .map_or(mono_now_ms, |d| mono_now_ms.min(d));
        self.redis_time_bound_unwatched(until)
    }

    /// [`Tracker::redis_time_bound`] without the watch's limit: a TIME past the bound but
    /// within this one is a stall of this process, not a step of Redis's clock.
    pub fn redis_time_bound_unwatched(&self, mono_now_ms: u64) -> Option<u64> {
        let l = self.last.as_ref()?;
        Some(l.redis_ms + mono_now_ms.saturating_sub(l.sent_mono_ms) + self.bound_slack_ms())
    }

    /// While a watch runs: the monotonic time (ms) by which its next attempt to observe
    /// starts, unless this process stalls (the last attempt's end plus the longest gap
    /// the watch allows).
    fn watch_due_ms(&self) -> Option<u64> {
        Some(self.attempt_ended_ms? + self.watch_gap_ms?)
    }

    /// Whether, at monotonic `mono_now_ms`, the watch is past its due time with no call
    /// failed since its last observation (failing attempts explain a late watch): this
    /// process stalled.
    pub fn watch_overdue(&self, mono_now_ms: u64) -> bool {
        !self.failing() && self.watch_due_ms().is_some_and(|d| mono_now_ms > d)
    }

    /// A call failed since the last observation.
    fn failing(&self) -> bool {
        self.failures != self.seen_failures
    }

    /// This process stalled, as a verdict found ([`Tracker::redis_time_bound`]): no
    /// verdict until the next observation, and then a grace of this process's own from it.
    /// True if none was pending (the first report).
    pub fn stalled(&mut self) -> bool {
        let first = !self.stall_pending;
        self.stall_pending = true;
        self.holding = true;
        first
    }

    /// Whether the next verdict must observe Redis first: a call failed, or a verdict
    /// found a stall, since the last observation.
    pub fn must_observe(&self) -> bool {
        self.failing() || self.stall_pending
    }

    /// The slack of [`Tracker::redis_time_bound`]: the tolerance, at least 250 ms.
    pub fn bound_slack_ms(&self) -> u64 {
        self.tolerance_ms.max(BOUND_SLACK_FLOOR_MS)
    }

    /// May verdicts on silent servers be taken at monotonic time `mono_now_ms`?
    pub fn hold(&self, mono_now_ms: u64) -> Hold {
        if self.must_observe() {
            return Hold::Unreachable;
        }
        let Some(now) = self.redis_now(mono_now_ms) else {
            return Hold::Unreachable;
        };
        let since = self.reachable_since_ms.max(self.stalled_since_ms);
        let until = since.saturating_add(self.grace_ms);
        if now < until {
            Hold::Waiting {
                remaining_ms: until - now,
            }
        } else {
            Hold::Ready
        }
    }

    /// True once, when a reported outage's grace of reachable time has passed.
    pub fn resumed(&mut self, mono_now_ms: u64) -> bool {
        if self.holding && self.hold(mono_now_ms).is_ready() {
            self.holding = false;
            return true;
        }
        false
    }

    /// Milliseconds since the last observation (`None` before the first).
    pub fn age_ms(&self, mono_now_ms: u64) -> Option<u64> {
        Some(mono_now_ms.saturating_sub(self.last.as_ref()?.received_mono_ms))
    }

    /// How long Redis has been reachable without a break, as far as known: since the
    /// last outage, or since Redis started. 0 while unreachable.
    pub fn reachable_for_ms(&self, mono_now_ms: u64) -> u64 {
        if self.must_observe() {
            return 0;
        }
        let (Some(now), Some(l)) = (self.redis_now(mono_now_ms), self.last.as_ref()) else {
            return 0;
        };
        let started = l.uptime_ms.map_or(0, |up| l.redis_ms.saturating_sub(up));
        now.saturating_sub(
            self.reachable_since_ms
                .max(started)
                .max(self.stalled_since_ms),
        )
    }

    /// The current stretch's start (Redis time, unix ms; 0 for none known).
    pub fn reachable_since_ms(&self) -> u64 {
        self.reachable_since_ms
    }
}
