//! # registry-janitor
//!
//! Keeps a real-time system's connection registry in Redis clean after connection
//! servers die. The data model and the event are fixed by `shared/CONTRACT.md`:
//!
//! ```text
//!  connection server S ── HSET registry <user> S ──────────► registry (Hash)  or user:<user>
//!                      ── SADD server:{S}:users <user> ───► reverse Set per server
//!                      ── SET server:{S}:alive PX / ZADD servers ► liveness
//!
//!  monitoring ── XADD registry:events type=server.dead payload=<msgpack> ──┐
//!                                                                          ▼
//!  worker (consumer group `registry-janitor`) ── SSCAN chunk + check-and-delete (Lua)
//!        ── until server:{S}:users is gone, ZREM servers S ── XACK
//!        └─ malformed ─► registry:events:dead (+ error, failed_at_ms), XACK
//! ```
//!
//! # Layout
//! - [`keys`]: every key name, in one place.
//! - [`config`]: settings (defaults file, `JANITOR_*`, flags) and their checks.
//! - [`event`]: the `server.dead` payload, its encoding and validation.
//! - [`stream`]: the events stream and the group (read, ack, claim, dead letters).
//! - [`cleanup`]: cleaning one dead server, step by step, in Lua.
//! - [`worker`]: the consumer loop, takeover of idle entries, drain on shutdown.
//! - [`maintenance`]: stream retention and removal of gone consumers.
//! - [`reconcile`]: the reconciler (dead servers from heartbeats, expiry hints, drift).
//! - [`registry`]: the connection-server side (register, unregister, heartbeat), used
//!   by the demo and the tests.
//! - [`dead_letters`]: listing, replaying and purging dead letters.
//! - `testkit` (cargo feature `testkit`, on by default, off in the image): a private
//!   `redis-server` on a free port and a local Redis Cluster, for the tests and for the
//!   binary's `demo` and `bench`.
//! - [`http`]: the /metrics, /healthz and /readyz listener.
//! - [`conn`], [`retry`], [`metrics`], [`error`]: plumbing.

pub mod cleanup;
pub mod config;
pub mod conn;
pub mod dead_letters;
pub mod error;
pub mod event;
pub mod forward;
pub mod health;
pub mod http;
pub mod keys;
pub mod maintenance;
pub mod metrics;
pub mod reconcile;
pub mod registry;
pub mod retry;
pub mod status;
pub mod stream;
#[cfg(feature = "testkit")]
pub mod testkit;
pub mod worker;

pub use error::{Error, Result};

/// Unix time in milliseconds.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
