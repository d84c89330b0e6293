//! Attaches an XDP program that passes every packet to the given interfaces and keeps it there
//! until SIGTERM or SIGINT. On veth, XDP_TX and XDP_REDIRECT into a peer are dropped unless
//! the peer runs an XDP program too, so the harness puts this on the peers of the gateway.

use anyhow::{bail, Context};
use aya::programs::{Xdp, XdpMode};
use aya::Ebpf;

fn main() -> anyhow::Result<()> {
    let interfaces: Vec<String> = std::env::args().skip(1).collect();
    if interfaces.is_empty() {
        bail!("usage: xdp-pass INTERFACE...");
    }
    // Block the signals before anything else so that they wait for sigwait below instead of
    // killing us before we have said `attached`.
    let signals = block_signals()?;

    let mut ebpf = Ebpf::load(balancer_agent::objects::PASS).context("loading the pass object")?;
    let program: &mut Xdp = ebpf
        .program_mut("xdp_pass")
        .context("no program xdp_pass in the object")?
        .try_into()?;
    program.load().context("loading xdp_pass")?;
    for interface in &interfaces {
        if let Err(native) = program.attach(interface, XdpMode::Driver) {
            program.attach(interface, XdpMode::Skb).with_context(|| {
                format!("attaching to {interface} (native mode failed first: {native})")
            })?;
            eprintln!("{interface}: native XDP failed ({native}), attached in generic mode");
        }
    }
    println!("attached");

    let mut signal = 0;
    // SAFETY: `signals` is an initialised set and `signal` a valid out-pointer.
    let rc = unsafe { libc::sigwait(&signals, &mut signal) };
    if rc != 0 {
        bail!("sigwait: {}", std::io::Error::from_raw_os_error(rc));
    }
    // The links belong to `ebpf`; dropping it on return detaches them.
    Ok(())
}

fn block_signals() -> anyhow::Result<libc::sigset_t> {
    // SAFETY: sigemptyset initialises the set before it is read; the calls only touch it and
    // this thread's signal mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            bail!("pthread_sigmask: {}", std::io::Error::from_raw_os_error(rc));
        }
        Ok(set)
    }
}
