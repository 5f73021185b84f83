//! Real monitoring daemons for the tests (Prometheus, Alertmanager): finding their
//! binaries (missing: skipped with a message, or a failure when `CI` is set), running one
//! on a free port in a directory of its own, and plain HTTP to talk to them.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use super::http_get;

/// The first of `candidates` (or the binary named by the environment variable `env`)
/// that runs with `--version`. None when there is none: the test is skipped, with a
/// message naming `install`; when `CI` is set, a missing binary fails the test instead.
pub fn binary(env: &str, candidates: &[&str], needed_for: &str, install: &str) -> Option<String> {
    let runs = |bin: &str| {
        Command::new(bin)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let chosen: Vec<String> = match std::env::var(env) {
        Ok(bin) => vec![bin],
        Err(_) => candidates.iter().map(|c| (*c).to_owned()).collect(),
    };
    if let Some(bin) = chosen.iter().find(|b| runs(b)) {
        return Some(bin.clone());
    }
    let why = format!(
        "{} is needed {needed_for} ({install}; or set {env} to the binary)",
        chosen.join(" or ")
    );
    super::cannot_run(&why);
    None
}

/// Prometheus (Debian's package `prometheus`; `PROMETHEUS` names another binary).
pub fn prometheus_binary(needed_for: &str) -> Option<String> {
    binary(
        "PROMETHEUS",
        &["prometheus"],
        needed_for,
        "Debian: apt-get install prometheus, or bash .ci/ensure-prometheus",
    )
}

/// Alertmanager (Debian's package `prometheus-alertmanager`; `ALERTMANAGER` names
/// another binary).
pub fn alertmanager_binary(needed_for: &str) -> Option<String> {
    binary(
        "ALERTMANAGER",
        &["prometheus-alertmanager", "alertmanager"],
        needed_for,
        "Debian: apt-get install prometheus-alertmanager, or bash .ci/ensure-prometheus",
    )
}

/// A daemon on a free loopback port with a directory of its own (its config files, its
/// data, its log); killed on drop.
pub struct Daemon {
    pub name: String,
    pub addr: String,
    pub dir: tempfile::TempDir,
    child: Child,
}

impl Daemon {
    /// Starts `bin` in `dir` with the arguments `args(dir, addr)` gives, its stderr in
    /// `dir/<name>.log`, and waits (up to 60 s) until GET `ready_path` answers 200.
    pub fn start(
        name: &str,
        bin: &str,
        dir: tempfile::TempDir,
        args: impl FnOnce(&std::path::Path, &str) -> Vec<String>,
        ready_path: &str,
    ) -> Self {
        let addr = super::free_addr();
        let log = std::fs::File::create(dir.path().join(format!("{name}.log"))).unwrap();
        let child = Command::new(bin)
            .current_dir(dir.path())
            .args(args(dir.path(), &addr))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {bin}: {e}"));
        let mut d = Daemon {
            name: name.to_owned(),
            addr,
            dir,
            child,
        };
        d.wait_for(
            &format!("{name} to be ready"),
            Duration::from_secs(60),
            |d| d.get(ready_path).0 == 200,
        );
        d
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{}.log", self.name)))
            .unwrap_or_default()
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        http_get(&self.addr, path)
    }

    /// Polls `check` every 250 ms until true; on timeout, or if the daemon exited, fails
    /// with its log.
    pub fn wait_for(
        &mut self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut(&Self) -> bool,
    ) {
        let deadline = Instant::now() + timeout;
        while !check(self) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "{} exited ({status}) while waiting for: {what}\n--- its log ---\n{}",
                    self.name,
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {timeout:?} waiting for: {what}\n--- {} log ---\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encodes a query-string value.
pub fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An HTTP/1.1 POST over `stream` (one request, `Connection: close`): the status code
/// and the body (status 0 when nothing came back).
pub fn post_over<S: std::io::Read + std::io::Write>(
    mut stream: S,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String) {
    let mut request = format!("POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("transfer-encoding"))
    {
        request.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    let mut raw = request.into_bytes();
    raw.extend_from_slice(body);
    // A server may answer (413, 401) before it reads the whole body and close: what it
    // answered is still read.
    let _ = stream.write_all(&raw);
    let _ = stream.flush();
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// [`post_over`] a plain TCP connection to `addr`.
pub fn http_post(addr: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String) {
    let Ok(s) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    post_over(s, addr, path, headers, body)
}

/// RFC 3339 (UTC, milliseconds) of unix milliseconds `ms`.
pub fn rfc3339(ms: u64) -> String {
    let (days, rest) = ((ms / 86_400_000) as i64, ms % 86_400_000);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / 3_600_000,
        rest / 60_000 % 60,
        rest / 1000 % 60,
        rest % 1000
    )
}
