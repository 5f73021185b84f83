//! What the zone benchmark measures beside the work: Redis's SLOWLOG, the workers' CPU
//! time, and the lookup probe, a process of its own (`bench-probe`).

use registry_janitor::{
    config::Settings,
    conn::{self, RedisConn},
    error::{Error, Result},
    keys::Keys,
};
use tokio::{io::AsyncWriteExt, process::Child};

use registry_janitor_testkit::sample;

use super::scene::live_user;
use crate::cli::ProbeOptions;

/// Redis's SLOWLOG over a run: every command of 1 ms or more is kept (up to 4,096).
pub(super) struct Slowest {
    pub(super) max_us: u64,
    pub(super) command: String,
    pub(super) over_5ms: u64,
}

/// The nodes whose SLOWLOG counts: the one node, or every master of a cluster (the
/// commands of a cluster walk and the lookups spread over them).
pub(super) async fn slowlog_nodes(settings: &Settings, conn: &RedisConn) -> Result<Vec<RedisConn>> {
    if !conn.is_cluster() {
        return Ok(vec![conn.clone()]);
    }
    conn::cluster_masters(conn)
        .await?
        .into_iter()
        .map(|(host, port)| conn::shared(&conn::node_client(settings, &host, port)?))
        .collect()
}

/// [`slowlog_reset`] on each of `nodes`.
pub(super) async fn slowlogs_reset(nodes: &[RedisConn]) -> Result<()> {
    for node in nodes {
        slowlog_reset(node).await?;
    }
    Ok(())
}

/// [`slowlog_read`] of each of `nodes`, together: the slowest of all, and every command
/// over 5 ms.
pub(super) async fn slowlogs_read(nodes: &[RedisConn]) -> Result<Slowest> {
    let mut all = Slowest {
        max_us: 0,
        command: String::new(),
        over_5ms: 0,
    };
    for node in nodes {
        let one = slowlog_read(node).await?;
        all.over_5ms += one.over_5ms;
        if one.max_us > all.max_us {
            (all.max_us, all.command) = (one.max_us, one.command);
        }
    }
    Ok(all)
}

async fn slowlog_reset(conn: &RedisConn) -> Result<()> {
    redis::pipe()
        .cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(1000)
        .ignore()
        .cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-max-len")
        .arg(4096)
        .ignore()
        .cmd("SLOWLOG")
        .arg("RESET")
        .ignore()
        .query_async::<()>(&mut conn.clone())
        .await?;
    Ok(())
}

async fn slowlog_read(conn: &RedisConn) -> Result<Slowest> {
    // Each entry: id, unix time, duration in us, [command, args...], client addr, name.
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(4096)
        .query_async(&mut conn.clone())
        .await?;
    let mut out = Slowest {
        max_us: 0,
        command: String::new(),
        over_5ms: 0,
    };
    for entry in entries {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let us: u64 = fields
            .get(2)
            .and_then(|v| redis::from_redis_value_ref(v).ok())
            .unwrap_or(0);
        let argv: Vec<Vec<u8>> = fields
            .get(3)
            .and_then(|v| redis::from_redis_value_ref(v).ok())
            .unwrap_or_default();
        // The benchmark's own SLOWLOG RESET (it frees the previous run's entries).
        if argv
            .first()
            .is_some_and(|c| c.eq_ignore_ascii_case(b"slowlog"))
        {
            continue;
        }
        if us > 5000 {
            out.over_5ms += 1;
        }
        if us > out.max_us {
            out.max_us = us;
            out.command = argv
                .iter()
                .take(2)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ");
        }
    }
    Ok(out)
}

/// utime + stime of a process, in seconds (Linux /proc; 100 ticks a second).
pub(super) fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// The probe process: closing its stdin stops it; it prints its latencies.
pub(super) struct Probe {
    pub(super) child: Child,
}

impl Probe {
    /// (unix ms when sent, latency in us) of every lookup.
    pub(super) async fn finish(mut self) -> Result<Vec<(u64, u64)>> {
        drop(self.child.stdin.take());
        let out = self
            .child
            .wait_with_output()
            .await
            .map_err(|e| Error::io("waiting for the lookup probe", e))?;
        if !out.status.success() {
            return Err(Error::io(
                "the lookup probe",
                std::io::Error::other(format!("exited with {}", out.status)),
            ));
        }
        serde_json::from_slice(&out.stdout).map_err(|e| {
            Error::io(
                "reading the lookup probe's latencies",
                std::io::Error::other(e),
            )
        })
    }
}

/// `registry-janitor-lab bench-probe`: one routing lookup (HGET/GET of a live user) per
/// millisecond until stdin closes, then each lookup's (unix ms when sent, latency in
/// microseconds), as a JSON array on stdout.
pub async fn probe(settings: &Settings, options: &ProbeOptions) -> Result<()> {
    let keys = Keys::new(settings.key_prefix.clone());
    let target = conn::target_for(settings)?;
    let stop = tokio_util::sync::CancellationToken::new();
    let watch = stop.clone();
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 64];
        while let Ok(n) = stdin.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
        watch.cancel();
    });
    let users: Vec<Vec<u8>> = (0..options.users.max(1))
        .map(|n| live_user(settings.layout, n))
        .collect();
    let latencies =
        crate::bench::probe::probe_lookups(target, keys, settings.layout, users, stop).await?;
    let mut out = tokio::io::stdout();
    let json = serde_json::to_vec(&latencies).expect("numbers serialize");
    out.write_all(&json)
        .await
        .map_err(|e| Error::io("writing the latencies", e))?;
    out.flush()
        .await
        .map_err(|e| Error::io("writing the latencies", e))?;
    Ok(())
}

/// Sums of two histograms over the workers' `/metrics`: the time the ends of cluster
/// walks waited for replicas, and the time of whole cleanups (start to acknowledgement).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct WorkerTimes {
    pub(super) replica_wait_seconds: f64,
    pub(super) cleanup_seconds: f64,
}

/// [`WorkerTimes`] summed over the workers whose metrics listen on `addrs`, once they
/// have recorded `cleanups` cleanups between them (a worker records a cleanup's time
/// right after its acknowledgement), or after 10 s with what they have: a worker whose
/// metrics cannot be read counts nothing, with a warning.
pub(super) async fn worker_times(addrs: &[String], cleanups: usize) -> WorkerTimes {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (mut times, mut recorded, mut unread) = (WorkerTimes::default(), 0.0, Vec::new());
        for addr in addrs {
            match get_metrics(addr).await {
                Ok(text) => {
                    times.replica_wait_seconds +=
                        sample(&text, "registry_janitor_cluster_replica_wait_seconds_sum")
                            .unwrap_or(0.0);
                    times.cleanup_seconds +=
                        sample(&text, "registry_janitor_cleanup_duration_seconds_sum")
                            .unwrap_or(0.0);
                    recorded += sample(&text, "registry_janitor_cleanup_duration_seconds_count")
                        .unwrap_or(0.0);
                }
                Err(e) => unread.push(e.to_string()),
            }
        }
        if recorded >= cleanups as f64 || std::time::Instant::now() > deadline {
            if !unread.is_empty() || recorded < cleanups as f64 {
                eprintln!(
                    "zone benchmark: the workers' metrics show {recorded} of {cleanups} cleanups; unread: {}",
                    unread.join("; ")
                );
            }
            return times;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// The body of `GET /metrics` at `addr` (HTTP/1.0, so that the body is never chunked).
async fn get_metrics(addr: &str) -> Result<String> {
    use tokio::io::AsyncReadExt;
    let io = |e| Error::io(format!("reading a worker's metrics at {addr}"), e);
    let mut stream = tokio::net::TcpStream::connect(addr).await.map_err(io)?;
    stream
        .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .map_err(io)?;
    let mut raw = String::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        stream.read_to_string(&mut raw),
    )
    .await
    .map_err(|_| io(std::io::ErrorKind::TimedOut.into()))?
    .map_err(io)?;
    Ok(raw
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default())
}
