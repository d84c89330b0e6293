//! The XDP program under BPF_PROG_TEST_RUN: crafted frames in, verdict and exact bytes out,
//! with every checksum of the expected frames computed from scratch by etherparse. The
//! program runs in a namespace of its own whose routes and permanent neighbours make the
//! FIB answer deterministic: 10.4.0.0/24 and fd00:4::/64 behind g1, clients behind g0.

use std::net::{IpAddr, SocketAddr};

use anyhow::{bail, ensure, Context, Result};
use aya::programs::{TestRun, TestRunOptions, Xdp};
use balancer_agent::{
    config::Config,
    controller::Controller,
    dataplane::Dataplane,
    decap::Decap,
    plan::{Ids, Plan, VipPlan, Weights},
    sync::{Event, Kind},
};
use balancer_common::{
    addr_words, tunnel_flow_label, BackendStats, Counter, DecapCounter, FlowKey, Limit,
};
use balancer_tests::netns::Netns;
use balancer_tests::test_run::{gateway_links, ifindex, MAC_G0, MAC_G1, MAC_S0};
use etherparse::{IpHeaders, Ipv4Header, Ipv6Header, PacketBuilder, TcpOptionElement, VlanId};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;

/// The gateway's links, where the agent would attach the program.
const LINKS: [&str; 2] = ["g0", "g1"];
const MAC_CLIENT: [u8; 6] = [0x02, 0, 0, 0, 0x09, 0x22];
const MAC_SAME_LINK: [u8; 6] = [0x02, 0, 0, 0, 0x09, 0x50];
const MAC_BACKEND: [u8; 6] = [0x02, 0, 0, 0, 0x04, 0x11];

/// The addresses of one family.
struct Net {
    client: IpAddr,
    /// VIP whose backend sits behind g1, neighbour resolved.
    vip: IpAddr,
    backend: IpAddr,
    /// VIP whose backend is on the client's link (port 9000): XDP_TX.
    vip_tx: IpAddr,
    backend_tx: IpAddr,
    /// VIP whose backend has no neighbour entry: rewritten, then to the stack.
    vip_nn: IpAddr,
    backend_nn: IpAddr,
    /// VIP whose only backend has weight 0.
    vip_empty: IpAddr,
    /// VIP whose backend is `routed`, behind `backend` as a router.
    vip_routed: IpAddr,
    /// An address behind g1 that is no backend.
    other: IpAddr,
    /// A router on the client's link, which sends ICMP errors.
    router: IpAddr,
    /// VIP of a pool of four backends behind g1 (no neighbour entries).
    vip_multi: IpAddr,
    multi: [IpAddr; 4],
    /// DSR VIPs (`forwarding = "dsr"`, port 8000): to `backend`, to `backend_tx` (one
    /// link), to `routed` (behind `backend` as a router), to `backend_nn`.
    vip_dsr: IpAddr,
    vip_dsr_tx: IpAddr,
    vip_dsr_routed: IpAddr,
    routed: IpAddr,
    vip_dsr_nn: IpAddr,
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn v4() -> Net {
    Net {
        client: ip("10.9.0.2"),
        vip: ip("192.0.2.60"),
        backend: ip("10.4.0.11"),
        vip_tx: ip("192.0.2.61"),
        backend_tx: ip("10.9.0.50"),
        vip_nn: ip("192.0.2.62"),
        backend_nn: ip("10.4.0.12"),
        vip_empty: ip("192.0.2.63"),
        vip_routed: ip("192.0.2.65"),
        other: ip("10.4.0.99"),
        router: ip("10.9.0.1"),
        vip_multi: ip("192.0.2.64"),
        multi: ["10.4.0.21", "10.4.0.22", "10.4.0.23", "10.4.0.24"].map(ip),
        vip_dsr: ip("192.0.2.70"),
        vip_dsr_tx: ip("192.0.2.71"),
        vip_dsr_routed: ip("192.0.2.72"),
        routed: ip("10.5.0.11"),
        vip_dsr_nn: ip("192.0.2.73"),
    }
}

fn v6() -> Net {
    Net {
        client: ip("fd00:9::2"),
        vip: ip("2001:db8::60"),
        backend: ip("fd00:4::11"),
        vip_tx: ip("2001:db8::61"),
        backend_tx: ip("fd00:9::50"),
        vip_nn: ip("2001:db8::62"),
        backend_nn: ip("fd00:4::12"),
        vip_empty: ip("2001:db8::63"),
        vip_routed: ip("2001:db8::65"),
        other: ip("fd00:4::99"),
        router: ip("fd00:9::1"),
        vip_multi: ip("2001:db8::64"),
        multi: ["fd00:4::21", "fd00:4::22", "fd00:4::23", "fd00:4::24"].map(ip),
        vip_dsr: ip("2001:db8::70"),
        vip_dsr_tx: ip("2001:db8::71"),
        vip_dsr_routed: ip("2001:db8::72"),
        routed: ip("fd00:5::11"),
        vip_dsr_nn: ip("2001:db8::73"),
    }
}

fn config(nets: &[Net]) -> Config {
    let mut text = String::from("[agent]\ninterfaces = [\"g0\", \"g1\"]\n");
    for (f, n) in nets.iter().enumerate() {
        for (name, vip, backend, port, weight) in [
            ("a", n.vip, n.backend, 8000, 100),
            ("tx", n.vip_tx, n.backend_tx, 9000, 100),
            ("nn", n.vip_nn, n.backend_nn, 8000, 100),
            ("empty", n.vip_empty, n.backend, 8000, 0),
            ("routed", n.vip_routed, n.routed, 8000, 100),
        ] {
            text += &format!(
                "[[pool]]\nname = \"{name}{f}\"\nvip = \"{vip}\"\nport = 8000\n\
                 [[pool.server]]\naddress = \"{backend}\"\nport = {port}\nmetrics_port = 8001\nweight = {weight}\n"
            );
        }
        for (name, vip, backend) in [
            ("dsr", n.vip_dsr, n.backend),
            ("dsrtx", n.vip_dsr_tx, n.backend_tx),
            ("dsrrouted", n.vip_dsr_routed, n.routed),
            ("dsrnn", n.vip_dsr_nn, n.backend_nn),
        ] {
            text += &format!(
                "[[pool]]\nname = \"{name}{f}\"\nvip = \"{vip}\"\nport = 8000\nforwarding = \"dsr\"\n\
                 [[pool.server]]\naddress = \"{backend}\"\nport = 8000\nmetrics_port = 8001\n"
            );
        }
        text += &format!(
            "[[pool]]\nname = \"multi{f}\"\nvip = \"{}\"\nport = 8000\n",
            n.vip_multi
        );
        for (i, b) in n.multi.iter().enumerate() {
            text += &format!(
                "[[pool.server]]\naddress = \"{b}\"\nport = 8000\nmetrics_port = 8001\nweight = {}\n",
                100 * (i + 1)
            );
        }
    }
    Config::parse(std::path::Path::new("test.toml"), &text).expect("test config")
}

/// A frame to craft or to expect.
#[derive(Clone)]
struct Frame {
    smac: [u8; 6],
    dmac: [u8; 6],
    vlan: Option<u16>,
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
    ttl: u8,
    flags: &'static str,
    /// Bytes of payload beyond the small one a 'P' frame carries.
    bulk: usize,
}

/// The SYN-ACK of `n.backend`'s port 8000 to the client's `port`, as it arrives on g1.
fn server_syn_ack(n: &Net, port: u16) -> Frame {
    Frame {
        smac: MAC_S0,
        dmac: MAC_G1,
        vlan: None,
        src: n.backend,
        dst: n.client,
        sport: 8000,
        dport: port,
        ttl: 64,
        flags: "SA",
        bulk: 0,
    }
}

/// A SYN from the client to `dst:8000`, as it arrives on g0.
fn client_syn(n: &Net, dst: IpAddr, sport: u16) -> Frame {
    Frame {
        smac: MAC_CLIENT,
        dmac: MAC_G0,
        vlan: None,
        src: n.client,
        dst,
        sport,
        dport: 8000,
        ttl: 64,
        flags: "S",
        bulk: 0,
    }
}

/// What `n`'s backend receives of the client's frame `f`: to its address, from g1 to `dmac`,
/// TTL - 1.
fn to_backend(f: &Frame, n: &Net, dmac: [u8; 6]) -> Frame {
    f.with(|f| {
        f.smac = MAC_G1;
        f.dmac = dmac;
        f.dst = n.backend;
        f.ttl -= 1;
    })
}

/// `f` as we send it on unchanged (DSR, or inside a tunnel): from `smac` to `dmac`, TTL - 1.
fn hop(f: &Frame, smac: [u8; 6], dmac: [u8; 6]) -> Frame {
    f.with(|f| {
        f.smac = smac;
        f.dmac = dmac;
        f.ttl -= 1;
    })
}

/// `f` carrying `bulk` bytes of data (flags PA).
fn data(f: &Frame, bulk: usize) -> Frame {
    f.with(|f| {
        f.flags = "PA";
        f.bulk = bulk;
    })
}

/// What the client receives of a backend's reply `f` to a connection to `vip`: from the
/// VIP, out of g0.
fn to_client(f: &Frame, vip: IpAddr) -> Frame {
    f.with(|f| {
        f.smac = MAC_G0;
        f.dmac = MAC_CLIENT;
        f.src = vip;
        f.ttl -= 1;
    })
}

impl Frame {
    fn bytes(&self) -> Vec<u8> {
        let eth = PacketBuilder::ethernet2(self.smac, self.dmac);
        let with_ip = |b: etherparse::PacketBuilderStep<etherparse::Ethernet2Header>| match (
            self.src, self.dst,
        ) {
            (IpAddr::V4(s), IpAddr::V4(d)) => b.ipv4(s.octets(), d.octets(), self.ttl),
            (IpAddr::V6(s), IpAddr::V6(d)) => b.ipv6(s.octets(), d.octets(), self.ttl),
            _ => panic!("mixed families"),
        };
        let ipb = match self.vlan {
            Some(id) => match (self.src, self.dst) {
                (IpAddr::V4(s), IpAddr::V4(d)) => eth
                    .single_vlan(VlanId::try_new(id).unwrap())
                    .ipv4(s.octets(), d.octets(), self.ttl),
                (IpAddr::V6(s), IpAddr::V6(d)) => eth
                    .single_vlan(VlanId::try_new(id).unwrap())
                    .ipv6(s.octets(), d.octets(), self.ttl),
                _ => panic!("mixed families"),
            },
            None => with_ip(eth),
        };
        let mut tcp = ipb.tcp(self.sport, self.dport, 1000, 64240);
        for f in self.flags.chars() {
            tcp = match f {
                'S' => tcp.syn(),
                'A' => tcp.ack(2000),
                'F' => tcp.fin(),
                'R' => tcp.rst(),
                'P' => tcp.psh(),
                _ => panic!("flag {f}"),
            };
        }
        // An MSS option, so that a frame cut inside the options is a distinct case.
        let tcp = tcp
            .options(&[TcpOptionElement::MaximumSegmentSize(1460)])
            .unwrap();
        let mut payload: Vec<u8> = if self.flags.contains('P') {
            b"data: {\"x\":1}\n\n".to_vec()
        } else {
            Vec::new()
        };
        payload.resize(payload.len() + self.bulk, b'x');
        let mut out = Vec::new();
        tcp.write(&mut out, &payload).unwrap();
        out
    }

    fn with(&self, f: impl FnOnce(&mut Frame)) -> Frame {
        let mut c = self.clone();
        f(&mut c);
        c
    }
}

/// Runs `frame` through `dp`'s program as if it came in on `ingress`: the verdict and the
/// frame after.
fn run_on(dp: &mut Dataplane, ingress: u32, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
    run_program(dp.program(), ingress, frame)
}

/// [`run_on`] for any XDP program.
fn run_program(prog: &mut Xdp, ingress: u32, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
    // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index,
    // egress_ifindex.
    let mut ctx = [0u8; 24];
    ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&ingress.to_ne_bytes());
    let mut out = vec![0u8; frame.len() + 256];
    let r = prog.test_run(TestRunOptions {
        data_in: Some(frame),
        data_out: Some(&mut out),
        ctx_in: Some(&ctx),
        ..Default::default()
    })?;
    out.truncate(r.data_size_out as usize);
    Ok((r.return_value, out))
}

struct Harness {
    dp: Dataplane,
    g0: u32,
    g1: u32,
}

impl Harness {
    /// The program with `config` applied and room everywhere (every SYN keeps its first
    /// Maglev draw unless a case says otherwise), and the plan applied.
    fn load(config: &Config) -> Result<(Self, Plan)> {
        let mut h = Self::new()?;
        let plan = h.apply(&mut Ids::default(), config)?;
        Ok((h, plan))
    }

    /// The program, attached nowhere, with no VIP yet.
    fn new() -> Result<Self> {
        let mut dp = Dataplane::load(1 << 16, None)?;
        dp.set_egress(&LINKS.map(String::from))?;
        Ok(Harness {
            dp,
            g0: ifindex("g0")?,
            g1: ifindex("g1")?,
        })
    }

    /// Plans `config` with `ids` and applies it, as a reload does, with room everywhere.
    fn apply(&mut self, ids: &mut Ids, config: &Config) -> Result<Plan> {
        let plan = ids.plan(config, &Default::default(), std::time::Instant::now())?;
        self.dp.apply(&plan)?;
        for &(id, _) in &plan.backends {
            self.dp.set_budget(id, 1_000_000)?;
        }
        Ok(plan)
    }

    fn run(&mut self, ingress: u32, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
        run_on(&mut self.dp, ingress, frame)
    }

    fn counter(&self, c: Counter) -> u64 {
        self.dp
            .counters()
            .unwrap()
            .into_iter()
            .find(|(k, _)| *k == c)
            .unwrap()
            .1
    }

    fn stats(&self, id: u32) -> BackendStats {
        self.dp.backend_stats(id).unwrap()
    }

    /// [`Harness::expect`] for a frame the program must leave as it is.
    fn expect_untouched(
        &mut self,
        what: &str,
        ingress: u32,
        frame: &[u8],
        verdict: u32,
        counter: Counter,
    ) -> Result<()> {
        self.expect(what, ingress, frame, verdict, frame, counter)
    }

    /// Runs `frame` and checks the verdict, the output bytes, that `counter` moved by one,
    /// and, when it is a reason to pass or drop a packet (`pass_*`, `drop_*`), that no other
    /// such reason moved.
    fn expect(
        &mut self,
        what: &str,
        ingress: u32,
        frame: &[u8],
        verdict: u32,
        out: &[u8],
        counter: Counter,
    ) -> Result<()> {
        let before = self.dp.counters()?;
        let (v, got) = self.run(ingress, frame).with_context(|| what.to_owned())?;
        ensure!(v == verdict, "{what}: verdict {v}, expected {verdict}");
        ensure!(
            got == out,
            "{what}: output differs\n got      {got:02x?}\n expected {out:02x?}"
        );
        let after = self.dp.counters()?;
        let reason = |c: &Counter| c.name().starts_with("pass_") || c.name().starts_with("drop_");
        for ((c, b), (_, a)) in before.iter().zip(&after) {
            if *c == counter {
                ensure!(*a == b + 1, "{what}: counter {} went {b} -> {a}", c.name());
            } else if reason(&counter) && reason(c) {
                ensure!(a == b, "{what}: counter {} went {b} -> {a} too", c.name());
            }
        }
        Ok(())
    }
}

fn topology() -> Result<Netns> {
    gateway_links(
        "xdp",
        &[
            ("10.9.0.2", MAC_CLIENT, "g0"),
            ("fd00:9::2", MAC_CLIENT, "g0"),
            ("10.9.0.50", MAC_SAME_LINK, "g0"),
            ("fd00:9::50", MAC_SAME_LINK, "g0"),
            ("10.4.0.11", MAC_BACKEND, "g1"),
            ("fd00:4::11", MAC_BACKEND, "g1"),
        ],
    )
    .and_then(|ns| {
        // Servers behind a router (10.4.0.11), for DSR VIPs that cannot use them.
        ns.ip(&["route", "add", "10.5.0.0/24", "via", "10.4.0.11"])?;
        ns.ip(&["-6", "route", "add", "fd00:5::/64", "via", "fd00:4::11"])?;
        Ok(ns)
    })
}

/// Runs `f` in the namespace `topology` builds, one test at a time, and removes it after.
fn in_topology(f: impl FnOnce() -> Result<()> + Send) -> Result<()> {
    let _serial = balancer_tests::serial();
    let ns = topology()?;
    let result = ns.enter(f);
    drop(ns);
    result
}

#[test]
fn xdp_verdicts_and_bytes() -> Result<()> {
    in_topology(|| {
        let nets = [v4(), v6()];
        let config = config(&nets);
        let (mut h, plan) = Harness::load(&config)?;
        let id = |addr: IpAddr| id_in(&plan, addr);
        for n in &nets {
            forwarding(&mut h, n, id(n.backend))?;
            next_hop_is_cached_for_an_epoch(&mut h, n)?;
            jumbo_frames(&mut h, n)?;
            flows_share_the_next_hop_to_a_backend_on_link(&mut h, n)?;
            passing(&mut h, n)?;
            let multi = multi_vip(&plan, n);
            kernel_picks_what_user_space_predicts(&mut h, n, &multi.table, &id)?;
            hinted_syns_go_home_then_spill(&mut h, n, multi.vip_id, &multi.table, &id)?;
            alternates_when_the_pick_has_no_room(&mut h, n, &config, &id)?;
            a_syn_leaves_a_down_server(&mut h, n, &config, &id)?;
            direct_server_return(&mut h, n, vip_in(&plan, n.vip_dsr).members[0].1)?;
            dropped_dsr_syns_are_not_hinted(&mut h, n, &plan)?;
            drops_are_counted_per_vip(&mut h, n, &plan)?;
            sent_only_where_attached(&mut h, n, vip_in(&plan, n.vip_dsr).members[0].1)?;
        }
        Ok(())
    })
}

/// Tunnel VIPs (`forwarding = "tunnel"`, to the server behind a router): the client's packet,
/// TTL - 1 and otherwise as it came, inside an outer IPIP or IP6IP6 header from the pool's
/// `tunnel_source` to the server, towards the router; the server's `decap` program gives the
/// packet inside back exactly, and leaves alone what a gateway it was not told of sends.
/// What cannot be sent is dropped, as for DSR: the stack would route it by the VIP. The
/// "too big" answer gives the MTU less the outer header.
#[test]
fn tunnels_carry_the_packet_as_it_came() -> Result<()> {
    in_topology(|| {
        let nets = [v4(), v6()];
        let sources = [ip("10.4.0.1"), ip("fd00:4::1")];
        let mut text = String::from("[agent]\ninterfaces = [\"g0\", \"g1\"]\n");
        for (f, (n, src)) in nets.iter().zip(sources).enumerate() {
            text += &format!(
                "[[pool]]\nname = \"tunnel{f}\"\nvip = \"{}\"\nport = 8000\n\
                 forwarding = \"tunnel\"\ntunnel_source = \"{src}\"\n\
                 [[pool.server]]\naddress = \"{}\"\nport = 8000\nmetrics_port = 8001\n",
                n.vip_dsr, n.routed
            );
        }
        let config = Config::parse(std::path::Path::new("tunnel.toml"), &text)?;
        let (mut h, plan) = Harness::load(&config)?;
        let mut decap = Decap::load(&sources)?;
        for (n, src) in nets.iter().zip(sources) {
            tunnel(&mut h, &mut decap, n, src, id_in(&plan, n.routed))?;
        }
        Ok(())
    })
}

fn tunnel(h: &mut Harness, decap: &mut Decap, n: &Net, src: IpAddr, id: u32) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let (g0, g1) = (h.g0, h.g1);
    let syn = client_syn(n, n.vip_dsr, 43001);
    // What the router (the backend's MAC) gets, and what the server finds inside.
    let inside = |f: &Frame| hop(f, MAC_G1, MAC_BACKEND);
    let s0 = h.stats(id);
    for (what, frame, counter) in [
        ("SYN", syn.clone(), Counter::FlowNewSyn),
        ("ACK", syn.with(|f| f.flags = "A"), Counter::Encapsulated),
        ("data", data(&syn, 600), Counter::Redirect),
        ("FIN", syn.with(|f| f.flags = "FA"), Counter::Forward),
    ] {
        let sent = encapsulated(&inside(&frame), src, n.routed);
        h.expect(
            &format!("{fam} tunnel {what}"),
            g0,
            &frame.bytes(),
            XDP_REDIRECT,
            &sent,
            counter,
        )?;
        let what = format!("{fam} tunnel {what}, decapsulated");
        expect_decap(decap, g1, &what, &sent, &inside(&frame).bytes())?;
    }
    let s1 = h.stats(id);
    ensure!(
        (s1.flows_opened, s1.flows_closed) == (s0.flows_opened + 1, s0.flows_closed + 1),
        "{fam} tunnel: opened {} and closed {}, expected one each",
        s1.flows_opened - s0.flows_opened,
        s1.flows_closed - s0.flows_closed
    );
    let counted = |d: &Decap, c: DecapCounter| -> Result<u64> {
        Ok(d.counters()?.into_iter().find(|(k, _)| *k == c).unwrap().1)
    };
    // From a gateway the server was not told of, and not a tunnel at all: untouched.
    let stranger = encapsulated(&inside(&syn), n.client, n.routed);
    let plain = inside(&syn).bytes();
    for (what, frame, counter) in [
        ("from another source", &stranger, DecapCounter::PassNotPeer),
        ("not tunnelled", &plain, DecapCounter::PassNotTunnel),
    ] {
        let before = counted(decap, counter)?;
        expect_decap(decap, g1, &format!("{fam} decap, {what}"), frame, frame)?;
        ensure!(
            counted(decap, counter)? == before + 1,
            "{fam} decap, {what}: {} did not count it",
            counter.name()
        );
    }
    // An ICMP error about a reply (which the server sent from the VIP itself, around the
    // gateway), from a router on the client's side: into the tunnel with the flow's packets.
    let open = syn.with(|f| f.sport = 43004);
    h.expect(
        &format!("{fam} tunnel SYN before an ICMP error"),
        g0,
        &open.bytes(),
        XDP_REDIRECT,
        &encapsulated(&inside(&open), src, n.routed),
        Counter::FlowNewSyn,
    )?;
    let reply = open.with(|f| {
        (f.src, f.dst, f.sport, f.dport) = (n.vip_dsr, n.client, 8000, 43004);
        f.flags = "AP";
    });
    let quoted = &reply.bytes()[14..];
    let error = icmp_error(n.router, n.vip_dsr, (MAC_CLIENT, MAC_G0, 64), quoted);
    let forwarded = icmp_error(n.router, n.vip_dsr, (MAC_G1, MAC_BACKEND, 63), quoted);
    let sent = encapsulated_bytes(&forwarded, (n.client, 43004), src, n.routed);
    h.expect(
        &format!("{fam} tunnel ICMP error"),
        g0,
        &error,
        XDP_REDIRECT,
        &sent,
        Counter::IcmpToBackend,
    )?;
    let what = format!("{fam} tunnel ICMP error, decapsulated");
    expect_decap(decap, g1, &what, &sent, &forwarded)?;
    // DSCP EF and ECT(1): the DSCP goes out on the outer header, the ECN capability not (a
    // mark on the outer header would be lost at the server), and the inner packet keeps
    // both. And an IPv4 packet without don't-fragment gets it on the outer header.
    let marked = data(&syn.with(|f| f.sport = 43005), 100);
    let open = syn.with(|f| f.sport = 43005);
    h.expect(
        &format!("{fam} tunnel SYN before a marked packet"),
        g0,
        &open.bytes(),
        XDP_REDIRECT,
        &encapsulated(&inside(&open), src, n.routed),
        Counter::FlowNewSyn,
    )?;
    let mut sent = with_tos(marked.bytes(), 0xb9);
    let mut inner = with_tos(inside(&marked).bytes(), 0xb9);
    if n.client.is_ipv4() {
        sent = without_df(sent);
        inner = without_df(inner);
    }
    h.expect(
        &format!("{fam} tunnel, DSCP and ECN marked"),
        g0,
        &sent,
        XDP_REDIRECT,
        &encapsulated_bytes(&inner, (n.client, 43005), src, n.routed),
        Counter::Encapsulated,
    )?;
    // A tagged frame: XDP cannot send on a VLAN device, the stack would route by the VIP.
    let tagged = syn.with(|f| {
        f.vlan = Some(7);
        f.sport = 43002;
    });
    h.expect_untouched(
        &format!("{fam} tunnel SYN, VLAN-tagged"),
        g0,
        &tagged.bytes(),
        XDP_DROP,
        Counter::DropTunnelVlan,
    )?;
    // Fits the egress MTU, but not with the outer header: answered with what is left.
    let v4 = n.client.is_ipv4();
    let big = data(&syn.with(|f| f.sport = 43003), if v4 { 1241 } else { 1221 });
    with_mtu(&["g1"], 1300, || {
        let len = big.bytes().len() - 14;
        ensure!(
            len == 1300,
            "{fam}: a {len}-byte packet, not one of exactly the MTU"
        );
        h.expect(
            &format!("{fam} tunnel data past the egress MTU with the outer header"),
            g0,
            &big.bytes(),
            XDP_TX,
            &too_big_answer(&big, if v4 { 1280 } else { 1260 }),
            Counter::TooBigAnswered,
        )
    })
}

/// Runs `frame` through the server's `decap` as if it came in on `ingress`: it must pass,
/// as `want`.
fn expect_decap(
    decap: &mut Decap,
    ingress: u32,
    what: &str,
    frame: &[u8],
    want: &[u8],
) -> Result<()> {
    let (verdict, out) = run_program(decap.program()?, ingress, frame)?;
    ensure!(
        verdict == XDP_PASS && out == want,
        "{what}: verdict {verdict}\n got      {out:02x?}\n expected {want:02x?}"
    );
    Ok(())
}

/// `inner` (an Ethernet frame) as the gateway tunnels it from `src` to `dst`: the same
/// MACs, then the outer header (TTL 64, the inner packet's DSCP without its ECN bits; for
/// IPv4 the inner packet's identification and don't-fragment set, for IPv6 the flow label
/// of the connection from `client`), then the inner IP packet.
fn encapsulated(inner: &Frame, src: IpAddr, dst: IpAddr) -> Vec<u8> {
    encapsulated_bytes(&inner.bytes(), (inner.src, inner.sport), src, dst)
}

fn encapsulated_bytes(bytes: &[u8], client: (IpAddr, u16), src: IpAddr, dst: IpAddr) -> Vec<u8> {
    let packet = &bytes[14..];
    let mut out = bytes[..12].to_vec();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            out.extend(0x0800u16.to_be_bytes());
            let mut ip = Ipv4Header::new(
                packet.len() as u16,
                64,
                etherparse::IpNumber::IPV4,
                s.octets(),
                d.octets(),
            )
            .unwrap();
            ip.identification = u16::from_be_bytes([packet[4], packet[5]]);
            ip.dont_fragment = true;
            ip.dscp = etherparse::IpDscp::try_new(packet[1] >> 2).unwrap();
            ip.header_checksum = ip.calc_header_checksum();
            out.extend(ip.to_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            out.extend(0x86ddu16.to_be_bytes());
            let key = FlowKey {
                src: addr_words(client.0).0,
                sport: client.1.to_be(),
                ..Default::default()
            };
            let ip = Ipv6Header {
                traffic_class: (packet[0] << 4 | packet[1] >> 4) & 0xfc,
                flow_label: etherparse::Ipv6FlowLabel::try_new(tunnel_flow_label(&key)).unwrap(),
                payload_length: packet.len() as u16,
                next_header: etherparse::IpNumber::IPV6,
                hop_limit: 64,
                source: s.octets(),
                destination: d.octets(),
            };
            out.extend(ip.to_bytes());
        }
        _ => panic!("mixed families"),
    }
    out.extend(packet);
    out
}

/// What a generated case sends: a client's frame to one of a family's VIPs, a backend's
/// reply to a connection the case opens first, or an ICMP error about that connection from
/// a router on the client's side; whole, or mangled as a broken or hostile sender might.
#[derive(Debug, Clone)]
struct Case {
    v6: bool,
    /// Below `VIPS` a client's frame to that VIP (see `vips`); `VIPS` a reply from the
    /// first one's server; `VIPS + 1` an ICMP error about that reply.
    target: usize,
    sport: u16,
    flags: &'static str,
    bulk: usize,
    ttl: u8,
    vlan: Option<u16>,
    mangle: Mangle,
}

#[derive(Debug, Clone)]
enum Mangle {
    Whole,
    /// Cut to this many bytes (an Ethernet header at least: BPF_PROG_TEST_RUN refuses
    /// less, as no driver hands XDP less).
    Cut(usize),
    /// These bytes of the headers set to these values.
    Set(Vec<(usize, u8)>),
}

/// Every kind of VIP of `n`: with a neighbour (redirected), on the client's link (sent back
/// out), without a neighbour (to the stack), with no server to take connections (dropped),
/// behind a router, the pool of four, and the DSR ones.
fn vips(n: &Net) -> [IpAddr; VIPS] {
    [
        n.vip,
        n.vip_tx,
        n.vip_nn,
        n.vip_empty,
        n.vip_routed,
        n.vip_multi,
        n.vip_dsr,
        n.vip_dsr_tx,
        n.vip_dsr_routed,
        n.vip_dsr_nn,
    ]
}
const VIPS: usize = 10;

/// TCP flags a case's frame carries.
const FLAGS: [&str; 9] = ["S", "A", "PA", "FA", "RA", "R", "SA", "F", ""];

fn case() -> impl proptest::strategy::Strategy<Value = Case> {
    use proptest::prelude::*;
    let mangle = prop_oneof![
        2 => Just(Mangle::Whole),
        1 => (14..120usize).prop_map(Mangle::Cut),
        1 => proptest::collection::vec((0..100usize, any::<u8>()), 1..4).prop_map(Mangle::Set),
    ];
    (
        (any::<bool>(), 0..VIPS + 2, 1024..65535u16),
        (
            proptest::sample::select(&FLAGS[..]),
            // Past a page: a frame in several buffers.
            prop_oneof![2 => Just(0usize), 2 => 0..1400usize, 1 => 3500..9000usize],
            prop_oneof![Just(64u8), 0..3u8],
            prop_oneof![3 => Just(None), 1 => (1..4095u16).prop_map(Some)],
        ),
        mangle,
    )
        .prop_map(
            |((v6, target, sport), (flags, bulk, ttl, vlan), mangle)| Case {
                v6,
                target,
                sport,
                flags,
                bulk,
                ttl,
                vlan,
                mangle,
            },
        )
}

/// Whether the IP packet in `frame` (Ethernet, tagged or not) carries valid checksums: its
/// IPv4 header's, and its TCP segment's or ICMP message's over what they cover. Its source
/// address too.
fn checksums_valid(frame: &[u8]) -> Result<(bool, IpAddr)> {
    use etherparse::{NetSlice, SlicedPacket, TransportSlice};
    let p = SlicedPacket::from_ethernet(frame).context("the output does not parse")?;
    let (ip_valid, src, dst) = match &p.net {
        Some(NetSlice::Ipv4(ip)) => {
            let h = ip.header();
            let valid = h.header_checksum() == h.to_header().calc_header_checksum();
            (
                valid,
                IpAddr::from(h.source_addr()),
                IpAddr::from(h.destination_addr()),
            )
        }
        Some(NetSlice::Ipv6(ip)) => {
            let h = ip.header();
            (
                true,
                IpAddr::from(h.source_addr()),
                IpAddr::from(h.destination_addr()),
            )
        }
        _ => bail!("the output is not IP"),
    };
    let l4_valid = match (&p.transport, src, dst) {
        (Some(TransportSlice::Tcp(tcp)), IpAddr::V4(s), IpAddr::V4(d)) => {
            tcp.calc_checksum_ipv4(s.octets(), d.octets())? == tcp.checksum()
        }
        (Some(TransportSlice::Tcp(tcp)), IpAddr::V6(s), IpAddr::V6(d)) => {
            tcp.calc_checksum_ipv6(s.octets(), d.octets())? == tcp.checksum()
        }
        (Some(TransportSlice::Icmpv4(icmp)), ..) => {
            icmp.icmp_type().calc_checksum(icmp.payload()) == icmp.checksum()
        }
        (Some(TransportSlice::Icmpv6(icmp)), IpAddr::V6(s), IpAddr::V6(d)) => {
            icmp.is_checksum_valid(s.octets(), d.octets())
        }
        _ => bail!("the output is neither TCP nor ICMP"),
    };
    Ok((ip_valid && l4_valid, src))
}

/// Generated frames, whole or mangled (cut anywhere, header bytes set to anything), to every
/// kind of VIP, tagged or not, of any length up to jumbo frames in several buffers, and
/// replies and ICMP errors about a connection: the kernel's
/// verdict is always one the program means (never XDP_ABORTED), a dropped frame leaves no
/// flow entry behind, and a whole frame that goes out (to a server, translated back to the
/// client, or an ICMP error sent on) carries valid checksums and the source it must. Cases
/// run one after another on one program and flow table: `XDP_CASES_SEED=N` runs the same
/// ones again, in the same order.
#[test]
fn generated_frames_get_a_meant_verdict_and_valid_checksums() -> Result<()> {
    use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
    use std::hash::BuildHasher;
    let seed: u64 = match std::env::var("XDP_CASES_SEED") {
        Ok(s) => s.parse().context("XDP_CASES_SEED")?,
        Err(_) => std::collections::hash_map::RandomState::new().hash_one(0u8),
    };
    println!("cases drawn with XDP_CASES_SEED={seed}");
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    in_topology(|| {
        let nets = [v4(), v6()];
        let (h, _) = Harness::load(&config(&nets))?;
        let h = std::cell::RefCell::new(h);
        let config = Config {
            cases: 1500,
            failure_persistence: None,
            ..Config::default()
        };
        let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &bytes);
        let mut runner = TestRunner::new_with_rng(config, rng);
        let verdicts = std::cell::RefCell::new([0u32; 5]);
        let first_failure = std::cell::RefCell::new(None);
        let outcome = runner.run(&case(), |c| {
            let h = &mut *h.borrow_mut();
            let result = one_case(h, &nets[usize::from(c.v6)], &c, &mut verdicts.borrow_mut());
            if let Err(e) = &result {
                first_failure
                    .borrow_mut()
                    .get_or_insert(format!("{c:?}: {e:#}"));
            }
            result.map_err(|e| TestCaseError::fail(format!("{e:#}")))
        });
        let seen = verdicts.into_inner();
        println!("verdicts, by XDP action (aborted, drop, pass, tx, redirect): {seen:?}");
        if let Err(e) = outcome {
            let first = first_failure.into_inner().unwrap_or_default();
            bail!("{e}\nfirst failing case (before shrinking): {first}");
        }
        ensure!(
            seen[1..].iter().all(|&n| n > 0),
            "the cases did not reach every verdict: {seen:?}"
        );
        Ok(())
    })
}

/// Runs case `c` on `n`'s side, counting its verdict in `verdicts`.
fn one_case(h: &mut Harness, n: &Net, c: &Case, verdicts: &mut [u32; 5]) -> Result<()> {
    let open = |h: &mut Harness| -> Result<Frame> {
        // The connection first, so that a reply or an error has one to belong to.
        let (v, _) = h.run(h.g0, &client_syn(n, n.vip, c.sport).bytes())?;
        ensure!(v == XDP_REDIRECT, "the connection's SYN: verdict {v}");
        Ok(server_syn_ack(n, c.sport))
    };
    let with_case = |f: Frame| {
        f.with(|f| {
            f.flags = c.flags;
            f.bulk = c.bulk;
            f.ttl = c.ttl;
            f.vlan = c.vlan;
        })
    };
    // Where the frame comes in, its bytes, and the source it must leave with.
    let (ingress, mut bytes, source) = if c.target < VIPS {
        let f = with_case(client_syn(n, vips(n)[c.target], c.sport));
        (h.g0, f.bytes(), n.client)
    } else if c.target == VIPS {
        let f = with_case(open(h)?);
        (h.g1, f.bytes(), n.vip)
    } else {
        // As the client got the reply, quoted whole or only as far as routers must.
        // The quote's own TTL is the reply's; the case's is the error's.
        let quoted = with_case(open(h)?).with(|f| {
            f.vlan = None;
            f.ttl = 64;
        });
        let reply = crate::to_client(&quoted, n.vip);
        let packet = &reply.bytes()[14..];
        let ip_hlen = if n.client.is_ipv4() { 20 } else { 40 };
        let quote = if c.bulk.is_multiple_of(2) {
            packet.len()
        } else {
            ip_hlen + 8
        };
        let router = (MAC_CLIENT, MAC_G0, c.ttl);
        let error = icmp_error(n.router, n.vip, router, &packet[..quote]);
        (h.g0, error, n.router)
    };
    match &c.mangle {
        Mangle::Whole => {}
        Mangle::Cut(len) => bytes.truncate(*len),
        Mangle::Set(at) => {
            for &(i, b) in at {
                if let Some(byte) = bytes.get_mut(i) {
                    *byte = b;
                }
            }
        }
    }
    let entries = |h: &mut Harness| h.dp.flow_table().keys().count();
    let before = entries(h);
    let (v, out) = h.run(ingress, &bytes)?;
    ensure!(
        matches!(v, XDP_DROP | XDP_PASS | XDP_TX | XDP_REDIRECT),
        "verdict {v}"
    );
    verdicts[v as usize] += 1;
    if v == XDP_DROP {
        ensure!(entries(h) <= before, "a dropped frame left a flow entry");
    }
    if matches!(c.mangle, Mangle::Whole) && matches!(v, XDP_TX | XDP_REDIRECT) {
        let (valid, src) = checksums_valid(&out)?;
        ensure!(valid, "invalid checksums out: {out:02x?}");
        ensure!(src == source, "went out from {src}, not {source}");
    }
    Ok(())
}

/// The agent walks the flow table in batches (`map_ops`, for drain statuses and the sync
/// dump): it must see every entry once, as aya's iterator (two calls an entry) sees them,
/// across several batches; stop where its callback breaks; and refuse the wrong types.
#[test]
fn the_flow_table_is_walked_in_batches() -> Result<()> {
    in_topology(|| {
        use balancer_agent::map_ops;
        use balancer_common::{FlowEntry, FlowKey};
        use std::ops::ControlFlow;

        let mut h = Harness::new()?;
        // More than two batches of 16384, fewer than the table's 65536 entries.
        const ENTRIES: u32 = 40_000;
        for i in 0..ENTRIES {
            let key = FlowKey {
                src: [
                    u32::from_be_bytes([172, 16, (i >> 8) as u8, i as u8]),
                    0,
                    0,
                    0,
                ],
                dst: [u32::from_be_bytes([192, 0, 2, 60]), 0, 0, 0],
                sport: ((i >> 16) as u16 + 1024).to_be(),
                dport: 8000u16.to_be(),
                proto: balancer_common::IPPROTO_TCP,
                family: balancer_common::FAMILY_V4,
                _pad: [0; 2],
            };
            let entry = FlowEntry {
                backend_id: i % 7 + 1,
                nat_port: (i as u16).to_be(),
                idle_timeout_s: 600,
                ..Default::default()
            };
            h.dp.flow_table().insert(key, entry, 0)?;
        }
        let id = h.dp.flows_id();
        let sorted = |mut v: Vec<(FlowKey, FlowEntry)>| {
            v.sort_by_key(|(k, _)| (k.src, k.sport));
            v
        };
        let mut batched = Vec::new();
        map_ops::for_each(id, |k: FlowKey, e: FlowEntry| {
            batched.push((k, e));
            ControlFlow::Continue(())
        })?;
        let one_by_one: Vec<(FlowKey, FlowEntry)> =
            h.dp.flow_table().iter().collect::<Result<_, _>>()?;
        ensure!(
            one_by_one.len() as u32 >= ENTRIES - 64,
            "only {} of {ENTRIES} entries written stayed",
            one_by_one.len()
        );
        ensure!(
            batched.len() == one_by_one.len(),
            "{} entries walked in batches, {} one by one",
            batched.len(),
            one_by_one.len()
        );
        ensure!(
            sorted(batched) == sorted(one_by_one),
            "the batches hold other entries than the table"
        );

        let mut seen = 0;
        map_ops::for_each(id, |_: FlowKey, _: FlowEntry| {
            seen += 1;
            if seen == 20_000 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })?;
        ensure!(seen == 20_000, "the walk went on after a break: {seen}");

        let wrong = map_ops::for_each(id, |_: u64, _: FlowEntry| ControlFlow::Continue(()));
        let message = format!("{:#}", wrong.expect_err("8-byte keys"));
        ensure!(message.contains("40-byte keys"), "{message}");
        Ok(())
    })
}

/// The sweep (`sweep.rs`) deletes the entries of connections that ended and of handshakes
/// never acknowledged once they are quiet for `QUIET`, and counts the unanswered ones closed
/// on their backend; it keeps every open connection's however quiet, and recent ones, and
/// puts back a new connection's entry placed on a tuple it was deleting.
#[test]
fn ended_and_unanswered_entries_are_reclaimed() -> Result<()> {
    in_topology(|| {
        use balancer_agent::{
            dataplane::monotonic_ns,
            sweep::{self, Reclaimed},
        };
        use balancer_common::{FlowEntry, FlowKey};

        let mut h = Harness::new()?;
        let now = monotonic_ns();
        let quiet = now.saturating_sub(sweep::QUIET.as_nanos() as u64 + 2_000_000_000);
        let recent = now.saturating_sub(1_000_000_000);
        ensure!(
            quiet > 0,
            "the machine has not been up for {:?}",
            sweep::QUIET
        );
        // (what, closed, acked, close_claim, last seen, reclaimed)
        let cases = [
            ("ended, quiet", 1, 1, 1, quiet, true),
            ("unanswered, quiet", 0, 0, 0, quiet, true),
            ("open, quiet", 0, 1, 0, quiet, false),
            ("ended, recent", 1, 1, 1, recent, false),
            ("unanswered, recent", 0, 0, 0, recent, false),
        ];
        const BACKEND: u32 = 3;
        let key = |i: usize| FlowKey {
            src: [u32::from_be_bytes([172, 16, 9, i as u8]), 0, 0, 0],
            dst: [u32::from_be_bytes([192, 0, 2, 60]), 0, 0, 0],
            sport: 40000u16.to_be(),
            dport: 8000u16.to_be(),
            proto: balancer_common::IPPROTO_TCP,
            family: balancer_common::FAMILY_V4,
            _pad: [0; 2],
        };
        for (i, &(_, closed, acked, close_claim, last_seen_ns, _)) in cases.iter().enumerate() {
            let entry = FlowEntry {
                backend_id: BACKEND,
                idle_timeout_s: 600,
                closed,
                acked,
                close_claim,
                last_seen_ns,
                ..Default::default()
            };
            h.dp.flow_table().insert(key(i), entry, 0)?;
        }
        let closed_before = h.dp.backend_stats(BACKEND)?.flows_closed;
        let swept = sweep::sweep(h.dp.flows_id(), sweep::QUIET)?;
        ensure!(
            swept.entries == cases.len() as u64
                && swept.ended == 1
                && swept.unanswered == [(BACKEND, 1)].into(),
            "swept {swept:?}"
        );
        for (i, &(what, .., reclaimed)) in cases.iter().enumerate() {
            let kept = h.dp.flow_table().get(&key(i), 0).is_ok();
            ensure!(kept != reclaimed, "{what}: kept {kept}");
        }
        // Counted closed where the spill room and `show` look, once.
        h.dp.count_closes(BACKEND, swept.unanswered[&BACKEND]);
        let closed = h.dp.backend_stats(BACKEND)?.flows_closed - closed_before;
        ensure!(
            closed == 1,
            "{closed} closes counted for one unanswered handshake"
        );
        let again = sweep::sweep(h.dp.flows_id(), sweep::QUIET)?;
        let kept = cases.iter().filter(|c| !c.5).count() as u64;
        ensure!(
            again
                == sweep::Swept {
                    entries: kept,
                    ..Default::default()
                },
            "a second sweep found {again:?}"
        );

        // A new connection on a tuple the walk found reclaimable, placed before the entry is
        // taken: put back as it was, not deleted with the old one's.
        let fresh = FlowEntry {
            backend_id: BACKEND,
            idle_timeout_s: 600,
            acked: 1,
            last_seen_ns: recent,
            ..Default::default()
        };
        let mut table = sweep::Reclaimer::open(h.dp.flows_id(), sweep::QUIET)?;
        h.dp.flow_table().insert(key(0), fresh, 0)?;
        let r = table.reclaim(&key(0))?;
        ensure!(r == Reclaimed::PutBack, "a new connection: {r:?}");
        let back = h.dp.flow_table().get(&key(0), 0);
        ensure!(
            back.as_ref()
                .is_ok_and(|e| e.last_seen_ns == recent && e.acked == 1),
            "a new connection's entry after a sweep: {back:?}"
        );
        // Where the program placed the flow again while it was out, its entry stays.
        let placed_again = FlowEntry {
            backend_id: BACKEND + 1,
            ..fresh
        };
        h.dp.flow_table().insert(key(0), placed_again, 0)?;
        ensure!(
            !table.put_back(&key(0), fresh)?,
            "put back over the program's entry"
        );
        let stays = h.dp.flow_table().get(&key(0), 0);
        ensure!(
            stays.as_ref().is_ok_and(|e| e.backend_id == BACKEND + 1),
            "the program's entry after a put-back: {stays:?}"
        );
        let ended = FlowEntry {
            closed: 1,
            last_seen_ns: quiet,
            ..fresh
        };
        h.dp.flow_table().insert(key(0), ended, 0)?;
        let taken = table.reclaim(&key(0))?;
        ensure!(
            taken == Reclaimed::Deleted(ended) && h.dp.flow_table().get(&key(0), 0).is_err(),
            "an ended connection's entry not taken: {taken:?}"
        );
        let r = table.reclaim(&key(0))?;
        ensure!(r == Reclaimed::Gone, "taken twice: {r:?}");
        Ok(())
    })
}

/// An agent that starts over counts the program already kept (pinned maps, after a
/// restart) takes them as where its rates start: its first fold reports no burst of new
/// connections for the ones opened before it, and `show` still counts them open.
#[test]
fn an_agent_starting_over_counts_reports_no_burst() -> Result<()> {
    in_topology(|| {
        const SYNS: u16 = 20;
        let n = &v4();
        let config = config(std::slice::from_ref(n));
        let (mut h, _) = Harness::load(&config)?;
        for sport in 0..SYNS {
            let (verdict, _) = h.run(h.g0, &client_syn(n, n.vip, 40000 + sport).bytes())?;
            ensure!(verdict == XDP_REDIRECT, "SYN {sport}: verdict {verdict}");
        }
        let mut controller = Controller::new(config, h.dp)?;
        std::thread::sleep(std::time::Duration::from_millis(20));
        controller.fold();
        let row = &controller.show("a0")?.servers[0];
        ensure!(
            row.flows == u64::from(SYNS) && row.new_per_s == 0.0,
            "{} open, {} new a second",
            row.flows,
            row.new_per_s
        );
        Ok(())
    })
}

/// The model a health check asks for across reloads: the file's name while it names one; once
/// the name is removed, the one the server reports (asked for again), kept over reloads that
/// name none, and replaced by a name the file gives.
#[test]
fn a_reload_asks_for_the_model_the_file_now_names() -> Result<()> {
    in_topology(|| {
        let n = &v4();
        let named = |model: Option<&str>| {
            let mut c = config(std::slice::from_ref(n));
            c.pool
                .iter_mut()
                .for_each(|p| p.model = model.map(String::from));
            c
        };
        let (h, _) = Harness::load(&named(Some("old")))?;
        let mut controller = Controller::new(named(Some("old")), h.dp)?;
        let asked = |c: &Controller| {
            let targets = c.health_targets();
            let t = targets
                .iter()
                .find(|t| t.key.0 == "a0")
                .expect("a0 is checked");
            t.model.clone()
        };
        ensure!(asked(&controller).as_deref() == Some("old"));
        controller.reconfigure(named(None))?;
        ensure!(
            asked(&controller).is_none(),
            "still asks for {:?} once the file names no model",
            asked(&controller)
        );
        let key = ("a0".to_string(), std::net::SocketAddr::new(n.backend, 8000));
        controller.checked(vec![(key, Some("found".into()), Ok(()))]);
        ensure!(asked(&controller).as_deref() == Some("found"));
        controller.reconfigure(named(None))?;
        ensure!(
            asked(&controller).as_deref() == Some("found"),
            "a model found on the server is forgotten by a reload"
        );
        controller.reconfigure(named(Some("new")))?;
        ensure!(asked(&controller).as_deref() == Some("new"));
        Ok(())
    })
}

/// What `drain --wait` is told of `server` in pool a0, once the flow table was walked.
fn drain_status(c: &Controller, server: &str) -> Result<balancer_agent::control::DrainStatus> {
    match c.drain_status("a0", server)?.answer() {
        balancer_agent::control::Response::DrainStatus(s) => Ok(s),
        other => anyhow::bail!("{other:?}"),
    }
}

/// `drain --wait` of a DOWN server: a connection whose client has been quiet for DSR_QUIET
/// is over (a dead host answers no FIN, and a client's FIN only half-closes), while the
/// server was UP it still counted.
#[test]
fn a_down_servers_quiet_connections_are_over() -> Result<()> {
    in_topology(|| {
        let n = &v4();
        let mut config = config(std::slice::from_ref(n));
        config.agent.fall = 1;
        let (mut h, _) = Harness::load(&config)?;
        let syn = client_syn(n, n.vip, 40900);
        for frame in [
            syn.clone(),
            syn.with(|f| f.flags = "A"),
            syn.with(|f| f.flags = "FA"),
        ] {
            let (verdict, _) = h.run(h.g0, &frame.bytes())?;
            ensure!(
                verdict == XDP_REDIRECT,
                "{}: verdict {verdict}",
                frame.flags
            );
        }
        let quiet = (balancer_agent::controller::DSR_QUIET.as_nanos() + 5_000_000_000) as u64;
        edit_flow(&mut h, &flow_key(n, n.vip, 40900), |e| {
            e.last_seen_ns -= quiet
        })?;
        let mut controller = Controller::new(config, h.dp)?;
        let server = n.backend.to_string();
        controller.drain("a0", &server, true)?;
        let open = |c: &_| drain_status(c, &server).map(|s| s.flows);
        let up = open(&controller)?;
        let key = ("a0".to_string(), SocketAddr::new(n.backend, 8000));
        controller.checked(vec![(key, None, Err(anyhow::anyhow!("refused")))]);
        // Past CENSUS_REUSE: a census of the other kind is walked anyway.
        let down = open(&controller)?;
        ensure!(
            (up, down) == (1, 0),
            "connections counted open: {up} while UP, {down} once DOWN (expected 1, 0)"
        );
        Ok(())
    })
}

/// `ready` waits for every server to be scraped, and to answer a check or go DOWN (a dead
/// one after `fall` failed checks, not before); then says ready, but while withdrawn.
#[test]
fn ready_once_every_server_is_known_alive_or_down() -> Result<()> {
    in_topology(|| {
        use balancer_agent::{
            control::{Request, Response},
            controller::Handled,
        };
        let n = &v4();
        let fresh = || -> Result<Controller> {
            let mut config = config(std::slice::from_ref(n));
            config.pool.retain(|p| p.name == "a0");
            config.agent.fall = 2;
            let (h, _) = Harness::load(&config)?;
            Controller::new(config, h.dp)
        };
        let mut controller = fresh()?;
        let key = ("a0".to_string(), SocketAddr::new(n.backend, 8000));
        let waits = |c: &mut Controller| c.readiness().waiting;
        let start = waits(&mut controller);
        ensure!(
            start
                == [
                    "pool a0: 1 of 1 servers not scraped yet",
                    "pool a0: 1 of 1 servers not health-checked yet"
                ],
            "at the start: {start:?}"
        );
        // A failed scrape is one: the server is known not to answer it.
        scrape_running(&mut controller, &|_| None);
        let refused =
            |k: &(String, SocketAddr)| vec![(k.clone(), None, Err(anyhow::anyhow!("refused")))];
        controller.checked(refused(&key));
        let failing = waits(&mut controller);
        ensure!(
            failing == ["pool a0: 1 of 1 servers failing their checks, not DOWN yet"],
            "after the first of two failed checks: {failing:?}"
        );
        controller.checked(refused(&key));
        let down = controller.readiness();
        ensure!(down.ready && controller.snapshot().ready, "DOWN: {down:?}");
        let said = |c: &mut Controller, r| match c.handle(r) {
            Handled::Now(Response::Done { message }) => message,
            _ => String::new(),
        };
        let message = said(&mut controller, Request::Withdraw);
        let withdrawn = controller.readiness();
        ensure!(
            message.starts_with("withdrawn: ")
                && !withdrawn.ready
                && !controller.snapshot().ready
                && withdrawn.waiting[0].contains("withdrawn by the operator"),
            "withdrawn ({message}): {withdrawn:?}"
        );
        let message = said(&mut controller, Request::Restore);
        ensure!(
            message.starts_with("restored: ") && controller.readiness().ready,
            "restored ({message})"
        );

        // A server that passed a check is alive: failures after it take `fall` to go DOWN
        // and hold nothing up.
        drop(controller);
        let mut controller = fresh()?;
        scrape_running(&mut controller, &|_| Some(0.0));
        controller.checked(refused(&key));
        controller.checked(vec![(key.clone(), None, Ok(()))]);
        controller.checked(refused(&key));
        let alive = controller.readiness();
        ensure!(alive.ready, "failing after a good check: {alive:?}");
        Ok(())
    })
}

/// `drain --wait` of a server that is DOWN but scraped fine (its checks fail for another
/// reason: a wrong model, an API key) waits for a scrape since the drain began, as for an UP
/// one: requests may still run on it. Only failing metrics end it on the connections alone.
/// And `show` says why a good check leaves it DOWN.
#[test]
fn a_down_server_whose_metrics_come_drains_by_its_scrape() -> Result<()> {
    in_topology(|| {
        let n = &v4();
        let mut config = config(std::slice::from_ref(n));
        config.agent.fall = 1;
        config.agent.rise = 2;
        let (h, _) = Harness::load(&config)?;
        let mut controller = Controller::new(config, h.dp)?;
        let server = n.backend.to_string();
        let key = ("a0".to_string(), SocketAddr::new(n.backend, 8000));
        let scrape = |c: &mut Controller, running: Option<f64>| scrape_running(c, &|_| running);
        let status = |c: &_| drain_status(c, &server);
        scrape(&mut controller, Some(3.0));
        controller.checked(vec![(key.clone(), None, Err(anyhow::anyhow!("HTTP 404")))]);
        controller.drain("a0", &server, true)?;
        let s = status(&controller)?;
        ensure!(
            s.down && !s.metrics_lost && s.flows == 0 && !s.finished(),
            "DOWN, scraped before the drain only: {s:?}"
        );
        scrape(&mut controller, Some(0.0));
        let s = status(&controller)?;
        ensure!(
            s.finished() && s.idle(),
            "scraped idle since the drain: {s:?}"
        );

        // Drained again, its metrics failing since: no connection left is enough.
        controller.drain("a0", &server, false)?;
        scrape(&mut controller, Some(2.0));
        controller.drain("a0", &server, true)?;
        ensure!(!status(&controller)?.finished());
        scrape(&mut controller, None);
        let s = status(&controller)?;
        ensure!(s.metrics_lost && s.finished(), "metrics failing: {s:?}");

        controller.checked(vec![(key, None, Ok(()))]);
        let view = controller.show("a0")?;
        let row = &view.servers[0];
        ensure!(
            row.state == "DOWN" && row.health == "ok, 1 of 2 good checks to come back",
            "one good check of two: {} {:?}",
            row.state,
            row.health
        );
        Ok(())
    })
}

/// A round of scrapes of every target, as [`answered`] says it goes.
fn scrape_running(c: &mut Controller, running: &dyn Fn(SocketAddr) -> Option<f64>) {
    let targets = c.scrape_targets();
    c.scraped(answered(targets, running));
}

/// `scraped`'s results for `targets`: each server running what `running` says of it,
/// nothing waiting, or its scrape failing where it says None.
fn answered(
    targets: Vec<balancer_agent::controller::ScrapeTarget>,
    running: &dyn Fn(SocketAddr) -> Option<f64>,
) -> Vec<(
    balancer_agent::controller::ScrapeTarget,
    Result<balancer_agent::dialect::Reading, balancer_agent::scrape::ScrapeError>,
)> {
    use balancer_agent::dialect::{Dialect, Reading};
    targets
        .into_iter()
        .map(|t| {
            let result = match running(t.key.1) {
                Some(running) => Ok(Reading {
                    dialect: Dialect::Plain,
                    running,
                    waiting: 0.0,
                    kv_usage: None,
                    ttft: None,
                    progress: None,
                    ignored: None,
                }),
                None => Err(balancer_agent::scrape::ScrapeError::Connect {
                    addr: t.metrics,
                    reason: "refused".into(),
                }),
            };
            (t, result)
        })
        .collect()
}

/// A scrape sent before a reload took a server out and another brought it back (a new id) is
/// not taken as the new one's: its counters, the baseline of the server's rates, are the
/// old id's.
#[test]
fn a_scrape_of_a_servers_earlier_id_is_left_out() -> Result<()> {
    in_topology(|| {
        let n = &v4();
        let full = config(std::slice::from_ref(n));
        let mut without = full.clone();
        without.pool.retain(|p| p.name != "a0");
        let (h, _) = Harness::load(&full)?;
        let mut controller = Controller::new(full.clone(), h.dp)?;
        let sent = controller.scrape_targets();
        controller.reconfigure(without)?;
        controller.reconfigure(full)?;
        controller.scraped(answered(sent, &|_| Some(5.0)));
        let running =
            |pool: &str| -> Result<Option<f64>> { Ok(controller.show(pool)?.servers[0].running) };
        ensure!(
            running("a0")?.is_none() && running("tx0")? == Some(5.0),
            "a0, back under a new id: {:?}; tx0, kept: {:?}",
            running("a0")?,
            running("tx0")?
        );
        Ok(())
    })
}

/// Where new connections from `ports` to the pool `multi0` go, as the program places them;
/// none may be dropped.
fn placed(c: &mut Controller, n: &Net, ports: std::ops::Range<u16>) -> Result<Vec<IpAddr>> {
    let g0 = ifindex("g0")?;
    ports
        .map(|sport| {
            let syn = client_syn(n, n.vip_multi, sport);
            let (verdict, out) = run_on(c.dataplane(), g0, &syn.bytes())?;
            ensure!(verdict != XDP_DROP, "SYN from port {sport} dropped");
            Ok(IpAddr::from(<[u8; 4]>::try_from(&out[30..34])?))
        })
        .collect()
}

/// A stream that ends between two scrapes frees its slot for the next hinted SYN at once,
/// and the agent's folds of the program's counts before the next scrape take none of that
/// room back: the program counts opens and closes from the scrape the budget comes from.
#[test]
fn a_closed_stream_frees_its_slot_until_the_next_scrape() -> Result<()> {
    in_topology(|| {
        let n = &v4();
        let mut config = config(std::slice::from_ref(n));
        let multi = config.pool.iter_mut().find(|p| p.name == "multi0").unwrap();
        multi.slots = Some(2);
        let (h, plan) = Harness::load(&config)?;
        let (g0, vip_id) = (h.g0, multi_vip(&plan, n).vip_id);
        let mut controller = Controller::new(config, h.dp)?;
        scrape_running(&mut controller, &|_| Some(0.0));
        let bucket = 17u16;
        let home = controller.dataplane().bucket(vip_id, bucket)?.ids[0];
        let home_addr = *n
            .multi
            .iter()
            .find(|&&a| id_in(&plan, a) == home)
            .context("bucket 17 has a home in the pool")?;
        let mut ports = balancer_common::hint::HintRange::DEFAULT.ports(bucket);
        // A hinted SYN's port, its counter (`hint_*`) and the server it went to.
        let mut syn = |c: &mut Controller| -> Result<(u16, Counter, IpAddr)> {
            let sport = ports.next().context("bucket ports")?;
            let pkt = client_syn(n, n.vip_multi, sport);
            let before = c.dataplane().counters()?;
            let (_, out) = run_on(c.dataplane(), g0, &pkt.bytes())?;
            let after = c.dataplane().counters()?;
            let ((counter, _), _) = (before.iter().zip(&after))
                .find(|((k, b), (_, a))| k.name().starts_with("hint_") && a > b)
                .context("no hint counter moved")?;
            let dst = <[u8; 4]>::try_from(&out[30..34])?;
            Ok((sport, *counter, IpAddr::from(dst)))
        };
        // Slots 2, nothing running: two SYNs at home, which then runs them.
        let mut streams = Vec::new();
        for i in 0..2 {
            let (sport, c, to) = syn(&mut controller)?;
            ensure!(
                (c, to) == (Counter::HintHome, home_addr),
                "SYN {i} with room: {c:?} to {to}"
            );
            streams.push(sport);
        }
        scrape_running(&mut controller, &|a| {
            Some(if a.ip() == home_addr { 2.0 } else { 0.0 })
        });
        // Both end (a client's RST), then the agent folds the program's counts in.
        for sport in streams {
            let rst = client_syn(n, n.vip_multi, sport).with(|f| f.flags = "AR");
            run_on(controller.dataplane(), g0, &rst.bytes())?;
        }
        controller.fold();
        ensure!(controller.dataplane().bucket(vip_id, bucket)?.ids[0] == home);
        for i in 0..2 {
            let (_, c, to) = syn(&mut controller)?;
            ensure!(
                (c, to) == (Counter::HintHome, home_addr),
                "SYN {i} after two streams ended and a fold: {c:?} to {to} (the home's room \
                 was taken back)"
            );
        }
        let (_, c, to) = syn(&mut controller)?;
        ensure!(
            c != Counter::HintHome && to != home_addr,
            "a third SYN on two freed slots: {c:?} to {to}"
        );
        Ok(())
    })
}

/// A server added to a running pool by a reload takes no connection until its first good
/// check (it may still be loading its model), and one check is enough; the pool's others
/// take them meanwhile.
#[test]
fn a_server_added_by_a_reload_waits_for_its_first_good_check() -> Result<()> {
    in_topology(|| {
        let n = &v4();
        let full = config(std::slice::from_ref(n));
        let full_config = full.clone();
        let added = n.multi[3];
        let mut before = full.clone();
        let multi = before.pool.iter_mut().find(|p| p.name == "multi0").unwrap();
        multi.server.retain(|s| s.address != added);
        let (h, _) = Harness::load(&before)?;
        let mut controller = Controller::new(before, h.dp)?;
        controller.reconfigure(full)?;
        let row = |c: &Controller| -> Result<balancer_agent::control::ServerRow> {
            let view = c.show("multi0")?;
            let row = view
                .servers
                .iter()
                .find(|r| r.server.starts_with(&added.to_string()));
            row.cloned().context("the added server in show")
        };
        let new = row(&controller)?;
        ensure!(
            new.state == "DOWN"
                && new.weight == 0
                && new.health == "new: waiting for its first good check",
            "added: {new:?}"
        );
        let went = placed(&mut controller, n, 50000..50064)?;
        ensure!(
            !went.contains(&added),
            "a connection reached {added} before its first check: {went:?}"
        );
        let key = ("multi0".to_string(), SocketAddr::new(added, 8000));
        controller.checked(vec![(key, None, Ok(()))]);
        let checked = row(&controller)?;
        ensure!(
            checked.state == "UP" && checked.weight > 0,
            "after one good check: {checked:?}"
        );
        let went = placed(&mut controller, n, 51000..51064)?;
        ensure!(
            went.contains(&added),
            "no connection reached {added} once UP: {went:?}"
        );
        // A pool renamed on its VIP runs all the same: a server added with the new name
        // waits too, and those it had go on.
        let again = n.multi[2];
        let mut without = controller.config().clone();
        let multi = without
            .pool
            .iter_mut()
            .find(|p| p.name == "multi0")
            .unwrap();
        multi.server.retain(|s| s.address != again);
        controller.reconfigure(without)?;
        let mut renamed = full_config.clone();
        renamed
            .pool
            .iter_mut()
            .find(|p| p.name == "multi0")
            .unwrap()
            .name = "multi0-b".into();
        controller.reconfigure(renamed)?;
        let view = controller.show("multi0-b")?;
        for r in &view.servers {
            let joined = r.server.starts_with(&again.to_string());
            ensure!(
                (r.state == "DOWN") == joined,
                "after the rename: {} is {} ({})",
                r.server,
                r.state,
                r.health
            );
        }
        Ok(())
    })
}

/// Every server of a pool DOWN while their metrics come (checks failing on a mistake they
/// share): they share the new connections (fail-open) rather than the program dropping
/// them all, DOWN all the same, but for one being drained; the first back UP takes them
/// all.
#[test]
fn a_pool_whose_every_server_is_down_fails_open() -> Result<()> {
    in_topology(|| {
        let n = &v4();
        let mut config = config(std::slice::from_ref(n));
        config.agent.fall = 1;
        config.agent.rise = 1;
        let (h, _) = Harness::load(&config)?;
        let mut controller = Controller::new(config, h.dp)?;
        scrape_running(&mut controller, &|_| Some(0.0));
        let drained = n.multi[3];
        controller.drain("multi0", &drained.to_string(), true)?;
        let key = |a: IpAddr| ("multi0".to_string(), SocketAddr::new(a, 8000));
        let failed = n
            .multi
            .map(|a| (key(a), None, Err(anyhow::anyhow!("HTTP 401"))));
        controller.checked(failed.into_iter().collect());
        let view = controller.show("multi0")?;
        ensure!(
            view.servers.iter().all(|r| {
                let open =
                    r.weight > 0 && r.reason == "fail-open: every server DOWN, its metrics answer";
                let out = r.server.starts_with(&drained.to_string());
                r.state == "DOWN" && open != out
            }),
            "every server DOWN, metrics fresh, one drained: {:?}",
            view.servers
        );
        let went = placed(&mut controller, n, 52000..52032)?;
        ensure!(
            went.iter().all(|a| n.multi.contains(a) && *a != drained),
            "fail-open connections went elsewhere: {went:?}"
        );
        let back = n.multi[0];
        controller.checked(vec![(key(back), None, Ok(()))]);
        let went = placed(&mut controller, n, 53000..53032)?;
        ensure!(
            went.iter().all(|&a| a == back),
            "with {back} UP again, connections went to {went:?}"
        );
        Ok(())
    })
}

/// A client port reused for a second VIP of the same backend while the first connection's
/// closed entry lingers: the backend's replies are the live flow's, from the second VIP, and
/// once both are closed, the one heard from last's. And the end of a connection whose entry
/// is gone is recorded closed: counted neither opened nor closed, its answers translated.
#[test]
fn replies_follow_the_live_flow_and_ends_open_nothing() -> Result<()> {
    in_topology(|| {
        let nets = [v4(), v6()];
        let mut config = config(&nets);
        let again = [ip("192.0.2.80"), ip("2001:db8::80")];
        for (f, vip) in again.iter().enumerate() {
            let mut pool = config
                .pool
                .iter()
                .find(|p| p.name == format!("a{f}"))
                .unwrap()
                .clone();
            pool.name = format!("again{f}");
            pool.vip = *vip;
            config.pool.push(pool);
        }
        let (mut h, plan) = Harness::load(&config)?;
        let (g0, g1) = (h.g0, h.g1);
        for (n, vip2) in nets.iter().zip(again) {
            let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
            let id = id_in(&plan, n.backend);
            let sent = |h: &mut Harness, what: &str, frame: Frame| -> Result<()> {
                let what = format!("{fam} {what}");
                let (v, _) = h.run(g0, &frame.bytes()).with_context(|| what.clone())?;
                ensure!(v == XDP_REDIRECT, "{what}: verdict {v}");
                Ok(())
            };
            sent(&mut h, "SYN to the first VIP", client_syn(n, n.vip, 50000))?;
            let rst = client_syn(n, n.vip, 50000).with(|f| f.flags = "AR");
            sent(&mut h, "RST to the first VIP", rst)?;
            // Past a tick of the program's coarse clock: the second flow is heard from later.
            std::thread::sleep(std::time::Duration::from_millis(20));
            sent(
                &mut h,
                "SYN from the same port to the second VIP",
                client_syn(n, vip2, 50000),
            )?;
            let syn_ack = server_syn_ack(n, 50000);
            let from_vip2 = to_client(&syn_ack, vip2);
            h.expect(
                &format!("{fam} SYN-ACK while a closed flow from the same port lingers"),
                g1,
                &syn_ack.bytes(),
                XDP_REDIRECT,
                &from_vip2.bytes(),
                Counter::Return,
            )?;
            // Both closed now (a client's FIN would only half-close): the answer is the flow
            // heard from last's.
            let rst = client_syn(n, vip2, 50000).with(|f| f.flags = "AR");
            sent(&mut h, "RST to the second VIP", rst)?;
            let fin_ack = syn_ack.with(|f| f.flags = "AF");
            h.expect(
                &format!("{fam} FIN-ACK when both flows from the port are closed"),
                g1,
                &fin_ack.bytes(),
                XDP_REDIRECT,
                &from_vip2.with(|f| f.flags = "AF").bytes(),
                Counter::Return,
            )?;

            // The end of a flow whose entry is gone: recorded closed, not opened, so that
            // the backend's answer is still translated.
            let opened = h.stats(id).flows_opened;
            let fin = client_syn(n, n.vip, 50001).with(|f| f.flags = "AF");
            sent(&mut h, "FIN of a flow without an entry", fin)?;
            let entry = h.dp.flow_table().get(&flow_key(n, n.vip, 50001), 0);
            ensure!(
                entry.is_ok_and(|e| e.closed == 1) && h.stats(id).flows_opened == opened,
                "{fam}: a FIN without an entry opened a flow, or left none"
            );
            let answer = syn_ack.with(|f| {
                f.dport = 50001;
                f.flags = "AF";
            });
            let translated = to_client(&answer, n.vip);
            h.expect(
                &format!("{fam} the backend's answer to that FIN"),
                g1,
                &answer.bytes(),
                XDP_REDIRECT,
                &translated.bytes(),
                Counter::Return,
            )?;
        }
        Ok(())
    })
}

/// Reloads that give a VIP's key to another pool id (two pools swap VIPs; a pool is renamed
/// and takes a lower id freed by an earlier reload): every VIP of the new configuration still
/// answers, and a VIP no pool has any more does not.
#[test]
fn reloads_keep_every_vip() -> Result<()> {
    in_topology(|| {
        let n = v4();
        let first = config(std::slice::from_ref(&n));
        let mut h = Harness::new()?;
        let mut ids = Ids::default();
        h.apply(&mut ids, &first)?;
        let g0 = h.g0;
        let syn = |h: &mut Harness, vip: IpAddr, sport: u16, verdict: u32, c: Counter| {
            let what = format!("a SYN to {vip} after the reloads so far");
            let before = h.counter(c);
            let frame = client_syn(&n, vip, sport).bytes();
            let (v, out) = h.run(g0, &frame).with_context(|| what.clone())?;
            ensure!(v == verdict, "{what}: verdict {v}, expected {verdict}");
            ensure!(
                h.counter(c) == before + 1,
                "{what}: {} did not move",
                c.name()
            );
            ensure!(
                (out != frame) == (c != Counter::PassNotOurs),
                "{what}: translated {}",
                out != frame
            );
            Ok(())
        };
        let pool = |c: &Config, name: &str| -> usize {
            c.pool.iter().position(|p| p.name == name).expect("pool")
        };
        // "a0" (backend behind g1) and "tx0" (backend on the client's link) swap VIPs.
        let mut swapped = first.clone();
        let (a, tx) = (pool(&swapped, "a0"), pool(&swapped, "tx0"));
        swapped.pool[a].vip = n.vip_tx;
        swapped.pool[tx].vip = n.vip;
        h.apply(&mut ids, &swapped)?;
        syn(&mut h, n.vip_tx, 41001, XDP_REDIRECT, Counter::Redirect)?;
        syn(&mut h, n.vip, 41002, XDP_TX, Counter::Tx)?;
        // "tx0" leaves, freeing its id; "nn0", later in the list, is renamed and takes it.
        let mut fewer = swapped.clone();
        let tx = pool(&fewer, "tx0");
        fewer.pool.remove(tx);
        h.apply(&mut ids, &fewer)?;
        syn(&mut h, n.vip, 41003, XDP_PASS, Counter::PassNotOurs)?;
        let mut renamed = fewer.clone();
        let nn = pool(&renamed, "nn0");
        renamed.pool[nn].name = "nn0-renamed".into();
        let plan = h.apply(&mut ids, &renamed)?;
        syn(&mut h, n.vip_nn, 41004, XDP_PASS, Counter::PassNoNeigh)?;
        syn(&mut h, n.vip_tx, 41005, XDP_REDIRECT, Counter::Redirect)?;
        // "empty0" drops a SYN and leaves; the pools after it, renamed, take new ids, one of
        // them its id, but not its count.
        let empty = vip_in(&plan, n.vip_empty).vip_id;
        let (v, _) = h.run(g0, &client_syn(&n, n.vip_empty, 41006).bytes())?;
        let dropped = h.dp.vip_drops(empty)?;
        ensure!(
            v == XDP_DROP && dropped == 1,
            "a SYN to {}: verdict {v}, {dropped} drops counted",
            n.vip_empty
        );
        let mut moved = renamed.clone();
        let e = pool(&moved, "empty0");
        moved.pool.remove(e);
        for p in &mut moved.pool[e..] {
            p.name += "-renamed";
        }
        let plan = h.apply(&mut ids, &moved)?;
        let heir = plan
            .vips
            .iter()
            .find(|v| v.vip_id == empty)
            .context("no pool took the id of the one that left")?;
        let inherited = h.dp.vip_drops(empty)?;
        ensure!(
            inherited == 0,
            "pool {} has the {inherited} drops of the VIP its id had",
            heir.pool
        );
        Ok(())
    })
}

/// The id `plan` gave the backend at `addr`.
fn id_in(plan: &Plan, addr: IpAddr) -> u32 {
    let (w, _) = balancer_common::addr_words(addr);
    plan.backends.iter().find(|(_, b)| b.addr == w).unwrap().0
}

/// The multi-backend VIP in `plan`.
fn multi_vip<'p>(plan: &'p Plan, n: &Net) -> &'p VipPlan {
    vip_in(plan, n.vip_multi)
}

/// The VIP `vip` in `plan`.
fn vip_in(plan: &Plan, vip: IpAddr) -> &VipPlan {
    let (addr, _) = balancer_common::addr_words(vip);
    plan.vips.iter().find(|v| v.key.addr == addr).unwrap()
}

/// Connection life cycle through the VIP, both directions, and every forwarding verdict.
fn forwarding(h: &mut Harness, n: &Net, backend_id: u32) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let (g0, g1) = (h.g0, h.g1);
    let syn = client_syn(n, n.vip, 40001);
    let to_backend = |f: &Frame| to_backend(f, n, MAC_BACKEND);
    let reply = server_syn_ack(n, 40001);
    // What the client receives: the reply comes from the VIP.
    let to_client = |f: &Frame| to_client(f, n.vip);
    let s0 = h.stats(backend_id);
    h.expect(
        &format!("{fam} SYN"),
        g0,
        &syn.bytes(),
        XDP_REDIRECT,
        &to_backend(&syn).bytes(),
        Counter::FlowNewSyn,
    )?;
    ensure!(
        h.stats(backend_id).flows_opened == s0.flows_opened + 1,
        "{fam}: open not counted"
    );
    h.expect(
        &format!("{fam} SYN-ACK"),
        g1,
        &reply.bytes(),
        XDP_REDIRECT,
        &to_client(&reply).bytes(),
        Counter::Return,
    )?;
    let ack = syn.with(|f| f.flags = "A");
    h.expect(
        &format!("{fam} ACK"),
        g0,
        &ack.bytes(),
        XDP_REDIRECT,
        &to_backend(&ack).bytes(),
        Counter::Forward,
    )?;
    let data = reply.with(|f| f.flags = "PA");
    h.expect(
        &format!("{fam} data"),
        g1,
        &data.bytes(),
        XDP_REDIRECT,
        &to_client(&data).bytes(),
        Counter::Redirect,
    )?;

    // From the backend, but not a reply of a flow of ours: untouched.
    for (what, stray) in [
        (
            "to a client port without a flow",
            reply.with(|f| f.dport = 49999),
        ),
        (
            "from another port of the backend",
            reply.with(|f| f.sport = 8001),
        ),
    ] {
        h.expect_untouched(
            &format!("{fam} backend packet {what}"),
            g1,
            &stray.bytes(),
            XDP_PASS,
            Counter::PassNotOurs,
        )?;
    }

    // The client's FIN only half-closes: the server may answer for minutes yet. The flow
    // stays open, is not reclaimed however quiet, and its answer is translated; the server's
    // FIN ends it, counted closed once.
    let fin = syn.with(|f| f.flags = "FA");
    h.expect(
        &format!("{fam} FIN"),
        g0,
        &fin.bytes(),
        XDP_REDIRECT,
        &to_backend(&fin).bytes(),
        Counter::Forward,
    )?;
    use balancer_agent::sweep;
    let quiet = (sweep::QUIET + std::time::Duration::from_secs(5)).as_nanos() as u64;
    let half = edit_flow(h, &flow_key(n, n.vip, 40001), |e| e.last_seen_ns -= quiet)?;
    ensure!(
        half.closed == 0 && h.stats(backend_id).flows_closed == s0.flows_closed,
        "{fam}: the client's FIN closed the flow"
    );
    sweep::sweep(h.dp.flows_id(), sweep::QUIET)?;
    let answer = reply.with(|f| f.flags = "PA");
    h.expect(
        &format!("{fam} the answer after the client's FIN, the flow quiet past the sweep's"),
        g1,
        &answer.bytes(),
        XDP_REDIRECT,
        &to_client(&answer).bytes(),
        Counter::Return,
    )?;
    let fin_back = reply.with(|f| f.flags = "FA");
    h.expect(
        &format!("{fam} FIN back"),
        g1,
        &fin_back.bytes(),
        XDP_REDIRECT,
        &to_client(&fin_back).bytes(),
        Counter::Return,
    )?;
    // A RST after it ends nothing more.
    let late_rst = syn.with(|f| f.flags = "RA");
    h.expect(
        &format!("{fam} RST after the end"),
        g0,
        &late_rst.bytes(),
        XDP_REDIRECT,
        &to_backend(&late_rst).bytes(),
        Counter::Forward,
    )?;
    let s1 = h.stats(backend_id);
    ensure!(
        s1.flows_closed == s0.flows_closed + 1,
        "{fam}: close counted {} times",
        s1.flows_closed - s0.flows_closed
    );
    // The same tuple again: a new flow.
    h.expect(
        &format!("{fam} SYN reusing a closed tuple"),
        g0,
        &syn.bytes(),
        XDP_REDIRECT,
        &to_backend(&syn).bytes(),
        Counter::FlowReopened,
    )?;
    let s2 = h.stats(backend_id);
    ensure!(
        (s2.flows_opened, s2.flows_closed) == (s1.flows_opened + 1, s1.flows_closed),
        "{fam}: reopening a closed tuple: {s1:?} -> {s2:?}"
    );
    // That flow goes quiet past its idle timeout, no FIN seen (the client vanished): a packet
    // on its tuple places it anew, and the one it replaces is closed on its server, once.
    let key = flow_key(n, n.vip, 40001);
    expire(h, &key)?;
    let ack = syn.with(|f| f.flags = "A");
    h.expect(
        &format!("{fam} ACK on an expired flow"),
        g0,
        &ack.bytes(),
        XDP_REDIRECT,
        &to_backend(&ack).bytes(),
        Counter::FlowExpired,
    )?;
    let s3 = h.stats(backend_id);
    ensure!(
        (s3.flows_opened, s3.flows_closed) == (s2.flows_opened + 1, s2.flows_closed + 1),
        "{fam}: an expired flow replaced: {s2:?} -> {s3:?}"
    );

    // A reset from the backend closes another flow.
    let syn2 = syn.with(|f| f.sport = 40002);
    h.expect(
        &format!("{fam} SYN 2"),
        g0,
        &syn2.bytes(),
        XDP_REDIRECT,
        &to_backend(&syn2).bytes(),
        Counter::FlowNewSyn,
    )?;
    let rst = reply.with(|f| {
        f.dport = 40002;
        f.flags = "R";
    });
    let c = h.stats(backend_id).flows_closed;
    h.expect(
        &format!("{fam} RST"),
        g1,
        &rst.bytes(),
        XDP_REDIRECT,
        &to_client(&rst).bytes(),
        Counter::Return,
    )?;
    ensure!(
        h.stats(backend_id).flows_closed == c + 1,
        "{fam}: RST not counted as a close"
    );

    // Mid-stream packet with no entry (evicted, or another gateway's): same deterministic pick.
    let mid = syn.with(|f| {
        f.sport = 40003;
        f.flags = "PA";
    });
    h.expect(
        &format!("{fam} mid-stream"),
        g0,
        &mid.bytes(),
        XDP_REDIRECT,
        &to_backend(&mid).bytes(),
        Counter::FlowNewMidstream,
    )?;

    // Backend on the ingress link: out the same interface.
    let tx = syn.with(|f| {
        f.sport = 40004;
        f.dst = n.vip_tx;
    });
    let tx_out = tx.with(|f| {
        f.smac = MAC_G0;
        f.dmac = MAC_SAME_LINK;
        f.dst = n.backend_tx;
        f.dport = 9000;
        f.ttl -= 1;
    });
    h.expect(
        &format!("{fam} same link"),
        g0,
        &tx.bytes(),
        XDP_TX,
        &tx_out.bytes(),
        Counter::Tx,
    )?;

    // An ICMP error about that flow's reply, from a router on the client's side, goes to the
    // backend as the reply left it: to its address, quoting its address and port, every
    // checksum fixed. Quoting the whole reply (its TCP checksum too) and quoting the 8 bytes
    // of TCP every router quotes. One about a connection we do not have goes to the stack.
    let reply = crate::to_client(
        &Frame {
            smac: MAC_SAME_LINK,
            dmac: MAC_G0,
            src: n.backend_tx,
            dst: n.client,
            sport: 8000,
            dport: 40004,
            flags: "AP",
            ..tx.clone()
        },
        n.vip_tx,
    );
    let sent = reply.with(|f| {
        f.src = n.backend_tx;
        f.sport = 9000;
    });
    let whole = reply.bytes().len() - 14;
    let ip_hlen = if n.client.is_ipv4() { 20 } else { 40 };
    for (what, quote) in [("whole", whole), ("8 bytes of TCP", ip_hlen + 8)] {
        let router = (MAC_CLIENT, MAC_G0, 64);
        let error = icmp_error(n.router, n.vip_tx, router, &reply.bytes()[14..14 + quote]);
        let on = (MAC_G0, MAC_SAME_LINK, 63);
        let out = icmp_error(n.router, n.backend_tx, on, &sent.bytes()[14..14 + quote]);
        h.expect(
            &format!("{fam} ICMP error quoting {what}"),
            g0,
            &error,
            XDP_TX,
            &out,
            Counter::IcmpToBackend,
        )?;
    }
    // The other way: an error about the client's packet, from a router between the
    // gateway and the backend, sent to the client, quoting the packet as the gateway sent
    // it. Its quote goes back to what the client sent (to the VIP's address and port), and
    // the stack routes it on; the error's own addresses, TTL and MACs stay.
    for (what, quote) in [
        ("whole", tx_out.bytes().len() - 14),
        ("8 bytes of TCP", ip_hlen + 8),
    ] {
        let from_router = (MAC_SAME_LINK, MAC_G0, 64);
        let error = icmp_error(
            n.other,
            n.client,
            from_router,
            &tx_out.bytes()[14..14 + quote],
        );
        let as_sent = tx_out.with(|f| {
            f.dst = n.vip_tx;
            f.dport = 8000;
        });
        let out = icmp_error(
            n.other,
            n.client,
            from_router,
            &as_sent.bytes()[14..14 + quote],
        );
        h.expect(
            &format!("{fam} ICMP error about the client's packet quoting {what}"),
            g0,
            &error,
            XDP_PASS,
            &out,
            Counter::IcmpToClient,
        )?;
    }
    let stranger = tx_out.with(|f| f.sport = 40099).bytes();
    h.expect_untouched(
        &format!("{fam} ICMP error about another client's packet"),
        g0,
        &icmp_error(
            n.other,
            n.client,
            (MAC_SAME_LINK, MAC_G0, 64),
            &stranger[14..],
        ),
        XDP_PASS,
        Counter::PassNotTcp,
    )?;
    let stranger = reply.with(|f| f.dport = 40099).bytes();
    h.expect_untouched(
        &format!("{fam} ICMP error about another connection"),
        g0,
        &icmp_error(
            n.router,
            n.vip_tx,
            (MAC_CLIENT, MAC_G0, 64),
            &stranger[14..],
        ),
        XDP_PASS,
        Counter::PassNotTcp,
    )?;

    // Neighbour unknown: rewritten, then the stack resolves it (and decrements the TTL).
    let nn = syn.with(|f| {
        f.sport = 40005;
        f.dst = n.vip_nn;
    });
    let nn_out = nn.with(|f| f.dst = n.backend_nn);
    h.expect(
        &format!("{fam} unresolved neighbour"),
        g0,
        &nn.bytes(),
        XDP_PASS,
        &nn_out.bytes(),
        Counter::PassNoNeigh,
    )?;

    // VLAN-tagged: rewritten, then forwarded by the stack's VLAN device.
    let tagged = syn.with(|f| {
        f.sport = 40006;
        f.vlan = Some(10);
    });
    let tagged_out = tagged.with(|f| f.dst = n.backend);
    h.expect(
        &format!("{fam} VLAN"),
        g0,
        &tagged.bytes(),
        XDP_PASS,
        &tagged_out.bytes(),
        Counter::PassVlan,
    )?;

    // No backend with weight > 0.
    let empty = syn.with(|f| {
        f.sport = 40007;
        f.dst = n.vip_empty;
    });
    let empty = empty.bytes();
    h.expect_untouched(
        &format!("{fam} SYN to a VIP without backends"),
        g0,
        &empty,
        XDP_DROP,
        Counter::DropNoBackend,
    )?;
    Ok(())
}

/// DSR VIPs: the client's packets go to the backend's MAC as they came (TTL aside: we are a
/// hop), its close is counted from the client's side alone, its replies are not ours to
/// translate, and a packet that cannot reach the backend's MAC is dropped, never handed to
/// the stack, which would route it by the VIP.
/// A next hop out of an interface the program is not attached to (not in `EGRESS`): a
/// translated packet goes to the stack translated but as it came (our MAC, its TTL), for the
/// stack to forward; a DSR packet, still addressed to the VIP, is dropped, and its SYN opens
/// no flow on `dsr_backend`. Once the interface is listed again, both are redirected.
fn sent_only_where_attached(h: &mut Harness, n: &Net, dsr_backend: u32) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let g0 = h.g0;
    let nat = client_syn(n, n.vip, 42001);
    let dsr = client_syn(n, n.vip_dsr, 42002);
    h.dp.set_egress(&["g0".to_owned()])?;
    let unlisted = (|| {
        h.expect(
            &format!("{fam} SYN, out of an interface not ours"),
            g0,
            &nat.bytes(),
            XDP_PASS,
            &nat.with(|f| f.dst = n.backend).bytes(),
            Counter::PassEgress,
        )?;
        let opened = h.stats(dsr_backend).flows_opened;
        h.expect_untouched(
            &format!("{fam} DSR SYN, out of an interface not ours"),
            g0,
            &dsr.bytes(),
            XDP_DROP,
            Counter::DropDsrEgress,
        )?;
        ensure!(
            h.stats(dsr_backend).flows_opened == opened,
            "{fam}: a DSR SYN that could not be sent opened a flow"
        );
        Ok(())
    })();
    h.dp.set_egress(&LINKS.map(String::from))?;
    unlisted?;
    for (what, frame) in [("ACK", &nat), ("DSR ACK", &dsr)] {
        let ack = frame.with(|f| f.flags = "A");
        let translated = if frame.dst == n.vip {
            n.backend
        } else {
            frame.dst
        };
        h.expect(
            &format!("{fam} {what}, out of an interface listed again"),
            g0,
            &ack.bytes(),
            XDP_REDIRECT,
            &ack.with(|f| {
                f.smac = MAC_G1;
                f.dmac = MAC_BACKEND;
                f.dst = translated;
                f.ttl -= 1;
            })
            .bytes(),
            Counter::Redirect,
        )?;
    }
    Ok(())
}

fn direct_server_return(h: &mut Harness, n: &Net, backend_id: u32) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let (g0, g1) = (h.g0, h.g1);
    let syn = client_syn(n, n.vip_dsr, 41001);
    let s0 = h.stats(backend_id);
    for (what, frame, counter) in [
        ("SYN", syn.clone(), Counter::FlowNewSyn),
        ("ACK", syn.with(|f| f.flags = "A"), Counter::Forward),
        ("data", syn.with(|f| f.flags = "PA"), Counter::Redirect),
        ("FIN", syn.with(|f| f.flags = "FA"), Counter::Forward),
    ] {
        h.expect(
            &format!("{fam} DSR {what}"),
            g0,
            &frame.bytes(),
            XDP_REDIRECT,
            &hop(&frame, MAC_G1, MAC_BACKEND).bytes(),
            counter,
        )?;
    }
    let s1 = h.stats(backend_id);
    ensure!(
        (s1.flows_opened, s1.flows_closed) == (s0.flows_opened + 1, s0.flows_closed + 1),
        "{fam} DSR: opened {} and closed {}, expected one each",
        s1.flows_opened - s0.flows_opened,
        s1.flows_closed - s0.flows_closed
    );
    // The server answers from the VIP, straight to the client; should an answer come through
    // here, from the VIP or from its own address, it is not translated.
    let reply = Frame {
        smac: MAC_S0,
        dmac: MAC_G1,
        vlan: None,
        src: n.vip_dsr,
        dst: n.client,
        sport: 8000,
        dport: 41002,
        ttl: 64,
        flags: "SA",
        bulk: 0,
    };
    let syn2 = syn.with(|f| f.sport = 41002);
    h.expect(
        &format!("{fam} DSR SYN 2"),
        g0,
        &syn2.bytes(),
        XDP_REDIRECT,
        &hop(&syn2, MAC_G1, MAC_BACKEND).bytes(),
        Counter::FlowNewSyn,
    )?;
    for (what, frame) in [
        ("from the VIP", reply.clone()),
        (
            "from the server's address",
            reply.with(|f| f.src = n.backend),
        ),
    ] {
        h.expect_untouched(
            &format!("{fam} DSR answer {what}"),
            g1,
            &frame.bytes(),
            XDP_PASS,
            Counter::PassNotOurs,
        )?;
    }

    // One-armed: the backend is on the link the packet came from.
    let tx = client_syn(n, n.vip_dsr_tx, 41003);
    h.expect(
        &format!("{fam} DSR same link"),
        g0,
        &tx.bytes(),
        XDP_TX,
        &hop(&tx, MAC_G0, MAC_SAME_LINK).bytes(),
        Counter::Tx,
    )?;
    // An ICMP error about its reply (which the backend sent from the VIP itself) goes to the
    // backend unchanged but for the MACs and the TTL.
    let reply = tx.with(|f| {
        (f.src, f.dst, f.sport, f.dport) = (n.vip_dsr_tx, n.client, 8000, 41003);
        f.flags = "AP";
    });
    let quoted = &reply.bytes()[14..];
    h.expect(
        &format!("{fam} DSR ICMP error"),
        g0,
        &icmp_error(n.router, n.vip_dsr_tx, (MAC_CLIENT, MAC_G0, 64), quoted),
        XDP_TX,
        &icmp_error(n.router, n.vip_dsr_tx, (MAC_G0, MAC_SAME_LINK, 63), quoted),
        Counter::IcmpToBackend,
    )?;

    // Undeliverable: dropped, and no flow recorded or counted, so that the client's next
    // SYN is placed anew (and its retransmission dropped the same way).
    for (what, frame, counter) in [
        (
            "backend behind a router",
            client_syn(n, n.vip_dsr_routed, 41004),
            Counter::DropDsrRouted,
        ),
        (
            "unresolved neighbour",
            client_syn(n, n.vip_dsr_nn, 41005),
            Counter::DropDsrNoNeigh,
        ),
        (
            "VLAN",
            syn.with(|f| {
                f.sport = 41006;
                f.vlan = Some(10);
            }),
            Counter::DropDsrVlan,
        ),
    ] {
        let bytes = frame.bytes();
        let opened = h.counter(Counter::FlowNewSyn);
        for attempt in ["", " again"] {
            let what = format!("{fam} DSR {what}{attempt}");
            h.expect_untouched(&what, g0, &bytes, XDP_DROP, counter)?;
        }
        let key = flow_key(n, frame.dst, frame.sport);
        ensure!(
            h.dp.flow_table().get(&key, 0).is_err() && h.counter(Counter::FlowNewSyn) == opened,
            "{fam} DSR {what}: a flow was recorded for a packet that was dropped"
        );
    }

    // `drain --wait` on a DSR pool: a flow whose client is quiet for DSR_QUIET is over (the
    // server's close is never seen); in NAT mode only its idle timeout ends it.
    let ids = std::collections::HashSet::from([backend_id]);
    let dsr_quiet = balancer_agent::controller::DSR_QUIET;
    let quiet = Some(dsr_quiet);
    let live = |h: &Harness, quiet| -> Result<u64> {
        Ok(h.dp
            .live_flows(&ids, quiet)?
            .get(&backend_id)
            .copied()
            .unwrap_or(0))
    };
    ensure!(
        live(h, quiet)? == 1 && live(h, None)? == 1,
        "{fam} DSR: the open flow (SYN 2) is not live"
    );
    let key = flow_key(n, n.vip_dsr, 41002);
    let mut entry = h.dp.flow_table().get(&key, 0)?;
    entry.last_seen_ns -= dsr_quiet.as_nanos() as u64 + 2_000_000_000;
    h.dp.flow_table().insert(key, entry, 0)?;
    ensure!(
        live(h, quiet)? == 0 && live(h, None)? == 1,
        "{fam} DSR: a flow quiet for longer than DSR_QUIET still counts, or an idle one \
         does not count without it"
    );
    // Drain statuses share their walks (`FlowCensus`): a question within CENSUS_REUSE of the
    // last walk takes its count, unless that walk began before its drain did; a later one
    // walks again.
    let census = balancer_agent::dataplane::FlowCensus::new(h.dp.flows_id());
    let (quiet_one, census_quiet) = (
        census.open_on(backend_id, quiet, None)?,
        census.open_on(backend_id, None, None)?,
    );
    let kept = entry;
    entry.closed = 1;
    h.dp.flow_table().insert(key, entry, 0)?;
    let reused = census.open_on(backend_id, None, None)?;
    let drained_since = census.open_on(backend_id, None, Some(std::time::Instant::now()))?;
    h.dp.flow_table().insert(key, kept, 0)?;
    let reused_since = census.open_on(backend_id, None, None)?;
    std::thread::sleep(
        balancer_agent::dataplane::CENSUS_REUSE + std::time::Duration::from_millis(100),
    );
    let walked = census.open_on(backend_id, None, None)?;
    ensure!(
        (
            quiet_one,
            census_quiet,
            reused,
            drained_since,
            reused_since,
            walked
        ) == (0, 1, 1, 0, 0, 1),
        "{fam} DSR census: quiet {quiet_one}, then {census_quiet}; closed: {reused} at once, \
         {drained_since} for a drain begun after the walk, {reused_since} reused; open again: \
         {walked} after CENSUS_REUSE (expected 0, 1; 1, 0, 0; 1)"
    );

    // Past the egress MTU: answered with the ICMP "too big" from the VIP; an IPv4 packet
    // that may be fragmented is dropped (the stack would route it to the VIP, XDP cannot
    // fragment it).
    let big = data(&syn.with(|f| f.sport = 41007), 1400);
    with_mtu(&["g1"], 1300, || {
        h.expect(
            &format!("{fam} DSR data past the egress MTU"),
            g0,
            &big.bytes(),
            XDP_TX,
            &too_big_answer(&big, 1300),
            Counter::TooBigAnswered,
        )?;
        if n.client.is_ipv4() {
            h.expect_untouched(
                "v4 DSR data past the egress MTU, may be fragmented",
                g0,
                &without_df(big.bytes()),
                XDP_DROP,
                Counter::DropDsrTooBig,
            )?;
        }
        Ok(())
    })
}

/// The ICMP "too big" answer to `frame` for `mtu`: from where the frame was going, to its
/// sender, back to the MAC it came from, quoting its IP header and 8 bytes of TCP. Built by
/// etherparse, checksums and all.
fn too_big_answer(frame: &Frame, mtu: u16) -> Vec<u8> {
    let bytes = frame.bytes();
    let eth = PacketBuilder::ethernet2(frame.dmac, frame.smac);
    let mut out = Vec::new();
    match (frame.src, frame.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut ip =
                Ipv4Header::new(0, 64, etherparse::IpNumber::ICMP, d.octets(), s.octets()).unwrap();
            ip.dont_fragment = false;
            let frag = etherparse::icmpv4::DestUnreachableHeader::FragmentationNeeded {
                next_hop_mtu: mtu,
            };
            eth.ip(IpHeaders::Ipv4(ip, Default::default()))
                .icmpv4(etherparse::Icmpv4Type::DestinationUnreachable(frag))
                .write(&mut out, &bytes[14..14 + 20 + 8])
                .unwrap();
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            eth.ipv6(d.octets(), s.octets(), 64)
                .icmpv6(etherparse::Icmpv6Type::PacketTooBig { mtu: mtu.into() })
                .write(&mut out, &bytes[14..14 + 40 + 8])
                .unwrap();
        }
        _ => unreachable!(),
    }
    out
}

/// An ICMP error from `from` to `to` quoting `quoted` (an IP packet, or its start):
/// "fragmentation needed" for IPv4, "packet too big" for IPv6, next-hop MTU 1400, between
/// the MACs and with the TTL given. Built by etherparse, checksums and all.
fn icmp_error(
    from: IpAddr,
    to: IpAddr,
    (smac, dmac, ttl): ([u8; 6], [u8; 6], u8),
    quoted: &[u8],
) -> Vec<u8> {
    let eth = PacketBuilder::ethernet2(smac, dmac);
    let mut out = Vec::new();
    match (from, to) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let frag = etherparse::icmpv4::DestUnreachableHeader::FragmentationNeeded {
                next_hop_mtu: 1400,
            };
            eth.ipv4(s.octets(), d.octets(), ttl)
                .icmpv4(etherparse::Icmpv4Type::DestinationUnreachable(frag))
                .write(&mut out, quoted)
                .unwrap();
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            eth.ipv6(s.octets(), d.octets(), ttl)
                .icmpv6(etherparse::Icmpv6Type::PacketTooBig { mtu: 1400 })
                .write(&mut out, quoted)
                .unwrap();
        }
        _ => unreachable!(),
    }
    out
}

/// An IPv4 frame without VLAN tag with its don't-fragment flag cleared, checksum fixed.
/// `frame` with TOS (IPv4, checksum fixed) or traffic class (IPv6) `tos`.
fn with_tos(mut frame: Vec<u8>, tos: u8) -> Vec<u8> {
    if frame[12..14] == [0x08, 0x00] {
        let (mut ip, _) = Ipv4Header::from_slice(&frame[14..]).unwrap();
        ip.dscp = etherparse::IpDscp::try_new(tos >> 2).unwrap();
        ip.ecn = etherparse::IpEcn::try_new(tos & 3).unwrap();
        ip.header_checksum = ip.calc_header_checksum();
        frame[14..34].copy_from_slice(&ip.to_bytes());
    } else {
        frame[14] = (frame[14] & 0xf0) | tos >> 4;
        frame[15] = (frame[15] & 0x0f) | tos << 4;
    }
    frame
}

fn without_df(mut frame: Vec<u8>) -> Vec<u8> {
    let (mut ip, _) = Ipv4Header::from_slice(&frame[14..]).unwrap();
    ip.dont_fragment = false;
    ip.header_checksum = ip.calc_header_checksum();
    frame[14..34].copy_from_slice(&ip.to_bytes());
    frame
}

/// Runs `f` with the MTU of `links` at `mtu` (for IPv6 at least 1280), then puts 1500 back
/// whatever `f` returned. Next hops cached earlier still carry the old MTU for the rest of
/// their epoch, which for replies is shifted by the client's port (`reply_epoch`), so `f`
/// runs once a whole epoch has passed.
fn with_mtu(links: &[&str], mtu: u32, f: impl FnOnce() -> Result<()>) -> Result<()> {
    let set = |m: &str| -> Result<()> {
        for link in links {
            let status = std::process::Command::new("ip")
                .args(["link", "set", link, "mtu", m])
                .status()?;
            ensure!(status.success(), "ip link set {link} mtu {m}: {status}");
        }
        Ok(())
    };
    set(&mtu.to_string())?;
    // And a tick or two: the program's clock is coarse.
    std::thread::sleep(std::time::Duration::from_nanos((1 << 30) + 20_000_000));
    let result = f();
    set("1500")?;
    result
}

/// The flow key of a SYN from the client's port `sport` to the multi-backend VIP.
fn multi_key(n: &Net, sport: u16) -> balancer_common::FlowKey {
    flow_key(n, n.vip_multi, sport)
}

/// The flow key of a connection from the client's port `sport` to `vip:8000`.
fn flow_key(n: &Net, vip: IpAddr, sport: u16) -> balancer_common::FlowKey {
    let (src, family) = balancer_common::addr_words(n.client);
    balancer_common::FlowKey {
        src,
        dst: balancer_common::addr_words(vip).0,
        sport: sport.to_be(),
        dport: 8000u16.to_be(),
        proto: balancer_common::IPPROTO_TCP,
        family,
        _pad: [0; 2],
    }
}

/// The server of `n.multi` with id `id_of`.
fn server(n: &Net, id_of: u32, id: &dyn Fn(IpAddr) -> u32) -> Result<IpAddr> {
    n.multi
        .iter()
        .copied()
        .find(|b| id(*b) == id_of)
        .context("predicted id")
}

/// The server the agent's Maglev `table` names for a SYN from the client's port `sport` to
/// the multi-backend VIP: what user space predicts the kernel will pick.
fn maglev_pick(n: &Net, sport: u16, table: &[u32], id: &dyn Fn(IpAddr) -> u32) -> Result<IpAddr> {
    let (slot, _) = balancer_common::hash::draws(&multi_key(n, sport));
    server(n, table[slot as usize], id)
}

/// The pick and the two alternates of that SYN, in `vip`'s tables.
fn draws(
    n: &Net,
    sport: u16,
    vip: &VipPlan,
    id: &dyn Fn(IpAddr) -> u32,
) -> Result<(IpAddr, [IpAddr; 2])> {
    let (slot, [a, b]) = balancer_common::hash::draws(&multi_key(n, sport));
    let alternate = |s: u32| server(n, vip.alternates[s as usize], id);
    Ok((
        server(n, vip.table[slot as usize], id)?,
        [alternate(a)?, alternate(b)?],
    ))
}

/// The kernel's flow hash and table lookup agree with the agent's: for many flows, the
/// backend the program picks is the one `flow_hash` and the agent's table name.
fn kernel_picks_what_user_space_predicts(
    h: &mut Harness,
    n: &Net,
    table: &[u32],
    id: &dyn Fn(IpAddr) -> u32,
) -> Result<()> {
    let mut seen = std::collections::BTreeSet::new();
    for sport in 42000..42200u16 {
        let syn = client_syn(n, n.vip_multi, sport);
        let backend = maglev_pick(n, sport, table, id)?;
        seen.insert(backend);
        // No neighbour entries here: rewritten and passed, which shows the pick.
        let out = syn.with(|f| f.dst = backend);
        h.expect(
            &format!("pick for port {sport}"),
            h.g0,
            &syn.bytes(),
            XDP_PASS,
            &out.bytes(),
            Counter::PassNoNeigh,
        )?;
    }
    ensure!(seen.len() == 4, "200 flows reached only {seen:?}");
    // Another backend of the same VIP answering one of those flows: not the flow's backend,
    // so not a reply of ours.
    let picked = maglev_pick(n, 42000, table, id)?;
    let other = *n.multi.iter().find(|b| **b != picked).context("another")?;
    let stray = client_syn(n, n.vip_multi, 42000)
        .with(|f| {
            f.src = other;
            f.dst = n.client;
            f.sport = 8000;
            f.dport = 42000;
            f.flags = "SA";
        })
        .bytes();
    h.expect(
        "reply from a backend the flow does not name",
        h.g1,
        &stray,
        XDP_PASS,
        &stray,
        Counter::PassNotOurs,
    )?;
    Ok(())
}

/// A hinted SYN to a DSR VIP that cannot be delivered (its server behind a router) is
/// dropped, and neither its bucket's statistics nor the hint counters count it: the
/// client's retries would count as hinted traffic the home never got. The same SYN to a
/// DSR VIP that delivers it is counted.
fn dropped_dsr_syns_are_not_hinted(h: &mut Harness, n: &Net, plan: &Plan) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let bucket = 5u16;
    let sport = balancer_common::hint::HintRange::DEFAULT
        .ports(bucket)
        .next()
        .context("bucket ports")?;
    let hints = |h: &Harness| {
        [Counter::HintHome, Counter::HintWarm, Counter::HintMaglev].map(|c| h.counter(c))
    };
    for (vip, verdict, counted) in [
        (n.vip_dsr_routed, XDP_DROP, 0),
        (n.vip_dsr, XDP_REDIRECT, 1),
    ] {
        let vip_plan = vip_in(plan, vip);
        let home = vip_plan.members[0].1;
        h.dp.set_bucket(
            vip_plan.vip_id,
            bucket,
            &balancer_common::Bucket {
                ids: [home, 0, 0, 0],
            },
        )?;
        let (before, stats) = (hints(h), h.dp.bucket_stats(vip_plan.vip_id, bucket)?);
        let (v, _) = h.run(h.g0, &client_syn(n, vip, sport).bytes())?;
        let (after, now) = (hints(h), h.dp.bucket_stats(vip_plan.vip_id, bucket)?);
        ensure!(v == verdict, "{fam} hinted DSR SYN to {vip}: verdict {v}");
        ensure!(
            after[0] == before[0] + counted
                && after[1..] == before[1..]
                && now.hinted == stats.hinted + counted
                && now.picks[0] == stats.picks[0] + counted,
            "{fam} hinted DSR SYN to {vip}: hint counters {before:?} -> {after:?}, bucket {stats:?} -> {now:?}"
        );
    }
    Ok(())
}

/// Each VIP counts the client packets the program dropped (`VIP_DROPS`): a SYN to the VIP
/// without backends and one to a DSR VIP whose server is behind a router count once each, on
/// their own VIP alone; a forwarded SYN counts nowhere.
fn drops_are_counted_per_vip(h: &mut Harness, n: &Net, plan: &Plan) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let vips = [n.vip, n.vip_empty, n.vip_dsr_routed];
    let drops = |h: &Harness| -> Result<Vec<u64>> {
        vips.iter()
            .map(|&v| h.dp.vip_drops(vip_in(plan, v).vip_id))
            .collect()
    };
    for (k, &vip) in vips.iter().enumerate() {
        let before = drops(h)?;
        let (v, _) = h.run(h.g0, &client_syn(n, vip, 42000 + k as u16).bytes())?;
        let after = drops(h)?;
        let dropped = k > 0;
        ensure!(
            (v == XDP_DROP) == dropped,
            "{fam} SYN to {vip}: verdict {v}"
        );
        let want: Vec<u64> = (before.iter().enumerate())
            .map(|(i, &b)| b + u64::from(dropped && i == k))
            .collect();
        ensure!(
            after == want,
            "{fam} SYN to {vip}: drops per VIP {before:?} -> {after:?}, not {want:?}"
        );
    }
    Ok(())
}

/// A SYN from a hint port goes to its bucket's home while the home has budget, then to the
/// warm alternate with the most room, then to the home again unless the weighted choice has
/// more room; a mid-stream packet without an entry goes home; ports outside the range never
/// look at the buckets.
fn hinted_syns_go_home_then_spill(
    h: &mut Harness,
    n: &Net,
    vip_id: u32,
    table: &[u32],
    id: &dyn Fn(IpAddr) -> u32,
) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let range = balancer_common::hint::HintRange::DEFAULT;
    let bucket = 17u16;
    let [a, b, c, _] = n.multi;
    h.dp.set_bucket(
        vip_id,
        bucket,
        &balancer_common::Bucket {
            ids: [id(a), id(b), id(c), 0],
        },
    )?;
    h.dp.set_budget(id(a), 2)?;
    h.dp.set_budget(id(b), 1)?;
    h.dp.set_budget(id(c), 3)?;
    let mut ports = range.ports(bucket);
    let mut send = |h: &mut Harness,
                    flags: &'static str,
                    expect: IpAddr,
                    c: Counter,
                    what: &str|
     -> Result<()> {
        let sport = ports.next().context("bucket ports")?;
        let pkt = client_syn(n, n.vip_multi, sport).with(|f| f.flags = flags);
        let out = pkt.with(|f| f.dst = expect);
        h.expect(
            &format!("{fam} {what} (port {sport})"),
            h.g0,
            &pkt.bytes(),
            XDP_PASS,
            &out.bytes(),
            c,
        )
    };
    // Budget 2 at home: two SYNs stay.
    send(h, "S", a, Counter::HintHome, "hinted SYN 1 at home")?;
    send(h, "S", a, Counter::HintHome, "hinted SYN 2 at home")?;
    // Home past its threshold: the alternate with the most room (c: 3 > b: 1).
    send(
        h,
        "S",
        c,
        Counter::HintWarm,
        "spill to the roomiest alternate",
    )?;
    send(h, "S", c, Counter::HintWarm, "spill again")?;
    // c has 1 left, b has 1: the first with the most room wins the tie (b comes first).
    send(h, "S", b, Counter::HintWarm, "spill to the next")?;
    send(h, "S", c, Counter::HintWarm, "spill to the last room")?;
    // No room anywhere (the fourth server neither), and the weighted choice has no more
    // than the home: the home keeps it, it holds the prefix.
    h.dp.set_budget(id(n.multi[3]), 0)?;
    send(
        h,
        "S",
        a,
        Counter::HintHome,
        "no room anywhere, the home no fuller",
    )?;
    // The home queued deeper than the weighted choice: the weighted pick, which is what
    // Maglev names for this flow (a server other than the home), its second draw having no
    // more room than the first.
    h.dp.set_budget(id(a), -3)?;
    let from_the_end: Vec<u16> = range.ports(bucket).collect();
    let (sport, maglev) = (from_the_end.into_iter().rev())
        .find_map(|p| Some((p, maglev_pick(n, p, table, id).ok()?)).filter(|(_, m)| *m != a))
        .context("a bucket port whose Maglev pick is not the home")?;
    let pkt = client_syn(n, n.vip_multi, sport);
    h.expect(
        &format!("{fam} the home queued deeper than the weighted pick"),
        h.g0,
        &pkt.bytes(),
        XDP_PASS,
        &pkt.with(|f| f.dst = maglev).bytes(),
        Counter::HintMaglev,
    )?;
    // A new budget counts from the opens at the time it is written.
    h.dp.set_budget(id(a), 1)?;
    send(
        h,
        "S",
        a,
        Counter::HintHome,
        "home again with a fresh budget",
    )?;
    // Mid-stream without an entry: home, no spill logic.
    send(h, "A", a, Counter::FlowNewMidstream, "mid-stream goes home")?;
    let stats = h.dp.bucket_stats(vip_id, bucket)?;
    ensure!(
        stats.hinted == 9 && stats.spilled == 5,
        "{fam} bucket stats {stats:?}"
    );
    ensure!(stats.picks == [4, 1, 3, 0], "{fam} picks {:?}", stats.picks);
    // A connection that ends gives its room back, unless the home is held (saturated on
    // TTFT or KV, or recovering): then the SYN after the close spills.
    let far: Vec<u16> = range.ports(bucket).skip(40).take(3).collect();
    let to = |h: &mut Harness, sport: u16, flags: &'static str, expect, c, what: &str| {
        let pkt = client_syn(n, n.vip_multi, sport).with(|f| f.flags = flags);
        let out = pkt.with(|f| f.dst = expect);
        let what = format!("{fam} {what} (port {sport})");
        h.expect(&what, h.g0, &pkt.bytes(), XDP_PASS, &out.bytes(), c)
    };
    h.dp.set_budget(id(a), 1)?;
    h.dp.set_budget(id(c), 5)?;
    to(h, far[0], "S", a, Counter::HintHome, "home with room 1")?;
    h.dp.set_budget(id(a), 0)?;
    to(h, far[0], "AR", a, Counter::PassNoNeigh, "its RST")?;
    to(
        h,
        far[1],
        "S",
        a,
        Counter::HintHome,
        "home again: the RST gave room",
    )?;
    let since = h.dp.load_counts(id(a))?;
    h.dp.set_load(id(a), 0, true, since)?;
    to(
        h,
        far[1],
        "AR",
        a,
        Counter::PassNoNeigh,
        "its RST, home held",
    )?;
    to(
        h,
        far[2],
        "S",
        c,
        Counter::HintWarm,
        "held: the RST gave no room",
    )?;
    // Outside the range: Maglev, the buckets are not consulted.
    let before = h.counter(Counter::HintHome)
        + h.counter(Counter::HintWarm)
        + h.counter(Counter::HintMaglev);
    let plain = client_syn(n, n.vip_multi, 45000);
    let (v, _) = h.run(h.g0, &plain.bytes())?;
    ensure!(v == XDP_PASS);
    let after = h.counter(Counter::HintHome)
        + h.counter(Counter::HintWarm)
        + h.counter(Counter::HintMaglev);
    ensure!(before == after, "{fam}: port 45000 was treated as a hint");
    Ok(())
}

/// A SYN whose Maglev pick has no room takes the roomier of its two alternates if that one
/// has more; with room at the pick, or no more room at the alternates, or for a mid-stream
/// packet, the pick. Alternates include saturated servers (weight 0 in the Maglev table),
/// which is what lets a burst leave the one server the weights left.
fn alternates_when_the_pick_has_no_room(
    h: &mut Harness,
    n: &Net,
    config: &Config,
    id: &dyn Fn(IpAddr) -> u32,
) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let plain = Ids::default().plan(config, &Weights::new(), std::time::Instant::now())?;
    let vip = multi_vip(&plain, n).clone();
    let budgets = |h: &mut Harness, b: [i32; 4]| -> Result<()> {
        for (server, budget) in n.multi.iter().zip(b) {
            h.dp.set_budget(id(*server), budget)?;
        }
        Ok(())
    };
    // Ports whose pick and two alternates are three different servers, and what they are.
    let distinct = |vip: &VipPlan, from: u16| {
        (from..from + 4000).find_map(|p| {
            let (pick, [a, b]) = draws(n, p, vip, id).ok()?;
            (pick != a && pick != b && a != b).then_some((p, pick, a, b))
        })
    };
    let index = |s: IpAddr| {
        n.multi
            .iter()
            .position(|m| *m == s)
            .expect("a multi server")
    };
    // Every case also checks `maglev_second`: it counts exactly the SYNs that left the pick.
    let case = |h: &mut Harness,
                flags: &'static str,
                sport: u16,
                expect: IpAddr,
                what: &str,
                pick: IpAddr| {
        let pkt = client_syn(n, n.vip_multi, sport).with(|f| f.flags = flags);
        let before = h.counter(Counter::MaglevSecond);
        let new = if flags == "S" {
            Counter::FlowNewSyn
        } else {
            Counter::FlowNewMidstream
        };
        let what = format!("{fam} {what} (port {sport})");
        h.expect(
            &what,
            h.g0,
            &pkt.bytes(),
            XDP_PASS,
            &pkt.with(|f| f.dst = expect).bytes(),
            new,
        )?;
        let after = h.counter(Counter::MaglevSecond);
        let moved = u64::from(expect != pick);
        ensure!(
            after == before + moved,
            "{what}: maglev_second {before} -> {after}"
        );
        Ok::<_, anyhow::Error>(())
    };
    // (budget of the pick, of alternate a, of alternate b, flags) -> expected server.
    let unknown = balancer_common::BUDGET_UNKNOWN;
    let cases: [(i32, i32, i32, &str, char, &str); 12] = [
        (1, 5, 9, "S", 'p', "room at the pick"),
        (0, 2, 5, "S", 'b', "no room at the pick, most at b"),
        (0, 5, 2, "S", 'a', "no room at the pick, most at a"),
        (0, 3, 3, "S", 'a', "a tie between the alternates: the first"),
        (0, 0, 0, "S", 'p', "no more room at the alternates"),
        (-4, -1, -2, "S", 'a', "all past the threshold, a least"),
        (-4, -3, -1, "S", 'b', "all past the threshold, b least"),
        (
            -1,
            -2,
            -3,
            "S",
            'p',
            "all past the threshold, the pick least",
        ),
        (0, 5, 5, "A", 'p', "mid-stream keeps the pick"),
        (
            unknown,
            5,
            5,
            "S",
            'p',
            "unknown load at the pick: it stands",
        ),
        (0, unknown, 3, "S", 'b', "unknown load at a: never taken"),
        (
            -5,
            unknown,
            -6,
            "S",
            'p',
            "unknown load at a, b more loaded",
        ),
    ];
    let mut from = 46000;
    for (bp, ba, bb, flags, expect, what) in cases {
        let (port, pick, a, b) = distinct(&vip, from).context("ports with distinct draws")?;
        from = port + 1;
        let mut budget = [1_000_000; 4];
        budget[index(pick)] = bp;
        budget[index(a)] = ba;
        budget[index(b)] = bb;
        budgets(h, budget)?;
        let expect = match expect {
            'p' => pick,
            'a' => a,
            _ => b,
        };
        case(h, flags, port, expect, what, pick)?;
    }

    // A saturated server (weight 0: out of the Maglev table) is still an alternate, and the
    // only one with room here: the SYN goes there.
    let pool = &config
        .pool
        .iter()
        .find(|p| p.vip == n.vip_multi)
        .context("the multi pool")?
        .name;
    let mut weights = Weights::new();
    let saturated = n.multi[0];
    weights.insert((pool.clone(), SocketAddr::new(saturated, 8000)), 0);
    let steered = Ids::default().plan(config, &weights, std::time::Instant::now())?;
    let svip = multi_vip(&steered, n).clone();
    ensure!(!svip.table.contains(&id(saturated)) && svip.alternates.contains(&id(saturated)));
    h.dp.apply(&steered)?;
    let (port, pick, _) = (from..from + 4000)
        .find_map(|p| {
            let (pick, alts) = draws(n, p, &svip, id).ok()?;
            (alts[0] == saturated).then_some((p, pick, alts))
        })
        .context("a port with the saturated server as first alternate")?;
    let mut budget = [0; 4];
    budget[index(saturated)] = 3;
    budgets(h, budget)?;
    case(
        h,
        "S",
        port,
        saturated,
        "a saturated alternate with room",
        pick,
    )?;
    // DOWN or draining: in neither table.
    let mut weights = Weights::new();
    let key = (pool.clone(), SocketAddr::new(saturated, 8000));
    weights.insert(key.clone(), 0);
    weights.exclude(key);
    let down = Ids::default().plan(config, &weights, std::time::Instant::now())?;
    let dvip = multi_vip(&down, n).clone();
    ensure!(!dvip.table.contains(&id(saturated)) && !dvip.alternates.contains(&id(saturated)));

    h.dp.apply(&plain)?;
    budgets(h, [1_000_000; 4])?;
    Ok(())
}

/// A SYN that finds an entry naming a server that went DOWN is placed anew: the
/// retransmission of a SYN it never answered, and a client that reuses the port of an
/// established flow, whose retries would otherwise keep the entry alive for good.
fn a_syn_leaves_a_down_server(
    h: &mut Harness,
    n: &Net,
    config: &Config,
    id: &dyn Fn(IpAddr) -> u32,
) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let now = std::time::Instant::now();
    let plain = Ids::default().plan(config, &Weights::new(), now)?;
    let sport = 43000;
    let first = maglev_pick(n, sport, &multi_vip(&plain, n).table, id)?;
    let syn = client_syn(n, n.vip_multi, sport);
    let to = |f: &Frame, server| f.with(|f| f.dst = server).bytes();
    let g0 = h.g0;
    h.expect(
        &format!("{fam} SYN"),
        g0,
        &syn.bytes(),
        XDP_PASS,
        &to(&syn, first),
        Counter::FlowNewSyn,
    )?;
    let ack = syn.with(|f| f.flags = "A");
    h.expect(
        &format!("{fam} ACK"),
        g0,
        &ack.bytes(),
        XDP_PASS,
        &to(&ack, first),
        Counter::PassNoNeigh,
    )?;
    // Another SYN to the same server, which it never answers.
    let table = &multi_vip(&plain, n).table;
    let lone = (sport + 1..sport + 1000)
        .find(|p| maglev_pick(n, *p, table, id).is_ok_and(|b| b == first))
        .context("another port whose pick is the same server")?;
    let unanswered = client_syn(n, n.vip_multi, lone);
    h.expect(
        &format!("{fam} a SYN left unanswered"),
        g0,
        &unanswered.bytes(),
        XDP_PASS,
        &to(&unanswered, first),
        Counter::FlowNewSyn,
    )?;
    let pool = &config
        .pool
        .iter()
        .find(|p| p.vip == n.vip_multi)
        .context("the multi pool")?
        .name;
    let mut weights = Weights::new();
    weights.down((pool.clone(), SocketAddr::new(first, 8000)));
    let down = Ids::default().plan(config, &weights, now)?;
    h.dp.apply(&down)?;
    let before = h.stats(id(first));
    let dtable = &multi_vip(&down, n).table;
    let placed = [
        (sport, &syn, "on the tuple of a flow"),
        (lone, &unanswered, "retransmitted"),
    ]
    .into_iter()
    .try_for_each(|(port, frame, what)| {
        let again = maglev_pick(n, port, dtable, id)?;
        ensure!(
            again != first,
            "{fam}: the table still names the DOWN server"
        );
        h.expect(
            &format!("{fam} SYN {what} to a DOWN server"),
            g0,
            &frame.bytes(),
            XDP_PASS,
            &to(frame, again),
            Counter::FlowReopened,
        )
    });
    h.dp.apply(&plain)?;
    placed?;
    // Neither flow ended with a FIN or RST: the DOWN server gets their closes.
    let after = h.stats(id(first));
    ensure!(
        after.flows_closed == before.flows_closed + 2,
        "{fam}: {} closes counted on the DOWN server for its two flows placed anew",
        after.flows_closed - before.flows_closed
    );
    Ok(())
}

/// Makes the flow `key`'s entry idle past its timeout, as if it had gone quiet long ago.
fn expire(h: &mut Harness, key: &balancer_common::FlowKey) -> Result<()> {
    edit_flow(h, key, |e| {
        // A short timeout rather than a long-past time: the clock starts at boot.
        e.idle_timeout_s = 2;
        e.last_seen_ns = e.last_seen_ns.saturating_sub(4_000_000_000);
    })?;
    Ok(())
}

/// Rewrites the flow `key`'s entry as `f` changes it; the entry written.
fn edit_flow(
    h: &mut Harness,
    key: &balancer_common::FlowKey,
    f: impl FnOnce(&mut balancer_common::FlowEntry),
) -> Result<balancer_common::FlowEntry> {
    let mut e = h.dp.flow_table().get(key, 0)?;
    f(&mut e);
    h.dp.flow_table().insert(key, e, 0)?;
    Ok(e)
}

/// The epoch a cached next hop is good for: the program's clock >> 30.
fn epoch() -> u32 {
    (balancer_agent::dataplane::monotonic_ns() >> 30) as u32
}

/// Sleeps until the next epoch has begun (at most one epoch, about 1.07 s).
fn next_epoch() {
    let now = balancer_agent::dataplane::monotonic_ns();
    let left = (1u64 << 30) - (now & ((1 << 30) - 1));
    std::thread::sleep(std::time::Duration::from_nanos(left + 5_000_000));
}

/// Sleeps, if need be, until at least 400 ms of the current epoch are left.
fn early_in_epoch() {
    let now = balancer_agent::dataplane::monotonic_ns();
    if (1u64 << 30) - (now & ((1 << 30) - 1)) < 400_000_000 {
        next_epoch();
    }
}

/// Runs `f` with the neighbour entry of `addr` on g1 giving `mac`, then puts the entry the
/// topology made back whatever `f` returned.
fn with_neighbour_on_g1(addr: IpAddr, mac: [u8; 6], f: impl FnOnce() -> Result<()>) -> Result<()> {
    let set = |mac: [u8; 6]| -> Result<()> {
        let lladdr = mac.map(|b| format!("{b:02x}")).join(":");
        let (addr, lladdr) = (addr.to_string(), lladdr.as_str());
        let args = [
            "neigh",
            "replace",
            &addr,
            "lladdr",
            lladdr,
            "nud",
            "permanent",
            "dev",
            "g1",
        ];
        let status = std::process::Command::new("ip").args(args).status()?;
        ensure!(status.success(), "ip {}: {status}", args.join(" "));
        Ok(())
    };
    set(mac)?;
    let result = f();
    set(MAC_BACKEND)?;
    result
}

/// A FIB answer towards a backend is kept per backend too (`HOPS`), for the other flows to it
/// in the same epoch, only when the next hop is the backend itself on one of our links and
/// only for packets that come in on the same interface. Shown by moving the backend's
/// neighbour entry to another MAC: a SYN of the same epoch still gets the answer an earlier
/// SYN got, and so do the first data packet of that SYN's flow (answers hold up to the MTU)
/// and a packet of a flow whose own answer is from an earlier epoch; a SYN to a server behind
/// the backend as a router, or from another interface, or of the next epoch, gets the new MAC.
fn flows_share_the_next_hop_to_a_backend_on_link(h: &mut Harness, n: &Net) -> Result<()> {
    on_this_cpu(|| share_the_next_hop(h, n))
}

/// Runs `f` with the calling thread pinned to the CPU it is on, then restores its affinity:
/// `HOPS` is per CPU, and BPF_PROG_TEST_RUN runs the program on the caller's CPU, so packets
/// that should share an answer must not migrate between runs (as a NIC queue's do not).
fn on_this_cpu<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    // SAFETY: cpu_set_t is plain data; the calls get and set the calling thread's mask.
    let mut was: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    ensure!(
        unsafe { libc::sched_getaffinity(0, size, &mut was) } == 0,
        "sched_getaffinity: {}",
        std::io::Error::last_os_error()
    );
    let cpu = unsafe { libc::sched_getcpu() };
    ensure!(
        cpu >= 0,
        "sched_getcpu: {}",
        std::io::Error::last_os_error()
    );
    let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe { libc::CPU_SET(cpu as usize, &mut one) };
    ensure!(
        unsafe { libc::sched_setaffinity(0, size, &one) } == 0,
        "sched_setaffinity: {}",
        std::io::Error::last_os_error()
    );
    let result = f();
    ensure!(
        unsafe { libc::sched_setaffinity(0, size, &was) } == 0,
        "restoring the affinity: {}",
        std::io::Error::last_os_error()
    );
    result
}

fn share_the_next_hop(h: &mut Harness, n: &Net) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let moved = [0x02, 0, 0, 0, 0x0e, 0x0f];
    let (g0, g1) = (h.g0, h.g1);
    let mut sport = 40400;
    let mut syn = |vip| {
        sport += 1;
        client_syn(n, vip, sport)
    };
    // Each case: what, ingress, frame, verdict, the address and MAC it goes to, its counter.
    // Once the neighbour has moved (`after`), a packet that gets the new MAC was looked up,
    // and one that gets the old MAC was not: `fib_lookup` says so too.
    type Case<'a> = (&'a str, u32, Frame, u32, (IpAddr, [u8; 6]), Counter);
    let check = |h: &mut Harness, after: bool, cases: &[Case]| -> Result<()> {
        for (what, ingress, frame, verdict, (dst, dmac), counter) in cases {
            let lookups = h.counter(Counter::FibLookup);
            let out = frame.with(|f| {
                f.smac = MAC_G1;
                f.dmac = *dmac;
                f.dst = *dst;
                f.ttl -= 1;
            });
            let (what, frame, out) = (format!("{fam} {what}"), frame.bytes(), out.bytes());
            h.expect(&what, *ingress, &frame, *verdict, &out, *counter)?;
            let looked_up = h.counter(Counter::FibLookup) - lookups;
            ensure!(
                !after || looked_up == u64::from(*dmac == moved),
                "{what}: {looked_up} FIB lookups"
            );
        }
        Ok(())
    };
    let (kept, looked_up) = ((n.backend, MAC_BACKEND), (n.backend, moved));
    let (routed, routed_new) = ((n.routed, MAC_BACKEND), (n.routed, moved));
    let (redirect, new, fwd) = (XDP_REDIRECT, Counter::FlowNewSyn, Counter::Forward);
    for _ in 0..3 {
        early_in_epoch();
        let at = epoch();
        let (a, r1, b) = (syn(n.vip), syn(n.vip_routed), syn(n.vip));
        let (r2, c) = (syn(n.vip_routed), syn(n.vip));
        let same_epoch = (|| -> Result<()> {
            let cases = [
                ("SYN to a backend on g1", g0, a.clone(), redirect, kept, new),
                ("SYN behind a router", g0, r1, redirect, routed, new),
            ];
            check(h, false, &cases)?;
            // Flow a's own answer, made a second old: its next packet needs another.
            let key = flow_key(n, n.vip, a.sport);
            let mut e = h.dp.flow_table().get(&key, 0)?;
            e.to_backend.epoch = at.wrapping_sub(1);
            h.dp.flow_table().insert(key, e, 0)?;
            // Flow b's first data packet is longer than its SYN: the answer holds up to the
            // egress MTU the FIB reported, not only up to the length it was asked for.
            let data = b.with(|f| {
                f.flags = "PA";
                f.bulk = 1000;
            });
            let ack = a.with(|f| f.flags = "A");
            with_neighbour_on_g1(n.backend, moved, || {
                let cases = [
                    ("next SYN: kept", g0, b, redirect, kept, new),
                    ("its data, longer: kept", g0, data, redirect, kept, fwd),
                    ("aged flow's ACK: kept", g0, ack, redirect, kept, fwd),
                    ("routed SYN: looked up", g0, r2, redirect, routed_new, new),
                    ("SYN in from g1: looked up", g1, c, XDP_TX, looked_up, new),
                ];
                check(h, true, &cases)
            })
        })();
        if epoch() != at {
            // The cases straddled an epoch boundary (the machine stalled): again.
            continue;
        }
        same_epoch?;
        let d = syn(n.vip);
        return with_neighbour_on_g1(n.backend, moved, || {
            next_epoch();
            check(
                h,
                true,
                &[("next epoch: looked up", g0, d, redirect, looked_up, new)],
            )
        });
    }
    anyhow::bail!("{fam}: three tries straddled an epoch boundary")
}

/// The FIB answer is kept in the flow entry, per direction: a packet of the same epoch uses
/// it without a lookup (shown by planting a MAC the FIB would never give), a packet of a later
/// epoch looks up again and refreshes it.
fn next_hop_is_cached_for_an_epoch(h: &mut Harness, n: &Net) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let planted = [0x02, 0, 0, 0, 0x0e, 0x0e];
    let syn = client_syn(n, n.vip, 40200);
    let out = |f: &Frame, dmac| to_backend(f, n, dmac);
    h.expect(
        &format!("{fam} SYN, next hop looked up"),
        h.g0,
        &syn.bytes(),
        XDP_REDIRECT,
        &out(&syn, MAC_BACKEND).bytes(),
        Counter::FlowNewSyn,
    )?;
    let key = flow_key(n, n.vip, 40200);
    let entry = h.dp.flow_table().get(&key, 0).context("the SYN's entry")?;
    ensure!(
        entry.to_backend.dmac == MAC_BACKEND && entry.to_backend.ifindex == h.g1,
        "{fam}: cached {:?}",
        entry.to_backend
    );
    let ack = syn.with(|f| f.flags = "A");
    // The same epoch: the planted MAC is used. Planting and sending take microseconds; a try
    // that straddles an epoch boundary is tried again.
    let mut used = false;
    for _ in 0..3 {
        let at = epoch();
        let mut e = entry;
        e.to_backend.dmac = planted;
        e.to_backend.epoch = at;
        h.dp.flow_table().insert(key, e, 0)?;
        let (v, got) = h.run(h.g0, &ack.bytes())?;
        ensure!(v == XDP_REDIRECT, "{fam}: verdict {v}");
        if got == out(&ack, planted).bytes() {
            used = true;
            break;
        }
        ensure!(
            epoch() != at,
            "{fam}: a cached next hop of this epoch was not used"
        );
    }
    ensure!(used, "{fam}: three tries straddled an epoch boundary");
    // An earlier epoch: looked up again, and the fresh answer kept.
    let mut e = h.dp.flow_table().get(&key, 0)?;
    e.to_backend.epoch = epoch().wrapping_sub(1);
    h.dp.flow_table().insert(key, e, 0)?;
    h.expect(
        &format!("{fam} ACK after the epoch, looked up again"),
        h.g0,
        &ack.bytes(),
        XDP_REDIRECT,
        &out(&ack, MAC_BACKEND).bytes(),
        Counter::Forward,
    )?;
    let e = h.dp.flow_table().get(&key, 0)?;
    ensure!(
        e.to_backend.dmac == MAC_BACKEND && e.to_backend.epoch >= epoch().wrapping_sub(1),
        "{fam}: not refreshed: {:?}",
        e.to_backend
    );
    // A packet longer than any the cached answer was checked for is looked up again: past
    // the egress MTU it is answered with the ICMP "too big" that quotes it as the client sent
    // it (an IPv4 packet that may be fragmented goes to the stack, translated, which
    // fragments it); a small one after it takes the fast path again. A reply past the
    // client side's MTU is answered to the backend, quoting the reply as it sent it.
    let big = data(&ack, 1400);
    let big_reply = data(&server_syn_ack(n, 40200), 1400);
    with_mtu(&["g0"], 1300, || {
        h.expect(
            &format!("{fam} reply past the client side's MTU"),
            h.g1,
            &big_reply.bytes(),
            XDP_TX,
            &too_big_answer(&big_reply, 1300),
            Counter::TooBigAnswered,
        )
    })?;
    // Longer than g0 carries (2000 bytes): coalesced by GRO before a program in generic
    // mode, which the stack splits again on the way out; no answer.
    let coalesced = big.with(|f| f.bulk = 1900);
    with_mtu(&["g1"], 1300, || {
        h.expect(
            &format!("{fam} data past the egress MTU"),
            h.g0,
            &big.bytes(),
            XDP_TX,
            &too_big_answer(&big, 1300),
            Counter::TooBigAnswered,
        )?;
        if n.client.is_ipv4() {
            h.expect(
                "v4 data past the egress MTU, may be fragmented",
                h.g0,
                &without_df(big.bytes()),
                XDP_PASS,
                &without_df(big.with(|f| f.dst = n.backend).bytes()),
                Counter::PassTooBig,
            )?;
        }
        h.expect(
            &format!("{fam} data longer than the ingress carries"),
            h.g0,
            &coalesced.bytes(),
            XDP_PASS,
            &coalesced.with(|f| f.dst = n.backend).bytes(),
            Counter::PassTooBig,
        )?;
        too_big_flood(h, fam, &big.bytes())?;
        h.expect(
            &format!("{fam} small data after it"),
            h.g0,
            &ack.bytes(),
            XDP_REDIRECT,
            &out(&ack, MAC_BACKEND).bytes(),
            Counter::Redirect,
        )
    })
}

/// Frames longer than a page (8 KB of data, as at MTU 9000), which the test run hands the
/// program in several buffers, as a driver does (the program is multi-buffer aware,
/// `xdp.frags`): in at MTU 9000 and past an egress MTU of 1500, answered "too big" (the
/// answer made of the first buffer, the others let go); where both links carry them and
/// their drivers transmit such frames, forwarded whole both ways, the payload in the later
/// buffers untouched; where they do not, handed to the stack.
fn jumbo_frames(h: &mut Harness, n: &Net) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let syn = client_syn(n, n.vip, 40300);
    let to_backend = |f: &Frame| to_backend(f, n, MAC_BACKEND);
    h.expect(
        &format!("{fam} SYN of a jumbo flow"),
        h.g0,
        &syn.bytes(),
        XDP_REDIRECT,
        &to_backend(&syn).bytes(),
        Counter::FlowNewSyn,
    )?;
    let big = data(&syn, 8000);
    let big_reply = data(&server_syn_ack(n, 40300), 8000);
    // In on a link that does not carry it: a frame the stack coalesced (generic mode), to
    // the stack translated, which splits it again. Its first buffer alone (a page less the
    // test run's head and tail room) would fit in the 4000.
    with_mtu(&["g0"], 4000, || {
        h.expect(
            &format!("{fam} jumbo data longer than the ingress carries"),
            h.g0,
            &big.bytes(),
            XDP_PASS,
            &big.with(|f| f.dst = n.backend).bytes(),
            Counter::PassTooBig,
        )
    })?;
    with_mtu(&["g0"], 9000, || {
        h.expect(
            &format!("{fam} jumbo data past an egress MTU of 1500"),
            h.g0,
            &big.bytes(),
            XDP_TX,
            &too_big_answer(&big, 1500),
            Counter::TooBigAnswered,
        )
    })?;
    with_mtu(&["g0", "g1"], 9000, || {
        // A veth transmits frames in several buffers once its peer has an XDP program, and
        // until then the kernel would drop them redirected: to the stack, translated.
        h.expect(
            &format!("{fam} jumbo data towards a driver that takes one buffer"),
            h.g0,
            &big.bytes(),
            XDP_PASS,
            &big.with(|f| f.dst = n.backend).bytes(),
            Counter::PassEgress,
        )?;
        let _peers = with_xdp_on(&["c0", "s0"])?;
        h.dp.set_egress(&LINKS.map(String::from))?;
        let sent = (|| {
            h.expect(
                &format!("{fam} jumbo data"),
                h.g0,
                &big.bytes(),
                XDP_REDIRECT,
                &to_backend(&big).bytes(),
                Counter::Redirect,
            )?;
            h.expect(
                &format!("{fam} jumbo reply"),
                h.g1,
                &big_reply.bytes(),
                XDP_REDIRECT,
                &to_client(&big_reply, n.vip).bytes(),
                Counter::Redirect,
            )
        })();
        drop(_peers);
        h.dp.set_egress(&LINKS.map(String::from))?;
        sent
    })
}

/// `xdp-pass` on `links` (in this namespace) until the process is dropped.
fn with_xdp_on(links: &[&str]) -> Result<balancer_tests::process::Process> {
    let dir = tempfile::tempdir()?;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_xdp-pass"));
    cmd.args(links);
    let mut pass =
        balancer_tests::process::Process::spawn("xdp-pass", cmd, &dir.path().join("xdp-pass.log"))?;
    pass.wait_for_line(0, std::time::Duration::from_secs(10), |l| {
        l.trim() == "attached"
    })?;
    Ok(pass)
}

/// A flood of packets too big for their next hop: answered at the rate Linux sends its own
/// ICMP errors, after a burst, and the rest dropped unanswered.
fn too_big_flood(h: &mut Harness, fam: &str, big: &[u8]) -> Result<()> {
    let limit = Limit::TooBigAnswers;
    let flood = 4 * limit.rate().1;
    let before = (
        h.counter(Counter::TooBigAnswered),
        h.counter(Counter::DropTooBigLimited),
    );
    let started = on_this_cpu(|| {
        let started = refilled(limit);
        for k in 0..flood {
            let (v, _) = h.run(h.g0, big)?;
            ensure!(
                v == XDP_TX || v == XDP_DROP,
                "{fam}: oversize packet {k} of a flood: verdict {v}"
            );
        }
        Ok(started)
    })?;
    let answered = h.counter(Counter::TooBigAnswered) - before.0;
    let limited = h.counter(Counter::DropTooBigLimited) - before.1;
    ensure!(
        answered + limited == flood,
        "{fam}: {answered} answered and {limited} dropped of {flood}"
    );
    within_allowance(limit, flood, answered, started)
        .with_context(|| format!("{fam}: oversize packets answered"))
}

/// Waits until every CPU's allowance under `limit` is a full burst again; returns when.
fn refilled(limit: Limit) -> std::time::Instant {
    let (per_s, burst) = limit.rate();
    std::thread::sleep(std::time::Duration::from_millis(1000 * burst / per_s + 10));
    std::time::Instant::now()
}

/// `used` of `flood` tries on one CPU since `started`, when its allowance under `limit` was
/// full, fit that limit: at least a burst, at most a burst and what the CPU earned meanwhile,
/// with a tick of the coarse clock to spare (10 ms at HZ = 100). Leaves every allowance full
/// again for the cases after.
fn within_allowance(
    limit: Limit,
    flood: u64,
    used: u64,
    started: std::time::Instant,
) -> Result<()> {
    let (per_s, burst) = limit.rate();
    let ms = started.elapsed().as_millis() as u64;
    let most = burst + (ms + 11) * per_s / 1000;
    ensure!(
        (burst..=most).contains(&used),
        "{used} of {flood} in {ms} ms, expected at least {burst} and at most {most}"
    );
    refilled(limit);
    Ok(())
}

/// Everything that is not plainly ours passes, byte for byte, with its reason counted.
fn passing(h: &mut Harness, n: &Net) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let g0 = h.g0;
    let syn = client_syn(n, n.vip, 41000);
    let same = |h: &mut Harness, what: &str, bytes: Vec<u8>, c: Counter| {
        h.expect_untouched(&format!("{fam} {what}"), g0, &bytes, XDP_PASS, c)
    };
    same(
        h,
        "TCP to another address",
        syn.with(|f| f.dst = n.other).bytes(),
        Counter::PassNotOurs,
    )?;
    same(
        h,
        "TCP to another port of the VIP",
        syn.with(|f| f.dport = 9999).bytes(),
        Counter::PassNotOurs,
    )?;
    same(
        h,
        "TTL 1",
        syn.with(|f| f.ttl = 1).bytes(),
        Counter::PassTtlExceeded,
    )?;

    let eth = || PacketBuilder::ethernet2(MAC_CLIENT, MAC_G0);
    let mut udp = Vec::new();
    let mut icmp = Vec::new();
    match (n.client, n.vip) {
        (IpAddr::V4(c), IpAddr::V4(v)) => {
            eth()
                .ipv4(c.octets(), v.octets(), 64)
                .udp(40000, 8000)
                .write(&mut udp, b"x")?;
            eth()
                .ipv4(c.octets(), v.octets(), 64)
                .icmpv4_echo_request(1, 1)
                .write(&mut icmp, b"ping")?;
        }
        (IpAddr::V6(c), IpAddr::V6(v)) => {
            eth()
                .ipv6(c.octets(), v.octets(), 64)
                .udp(40000, 8000)
                .write(&mut udp, b"x")?;
            eth()
                .ipv6(c.octets(), v.octets(), 64)
                .icmpv6_echo_request(1, 1)
                .write(&mut icmp, b"ping")?;
        }
        _ => unreachable!(),
    }
    same(h, "UDP to the VIP", udp, Counter::PassNotTcp)?;
    same(h, "ICMP echo to the VIP", icmp, Counter::PassNotTcp)?;

    // ARP who-has for the VIP.
    let mut arp = vec![0xff; 6];
    arp.extend_from_slice(&MAC_CLIENT);
    arp.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    arp.extend_from_slice(&MAC_CLIENT);
    arp.extend_from_slice(&[10, 9, 0, 2, 0, 0, 0, 0, 0, 0, 192, 0, 2, 60]);
    // Tags in front of the EtherType: 802.1ad outer, 802.1Q inner.
    let tagged = |frame: &[u8], tags: &[[u8; 2]]| {
        let mut b = frame[..12].to_vec();
        for (i, tpid) in tags.iter().enumerate() {
            b.extend_from_slice(tpid);
            b.extend_from_slice(&[0, 5 + i as u8]);
        }
        b.extend_from_slice(&frame[12..]);
        b
    };
    let (qinq, q) = ([0x88, 0xa8], [0x81, 0x00]);
    same(h, "ARP", arp.clone(), Counter::PassNotIp)?;
    same(h, "ARP under a tag", tagged(&arp, &[q]), Counter::PassNotIp)?;
    same(
        h,
        "ARP under two tags",
        tagged(&arp, &[qinq, q]),
        Counter::PassNotIp,
    )?;
    // A third tag is more than the program looks through.
    let syn3 = tagged(&syn.bytes(), &[qinq, q, q]);
    same(h, "a SYN under three tags", syn3, Counter::PassNotIp)?;

    let full = syn.bytes();
    match (n.client, n.vip) {
        (IpAddr::V4(c), IpAddr::V4(v)) => {
            let tcp = etherparse::TcpHeader::new(41000, 8000, 1, 64240);
            let mut with_opts =
                Ipv4Header::new(0, 64, etherparse::IpNumber::TCP, c.octets(), v.octets())?;
            with_opts.options = etherparse::Ipv4Options::try_from(&[1u8, 1, 1, 0][..])?;
            let mut b = Vec::new();
            PacketBuilder::ethernet2(MAC_CLIENT, MAC_G0)
                .ip(IpHeaders::Ipv4(with_opts, Default::default()))
                .tcp_header(tcp.clone())
                .write(&mut b, b"")?;
            same(h, "IPv4 options", b, Counter::PassIpOptions)?;
            for (mf, offset) in [(true, 0u16), (false, 185)] {
                let mut frag =
                    Ipv4Header::new(0, 64, etherparse::IpNumber::TCP, c.octets(), v.octets())?;
                frag.more_fragments = mf;
                frag.fragment_offset = etherparse::IpFragOffset::try_new(offset)?;
                let mut b = Vec::new();
                PacketBuilder::ethernet2(MAC_CLIENT, MAC_G0)
                    .ip(IpHeaders::Ipv4(frag, Default::default()))
                    .tcp_header(tcp.clone())
                    .write(&mut b, b"")?;
                same(
                    h,
                    &format!("fragment mf={mf} offset={offset}"),
                    b,
                    Counter::PassFragment,
                )?;
            }
            let mut bad = full.clone();
            bad[14] = 0x44; // IHL 4: shorter than the fixed header
            same(h, "IHL < 5", bad, Counter::PassMalformed)?;
            for tot_len in [0u16, 19] {
                // Total length shorter than the header itself (checksum not fixed: the
                // program must refuse it before any checksum matters).
                let mut bad = full.clone();
                bad[16..18].copy_from_slice(&tot_len.to_be_bytes());
                same(
                    h,
                    &format!("total length {tot_len}"),
                    bad,
                    Counter::PassMalformed,
                )?;
            }
        }
        (IpAddr::V6(_), IpAddr::V6(_)) => {
            // A hop-by-hop header (PadN) between IPv6 and TCP.
            let mut b = full[..54].to_vec();
            b[14 + 6] = 0; // next header: hop-by-hop
            let plen = u16::from_be_bytes([b[18], b[19]]) + 8;
            b[18..20].copy_from_slice(&plen.to_be_bytes());
            b.extend_from_slice(&[6, 0, 1, 4, 0, 0, 0, 0]);
            b.extend_from_slice(&full[54..]);
            same(h, "IPv6 hop-by-hop header", b, Counter::PassIpv6ExtHeader)?;
            for (next, name) in [
                (43, "routing"),
                (44, "fragment"),
                (51, "AH"),
                (60, "destination options"),
            ] {
                let mut b = full.clone();
                b[14 + 6] = next;
                same(
                    h,
                    &format!("IPv6 {name} header"),
                    b,
                    Counter::PassIpv6ExtHeader,
                )?;
            }
        }
        _ => unreachable!(),
    }

    // TCP data offset 4, and 60 bytes of header in a shorter segment.
    let (l4, other_version) = if n.client.is_ipv4() {
        (14 + 20, 0x65)
    } else {
        (14 + 40, 0x45)
    };
    for (offset, what) in [(0x40, "< 5"), (0xf0, "past the segment")] {
        let mut bad = full.clone();
        bad[l4 + 12] = offset;
        same(
            h,
            &format!("TCP data offset {what}"),
            bad,
            Counter::PassMalformed,
        )?;
    }
    let mut bad = full.clone();
    bad[14] = other_version;
    same(
        h,
        "the other IP version under the EtherType",
        bad,
        Counter::PassMalformed,
    )?;

    // Every cut of a SYN with options, from nothing to one byte short of its headers.
    for len in 0..full.len() {
        let cut = &full[..len];
        if len < 14 {
            // The kernel refuses to run XDP on less than an Ethernet header: no driver hands
            // such a frame to XDP either.
            ensure!(
                h.run(g0, cut).is_err(),
                "{fam}: test run accepted a {len}-byte frame"
            );
            continue;
        }
        same(
            h,
            &format!("SYN cut to {len} bytes"),
            cut.to_vec(),
            Counter::PassTruncated,
        )?;
    }
    Ok(())
}

/// Every event the program has put in the ring since the last call.
fn reported(ring: &mut aya::maps::RingBuf<aya::maps::MapData>) -> Vec<Event> {
    let mut events = Vec::new();
    while let Some(item) = ring.next() {
        let (e, at) = Event::from_ring(&item).expect("the program writes well-formed events");
        assert!(epoch().wrapping_sub(at) <= 1, "reported at epoch {at}");
        events.push(e);
    }
    events
}

/// Flows shared with other gateways (`[sync]`): the program reports a new flow once the
/// client's ACK follows its SYN, a keepalive once a third of the idle timeout has passed
/// since the last report (not before), its end once, and a flow placed without its SYN
/// as a guess; a VIP without sharing reports nothing. A flow another gateway reported
/// (written by the agent) is followed by a mid-stream packet that has no SYN here, to the
/// server that gateway chose rather than this one's Maglev pick; its close is reported but
/// not counted, as its open was not; and what each kind of report may overwrite follows
/// `Dataplane::adopt_flow`.
#[test]
fn shared_flows_are_reported_and_followed() -> Result<()> {
    in_topology(|| {
        let nets = [v4(), v6()];
        let plain = config(&nets);
        let mut shared = plain.clone();
        shared.sync = Some(balancer_agent::config::FlowSync {
            listen: "10.4.0.1:7471".parse()?,
            peers: vec!["10.4.0.2:7471".parse()?],
            key_file: "/dev/null".into(),
            accept_key_files: Vec::new(),
        });
        for (config, sharing) in [(&shared, true), (&plain, false)] {
            let (mut h, plan) = Harness::load(config)?;
            let mut ring = h.dp.take_flow_events().context("the ring")?;
            let id = |addr: IpAddr| id_in(&plan, addr);
            for n in &nets {
                reports(&mut h, &mut ring, n, sharing)?;
                if sharing {
                    let table = &multi_vip(&plan, n).table;
                    adopted(&mut h, &mut ring, n, table, &id)?;
                    dumped(&mut h, n, &id)?;
                }
            }
        }
        Ok(())
    })
}

fn reports(
    h: &mut Harness,
    ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
    n: &Net,
    sharing: bool,
) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let event = |kind, sport| Event {
        kind,
        client: SocketAddr::new(n.client, sport),
        vip: SocketAddr::new(n.vip, 8000),
        backend: SocketAddr::new(n.backend, 8000),
    };
    let want = |events: Vec<Event>| if sharing { events } else { Vec::new() };
    let syn = client_syn(n, n.vip, 40300);
    let ack = syn.with(|f| f.flags = "A");
    let reply = server_syn_ack(n, 40300).with(|f| f.flags = "PA");
    let run = |h: &mut Harness, ingress: u32, f: &Frame| forwarded(h, ingress, f, fam);
    let (g0, g1) = (h.g0, h.g1);
    run(h, g0, &syn)?;
    ensure!(reported(ring).is_empty(), "{fam}: reported at its SYN");
    run(h, g0, &ack)?;
    ensure!(
        reported(ring) == want(vec![event(Kind::Open, 40300)]),
        "{fam}: the handshake's ACK"
    );
    run(h, g0, &ack)?;
    ensure!(reported(ring).is_empty(), "{fam}: reported again at once");
    // A keepalive every third of the idle timeout (600 s: 186 epochs of 2^30 ns), checked
    // when the entry's time is refreshed (a packet a second after the last).
    for (since, expect) in [(185, vec![]), (186, vec![event(Kind::Alive, 40300)])] {
        let synced = aged(h, n, 40300, |e| {
            if e.synced != 0 {
                e.synced = epoch().wrapping_sub(since);
            }
        })?;
        ensure!((synced != 0) == sharing, "{fam}: synced {synced}");
        run(h, g1, &reply)?;
        ensure!(
            reported(ring) == want(expect),
            "{fam}: keepalive {since} epochs after the last report"
        );
    }
    run(h, g1, &reply.with(|f| f.flags = "FA"))?;
    run(h, g0, &ack.with(|f| f.flags = "FA"))?;
    run(h, g0, &ack.with(|f| f.flags = "RA"))?;
    ensure!(
        reported(ring) == want(vec![event(Kind::Close, 40300)]),
        "{fam}: the end once (the server's FIN; not the client's FIN, nor a RST after)"
    );
    // Placed without its SYN: a guess, shared as such.
    run(h, g0, &ack.with(|f| f.sport = 40302))?;
    ensure!(
        reported(ring) == want(vec![event(Kind::Alive, 40302)]),
        "{fam}: a flow placed mid-stream"
    );
    // A flood of them (forged, most likely): reported up to each CPU's allowance; every one
    // is still placed.
    let guesses = Flood {
        whats: "guesses",
        kind: Kind::Alive,
        counter: Counter::SyncGuessLimited,
        port: |k| 20000 + k as u16,
    };
    guesses.check(
        h,
        ring,
        n,
        sharing,
        |h, k| run(h, g0, &ack.with(|f| f.sport = guesses.port(k))),
        |h, k| {
            let rst = ack.with(|f| {
                f.sport = guesses.port(k);
                f.flags = "RA";
            });
            run(h, g0, &rst)
        },
    )?;
    opens_bounded(h, ring, n, sharing, &syn)
}

/// Runs `f` in from `ingress`, which the program must forward (`XDP_REDIRECT`).
fn forwarded(h: &mut Harness, ingress: u32, f: &Frame, fam: &str) -> Result<()> {
    let (v, _) = h.run(ingress, &f.bytes())?;
    ensure!(v == XDP_REDIRECT, "{fam}: verdict {v} for {}", f.flags);
    Ok(())
}

/// Forged packets buy no reports beyond the allowance: a SYN that is never acknowledged is
/// reported neither when it comes again nor when a RST ends it, and the opens of a flood of
/// SYN and ACK pairs are reported up to each CPU's allowance, the rest at their next packet
/// a second or more later.
fn opens_bounded(
    h: &mut Harness,
    ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
    n: &Net,
    sharing: bool,
    syn: &Frame,
) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let g0 = h.g0;
    let run = |h: &mut Harness, f: &Frame| forwarded(h, g0, f, fam);
    let unacked = syn.with(|f| f.sport = 40304);
    run(h, &unacked)?;
    // Its keepalive due, if it were one.
    aged(h, n, 40304, |e| {
        if e.synced != 0 {
            e.synced = e.synced.wrapping_sub(186);
        }
    })?;
    run(h, &unacked)?;
    // A bare RST, without ACK: no acknowledgment either.
    run(h, &unacked.with(|f| f.flags = "R"))?;
    let events = reported(ring);
    ensure!(
        events.is_empty(),
        "{fam}: a flow never acknowledged reported {events:?}"
    );

    let opens = Flood {
        whats: "opens",
        kind: Kind::Open,
        counter: Counter::SyncOpenLimited,
        port: |k| 24000 + k as u16,
    };
    let flow = |k: u64| syn.with(|f| f.sport = opens.port(k));
    for k in 0..opens.size() {
        run(h, &flow(k))?;
    }
    opens.check(
        h,
        ring,
        n,
        sharing,
        |h, k| run(h, &flow(k).with(|f| f.flags = "A")),
        |h, k| run(h, &flow(k).with(|f| f.flags = "RA")),
    )
}

/// Makes flow `sport` (client to `n.vip`) look two seconds older, so that its next packet
/// refreshes its time and checks its keepalive, after `f` changed what else it needs; its
/// `synced` as written.
fn aged(
    h: &mut Harness,
    n: &Net,
    sport: u16,
    f: impl FnOnce(&mut balancer_common::FlowEntry),
) -> Result<u32> {
    let e = edit_flow(h, &flow_key(n, n.vip, sport), |e| {
        f(e);
        e.last_seen_ns = e.last_seen_ns.saturating_sub(2_000_000_000);
    })?;
    Ok(e.synced)
}

/// Makes flow `sport`'s (client to `n.vip`) last packet now, so that its next one checks no
/// keepalive.
fn refreshed(h: &mut Harness, n: &Net, sport: u16) -> Result<()> {
    edit_flow(h, &flow_key(n, n.vip, sport), |e| {
        e.last_seen_ns = balancer_agent::dataplane::monotonic_ns()
    })?;
    Ok(())
}

/// A flood of new flows (`whats`) from ports `port(0..size())` to `n.vip`, sent on one CPU,
/// of which those past its allowance of new-flow reports are counted in `counter`.
struct Flood {
    whats: &'static str,
    kind: Kind,
    counter: Counter,
    port: fn(u64) -> u16,
}

impl Flood {
    fn size(&self) -> u64 {
        3 * Limit::NewFlowReports.rate().1
    }

    fn port(&self, k: u64) -> u16 {
        (self.port)(k)
    }

    /// Sends the flood (`send(h, k)` sends flow `k`'s packet) from a full allowance, then
    /// checks what the ring says of it: with sharing, each flow reported as `kind` or counted
    /// past the allowance, those reported within it; then, at its next packet a second or
    /// more later, the last flow past the allowance is reported and the first, reported
    /// already, is not (which were past it depends on when the coarse clock ticked during
    /// the flood: the ring says). Their ends (`end(h, k)`): the first flow's is reported,
    /// and a flow's past the allowance, never told of, is not (forged pairs of packets and
    /// their ends buy no report past the allowance), unless a peer reported it while it was
    /// quiet here. Without sharing, neither reported nor counted.
    fn check(
        &self,
        h: &mut Harness,
        ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
        n: &Net,
        sharing: bool,
        send: impl Fn(&mut Harness, u64) -> Result<()>,
        end: impl Fn(&mut Harness, u64) -> Result<()>,
    ) -> Result<()> {
        let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
        let limit = Limit::NewFlowReports;
        let (whats, flood) = (self.whats, self.size());
        let before = h.counter(self.counter);
        let started = on_this_cpu(|| {
            let started = refilled(limit);
            for k in 0..flood {
                send(h, k)?;
            }
            Ok(started)
        })?;
        let events = reported(ring);
        ensure!(
            events.iter().all(|e| e.kind == self.kind),
            "{fam}: a flood of {whats} reported {events:?}"
        );
        let ports: std::collections::HashSet<u16> =
            events.iter().map(|e| e.client.port()).collect();
        let (shared, limited) = (events.len() as u64, h.counter(self.counter) - before);
        if !sharing {
            ensure!(
                (shared, limited) == (0, 0),
                "{fam}: without sharing, {shared} {whats} reported and {limited} limited"
            );
            return Ok(());
        }
        ensure!(
            shared + limited == flood,
            "{fam}: {shared} {whats} reported and {limited} not, of {flood}"
        );
        within_allowance(limit, flood, shared, started)
            .with_context(|| format!("{fam}: {whats} reported"))?;
        let last_limited = (0..flood)
            .rev()
            .find(|&k| !ports.contains(&self.port(k)))
            .with_context(|| format!("{fam}: none of the {whats} was past the allowance"))?;
        let event = |kind, k| Event {
            kind,
            client: SocketAddr::new(n.client, self.port(k)),
            vip: SocketAddr::new(n.vip, 8000),
            backend: SocketAddr::new(n.backend, 8000),
        };
        for (k, now_shared) in [(0, false), (last_limited, true)] {
            aged(h, n, self.port(k), |_| {})?;
            send(h, k)?;
            let expect = if now_shared {
                vec![event(Kind::Alive, k)]
            } else {
                vec![]
            };
            let got = reported(ring);
            ensure!(
                got == expect,
                "{fam}: {whats}: flow {k} of {flood} at its next packet: {got:?}"
            );
        }
        let mut past = (0..last_limited)
            .rev()
            .filter(|&k| !ports.contains(&self.port(k)));
        let (Some(untold), Some(peer_told)) = (past.next(), past.next()) else {
            bail!("{fam}: fewer than three of the {whats} were past the allowance");
        };
        // A peer reports one open (its packets went there too): the peers know of it after
        // all, and hear of its end.
        let key = flow_key(n, n.vip, self.port(peer_told));
        let e = edit_flow(h, &key, |e| e.last_seen_ns -= 3_000_000_000)?;
        let target = (e.backend_id, e.nat_addr, e.nat_port);
        ensure!(
            h.dp.adopt_flow(&key, target, 600, Kind::Open)?,
            "{fam}: a peer's report of a quiet flow did not refresh it"
        );
        for (k, expect) in [
            (0, vec![event(Kind::Close, 0)]),
            (untold, vec![]),
            (peer_told, vec![event(Kind::Close, peer_told)]),
        ] {
            // Heard from just now: no keepalive is due (it would tell them).
            refreshed(h, n, self.port(k))?;
            end(h, k)?;
            let got = reported(ring);
            ensure!(
                got == expect,
                "{fam}: {whats}: the end of flow {k} of {flood} (untold: {}): {got:?}",
                k == untold
            );
        }
        Ok(())
    }
}

/// A flow of another gateway on the multi-backend VIP, on a server this gateway's Maglev
/// would not pick for it.
fn adopted(
    h: &mut Harness,
    ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
    n: &Net,
    table: &[u32],
    id: &dyn Fn(IpAddr) -> u32,
) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let sport = 40310;
    let pick = maglev_pick(n, sport, table, id)?;
    let (theirs, other) = {
        let mut rest = n.multi.iter().copied().filter(|b| *b != pick);
        (rest.next().unwrap(), rest.next().unwrap())
    };
    let key = multi_key(n, sport);
    let target = |b: IpAddr| (id(b), balancer_common::addr_words(b).0, 8000u16.to_be());
    let g0 = h.g0;
    ensure!(
        h.dp.adopt_flow(&key, target(theirs), 600, Kind::Open)?,
        "{fam}: not written"
    );
    let before = h.stats(id(theirs));
    let data = client_syn(n, n.vip_multi, sport).with(|f| f.flags = "PA");
    // No neighbour entries behind this VIP: rewritten, then to the stack.
    h.expect(
        &format!("{fam} data of a flow another gateway opened on {theirs}, not {pick}"),
        g0,
        &data.bytes(),
        XDP_PASS,
        &data.with(|f| f.dst = theirs).bytes(),
        Counter::PassNoNeigh,
    )?;
    // A report decided on the table as read just before the program placed a SYN on the
    // tuple here (no entry then): the program's entry stays.
    let raced = multi_key(n, sport + 1);
    let (v, _) = h.run(g0, &client_syn(n, n.vip_multi, sport + 1).bytes())?;
    ensure!(v == XDP_PASS, "{fam}: SYN verdict {v}");
    let placed = h.dp.flow_table().get(&raced, 0)?.backend_id;
    let peer_pick = if placed == id(theirs) { other } else { theirs };
    ensure!(
        !h.dp
            .adopt_flow_over(&raced, target(peer_pick), 600, Kind::Open, None)?
            && h.dp.flow_table().get(&raced, 0)?.backend_id == placed,
        "{fam}: a report overwrote an entry the program placed after the report's read"
    );
    // What other reports may do to it.
    let at = |h: &mut Harness| -> Result<IpAddr> {
        let e = h.dp.flow_table().get(&key, 0)?;
        server(n, e.backend_id, id)
    };
    ensure!(
        !h.dp.adopt_flow(&key, target(other), 600, Kind::Alive)? && at(h)? == theirs,
        "{fam}: a guess overrode a live entry"
    );
    ensure!(
        !h.dp.adopt_flow(&key, target(other), 600, Kind::Close)?
            && h.dp.flow_table().get(&key, 0)?.closed == 0,
        "{fam}: another server's close closed it"
    );
    let (v, _) = h.run(g0, &data.with(|f| f.flags = "RA").bytes())?;
    ensure!(v == XDP_PASS, "{fam}: RST verdict {v}");
    let closes = reported(ring);
    ensure!(
        closes.len() == 1 && closes[0].kind == Kind::Close && closes[0].backend.ip() == theirs,
        "{fam}: the adopted flow's close: {closes:?}"
    );
    let after = h.stats(id(theirs));
    ensure!(
        (after.flows_opened, after.flows_closed) == (before.flows_opened, before.flows_closed),
        "{fam}: an adopted flow counted as opened or closed here: {before:?} -> {after:?}"
    );
    ensure!(
        !h.dp.adopt_flow(&key, target(theirs), 600, Kind::Alive)?
            && h.dp.flow_table().get(&key, 0)?.closed == 1,
        "{fam}: a late keepalive reopened a closed flow"
    );
    // A new connection on the tuple, placed by its SYN elsewhere: it replaces the entry.
    ensure!(
        h.dp.adopt_flow(&key, target(other), 600, Kind::Open)? && at(h)? == other,
        "{fam}: a new connection did not replace a closed one"
    );
    // A flow this gateway opened, closed through a peer: its close is counted here, once.
    let sport = 40311;
    let syn = client_syn(n, n.vip_multi, sport);
    let (v, _) = h.run(g0, &syn.bytes())?;
    ensure!(v == XDP_PASS, "{fam}: SYN verdict {v}");
    let mine = maglev_pick(n, sport, table, id)?;
    let key = multi_key(n, sport);
    let before = h.stats(id(mine));
    for _ in 0..2 {
        h.dp.adopt_flow(&key, target(mine), 600, Kind::Close)?;
    }
    let (v, _) = h.run(g0, &syn.with(|f| f.flags = "RA").bytes())?;
    ensure!(v == XDP_PASS, "{fam}: RST verdict {v}");
    let after = h.stats(id(mine));
    ensure!(
        after.flows_closed == before.flows_closed + 1,
        "{fam}: a close through a peer counted {} times",
        after.flows_closed - before.flows_closed
    );
    // A flow this gateway opened that went quiet here past its idle timeout (its packets go
    // to a peer now), which the peer reports alive: adopted, and its close counted here, once.
    let sport = 40312;
    let syn = client_syn(n, n.vip_multi, sport);
    let (v, _) = h.run(g0, &syn.bytes())?;
    ensure!(v == XDP_PASS, "{fam}: SYN verdict {v}");
    let mine = maglev_pick(n, sport, table, id)?;
    let key = multi_key(n, sport);
    expire(h, &key)?;
    let before = h.stats(id(mine));
    ensure!(
        h.dp.adopt_flow(&key, target(mine), 600, Kind::Alive)?,
        "{fam}: an expired flow of ours not adopted"
    );
    let (v, _) = h.run(g0, &syn.with(|f| f.flags = "RA").bytes())?;
    ensure!(v == XDP_PASS, "{fam}: RST verdict {v}");
    let closes = reported(ring);
    ensure!(
        closes.len() == 1 && closes[0].kind == Kind::Close,
        "{fam}: the adopted flow's close: {closes:?}"
    );
    let after = h.stats(id(mine));
    ensure!(
        after.flows_closed == before.flows_closed + 1,
        "{fam}: an expired flow of ours adopted from a peer: {} closes counted",
        after.flows_closed - before.flows_closed
    );
    reported_nothing_else(ring, fam)
}

fn reported_nothing_else(
    ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
    fam: &str,
) -> Result<()> {
    let rest = reported(ring);
    ensure!(rest.is_empty(), "{fam}: unexpected reports {rest:?}");
    Ok(())
}

/// What a peer that starts is sent (`sync::live_flows`): every live shared flow in the
/// table, in parts of 64, and none that is closed.
fn dumped(h: &mut Harness, n: &Net, id: &dyn Fn(IpAddr) -> u32) -> Result<()> {
    let fam = if n.client.is_ipv4() { "v4" } else { "v6" };
    let server = n.multi[2];
    let target = (
        id(server),
        balancer_common::addr_words(server).0,
        8000u16.to_be(),
    );
    let ports = 41000..41150u16;
    for sport in ports.clone() {
        let key = multi_key(n, sport);
        h.dp.adopt_flow(&key, target, 600, Kind::Open)?;
        if sport % 10 == 0 {
            h.dp.adopt_flow(&key, target, 600, Kind::Close)?;
        }
    }
    let mut parts = Vec::new();
    let handed = balancer_agent::sync::live_flows(h.dp.flows_id(), |part| {
        parts.push(part);
        true
    })?;
    ensure!(
        parts.iter().map(Vec::len).sum::<usize>() == handed
            && parts.iter().rev().skip(1).all(|p| p.len() == 64)
            && parts.last().is_some_and(|p| p.len() <= 64),
        "{fam}: parts of {:?}",
        parts.iter().map(Vec::len).collect::<Vec<_>>()
    );
    let mut ours: Vec<u16> = parts
        .iter()
        .flatten()
        .filter(|e| e.vip.ip() == n.vip_multi && ports.contains(&e.client.port()))
        .inspect(|e| assert!(e.kind == Kind::Alive && e.backend.ip() == server))
        .map(|e| e.client.port())
        .collect();
    ours.sort_unstable();
    let want: Vec<u16> = ports.filter(|p| p % 10 != 0).collect();
    ensure!(
        ours == want,
        "{fam}: dumped {} of {} live flows",
        ours.len(),
        want.len()
    );
    // A receiver that stops taking parts stops the walk.
    let mut taken = 0;
    balancer_agent::sync::live_flows(h.dp.flows_id(), |_| {
        taken += 1;
        false
    })?;
    ensure!(
        taken == 1,
        "{fam}: the walk went on after {taken} refused parts"
    );
    Ok(())
}
