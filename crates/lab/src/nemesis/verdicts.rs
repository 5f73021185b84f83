//! What the run found: violations of the invariants, the checks made, and notes on what
//! the harness itself did wrong (a starved process), kept apart from the janitor's faults.

use std::{
    collections::BTreeMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use tokio_util::sync::CancellationToken;

/// The invariants, by the names the report uses.
pub mod invariant {
    /// No entry of a live server is deleted.
    pub const LIVE_KEPT: &str = "live entries kept";
    /// Once every event of a dead server is acknowledged, no entry names it.
    pub const ACKED_CLEAN: &str = "acknowledged servers clean";
    /// Every event is acknowledged, or dead-lettered with its reason.
    pub const EVENTS_SETTLED: &str = "events settled";
    /// Each deleted entry is announced exactly once, and no other.
    pub const ANNOUNCED_ONCE: &str = "evictions exactly once";
    /// On a cluster: each deleted entry is announced at least once (unless a worker was
    /// killed between its delete and its announcement), and no entry that was never on
    /// that dead server.
    pub const ANNOUNCED_AT_LEAST_ONCE: &str = "evictions at least once";
    /// No janitor process exits by itself.
    pub const PROCESSES_UP: &str = "processes stay up";
    /// Worker (and reconciler) memory stays within its bound.
    pub const MEMORY_FLAT: &str = "memory flat";
    /// A fenced server's writes are refused, and no live server is fenced.
    pub const FENCING: &str = "fencing";
    /// `route` never returns a server whose fence was seen before the lookup.
    pub const ROUTE: &str = "route never names a fenced server";
    /// Every dead server is declared dead and cleaned within the deadline.
    pub const DEAD_FOUND: &str = "dead servers cleaned in time";
    /// The registry holds what the load wrote (an owner nobody wrote is a harness bug or
    /// a janitor write).
    pub const OWNERS_WRITTEN: &str = "owners are what was written";
}

/// Violations kept (and printed) at most.
const MAX_KEPT: usize = 10;

#[derive(Debug, Clone)]
pub struct Violation {
    pub at: Duration,
    pub invariant: &'static str,
    pub what: String,
    /// The keys and members involved, with what the load did to them.
    pub keys: Vec<String>,
}

#[derive(Default)]
struct Inner {
    violations: Vec<Violation>,
    checks: BTreeMap<&'static str, u64>,
    notes: Vec<(Duration, String)>,
}

pub struct Verdicts {
    start: Mutex<Instant>,
    /// Cancelled at the first violation: the run stops.
    pub stop: CancellationToken,
    inner: Mutex<Inner>,
}

impl Verdicts {
    pub fn new(start: Instant) -> Self {
        Verdicts {
            start: Mutex::new(start),
            stop: CancellationToken::new(),
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The run's clock starts again (once the fleet and the janitor are up).
    pub fn restart_clock(&self, start: Instant) {
        *self.start.lock().unwrap_or_else(|e| e.into_inner()) = start;
    }

    pub fn elapsed(&self) -> Duration {
        self.start
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
    }

    /// Records a violation and stops the run.
    pub fn violation(&self, invariant: &'static str, what: impl Into<String>, keys: Vec<String>) {
        let v = Violation {
            at: self.elapsed(),
            invariant,
            what: what.into(),
            keys,
        };
        let mut inner = self.lock();
        // The first ones say it all: one round can find the same fault many times.
        if inner.violations.len() < MAX_KEPT {
            eprintln!(
                "nemesis: VIOLATION at +{:.1}s: {}: {}",
                v.at.as_secs_f64(),
                v.invariant,
                v.what
            );
            inner.violations.push(v);
        }
        self.stop.cancel();
    }

    /// Counts `n` checks of `invariant` that passed or were made.
    pub fn checked(&self, invariant: &'static str, n: u64) {
        *self.lock().checks.entry(invariant).or_default() += n;
    }

    /// Something the harness did (not the janitor), worth saying in the report.
    pub fn note(&self, what: impl Into<String>) {
        let what = what.into();
        let at = self.elapsed();
        eprintln!("nemesis: note at +{:.1}s: {what}", at.as_secs_f64());
        self.lock().notes.push((at, what));
    }

    pub fn violations(&self) -> Vec<Violation> {
        self.lock().violations.clone()
    }

    pub fn checks(&self) -> BTreeMap<&'static str, u64> {
        self.lock().checks.clone()
    }

    pub fn notes(&self) -> Vec<(Duration, String)> {
        self.lock().notes.clone()
    }

    pub fn failed(&self) -> bool {
        !self.lock().violations.is_empty()
    }
}
