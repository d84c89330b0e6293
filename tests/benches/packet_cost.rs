//! Packet cost under BPF_PROG_TEST_RUN (issue 8, item 1): nanoseconds per packet for each
//! path of the program, against a bare XDP_PASS program measured the same way in the same
//! run, with a million flows in the flow table.
//!
//! Every packet runs once (`repeat` = 1) and the figure is the mean of the kernel's times
//! over many distinct flows: with `repeat` > 1 the kernel runs the program again on the
//! packet it already rewrote, which measures a different path (a rewritten packet is not
//! ours any more), and a SYN repeated would find the flow its first run opened. The floor
//! is measured the same way, so the ratios compare like with like; the per-run timer
//! overhead is in every figure, floor included. The packets go in passes over chunks of
//! flows (SYNs; first replies and first client packets; then the measured client packets and
//! replies), so that a flow's entry has left the CPU's nearer caches since its previous
//! packet while the next hop its previous packet in that direction cached is still fresh, as in a
//! stream. One more figure sends the established packet again right away, as the segments
//! after the first of a burst arrive: its entry is then in cache.
//!
//! A second table times the two paths whose packet the program does not modify (the floor
//! and a packet that is not ours) with `repeat` = a million, one packet run again and again:
//! there the kernel's timer overhead is spread over the repetitions, which shows how much of
//! the single-run figures it is.
//!
//! `cargo bench -p balancer-tests --bench packet_cost [-- --quick]`, as root. Prints a
//! markdown table and writes it to `target/bench/packet-cost.md` (with `.figures` and
//! `.summary` for `cargo xtask bench`).

use std::{collections::BTreeMap, net::IpAddr, time::Instant};

use anyhow::{bail, ensure, Context, Result};
use aya::programs::{TestRun, TestRunOptions, Xdp};
use balancer_agent::{config::Config, dataplane::Dataplane, objects, plan::Ids};
use balancer_common::{
    addr_words, hint::HintRange, Bucket, FlowEntry, FlowKey, FAMILY_V4, IPPROTO_TCP,
};
use balancer_tests::bench::Report;
use balancer_tests::test_run::{gateway_links, ifindex, MAC_C0, MAC_G0};
use etherparse::PacketBuilder;

const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;

/// Flows per chunk: 5000 entries (about 750 KB) and the runs between a flow's packets
/// outgrow a core's L2, and a chunk's passes take milliseconds, far less than the second a
/// cached next hop lasts.
const CHUNK: u32 = 5000;

/// A run the kernel timed at more than this was interrupted or rescheduled inside the timed
/// region (the test run only keeps it from migrating): no path of the program takes a tenth
/// of it. Such runs are left out of the means and counted, so that one stall of a few
/// milliseconds on this shared machine cannot make a floor of microseconds.
const STALL_NS: f64 = 50_000.0;

struct Plan {
    flows: u32,
    packets: u32,
    /// `repeat` of the second table.
    repeat: u32,
}

/// What [`measure`] found: the section's tables, its figures and its summary lines.
struct Measured {
    markdown: String,
    figures: BTreeMap<String, Option<f64>>,
    summary: Vec<String>,
}

struct Net {
    client: IpAddr,
    vip: IpAddr,
    backend: IpAddr,
    other: IpAddr,
    /// A VIP of the same backend whose flows are shared with other gateways (`[sync]`).
    vip_shared: IpAddr,
    /// A VIP of the same backend with direct server return (`forwarding = "dsr"`).
    vip_dsr: IpAddr,
    /// And one through a tunnel (`forwarding = "tunnel"`).
    vip_tunnel: IpAddr,
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("bench address")
}

fn main() -> Result<()> {
    let mut quick = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--quick" => quick = true,
            "--bench" => {}
            other => bail!("unknown argument {other:?}; usage: packet_cost [--quick]"),
        }
    }
    let plan = if quick {
        Plan {
            flows: 100_000,
            packets: 2_000,
            repeat: 100_000,
        }
    } else {
        Plan {
            flows: 1_000_000,
            packets: 50_000,
            repeat: 1_000_000,
        }
    };
    balancer_tests::require_root()?;
    let backend_mac = [0x02, 0, 0, 0, 0x04, 0x11];
    let ns = gateway_links(
        "bench",
        &[
            ("10.4.0.11", backend_mac, "g1"),
            ("fd00:4::11", backend_mac, "g1"),
            ("10.9.0.2", backend_mac, "g0"),
            ("fd00:9::2", backend_mac, "g0"),
        ],
    )?;
    // The benchmark's clients live in 10.20-21.0.0/16 and fd00:20-21::/32, behind 10.9.0.2.
    for (net, via) in [("10.20.0.0/15", "10.9.0.2"), ("fd00:20::/31", "fd00:9::2")] {
        ns.ip(&["route", "add", net, "via", via, "dev", "g0"])?;
    }
    let started = Instant::now();
    let measured = ns.enter(|| measure(&plan))?;
    drop(ns);
    Report {
        name: "packet-cost".into(),
        quick,
        markdown: format!(
            "## 1. Packet cost under BPF_PROG_TEST_RUN\n\n{}",
            measured.markdown
        ),
        summary: measured.summary,
        figures: measured.figures,
        seconds: started.elapsed().as_secs_f64(),
    }
    .write()
}

fn frame(src: IpAddr, dst: IpAddr, sport: u16, dport: u16, syn: bool) -> Vec<u8> {
    let eth = PacketBuilder::ethernet2(MAC_C0, MAC_G0);
    let ipb = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => eth.ipv4(s.octets(), d.octets(), 64),
        (IpAddr::V6(s), IpAddr::V6(d)) => eth.ipv6(s.octets(), d.octets(), 64),
        _ => unreachable!("one family per frame"),
    };
    let tcp = ipb.tcp(sport, dport, 1, 64240);
    let tcp = if syn { tcp.syn() } else { tcp.ack(1) };
    let mut out = Vec::new();
    tcp.write(&mut out, if syn { b"" } else { b"data: {}\n\n" })
        .expect("frame");
    out
}

/// Runs `frame`, arriving on `ifindex`, `repeat` times in one BPF_PROG_TEST_RUN; the kernel's
/// mean time per run in ns. Repeated runs see the packet the previous run left, so `repeat`
/// > 1 is only for packets the program does not modify, which is checked.
fn run(prog: &Xdp, ifindex: u32, frame: &[u8], repeat: u32, want: u32) -> Result<f64> {
    let mut ctx = [0u8; 24];
    ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
    let mut out = vec![0u8; frame.len() + 256];
    let r = prog.test_run(TestRunOptions {
        data_in: Some(frame),
        data_out: Some(&mut out),
        ctx_in: Some(&ctx),
        repeat,
        ..Default::default()
    })?;
    ensure!(
        r.return_value == want,
        "verdict {} where {want} was expected, for {:02x?}",
        r.return_value,
        &frame[..frame.len().min(54)]
    );
    ensure!(
        repeat <= 1 || out[..frame.len()] == *frame,
        "the program modified a packet run {repeat} times"
    );
    Ok(r.duration.as_nanos() as f64)
}

fn measure(plan: &Plan) -> Result<Measured> {
    let nets = [
        Net {
            client: ip("10.9.0.2"),
            vip: ip("192.0.2.60"),
            backend: ip("10.4.0.11"),
            other: ip("10.4.0.99"),
            vip_shared: ip("192.0.2.61"),
            vip_dsr: ip("192.0.2.62"),
            vip_tunnel: ip("192.0.2.63"),
        },
        Net {
            client: ip("fd00:9::2"),
            vip: ip("2001:db8::60"),
            backend: ip("fd00:4::11"),
            other: ip("fd00:4::99"),
            vip_shared: ip("2001:db8::61"),
            vip_dsr: ip("2001:db8::62"),
            vip_tunnel: ip("2001:db8::63"),
        },
    ];
    let mut text =
        String::from("[agent]\ninterfaces = [\"g0\", \"g1\"]\nflow_table_entries = 4194304\n");
    for (i, n) in nets.iter().enumerate() {
        // The tunnel's source: the gateway's address on g1.
        let source = if n.client.is_ipv4() {
            "10.4.0.1"
        } else {
            "fd00:4::1"
        };
        for (name, vip, forwarding) in [
            ("p", n.vip, "nat"),
            ("shared", n.vip_shared, "nat"),
            ("dsr", n.vip_dsr, "dsr"),
            ("tunnel", n.vip_tunnel, "tunnel"),
        ] {
            let source = if forwarding == "tunnel" {
                format!("tunnel_source = \"{source}\"\n")
            } else {
                String::new()
            };
            text += &format!(
                "[[pool]]\nname = \"{name}{i}\"\nvip = \"{vip}\"\nport = 8000\nforwarding = \"{forwarding}\"\n{source}[[pool.server]]\naddress = \"{}\"\nport = 8000\nmetrics_port = 8001\n",
                n.backend
            );
        }
    }
    let config = Config::parse(std::path::Path::new("bench.toml"), &text)?;
    let mut dp = Dataplane::load(config.agent.flow_table_entries, None)?;
    let mut plan_maps =
        Ids::default().plan(&config, &Default::default(), std::time::Instant::now())?;
    // `[sync]` shares every VIP's flows; here only the `shared` pools', so that their SYNs
    // and the others run side by side.
    for vip in &mut plan_maps.vips {
        vip.shared = vip.pool.starts_with("shared");
    }
    dp.apply(&plan_maps)?;
    dp.set_egress(&["g0".to_owned(), "g1".to_owned()])?;
    // Every bucket's home is the one backend, with room to spare: hinted SYNs take the
    // whole hint path (bucket lookup, budget check, bucket statistics).
    for vip in &plan_maps.vips {
        let home = vip.members[0].1;
        for b in 0..HintRange::DEFAULT.buckets {
            dp.set_bucket(
                vip.vip_id,
                b,
                &Bucket {
                    ids: [home, 0, 0, 0],
                },
            )?;
        }
        dp.set_budget(home, i32::MAX)?;
    }
    let (g0, g1) = (ifindex("g0")?, ifindex("g1")?);
    let mut ring = dp.take_flow_events().context("the ring of shared flows")?;
    // A CPU reports at most 1000 new shared flows a second after a burst of 1000
    // (`Limit::NewFlowReports`); these run thousands in a few milliseconds, so each gets a
    // full allowance, and the figure is that of a report that goes out.
    let mut allowances = dp.allowances()?;

    // A million other flows, so lookups walk a full table.
    let started = Instant::now();
    let table = dp.flow_table();
    for i in 0..plan.flows {
        let key = FlowKey {
            src: [
                u32::from_ne_bytes([172, 16, (i >> 16) as u8, (i >> 8) as u8]),
                0,
                0,
                0,
            ],
            dst: addr_words(nets[0].vip).0,
            sport: (i as u16).to_be(),
            dport: 8000u16.to_be(),
            proto: IPPROTO_TCP,
            family: FAMILY_V4,
            _pad: [0; 2],
        };
        let entry = FlowEntry {
            nat_addr: addr_words(nets[0].backend).0,
            nat_port: 8000u16.to_be(),
            backend_id: 1,
            idle_timeout_s: 600,
            ..Default::default()
        };
        table
            .insert(key, entry, 0)
            .context("filling the flow table")?;
    }
    eprintln!(
        "filled {} flows in {:.1} s",
        plan.flows,
        started.elapsed().as_secs_f64()
    );

    let mut pass_obj = aya::Ebpf::load(objects::PASS)?;
    let pass: &mut Xdp = pass_obj
        .program_mut("xdp_pass")
        .context("pass program")?
        .try_into()?;
    pass.load()?;

    let mut rows = Vec::new();
    let mut repeated = Vec::new();
    let mut figures = BTreeMap::new();
    let mut summary = Vec::new();
    let mut stalled = Vec::new();
    for n in &nets {
        let fam = if n.client.is_ipv4() { "IPv4" } else { "IPv6" };
        // Distinct flows: client address and port vary, one run per packet.
        let client = |i: u32, salt: u32| match n.client {
            IpAddr::V4(_) => ip(&format!(
                "10.{}.{}.{}",
                20 + salt,
                (i >> 8) & 0xff,
                i & 0xff
            )),
            IpAddr::V6(_) => ip(&format!("fd00:{}::{:x}", 20 + salt, i)),
        };
        let mut sums = [0.0f64; 18];
        let mut runs = [0u32; 18];
        let mut stalls = 0u32;
        let hint = HintRange::DEFAULT;
        let flow = |i: u32| (client(i, 0), 40000 + (i % 20000) as u16);
        // In chunks of flows, each packet kind in a pass over the chunk: a flow's entry has
        // left the CPU's nearer caches since its previous packet, as it would among many busy
        // flows, while its cached next hop (good for about a second) is still fresh, as it is
        // for a stream whose packets are milliseconds apart.
        // Figures, by their place in `sums`, and what each sends for flow `i`.
        const FLOOR: usize = 0;
        const NOT_OURS: usize = 1;
        const SYN: usize = 2;
        const ESTABLISHED: usize = 3;
        const REPLY: usize = 4;
        const HINTED: usize = 5;
        const FIRST_REPLY: usize = 6;
        // The flow's first packet after its SYN, of the established size: it marks the flow
        // acknowledged, with the next hop its SYN cached (good up to the egress MTU).
        const WARM_FORWARD: usize = 7;
        // The packet right after ESTABLISHED, as in a burst of segments: its entry is cached.
        const BURST: usize = 8;
        // A SYN to the shared VIP, and its first packet after it, which reports the flow in
        // `FLOW_EVENTS` as well. The ring is drained after every chunk, as the agent's sender
        // would, so that it never fills (a full ring would spare the copy).
        // Their clients are the hinted SYNs' (other addresses than the plain flows', so
        // that a reply finds its own flow), on ports outside the hint range. Before the
        // first packet, the first reply, as for the plain flow (not a figure: it finds the
        // plain VIP's flow missing first).
        const SHARED_SYN: usize = 9;
        const SHARED_FIRST: usize = 10;
        const SHARED_REPLY: usize = 11;
        // A SYN to the DSR VIP, its first packet after it (not a figure: as WARM_FORWARD)
        // and a later one. Their clients are others again.
        const DSR_SYN: usize = 12;
        const DSR_WARM: usize = 13;
        const DSR_ESTABLISHED: usize = 14;
        // The same for the tunnel VIP: the packet goes out inside an outer header.
        const TUNNEL_SYN: usize = 15;
        const TUNNEL_WARM: usize = 16;
        const TUNNEL_ESTABLISHED: usize = 17;
        let ours: &Xdp = dp.program();
        let floor_prog: &Xdp = pass;
        let packet = |figure: usize, i: u32| {
            let (c, sport) = flow(i);
            match figure {
                FLOOR => (floor_prog, g0, frame(c, n.vip, sport, 8000, true), XDP_PASS),
                NOT_OURS => (ours, g0, frame(c, n.other, sport, 80, false), XDP_PASS),
                SYN => (ours, g0, frame(c, n.vip, sport, 8000, true), XDP_REDIRECT),
                SHARED_SYN => (
                    ours,
                    g0,
                    frame(client(i, 1), n.vip_shared, sport, 8000, true),
                    XDP_REDIRECT,
                ),
                SHARED_REPLY => (
                    ours,
                    g1,
                    frame(n.backend, client(i, 1), 8000, sport, false),
                    XDP_REDIRECT,
                ),
                ESTABLISHED | WARM_FORWARD | BURST => {
                    (ours, g0, frame(c, n.vip, sport, 8000, false), XDP_REDIRECT)
                }
                SHARED_FIRST => (
                    ours,
                    g0,
                    frame(client(i, 1), n.vip_shared, sport, 8000, false),
                    XDP_REDIRECT,
                ),
                DSR_SYN => (
                    ours,
                    g0,
                    frame(client(i, 2), n.vip_dsr, sport, 8000, true),
                    XDP_REDIRECT,
                ),
                DSR_WARM | DSR_ESTABLISHED => (
                    ours,
                    g0,
                    frame(client(i, 2), n.vip_dsr, sport, 8000, false),
                    XDP_REDIRECT,
                ),
                TUNNEL_SYN => (
                    ours,
                    g0,
                    frame(client(i, 3), n.vip_tunnel, sport, 8000, true),
                    XDP_REDIRECT,
                ),
                TUNNEL_WARM | TUNNEL_ESTABLISHED => (
                    ours,
                    g0,
                    frame(client(i, 3), n.vip_tunnel, sport, 8000, false),
                    XDP_REDIRECT,
                ),
                HINTED => {
                    let hport = hint.start + (i % u32::from(hint.span)) as u16;
                    let f = frame(client(i, 1), n.vip, hport, 8000, true);
                    (ours, g0, f, XDP_REDIRECT)
                }
                // REPLY, FIRST_REPLY: the first reply of a flow looks its next hop up.
                _ => (
                    ours,
                    g1,
                    frame(n.backend, c, 8000, sport, false),
                    XDP_REDIRECT,
                ),
            }
        };
        // Over a chunk of flows, pass after pass: the flows' first packets, then each way.
        // One kind of SYN per pass: the LRU refills a CPU's list of free entries every 128
        // inserts (several microseconds), and kinds interleaved flow by flow would leave
        // that cost to whichever kind comes first when their number divides 128.
        let passes: [&[usize]; 9] = [
            &[FLOOR, NOT_OURS],
            &[SYN],
            &[HINTED],
            &[SHARED_SYN],
            &[DSR_SYN],
            &[TUNNEL_SYN],
            &[
                FIRST_REPLY,
                WARM_FORWARD,
                SHARED_REPLY,
                SHARED_FIRST,
                DSR_WARM,
                TUNNEL_WARM,
            ],
            &[ESTABLISHED, BURST, DSR_ESTABLISHED, TUNNEL_ESTABLISHED],
            &[REPLY],
        ];
        let chunk = plan.packets.min(CHUNK);
        let mut start = 0;
        while start < plan.packets {
            let flows = start..(start + chunk).min(plan.packets);
            for kinds in passes {
                for i in flows.clone() {
                    for &figure in kinds {
                        let (prog, ingress, bytes, want) = packet(figure, i);
                        if figure == SHARED_FIRST {
                            allowances.refill()?;
                        }
                        let ns = run(prog, ingress, &bytes, 1, want)?;
                        if ns > STALL_NS {
                            stalls += 1;
                        } else {
                            sums[figure] += ns;
                            runs[figure] += 1;
                        }
                    }
                }
            }
            let mut reported = 0;
            while ring.next().is_some() {
                reported += 1;
            }
            ensure!(
                reported == flows.len(),
                "{fam}: {reported} shared flows reported for {} handshakes",
                flows.len()
            );
            start = flows.end;
        }
        ensure!(
            runs.iter().all(|&r| r > 0),
            "{fam}: every run of some path stalled past {STALL_NS} ns"
        );
        let [floor, not_ours, maglev, established, reply, hinted, first_reply, first, burst, shared_syn, shared_first, _, dsr_syn, _, dsr_established, tunnel_syn, _, tunnel_established] =
            std::array::from_fn(|f| sums[f] / f64::from(runs[f]));
        stalled.push(format!("{fam} {stalls}"));
        figures.insert(
            format!("{}.stalled_runs", fam.to_ascii_lowercase()),
            Some(f64::from(stalls)),
        );
        let goal = |ratio: f64, max: f64| {
            format!("<= {max}x: {}", if ratio <= max { "met" } else { "MISSED" })
        };
        let key = fam.to_ascii_lowercase();
        let mut row = |id: &str, path: &str, ns: f64, goal: String| {
            rows.push(format!(
                "| {fam} | {path} | {ns:.1} | {:.2} | {goal} |",
                ns / floor
            ));
            figures.insert(format!("{key}.{id}.ns"), Some(ns));
            figures.insert(format!("{key}.{id}.x_floor"), Some(ns / floor));
            if !goal.is_empty() {
                summary.push(format!(
                    "packet   {fam} {path:<34} {ns:>7.1} ns  {:>5.2}x floor  {goal}",
                    ns / floor
                ));
            }
        };
        row("floor", "XDP_PASS program (floor)", floor, String::new());
        row(
            "not_ours",
            "not ours (TCP to another address)",
            not_ours,
            String::new(),
        );
        row(
            "maglev_syn",
            "new SYN through Maglev",
            maglev,
            goal(maglev / floor, 6.0),
        );
        row(
            "hinted_syn",
            "new hinted SYN",
            hinted,
            goal(hinted / floor, 6.0),
        );
        row(
            "shared_syn",
            "new SYN through Maglev, flow shared (`[sync]`)",
            shared_syn,
            String::new(),
        );
        row(
            "first_forward",
            "first packet after the SYN",
            first,
            String::new(),
        );
        row(
            "shared_first_forward",
            "first packet after the SYN, flow shared (reported)",
            shared_first,
            String::new(),
        );
        row(
            "established",
            "established flow, forward",
            established,
            goal(established / floor, 3.0),
        );
        row(
            "burst",
            "established, next packet of a burst",
            burst,
            String::new(),
        );
        row(
            "dsr_syn",
            "new SYN through Maglev, direct server return",
            dsr_syn,
            String::new(),
        );
        row(
            "dsr_established",
            "established flow, forward, direct server return",
            dsr_established,
            String::new(),
        );
        row(
            "tunnel_syn",
            "new SYN through Maglev, through a tunnel",
            tunnel_syn,
            String::new(),
        );
        row(
            "tunnel_established",
            "established flow, forward, through a tunnel",
            tunnel_established,
            String::new(),
        );
        row(
            "reply",
            "reply, reverse translation",
            reply,
            goal(reply / floor, 3.0),
        );
        row(
            "first_reply",
            "first reply (next hop looked up)",
            first_reply,
            String::new(),
        );

        // The same two unmodified packets, each run `repeat` times in one call.
        let c = client(0, 0);
        let floor_n = run(
            pass,
            g0,
            &frame(c, n.vip, 40000, 8000, true),
            plan.repeat,
            XDP_PASS,
        )?;
        let not_ours_n = run(
            dp.program(),
            g0,
            &frame(c, n.other, 40000, 80, false),
            plan.repeat,
            XDP_PASS,
        )?;
        repeated.push(format!(
            "| {fam} | XDP_PASS program (floor) | {floor_n:.1} | 1.00 |\n| {fam} | not ours (TCP to another address) | {not_ours_n:.1} | {:.2} |",
            not_ours_n / floor_n
        ));
        figures.insert(format!("{key}.floor.repeat_ns"), Some(floor_n));
        figures.insert(format!("{key}.not_ours.repeat_ns"), Some(not_ours_n));
    }
    let mut out = format!(
        "Packet cost under BPF_PROG_TEST_RUN: {} other flows in the table; each figure is the mean of {} runs of one packet each (distinct flows), as the kernel timed them, less the runs it timed at over {} us: an interrupt or a reschedule inside the timed region (the test run only keeps it from migrating), where no path takes a tenth of that (runs left out: {}). The packets go in passes over chunks of {CHUNK} flows (first packets; first replies and a first client packet of the established size; then one more packet each way), so that a flow's entry has left the nearer CPU caches since its previous packet while the next hop its previous packet in that direction cached is still fresh, as in a stream. The goal is checked on that packet; \"next packet of a burst\" is the same flow's packet right after it, its entry still in cache, as for the segments after the first of a TSO burst. A new flow's SYN finds the next hop to its backend that the SYN before it found (see `HOPS` in docs/architecture.md); a first reply looks its next hop up. A shared flow's first packet finds its CPU's allowance of reports refilled (`Limit::NewFlowReports`: 1000 a second after a burst of 1000, far less than these rates), so that its report goes out.\n\n",
        plan.flows,
        plan.packets,
        STALL_NS / 1000.0,
        stalled.join(", ")
    );
    out += "| family | path | ns/packet | x floor | goal |\n|---|---|---:|---:|---|\n";
    for r in rows {
        out += &r;
        out.push('\n');
    }
    out += &format!(
        "\nFor comparison, with `repeat` = {} (one packet run again and again in one call, the \
         timer overhead spread over the repetitions): only for the two paths that leave the \
         packet unchanged, since a rewritten packet would not take the same path twice. Not \
         comparable with the table above.\n\n| family | path, repeat = {} | ns/packet | x floor |\n|---|---|---:|---:|\n",
        plan.repeat, plan.repeat
    );
    for r in repeated {
        out += &r;
        out.push('\n');
    }
    out.push('\n');
    Ok(Measured {
        markdown: out,
        figures,
        summary,
    })
}
