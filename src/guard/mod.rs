//! The guard: no outage elsewhere and no monitoring mistake may fence a live fleet.
//!
//! A verdict (`server.dead`) fences its server: the server must close every socket and
//! start again, and all its users reconnect. That is right for one dead server and
//! ruinous for a fleet. Two parts:
//!
//! - `reachable` (the reconciler): Redis's own absence (unreachable, restarting,
//!   loading, failing over, not answering, its clock stepped) is never a server's
//!   silence; verdicts on silent servers wait until Redis has been reachable for a full
//!   `heartbeat_grace_ms`.
//! - [`hold`] (the workers), between a worker taking a verdict and the fence:
//!   - **Doubtful verdicts** ([`Doubt`]): *disputed*, its server still heartbeats (its
//!     liveness key exists); or one of a *mass silence*, more than
//!     `guard_silence_fraction` of the servers that heartbeated within the window are
//!     silent at once (and at least `guard_silence_min`): what a cut between the fleet
//!     and Redis looks like, and what no zone outage of one zone in three reaches.
//!   - **Limits**: up to `guard_disputed_limit` disputed verdicts per window go ahead (a
//!     hung server that still heartbeats is what monitoring is for); verdicts of a mass
//!     silence never do. Everything beyond is **held**: not fenced, not cleaned, not
//!     acknowledged, not dead-lettered. The stream entry stays pending, parked with the
//!     consumer [`HELD_CONSUMER`] (kept from takeover by every worker's upkeep); the
//!     hold itself is recorded in `janitor:{guard}:held`.
//!   - **Ends of a hold**: a held verdict of a mass silence whose server heartbeats
//!     again is dropped (acknowledged, nothing done); any held verdict whose server stays
//!     silent for `guard_hold_grace_ms` proceeds by itself; an operator releases or
//!     discards held verdicts with `registry-janitor held`.
//!
//! A held verdict costs memory, not misrouted messages: `route.lua` already refuses an
//! owner whose liveness has expired.

pub mod hold;
pub(crate) mod reachable;

pub use hold::{Decision, Doubt, Guard, Hold, HoldState, HELD_CONSUMER};
