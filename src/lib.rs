//! # registry-janitor
//!
//! Keeps a real-time system's connection registry in Redis clean after connection
//! servers die. The data model and the event are specified in the documentation:
//!
//! ```text
//!  connection server S ── HSET registry <user> S ──────────► registry (Hash)  or user:<user>
//!                      ── SADD server:{S}:users <user> ───► reverse Set per server
//!                      ── SET server:{S}:alive PX / ZADD servers ► liveness
//!
//!  monitoring ── XADD registry:events type=server.dead payload=<msgpack> ──┐
//!                                                                          ▼
//!  worker (consumer group `registry-janitor`)
//!        ── RENAME server:{S}:users → server:{S}:walking, then per chunk:
//!           SSCAN + check-and-delete of the forward entries (one Lua step)
//!        ── the step that finds nothing left: ZREM servers S, XACK
//!        └─ malformed ─► registry:events:dead (+ error, failed_at_ms), then XACK
//! ```
//!
//! # The path of one event
//! [`worker::Worker::run`] joins the group and loops in `read_loop` (worker/mod.rs):
//! [`stream::read_new`] takes entries off the stream, and each one goes to `handle`
//! (worker/entry.rs), which classifies it ([`event::classify`]). A `server.dead` is
//! cleaned by [`cleanup::Cleaner::clean_event`]: on one node `cleanup/single.rs` runs
//! `clean_step.lua` until a step finds nothing left and XACKs inside that step; on a
//! cluster `cleanup/cluster.rs` runs scan, [`forward::check_delete`] and advance per
//! chunk, then XACKs ([`stream::ack`]).
//!
//! # Layout
//! - [`keys`]: every key name and special stream id, in one place.
//! - [`config`]: settings (defaults file, `JANITOR_*`, flags) and their checks
//!   (`validate.rs`).
//! - [`event`]: the `server.dead` payload, its encoding, structural check and validation.
//! - [`stream`]: the events stream and the group (read, ack, claim, hand-off, dead letters).
//! - [`worker`]: the consumer loop, takeover of idle entries, drain on shutdown
//!   (`mod.rs`); one entry from takeover to its end (`entry.rs`).
//! - [`cleanup`]: cleaning one dead server (`single.rs` on one node, `cluster.rs` on a
//!   cluster, each next to its Lua).
//! - [`forward`]: the atomic check-and-delete of forward entries and the Lua prelude,
//!   shared by the cleanup and the reconciler's drift sweep.
//! - [`fence`]: the fence a worker records before a cleanup's first step, which the
//!   connection-server protocol checks (a fenced server's writes are refused).
//! - [`evictions`]: the evictions stream (`users.evicted`, `server.cleaned`), written by
//!   the scripts that delete, and read by whoever keeps presence.
//! - [`reconcile`]: the reconciler: the heartbeat pass (`pass.rs`), expiry hints
//!   (`hints.rs`), the drift sweep on one node (`sweep.rs`) and on a cluster
//!   (`sweep_cluster.rs`).
//! - [`clock`]: Redis's clock, by which every liveness question is judged: a `servers`
//!   score is Redis's time, and its age is measured against Redis's time; scores that
//!   lie in the future (a writer scoring with its own clock, ahead) are lowered.
//! - [`guard`]: keeps outages elsewhere and monitoring mistakes from fencing a live
//!   fleet: verdicts on silent servers wait until Redis has been reachable for a full
//!   grace (`reachable/`: the tracker in `tracker.rs`, what an observation reads in
//!   `observation.rs`); doubtful verdicts (disputed, or of a mass silence) beyond its
//!   limits are held (`hold/`: the decision in `mod.rs`, the fleet's census in
//!   `census.rs`, how a hold ends in `ending.rs`).
//! - [`mod@format`]: the data format, which lets workers of two releases run side by side:
//!   the format in use, each worker's announcement of its own, moving the format forward
//!   once no older worker is left, and setting it back for a rollback.
//! - [`maintenance`]: stream retention and removal of gone consumers.
//! - [`registry`]: the connection-server side (register, unregister, heartbeat; route
//!   and the reads in `route.rs`; layout `conns`, a user with several connections, in
//!   `conns.rs`), used by connection servers in Rust, the demo and the tests.
//! - [`dead_letters`]: listing, replaying and purging dead letters; [`status`]: what
//!   `status` reports.
//! - `receiver`: the Alertmanager webhook receiver (`alert-receiver`): one
//!   `server.dead` per firing alert, once per alert (`webhook.rs`: the payload and what
//!   an alert becomes; `publish.rs`: the once-only publish script; `credentials.rs`:
//!   its bearer token and TLS certificate).
//! - `protocol/*.lua` (outside `src/`): the connection-server protocol as scripts
//!   (register, heartbeat, unregister, release, route; register_conn, unregister_conn
//!   and route_user for layout `conns`), which [`registry`] runs.
//! - `health`: liveness and readiness, shared by the worker and the reconciler;
//!   `http`: the /metrics, /healthz and /readyz listener.
//! - [`conn`] (one node, a cluster or Sentinel; `conn/cluster.rs`: masters, node
//!   clients, epoch; `conn/sentinel/`: the primary through Sentinel; `conn/commands.rs`:
//!   commands over several keys), `retry`, [`metrics`], [`error`], `reply` (decoding
//!   the scripts' replies into named types) and `lock`: plumbing.
//! - [`service`]: the settings flags, logging, signals, and the long-running commands
//!   (`worker`, `reconcile`, `alert-receiver`) with their metrics listener.
//!
//! The public modules are the ones the two binaries (`registry-janitor`,
//! `registry-janitor-lab`) and the tests drive; the others (`health`, `http`, `receiver`,
//! `retry`, `reply`, `lock`) are private to the crate.
//!
//! The command line is the binary, `src/bin/registry-janitor/`: `main.rs` parses, loads
//! the settings and calls one function per command (`commands.rs`); `output.rs` prints.
//! The workspace holds two more crates: `crates/testkit` (a private `redis-server` on a
//! free port, a local Redis Cluster, a Sentinel group, for the tests) and `crates/lab`
//! (`registry-janitor-lab`: the demo and the benchmark).

pub mod cleanup;
pub mod clock;
pub mod config;
pub mod conn;
pub mod dead_letters;
pub mod error;
pub mod event;
pub mod evictions;
pub mod fence;
pub mod format;
pub mod forward;
pub mod guard;
pub(crate) mod health;
pub(crate) mod http;
pub mod keys;
pub(crate) mod lock;
pub mod maintenance;
pub mod metrics;
pub(crate) mod receiver;
pub mod reconcile;
pub mod registry;
pub(crate) mod reply;
pub(crate) mod retry;
pub mod service;
pub mod status;
pub mod stream;
pub mod worker;

pub use error::{Error, Result};

/// Unix time in milliseconds.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
