// Included by tests/src/agent.rs and by xtask/src/bench.rs (`include!`): xtask builds with
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
