//! The zone report as a table.

use std::fmt;

use super::ZoneReport;

impl fmt::Display for ZoneReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on = match self.cluster_masters {
            0 => "one node".to_owned(),
            masters => format!("a local cluster of {masters} masters"),
        };
        writeln!(
            f,
            "redis {} on {on} | zone of {} servers x {} users | {} workers x concurrency {} x chunks_in_flight {} | chunk_size {}",
            self.redis_version,
            self.servers,
            self.users_per_server,
            self.workers,
            self.concurrency,
            self.chunks_in_flight,
            self.chunk_size
        )?;
        writeln!(f, "workers: {}", self.worker_exe)?;
        writeln!(f, "{}", self.calibration)?;
        writeln!(
            f,
            "{:>6} {:<14} {:<4} {:>4} {:<6} {:>9} {:>10} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>6} {:>5} {:>5}",
            "target", "order", "wait", "busy", "run", "users", "users/s", "p50 us", "p99 us", "max us",
            "win p50", "win p99", "win mean", "rss MiB", "cpu s/M", "acked", "stale", "lost"
        )?;
        for s in &self.settings {
            // The setting's columns, at the head of each of its lines.
            let knobs = format!(
                "{:>6} {:<14} {:<4} {:>4}",
                s.knobs.latency_target_ms,
                s.knobs.step_order,
                wait(s.knobs.replica_wait),
                s.knobs.busy_cores
            );
            for r in [&s.zone, &s.single] {
                writeln!(
                    f,
                    "{} {:<6} {:>9} {:>10.0} {:>8} {:>8} {:>8} {:>8.0}ms {:>7.0}ms {:>7.0}ms {:>8.1} {:>8.2} {:>6} {:>5} {:>5}",
                    knobs,
                    r.name,
                    r.users,
                    r.users_per_second,
                    r.lookup_p50_us,
                    r.lookup_p99_us,
                    r.lookup_max_us,
                    r.stale_window_p50_ms,
                    r.stale_window_p99_ms,
                    r.stale_window_mean_ms,
                    r.worker_peak_rss_bytes as f64 / (1 << 20) as f64,
                    r.worker_cpu_seconds_per_million_users,
                    format!("{}/{}", r.acknowledged, r.servers),
                    r.stale_left,
                    r.live_lost
                )?;
            }
            writeln!(
                f,
                "{} throughput vs one server alone: {:.2}x; lookups with Redis idle (the machine's floor): p50 {} us, p99 {} us, max {} us",
                knobs,
                s.throughput_vs_single,
                s.zone.idle_lookup_p50_us,
                s.zone.idle_lookup_p99_us,
                s.zone.idle_lookup_max_us
            )?;
            writeln!(
                f,
                "{} slowest command in Redis while the zone was cleaned: {} us ({}), {} over 5 ms",
                knobs,
                s.zone.redis_slowest_us,
                s.zone.redis_slowest_command,
                s.zone.redis_commands_over_5ms
            )?;
            if self.cluster_masters == 0 {
                continue; // one node: no replica wait
            }
            writeln!(
                f,
                "{} time in the replica wait, of the cleanups' time: zone {:.2}% ({:.3} s of {:.3} s), single {:.2}% ({:.3} s of {:.3} s)",
                knobs,
                s.zone.replica_wait_share * 100.0,
                s.zone.replica_wait_seconds,
                s.zone.cleanup_seconds,
                s.single.replica_wait_share * 100.0,
                s.single.replica_wait_seconds,
                s.single.cleanup_seconds
            )?;
        }
        Ok(())
    }
}

/// `cluster_replica_wait` in a column.
fn wait(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}
