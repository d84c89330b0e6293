//! The backend's half of `forwarding = "tunnel"` (`balancer-agent decap`): the `decap`
//! program on the backend's interfaces takes the outer header off what the gateways tunnel
//! to it, for a backend whose kernel has no `ipip`/`ip6tnl` device (or that would rather
//! not send every packet through one). It runs for as long as the command does.

use std::net::IpAddr;

use anyhow::{bail, Context as _, Result};
use aya::{
    maps::{HashMap as BpfHashMap, PerCpuArray},
    programs::{Xdp, XdpMode as Attach},
    Ebpf,
};
use balancer_common::{addr_words, DecapCounter, TunnelPeer, MAX_TUNNEL_PEERS};
use tokio::signal::unix::{signal, SignalKind};
use tracing::{info, warn};

use crate::{
    config::{unroutable, XdpMode},
    objects,
};

/// The loaded program, its peers written, attached where `attach` was asked.
pub struct Decap {
    ebpf: Ebpf,
}

impl Decap {
    /// Loads the program and lets it take tunnelled packets from `gateways` (each a pool's
    /// `tunnel_source`) and from no one else.
    pub fn load(gateways: &[IpAddr]) -> Result<Self> {
        if gateways.is_empty() || gateways.len() > MAX_TUNNEL_PEERS as usize {
            bail!("name 1 to {MAX_TUNNEL_PEERS} gateways");
        }
        for a in gateways {
            if let Some(problem) = unroutable(*a) {
                bail!("{a} cannot be a gateway's address: {problem}");
            }
        }
        let mut ebpf = Ebpf::load(objects::DECAP).context("loading the decap object")?;
        let mut peers: BpfHashMap<_, TunnelPeer, u8> = BpfHashMap::try_from(
            ebpf.map_mut("DECAP_PEERS")
                .context("the object has no map DECAP_PEERS")?,
        )?;
        for gateway in gateways {
            let (addr, family) = addr_words(*gateway);
            let peer = TunnelPeer {
                addr,
                family,
                _pad: [0; 3],
            };
            peers.insert(peer, 1, 0).context("writing DECAP_PEERS")?;
        }
        let mut decap = Decap { ebpf };
        decap
            .program()?
            .load()
            .context("the kernel refused the decap program")?;
        Ok(decap)
    }

    /// Attaches to `interface` as `mode` says (`auto`: native, else generic with a warning).
    pub fn attach(&mut self, interface: &str, mode: XdpMode) -> Result<()> {
        let prog = self.program()?;
        let generic = match mode {
            XdpMode::Native => prog.attach(interface, Attach::Driver).map(|_| false),
            XdpMode::Generic => prog.attach(interface, Attach::Skb).map(|_| true),
            XdpMode::Auto => prog
                .attach(interface, Attach::Driver)
                .map(|_| false)
                .or_else(|native| {
                    warn!(%interface, "no native XDP ({native}): attaching in generic mode");
                    prog.attach(interface, Attach::Skb).map(|_| true)
                }),
        }
        .with_context(|| format!("attaching the decap program to {interface}"))?;
        info!(%interface, mode = if generic { "generic" } else { "native" }, "decapsulating");
        Ok(())
    }

    /// The program, for tests that run it on crafted frames.
    pub fn program(&mut self) -> Result<&mut Xdp> {
        Ok(self
            .ebpf
            .program_mut("decap")
            .context("the object has no program `decap`")?
            .try_into()?)
    }

    /// Every counter, summed over the CPUs.
    pub fn counters(&self) -> Result<Vec<(DecapCounter, u64)>> {
        let map: PerCpuArray<_, u64> = PerCpuArray::try_from(
            self.ebpf
                .map("DECAP_COUNTERS")
                .context("the object has no map DECAP_COUNTERS")?,
        )?;
        DecapCounter::ALL
            .iter()
            .map(|c| {
                let per_cpu = map.get(&(*c as u32), 0).context("reading DECAP_COUNTERS")?;
                Ok((*c, per_cpu.iter().sum()))
            })
            .collect()
    }
}

/// `decap`: attaches to every interface, then prints the counters at each SIGUSR1, and at
/// SIGINT or SIGTERM detaches (by dropping the program) and prints them a last time.
pub async fn run(interfaces: &[String], gateways: &[IpAddr], mode: XdpMode) -> Result<()> {
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut usr1 = signal(SignalKind::user_defined1()).context("installing the SIGUSR1 handler")?;
    let mut decap = Decap::load(gateways)?;
    for interface in interfaces {
        decap.attach(interface, mode)?;
    }
    loop {
        tokio::select! {
            _ = int.recv() => break,
            _ = term.recv() => break,
            _ = usr1.recv() => println!("{}\n", render(&decap.counters()?)),
        }
    }
    let counters = decap.counters()?;
    drop(decap);
    println!("{}", render(&counters));
    Ok(())
}

/// One `name value` line per counter.
pub fn render(counters: &[(DecapCounter, u64)]) -> String {
    counters
        .iter()
        .map(|(c, n)| format!("{} {n}", c.name()))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateways_are_named_and_routable() {
        let refused = |gateways: &[&str]| {
            let gateways: Vec<IpAddr> = gateways.iter().map(|g| g.parse().unwrap()).collect();
            match Decap::load(&gateways) {
                Ok(_) => panic!("{gateways:?} accepted"),
                Err(e) => e.to_string(),
            }
        };
        assert!(refused(&[]).contains("name 1 to 64 gateways"));
        let many: Vec<String> = (0..65).map(|i| format!("10.4.1.{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(refused(&many).contains("name 1 to 64 gateways"));
        for bad in ["0.0.0.0", "127.0.0.1", "ff02::1", "::", "::ffff:10.4.0.1"] {
            let said = refused(&["10.4.0.1", bad]);
            assert!(
                said.contains(&format!("{bad} cannot be a gateway's address")),
                "{said}"
            );
        }
    }

    #[test]
    fn counters_are_printed_one_per_line() {
        let text = render(&[
            (DecapCounter::Packets, 3),
            (DecapCounter::Decapsulated, 2),
            (DecapCounter::PassNotPeer, 1),
        ]);
        assert_eq!(text, "packets 3\ndecapsulated 2\npass_not_peer 1");
    }
}
