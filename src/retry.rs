//! Retrying Redis work through outages and transient states: capped exponential backoff
//! with jitter, every wait cancellable, and one log line per change of state (failing,
//! recovered) rather than one per attempt.
//!
//! What is worth retrying is decided in one place, [`crate::error::redis_error_is_retryable`].
//! [`Watch`] ties a retry to its process: each failed attempt counts in
//! `registry_janitor_redis_errors_total`, beats the liveness (a loop that waits out BUSY
//! or OOM is turning, not stuck: `/healthz` stays 200), and marks the work as failing in
//! [`Failing`], which `/readyz` reads (503 while anything is failing).

use std::{future::Future, sync::Arc, time::Duration};

use backon::{BackoffBuilder, ExponentialBuilder};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    error::{Error, Result},
    health::{Failing, Health},
};

/// The backoff used everywhere: 50 ms doubling to at most 5 s, with jitter, forever
/// (until the work succeeds, fails for good or is cancelled).
pub fn policy() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_secs(5))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
}

/// Runs `op` until it succeeds or fails with an error that is not retryable. Returns
/// [`Error::Cancelled`] if `token` is cancelled while waiting or working.
pub async fn retrying<T, F, Fut>(what: &str, token: &CancellationToken, op: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    retry(what, token, None, None, None, None, op).await
}

/// [`retrying`], counting every failed attempt in `errors`.
pub async fn retrying_counted<T, F, Fut>(
    what: &str,
    token: &CancellationToken,
    errors: Option<&prometheus::IntCounter>,
    op: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    retry(what, token, errors, None, None, None, op).await
}

/// Told of every failed attempt (the reconciler's reachable-time guard).
pub type OnFailure = Arc<dyn Fn(&Error) + Send + Sync>;

/// What one process's retries report to: its error counter, its liveness and its list
/// of failing work. Cheap to clone.
#[derive(Clone)]
pub struct Watch {
    pub errors: prometheus::IntCounter,
    pub health: Arc<Health>,
    pub failing: Arc<Failing>,
    /// Told of every failed attempt: the reconciler's guard takes a failed call for a
    /// Redis outage (see `guard::reachable`); `None` elsewhere.
    pub on_failure: Option<OnFailure>,
}

impl Watch {
    /// [`retrying`], reported to this process's metrics, liveness and readiness.
    pub async fn retrying<T, F, Fut>(
        &self,
        what: &str,
        token: &CancellationToken,
        op: F,
    ) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        retry(
            what,
            token,
            Some(&self.errors),
            Some(&self.health),
            Some(&self.failing),
            self.on_failure.as_ref(),
            op,
        )
        .await
    }

    /// A failing episode of `what` reported to this process's readiness.
    pub fn episode<'a>(&'a self, what: &'a str) -> Episode<'a> {
        Episode::new(what, Some(&self.failing))
    }
}

async fn retry<T, F, Fut>(
    what: &str,
    token: &CancellationToken,
    errors: Option<&prometheus::IntCounter>,
    health: Option<&Health>,
    failing: Option<&Failing>,
    on_failure: Option<&OnFailure>,
    mut op: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut backoff = policy().build();
    let mut episode = Episode::new(what, failing);
    loop {
        let attempt = tokio::select! {
            r = op() => r,
            _ = token.cancelled() => return Err(Error::Cancelled),
        };
        let e = match attempt {
            Ok(v) => {
                episode.recovered();
                return Ok(v);
            }
            Err(e) if e.is_retryable() => e,
            Err(e) => return Err(e),
        };
        if let Some(errors) = errors {
            errors.inc();
        }
        if let Some(on_failure) = on_failure {
            on_failure(&e);
        }
        if let Some(health) = health {
            health.beat();
        }
        let wait = backoff.next().unwrap_or(Duration::from_secs(5));
        episode.failed(&e, wait);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = token.cancelled() => return Err(Error::Cancelled),
        }
    }
}

/// One task's run of failures of `what`: logs once when it starts failing and once when
/// it recovers; while it fails, `what` is listed in [`Failing`] (if given). Dropped while
/// failing (cancelled, or ended by an error that is not retryable), it leaves the list
/// without a "recovered" line.
pub struct Episode<'a> {
    what: &'a str,
    failing: bool,
    shared: Option<&'a Failing>,
}

impl<'a> Episode<'a> {
    pub fn new(what: &'a str, shared: Option<&'a Failing>) -> Self {
        Episode {
            what,
            failing: false,
            shared,
        }
    }

    /// An attempt failed with a transient error; the next one is in `retry_in`.
    pub fn failed(&mut self, error: &Error, retry_in: Duration) {
        if self.failing {
            if let Some(shared) = self.shared {
                shared.update(self.what, error.to_string());
            }
            return;
        }
        self.failing = true;
        let first = self
            .shared
            .is_none_or(|s| s.start(self.what, error.to_string()));
        if first {
            let what = self.what;
            warn!(error = %error, ?retry_in, "{what} failing, retrying with backoff");
        }
    }

    /// An attempt succeeded.
    pub fn recovered(&mut self) {
        if !std::mem::take(&mut self.failing) {
            return;
        }
        if self.shared.is_none_or(|s| s.end(self.what)) {
            let what = self.what;
            info!("{what} recovered");
        }
    }
}

impl Drop for Episode<'_> {
    fn drop(&mut self) {
        if self.failing {
            if let Some(shared) = self.shared {
                shared.end(self.what);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn busy() -> Error {
        Error::Redis(
            redis::parse_redis_value(b"-BUSY Redis is busy running a script.\r\n")
                .unwrap()
                .extract_error()
                .unwrap_err(),
        )
    }

    /// Two tasks failing at the same work: listed until the last recovers.
    #[test]
    fn work_is_failing_until_its_last_task_recovers() {
        let failing = Failing::default();
        let mut a = Episode::new("acknowledging", Some(&failing));
        let mut b = Episode::new("acknowledging", Some(&failing));
        a.failed(&busy(), Duration::ZERO);
        b.failed(&busy(), Duration::ZERO);
        a.failed(&busy(), Duration::ZERO);
        assert_eq!(failing.any().unwrap().0, "acknowledging");
        a.recovered();
        assert!(failing.any().is_some());
        drop(b);
        assert_eq!(failing.any(), None);
    }

    #[tokio::test]
    async fn a_retry_waits_out_transient_errors_and_reports_them() {
        let watch = Watch {
            errors: prometheus::IntCounter::new("e", "e").unwrap(),
            health: Health::new(Duration::from_secs(60)),
            failing: Failing::new(),
            on_failure: None,
        };
        let token = CancellationToken::new();
        let mut attempts = 0;
        let seen = watch.failing.clone();
        let done = watch
            .retrying("work", &token, || {
                attempts += 1;
                let (n, listed) = (attempts, seen.any().is_some());
                async move {
                    assert_eq!(listed, n > 1, "listed as failing from the first failure on");
                    if n < 4 {
                        Err(busy())
                    } else {
                        Ok(n)
                    }
                }
            })
            .await;
        assert_eq!(done.unwrap(), 4);
        assert_eq!(watch.errors.get(), 3);
        assert_eq!(watch.failing.any(), None);
    }
}
