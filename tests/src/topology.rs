//! The gateway scenario: a client, a gateway that will run the balancer, and four backends
//! behind a switch, each in a namespace of its own.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use tempfile::TempDir;

use crate::client;
use crate::netns::{sweep_stale, temp_dir, Netns};

pub const VIP4: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 60);
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x60);
/// The port clients connect to on the VIPs.
pub const VIP_PORT: u16 = 8000;
/// The backends' HTTP port.
pub const BACKEND_PORT: u16 = 8000;
/// The backends' metrics port, as the agent's config names it (nothing listens there yet).
pub const METRICS_PORT: u16 = 8001;
pub const BACKENDS: usize = 4;
/// The gateway's interfaces, where the balancer attaches.
pub const GATEWAY_INTERFACES: [&str; 2] = ["g0", "g1"];
/// The second gateway's ([`Topology::add_second_gateway`]).
pub const SECOND_GATEWAY_INTERFACES: [&str; 2] = ["h0", "h1"];
/// The gateways' addresses on the servers' network, where they reach each other.
pub const GATEWAY_SERVER_SIDE: [Ipv4Addr; 2] =
    [Ipv4Addr::new(10, 4, 0, 1), Ipv4Addr::new(10, 4, 0, 2)];

const READY_TIMEOUT: Duration = Duration::from_secs(10);
const PING_ATTEMPTS: usize = 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn vip(self) -> SocketAddr {
        match self {
            Family::V4 => SocketAddr::new(VIP4.into(), VIP_PORT),
            Family::V6 => SocketAddr::new(VIP6.into(), VIP_PORT),
        }
    }

    /// Address of backend `index` (0-based): `b1` is 10.4.0.11 and fd00:4::11.
    pub fn backend(self, index: usize) -> IpAddr {
        let n = u8::try_from(index + 1).expect("a handful of backends");
        // "1N" in both: decimal in the IPv4 address, hex in the IPv6 one.
        match self {
            Family::V4 => Ipv4Addr::new(10, 4, 0, 10 + n).into(),
            Family::V6 => Ipv6Addr::new(0xfd00, 4, 0, 0, 0, 0, 0, 0x10 + u16::from(n)).into(),
        }
    }
}

/// Name of backend `index` (0-based): its namespace role and the identity its server reports.
pub fn backend_name(index: usize) -> String {
    format!("b{}", index + 1)
}

/// The switch's end of backend `index`'s veth.
fn switch_port(index: usize) -> String {
    format!("s{}", backend_name(index))
}

/// The namespaces of the gateway scenario, with a server running in every backend:
///
/// ```text
///  client              gw                                sw                    b1..b4
/// +------------+      +------------------------------+  +------------------+  +---------------+
/// | c0         |------| g0                        g1 |--| s0    br0    sbN |--| eth0          |
/// | 10.9.0.2   |      | 10.9.0.1            10.4.0.1 |  |  (bridge of s0,  |  | 10.4.0.1N     |
/// | fd00:9::2  |      | fd00:9::1          fd00:4::1 |  |   sb1..sb4)      |  | fd00:4::1N    |
/// +------------+      +------------------------------+  +------------------+  | sse-server    |
///  VIPs 192.0.2.60,    forwarding on, rp_filter off;                          |   :8000       |
///  2001:db8::60        the agent attaches to g0, g1                           +---------------+
///  routed via gw                                          backends route 10.9.0.0/24 and
///                                                         fd00:9::/64 via the gateway
/// ```
///
/// Nothing routes out of these namespaces. Every veth end has tx checksum offload off: XDP
/// on veth would otherwise see CHECKSUM_PARTIAL packets and the balancer's incremental
/// checksum updates would come out wrong. The backends run `sse-server`
/// ([`Topology::build`]) or what the caller starts there ([`Topology::build_bare`]).
/// Dropping the topology stops its processes and deletes the namespaces, and prints the
/// logs in its directory if the thread is panicking.
pub struct Topology {
    client: Netns,
    gw: Netns,
    gw2: Option<Netns>,
    far: Option<Netns>,
    /// The router and the server of [`Topology::add_far_server`].
    far_server: Vec<Netns>,
    sw: Netns,
    backends: Vec<Netns>,
    dir: TempDir,
}

impl Topology {
    /// Builds the namespaces and links, checks that the neighbours can reach each other, and
    /// starts `sse_server` in every backend.
    pub fn build(sse_server: &Path) -> Result<Self> {
        let mut topology = Self::build_bare()?;
        topology.start_backends(sse_server)?;
        Ok(topology)
    }

    /// Like [`Topology::build`], but starts no server in the backends: the caller runs its
    /// own there (with [`Netns::command`] on [`Topology::backend`]), as processes that it
    /// owns and may stop and restart.
    pub fn build_bare() -> Result<Self> {
        crate::require_root()?;
        sweep_stale()?;
        let topology = Self {
            client: Netns::create("client")?,
            gw: Netns::create("gw")?,
            gw2: None,
            far: None,
            far_server: Vec::new(),
            sw: Netns::create("sw")?,
            backends: (0..BACKENDS)
                .map(|i| Netns::create(&backend_name(i)))
                .collect::<Result<_>>()?,
            dir: temp_dir()?,
        };
        topology.wire().context("wiring the topology")?;
        topology
            .check_reachability()
            .context("checking the topology")?;
        Ok(topology)
    }

    fn wire(&self) -> Result<()> {
        let Self { client, gw, sw, .. } = self;
        let mut veths = vec![(client, "c0", gw, "g0"), (gw, "g1", sw, "s0")];
        let ports: Vec<String> = (0..BACKENDS).map(switch_port).collect();
        veths.extend(
            ports
                .iter()
                .zip(&self.backends)
                .map(|(port, backend)| (sw, port.as_str(), backend, "eth0")),
        );
        ip(sw, "link add br0 type bridge mcast_snooping 0")?;
        for &(ns, dev, peer_ns, peer) in &veths {
            veth(ns, dev, peer_ns, peer)?;
        }
        for port in ["s0"].into_iter().chain(ports.iter().map(String::as_str)) {
            ip(sw, &format!("link set {port} master br0"))?;
        }
        ip(sw, "link set br0 up")?;
        forwarding(gw, GATEWAY_INTERFACES)?;

        add_addresses(client, "c0", "10.9.0.2/24", "fd00:9::2/64")?;
        add_addresses(gw, "g0", "10.9.0.1/24", "fd00:9::1/64")?;
        add_addresses(gw, "g1", "10.4.0.1/24", "fd00:4::1/64")?;
        ip(client, &format!("route add {VIP4}/32 via 10.9.0.1"))?;
        ip(client, &format!("-6 route add {VIP6}/128 via fd00:9::1"))?;
        for (i, backend) in self.backends.iter().enumerate() {
            add_addresses(
                backend,
                "eth0",
                &format!("{}/24", Family::V4.backend(i)),
                &format!("{}/64", Family::V6.backend(i)),
            )?;
            ip(backend, "route add 10.9.0.0/24 via 10.4.0.1")?;
            ip(backend, "-6 route add fd00:9::/64 via fd00:4::1")?;
        }
        Ok(())
    }

    /// Every namespace pings its side of the gateway; veth carrier and the bridge take a
    /// moment to come up.
    fn check_reachability(&self) -> Result<()> {
        let mut checks = vec![(&self.client, "10.9.0.1"), (&self.client, "fd00:9::1")];
        for backend in &self.backends {
            checks.push((backend, "10.4.0.1"));
            checks.push((backend, "fd00:4::1"));
        }
        for (ns, address) in checks {
            ping(ns, address)?;
        }
        Ok(())
    }

    fn start_backends(&mut self, sse_server: &Path) -> Result<()> {
        for (i, backend) in self.backends.iter_mut().enumerate() {
            let name = backend_name(i);
            let mut cmd = backend.command(sse_server);
            for family in [Family::V4, Family::V6] {
                cmd.arg("--listen")
                    .arg(SocketAddr::new(family.backend(i), BACKEND_PORT).to_string());
            }
            cmd.args(["--name", &name]);
            let log = self.dir.path().join(format!("{name}-sse-server.log"));
            backend
                .spawn("sse-server", cmd, &log)?
                .wait_for_line(0, READY_TIMEOUT, |line| line.contains("listening on"))?;
            for family in [Family::V4, Family::V6] {
                let server = SocketAddr::new(family.backend(i), BACKEND_PORT);
                let reply = backend
                    .enter(|| retry(|| client::get(server, 0)))
                    .with_context(|| format!("{name}'s server does not answer on {server}"))?;
                ensure!(
                    reply.backend == name,
                    "{server} answered as {:?}, not {name}",
                    reply.backend
                );
            }
        }
        Ok(())
    }

    /// A second gateway, `gw2`, as a peer of the first behind ECMP would be: its own link
    /// to the client (`c1`, 10.8.0.2 / fd00:8::2, to `h0`, 10.8.0.1 / fd00:8::1) and a port
    /// on the servers' switch (`h1`, 10.4.0.2 / fd00:4::2 on `s1`), routing the client's
    /// network back through `c1`. Traffic keeps going through the first gateway until
    /// [`Topology::fail_over`]. Call it before [`Topology::attach_xdp_pass`].
    pub fn add_second_gateway(&mut self) -> Result<()> {
        let gw2 = Netns::create("gw2")?;
        for key in ["all", "default"] {
            // The client answers from 10.9.0.2 on the link where 10.8.0.2 lives.
            self.client
                .sysctl(&format!("net.ipv4.conf.{key}.rp_filter"), "0")?;
        }
        veth(&self.client, "c1", &gw2, "h0")?;
        veth(&gw2, "h1", &self.sw, "s1")?;
        ip(&self.sw, "link set s1 master br0")?;
        forwarding(&gw2, SECOND_GATEWAY_INTERFACES)?;
        add_addresses(&self.client, "c1", "10.8.0.2/24", "fd00:8::2/64")?;
        add_addresses(&gw2, "h0", "10.8.0.1/24", "fd00:8::1/64")?;
        add_addresses(&gw2, "h1", "10.4.0.2/24", "fd00:4::2/64")?;
        ip(&gw2, "route add 10.9.0.0/24 via 10.8.0.2")?;
        ip(&gw2, "-6 route add fd00:9::/64 via fd00:8::2")?;
        for (ns, address) in [(&self.client, "10.8.0.1"), (&gw2, "10.4.0.1")] {
            ping(ns, address)?;
        }
        self.gw2 = Some(gw2);
        Ok(())
    }

    /// A client one router further away, `far` (f0: 10.7.0.2 / fd00:7::2), whose router is
    /// the client namespace (c5: 10.7.0.1 / fd00:7::1): the router's end of their link has
    /// MTU `mtu`, the far client's 1500. A hop narrower than both ends on the clients' side
    /// of the gateway: the servers' full-size answers are too big for it, and the router
    /// says so in an ICMP error to their source, the VIP. Only the VIPs are routed from
    /// `far`, through the router and the gateway.
    pub fn add_far_client(&mut self, mtu: u32) -> Result<()> {
        let far = Netns::create("far")?;
        veth(&self.client, "c5", &far, "f0")?;
        ip(&self.client, &format!("link set c5 mtu {mtu}"))?;
        forwarding(&self.client, ["c0", "c5"])?;
        add_addresses(&self.client, "c5", "10.7.0.1/24", "fd00:7::1/64")?;
        add_addresses(&far, "f0", "10.7.0.2/24", "fd00:7::2/64")?;
        ip(&far, &format!("route add {VIP4}/32 via 10.7.0.1"))?;
        ip(&far, &format!("-6 route add {VIP6}/128 via fd00:7::1"))?;
        ip(&self.gw, "route add 10.7.0.0/24 via 10.9.0.2")?;
        ip(&self.gw, "-6 route add fd00:7::/64 via fd00:9::2")?;
        for backend in &self.backends {
            ip(backend, "route add 10.7.0.0/24 via 10.4.0.1")?;
            ip(backend, "-6 route add fd00:7::/64 via fd00:4::1")?;
        }
        for address in ["10.7.0.1", "fd00:7::1"] {
            ping(&far, address)?;
        }
        self.far = Some(far);
        Ok(())
    }

    /// A server one router beyond the switch, `fs` (e0: 10.6.0.2 / fd00:6::2, running
    /// `sse_server` on port 8000 as `far`), whose router `rt` (r0 on the switch: 10.4.0.50 /
    /// fd00:4::50; r1: 10.6.0.1 / fd00:6::1) has MTU `mtu` on their link, the server 1500: a
    /// hop narrower than both ends on the servers' side of the gateway. The clients' full-size
    /// segments are too big for it, and the router says so in an ICMP error to their source,
    /// the client, through the gateway. The gateway routes 10.6.0.0/24 and fd00:6::/64
    /// through the router; the server answers the clients through it and the gateway.
    pub fn add_far_server(&mut self, mtu: u32, sse_server: &Path) -> Result<()> {
        let rt = Netns::create("rt")?;
        let mut fs = Netns::create("fs")?;
        veth(&rt, "r0", &self.sw, "sr")?;
        ip(&self.sw, "link set sr master br0")?;
        veth(&rt, "r1", &fs, "e0")?;
        ip(&rt, &format!("link set r1 mtu {mtu}"))?;
        forwarding(&rt, ["r0", "r1"])?;
        add_addresses(&rt, "r0", "10.4.0.50/24", "fd00:4::50/64")?;
        add_addresses(&rt, "r1", "10.6.0.1/24", "fd00:6::1/64")?;
        add_addresses(&fs, "e0", "10.6.0.2/24", "fd00:6::2/64")?;
        ip(&rt, "route add 10.9.0.0/24 via 10.4.0.1")?;
        ip(&rt, "-6 route add fd00:9::/64 via fd00:4::1")?;
        ip(&fs, "route add 10.9.0.0/24 via 10.6.0.1")?;
        ip(&fs, "-6 route add fd00:9::/64 via fd00:6::1")?;
        ip(&self.gw, "route add 10.6.0.0/24 via 10.4.0.50")?;
        ip(&self.gw, "-6 route add fd00:6::/64 via fd00:4::50")?;
        for (ns, address) in [
            (&rt, "10.4.0.1"),
            (&rt, "fd00:4::1"),
            (&fs, "10.6.0.1"),
            (&fs, "fd00:6::1"),
        ] {
            ping(ns, address)?;
        }
        let mut cmd = fs.command(sse_server);
        cmd.args([
            "--listen",
            "10.6.0.2:8000",
            "--listen",
            "[fd00:6::2]:8000",
            "--name",
            "far",
        ]);
        let log = self.dir.path().join("far-sse-server.log");
        fs.spawn("sse-server", cmd, &log)?
            .wait_for_line(0, READY_TIMEOUT, |line| line.contains("listening on"))?;
        self.far_server = vec![rt, fs];
        Ok(())
    }

    /// Tunnel forwarding (`forwarding = "tunnel"`) to the server of
    /// [`Topology::add_far_server`], `fs`: it holds both VIPs on its loopback and serves them
    /// too (a second `sse_server`, also `far`); its `decap` is the caller's to run
    /// ([`Topology::far_server`]). After [`Topology::direct_return`], the router sends the
    /// answers, from the VIPs, to the client over the client's own link to the switch rather
    /// than through the gateway.
    pub fn tunnel_to_far_server(&mut self, sse_server: &Path, direct: bool) -> Result<()> {
        let dir = self.dir.path().to_owned();
        let [rt, fs] = &mut self.far_server[..] else {
            anyhow::bail!("no far server: add_far_server first");
        };
        ip(fs, &format!("addr add {VIP4}/32 dev lo"))?;
        ip(fs, &format!("-6 addr add {VIP6}/128 dev lo"))?;
        if direct {
            ip(rt, "route replace 10.9.0.0/24 via 10.4.0.9")?;
            ip(rt, "-6 route replace fd00:9::/64 via fd00:4::9")?;
        }
        let mut cmd = fs.command(sse_server);
        cmd.args([
            "--listen",
            &SocketAddr::new(VIP4.into(), 8000).to_string(),
            "--listen",
            &SocketAddr::new(VIP6.into(), 8000).to_string(),
            "--name",
            "far",
        ]);
        let log = dir.join("far-vip-sse-server.log");
        fs.spawn("sse-server", cmd, &log)?
            .wait_for_line(0, READY_TIMEOUT, |line| line.contains("listening on"))?;
        Ok(())
    }

    /// The far server's namespace ([`Topology::add_far_server`]).
    pub fn far_server(&self) -> Result<&Netns> {
        self.far_server
            .get(1)
            .context("the topology has no far server")
    }

    /// The client one router further away ([`Topology::add_far_client`]).
    pub fn far_client(&self) -> Result<&Netns> {
        self.far.as_ref().context("the topology has no far client")
    }

    /// Direct server return (`forwarding = "dsr"`): every backend holds both VIPs on its
    /// loopback, answering no ARP for them, and the client gets a link of its own to the
    /// switch (`c2`, 10.4.0.9 / fd00:4::9, to `s2`), over which [`Topology::route_answers`]
    /// can send the backends' answers so that they do not pass the gateway. Call it before
    /// starting the servers, which must listen on the VIPs as well.
    pub fn direct_return(&self) -> Result<()> {
        veth(&self.client, "c2", &self.sw, "s2")?;
        ip(&self.sw, "link set s2 master br0")?;
        add_addresses(&self.client, "c2", "10.4.0.9/24", "fd00:4::9/64")?;
        // The answers arrive on c2, the VIPs are routed through c0.
        for key in ["all", "default", "c0", "c2"] {
            self.client
                .sysctl(&format!("net.ipv4.conf.{key}.rp_filter"), "0")?;
        }
        for backend in &self.backends {
            ip(backend, &format!("addr add {VIP4}/32 dev lo"))?;
            ip(backend, &format!("-6 addr add {VIP6}/128 dev lo"))?;
            backend.sysctl("net.ipv4.conf.all.arp_ignore", "1")?;
            backend.sysctl("net.ipv4.conf.all.arp_announce", "2")?;
        }
        ping(&self.client, "10.4.0.11")?;
        ping(&self.client, "fd00:4::11")
    }

    /// A link `dev` of the gateway to the servers' switch, without addresses of its own and
    /// without any XDP program on either end: the agent does not list it.
    pub fn unattached_gateway_link(&self, dev: &str) -> Result<()> {
        let port = format!("s{dev}");
        veth(&self.gw, dev, &self.sw, &port)?;
        ip(&self.sw, &format!("link set {port} master br0"))?;
        Ok(())
    }

    /// The backends' route to the client's network: over the client's own link to the switch
    /// (`direct`, after [`Topology::direct_return`]), or through the gateway, as built.
    pub fn route_answers(&self, direct: bool) -> Result<()> {
        let (v4, v6) = if direct {
            ("10.4.0.9", "fd00:4::9")
        } else {
            ("10.4.0.1", "fd00:4::1")
        };
        for backend in &self.backends {
            ip(backend, &format!("route replace 10.9.0.0/24 via {v4}"))?;
            ip(backend, &format!("-6 route replace fd00:9::/64 via {v6}"))?;
        }
        Ok(())
    }

    /// The first gateway fails: the client's routes to the VIPs and the servers' routes to
    /// the client move to the second gateway (as ECMP would once the first is gone), and the
    /// first one's links go down.
    pub fn fail_over(&self) -> Result<()> {
        ensure!(self.gw2.is_some(), "no second gateway to fail over to");
        // From the client's address all the same: the servers route only that back.
        ip(
            &self.client,
            &format!("route replace {VIP4}/32 via 10.8.0.1 src 10.9.0.2"),
        )?;
        ip(
            &self.client,
            &format!("-6 route replace {VIP6}/128 via fd00:8::1 src fd00:9::2"),
        )?;
        for backend in &self.backends {
            ip(backend, "route replace 10.9.0.0/24 via 10.4.0.2")?;
            ip(backend, "-6 route replace fd00:9::/64 via fd00:4::2")?;
        }
        for dev in GATEWAY_INTERFACES {
            ip(&self.gw, &format!("link set {dev} down"))?;
        }
        Ok(())
    }

    /// Attaches a pass program to the gateways' peers (`c0` in client, `s0` in sw; `c1` and
    /// `s1` with a second gateway), without which veth drops what the balancer sends them
    /// with XDP_TX or XDP_REDIRECT.
    pub fn attach_xdp_pass(&mut self, xdp_pass: &Path) -> Result<()> {
        let mut peers = vec![(true, "c0"), (false, "s0")];
        if self.gw2.is_some() {
            peers.extend([(true, "c1"), (false, "s1")]);
        }
        for (on_client, dev) in peers {
            let ns = if on_client {
                &mut self.client
            } else {
                &mut self.sw
            };
            let mut cmd = ns.command(xdp_pass);
            cmd.arg(dev);
            let log = self.dir.path().join(format!("{dev}-xdp-pass.log"));
            ns.spawn("xdp-pass", cmd, &log)?
                .wait_for_line(0, READY_TIMEOUT, |line| line.trim() == "attached")?;
        }
        Ok(())
    }

    pub fn client(&self) -> &Netns {
        &self.client
    }

    /// Sets the MTU of the link between the gateway and the switch (both ends), leaving the
    /// clients' and the backends' links as they are: a narrower hop in the middle of the
    /// path, which only path MTU discovery finds.
    pub fn set_gateway_switch_mtu(&self, mtu: u32) -> Result<()> {
        let mtu = mtu.to_string();
        self.gw.ip(&["link", "set", "g1", "mtu", &mtu])?;
        self.sw.ip(&["link", "set", "s0", "mtu", &mtu])?;
        Ok(())
    }

    /// Sets the MTU of every link on the path between the client and the backends, both
    /// ends (jumbo frames end to end), but not of the links [`Topology::direct_return`]
    /// adds.
    pub fn set_mtu(&self, mtu: u32) -> Result<()> {
        let mtu = mtu.to_string();
        let mut ends = vec![(&self.client, "c0".to_owned()), (&self.gw, "g0".to_owned())];
        ends.extend([(&self.gw, "g1".to_owned()), (&self.sw, "s0".to_owned())]);
        for (i, backend) in self.backends.iter().enumerate() {
            ends.extend([(&self.sw, switch_port(i)), (backend, "eth0".to_owned())]);
        }
        for (ns, dev) in ends {
            ns.ip(&["link", "set", &dev, "mtu", &mtu])?;
        }
        Ok(())
    }

    pub fn gw(&self) -> &Netns {
        &self.gw
    }

    /// The switch between the gateway and the backends.
    pub fn sw(&self) -> &Netns {
        &self.sw
    }

    /// The second gateway ([`Topology::add_second_gateway`]).
    pub fn gw2(&self) -> Result<&Netns> {
        self.gw2
            .as_ref()
            .context("the topology has no second gateway")
    }

    pub fn backend(&self, index: usize) -> &Netns {
        &self.backends[index]
    }

    /// Every namespace of the topology.
    pub fn namespaces(&self) -> impl Iterator<Item = &Netns> {
        [&self.client, &self.gw, &self.sw]
            .into_iter()
            .chain(&self.gw2)
            .chain(&self.far)
            .chain(&self.far_server)
            .chain(&self.backends)
    }

    /// A directory that lives as long as the topology, for logs and configuration files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The gateway interfaces that have an XDP program attached.
    pub fn gateway_xdp(&self) -> Result<Vec<String>> {
        let mut attached = Vec::new();
        for dev in GATEWAY_INTERFACES {
            let details = ip(&self.gw, &format!("-d link show dev {dev}"))?;
            if details.contains("xdp") {
                attached.push(format!("{dev}: {}", details.trim()));
            }
        }
        Ok(attached)
    }

    fn print_logs(&self) {
        let Ok(entries) = std::fs::read_dir(self.dir.path()) else {
            return;
        };
        let mut paths: Vec<_> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
        paths.sort();
        for path in paths {
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| format!("<{e}>"));
            eprintln!("===== {} =====\n{text}", path.display());
        }
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.print_logs();
        }
    }
}

/// `ip` in `ns` with whitespace-separated arguments, which all of ours are.
fn ip(ns: &Netns, args: &str) -> Result<String> {
    ns.ip(&args.split_whitespace().collect::<Vec<_>>())
}

/// `ns` routes between `interfaces`, both families, without reverse-path filtering.
fn forwarding(ns: &Netns, interfaces: [&str; 2]) -> Result<()> {
    for key in ["all", "default"].into_iter().chain(interfaces) {
        ns.sysctl(&format!("net.ipv4.conf.{key}.rp_filter"), "0")?;
    }
    ns.sysctl("net.ipv4.ip_forward", "1")?;
    ns.sysctl("net.ipv6.conf.all.forwarding", "1")
}

/// A veth pair, `dev` in `ns` and `peer` in `peer_ns`, both up, tx checksum offload off.
fn veth(ns: &Netns, dev: &str, peer_ns: &Netns, peer: &str) -> Result<()> {
    ip(
        ns,
        &format!(
            "link add {dev} type veth peer name {peer} netns {}",
            peer_ns.name()
        ),
    )?;
    for (ns, dev) in [(ns, dev), (peer_ns, peer)] {
        ns.exec("ethtool", &["-K", dev, "tx", "off"])
            .with_context(|| format!("turning tx checksum offload off on {dev}"))?;
        ip(ns, &format!("link set {dev} up"))?;
    }
    Ok(())
}

fn add_addresses(ns: &Netns, dev: &str, v4: &str, v6: &str) -> Result<()> {
    ip(ns, &format!("addr add {v4} dev {dev}"))?;
    // Without nodad the address stays tentative for a while and cannot be bound or used.
    ip(ns, &format!("-6 addr add {v6} dev {dev} nodad"))?;
    Ok(())
}

fn ping(ns: &Netns, address: &str) -> Result<()> {
    let mut last = None;
    for _ in 0..PING_ATTEMPTS {
        match ns.exec("ping", &["-c", "1", "-W", "1", address]) {
            Ok(_) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("at least one attempt")).with_context(|| {
        format!(
            "{} cannot reach {address} after {PING_ATTEMPTS} pings",
            ns.name()
        )
    })
}

/// Retries `f` every 100 ms for up to [`READY_TIMEOUT`].
fn retry<T>(mut f: impl FnMut() -> Result<T>) -> Result<T> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        match f() {
            Ok(value) => return Ok(value),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => sleep(Duration::from_millis(100)),
        }
    }
}
