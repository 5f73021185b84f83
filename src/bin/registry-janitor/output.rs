//! What `status`, `dead-letters`, `held`, `format` and `emit` print: text for people, JSON
//! for scripts.
//! Presentation only; the library collects the data.

use std::fmt;

use registry_janitor::{
    dead_letters::DeadLetter,
    format::{FormatStatus, SetOutcome},
    guard::{Hold, HoldState},
    keys::GROUP,
    status::Status,
};

/// `emit`: the new entry's id, alone on its line.
pub fn emitted(id: &str) {
    println!("{id}");
}

/// `status`: the report as text, or as pretty JSON.
pub fn status(report: &Status, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print!("{}", StatusText(report));
    }
    Ok(())
}

/// `dead-letters list`: one block per dead letter and a count, or pretty JSON.
pub fn dead_letters(letters: &[DeadLetter], json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(letters)?);
        return Ok(());
    }
    for d in letters {
        println!(
            "{}  type={}  server_id={}  failed_at_ms={}\n    error: {}",
            d.id,
            d.kind.as_deref().unwrap_or("-"),
            d.server_id.as_deref().unwrap_or("-"),
            d.failed_at_ms.map_or("-".into(), |t| t.to_string()),
            d.error
        );
    }
    println!("{} dead letter(s) shown", letters.len());
    Ok(())
}

/// `dead-letters replay`: `old -> new` per replayed dead letter.
pub fn replayed(pairs: &[(String, String)]) {
    for (old, new) in pairs {
        println!("{old} -> {new}");
    }
}

/// `dead-letters purge`.
pub fn purged(n: u64) {
    println!("{n} dead letter(s) purged");
}

/// `held list`: one line per held verdict and a count, or pretty JSON.
pub fn holds(holds: &[Hold], json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(holds)?);
        return Ok(());
    }
    let now = registry_janitor::now_ms();
    for hold in holds {
        println!("{}", HoldLine(hold, now));
    }
    println!("{} held verdict(s)", holds.len());
    Ok(())
}

/// `format status`: the format in use, this build's, and each worker's announcement, or
/// pretty JSON.
pub fn format_status(status: &FormatStatus, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(status)?);
        return Ok(());
    }
    let recorded = if status.recorded {
        ""
    } else {
        " (never moved or set: the format of a deployment that started at format 1)"
    };
    println!("format in use   {}{recorded}", status.in_use);
    println!("this build      {}", status.build.describe());
    let live = status.workers.iter().filter(|w| w.live).count();
    println!(
        "workers         {live} live (announced within {} ms), {} gone",
        status.live_ms,
        status.workers.len() - live
    );
    for w in &status.workers {
        let under = if (w.min..=w.format).contains(&status.in_use) {
            "works under the format in use"
        } else if status.in_use > w.format {
            "BEHIND: takes no work"
        } else {
            "too new for the format in use: takes no work"
        };
        println!(
            "  {:<40} format {} (works under {} to {})  {}  {under}",
            w.consumer,
            w.format,
            w.min,
            w.format,
            if w.live { "live" } else { "gone" },
        );
        println!(
            "  {:<40} seen {} ms ago, announced for {} ms",
            "",
            status.now_ms.saturating_sub(w.seen_ms),
            w.seen_ms.saturating_sub(w.since_ms)
        );
    }
    Ok(())
}

/// `format set`: what changed, or why it was refused (an error).
pub fn format_set(n: u32, outcome: &SetOutcome, live_ms: u64) -> anyhow::Result<()> {
    let cannot: Vec<String> = outcome
        .cannot
        .iter()
        .map(|(c, f, m)| format!("{c} (format {f}, works under {m} to {f})"))
        .collect();
    if !outcome.set {
        let mut why = Vec::new();
        if !cannot.is_empty() {
            why.push(format!(
                "live workers cannot work under format {n}: {}",
                cannot.join(", ")
            ));
        }
        if outcome.moves_back {
            why.push(format!(
                "live workers of a newer format are announced and none of format {n}: they \
                 would move the format forward again at once (start a worker of format {n} \
                 first, or stop them)"
            ));
        }
        anyhow::bail!(
            "format {n} not set (format {} stays in use): {}; live: announced within {live_ms} ms; \
             --force sets it anyway",
            outcome.previous,
            why.join("; ")
        );
    }
    println!("format in use: {} -> {n}", outcome.previous);
    if !cannot.is_empty() {
        println!(
            "forced: these live workers take no work under format {n}: {}",
            cannot.join(", ")
        );
    }
    if outcome.moves_back {
        println!(
            "forced: live workers of a newer format will move it forward again unless a \
             worker of format {n} is announced"
        );
    }
    Ok(())
}

/// One held verdict on one line.
struct HoldLine<'a>(&'a Hold, u64);

impl fmt::Display for HoldLine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (h, now) = (self.0, self.1);
        let state = match h.state {
            HoldState::Held => "held",
            HoldState::Released => "released",
            HoldState::Discarding => "discarding",
        };
        write!(
            f,
            "{:<40} {state:<8} {:<12} for {} s  entry {}  source {}: {}",
            h.server_id,
            h.doubt.as_str(),
            now.saturating_sub(h.since_ms) / 1000,
            h.entry,
            h.source.as_deref().unwrap_or("-"),
            h.detail
        )
    }
}

/// The status as an on-call engineer reads it.
struct StatusText<'a>(&'a Status);

impl fmt::Display for StatusText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let now = registry_janitor::now_ms();
        self.stream(f)?;
        self.servers(f)?;
        self.fences(f, now)?;
        self.held(f, now)?;
        self.evictions(f)?;
        self.format(f)
    }
}

impl StatusText<'_> {
    /// The events stream, the group, its consumers, the dead letters.
    fn stream(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0;
        writeln!(
            f,
            "stream          {} ({} entries)",
            s.stream, s.stream_length
        )?;
        if !s.group_exists {
            writeln!(
                f,
                "group           {GROUP}: not created yet (no worker has started)"
            )?;
        } else {
            let lag = s.lag.map_or("unknown".to_owned(), |l| l.to_string());
            writeln!(
                f,
                "group           {GROUP}: lag {lag}, pending {}",
                s.pending
            )?;
        }
        writeln!(f, "consumers       {}", s.consumers.len())?;
        for c in &s.consumers {
            writeln!(
                f,
                "  {:<40} pending {:>6}  idle {:>8} ms",
                c.name, c.pending, c.idle_ms
            )?;
        }
        writeln!(f, "dead letters    {}", s.dead_letters)
    }

    /// The data format in use, and the live workers by format.
    fn format(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(format) = &self.0.format else {
            return Ok(());
        };
        let by_format: Vec<String> = format
            .live_by_format()
            .iter()
            .map(|(n, count)| format!("{count} of format {n}"))
            .collect();
        let workers = if by_format.is_empty() {
            "none".to_owned()
        } else {
            by_format.join(", ")
        };
        writeln!(
            f,
            "data format     {} in use; live workers: {workers}",
            format.in_use
        )
    }

    /// The servers known and dead, and the last Redis outage the reconciler saw.
    fn servers(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0;
        write!(f, "servers known   {}", s.servers_known)?;
        match s.servers_dead {
            Some(dead) => writeln!(f, " ({dead} dead, not yet cleaned)")?,
            None => writeln!(f)?,
        }
        if let Some(r) = &s.reachable {
            match (r.reachable_since_ms, r.verdicts_wait_ms) {
                (0, _) => writeln!(f, "redis outages   none seen by the reconciler")?,
                (since, 0) => writeln!(f, "redis outages   last one ended at {since} (unix ms)")?,
                (since, wait) => writeln!(
                    f,
                    "redis outages   one ended at {since} (unix ms): verdicts on silent servers wait {wait} ms more"
                )?,
            }
        }
        Ok(())
    }

    /// The fenced servers, and those that tried to write after their verdict.
    fn fences(&self, f: &mut fmt::Formatter<'_>, now: u64) -> fmt::Result {
        let s = self.0;
        if let Some(fenced) = s.fenced {
            writeln!(
                f,
                "fenced          {fenced} ({} tried to write after their verdict)",
                s.fenced_still_writing.len()
            )?;
        }
        for fence in s.fenced_still_writing.iter().take(20) {
            let last = fence.last_refused_ms.unwrap_or(0);
            let state = if fence.writing(now, s.writing_window_ms) {
                "STILL WRITING (false positive or zombie)"
            } else {
                "quiet now"
            };
            writeln!(
                f,
                "  {:<40} refused: {} register, {} heartbeat, {} unregister; last {} ms ago: {state}",
                fence.server_id,
                fence.refused_register,
                fence.refused_heartbeat,
                fence.refused_unregister,
                now.saturating_sub(last)
            )?;
        }
        Ok(())
    }

    /// The verdicts the guard holds.
    fn held(&self, f: &mut fmt::Formatter<'_>, now: u64) -> fmt::Result {
        let s = self.0;
        write!(f, "held verdicts   {}", s.held.len())?;
        if s.held.is_empty() {
            writeln!(f)?;
        } else {
            writeln!(
                f,
                " (doubtful: not fenced, not cleaned; `registry-janitor held list`)"
            )?;
        }
        for hold in s.held.iter().take(20) {
            writeln!(f, "  {}", HoldLine(hold, now))?;
        }
        Ok(())
    }

    /// The evictions stream and its groups, when it is on.
    fn evictions(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(ev) = &self.0.evictions {
            writeln!(f, "evictions       {} ({} entries)", ev.stream, ev.length)?;
            for g in &ev.groups {
                let lag = g.lag.map_or("unknown".to_owned(), |l| l.to_string());
                writeln!(f, "  group {:<34} lag {lag}, pending {}", g.name, g.pending)?;
            }
        }
        Ok(())
    }
}
