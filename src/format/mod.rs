//! The data format: what lets workers of two releases run side by side.
//!
//! What the workers write in Redis for a cleanup (the progress record, the set being
//! walked, the members set aside...) has a format, numbered. Each build has a format of
//! its own, [`FORMAT`], and works under a range of formats, [`MIN_FORMAT`] to [`FORMAT`]:
//! a release that raises the format keeps the one before in its range, working under it
//! exactly as the release before does, so that a rolling update runs both side by side.
//!
//! - `janitor:{format}:in_use` holds the format in use (absent: format 1). Workers move it
//!   forward, one atomic script ([`announce`]), only to their own format and only while
//!   no worker of an older format is announced; an operator sets it back for a rollback
//!   ([`set`], `registry-janitor format set`).
//! - `janitor:{format}:workers` holds each worker's announcement (consumer -> its format,
//!   its oldest format, since when, last seen, in Redis time), refreshed every
//!   `claim_min_idle_ms / 3` and removed when the worker exits; an announcement not
//!   refreshed within `claim_min_idle_ms` (the live bound) is ignored, and one older than
//!   `consumer_expiry_ms` is removed.
//! - A worker whose format is older than the format in use is *behind*: it takes no new
//!   events and no takeovers, hands its entries back, and answers `/readyz` 503 saying
//!   why (see [`Gate`]). Each cleanup step checks the format atomically: on one node
//!   clean_step.lua reads the format in use in the same script; on a cluster, where that
//!   key is in another slot, the worker reads it before each chunk and the chunk's
//!   scripts check the format stamped in the progress record (`format`, absent: 1) by the
//!   steps that wrote it. A step refused answers the error code `FORMAT`
//!   ([`crate::Error::Format`]): the cleanup stops without acknowledging, and its entry
//!   is handed over to a worker that works under the format in use.
//!
//! The format is this build's unless the environment variable [`OVERRIDE_ENV`] says
//! otherwise: a build that differs only in its format number, for testing upgrades (see
//! [`Build::current`]).

use std::sync::{
    atomic::{AtomicU32, Ordering},
    Arc, LazyLock,
};

use serde::Serialize;

use crate::{
    conn::RedisConn,
    error::{Error, Result},
    keys::Keys,
    reply::Fields,
};

/// This build's data format: what it writes when the format in use is its own.
pub const FORMAT: u32 = 1;

/// The oldest format this build works under. A release that raises [`FORMAT`] keeps the
/// format before it here, so that its workers run beside the release before.
pub const MIN_FORMAT: u32 = 1;

/// The format in use when `janitor:{format}:in_use` does not exist, and the format of a
/// progress record without a `format` field.
pub const ABSENT: u32 = 1;

/// The environment variable that gives a build another format number, for testing
/// upgrades only: `REGISTRY_JANITOR_FORMAT=<N>` makes this build a build of format N that
/// works under [`MIN_FORMAT`] (or N, if lower) to N. Not a setting: the settings never
/// read it, and a worker logs a warning when it is set.
pub const OVERRIDE_ENV: &str = "REGISTRY_JANITOR_FORMAT";

static ANNOUNCE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("announce.lua")));
static SET: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(include_str!("set.lua")));

/// The formats a build works under: its own, and the oldest it can still work under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Build {
    /// The build's own format.
    pub format: u32,
    /// The oldest format it works under.
    pub min: u32,
}

/// Where a build stands against the format in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stance {
    /// The format in use is not known yet.
    Unknown,
    /// The format in use is in the build's range: it works (under that format).
    Works,
    /// The format in use is newer than the build's own: the build is behind.
    Behind { in_use: u32 },
    /// The format in use is older than the oldest the build works under: it waits for
    /// the format to move forward (which it does itself once no older worker is left).
    Ahead { in_use: u32 },
}

impl Build {
    pub const fn new(format: u32, min: u32) -> Self {
        Build { format, min }
    }

    /// The build as compiled: [`FORMAT`] and [`MIN_FORMAT`].
    pub const fn compiled() -> Self {
        Build::new(FORMAT, MIN_FORMAT)
    }

    /// The build as this process runs it: as compiled, or with the format of
    /// [`OVERRIDE_ENV`] when that is set (read once). An override that is not a format
    /// number (1 or more) is an error naming the variable.
    pub fn current() -> Result<Self> {
        static CURRENT: LazyLock<std::result::Result<Build, String>> =
            LazyLock::new(|| Build::with_override(std::env::var(OVERRIDE_ENV).ok().as_deref()));
        CURRENT.clone().map_err(|reason| Error::Setting {
            name: OVERRIDE_ENV.into(),
            reason,
        })
    }

    /// The compiled build, with the format `value` of [`OVERRIDE_ENV`] if given.
    pub fn with_override(value: Option<&str>) -> std::result::Result<Self, String> {
        let Some(value) = value else {
            return Ok(Build::compiled());
        };
        match value.trim().parse::<u32>() {
            Ok(n) if n >= 1 => Ok(Build::new(n, MIN_FORMAT.min(n))),
            _ => Err(format!(
                "must be a format number, 1 or more (for testing upgrades only), got {value:?}"
            )),
        }
    }

    /// True when this build's format is not the compiled one.
    pub fn is_overridden(&self) -> bool {
        *self != Build::compiled()
    }

    pub fn works_under(&self, in_use: u32) -> bool {
        (self.min..=self.format).contains(&in_use)
    }

    pub fn stance(&self, in_use: u32) -> Stance {
        if in_use > self.format {
            Stance::Behind { in_use }
        } else if in_use < self.min {
            Stance::Ahead { in_use }
        } else {
            Stance::Works
        }
    }

    /// "format 2 (works under 1 to 2)".
    pub fn describe(&self) -> String {
        format!(
            "format {} (works under {} to {})",
            self.format, self.min, self.format
        )
    }
}

/// A worker's view of the format in use, shared by its tasks: the read loop takes no
/// work, and `/readyz` answers 503, while the build does not work under it.
#[derive(Debug)]
pub struct Gate {
    build: Build,
    /// The format in use as last read; 0 before the first read.
    in_use: AtomicU32,
    /// Wakes the worker's format round before its time (a step was refused).
    wake: tokio::sync::Notify,
}

impl Gate {
    pub fn new(build: Build) -> Arc<Self> {
        Arc::new(Gate {
            build,
            in_use: AtomicU32::new(0),
            wake: tokio::sync::Notify::new(),
        })
    }

    pub fn build(&self) -> Build {
        self.build
    }

    /// The format in use as last read, if it was.
    pub fn in_use(&self) -> Option<u32> {
        match self.in_use.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n),
        }
    }

    pub fn set_in_use(&self, in_use: u32) {
        self.in_use.store(in_use, Ordering::Relaxed);
    }

    pub fn stance(&self) -> Stance {
        self.in_use()
            .map_or(Stance::Unknown, |in_use| self.build.stance(in_use))
    }

    /// True while the build works under the format in use.
    pub fn works(&self) -> bool {
        self.stance() == Stance::Works
    }

    /// Why this worker takes no work, when it takes none: `/readyz` says it.
    pub fn refusal(&self) -> Option<String> {
        let build = self.build.describe();
        match self.stance() {
            Stance::Works => None,
            Stance::Unknown => Some("data format: the format in use is not read yet".into()),
            Stance::Behind { in_use } => Some(format!(
                "data format: format {in_use} is in use, newer than this build's {build}: \
                 this worker takes no work; replace it with a release of format {in_use} or \
                 newer, or roll the format back (`registry-janitor format status`)"
            )),
            Stance::Ahead { in_use } => Some(format!(
                "data format: format {in_use} is in use, older than this build's {build}: \
                 this worker takes no work until the format moves forward, which it does \
                 once no worker of an older format is announced \
                 (`registry-janitor format status`)"
            )),
        }
    }

    /// Asks the worker's format round to run now.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Resolves at the next [`Gate::wake`].
    pub async fn woken(&self) {
        self.wake.notified().await
    }
}

/// What one round of [`announce`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announced {
    /// The format in use, after this round.
    pub in_use: u32,
    /// This round moved the format forward (to the worker's own).
    pub moved: bool,
    /// A live worker of an older format, which keeps the format where it is: its
    /// consumer name and format.
    pub older: Option<(String, u32)>,
}

impl redis::FromRedisValue for Announced {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("announce.lua", v, 3)?;
        let in_use = f.next("format in use")?;
        let moved = f.next::<u8>("moved")? == 1;
        let older: String = f.next("older worker")?;
        let older = match older.rsplit_once(' ') {
            Some((name, format)) => Some((
                name.to_owned(),
                format.parse().map_err(|_| {
                    crate::reply::malformed(
                        "announce.lua",
                        "'<consumer> <format>'",
                        &redis::Value::SimpleString(older.clone()),
                    )
                })?,
            )),
            None => None,
        };
        Ok(Announced {
            in_use,
            moved,
            older,
        })
    }
}

/// Announces `consumer` as a worker of `build` and reads the format in use; with
/// `move_forward`, moves it forward to the build's format if no worker of an older format
/// was seen within `live_ms` (and this worker has been announced for that long).
/// Announcements not refreshed within `forget_ms` are removed.
pub async fn announce(
    conn: &RedisConn,
    keys: &Keys,
    consumer: &str,
    build: Build,
    live_ms: u64,
    forget_ms: u64,
    move_forward: bool,
) -> Result<Announced> {
    let mut call = ANNOUNCE.prepare_invoke();
    call.key(keys.format_in_use())
        .key(keys.format_workers())
        .arg(consumer)
        .arg(build.format)
        .arg(build.min)
        .arg(live_ms)
        .arg(forget_ms.max(live_ms))
        .arg(if move_forward { "1" } else { "0" });
    Ok(call.invoke_async(&mut conn.clone()).await?)
}

/// Removes the announcement of `consumer` (a worker that exits).
pub async fn withdraw(conn: &RedisConn, keys: &Keys, consumer: &str) -> Result<()> {
    let _: i64 = redis::cmd("HDEL")
        .arg(keys.format_workers())
        .arg(consumer)
        .query_async(&mut conn.clone())
        .await?;
    Ok(())
}

/// The format in use ([`ABSENT`] when the key does not exist).
pub async fn in_use(conn: &RedisConn, keys: &Keys) -> Result<u32> {
    let value: Option<String> = redis::cmd("GET")
        .arg(keys.format_in_use())
        .query_async(&mut conn.clone())
        .await?;
    match value {
        None => Ok(ABSENT),
        Some(v) => v.parse().map_err(|_| {
            Error::Protocol(format!(
                "{} holds {v:?}, not a format number",
                keys.format_in_use()
            ))
        }),
    }
}

/// One worker's announcement, as `format status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Announcement {
    pub consumer: String,
    pub format: u32,
    pub min: u32,
    /// Since when it has been announced without a gap (Redis time, unix ms).
    pub since_ms: u64,
    /// When it was last refreshed (Redis time, unix ms).
    pub seen_ms: u64,
    /// Refreshed within the live bound.
    pub live: bool,
}

/// Parses an announcement's value: its first four fields, `<format>:<min>:<since>:<seen>`
/// (any that follow are a later release's, and ignored).
pub fn parse_announcement(value: &str) -> Option<(u32, u32, u64, u64)> {
    let mut fields = value.split(':');
    let mut next = || fields.next().and_then(|f| f.parse::<u64>().ok());
    let (format, min, since, seen) = (next()?, next()?, next()?, next()?);
    Some((
        u32::try_from(format).ok()?,
        u32::try_from(min).ok()?,
        since,
        seen,
    ))
}

/// What `format status` reports.
#[derive(Debug, Clone, Serialize)]
pub struct FormatStatus {
    /// The format in use.
    pub in_use: u32,
    /// Whether `janitor:{format}:in_use` exists (absent: format 1, never moved or set).
    pub recorded: bool,
    /// The build of the process that asked.
    pub build: Build,
    /// The live bound used to tell live workers from gone ones (`claim_min_idle_ms`).
    pub live_ms: u64,
    /// Redis's time when the announcements were read (unix ms).
    pub now_ms: u64,
    /// Every announcement, live ones first, then by consumer name.
    pub workers: Vec<Announcement>,
}

impl FormatStatus {
    /// Live workers by format: (format, count), oldest first.
    pub fn live_by_format(&self) -> Vec<(u32, usize)> {
        let mut counts = std::collections::BTreeMap::new();
        for w in self.workers.iter().filter(|w| w.live) {
            *counts.entry(w.format).or_insert(0) += 1;
        }
        counts.into_iter().collect()
    }
}

/// The format in use and the announcements, with Redis's time to tell live ones.
pub async fn status(
    conn: &RedisConn,
    keys: &Keys,
    build: Build,
    live_ms: u64,
) -> Result<FormatStatus> {
    let mut c = conn.clone();
    /// The format in use, the announcements, Redis's TIME.
    type Read = (Option<String>, Vec<(String, String)>, (u64, u64));
    let (value, all, time): Read = if conn.is_cluster() {
        // The two keys share a hash tag; TIME goes to any node.
        let (value, all): (Option<String>, Vec<(String, String)>) = redis::pipe()
            .get(keys.format_in_use())
            .hgetall(keys.format_workers())
            .query_async(&mut c)
            .await?;
        let time: (u64, u64) = redis::cmd("TIME").query_async(&mut c).await?;
        (value, all, time)
    } else {
        redis::pipe()
            .get(keys.format_in_use())
            .hgetall(keys.format_workers())
            .cmd("TIME")
            .query_async(&mut c)
            .await?
    };
    let now = time.0 * 1000 + time.1 / 1000;
    let in_use = match &value {
        None => ABSENT,
        Some(v) => v.parse().map_err(|_| {
            Error::Protocol(format!(
                "{} holds {v:?}, not a format number",
                keys.format_in_use()
            ))
        })?,
    };
    let mut workers: Vec<Announcement> = all
        .into_iter()
        .filter_map(|(consumer, value)| {
            let (format, min, since_ms, seen_ms) = parse_announcement(&value)?;
            Some(Announcement {
                consumer,
                format,
                min,
                since_ms,
                seen_ms,
                live: now.saturating_sub(seen_ms) <= live_ms,
            })
        })
        .collect();
    workers.sort_by(|a, b| b.live.cmp(&a.live).then(a.consumer.cmp(&b.consumer)));
    Ok(FormatStatus {
        in_use,
        recorded: value.is_some(),
        build,
        live_ms,
        now_ms: now,
        workers,
    })
}

/// What `format set` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetOutcome {
    /// The format was set (false: refused).
    pub set: bool,
    /// The format in use before.
    pub previous: u32,
    /// Live workers that cannot work under the format asked for: (consumer, format, min).
    pub cannot: Vec<(String, u32, u32)>,
    /// Live workers of a newer format are announced and none of the format asked for:
    /// they would move the format forward again at once.
    pub moves_back: bool,
}

impl redis::FromRedisValue for SetOutcome {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("set.lua", v, 4)?;
        let set = f.state("outcome", |s| match s {
            "set" => Some(true),
            "refused" => Some(false),
            _ => None,
        })?;
        let previous = f.next("previous format")?;
        let rows: Vec<String> = f.next("workers that cannot work under it")?;
        let mut cannot = Vec::with_capacity(rows.len());
        for row in rows {
            let mut parts = row.rsplitn(3, ' ');
            let (min, format, name) = (parts.next(), parts.next(), parts.next());
            match (
                name,
                format.and_then(|f| f.parse().ok()),
                min.and_then(|m| m.parse().ok()),
            ) {
                (Some(name), Some(format), Some(min)) => {
                    cannot.push((name.to_owned(), format, min))
                }
                _ => {
                    return Err(crate::reply::malformed(
                        "set.lua",
                        "'<consumer> <format> <min>'",
                        &redis::Value::SimpleString(row),
                    ))
                }
            }
        }
        let moves_back = f.next::<u8>("moves back")? == 1;
        Ok(SetOutcome {
            set,
            previous,
            cannot,
            moves_back,
        })
    }
}

/// Sets the format in use to `n` (`registry-janitor format set`), unless a live worker
/// (announced within `live_ms`) cannot work under it or newer live workers would move it
/// forward again at once; `force` sets it whatever the workers.
pub async fn set(
    conn: &RedisConn,
    keys: &Keys,
    n: u32,
    live_ms: u64,
    force: bool,
) -> Result<SetOutcome> {
    if n == 0 {
        return Err(Error::Setting {
            name: "FORMAT".into(),
            reason: "a format number is 1 or more".into(),
        });
    }
    let mut call = SET.prepare_invoke();
    call.key(keys.format_in_use())
        .key(keys.format_workers())
        .arg(n)
        .arg(live_ms)
        .arg(if force { "1" } else { "0" });
    Ok(call.invoke_async(&mut conn.clone()).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_build_works_under_its_range_only() {
        let b = Build::new(3, 2);
        assert_eq!(b.stance(1), Stance::Ahead { in_use: 1 });
        assert_eq!(b.stance(2), Stance::Works);
        assert_eq!(b.stance(3), Stance::Works);
        assert_eq!(b.stance(4), Stance::Behind { in_use: 4 });
        assert!(b.works_under(2) && !b.works_under(4));
    }

    /// A release that raises the format keeps the one before in its range: workers of
    /// two consecutive releases work side by side under the older format.
    #[test]
    fn the_compiled_build_works_under_the_format_before_its_own() {
        let b = Build::compiled();
        assert!(b.works_under(FORMAT));
        assert!(b.works_under(FORMAT.saturating_sub(1).max(1)));
        assert!(b.works_under(ABSENT) || MIN_FORMAT > ABSENT);
    }

    #[test]
    fn the_override_changes_the_format_number_only() {
        assert_eq!(Build::with_override(None), Ok(Build::compiled()));
        assert_eq!(
            Build::with_override(Some("2")),
            Ok(Build::new(2, MIN_FORMAT.min(2)))
        );
        assert_eq!(Build::with_override(Some(" 1 ")), Ok(Build::new(1, 1)));
        for bad in ["0", "-1", "two", ""] {
            let err = Build::with_override(Some(bad)).unwrap_err();
            assert!(err.contains("format number"), "{bad}: {err}");
        }
        assert!(Build::new(2, 1).is_overridden());
    }

    #[test]
    fn announcements_parse_their_first_four_fields() {
        assert_eq!(parse_announcement("2:1:10:20"), Some((2, 1, 10, 20)));
        assert_eq!(parse_announcement("2:1:10:20:later"), Some((2, 1, 10, 20)));
        assert_eq!(parse_announcement("2:1:10"), None);
        assert_eq!(parse_announcement("x:1:10:20"), None);
    }

    #[test]
    fn a_gate_refuses_work_until_it_knows_and_while_it_is_out_of_range() {
        let gate = Gate::new(Build::new(1, 1));
        assert!(!gate.works());
        assert!(gate.refusal().unwrap().contains("not read yet"));
        gate.set_in_use(1);
        assert!(gate.works() && gate.refusal().is_none());
        gate.set_in_use(2);
        let why = gate.refusal().unwrap();
        assert!(
            why.contains("format 2 is in use") && why.contains("takes no work"),
            "{why}"
        );
        let newer = Gate::new(Build::new(3, 3));
        newer.set_in_use(1);
        assert!(newer
            .refusal()
            .unwrap()
            .contains("until the format moves forward"));
    }
}
