//! The registry of one run: a dead server with its users (some of whom moved to the live
//! server) and the live server's own users, seeded before the run and verified after it.

use registry_janitor::{
    config::Settings, conn::RedisConn, error::Result, event::ServerId, keys::Keys,
    registry::Registry,
};

use super::Options;

/// `user` as the registry's calls take it: itself, or in layout `conns` the member of its
/// connection `c` (`c <user>`).
pub(crate) fn as_entry(layout: registry_janitor::config::Layout, user: Vec<u8>) -> Vec<u8> {
    match layout {
        registry_janitor::config::Layout::Conns => registry_janitor::keys::conn_member("c", &user),
        _ => user,
    }
}

/// The registry of one run: a dead server, a live one, who moved.
#[derive(Clone)]
pub(super) struct Scene {
    pub(super) keys: Keys,
    pub(super) registry: Registry,
    pub(super) dead: ServerId,
    pub(super) live: ServerId,
    pub(super) users: usize,
    /// Every `moved_every`-th user of the dead server reconnected to the live one.
    moved_every: usize,
    pub(super) live_users: usize,
}

impl Scene {
    /// The `n`th user of the dead server, `u<n>` (layout `conns`: its connection `c`).
    pub(super) fn dead_user(&self, n: usize) -> Vec<u8> {
        as_entry(self.registry.layout(), format!("u{n}").into_bytes())
    }

    /// The `n`th user of the live server, `live<n>` (layout `conns`: its connection `c`).
    pub(super) fn live_user(&self, n: usize) -> Vec<u8> {
        as_entry(self.registry.layout(), format!("live{n}").into_bytes())
    }

    pub(super) fn moved(&self, n: usize) -> bool {
        self.moved_every > 0 && n % self.moved_every == 0
    }

    /// `n` if that user of the dead server did not move, else a neighbour who did not
    /// (moved users are never next to each other unless all of them moved).
    pub(super) fn unmoved_near(&self, n: usize) -> Option<usize> {
        [n, n + 1, n.wrapping_sub(1)]
            .into_iter()
            .find(|&m| m < self.users && !self.moved(m))
    }

    pub(super) async fn seed(&self, conn: &RedisConn) -> Result<()> {
        self.registry.heartbeat(conn, &self.live, 600_000).await?;
        let _: () = redis::cmd("ZADD")
            .arg(self.keys.servers())
            .arg(1)
            .arg(self.dead.as_str())
            .query_async(&mut conn.clone())
            .await?;
        for start in (0..self.users).step_by(10_000) {
            let ids: Vec<Vec<u8>> = (start..self.users.min(start + 10_000))
                .map(|n| self.dead_user(n))
                .collect();
            self.registry
                .register_many(conn, ids.iter().map(Vec::as_slice), &self.dead, 1000)
                .await?;
            let moved: Vec<&Vec<u8>> = (start..self.users.min(start + 10_000))
                .filter(|&n| self.moved(n))
                .map(|n| &ids[n - start])
                .collect();
            self.registry
                .register_many(conn, moved.into_iter().map(Vec::as_slice), &self.live, 1000)
                .await?;
        }
        let live: Vec<Vec<u8>> = (0..self.live_users).map(|n| self.live_user(n)).collect();
        self.registry
            .register_many(conn, live.iter().map(Vec::as_slice), &self.live, 1000)
            .await
    }

    /// (stale left, live lost)
    pub(super) async fn verify(&self, conn: &RedisConn) -> Result<(u64, u64)> {
        let (mut stale, mut lost) = (0, 0);
        for start in (0..self.users).step_by(1000) {
            let ids: Vec<Vec<u8>> = (start..self.users.min(start + 1000))
                .map(|n| self.dead_user(n))
                .collect();
            for (i, owner) in self
                .registry
                .owners(conn, &ids)
                .await?
                .into_iter()
                .enumerate()
            {
                match owner.as_deref() {
                    Some(o) if o == self.dead.as_str() => stale += 1,
                    Some(o) if self.moved(start + i) && o == self.live.as_str() => {}
                    None if !self.moved(start + i) => {}
                    _ => lost += 1,
                }
            }
        }
        let live: Vec<Vec<u8>> = (0..self.live_users).map(|n| self.live_user(n)).collect();
        for chunk in live.chunks(1000) {
            let owners = self.registry.owners(conn, chunk).await?;
            lost += owners
                .iter()
                .filter(|o| o.as_deref() != Some(self.live.as_str()))
                .count() as u64;
        }
        Ok((stale, lost))
    }
}

pub(super) fn scene(
    settings: &Settings,
    root: &str,
    name: &str,
    users: usize,
    options: &Options,
) -> Scene {
    // The evictions stream as the settings have it (JANITOR_EVICTIONS=false measures the
    // cleanup without it).
    let keys = Keys::new(format!("{root}{name}:")).evictions_stream(
        settings
            .evictions
            .then_some(settings.evictions_stream.as_str()),
    );
    let moved_every = if options.moved_percent > 0.0 {
        (100.0 / options.moved_percent).round().max(1.0) as usize
    } else {
        0
    };
    Scene {
        registry: Registry::new(keys.clone(), settings.layout),
        keys,
        dead: ServerId::parse("bench-dead#1").expect("valid"),
        live: ServerId::parse("bench-live#1").expect("valid"),
        users,
        moved_every,
        live_users: 10_000,
    }
}
