//! The gateway topology without the balancer: it comes up, neighbours reach each other, and
//! it leaves nothing behind, also when a test panics inside it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use balancer_tests::topology::{Family, Topology, BACKENDS};
use balancer_tests::{check_nothing_remains, serial};

const SSE_SERVER: &str = env!("CARGO_BIN_EXE_sse-server");

#[test]
fn neighbours_reach_each_other_and_nothing_remains() {
    let _serial = serial();
    let topology = Topology::build(Path::new(SSE_SERVER)).unwrap();
    for address in ["10.9.0.1", "fd00:9::1"] {
        topology
            .client()
            .exec("ping", &["-c", "1", "-W", "2", address])
            .unwrap();
    }
    for address in ["10.4.0.1", "fd00:4::1"] {
        topology
            .backend(0)
            .exec("ping", &["-c", "1", "-W", "2", address])
            .unwrap();
    }
    // The client has no route but to the VIPs through the gateway.
    let routes = topology.client().ip(&["route", "show"]).unwrap();
    assert!(!routes.contains("default"), "{routes}");
    assert!(topology.gateway_xdp().unwrap().is_empty());
    let offloads = topology.client().exec("ethtool", &["-k", "c0"]).unwrap();
    assert!(offloads.contains("tx-checksumming: off"), "{offloads}");
    for i in 0..BACKENDS {
        let backend = topology.backend(i);
        let addresses = backend.ip(&["-brief", "addr", "show", "eth0"]).unwrap();
        for family in [Family::V4, Family::V6] {
            assert!(
                addresses.contains(&family.backend(i).to_string()),
                "{addresses}"
            );
        }
    }
    drop(topology);
    check_nothing_remains().unwrap();
}

#[test]
fn panic_inside_a_topology_leaves_nothing_behind() {
    let _serial = serial();
    let result = catch_unwind(AssertUnwindSafe(|| {
        let _topology = Topology::build(Path::new(SSE_SERVER)).unwrap();
        panic!("deliberate panic inside a topology");
    }));
    let payload = result.expect_err("the closure panics");
    assert_eq!(
        payload.downcast_ref::<&str>(),
        Some(&"deliberate panic inside a topology"),
        "the topology itself failed"
    );
    check_nothing_remains().unwrap();
}
