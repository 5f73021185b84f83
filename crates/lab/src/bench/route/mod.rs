//! Routing with fences: what `route` (route.lua) costs next to a plain HGET or
//! GET of the forward entry ([`route_cost`]), and what each returns while a fenced server
//! that still looks alive is being cleaned ([`StaleProbes`]).
//!
//! - [`cost`]: `route_cost`, latency and Redis CPU per lookup of each kind;
//! - [`stale`]: the stale-window probes of the janitor runs.

mod cost;
mod stale;

use registry_janitor::{conn::RedisConn, error::Result, registry::Registry};
use serde::Serialize;

pub(in crate::bench) use cost::route_cost;
pub use cost::{LookupCost, RouteCost};
pub(in crate::bench) use stale::StaleProbes;
pub use stale::{StaleCount, StaleWindow};

/// How a lookup asks for a user's server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Lookup {
    /// `Registry::route`: route.lua in one EVALSHA on one node (HGET or GET, EXISTS of the
    /// owner's fence and liveness keys); on a cluster, the owner, then both EXISTS in one
    /// pipeline.
    Route,
    /// `Registry::owner`: a plain HGET (layout hash) or GET (layout keys).
    Plain,
}

impl Lookup {
    async fn owner(
        self,
        registry: &Registry,
        conn: &RedisConn,
        user: &[u8],
    ) -> Result<Option<String>> {
        match self {
            // Layout conns: the user lookup of the layout (route_user.lua); a bench user
            // holds one connection, so its first server is the one.
            Lookup::Route if registry.layout() == registry_janitor::config::Layout::Conns => {
                let (_, user) =
                    registry_janitor::keys::split_conn_member(user).unwrap_or((b"", user));
                Ok(registry.route_user(conn, user).await?.into_iter().next())
            }
            Lookup::Route => registry.route(conn, user).await,
            Lookup::Plain => registry.owner(conn, user).await,
        }
    }
}
