//! The report as a table: one line per run, then the targets and how each run compares.

use std::fmt;

use super::{
    route::{LookupCost, StaleCount},
    Report, Run,
};

impl Report {
    fn run(&self, name: &str) -> Option<&Run> {
        self.runs.iter().find(|r| r.name == name)
    }

    /// The header and one line per run.
    fn table(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "redis {} | layout {} | chunk_size {} | chunks_in_flight {} | latency_target_ms {}",
            self.redis_version,
            self.layout,
            self.chunk_size,
            self.chunks_in_flight,
            self.latency_target_ms
        )?;
        writeln!(f, "{}", self.calibration)?;
        writeln!(
            f,
            "{:<17} {:>9} {:>8} {:>11} {:>9} {:>10} {:>8} {:>8} {:>8} {:>9} {:>6} {:>5}",
            "run",
            "users",
            "seconds",
            "users/s",
            "cpu s",
            "cpu us/u",
            "p50 us",
            "p99 us",
            "max us",
            "rss MiB",
            "stale",
            "lost"
        )?;
        for r in &self.runs {
            writeln!(
                f,
                "{:<17} {:>9} {:>8.2} {:>11.0} {:>9.2} {:>10.2} {:>8} {:>8} {:>8} {:>9} {:>6} {:>5}",
                r.name,
                r.users,
                r.seconds,
                r.users_per_second,
                r.redis_cpu_seconds,
                r.redis_cpu_us_per_user,
                r.lookup_p50_us,
                r.lookup_p99_us,
                r.lookup_max_us,
                r.worker_peak_rss_bytes.map_or("-".into(), |b| format!("{:.1}", b as f64 / 1048576.0)),
                r.stale_left,
                r.live_lost
            )?;
        }
        writeln!(
            f,
            "(janitor, unconditional and careful: medians of {} interleaved repetitions; max us is the worst of them)",
            self.repeats.iter().filter(|r| r.name == "janitor").count()
        )
    }

    /// Each target, and where the janitor stands.
    fn targets(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.ratios;
        let max_stall = self.run("janitor").map_or(0, |j| j.lookup_max_us);
        let p99 = self.run("janitor").map_or(0, |j| j.lookup_p99_us);
        let rss = self
            .run("janitor")
            .and_then(|j| j.worker_peak_rss_bytes)
            .unwrap_or(0);
        writeln!(f, "targets:")?;
        writeln!(
            f,
            "  throughput vs unconditional ceiling {:>6.2}x  (target >= 1.4)",
            r.throughput_vs_ceiling
        )?;
        match r.redis_cpu_vs_careful {
            Some(x) => writeln!(f, "  Redis CPU per user vs careful        {x:>6.2}x  (target <= 0.6)")?,
            None => writeln!(f, "  Redis CPU per user vs careful             -  (no careful reference on a cluster)")?,
        }
        writeln!(
            f,
            "  max lookup stall                     {:>6.1} ms (target <= 3)",
            max_stall as f64 / 1000.0
        )?;
        writeln!(
            f,
            "  lookup p99                           {:>6.1} ms (target <= 1.5)",
            p99 as f64 / 1000.0
        )?;
        writeln!(
            f,
            "  worker peak memory                   {:>6.1} MB (target < 20)",
            rss as f64 / 1e6
        )?;
        match r.memory_growth {
            Some(g) => writeln!(
                f,
                "  memory growth vs baseline run        {g:>6.2}x  (target <= 1.2)"
            )?,
            None => writeln!(
                f,
                "  memory growth vs baseline run             -  (skipped)"
            )?,
        }
        writeln!(
            f,
            "  speed-up vs naive per-user loop      {:>6.1}x  (target >= 15)",
            r.speedup_vs_naive
        )?;
        if let Some(w) = &self.stale_window {
            writeln!(
                f,
                "  route: dead owner after the verdict  {:>6} of {} lookups (target 0)",
                w.route.dead_after_verdict, w.route.lookups_after_verdict
            )?;
        }
        if let Some(c) = &self.route_cost {
            writeln!(
                f,
                "  route: Redis CPU per lookup vs {:<4}  {:>6.2}x  (measured; no target)",
                self.plain_name(),
                c.cpu_ratio
            )?;
        }
        Ok(())
    }

    /// What the plain lookup is on this layout.
    fn plain_name(&self) -> &'static str {
        if self.layout == "keys" {
            "GET"
        } else {
            "HGET"
        }
    }

    /// `route` against the plain lookup, on the same registry and users.
    fn route_cost(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(c) = &self.route_cost else {
            return Ok(());
        };
        writeln!(
            f,
            "route cost: {} lookups of random users of {} (every owner alive), {} in flight, each on its own connection:",
            c.route.lookups, c.registry_users, c.in_flight
        )?;
        writeln!(
            f,
            "{:<21} {:>9} {:>8} {:>11} {:>9} {:>10} {:>10} {:>8} {:>8} {:>8} {:>6}",
            "lookup",
            "lookups",
            "seconds",
            "lookups/s",
            "cpu s",
            "cpu us/l",
            "exec us/l",
            "p50 us",
            "p99 us",
            "max us",
            "wrong"
        )?;
        let route = format!("route ({})", c.route_path);
        let line = |f: &mut fmt::Formatter<'_>, name: &str, l: &LookupCost| {
            writeln!(
                f,
                "{:<21} {:>9} {:>8.2} {:>11.0} {:>9.3} {:>10.2} {:>10} {:>8} {:>8} {:>8} {:>6}",
                name,
                l.lookups,
                l.seconds,
                l.lookups_per_second,
                l.redis_cpu_seconds,
                l.redis_cpu_us_per_lookup,
                l.redis_exec_us_per_lookup
                    .map_or("-".into(), |e| format!("{e:.2}")),
                l.p50_us,
                l.p99_us,
                l.max_us,
                l.wrong
            )
        };
        line(f, &route, &c.route)?;
        line(f, self.plain_name(), &c.plain)?;
        writeln!(
            f,
            "(medians of {} interleaved repetitions; max us the worst, wrong the sum; exec us/l: the command's own time, INFO commandstats)",
            c.repeats.len() / 2,
        )?;
        writeln!(
            f,
            "route / {}: Redis CPU per lookup {:.2}x, execution per lookup {}, p50 {:.2}x, p99 {:.2}x",
            self.plain_name(),
            c.cpu_ratio,
            c.exec_ratio.map_or("-".into(), |e| format!("{e:.2}x")),
            c.p50_ratio,
            c.p99_ratio
        )
    }

    /// What the probes of the janitor runs saw of the dead server's unmoved users.
    fn stale_window(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(w) = &self.stale_window else {
            return Ok(());
        };
        writeln!(
            f,
            "stale window (janitor runs: {}; the dead server looks alive; each probe looks up 1 of its unmoved users per ms; {:.2} s after the verdict in all):",
            w.runs, w.after_verdict_seconds
        )?;
        writeln!(
            f,
            "{:<17} {:>15} {:>12} {:>15} {:>12}",
            "probe", "before verdict", "dead owner", "after verdict", "dead owner"
        )?;
        let line = |f: &mut fmt::Formatter<'_>, name: &str, c: &StaleCount| {
            writeln!(
                f,
                "{:<17} {:>15} {:>12} {:>15} {:>12}",
                name,
                c.lookups_before_verdict,
                c.dead_before_verdict,
                c.lookups_after_verdict,
                c.dead_after_verdict
            )
        };
        line(f, "route", &w.route)?;
        line(f, self.plain_name(), &w.plain)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.table(f)?;
        self.route_cost(f)?;
        self.stale_window(f)?;
        self.targets(f)
    }
}
