//! What the lab's tests share: a private redis-server, settings for it under a key prefix
//! of the test's own, and the `registry-janitor-lab` binary configured by `JANITOR_*`.
#![allow(dead_code)]

use std::process::Command;

use registry_janitor::config::{Layout, Settings};
use registry_janitor_testkit::RedisServer;

/// Starts a private redis-server, or fails with a clear message.
pub fn redis() -> RedisServer {
    assert!(
        RedisServer::available(),
        "these tests need redis-server on PATH (Debian: apt-get install redis-server)"
    );
    RedisServer::start().expect("start redis-server")
}

/// Settings for a test: short waits, metrics listener off, a key prefix no other test
/// uses.
pub fn settings(server: &RedisServer, layout: Layout) -> Settings {
    let mut s = Settings::defaults();
    s.redis_url = server.url();
    s.key_prefix = format!("t{}:", ulid::Ulid::new());
    s.layout = layout;
    s.block_ms = 200;
    s.claim_min_idle_ms = 1000;
    s.metrics_addr = "off".into();
    s.chunk_size = 500;
    s
}

/// The `registry-janitor-lab` binary, configured only through `JANITOR_*` variables.
pub fn lab(settings: &Settings) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_registry-janitor-lab"));
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("JANITOR_REDIS_URL", &settings.redis_url)
        .env("JANITOR_KEY_PREFIX", &settings.key_prefix)
        .env("JANITOR_LAYOUT", settings.layout.as_str())
        .env("JANITOR_CHUNK_SIZE", settings.chunk_size.to_string())
        .env("JANITOR_BLOCK_MS", settings.block_ms.to_string())
        .env(
            "JANITOR_CLAIM_MIN_IDLE_MS",
            settings.claim_min_idle_ms.to_string(),
        )
        .env("JANITOR_METRICS_ADDR", &settings.metrics_addr)
        .env("RUST_LOG", "info");
    cmd
}
