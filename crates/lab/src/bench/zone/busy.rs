//! Other load on the machine: `--busy-cores N` keeps N cores busy through a zone run and
//! its single-server run, each with a process of its own (`registry-janitor-lab busy`)
//! spinning at normal priority, as another service on the same host would.

use std::process::{Child, Command, Stdio};

use registry_janitor::error::{Error, Result};

/// The busy processes of one run; killed when dropped.
pub(super) struct Busy(Vec<Child>);

impl Busy {
    /// Starts `cores` busy processes of this binary.
    pub(super) fn start(cores: usize) -> Result<Self> {
        let exe = std::env::current_exe().map_err(|e| {
            Error::LocalRedis(format!("this binary's path, for a busy process: {e}"))
        })?;
        let mut busy = Busy(Vec::with_capacity(cores));
        for _ in 0..cores {
            let child = Command::new(&exe)
                .arg("busy")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| Error::LocalRedis(format!("starting a busy process: {e}")))?;
            busy.0.push(child);
        }
        Ok(busy)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `registry-janitor-lab busy`: spins on one core until killed, or until the process that
/// started it is gone (a bench killed whole leaves no spinning process behind).
pub fn spin() -> ! {
    let parent = std::os::unix::process::parent_id();
    let mut x: u64 = 1;
    loop {
        for _ in 0..(1 << 24) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        if std::os::unix::process::parent_id() != parent {
            std::process::exit(0);
        }
    }
}
