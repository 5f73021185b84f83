//! The registry of one zone run: the dead servers, the fleet that stays alive, the
//! users who moved, and the check afterwards.

use registry_janitor::{
    config::Layout, conn::RedisConn, error::Result, event::ServerId, keys::Keys, registry::Registry,
};

/// Live users the probe looks up (and who must survive).
pub(super) const LIVE_USERS: usize = 10_000;

/// The registry of one run: dead servers (1% of whose users moved to the live server) and
/// the live server's own users.
pub(super) struct ZoneScene {
    pub(super) keys: Keys,
    registry: Registry,
    pub(super) dead: Vec<ServerId>,
    live: ServerId,
    users_per_server: usize,
    moved_every: usize,
}

impl ZoneScene {
    /// `servers` dead servers of `users_per_server` users each, `moved_percent` of whom
    /// moved to the live server, under `keys`.
    pub(super) fn new(
        keys: Keys,
        layout: Layout,
        servers: usize,
        users_per_server: usize,
        moved_percent: f64,
    ) -> Self {
        ZoneScene {
            registry: Registry::new(keys.clone(), layout),
            keys,
            dead: (0..servers)
                .map(|i| ServerId::parse(&format!("zone-dead-{i}#1")).expect("valid"))
                .collect(),
            live: ServerId::parse("zone-live#1").expect("valid"),
            users_per_server,
            moved_every: if moved_percent > 0.0 {
                (100.0 / moved_percent).round().max(1.0) as usize
            } else {
                0
            },
        }
    }

    fn user(&self, server: usize, n: usize) -> Vec<u8> {
        crate::bench::scene::as_entry(
            self.registry.layout(),
            format!("z{server}u{n}").into_bytes(),
        )
    }

    fn moved(&self, n: usize) -> bool {
        self.moved_every > 0 && n % self.moved_every == 0
    }

    pub(super) async fn seed(&self, conn: &RedisConn) -> Result<()> {
        self.registry.heartbeat(conn, &self.live, 3_600_000).await?;
        // The rest of the fleet, alive: the zone is one third of it, as the guard sees a
        // zone outage (every dead server heartbeated until now, none has a liveness key).
        for i in 0..2 * self.dead.len() {
            let peer = ServerId::parse(&format!("zone-peer-{i}#1")).expect("valid");
            self.registry.heartbeat(conn, &peer, 3_600_000).await?;
        }
        let now = registry_janitor::now_ms();
        for (i, dead) in self.dead.iter().enumerate() {
            let _: () = redis::cmd("ZADD")
                .arg(self.keys.servers())
                .arg(now)
                .arg(dead.as_str())
                .query_async(&mut conn.clone())
                .await?;
            for start in (0..self.users_per_server).step_by(10_000) {
                let end = self.users_per_server.min(start + 10_000);
                let ids: Vec<Vec<u8>> = (start..end).map(|n| self.user(i, n)).collect();
                self.registry
                    .register_many(conn, ids.iter().map(Vec::as_slice), dead, 1000)
                    .await?;
                let moved = (start..end)
                    .filter(|&n| self.moved(n))
                    .map(|n| ids[n - start].as_slice());
                self.registry
                    .register_many(conn, moved, &self.live, 1000)
                    .await?;
            }
        }
        let live: Vec<Vec<u8>> = (0..LIVE_USERS)
            .map(|n| live_user(self.registry.layout(), n))
            .collect();
        self.registry
            .register_many(conn, live.iter().map(Vec::as_slice), &self.live, 1000)
            .await
    }

    /// (stale left, live lost)
    pub(super) async fn verify(&self, conn: &RedisConn) -> Result<(u64, u64)> {
        let (mut stale, mut lost) = (0, 0);
        for (i, dead) in self.dead.iter().enumerate() {
            let left: u64 = redis::cmd("EXISTS")
                .arg(&self.keys.server_members_left(dead))
                .query_async(&mut conn.clone())
                .await?;
            stale += left;
            for start in (0..self.users_per_server).step_by(1000) {
                let end = self.users_per_server.min(start + 1000);
                let ids: Vec<Vec<u8>> = (start..end).map(|n| self.user(i, n)).collect();
                for (k, owner) in self.registry.owners(conn, &ids).await?.iter().enumerate() {
                    match owner.as_deref() {
                        Some(o) if o == dead.as_str() => stale += 1,
                        Some(o) if self.moved(start + k) && o == self.live.as_str() => {}
                        None if !self.moved(start + k) => {}
                        _ => lost += 1,
                    }
                }
            }
        }
        let live: Vec<Vec<u8>> = (0..LIVE_USERS)
            .map(|n| live_user(self.registry.layout(), n))
            .collect();
        for chunk in live.chunks(1000) {
            lost += self
                .registry
                .owners(conn, chunk)
                .await?
                .iter()
                .filter(|o| o.as_deref() != Some(self.live.as_str()))
                .count() as u64;
        }
        Ok((stale, lost))
    }
}

/// The `n`th live user, `live<n>`; in layout `conns` its connection `c`, as the member.
pub(super) fn live_user(layout: registry_janitor::config::Layout, n: usize) -> Vec<u8> {
    crate::bench::scene::as_entry(layout, format!("live{n}").into_bytes())
}
