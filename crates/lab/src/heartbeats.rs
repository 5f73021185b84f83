//! `registry-janitor-lab heartbeats` (internal): connection servers that do nothing but
//! heartbeat through the protocol (`heartbeat.lua`, through [`Registry::heartbeat`]), in a
//! process of their own, so that a test can pause them with the rest of a machine
//! (SIGSTOP) and tell, from what they print, whether any was fenced while alive.
//!
//! Each server heartbeats every `--interval-ms` with a liveness TTL of `--ttl-ms`; after
//! a failed heartbeat (Redis away) it tries again after the interval. A server told it is
//! fenced prints `fenced <server>` on stdout and stops, as a real one would restart
//! under a new id. It runs until SIGTERM or SIGINT.

use std::time::Duration;

use anyhow::Context;
use registry_janitor::{
    config::Settings, conn, error::Error, event::ServerId, keys::Keys, registry::Registry, service,
};

use crate::cli::HeartbeatOptions;

pub async fn run(settings: &Settings, options: &HeartbeatOptions) -> anyhow::Result<()> {
    let conn = conn::shared_for(&conn::target_for(settings)?).await?;
    let registry = Registry::new(Keys::for_settings(settings), settings.layout);
    let stop = service::shutdown_on_signals();
    let interval = Duration::from_millis(options.interval_ms);
    let mut tasks = Vec::new();
    for id in &options.server {
        let server = ServerId::parse(id).with_context(|| format!("--server {id:?}"))?;
        let (conn, registry, stop) = (conn.clone(), registry.clone(), stop.clone());
        let ttl_ms = options.ttl_ms;
        tasks.push(tokio::spawn(async move {
            loop {
                let beat = tokio::select! {
                    r = registry.heartbeat(&conn, &server, ttl_ms) => r,
                    _ = stop.cancelled() => return,
                };
                if let Err(Error::Fenced { .. }) = beat {
                    println!("fenced {server}");
                    return;
                }
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = stop.cancelled() => return,
                }
            }
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    Ok(())
}
