//! The step limiter: how many cleanup steps one worker process keeps queued in Redis.
//!
//! A Lua script cannot be interrupted, so a routing lookup that arrives while janitor
//! steps are queued waits for all of them. Nothing else bounds that queue across workers:
//! each runs `concurrency` cleanups of `chunks_in_flight` steps. So every worker process
//! shares one [`Limiter`] between its cleanups, a window of steps in flight that it
//! adjusts the way TCP adjusts its congestion window (AIMD), without any coordination:
//! - each step reports its own execution time (clean_step.lua reads TIME at its start and
//!   its end); the worker measures the round trip, and round trip minus execution is the
//!   time the step waited behind other commands, plus the network's round trip and the
//!   worker's own scheduling, which no queue in Redis causes: so the lowest such delay
//!   seen lately (over the current and the previous minute, as LEDBAT keeps its base
//!   delay; from the 16th step, zero before) is the base, and what a step waited above it is
//!   its queue delay. A 1 ms
//!   target then holds where the network alone takes 1 ms or more (another zone, TLS, a
//!   hosted Redis), which would otherwise keep the worker paced at its slowest for good;
//! - a delay above `latency_target_ms` halves the window (floor 1), at most once per round
//!   trip: only a step sent after the last cut can cut again;
//! - a step that found Redis (nearly) idle, its queue delay under a quarter of the target,
//!   counts toward growth: the window grows by one per window's worth of such steps, up
//!   to `concurrency * chunks_in_flight` (what the worker would queue without a limiter).
//!   A step that waited longer (but not over the target) found work queued in front of
//!   it: Redis was busy the whole time, so a wider window would add only waiting, to the
//!   steps and to the lookups behind them; the window holds;
//! - the window grows past one step only where the base delay is at least a quarter of a
//!   step's execution (averaged like the time per member; half the target until a step
//!   was measured). With one step in flight Redis idles for about the base delay between
//!   a step's answer and the next step; a second step queued behind the running one fills
//!   that gap, and every lookup then waits for it too. A worker alone next to its Redis
//!   (the base a fraction of a step) so keeps one step in flight, and a lookup waits for
//!   the rest of that one step; a worker whose Redis is a long round trip away keeps two
//!   or more, and Redis need not wait for the round trips. A window above that ceiling
//!   (the base dropped, or the steps grew longer) comes down to it at the next measured
//!   answer, without a cut of its own; a window already wider than one keeps its ceiling
//!   until the base is under an eighth of a step, so that a base near a quarter does not
//!   flip it between one and two. Where a step spans a cluster's masters (layouts `keys` and
//!   `conns`), this rule does not apply: the window starts at two and grows up to
//!   `concurrency * chunks_in_flight` whatever the base delay;
//! - at the floor of one step, W workers still keep W steps queued; a delay over the target
//!   there starts pacing instead: a pause before each step (250 us, doubled per round trip
//!   while the delay stays over, at most 20 targets), halved per step under the target,
//!   and gone once no step was in flight for a second (or 40 targets, if longer: the queue
//!   it answered has drained since); the window grows again only once the pause is gone;
//! - a step's execution is read off Redis's clock and its round trip off the worker's: a
//!   step whose execution is longer than its round trip (Redis's clock stepped during it)
//!   frees its place unmeasured;
//! - a step cannot be interrupted, so a lookup waits for the queue in front of it and for
//!   the rest of the step that is running: the step's size (members per step) follows
//!   too, so that one step runs for about half the target (the queue gets the other
//!   half). Each step's execution time per member walked is averaged (EWMA), and a step
//!   walks `target / 2 / time per member` members, at least [`MIN_STEP`] and at most
//!   `chunk_size`; [`MIN_STEP`] until a step was measured. Where steps wait behind other
//!   work (their queue delay, averaged the same way, over a quarter of the target: several
//!   workers at once), a step runs for three eighths of the target instead: each worker
//!   keeps a step queued, a lookup may wait for one of each, and the other workers' steps
//!   keep Redis busy all the same.
//!
//! Every worker that sees the queue grow backs off, so the fleet's queue converges near the
//! target whatever the number of processes. A step acquires a permit before it is sent
//! (each attempt of it: a retry's pause holds no permit);
//! waiting steps get permits in the order of `step_order`: `smallest_first` (the cleanup
//! with the fewest members left, shortest job first; every [`OLDEST_EVERY`]th permit goes
//! to the step that has waited longest instead, so a large cleanup, or one whose size could
//! not be read, still moves while smaller ones keep arriving) or `round_robin` (in the
//! order asked, which interleaves the cleanups).
//!
//! On a cluster a step is part of a chunk's check-and-delete (its scripts on the masters,
//! in parallel), of the step size times the masters its entries spread over; the longest
//! script's execution time and entries stand for the step, and a chunk sends up to
//! `chunks_in_flight` steps at once, in the order asked, as far as the window lets them
//! (one after another at a window of one: layout `hash`, whose step is one script on the
//! master of `registry`) (see `Cleaner::clean_on_cluster`).

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

/// The fewest members one step walks when steps are sized to the target.
pub const MIN_STEP: usize = 100;

/// In `smallest_first` order, one permit in this many goes to the step that has waited
/// longest, whatever its cleanup's size: a large cleanup gets at least this share of the
/// permits while smaller cleanups keep arriving, and the mean wait stays that of shortest
/// job first.
const OLDEST_EVERY: u64 = 8;

/// The shortest pause when pacing, and the longest, in targets.
const MIN_PAUSE: Duration = Duration::from_micros(250);
const MAX_PAUSE_TARGETS: u32 = 20;
/// A pause lapses once no step was in flight for this long, or for twice the longest
/// pause (40 targets) where that is longer: it answered a queue that has drained since, so
/// a cleanup an hour later does not start paced. Long enough that the round trips a
/// cleanup makes outside the limiter (a cluster chunk's scan and advance) and a retry's
/// first pauses keep it.
const PAUSE_LAPSES_AFTER: Duration = Duration::from_secs(1);

/// A step whose queue delay is under the target divided by this found Redis (nearly) idle:
/// it counts toward the window's growth.
const IDLE_FRACTION: u32 = 4;

/// The base delay is the lowest of the current and the previous period of this length.
const BASE_PERIOD: Duration = Duration::from_secs(60);
/// Steps a process measures before it trusts its base delay: at a zone outage its first
/// steps all wait behind every other worker's, and a base taken from them would let the
/// queue grow by as much. Until then the whole delay counts (the base is zero).
const BASE_SAMPLES: u32 = 16;

/// An average that moves 20% of the way to each new sample.
fn ewma(avg: Option<f64>, sample: f64) -> f64 {
    match avg {
        Some(avg) => avg * 0.8 + sample * 0.2,
        None => sample,
    }
}

/// The lowest delay seen lately: what a step waits even with nothing queued in Redis.
struct BaseDelay {
    current: Duration,
    previous: Duration,
    since: Instant,
    samples: u32,
}

impl BaseDelay {
    fn new() -> Self {
        BaseDelay {
            current: Duration::MAX,
            previous: Duration::MAX,
            since: Instant::now(),
            samples: 0,
        }
    }

    /// Takes in one step's delay; returns the base now.
    fn observe(&mut self, delay: Duration) -> Duration {
        if self.since.elapsed() >= BASE_PERIOD {
            self.previous = self.current;
            self.current = delay;
            self.since = Instant::now();
        } else {
            self.current = self.current.min(delay);
        }
        self.samples = self.samples.saturating_add(1);
        if self.samples < BASE_SAMPLES {
            return Duration::ZERO;
        }
        self.current.min(self.previous)
    }
}

/// Which waiting step gets the next permit (the `step_order` setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepOrder {
    /// The cleanup with the fewest members left first (shortest job first).
    #[default]
    SmallestFirst,
    /// In the order asked: the cleanups' steps interleave.
    RoundRobin,
}

impl StepOrder {
    pub fn as_str(self) -> &'static str {
        match self {
            StepOrder::SmallestFirst => "smallest_first",
            StepOrder::RoundRobin => "round_robin",
        }
    }
}

/// What the limiter reports to Prometheus.
#[derive(Clone)]
pub struct LimiterMetrics {
    pub window: prometheus::IntGauge,
    pub in_flight: prometheus::IntGauge,
    pub queue_delay: prometheus::Histogram,
    pub cuts: prometheus::IntCounter,
}

/// One worker process's window of cleanup steps in flight (see the module docs).
pub struct Limiter {
    target: Duration,
    max_window: usize,
    order: StepOrder,
    /// A step spans a cluster's masters (layouts `keys` and `conns` on a cluster): the
    /// window is not held at one step.
    spans_masters: bool,
    state: Mutex<State>,
    metrics: Option<LimiterMetrics>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("target", &self.target)
            .field("max_window", &self.max_window)
            .field("order", &self.order)
            .finish_non_exhaustive()
    }
}

struct State {
    window: usize,
    in_flight: usize,
    /// Completions without a cut since the window last grew.
    grown: usize,
    last_cut: Option<Instant>,
    cuts: u64,
    /// At the floor of one step, a pause before each step (see [`Limiter::acquire`]).
    pause: Duration,
    /// When a permit was last given back, measured or not (see [`PAUSE_LAPSES_AFTER`]).
    released_at: Option<Instant>,
    /// Execution time per member walked, averaged over the steps (microseconds).
    us_per_member: Option<f64>,
    /// Execution time of a step, averaged over the steps (microseconds).
    us_per_step: Option<f64>,
    /// Queue delay (above the base) of a step, averaged over the steps (microseconds).
    queue_us: Option<f64>,
    /// The delay a step sees with nothing queued (network, scheduling).
    base: BaseDelay,
    /// Steps waiting for a permit (a few: at most the cleanups' steps of one process).
    waiting: Vec<Waiter>,
    asked: u64,
    /// Permits given to waiting steps so far (see [`OLDEST_EVERY`]).
    granted: u64,
}

struct Waiter {
    /// (members left, or 0 in round-robin order; order of asking)
    key: (u64, u64),
    grant: oneshot::Sender<Permit>,
}

/// The right to send one step. Dropped without [`Permit::complete`] (the step failed or
/// was abandoned), it frees its place without a measurement.
pub struct Permit {
    limiter: Option<Arc<Limiter>>,
    sent: Instant,
}

impl Permit {
    /// Marks the step as sent now (the round trip is measured from here).
    pub fn sent(&mut self) {
        self.sent = Instant::now();
    }

    /// The step's answer came back, having walked `members` in `execution` inside Redis:
    /// frees the place, adjusts the window by the queue delay (round trip minus
    /// execution) and the step size by the time per member.
    pub fn complete(mut self, execution: Duration, members: u64) {
        if let Some(limiter) = self.limiter.take() {
            let round_trip = self.sent.elapsed();
            // The execution is read off Redis's wall clock (TIME), the round trip off this
            // process's monotonic one: an execution longer than the round trip is a clock
            // step on Redis's host during the step, not a measurement. Taken as one, its
            // delay of zero would become the base delay, and every later step's network
            // would count as queueing until the base's periods turned over.
            if execution > round_trip {
                limiter.release(None);
                return;
            }
            if members > 0 {
                limiter.observe_step(execution, members);
            }
            limiter.release(Some((self.sent, round_trip.saturating_sub(execution))));
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(limiter) = self.limiter.take() {
            limiter.release(None);
        }
    }
}

impl Limiter {
    /// A limiter keeping the queue delay near `target` (must not be zero: a zero target
    /// means no limiter), with at most `max_window` steps in flight, for steps on one
    /// node or (`spans_masters`) spanning a cluster's masters.
    pub fn new(
        target: Duration,
        max_window: usize,
        order: StepOrder,
        spans_masters: bool,
        metrics: Option<LimiterMetrics>,
    ) -> Arc<Self> {
        let max_window = max_window.max(1);
        // Start low: a zone outage makes every worker start at once, and a burst of full
        // windows would queue them all in Redis before the first answer. Where the window
        // may widen, it reaches its ceiling within a few dozen steps when Redis keeps up.
        let window = if spans_masters { 2.min(max_window) } else { 1 };
        if let Some(m) = &metrics {
            m.window.set(window as i64);
            m.in_flight.set(0);
        }
        Arc::new(Limiter {
            target,
            max_window,
            order,
            spans_masters,
            state: Mutex::new(State {
                window,
                in_flight: 0,
                grown: 0,
                last_cut: None,
                cuts: 0,
                pause: Duration::ZERO,
                released_at: None,
                us_per_member: None,
                us_per_step: None,
                queue_us: None,
                base: BaseDelay::new(),
                waiting: Vec::new(),
                asked: 0,
                granted: 0,
            }),
            metrics,
        })
    }

    /// The limiter of the `latency_target_ms` setting: none when it is 0 (steps are then
    /// sent as they come, `chunks_in_flight` per cleanup).
    pub fn for_target(
        target_ms: u64,
        max_window: usize,
        order: StepOrder,
        spans_masters: bool,
        metrics: Option<LimiterMetrics>,
    ) -> Option<Arc<Self>> {
        (target_ms > 0).then(|| {
            Limiter::new(
                Duration::from_millis(target_ms),
                max_window,
                order,
                spans_masters,
                metrics,
            )
        })
    }

    pub fn target(&self) -> Duration {
        self.target
    }

    pub fn order(&self) -> StepOrder {
        self.order
    }

    /// The window now.
    pub fn window(&self) -> usize {
        crate::lock::lock(&self.state).window
    }

    /// Steps holding a permit now.
    pub fn in_flight(&self) -> usize {
        crate::lock::lock(&self.state).in_flight
    }

    /// Times the window was cut so far.
    pub fn cuts(&self) -> u64 {
        crate::lock::lock(&self.state).cuts
    }

    /// Waits for a permit to send one step of a cleanup with `members_left` members left
    /// (the key of `smallest_first`; ignored in `round_robin` order).
    pub async fn acquire(self: &Arc<Self>, members_left: u64) -> Permit {
        let rx = {
            let mut state = crate::lock::lock(&self.state);
            state.asked += 1;
            if state.waiting.is_empty() && state.in_flight < state.window {
                let pause = self.pause_now(&mut state);
                state.in_flight += 1;
                self.show(&state);
                Err((self.permit(), pause))
            } else {
                let (tx, rx) = oneshot::channel();
                let key = match self.order {
                    StepOrder::SmallestFirst => members_left,
                    StepOrder::RoundRobin => 0,
                };
                let asked = state.asked;
                state.waiting.push(Waiter {
                    key: (key, asked),
                    grant: tx,
                });
                Ok(rx)
            }
        };
        let rx = match rx {
            Ok(rx) => rx,
            Err((permit, pause)) => return self.paced(permit, pause).await,
        };
        let permit = match rx.await {
            Ok(permit) => permit,
            // The sender is dropped only with the limiter, which is alive while we hold
            // it: should it be dropped unanswered all the same, this step takes a place
            // of its own, as when the window has room.
            Err(_) => {
                let mut state = crate::lock::lock(&self.state);
                state.in_flight += 1;
                self.show(&state);
                self.permit()
            }
        };
        let pause = self.pause_now(&mut crate::lock::lock(&self.state));
        self.paced(permit, pause).await
    }

    /// Holds `permit` for `pause` before the step may go: with a window of one, the whole
    /// process waits, so its share of Redis drops below one step at a time.
    async fn paced(&self, permit: Permit, pause: Duration) -> Permit {
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        permit
    }

    /// Members the next step should walk: about half a target of execution (three
    /// eighths where steps wait behind others: [`Limiter::step_goal_us`]), at least
    /// [`MIN_STEP`] and at most `chunk_size`. Until a step was measured, [`MIN_STEP`]: a
    /// whole fleet starts at once after a zone outage, and its first steps at full
    /// `chunk_size` (several ms each) all queue in front of the lookups at the same moment.
    pub fn step_size(&self, chunk_size: usize) -> usize {
        let (per_member, goal) = {
            let state = crate::lock::lock(&self.state);
            (state.us_per_member, self.step_goal_us(&state))
        };
        let floor = MIN_STEP.min(chunk_size);
        match per_member {
            // A float cast saturates: steps measured at 0 us per member fit usize::MAX.
            Some(us) => ((goal / us) as usize).clamp(floor, chunk_size),
            None => floor,
        }
    }

    /// How long a step should run, in microseconds: half the target; three eighths of it
    /// where steps wait behind others' work (their queue delay averages over a quarter of
    /// the target, as when several workers clean at once). Each worker then keeps a step
    /// queued, and a lookup may wait for one of each: shorter steps shorten that wait,
    /// while the other workers' steps keep Redis as busy.
    fn step_goal_us(&self, state: &State) -> f64 {
        let target = self.target.as_micros() as f64;
        if state
            .queue_us
            .is_some_and(|queue| queue > target / f64::from(IDLE_FRACTION))
        {
            target * 3.0 / 8.0
        } else {
            target / 2.0
        }
    }

    /// A step walked `members` in `execution`: the average time per member moves 20% of
    /// the way to it.
    fn observe_step(&self, execution: Duration, members: u64) {
        let us = execution.as_micros() as f64;
        let mut state = crate::lock::lock(&self.state);
        state.us_per_member = Some(ewma(state.us_per_member, us / members as f64));
        state.us_per_step = Some(ewma(state.us_per_step, us));
    }

    /// The widest the window may grow with `base` the delay a step sees with nothing
    /// queued: one step in flight, unless that delay is at least a quarter of a step's
    /// execution (half the target until a step was measured), or the steps span a
    /// cluster's masters (each master idles while the others' scripts and the round trip
    /// complete a step, so the window keeps them busy; a step of layout `hash` on a
    /// cluster is one script on one master, as on one node). Redis is idle for about
    /// `base` between one step's answer and the next step with one in flight; a second
    /// step queued behind the running one fills that gap, but every lookup then waits for
    /// it too, which is worth it only where the gap is a sizeable share of Redis's time.
    /// A window already wider than one keeps its ceiling until the delay is under an
    /// eighth of a step: near a quarter, the averaged step time alone would otherwise
    /// flip the window between one and two from one answer to the next.
    fn ceiling(&self, state: &State, base: Duration) -> usize {
        let step_us = state
            .us_per_step
            .unwrap_or(self.target.as_micros() as f64 / 2.0);
        let fraction = if state.window > 1 {
            2 * IDLE_FRACTION
        } else {
            IDLE_FRACTION
        };
        if self.spans_masters || base.as_micros() as f64 * f64::from(fraction) >= step_us {
            self.max_window
        } else {
            1
        }
    }

    /// The pause before each step now (zero unless the window is at its floor of one).
    pub fn pause(&self) -> Duration {
        self.pause_now(&mut crate::lock::lock(&self.state))
    }

    /// The pause, once it has lapsed ([`PAUSE_LAPSES_AFTER`]) zero.
    fn pause_now(&self, state: &mut State) -> Duration {
        let lapse = PAUSE_LAPSES_AFTER.max(self.target * 2 * MAX_PAUSE_TARGETS);
        if !state.pause.is_zero()
            && state.in_flight == 0
            && state.released_at.is_some_and(|at| at.elapsed() >= lapse)
        {
            state.pause = Duration::ZERO;
        }
        state.pause
    }

    fn permit(self: &Arc<Self>) -> Permit {
        Permit {
            limiter: Some(self.clone()),
            sent: Instant::now(),
        }
    }

    /// A permit is given back, with (sent at, round trip minus execution) when its step
    /// completed; what is above the base delay is the queue delay.
    fn release(self: &Arc<Self>, measured: Option<(Instant, Duration)>) {
        let mut state = crate::lock::lock(&self.state);
        state.in_flight -= 1;
        state.released_at = Some(Instant::now());
        if let Some((sent, delay)) = measured {
            let base = state.base.observe(delay);
            let delay = delay.saturating_sub(base);
            let ceiling = self.ceiling(&state, base);
            state.queue_us = Some(ewma(state.queue_us, delay.as_micros() as f64));
            if let Some(m) = &self.metrics {
                m.queue_delay.observe(delay.as_secs_f64());
            }
            if delay > self.target {
                // Once per round trip: a step sent before the last cut saw the old window.
                state.grown = 0;
                if state.last_cut.is_none_or(|cut| sent > cut) {
                    state.last_cut = Some(Instant::now());
                    if state.window > 1 {
                        state.window = (state.window / 2).max(1);
                        state.cuts += 1;
                        if let Some(m) = &self.metrics {
                            m.cuts.inc();
                        }
                    } else {
                        // At the floor of one step: W workers still keep W steps queued.
                        // Below that, pace: a pause before each step, doubled while the
                        // delay stays over the target, at most 20 targets.
                        state.pause = (state.pause * 2)
                            .max(MIN_PAUSE)
                            .min(self.target * MAX_PAUSE_TARGETS);
                    }
                }
            } else if !state.pause.is_zero() {
                // Pacing ends first (halved per good step), then the window grows.
                state.pause /= 2;
                if state.pause < MIN_PAUSE {
                    state.pause = Duration::ZERO;
                }
            } else if delay < self.target / IDLE_FRACTION {
                // The step found Redis (nearly) idle: a wider window may keep it busier.
                state.grown += 1;
                if state.grown >= state.window {
                    state.grown = 0;
                    state.window = (state.window + 1).min(ceiling);
                }
            }
            // Otherwise work was queued in front of the step: Redis was busy, the window
            // holds.
            // A window over its ceiling comes down to it (after a cut, which a slow step
            // makes from the window it was sent with).
            if state.window > ceiling {
                state.window = ceiling;
                state.grown = 0;
            }
        }
        while state.in_flight < state.window {
            let Some(waiter) = Self::next_waiter(&mut state) else {
                break;
            };
            state.in_flight += 1;
            if let Err(mut permit) = waiter.grant.send(self.permit()) {
                // The step stopped waiting: take the place back without a second lock.
                permit.limiter = None;
                state.in_flight -= 1;
            }
        }
        self.show(&state);
    }

    /// The waiting step to get the next permit: the smallest key (members left, then the
    /// order asked), except every [`OLDEST_EVERY`]th permit, which goes to the step asked
    /// first (the same in `round_robin` order, whose keys are all 0).
    fn next_waiter(state: &mut State) -> Option<Waiter> {
        if state.waiting.is_empty() {
            return None;
        }
        state.granted += 1;
        let oldest = state.granted % OLDEST_EVERY == 0;
        let at = state
            .waiting
            .iter()
            .enumerate()
            .min_by_key(|(_, w)| if oldest { (0, w.key.1) } else { w.key })
            .map(|(at, _)| at)?;
        Some(state.waiting.swap_remove(at))
    }

    fn show(&self, state: &State) {
        if let Some(m) = &self.metrics {
            m.window.set(state.window as i64);
            m.in_flight.set(state.in_flight as i64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn limiter(max: usize) -> Arc<Limiter> {
        Limiter::new(MS, max, StepOrder::SmallestFirst, false, None)
    }

    /// Completes one step that waited `delay` in Redis' queue.
    fn step_with_delay(_: &Arc<Limiter>, mut permit: Permit, delay: Duration) {
        let limiter = permit.limiter.take().unwrap();
        limiter.release(Some((permit.sent, delay)));
    }

    #[test]
    fn a_target_of_zero_means_no_limiter() {
        assert!(Limiter::for_target(0, 8, StepOrder::SmallestFirst, false, None).is_none());
        let l = Limiter::for_target(2, 8, StepOrder::RoundRobin, false, None).unwrap();
        assert_eq!(l.target(), 2 * MS);
        assert_eq!(l.order(), StepOrder::RoundRobin);
    }

    #[tokio::test]
    async fn steps_are_sized_to_run_for_about_the_target() {
        let l = limiter(8);
        assert_eq!(
            l.step_size(1000),
            MIN_STEP,
            "MIN_STEP until a step is measured"
        );
        assert_eq!(l.step_size(50), 50, "never more than chunk_size");
        // 1000 members in 2.5 ms: 2.5 us each, so about 200 fit in half the 1 ms target.
        measured_steps(&l, 1, Duration::from_micros(2500), 1000, Duration::ZERO).await;
        assert_eq!(l.step_size(1000), 200);
        // Never more than chunk_size, never fewer than MIN_STEP (or chunk_size if smaller).
        assert_eq!(l.step_size(150), 150);
        measured_steps(&l, 50, Duration::from_millis(50), 100, Duration::ZERO).await;
        assert_eq!(l.step_size(1000), MIN_STEP);
        assert_eq!(l.step_size(50), 50);
        // Fast steps bring it back up to chunk_size.
        measured_steps(&l, 50, Duration::from_micros(100), 1000, Duration::ZERO).await;
        assert_eq!(l.step_size(1000), 1000);
        // A step measured at 0 us (under TIME's resolution): as fast as can be.
        let z = limiter(8);
        z.acquire(10).await.complete(Duration::ZERO, 500);
        assert_eq!(z.step_size(1000), 1000);
    }

    /// The round trip of a Redis far enough away that a second step in flight pays: a
    /// step's execution is half the 1 ms target until one was measured, and this is over
    /// a quarter of that.
    const NET: Duration = Duration::from_micros(200);

    /// A limiter whose steps have seen a round trip of [`NET`] long enough to trust it as
    /// the base delay, with nothing queued: its window may now grow, and the step that
    /// made the base trusted found Redis idle and grew it to two.
    async fn remote(max: usize) -> Arc<Limiter> {
        let l = limiter(max);
        for _ in 0..BASE_SAMPLES - 1 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, NET);
        }
        assert_eq!(
            (l.window(), l.cuts()),
            (1, 0),
            "one step until the base is known"
        );
        let p = l.acquire(10).await;
        step_with_delay(&l, p, NET);
        assert_eq!((l.window(), l.cuts()), (2, 0));
        l
    }

    /// Completes `n` steps, each measured at `execution` for `members` and waiting `delay`
    /// (round trip minus execution) in all.
    async fn measured_steps(
        l: &Arc<Limiter>,
        n: usize,
        execution: Duration,
        members: u64,
        delay: Duration,
    ) {
        for _ in 0..n {
            let p = l.acquire(10).await;
            l.observe_step(execution, members);
            step_with_delay(l, p, delay);
        }
    }

    #[tokio::test]
    async fn a_worker_near_redis_keeps_one_step_in_flight() {
        const RTT: Duration = Duration::from_micros(100);
        const SHORT: Duration = Duration::from_micros(300);
        // Steps of 500 us that found Redis idle, with a round trip of 100 us: a second
        // step in flight would save Redis 100 us of idling per step, and cost every
        // lookup a whole step of waiting.
        let l = limiter(8);
        assert_eq!(l.window(), 1);
        measured_steps(&l, 200, MS / 2, 250, RTT).await;
        assert_eq!((l.window(), l.cuts()), (1, 0));
        // Steps of 300 us at the same round trip: it is a third of a step now, and the
        // window grows.
        measured_steps(&l, 200, SHORT, 150, RTT).await;
        assert_eq!((l.window(), l.cuts()), (8, 0));
        // Steps of 500 us again: the round trip is a fifth of a step, over the eighth that
        // a wide window keeps its ceiling down to: it holds.
        measured_steps(&l, 200, MS / 2, 250, RTT).await;
        assert_eq!((l.window(), l.cuts()), (8, 0));
        // Steps of 900 us: the round trip is under an eighth of a step: one step, no cut.
        measured_steps(&l, 20, Duration::from_micros(900), 450, RTT).await;
        assert_eq!((l.window(), l.cuts()), (1, 0));
        // And it stays there at 500 us steps: a window of one widens only from a quarter.
        measured_steps(&l, 200, MS / 2, 250, RTT).await;
        assert_eq!((l.window(), l.cuts()), (1, 0));
        // Back to 300 us steps, then the round trip drops (the worker moved next to
        // Redis): back to one step, no cut.
        measured_steps(&l, 200, SHORT, 150, RTT).await;
        assert_eq!(l.window(), 8);
        let p = l.acquire(10).await;
        step_with_delay(&l, p, Duration::ZERO);
        assert_eq!((l.window(), l.cuts()), (1, 0));
    }

    #[tokio::test]
    async fn steps_spanning_masters_grow_the_window_whatever_the_round_trip() {
        let l = Limiter::new(MS, 8, StepOrder::RoundRobin, true, None);
        assert_eq!(l.window(), 2);
        measured_steps(&l, 200, MS / 2, 250, Duration::ZERO).await;
        assert_eq!((l.window(), l.cuts()), (8, 0));
    }

    #[tokio::test]
    async fn grows_by_one_per_window_of_fast_steps_up_to_the_ceiling() {
        let l = remote(8).await;
        for _ in 0..200 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, NET);
        }
        assert_eq!(l.window(), 8, "capped at concurrency * chunks_in_flight");
        assert_eq!(l.cuts(), 0);
    }

    #[tokio::test]
    async fn steps_that_waited_behind_work_under_the_target_hold_the_window() {
        let l = remote(8).await;
        // Steps that found Redis idle grow the window (2, then 3)...
        for _ in 0..2 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, NET);
        }
        assert_eq!(l.window(), 3);
        // ... steps that waited behind others (half the target: busy, not over) hold it.
        for _ in 0..100 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, NET + MS / 2);
        }
        assert_eq!((l.window(), l.cuts()), (3, 0));
        // Just under a quarter of the target counts as idle again.
        for _ in 0..3 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, NET + MS / 4 - Duration::from_micros(1));
        }
        assert_eq!(l.window(), 4);
    }

    #[tokio::test]
    async fn a_slow_step_halves_the_window_once_per_round_trip_down_to_one() {
        let l = remote(8).await;
        for _ in 0..200 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, NET);
        }
        // Eight steps sent with the full window; all come back late: one cut only.
        let mut permits = Vec::new();
        for _ in 0..8 {
            permits.push(l.acquire(10).await);
        }
        for p in permits {
            step_with_delay(&l, p, 5 * MS);
        }
        assert_eq!(l.window(), 4);
        assert_eq!(l.cuts(), 1);
        // Steps sent after the cut may cut again, down to the floor of one.
        for _ in 0..10 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, 5 * MS);
        }
        assert_eq!(l.window(), 1);
        assert_eq!(l.cuts(), 3);
        // And it grows back, once the pacing at the floor is over.
        while !l.pause().is_zero() {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, NET);
        }
        assert_eq!(l.window(), 1);
        for _ in 0..3 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, NET);
        }
        assert_eq!(l.window(), 3);
    }

    #[tokio::test]
    async fn a_slow_step_that_also_lowers_the_ceiling_cuts_and_does_not_pace() {
        let l = remote(8).await;
        for _ in 0..200 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, NET);
        }
        assert_eq!(l.window(), 8);
        // A step of 5 ms, late: the round trip is now far under an eighth of a step.
        measured_steps(&l, 1, 5 * MS, 250, NET + 5 * MS).await;
        assert_eq!((l.window(), l.cuts()), (1, 1));
        assert_eq!(
            l.pause(),
            Duration::ZERO,
            "a cut of the window it was sent with"
        );
    }

    #[tokio::test]
    async fn steps_that_wait_behind_other_work_run_for_three_eighths_of_the_target() {
        // 2.5 us per member, Redis idle: half the 1 ms target is 200 members.
        let l = limiter(8);
        measured_steps(&l, 20, Duration::from_micros(2500), 1000, Duration::ZERO).await;
        assert_eq!(l.step_size(1000), 200);
        // Each step waits 600 us behind other workers' steps (under the target: the
        // window holds): once that averages over a quarter of the target, steps run for
        // three eighths of it, 150 members.
        measured_steps(
            &l,
            1,
            Duration::from_micros(2500),
            1000,
            Duration::from_micros(600),
        )
        .await;
        assert_eq!(
            l.step_size(1000),
            200,
            "one step's wait is not yet the average"
        );
        measured_steps(
            &l,
            10,
            Duration::from_micros(2500),
            1000,
            Duration::from_micros(600),
        )
        .await;
        assert_eq!(l.step_size(1000), 150);
        assert_eq!(l.cuts(), 0);
        // Redis idle again: back to half the target.
        measured_steps(&l, 20, Duration::from_micros(2500), 1000, Duration::ZERO).await;
        assert_eq!(l.step_size(1000), 200);
    }

    #[tokio::test]
    async fn a_step_longer_than_its_round_trip_is_no_measurement() {
        // A Redis 5 ms away, the window grown to its widest.
        let l = limiter(8);
        for _ in 0..BASE_SAMPLES + 100 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, 5 * MS);
        }
        assert_eq!((l.window(), l.pause()), (8, Duration::ZERO));
        // Redis's clock steps forward during a step: its execution, read off that clock,
        // is longer than the round trip the worker measured.
        l.acquire(10).await.complete(6 * MS, 100);
        for _ in 0..30 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, 5 * MS);
        }
        assert_eq!(
            (l.window(), l.pause(), l.cuts()),
            (8, Duration::ZERO, 0),
            "the network's 5 ms is still the base delay, not queueing"
        );
        // Nor did it count as a step of 100 members in 6 ms.
        assert_eq!(l.step_size(1000), MIN_STEP);
    }

    #[tokio::test]
    async fn a_pause_lapses_once_no_step_ran_for_a_second() {
        let l = remote(8).await;
        for _ in 0..3 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, 5 * MS);
        }
        assert_eq!(l.pause(), Duration::from_micros(500));
        // A step that fails frees its place unmeasured, and a retry's first pauses or a
        // cluster chunk's scan and advance come between steps: the pause holds.
        drop(l.acquire(10).await);
        tokio::time::sleep(100 * MS).await;
        assert_eq!(l.pause(), Duration::from_micros(500));
        // A step in flight all along keeps it too.
        let held = l.acquire(10).await;
        tokio::time::sleep(PAUSE_LAPSES_AFTER + 50 * MS).await;
        assert_eq!(l.pause(), Duration::from_micros(500));
        drop(held);
        // No step for over a second: the next cleanup starts unpaced.
        tokio::time::sleep(PAUSE_LAPSES_AFTER + 50 * MS).await;
        assert_eq!(l.pause(), Duration::ZERO);
    }

    #[tokio::test]
    async fn a_constant_network_delay_is_not_queueing() {
        // Every step takes 5 ms more than its execution (the network). The first steps
        // count it all (no base yet) and pace; then the base takes it out: no more cuts,
        // no pause, the full window.
        let l = limiter(8);
        for _ in 0..BASE_SAMPLES {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, 5 * MS);
        }
        assert_eq!(l.window(), 1);
        let cuts = l.cuts();
        for _ in 0..200 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, 5 * MS);
        }
        assert_eq!((l.window(), l.cuts()), (8, cuts));
        assert_eq!(l.pause(), Duration::ZERO);
        // Waiting 2 ms above it is queueing: over the 1 ms target.
        let p = l.acquire(10).await;
        step_with_delay(&l, p, 7 * MS);
        assert_eq!((l.window(), l.cuts()), (4, cuts + 1));
    }

    #[tokio::test]
    async fn at_the_floor_a_slow_step_paces_and_fast_steps_end_it_before_the_window_grows() {
        let l = remote(8).await;
        // The first slow step cuts the window from 2 to 1; then pacing starts.
        for _ in 0..3 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, 5 * MS);
        }
        assert_eq!((l.window(), l.cuts()), (1, 1));
        assert_eq!(
            l.pause(),
            Duration::from_micros(500),
            "250 us, then doubled"
        );
        for _ in 0..20 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, 5 * MS);
        }
        assert_eq!(l.pause(), 20 * MS, "at most 20 targets");
        let started = Instant::now();
        let p = l.acquire(10).await;
        assert!(
            started.elapsed() >= 20 * MS,
            "the step waited out the pause"
        );
        step_with_delay(&l, p, NET);
        assert_eq!(l.pause(), 10 * MS);
        // 10, 5, 2.5, 1.25, 0.625, 0.3125 ms, then under 250 us: none.
        for _ in 0..6 {
            let p = l.acquire(10).await;
            step_with_delay(&l, p, NET);
        }
        assert_eq!(l.pause(), Duration::ZERO);
        assert_eq!(l.window(), 1, "the window grows only once pacing is over");
        let p = l.acquire(10).await;
        step_with_delay(&l, p, NET);
        assert_eq!(l.window(), 2);
    }

    #[tokio::test]
    async fn steps_beyond_the_window_wait_and_the_smallest_cleanup_goes_first() {
        let l = limiter(1);
        let first = l.acquire(100).await;
        assert_eq!(l.in_flight(), 1);
        let big = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(1000).await }
        });
        let small = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(5).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(l.in_flight(), 1, "both wait");
        first.complete(Duration::ZERO, 0);
        let small = tokio::time::timeout(Duration::from_secs(1), small)
            .await
            .expect("the smaller cleanup got the permit")
            .unwrap();
        assert!(!big.is_finished());
        drop(small); // failed step: frees its place without a measurement
        let big = tokio::time::timeout(Duration::from_secs(1), big)
            .await
            .unwrap()
            .unwrap();
        drop(big);
        assert_eq!(l.in_flight(), 0);
    }

    /// A large cleanup is not starved while smaller ones keep asking: one permit in
    /// [`OLDEST_EVERY`] goes to the step that has waited longest.
    #[tokio::test]
    async fn a_large_cleanup_gets_a_permit_while_smaller_ones_keep_asking() {
        let l = limiter(1);
        let waiting = |n: usize| {
            let l = l.clone();
            async move {
                while crate::lock::lock(&l.state).waiting.len() != n {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        };
        let mut held = l.acquire(5).await;
        let mut big = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(1_000_000).await }
        });
        waiting(1).await;
        // Smaller cleanups always have a step waiting: each permit handed over finds
        // another small one queued beside the big step.
        let mut small_grants = 0;
        loop {
            let mut next = tokio::spawn({
                let l = l.clone();
                async move { l.acquire(5).await }
            });
            waiting(2).await;
            drop(held);
            let got = tokio::time::timeout(Duration::from_secs(1), async {
                tokio::select! {
                    big = &mut big => (true, big.unwrap()),
                    small = &mut next => (false, small.unwrap()),
                }
            })
            .await
            .expect("a waiting step got the permit");
            match got {
                (true, permit) => {
                    drop(permit);
                    drop(next.await.unwrap());
                    break;
                }
                (false, permit) => {
                    held = permit;
                    small_grants += 1;
                    assert!(
                        small_grants < OLDEST_EVERY,
                        "the big cleanup still waits after {small_grants} permits to smaller ones"
                    );
                }
            }
        }
        assert_eq!(
            small_grants,
            OLDEST_EVERY - 1,
            "smaller cleanups go first but for one permit in {OLDEST_EVERY}"
        );
        assert_eq!(l.in_flight(), 0);
    }

    #[tokio::test]
    async fn round_robin_grants_in_the_order_asked() {
        let l = Limiter::new(MS, 1, StepOrder::RoundRobin, false, None);
        let first = l.acquire(0).await;
        let a = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(1000).await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let b = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(5).await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(first);
        let a = tokio::time::timeout(Duration::from_secs(1), a)
            .await
            .unwrap()
            .unwrap();
        assert!(!b.is_finished());
        drop(a);
        drop(b.await.unwrap());
    }

    #[tokio::test]
    async fn an_abandoned_waiter_does_not_keep_its_place() {
        let l = limiter(1);
        let first = l.acquire(1).await;
        let waiting = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(1).await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        waiting.abort();
        let _ = waiting.await;
        drop(first);
        assert_eq!(l.in_flight(), 0);
        let again = tokio::time::timeout(Duration::from_secs(1), l.acquire(1))
            .await
            .expect("the place is free");
        drop(again);
    }
}
