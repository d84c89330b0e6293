//! `balancer-agent run`: load, fill the maps, attach, then follow signals: SIGHUP reloads
//! the configuration, SIGINT and SIGTERM detach and exit.

use std::{path::Path, time::Instant};

use anyhow::{Context, Result};
use tokio::signal::unix::{signal, SignalKind};
use tracing::{error, info, warn};

use crate::{config::Config, dataplane::Dataplane, plan::Ids};

pub async fn run(config_path: &Path) -> Result<()> {
    // Before anything else: a SIGHUP that arrives early must reload, not kill us.
    let mut hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut config = Config::load(config_path)?;
    let mut dp = Dataplane::load(config.agent.flow_table_entries)?;
    let mut ids = Ids::default();
    let plan = ids.plan(&config, Instant::now())?;
    // Maps first: a program attached to empty maps would pass VIP traffic to the stack.
    dp.apply(&plan)?;
    if let Err(e) = dp.attach(&config.agent.interfaces) {
        dp.detach_all().ok();
        return Err(e);
    }
    info!(
        pools = config.pool.len(),
        interfaces = ?config.agent.interfaces,
        "ready"
    );

    loop {
        tokio::select! {
            _ = hup.recv() => match reload(config_path, &config, &mut ids, &mut dp) {
                Ok(new) => {
                    config = new;
                    info!(pools = config.pool.len(), "config reloaded");
                }
                Err(e) => error!("reload failed, keeping the running configuration: {e:#}"),
            },
            _ = int.recv() => break,
            _ = term.recv() => break,
        }
    }
    dp.detach_all()?;
    info!("stopped");
    Ok(())
}

/// Applies a new configuration to new flows; established flows keep their backends.
fn reload(path: &Path, old: &Config, ids: &mut Ids, dp: &mut Dataplane) -> Result<Config> {
    let new = Config::load(path)?;
    for name in &new.agent.interfaces {
        // Checked before anything is applied, so that a typo changes nothing.
        require_interface(name)?;
    }
    if new.agent.flow_table_entries != old.agent.flow_table_entries {
        warn!("agent.flow_table_entries changes only when the agent restarts");
    }
    let plan = ids.plan(&new, Instant::now())?;
    dp.apply(&plan)?;
    dp.attach(&new.agent.interfaces)?;
    Ok(new)
}

fn require_interface(name: &str) -> Result<()> {
    let c = std::ffi::CString::new(name).context("interface name")?;
    // SAFETY: a NUL-terminated string that outlives the call.
    if unsafe { libc::if_nametoindex(c.as_ptr()) } == 0 {
        anyhow::bail!("agent.interfaces: no interface named {name:?}");
    }
    Ok(())
}
