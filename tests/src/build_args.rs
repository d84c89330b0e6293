// Included by tests/src/agent.rs and by xtask/src/cmd.rs (`include!`): xtask builds with
// stable Rust before anything here compiles, so it cannot depend on this crate.

/// How `cargo xtask bench` builds the benchmarks and the release agent they run, and so how
/// `release_agent_binary` asks Cargo for that agent: the same targets of the same packages,
/// so that Cargo resolves the dependencies' features alike and compiles nothing twice.
pub const RELEASE_BUILD_ARGS: [&str; 8] = [
    "build",
    "--release",
    "-p",
    "balancer-tests",
    "-p",
    "balancer-agent",
    "--bins",
    "--benches",
];

/// Takes out of `cargo`'s environment what Cargo set for the crate that runs it (its
/// manifest, package, crate and binaries), leaving the user's own (CARGO_HOME,
/// CARGO_TARGET_DIR, ...). `ring`'s build script watches CARGO_MANIFEST_DIR: a build run by
/// the xtask (which has the xtask's) and one run by a benchmark (the tests crate's) each
/// found it changed and recompiled ring and everything above it, the agent included, a
/// minute at every benchmark of `cargo xtask bench`.
pub fn without_run_env(cargo: &mut std::process::Command) {
    for (name, _) in std::env::vars_os() {
        let set_by_cargo = name.to_str().is_some_and(|name| {
            matches!(
                name,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_MANIFEST_LINKS"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "CARGO_RUSTC_CURRENT_DIR"
                    | "OUT_DIR"
            ) || name.starts_with("CARGO_PKG_")
                || name.starts_with("CARGO_BIN_EXE_")
        });
        if set_by_cargo {
            cargo.env_remove(name);
        }
    }
}
