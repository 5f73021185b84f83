//! Retrying Redis work through outages: capped exponential backoff with jitter, every
//! wait cancellable, and one log line per change of state (failing, recovered) rather
//! than one per attempt.

use std::{
    future::Future,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use backon::{ExponentialBuilder, Retryable};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

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
    retrying_counted(what, token, None, op).await
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
    let failing = AtomicBool::new(false);
    let attempt = op
        .retry(policy())
        .sleep(tokio::time::sleep)
        .when(Error::is_retryable)
        .notify(|e, wait| {
            if let Some(errors) = errors {
                errors.inc();
            }
            if !failing.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %e, retry_in = ?wait, "{what} failing, retrying with backoff");
            }
        });
    let result = tokio::select! {
        r = attempt => r,
        _ = token.cancelled() => Err(Error::Cancelled),
    };
    if failing.load(Ordering::Relaxed) && result.is_ok() {
        tracing::info!("{what} recovered");
    }
    result
}
