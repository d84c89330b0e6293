//! The balancers the benchmarks compare ours with (issue 8), run in the gateway namespace
//! of a [`crate::topology::Topology`]: nftables DNAT with `numgen`, and HAProxy in TCP mode.
//! Each is a guard: dropping it removes its rules, or stops the process and removes the VIP
//! it added, also when a benchmark fails.

use std::net::SocketAddr;
use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::netns::Netns;
use crate::process::{Process, STOP_GRACE};

const TABLE: &str = "blbench";
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// nftables DNAT load balancing in `ns`: a prerouting NAT rule that rewrites `vip`'s
/// destination to one of `servers` chosen by `numgen` (`random` or `inc`), with conntrack
/// reversing the translation on the way back. The servers listen on the VIP's port.
pub struct Nft<'a> {
    ns: &'a Netns,
}

impl<'a> Nft<'a> {
    pub fn start(
        ns: &'a Netns,
        dir: &Path,
        vip: SocketAddr,
        servers: &[SocketAddr],
        numgen: &str,
    ) -> Result<Self> {
        let (SocketAddr::V4(vip), true) = (vip, servers.iter().all(|s| s.port() == vip.port()))
        else {
            bail!("the nftables rule is IPv4 and keeps the port");
        };
        let map: Vec<String> = servers
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{i} : {}", s.ip()))
            .collect();
        let rules = format!(
            "table ip {TABLE} {{\n  chain prerouting {{\n    type nat hook prerouting priority dstnat; policy accept;\n    ip daddr {} tcp dport {} dnat to numgen {numgen} mod {} map {{ {} }}\n  }}\n}}\n",
            vip.ip(),
            vip.port(),
            servers.len(),
            map.join(", ")
        );
        let path = dir.join("nft-rules.nft");
        std::fs::write(&path, &rules)?;
        let path = path.to_str().context("a UTF-8 temporary path")?;
        ns.exec("nft", &["-f", path])
            .with_context(|| format!("loading nftables rules:\n{rules}"))?;
        Ok(Self { ns })
    }
}

impl Drop for Nft<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.ns.exec("nft", &["delete", "table", "ip", TABLE]) {
            eprintln!("removing the nftables table: {e:#}");
        }
    }
}

/// HAProxy in TCP mode in `ns` (the Debian package's binary), listening on `vip`, which it
/// makes a local address of the namespace (on `lo`) for as long as it runs.
pub struct Haproxy<'a> {
    ns: &'a Netns,
    process: Option<Process>,
    vip: SocketAddr,
}

impl<'a> Haproxy<'a> {
    /// `balance` is HAProxy's algorithm (`roundrobin`, `leastconn`); `timeout` bounds idle
    /// client and server sides.
    pub fn start(
        ns: &'a Netns,
        dir: &Path,
        vip: SocketAddr,
        servers: &[SocketAddr],
        balance: &str,
        timeout: Duration,
    ) -> Result<Self> {
        let prefix = if vip.is_ipv4() { 32 } else { 128 };
        ns.ip(&[
            "addr",
            "add",
            &format!("{}/{prefix}", vip.ip()),
            "dev",
            "lo",
        ])?;
        // From here on, drop removes the address whatever happens next.
        let mut guard = Self {
            ns,
            process: None,
            vip,
        };
        let t = timeout.as_millis();
        let mut config = format!(
            "global\n    log stderr format short local0 notice\n\ndefaults\n    mode tcp\n    timeout connect 5s\n    \
             timeout client {t}ms\n    timeout server {t}ms\n\nfrontend vip\n    bind {vip}\n    \
             default_backend pool\n\nbackend pool\n    balance {balance}\n"
        );
        for (i, s) in servers.iter().enumerate() {
            config.push_str(&format!("    server s{} {s}\n", i + 1));
        }
        let path = dir.join(format!("haproxy-{balance}.cfg"));
        std::fs::write(&path, &config)?;
        let mut cmd = ns.command("haproxy");
        cmd.arg("-f").arg(&path).arg("-db");
        let log = dir.join(format!("haproxy-{balance}.log"));
        guard.process = Some(Process::spawn("haproxy", cmd, &log)?);
        guard.wait_listening()?;
        Ok(guard)
    }

    fn wait_listening(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let want = self.vip.to_string();
        loop {
            let listening = self.ns.exec("ss", &["-Hltn"])?;
            if listening
                .lines()
                .any(|l| l.split_whitespace().any(|w| w == want))
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let output = self.process.as_ref().map(Process::output);
                bail!("haproxy does not listen on {want} within {READY_TIMEOUT:?}: {output:?}");
            }
            sleep(Duration::from_millis(50));
        }
    }

    pub fn pid(&self) -> libc::pid_t {
        self.process.as_ref().expect("running").pid()
    }
}

impl Drop for Haproxy<'_> {
    fn drop(&mut self) {
        if let Some(mut process) = self.process.take() {
            if let Err(e) = process.stop(STOP_GRACE) {
                eprintln!("stopping haproxy: {e:#}");
            }
        }
        let prefix = if self.vip.is_ipv4() { 32 } else { 128 };
        let address = format!("{}/{prefix}", self.vip.ip());
        if let Err(e) = self.ns.ip(&["addr", "del", &address, "dev", "lo"]) {
            eprintln!("removing {address} from lo: {e:#}");
        }
    }
}
