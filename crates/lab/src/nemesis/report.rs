//! What a run prints: its header (the seed, how to replay it, the schedule), and its
//! summary (faults by kind, load, deaths, checks made, processes, violations). A
//! violation adds the seed, the schedule up to it with what each fault did, and the keys
//! involved.

use std::{collections::BTreeMap, path::Path, sync::atomic::Ordering::Relaxed, time::Duration};

use registry_janitor::config::Settings;

use super::{
    fleet::{Fleet, State},
    observer::{Class, Observer},
    procs::Janitors,
    schedule::{Kind, Schedule},
    topology::Topology,
    verdicts::Verdicts,
};
use crate::cli::NemesisOptions as Options;

/// The command that replays a run (`partitions`: whether its schedule has them).
pub fn replay(seed: u64, options: &Options, layout: &str, partitions: bool) -> String {
    let mut line = format!(
        "registry-janitor-lab nemesis --seed {seed} --duration {}s --layout {layout}",
        options.duration.as_secs()
    );
    if options.topology != crate::cli::TopologyName::Node {
        let topology = clap::ValueEnum::to_possible_value(&options.topology)
            .map(|v| v.get_name().to_owned())
            .unwrap_or_default();
        line.push_str(&format!(" --topology {topology}"));
    }
    let defaults = [
        (options.workers, 3, "--workers"),
        (options.servers, 12, "--servers"),
        (options.zones, 3, "--zones"),
        (options.entries, 2000, "--entries"),
        (options.rate as usize, 150, "--rate"),
    ];
    for (value, default, flag) in defaults {
        if value != default {
            line.push_str(&format!(" {flag} {value}"));
        }
    }
    // A root machine draws partitions on one node unless told not to.
    if options.topology == crate::cli::TopologyName::Node && !partitions {
        line.push_str(" --no-partitions");
    }
    line
}

/// The header; `network` says where the janitor's processes run, and whether
/// partitions are drawn.
pub fn header(
    seed: u64,
    options: &Options,
    settings: &Settings,
    topology: &Topology,
    schedule: &Schedule,
    network: &str,
) {
    println!(
        "nemesis: seed {seed}, {}s of faults on {}, layout {}",
        options.duration.as_secs(),
        topology.describe(),
        settings.layout.as_str()
    );
    println!(
        "  {} worker processes and a reconciler; {} connection servers in {} zones; {} entries; {} operations/s",
        options.workers, options.servers, options.zones, options.entries, options.rate
    );
    println!("  {network}");
    println!(
        "  replay: {}",
        replay(seed, options, settings.layout.as_str(), schedule.partitions)
    );
    let counts: Vec<String> = schedule
        .counts()
        .iter()
        .map(|(k, n)| format!("{} {n}", k.name()))
        .collect();
    println!(
        "schedule ({} faults: {}):",
        schedule.faults.len(),
        counts.join(", ")
    );
    for (i, p) in schedule.faults.iter().enumerate() {
        println!("  #{i:<3} +{:>6.1}s  {}", p.at.as_secs_f64(), p.fault);
    }
}

pub struct Inputs<'a> {
    pub seed: u64,
    pub options: &'a Options,
    pub schedule: &'a Schedule,
    pub applied: &'a [(usize, Duration, String)],
    pub verdicts: &'a Verdicts,
    pub fleet: &'a Fleet,
    pub observer: &'a Observer,
    pub janitors: &'a Janitors,
    pub settled_in: Option<Duration>,
    pub logs: Option<&'a Path>,
    /// What was done to Redis itself ([`Topology::summary`]).
    pub redis: Option<&'a str>,
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1 << 20) as f64)
}

pub fn summary(i: &Inputs<'_>) {
    let violations = i.verdicts.violations();
    let layout = i.fleet.params.layout.as_str();
    println!("nemesis summary (seed {}):", i.seed);
    // Faults by kind: drawn, applied, skipped.
    let mut by_kind: BTreeMap<Kind, (usize, usize)> = BTreeMap::new();
    for p in &i.schedule.faults {
        by_kind.entry(p.fault.kind()).or_default().0 += 1;
    }
    let mut skipped = 0;
    for (index, _, note) in i.applied {
        let kind = i.schedule.faults[*index].fault.kind();
        if note.starts_with("skipped") {
            skipped += 1;
        } else {
            by_kind.entry(kind).or_default().1 += 1;
        }
    }
    println!(
        "  faults      {} drawn, {} applied, {} skipped (not applicable when their time came)",
        i.schedule.faults.len(),
        i.applied.len() - skipped,
        skipped
    );
    let kinds: Vec<String> = by_kind
        .iter()
        .map(|(k, (drawn, applied))| format!("{} {applied}/{drawn}", k.name()))
        .collect();
    for chunk in kinds.chunks(4) {
        println!("              {}", chunk.join(", "));
    }
    if let Some(line) = i.redis {
        println!("  redis       {line}");
    }
    let s = &i.fleet.stats;
    println!(
        "  load        {} registrations ({} reconnects), {} moves, {} unregisters, {} lookups; \
         {} without an answer (uncertain), {} refused FENCED",
        s.registers.load(Relaxed),
        s.reconnects.load(Relaxed),
        s.moves.load(Relaxed),
        s.unregisters.load(Relaxed),
        s.routes.load(Relaxed),
        s.op_errors.load(Relaxed),
        s.refused_fenced.load(Relaxed)
    );
    let t = i.fleet.truth();
    let mut deaths: BTreeMap<&str, usize> = BTreeMap::new();
    for server in t
        .servers
        .values()
        .filter(|s| s.state == State::Dead || s.state == State::Zombie)
    {
        *deaths.entry(server.how).or_default() += 1;
    }
    let died: usize = deaths.values().sum();
    println!(
        "  servers     {} started, {} died ({}), {} cleaned and acknowledged; {} zombies told FENCED; \
         {} server.dead from monitoring",
        s.servers_started.load(Relaxed),
        died,
        deaths
            .iter()
            .map(|(how, n)| format!("{how} {n}"))
            .collect::<Vec<_>>()
            .join(", "),
        i.observer.acked.len(),
        s.zombies_told.load(Relaxed),
        s.monitoring_events.load(Relaxed)
    );
    let (mut valid, mut foreign, mut malformed) = (0, 0, 0);
    for e in &i.observer.events {
        match e.class {
            Class::Dead(_) => valid += 1,
            Class::Foreign => foreign += 1,
            Class::Malformed(_) => malformed += 1,
        }
    }
    println!(
        "  events      {} on the stream: {valid} server.dead, {malformed} malformed ({} dead-lettered with a reason), \
         {foreign} of another type",
        i.observer.events.len(),
        i.observer.dead_letters.len()
    );
    println!(
        "  evictions   {} entries announced ({} distinct), {} server.cleaned; registrations found {} \
         entries deleted by the janitor and {} kept",
        i.observer.announced_entries,
        i.observer.announced_pairs(),
        i.observer.cleaned_entries,
        s.found_deleted.load(Relaxed),
        s.found_kept.load(Relaxed)
    );
    if i.fleet.cluster {
        println!(
            "  cluster     {} deletions found unannounced after a worker was SIGKILLed (the \
             documented gap); {} entries named an acknowledged server until a later pass \
             deleted them (longest {:.1}s)",
            i.observer.unannounced_after_kill,
            i.observer.swept_late,
            i.observer.swept_late_max.as_secs_f64()
        );
    }
    drop(t);
    println!(
        "  observer    {} rounds ({} skipped while Redis was away)",
        i.observer.rounds, i.observer.skipped
    );
    for (name, n) in i.verdicts.checks() {
        println!("    {name:<34} {n:>10} checks");
    }
    for p in &i.janitors.procs {
        println!(
            "  {:<11} {} process(es); last: resident memory {} MiB at its start, {} MiB baseline, {} MiB max, {} MiB last",
            p.role.name(),
            p.generation,
            mib(p.rss_first.unwrap_or(0)),
            p.rss_baseline.map(mib).unwrap_or_else(|| "-".into()),
            mib(p.rss_max),
            mib(p.rss_last)
        );
    }
    match i.settled_in {
        Some(d) => println!(
            "  settled     {:.1}s after the faults stopped",
            d.as_secs_f64()
        ),
        None => println!("  settled     no"),
    }
    let notes = i.verdicts.notes();
    println!("  harness     {} notes", notes.len());
    for (at, note) in &notes {
        println!("              +{:.1}s {note}", at.as_secs_f64());
    }
    println!("  violations  {}", violations.len());
    if violations.is_empty() {
        return;
    }
    for v in &violations {
        println!();
        println!("VIOLATION at +{:.1}s: {}", v.at.as_secs_f64(), v.invariant);
        println!("  {}", v.what);
        for k in &v.keys {
            println!("  - {k}");
        }
    }
    let first = violations[0].at;
    println!();
    println!(
        "seed {}; replay: {}",
        i.seed,
        replay(i.seed, i.options, layout, i.schedule.partitions)
    );
    println!("schedule up to +{:.1}s:", first.as_secs_f64());
    for (n, p) in i
        .schedule
        .faults
        .iter()
        .enumerate()
        .filter(|(_, p)| p.at <= first)
    {
        let note = i
            .applied
            .iter()
            .find(|(index, _, _)| *index == n)
            .map(|(_, done, note)| format!("{note} (done +{:.1}s)", done.as_secs_f64()))
            .unwrap_or_else(|| "still running".into());
        println!(
            "  #{n:<3} +{:>6.1}s  {}  -> {note}",
            p.at.as_secs_f64(),
            p.fault
        );
    }
    if let Some(logs) = i.logs {
        println!(
            "logs of the processes and of redis-server: {}",
            logs.display()
        );
    }
}
