//! The test harness of registry-janitor: a private `redis-server` on a free port
//! ([`RedisServer`]), a local Redis Cluster of them ([`RedisCluster`]) and a local Redis
//! Sentinel group ([`RedisSentinels`]).
//!
//! The tests start one each, so they never depend on a Redis of the machine or on a fixed
//! port; the lab's `demo` and `bench` start one when no Redis answers at `redis_url`. Not
//! part of the service: the service crate has it as a dev-dependency only.

mod cluster;
mod error;
mod sentinel;
mod server;

pub use cluster::RedisCluster;
pub use error::{Error, Result};
pub use sentinel::{RedisSentinels, SentinelProcess, MASTER_NAME};
pub use server::{cli_binary, server_binary, RedisServer};
