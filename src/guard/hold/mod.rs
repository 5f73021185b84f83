//! The verdict hold: the decision on each verdict ([`Guard::decide`]), the upkeep of
//! held verdicts ([`Guard::upkeep`]), and the operator's release and discard.
//!
//! Where things are while a verdict is held:
//! - the hold, as JSON, in `janitor:{guard}:held` (field = server id): one per server;
//!   further verdicts for a held server are acknowledged as duplicates of it;
//! - the stream entry, pending, parked with [`HELD_CONSUMER`] by `park.lua` (XCLAIM
//!   JUSTID with IDLE 0 and RETRYCOUNT 0: no delivery counted, never idle long enough for
//!   a takeover while any worker runs its upkeep). If every worker was gone longer than
//!   `claim_min_idle_ms`, the next takeover finds the hold recorded and parks the entry
//!   again ([`Decision::Park`]): a hold survives worker restarts.
//!
//! Ending a hold: *dropped* (XACK, then the hold forgotten), *released* (the hold's state
//! becomes `released` and the entry is made claimable at once: the next claim round of
//! any worker takes it and proceeds as with any verdict, then forgets the hold), or
//! *discarded* by an operator (dead-lettered with the reason, then forgotten). Each step
//! checks that the hold is still the one of its entry (`forget.lua`), and a hold whose
//! entry is no longer pending is forgotten by the upkeep: no crash between two steps
//! loses a verdict or leaves a hold behind for good.

use std::{
    sync::{LazyLock, Mutex},
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use tracing::{debug, info};

use crate::{
    config::Settings,
    conn::RedisConn,
    error::{Error, Result},
    event::{ServerDead, ServerId},
    keys::Keys,
    reply::Fields,
    stream,
};

mod census;
mod ending;

pub use census::Census;
use census::CENSUS_TTL;

use ending::{dead_letter_lost, entry_exists, forget, park, parse_hold, pending};
pub use ending::{discard, list, release};

/// The consumer that held verdicts' stream entries are parked with. No worker reads as
/// it; consumer expiry never removes a consumer with pending entries.
pub const HELD_CONSUMER: &str = "janitor-guard-held";

static HOLD: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(include_str!("../hold.lua")));
/// Why a verdict is doubtful.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Doubt {
    /// Its server still heartbeats: monitoring and the server disagree.
    Disputed,
    /// Its server is silent along with more of the fleet than a zone outage explains.
    MassSilence,
}

impl Doubt {
    pub fn as_str(self) -> &'static str {
        match self {
            Doubt::Disputed => "disputed",
            Doubt::MassSilence => "mass_silence",
        }
    }
}

/// Where a hold stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldState {
    /// Waiting: not fenced, not cleaned, not acknowledged.
    Held,
    /// Let go (by the hold's grace or an operator): the next worker to take the entry
    /// proceeds with it.
    Released,
    /// An operator is discarding it (to the dead-letter stream): stays parked.
    Discarding,
}

/// One held verdict, as recorded in `janitor:{guard}:held` and shown by `status` and
/// `held list`. `state` is serialized first: `forget.lua` changes it in place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    pub state: HoldState,
    pub server_id: String,
    /// The stream entry of the held `server.dead`.
    pub entry: String,
    pub event_id: String,
    pub doubt: Doubt,
    /// What the guard saw, for a person: "liveness key present", "120 of 180 ...".
    pub detail: String,
    /// Unix ms when the hold started.
    pub since_ms: u64,
    /// The event's `source` and `reason`, as published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The guard's answer for one `server.dead` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Go ahead: fence and clean. `released`: the verdict was held and let go; its hold
    /// is forgotten once the entry is acknowledged. `let_through`: a disputed verdict
    /// within `guard_disputed_limit`.
    Proceed { released: bool, let_through: bool },
    /// Hold this verdict (recorded); park its entry. `first`: no other verdict was held,
    /// a hold starts.
    Hold { hold: Hold, first: bool },
    /// This entry's verdict is held already (taken over after every worker was gone):
    /// park it again.
    Park,
    /// Another verdict for the same server is held (`held_entry`): this one adds nothing,
    /// acknowledge it.
    Duplicate { held_entry: String },
}

/// What one round of [`Guard::upkeep`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Upkeep {
    /// Holds standing after the round.
    pub held: u64,
    /// Held verdicts of a mass silence dropped: their server heartbeats again.
    pub dropped: u64,
    /// Held verdicts let go: their server stayed silent past the hold's grace.
    pub released: u64,
}

/// The guard of one process.
pub struct Guard {
    keys: Keys,
    on: bool,
    window_ms: u64,
    silence_fraction: f64,
    silence_min: u64,
    disputed_limit: u64,
    hold_grace_ms: u64,
    claim_min_idle_ms: u64,
    /// How long a census (and the look at the holds) is reused: [`CENSUS_TTL`], or a
    /// quarter of `heartbeat_grace_ms` if less. A census older than that could predate
    /// the silence of servers that have since passed the grace (a liveness TTL must lie
    /// well inside the grace period).
    census_ttl: Duration,
    /// The last census and when it was taken.
    census: Mutex<Option<(Instant, Census)>>,
    /// Whether a verdict of a mass silence was held at the last look, and when (reused
    /// like the census).
    mass_held: Mutex<Option<(Instant, bool)>>,
    /// The holds may not be read (an ACL without them): said once.
    holds_refused: std::sync::atomic::AtomicBool,
}

impl Guard {
    pub fn new(keys: Keys, settings: &Settings) -> Self {
        Guard {
            keys,
            on: settings.guard,
            window_ms: settings.guard_window(),
            silence_fraction: settings.guard_silence_fraction,
            silence_min: settings.guard_silence_min,
            disputed_limit: settings.guard_disputed_limit,
            hold_grace_ms: settings.guard_hold_grace(),
            claim_min_idle_ms: settings.claim_min_idle_ms,
            census_ttl: CENSUS_TTL.min(Duration::from_millis(settings.heartbeat_grace_ms / 4)),
            census: Mutex::new(None),
            mass_held: Mutex::new(None),
            holds_refused: Default::default(),
        }
    }

    /// The guard's answer for the verdict of stream entry `entry` against `server`.
    pub async fn decide(
        &self,
        conn: &RedisConn,
        entry: &str,
        event: &ServerDead,
        server: &ServerId,
    ) -> Result<Decision> {
        if !self.on {
            return Ok(Decision::Proceed {
                released: false,
                let_through: false,
            });
        }
        let (doubt, detail) = self.doubt(conn, server).await?;
        let hold = Hold {
            state: HoldState::Held,
            server_id: server.as_str().to_owned(),
            entry: entry.to_owned(),
            event_id: event.event_id.clone(),
            doubt: doubt.unwrap_or(Doubt::Disputed),
            detail,
            since_ms: crate::now_ms(),
            source: event.source.clone(),
            reason: event.reason.clone(),
        };
        let record = serde_json::to_string(&hold).map_err(|e| Error::Protocol(e.to_string()))?;
        let answer: HoldAnswer = HOLD
            .key(self.keys.guard_held())
            .key(self.keys.guard_disputed())
            .arg(server.as_str())
            .arg(entry)
            .arg(match doubt {
                None => "none",
                Some(Doubt::Disputed) => "disputed",
                Some(Doubt::MassSilence) => "mass",
            })
            .arg(record)
            .arg(crate::now_ms())
            .arg(self.window_ms)
            .arg(self.disputed_limit)
            .invoke_async(&mut conn.clone())
            .await?;
        match answer {
            HoldAnswer::Proceed => Ok(Decision::Proceed {
                released: false,
                let_through: doubt.is_some(),
            }),
            HoldAnswer::Hold { holds_before } => Ok(Decision::Hold {
                hold,
                first: holds_before == "0",
            }),
            HoldAnswer::Recorded { hold: standing } => {
                Ok(standing_decision(parse_hold(&standing)?, entry))
            }
        }
    }

    /// What is doubtful about a verdict on `server`, with the detail a hold records:
    /// nothing for a fenced server (its verdict was executed already), `Disputed` while
    /// its liveness key stands, `MassSilence` when it is one of many silent at once.
    async fn doubt(&self, conn: &RedisConn, server: &ServerId) -> Result<(Option<Doubt>, String)> {
        // Both keys are in the slot of {S}: one pipeline on a cluster too.
        let (alive, fenced): (bool, bool) = redis::pipe()
            .cmd("EXISTS")
            .arg(self.keys.server_alive(server))
            .cmd("EXISTS")
            .arg(self.keys.server_fence(server))
            .query_async(&mut conn.clone())
            .await?;
        // A fenced server's verdict was executed already: nothing left to protect.
        let (doubt, detail) = if fenced {
            (None, String::new())
        } else if alive {
            (
                Some(Doubt::Disputed),
                "its liveness key is present: it still heartbeats".to_owned(),
            )
        } else {
            let census = self.census(conn).await?;
            // A server the registry does not know has nothing to lose to a verdict (its
            // fence is short-lived, see `crate::fence`): holding it protects nothing.
            if self.is_mass_silence(census) && !is_unknown(conn, &self.keys, server).await? {
                (
                    Some(Doubt::MassSilence),
                    format!(
                        "{} of the {} servers that heartbeated within {} s are silent",
                        census.silent,
                        census.recent,
                        self.window_ms / 1000
                    ),
                )
            } else {
                (None, String::new())
            }
        };
        Ok((doubt, detail))
    }

    /// Parks a held verdict's entry with [`HELD_CONSUMER`]; false if it is no longer
    /// pending.
    pub async fn park(&self, conn: &RedisConn, entry: &str) -> Result<bool> {
        park(conn, &self.keys, entry, 0).await
    }

    /// Forgets the hold of `entry` against `server` (its verdict was acknowledged).
    pub async fn forget(&self, conn: &RedisConn, server: &str, entry: &str) -> Result<()> {
        forget(conn, &self.keys, server, entry).await.map(|_| ())
    }

    /// One round over the held verdicts: keeps each parked entry from takeover, drops
    /// those of a mass silence whose server heartbeats again, lets go those whose server
    /// stayed silent past the hold's grace, and forgets holds whose entry is gone.
    pub async fn upkeep(&self, conn: &RedisConn) -> Result<Upkeep> {
        let mut report = Upkeep::default();
        let holds = list(conn, &self.keys).await?;
        for hold in holds {
            // One hold's failure (a transient state, a lost connection) never keeps the
            // others from their upkeep: it is retried next round.
            match self.keep(conn, &hold, &mut report).await {
                Ok(()) => {}
                Err(e) => {
                    report.held += 1;
                    debug!(server_id = %hold.server_id, error = %e, "guard upkeep of a hold failed; next round");
                }
            }
        }
        Ok(report)
    }

    /// The upkeep of one hold (see [`Guard::upkeep`]).
    async fn keep(&self, conn: &RedisConn, hold: &Hold, report: &mut Upkeep) -> Result<()> {
        let now = crate::now_ms();
        let Some((owner, idle)) = pending(conn, &self.keys, &hold.entry).await? else {
            if hold.state == HoldState::Held && !entry_exists(conn, &self.keys, &hold.entry).await?
            {
                // Deleted from the stream while held (XDEL, or a trim by another
                // producer): the verdict itself must not go with it.
                dead_letter_lost(conn, &self.keys, hold).await?;
            }
            // Acknowledged (cleaned, dropped, discarded) or gone: the hold is over.
            forget(conn, &self.keys, &hold.server_id, &hold.entry).await?;
            return Ok(());
        };
        report.held += 1;
        if hold.state == HoldState::Released {
            // Not yet taken: make sure it looks idle enough for a takeover.
            if owner == HELD_CONSUMER && idle < self.claim_min_idle_ms {
                park(conn, &self.keys, &hold.entry, self.claim_min_idle_ms).await?;
            }
            return Ok(());
        }
        let Ok(server) = ServerId::parse(&hold.server_id) else {
            return Ok(());
        };
        let (alive, score, redis_now) = liveness(conn, &self.keys, &server).await?;
        if hold.state == HoldState::Held {
            if alive && hold.doubt == Doubt::MassSilence {
                stream::ack(conn, &self.keys, &hold.entry).await?;
                report.held -= 1;
                report.dropped += 1;
                info!(
                    server_id = %hold.server_id, entry = %hold.entry, event_id = %hold.event_id,
                    "guard: held verdict dropped, its server heartbeats again"
                );
                forget(conn, &self.keys, &hold.server_id, &hold.entry).await?;
                return Ok(());
            }
            // A disputed verdict whose server has since fallen silent, with no mass
            // silence around it: monitoring was right, nothing is in doubt any more.
            let settled = !alive
                && hold.doubt == Doubt::Disputed
                && !self.is_mass_silence(self.census(conn).await?);
            // The hold's grace counts from its start too: after a long gap (Redis
            // unreachable for longer than the grace), a fresh hold still waits it out.
            // Each on its own clock: the heartbeat's age on Redis's (the score's), the
            // hold's on this worker's (its `since_ms`).
            let heartbeat_silent_ms =
                score.map_or(u64::MAX, |s| redis_now.saturating_sub(s as u64));
            let held_ms = now.saturating_sub(hold.since_ms);
            let silent_ms = heartbeat_silent_ms.min(held_ms);
            let waited = !alive && silent_ms >= self.hold_grace_ms;
            if settled || waited {
                if release(conn, &self.keys, hold, self.claim_min_idle_ms).await? {
                    report.released += 1;
                    info!(
                        server_id = %hold.server_id, entry = %hold.entry, event_id = %hold.event_id,
                        silent_ms,
                        "guard: held verdict proceeds, {}",
                        if settled {
                            "its server has fallen silent too, with no mass silence around it"
                        } else {
                            "its server stayed silent past guard_hold_grace_ms"
                        }
                    );
                }
                return Ok(());
            }
        }
        if owner != HELD_CONSUMER || idle >= self.claim_min_idle_ms / 3 {
            park(conn, &self.keys, &hold.entry, 0).await?;
        }
        Ok(())
    }
}

/// hold.lua's reply, {answer, detail}.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HoldAnswer {
    /// The verdict goes ahead (`proceed`).
    Proceed,
    /// The verdict is held now; `holds_before` is how many were held before it (`hold`).
    Hold { holds_before: String },
    /// A hold stands for this server: its record, as JSON (`recorded`).
    Recorded { hold: String },
}

impl redis::FromRedisValue for HoldAnswer {
    fn from_redis_value(v: redis::Value) -> std::result::Result<Self, redis::ParsingError> {
        let mut f = Fields::new("hold.lua", v, 2)?;
        #[derive(Clone, Copy)]
        enum Answer {
            Proceed,
            Hold,
            Recorded,
        }
        let answer = f.state("answer", |s| match s {
            "proceed" => Some(Answer::Proceed),
            "hold" => Some(Answer::Hold),
            "recorded" => Some(Answer::Recorded),
            _ => None,
        })?;
        let detail: String = f.next("detail")?;
        Ok(match answer {
            Answer::Proceed => HoldAnswer::Proceed,
            Answer::Hold => HoldAnswer::Hold {
                holds_before: detail,
            },
            Answer::Recorded => HoldAnswer::Recorded { hold: detail },
        })
    }
}

/// The decision for a verdict on a server that a hold already stands for (`standing`):
/// the hold of another entry makes this one a duplicate unless it was released; the hold
/// of this entry lets it go once released, and parks it while held.
fn standing_decision(standing: Hold, entry: &str) -> Decision {
    if standing.entry != entry {
        if standing.state == HoldState::Released {
            Decision::Proceed {
                released: false,
                let_through: false,
            }
        } else {
            Decision::Duplicate {
                held_entry: standing.entry,
            }
        }
    } else if standing.state == HoldState::Released {
        Decision::Proceed {
            released: true,
            let_through: false,
        }
    } else {
        Decision::Park
    }
}

/// Whether the registry does not know `server`: no reverse set, no set being walked or
/// set aside, and not in `servers` (its liveness key was checked before).
async fn is_unknown(conn: &RedisConn, keys: &Keys, server: &ServerId) -> Result<bool> {
    let sets: u64 = redis::cmd("EXISTS")
        .arg(keys.server_users(server))
        .arg(keys.server_walking(server))
        .arg(keys.server_moved(server))
        .query_async(&mut conn.clone())
        .await?;
    if sets > 0 {
        return Ok(false);
    }
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(keys.servers())
        .arg(server.as_str())
        .query_async(&mut conn.clone())
        .await?;
    Ok(score.is_none())
}

/// Whether `server`'s liveness key exists, its last heartbeat in `servers`, and Redis's
/// time in the slot of `servers` (the clock of that score, see [`crate::clock`]).
async fn liveness(
    conn: &RedisConn,
    keys: &Keys,
    server: &ServerId,
) -> Result<(bool, Option<f64>, u64)> {
    let mut c = conn.clone();
    let alive: bool = redis::cmd("EXISTS")
        .arg(keys.server_alive(server))
        .query_async(&mut c)
        .await?;
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(keys.servers())
        .arg(server.as_str())
        .query_async(&mut c)
        .await?;
    let now = crate::clock::now_ms(conn, keys).await?;
    Ok((alive, score, now))
}
