//! The test harness of registry-janitor: a private `redis-server` on a free port
//! ([`RedisServer`]), a local Redis Cluster of them ([`RedisCluster`]) and a local Redis
//! Sentinel group ([`RedisSentinels`]).
//!
//! The tests start one each, so they never depend on a Redis of the machine or on a fixed
//! port; the lab's `demo` and `bench` start one when no Redis answers at `redis_url`. Not
//! part of the service: the service crate has it as a dev-dependency only.

mod cluster;
mod error;
mod sentinel;
mod server;

pub use cluster::RedisCluster;
pub use error::{Error, Result};
pub use sentinel::{RedisSentinels, SentinelProcess, MASTER_NAME};
pub use server::{cli_binary, free_port, server_binary, RedisServer};

/// A test that cannot run where it is (no cluster, no sentinels, a tool missing): under
/// CI (env `CI` set, other than `0` or `false`) it fails with `why`; elsewhere it is
/// skipped with `why` printed. The one place of that rule: call it, then return.
pub fn cannot_run(why: &str) {
    let ci = std::env::var("CI").unwrap_or_default();
    if !matches!(ci.trim().to_ascii_lowercase().as_str(), "" | "0" | "false") {
        panic!("CI is set, and this test cannot run: {why}");
    }
    eprintln!("SKIPPED: {why}");
}

/// Polls `check` every 50 ms until it is true; panics naming `what` after `timeout`.
pub async fn wait_for<F, Fut>(what: &str, timeout: std::time::Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + timeout;
    while !check().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// The value of one sample in a Prometheus text exposition (`name{labels}` as written),
/// e.g. of a worker's `/metrics`.
pub fn sample(exposition: &str, series: &str) -> Option<f64> {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
}
