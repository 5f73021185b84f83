//! The `registry-janitor` binary holds the service and nothing else: its command list.

use std::process::Command;

/// `registry-janitor --help` lists the service's commands, and no tooling: the demo and
/// the benchmark are `registry-janitor-lab`'s.
#[test]
fn the_service_binary_lists_the_service_commands_only() {
    let out = Command::new(env!("CARGO_BIN_EXE_registry-janitor"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let commands: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(
        commands,
        [
            "worker",
            "reconcile",
            "alert-receiver",
            "emit",
            "status",
            "dead-letters",
            "held",
            "format",
            "help"
        ],
        "{help}"
    );
    for tooling in ["demo", "bench", "bench-probe"] {
        let out = Command::new(env!("CARGO_BIN_EXE_registry-janitor"))
            .arg(tooling)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "`{tooling}` is not a command");
    }
}
