//! What the benchmark measures beside the work: routing lookup latencies on a connection
//! of their own, Redis main-thread CPU (INFO cpu), and a worker process's peak RSS (Linux
//! /proc).

use std::time::{Duration, Instant};

use registry_janitor::{
    config::{Layout, Settings},
    conn::{self, RedisConn},
    error::Result,
    keys::Keys,
};
use tokio_util::sync::CancellationToken;

/// The Redis version (INFO server); on a cluster, of one master, since INFO would go to
/// every node.
pub(super) async fn redis_version(settings: &Settings, conn: &RedisConn) -> Result<String> {
    let one_node = match conn::cluster_masters(conn).await {
        Ok(masters) if conn.is_cluster() && !masters.is_empty() => {
            conn::shared(&conn::node_client(settings, &masters[0].0, masters[0].1)?)?
        }
        _ => conn.clone(),
    };
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut one_node.clone())
        .await?;
    Ok(info_field(&info, "redis_version").unwrap_or_default())
}

/// Redis main-thread CPU seconds so far.
pub(super) async fn redis_cpu(settings: &Settings, conn: &RedisConn) -> Result<f64> {
    if !conn.is_cluster() {
        return node_cpu(conn).await;
    }
    // Every master's main thread: the cleanup spreads over all of them.
    let mut total = 0.0;
    for (host, port) in conn::cluster_masters(conn).await? {
        total += node_cpu(&conn::shared(&conn::node_client(settings, &host, port)?)?).await?;
    }
    Ok(total)
}

/// Main-thread CPU seconds of one Redis node so far.
async fn node_cpu(node: &RedisConn) -> Result<f64> {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(&mut node.clone())
        .await?;
    let field = |name: &str| info_field(&info, name).and_then(|v| v.parse::<f64>().ok());
    Ok(
        match (
            field("used_cpu_user_main_thread"),
            field("used_cpu_sys_main_thread"),
        ) {
            (Some(u), Some(s)) => u + s,
            _ => field("used_cpu_user").unwrap_or(0.0) + field("used_cpu_sys").unwrap_or(0.0),
        },
    )
}

/// Calls of `command` (lower case, e.g. `hget`, `evalsha`) and the microseconds Redis
/// spent executing them, so far (INFO commandstats; one node). Execution only: reading
/// the request and writing the reply are not in it.
pub(super) async fn command_usec(conn: &RedisConn, command: &str) -> Result<(u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn.clone())
        .await?;
    let Some(stats) = info_field(&info, &format!("cmdstat_{command}")) else {
        return Ok((0, 0));
    };
    let field = |name: &str| {
        stats
            .split(',')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Ok((field("calls"), field("usec")))
}

fn info_field(info: &str, name: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_owned())
}

/// Issues one routing lookup per millisecond on its own connection until stopped;
/// returns each lookup's (unix ms when sent, latency in microseconds).
pub(super) async fn probe_lookups(
    target: conn::Target,
    scene_keys: Keys,
    layout: Layout,
    targets: Vec<Vec<u8>>,
    stop: CancellationToken,
) -> Result<Vec<(u64, u64)>> {
    // A connection of its own (a new one, of the same kind as the janitor's).
    let mut c = conn::shared_for(&target).await?;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut latencies = Vec::with_capacity(16_384);
    let mut i = 0;
    while !stop.is_cancelled() {
        tick.tick().await;
        let user = &targets[i % targets.len()];
        i += 1;
        let started = Instant::now();
        let at_ms = registry_janitor::now_ms();
        let _: Option<String> =
            crate::bench::runs::forward_cmd(&scene_keys, layout, user, "HGET", "GET")
                .query_async(&mut c)
                .await?;
        latencies.push((at_ms, started.elapsed().as_micros() as u64));
    }
    Ok(latencies)
}

/// The median of `f` over `of` (the upper one of an even count); 0 if `of` is empty.
pub(super) fn median_by<R, T: Copy + PartialOrd + Default>(of: &[&R], f: impl Fn(&R) -> T) -> T {
    let mut values: Vec<T> = of.iter().map(|r| f(r)).collect();
    values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    values.get(values.len() / 2).copied().unwrap_or_default()
}

/// The `p` quantile (0..=1) of `sorted` latencies; 0 if there are none.
pub(super) fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted
        .get(((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0)
}

/// VmHWM of a process, in bytes (Linux).
pub(super) fn peak_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}
