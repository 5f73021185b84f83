//! The guard keeps outages elsewhere from fencing a live fleet: a verdict that a server
//! is dead rests on its silence, and silence that only means "nobody could reach Redis"
//! must never become a `server.dead`.
//!
//! - [`reachable`]: Redis's own absence (unreachable, restarting, loading, failing over,
//!   not answering, its clock stepped) is never a server's silence; verdicts on silent
//!   servers wait until Redis has been reachable for a full `heartbeat_grace_ms`.

pub mod reachable;
