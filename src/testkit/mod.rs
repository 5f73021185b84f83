//! The test harness (cargo feature `testkit`): a private `redis-server` on a free port
//! ([`RedisServer`]), a local Redis Cluster of them ([`RedisCluster`]) and a local Redis
//! Sentinel group ([`RedisSentinels`]).
//!
//! The tests start one each, so they never depend on a Redis of the machine or on a fixed
//! port; the binary's `demo` and `bench` start one when no Redis answers at `redis_url`.
//! Not part of the service: the image is built with `--no-default-features`, without it.

mod cluster;
mod sentinel;
mod server;

pub use cluster::RedisCluster;
pub use sentinel::{RedisSentinels, SentinelProcess, MASTER_NAME};
pub use server::{cli_binary, server_binary, RedisServer};
