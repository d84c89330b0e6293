#![no_std]
// The programs are binaries (src/main.rs, src/pass.rs); this library target only lets
// balancer-agent depend on this crate, so that cargo rebuilds the agent when it changes.
