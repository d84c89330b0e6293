//! The compiled XDP objects, embedded so that the agent is one self-contained binary.

/// The load balancer: program `balancer` and its maps.
pub static BALANCER: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/balancer"));

/// A program that returns XDP_PASS: the floor of packet-cost benchmarks, and what a veth
/// peer needs before it accepts frames that our program sends to it.
pub static PASS: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/pass"));

/// The backend's half of tunnel forwarding: program `decap`, which takes the gateway's
/// outer header off (`balancer-agent decap`).
pub static DECAP: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/decap"));
