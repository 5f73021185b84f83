//! A fixed Redis workload timed before the runs, so that invocations on different days
//! (or on a machine whose speed drifts) can be put side by side: the runs' own figures
//! are comparable only within one invocation, and this one says how fast that Redis and
//! machine were at the time.
//!
//! Two parts, each done [`REPEAT`] times and reported as the median:
//! - `pipelined`: [`COMMANDS`] SETs then as many GETs of 1,000 keys (16-byte values), in
//!   pipelines of 1,000: Redis CPU and wall time per command (request parsing and reply
//!   writing included);
//! - `script`: one EVAL looping [`COMMANDS`] times over HSET and HGET of a 1,000-field
//!   hash: Redis CPU per command called from Lua, which is what a cleanup step is made of.

use std::time::Instant;

use registry_janitor::{config::Settings, conn::RedisConn, error::Result};
use serde::Serialize;

use super::probe;

/// Commands of each part.
pub const COMMANDS: usize = 100_000;
/// Repetitions of each part (the median is reported).
pub const REPEAT: usize = 3;

/// The calibration figures (medians).
#[derive(Debug, Clone, Serialize)]
pub struct Calibration {
    /// Redis main-thread CPU per pipelined SET or GET, in microseconds.
    pub pipelined_cpu_us: f64,
    /// Wall time per pipelined SET or GET, in microseconds.
    pub pipelined_wall_us: f64,
    /// Redis main-thread CPU per HSET or HGET called from a Lua loop, in microseconds.
    pub script_cpu_us: f64,
}

const SCRIPT: &str = "local h = KEYS[1]
for i = 1, tonumber(ARGV[1]) / 2 do
  local f = i % 1000
  redis.call('HSET', h, f, 'abcdefghijklmnop')
  redis.call('HGET', h, f)
end
return 1";

/// Times the workload on the node `conn` (on a cluster: the keys of one slot, under
/// `root`'s hash tag), then deletes its keys.
pub async fn calibrate(settings: &Settings, conn: &RedisConn, root: &str) -> Result<Calibration> {
    let tag = format!("{root}{{calibration}}:");
    let (mut pipelined_cpu, mut pipelined_wall, mut script_cpu) = (vec![], vec![], vec![]);
    for _ in 0..REPEAT {
        let cpu = probe::redis_cpu(settings, conn).await?;
        let started = Instant::now();
        for op in ["SET", "GET"] {
            for chunk in 0..COMMANDS / 2 / 1000 {
                let mut pipe = redis::pipe();
                for i in 0..1000 {
                    let key = format!("{tag}k{}", (chunk * 1000 + i) % 1000);
                    match op {
                        "SET" => pipe.cmd("SET").arg(key).arg("abcdefghijklmnop").ignore(),
                        _ => pipe.cmd("GET").arg(key).ignore(),
                    };
                }
                let () = pipe.query_async(&mut conn.clone()).await?;
            }
        }
        let wall = started.elapsed().as_secs_f64();
        let cpu = probe::redis_cpu(settings, conn).await? - cpu;
        pipelined_cpu.push(cpu * 1e6 / COMMANDS as f64);
        pipelined_wall.push(wall * 1e6 / COMMANDS as f64);

        let cpu = probe::redis_cpu(settings, conn).await?;
        let _: i64 = redis::cmd("EVAL")
            .arg(SCRIPT)
            .arg(1)
            .arg(format!("{tag}h"))
            .arg(COMMANDS)
            .query_async(&mut conn.clone())
            .await?;
        let cpu = probe::redis_cpu(settings, conn).await? - cpu;
        script_cpu.push(cpu * 1e6 / COMMANDS as f64);
    }
    let mut keys: Vec<String> = (0..1000).map(|i| format!("{tag}k{i}")).collect();
    keys.push(format!("{tag}h"));
    for chunk in keys.chunks(500) {
        let _: i64 = redis::cmd("DEL")
            .arg(chunk)
            .query_async(&mut conn.clone())
            .await?;
    }
    Ok(Calibration {
        pipelined_cpu_us: median(pipelined_cpu),
        pipelined_wall_us: median(pipelined_wall),
        script_cpu_us: median(script_cpu),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

impl std::fmt::Display for Calibration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "calibration (medians of {REPEAT}; {COMMANDS} commands each): pipelined SET/GET {:.3} us Redis CPU, {:.3} us wall per command; HSET/HGET from Lua {:.3} us Redis CPU per command",
            self.pipelined_cpu_us, self.pipelined_wall_us, self.script_cpu_us
        )
    }
}
