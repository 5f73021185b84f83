//! A private `redis-server` on a free loopback port, stopped when dropped.
//!
//! Persistence is off unless the extra arguments turn it on (`--appendonly yes`; a SAVE
//! writes `dump.rdb`, which a restart loads), and the log goes to a file in a temporary
//! directory, so a failing test can show it. The directory is kept across restarts.

use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::error::{Error, Result};

/// The `redis-server` binary the harness runs: `JANITOR_TEST_REDIS_SERVER` if set (any
/// Redis or Valkey build, for running the suite against another server), else
/// `redis-server` from PATH.
pub fn server_binary() -> String {
    std::env::var("JANITOR_TEST_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into())
}

/// The `redis-cli` binary (for creating local clusters): `JANITOR_TEST_REDIS_CLI` if set,
/// else `redis-cli` from PATH.
pub fn cli_binary() -> String {
    std::env::var("JANITOR_TEST_REDIS_CLI").unwrap_or_else(|_| "redis-cli".into())
}

/// A running `redis-server` child process.
pub struct RedisServer {
    pub(super) child: Option<Child>,
    port: u16,
    /// Holds the log file and, with persistence on, the RDB and AOF files; removed on
    /// drop, kept across restarts.
    dir: tempfile::TempDir,
    /// Extra `redis-server` arguments, kept so a restart brings back the same server.
    args: Vec<String>,
}

impl RedisServer {
    /// True when the `redis-server` binary ([`server_binary`]) can be run.
    pub fn available() -> bool {
        Command::new(server_binary())
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Starts a server with default options.
    pub fn start() -> Result<Self> {
        Self::start_with(&[])
    }

    /// Starts a server with extra arguments, e.g. `["--notify-keyspace-events", "Ex"]`.
    pub fn start_with(args: &[&str]) -> Result<Self> {
        let mut dir = tempfile::tempdir().map_err(|e| Error::io("creating a temporary dir", e))?;
        let mut last_error = None;
        // A port found free can be taken by someone else before redis-server binds it.
        for _ in 0..5 {
            let port = free_port()?;
            let mut server = RedisServer {
                child: None,
                port,
                dir,
                args: args.iter().map(|s| s.to_string()).collect(),
            };
            match server.spawn() {
                Ok(()) => return Ok(server),
                Err(e) => {
                    last_error = Some(e);
                    dir = std::mem::replace(
                        &mut server.dir,
                        tempfile::tempdir()
                            .map_err(|e| Error::io("creating a temporary dir", e))?,
                    );
                }
            }
        }
        Err(last_error.expect("at least one attempt"))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The process id while the server runs (to pause it with SIGSTOP, for one).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Sends `signal` (e.g. `STOP`, `CONT`) to the server process.
    pub fn signal(&self, signal: &str) -> Result<()> {
        let pid = self
            .pid()
            .ok_or_else(|| Error::LocalRedis("the server is not running".into()))?;
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .map_err(|e| Error::io("running kill", e))?;
        if !status.success() {
            return Err(Error::LocalRedis(format!("kill -{signal} {pid}: {status}")));
        }
        Ok(())
    }

    /// The server's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Kills the server with SIGKILL, like a crash. Its data is gone (no persistence).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, after [`RedisServer::kill`].
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.spawn() {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Starts the server again after [`RedisServer::kill`], with `extra` arguments after
    /// its own for this start only (`["--replicaof", "127.0.0.1", "<port>"]`: a former
    /// primary that comes back as a replica and never takes a write).
    pub fn restart_with(&mut self, extra: &[&str]) -> Result<()> {
        let kept = self.args.clone();
        self.args.extend(extra.iter().map(|s| s.to_string()));
        let restarted = self.restart();
        self.args = kept;
        restarted
    }

    /// A command's text reply from this server over a fresh connection, or None.
    pub(super) fn query_text(&self, cmd: &redis::Cmd) -> Option<String> {
        let client = redis::Client::open(self.url()).ok()?;
        let mut c = client
            .get_connection_with_timeout(Duration::from_millis(200))
            .ok()?;
        cmd.query(&mut c).ok()
    }

    /// The Redis version this server reports (`redis_version` of `INFO server`), as
    /// (major, minor, patch), or None if it does not answer or gives none. Valkey reports
    /// the Redis version it is compatible with there (Valkey 8.0: 7.2.4), which is what
    /// decides the commands and script features it has.
    pub fn redis_version(&self) -> Option<(u32, u32, u32)> {
        parse_redis_version(&self.query_text(redis::cmd("INFO").arg("server"))?)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    fn spawn(&mut self) -> Result<()> {
        let child = Command::new(server_binary())
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.log_path())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Error::io("starting redis-server (is it installed?)", e))?;
        self.child = Some(child);
        let (url, log) = (self.url(), self.log_path());
        let answered = wait_answering(&mut self.child, &url, "redis-server", &log);
        if answered.is_err() {
            self.kill();
        }
        answered
    }
}

/// Waits up to 10 s until the process in `child`, listening at `url`, answers PING (or
/// NOAUTH: a server started with --requirepass is up). An error, with its log file, if
/// it exits first (then `child` is None) or does not answer in time. A server that
/// answers with another `process_id` (INFO server) is not ours while ours may still exit
/// for the port being taken (another process took it between [`free_port`] and the
/// start); once ours has run for [`FOREIGN_GRACE`] beside it, the server is ours behind a
/// wrapper (`JANITOR_TEST_REDIS_SERVER` a script that does not `exec`).
pub(crate) fn wait_answering(
    child: &mut Option<std::process::Child>,
    url: &str,
    what: &str,
    log_file: &std::path::Path,
) -> Result<()> {
    let log = || std::fs::read_to_string(log_file).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(10);
    let client = redis::Client::open(url)?;
    let started = Instant::now();
    loop {
        if let Some(status) = child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
            *child = None;
            return Err(Error::LocalRedis(format!(
                "{what} exited with {status} at start; log:\n{}",
                log()
            )));
        }
        let conn = client.get_connection_with_timeout(Duration::from_millis(200));
        if conn.as_ref().is_err_and(|e| e.code() == Some("NOAUTH")) {
            return Ok(());
        }
        if let Ok(mut c) = conn {
            match redis::cmd("PING").query::<String>(&mut c) {
                Err(e) if e.code() == Some("NOAUTH") => return Ok(()),
                Ok(_) => {
                    let ours = child.as_ref().map(std::process::Child::id);
                    let theirs = redis::cmd("INFO")
                        .arg("server")
                        .query::<String>(&mut c)
                        .ok()
                        .and_then(|info| info_field(&info, "process_id")?.parse::<u32>().ok());
                    match (ours, theirs) {
                        (Some(ours), Some(theirs))
                            if ours != theirs && started.elapsed() < FOREIGN_GRACE => {}
                        _ => return Ok(()),
                    }
                }
                Err(_) => {}
            }
        }
        if Instant::now() > deadline {
            return Err(Error::LocalRedis(format!(
                "{what} did not answer within 10 s; log:\n{}",
                log()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// How long a child must keep running beside a server with another `process_id` on its
/// port before that server counts as the child's (see [`wait_answering`]): a server that
/// finds its port taken exits at once.
const FOREIGN_GRACE: Duration = Duration::from_secs(2);

/// A loopback port that was free a moment ago.
pub fn free_port() -> Result<u16> {
    let listener =
        TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io("finding a free port", e))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| Error::io("finding a free port", e))
}

/// The value of `field` in an INFO reply.
fn info_field<'a>(info: &'a str, field: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.trim_end().strip_prefix(field)?.strip_prefix(':'))
}

/// The `redis_version` field of an `INFO` reply, as (major, minor, patch).
fn parse_redis_version(info: &str) -> Option<(u32, u32, u32)> {
    let value = info_field(info, "redis_version")?;
    let mut parts = value.splitn(3, '.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??, parts.next()??))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port taken by another server between `free_port` and the start: the other
    /// server answers PING, but the start fails (ours exits, the port in use) instead of
    /// handing back a server that is not ours.
    #[test]
    fn a_server_answering_on_our_port_is_not_taken_for_ours() {
        let theirs = RedisServer::start().unwrap();
        let mut ours = RedisServer {
            child: None,
            port: theirs.port(),
            dir: tempfile::tempdir().unwrap(),
            args: Vec::new(),
        };
        let started = ours.spawn();
        assert!(
            started.is_err(),
            "the start took the server already on port {} for ours",
            theirs.port()
        );
        assert!(ours.child.is_none(), "ours is gone");
        assert!(theirs.pid().is_some());
    }

    #[test]
    fn the_redis_version_is_read_from_info() {
        let redis_6 = "# Server\r\nredis_version:6.2.16\r\nredis_git_sha1:00000000\r\n";
        assert_eq!(parse_redis_version(redis_6), Some((6, 2, 16)));
        let redis_7 = "# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n";
        assert_eq!(parse_redis_version(redis_7), Some((7, 0, 15)));
        // Valkey gives the Redis version it is compatible with, then its own.
        let valkey_8 =
            "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:8.0.1\r\n";
        assert_eq!(parse_redis_version(valkey_8), Some((7, 2, 4)));
        let unstable = "# Server\r\nredis_version:255.255.255\r\n";
        assert_eq!(parse_redis_version(unstable), Some((255, 255, 255)));
        assert_eq!(parse_redis_version("# Server\r\nrun_id:abc\r\n"), None);
        assert_eq!(parse_redis_version("redis_version:seven\r\n"), None);
        assert_eq!(parse_redis_version("redis_version:7.2\r\n"), None);
    }
}
