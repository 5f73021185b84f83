//! Network namespaces for the `partition` fault, on one node where the run has root and
//! `ip netns` works.
//!
//! Each janitor process (the workers, then the reconciler: process `k`) runs in a network
//! namespace of its own, `rjn<pid>-<k>` (`<pid>` this process's id), joined to the host by
//! a veth pair: the host end `rjh<pid>-<k>`, the other end `rjp<pid>-<k>` in the
//! namespace. Each pair is a /30 out of [`RANGE`]: the host end has the first address,
//! the namespace end the second. The process is started with `ip netns exec`, and its
//! `redis_url` names the host end's address, where Redis listens too. A cut sets the host
//! end's link down: what the process sends is dropped, nothing answers it and nothing
//! resets its connections; a heal sets the link up again, and its connections go on
//! where they were (or time out and reconnect, as the client decides).
//!
//! The namespaces and their links are removed at the end of the run ([`Net::teardown`],
//! also on drop), and those of runs whose process is gone at the start of the next
//! ([`clean_leftovers`]).

use std::{
    collections::HashSet,
    net::Ipv4Addr,
    process::{Command, Stdio},
    sync::Mutex,
};

/// The addresses the pairs take: 198.18.0.0/15, 32,768 /30s. The range is reserved for
/// benchmarking networks (RFC 2544), so no deployment's own network (a Kubernetes
/// service range, a VPC) is likely to use it.
pub const RANGE: (Ipv4Addr, u8) = (Ipv4Addr::new(198, 18, 0, 0), 15);
/// The /30s in [`RANGE`].
const PAIRS: u32 = 1 << (32 - RANGE.1 - 2);
/// Longest name of a network interface (`IFNAMSIZ` - 1).
const IFNAME_MAX: usize = 15;

/// One process's namespace and link.
#[derive(Debug, Clone)]
pub struct Link {
    /// The namespace, `rjn<pid>-<k>`.
    pub netns: String,
    /// The host end, `rjh<pid>-<k>`.
    pub host: String,
    /// The end in the namespace, `rjp<pid>-<k>`.
    pub peer: String,
    /// The host end's address: where the process reaches Redis.
    pub host_addr: Ipv4Addr,
    pub peer_addr: Ipv4Addr,
}

/// The namespaces of a run.
#[derive(Debug)]
pub struct Net {
    pub links: Vec<Link>,
    /// Set once [`Net::teardown`] has run.
    gone: Mutex<bool>,
}

/// Why partitions cannot be made here (not root, or a namespace and a veth pair cannot
/// be made: no `ip`, no CAP_SYS_ADMIN or CAP_NET_ADMIN, no veth), or None. It makes a
/// namespace and a pair of its own, and removes them.
pub fn unavailable() -> Option<String> {
    if !is_root() {
        return Some("the run is not root".into());
    }
    let pid = std::process::id();
    let (netns, host, peer) = (
        format!("rjn{pid}-{PROBE}"),
        format!("rjh{pid}-{PROBE}"),
        format!("rjp{pid}-{PROBE}"),
    );
    let made = ip(&["netns", "add", &netns])
        .and_then(|()| ip(&["link", "add", &host, "type", "veth", "peer", "name", &peer]));
    let _ = ip(&["link", "delete", &host]);
    let _ = ip(&["netns", "delete", &netns]);
    made.err()
}

/// The number of the probe's namespace and pair (`rjn<pid>-99`): a name of ours, so that
/// one left by a run killed while probing is removed as any other.
const PROBE: usize = 99;

/// Whether this process's effective user id is 0 (`Uid:` of `/proc/self/status`).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// Runs `ip <args>`; an error with its stderr if it fails.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The stdout of `ip <args>`, or empty.
fn ip_out(args: &[&str]) -> String {
    Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// The pid in a name of ours (`<prefix><pid>-<k>`), or None.
fn pid_of(name: &str, prefix: &str) -> Option<u32> {
    let (pid, k) = name.strip_prefix(prefix)?.split_once('-')?;
    k.parse::<usize>().ok()?;
    pid.parse().ok()
}

/// A name of ours left by a run that is gone: its pid is no process now, or is this
/// process (which has made none yet when this is asked).
fn left_over(name: &str, prefix: &str) -> bool {
    pid_of(name, prefix).is_some_and(|pid| {
        pid == std::process::id() || !std::path::Path::new(&format!("/proc/{pid}")).exists()
    })
}

/// Removes the namespaces (`rjn<pid>-<k>`) and host ends (`rjh<pid>-<k>`) of runs whose
/// process is gone; returns how many.
pub fn clean_leftovers() -> usize {
    let mut removed = 0;
    for line in ip_out(&["netns", "list"]).lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        if left_over(name, "rjn") && ip(&["netns", "delete", name]).is_ok() {
            removed += 1;
        }
    }
    // `<index>: <name>@<peer>: <flags> ...`
    for line in ip_out(&["-o", "link", "show"]).lines() {
        let Some(name) = line
            .split(": ")
            .nth(1)
            .map(|n| n.split('@').next().unwrap_or(n))
        else {
            continue;
        };
        if left_over(name, "rjh") && ip(&["link", "delete", name]).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// The IPv4 addresses on the host's interfaces.
fn host_addresses() -> HashSet<Ipv4Addr> {
    // `<index>: <dev>    inet <addr>/<len> ...`
    ip_out(&["-4", "-o", "addr", "show"])
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "inet")?;
            words.next()?.split('/').next()?.parse().ok()
        })
        .collect()
}

/// The network address of the `i`-th /30 of [`RANGE`].
fn pair(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(RANGE.0) + 4 * (i % PAIRS))
}

/// The first of `count` consecutive /30s none of whose addresses the host has, starting
/// from a block chosen by `pid` (runs at once take different blocks); None if the range
/// has no such block.
fn first_free(pid: u32, count: u32, used: &HashSet<Ipv4Addr>) -> Option<u32> {
    let blocks = PAIRS / count.max(1);
    (0..blocks)
        .map(|b| ((pid % blocks + b) % blocks) * count)
        .find(|&start| {
            (start..start + count).all(|i| {
                let net = u32::from(pair(i));
                (net..net + 4).all(|a| !used.contains(&Ipv4Addr::from(a)))
            })
        })
}

impl Net {
    /// Leftovers of dead runs removed, then a namespace and a veth pair for each of
    /// `count` processes, every link up. An error says what failed (and what was made is
    /// removed).
    pub fn setup(count: usize) -> Result<Net, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        clean_leftovers();
        let pid = std::process::id();
        let start = first_free(pid, count as u32, &host_addresses())
            .ok_or_else(|| format!("no {count} free /30s in {}/{}", RANGE.0, RANGE.1))?;
        let mut links = Vec::new();
        for k in 0..count {
            let net = u32::from(pair(start + k as u32));
            let link = Link {
                netns: format!("rjn{pid}-{k}"),
                host: format!("rjh{pid}-{k}"),
                peer: format!("rjp{pid}-{k}"),
                host_addr: Ipv4Addr::from(net + 1),
                peer_addr: Ipv4Addr::from(net + 2),
            };
            if link.host.len() > IFNAME_MAX {
                return Err(format!("{} is longer than {IFNAME_MAX}", link.host));
            }
            links.push(link);
        }
        let net = Net {
            links,
            gone: Mutex::new(false),
        };
        for link in &net.links {
            // On failure, `net` is dropped: what was made is removed.
            link.make()?;
        }
        Ok(net)
    }

    /// The host ends' addresses, where Redis must listen too.
    pub fn host_addrs(&self) -> Vec<Ipv4Addr> {
        self.links.iter().map(|l| l.host_addr).collect()
    }

    /// Cuts process `k` off: its host end's link down.
    pub fn cut(&self, k: usize) -> Result<(), String> {
        ip(&["link", "set", "dev", &self.links[k].host, "down"])
    }

    /// Joins process `k` again: its host end's link up.
    pub fn heal(&self, k: usize) -> Result<(), String> {
        ip(&["link", "set", "dev", &self.links[k].host, "up"])
    }

    /// Every link up; the errors, if any.
    pub fn heal_all(&self) -> Result<(), String> {
        let errors: Vec<String> = (0..self.links.len())
            .filter_map(|k| self.heal(k).err())
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// Removes every namespace and link of the run (once; what is gone already is fine).
    pub fn teardown(&self) {
        let mut gone = self.gone.lock().unwrap_or_else(|e| e.into_inner());
        if *gone {
            return;
        }
        for link in &self.links {
            link.remove();
        }
        *gone = true;
    }
}

impl Link {
    fn make(&self) -> Result<(), String> {
        let (ns, host, peer) = (&self.netns, &self.host, &self.peer);
        let host_cidr = format!("{}/30", self.host_addr);
        let peer_cidr = format!("{}/30", self.peer_addr);
        ip(&["netns", "add", ns])?;
        ip(&[
            "link", "add", host, "type", "veth", "peer", "name", peer, "netns", ns,
        ])?;
        ip(&["addr", "add", &host_cidr, "dev", host])?;
        ip(&["-n", ns, "addr", "add", &peer_cidr, "dev", peer])?;
        ip(&["-n", ns, "link", "set", "dev", "lo", "up"])?;
        ip(&["-n", ns, "link", "set", "dev", peer, "up"])?;
        ip(&["link", "set", "dev", host, "up"])
    }

    /// The host end deleted (which deletes the pair), and the namespace.
    fn remove(&self) {
        let _ = ip(&["link", "delete", &self.host]);
        let _ = ip(&["netns", "delete", &self.netns]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.teardown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_dead_runs_are_told_from_others() {
        assert_eq!(pid_of("rjn123-0", "rjn"), Some(123));
        assert_eq!(pid_of("rjh4194303-12", "rjh"), Some(4_194_303));
        assert_eq!(pid_of("rjn123", "rjn"), None);
        assert_eq!(pid_of("rjn12a-0", "rjn"), None);
        assert_eq!(pid_of("rjh123-x", "rjh"), None);
        assert_eq!(pid_of("eth0", "rjh"), None);
        assert!(left_over(&format!("rjn{}-3", std::process::id()), "rjn"));
        assert!(!left_over("rjn1-0", "rjn"), "pid 1 is always a process");
        assert!(!left_over("veth0", "rjh"));
    }

    #[test]
    fn pairs_are_slash_30s_of_the_range_clear_of_the_hosts_addresses() {
        assert_eq!(pair(0), Ipv4Addr::new(198, 18, 0, 0));
        assert_eq!(pair(1), Ipv4Addr::new(198, 18, 0, 4));
        assert_eq!(pair(PAIRS - 1), Ipv4Addr::new(198, 19, 255, 252));
        assert_eq!(pair(PAIRS), pair(0), "the range wraps");
        let none = HashSet::new();
        assert_eq!(first_free(7, 4, &none), Some(28));
        let start = first_free(7, 4, &none).unwrap();
        let used: HashSet<Ipv4Addr> = [Ipv4Addr::from(u32::from(pair(start + 2)) + 1)].into();
        assert_eq!(first_free(7, 4, &used), Some(start + 4));
        // The longest names fit: a 7-digit pid, two-digit k (the probe's too).
        assert!("rjh4194303-99".len() <= IFNAME_MAX);
        assert!(format!("rjh4194303-{PROBE}").len() <= IFNAME_MAX);
    }
}
