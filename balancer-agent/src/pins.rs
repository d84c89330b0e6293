//! State that outlives the agent (`agent.pin_dir`): the program's maps and its XDP links,
//! pinned in bpffs. While they are pinned the program stays attached and keeps forwarding
//! with the last tables when no agent runs, and the next agent takes them over: it loads its
//! program onto the same maps and swaps it into the same links (`bpf_link_update`), so no
//! packet meets a detached interface and no open connection loses its flow entry.
//!
//! Layout: `DIR/maps-vN/NAME` for every map of the program, N being
//! [`PIN_LAYOUT`], and `DIR/links/INTERFACE` for each attached interface.

use std::{
    collections::BTreeMap,
    ffi::CString,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use aya::maps::{MapInfo, MapType};
use aya_obj::generated::{bpf_map_type, BPF_F_RDONLY_PROG};
use balancer_common::PIN_LAYOUT;
use tracing::warn;

use crate::objects;

/// Maps that hold no state to carry over (the ring of shared flows, the next-hop cache, the
/// interfaces to send out of and which take frames in several buffers, the rate limits'
/// allowances), or only counts that can start again from zero (the drops per VIP): one
/// that an earlier build did not pin is created and pinned (and filled before the program
/// runs), and the upgrade goes on.
const CREATED_IF_MISSING: [&str; 6] = [
    "FLOW_EVENTS",
    "HOPS",
    "EGRESS",
    "EGRESS_FRAGS",
    "ALLOWANCES",
    "VIP_DROPS",
];

/// `f_type` of a bpffs mount (`BPF_FS_MAGIC`).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// What a map must be for this build's program to use it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Shape {
    kind: Option<MapType>,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    flags: u32,
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            Some(kind) => write!(f, "{kind:?}")?,
            None => write!(f, "a map of unknown type")?,
        }
        write!(
            f,
            ", {} entries of {} + {} bytes, flags {:#x}",
            self.max_entries, self.key_size, self.value_size, self.flags
        )
    }
}

pub struct Pins {
    dir: PathBuf,
    /// Every map the program declares, by name, and its shape.
    maps: BTreeMap<String, Shape>,
    /// The directory, locked: one agent at a time writes the maps.
    _lock: std::fs::File,
}

impl Pins {
    /// The pins under `dir`, which must be on bpffs; creates the directories. `flow_entries`
    /// is the flow table's configured size.
    pub fn open(dir: &Path, flow_entries: u32) -> Result<Self> {
        on_bpffs(dir)?;
        not_a_mount(dir)?;
        let object = aya_obj::Object::parse(objects::BALANCER).context("parsing the XDP object")?;
        let maps = object
            .maps
            .iter()
            .filter(|(name, _)| !name.starts_with('.'))
            .map(|(name, m)| {
                let max_entries = if name == "FLOWS" {
                    flow_entries
                } else {
                    m.max_entries()
                };
                let kind = bpf_map_type::try_from(m.map_type())
                    .ok()
                    .and_then(|t| MapType::try_from(t).ok());
                // The kernel makes device maps read-only to programs itself.
                let added = match kind {
                    Some(MapType::DevMap | MapType::DevMapHash) => BPF_F_RDONLY_PROG,
                    _ => 0,
                };
                let shape = Shape {
                    kind,
                    key_size: m.key_size(),
                    value_size: m.value_size(),
                    max_entries,
                    flags: m.map_flags() | added,
                };
                (name.clone(), shape)
            })
            .collect();
        std::fs::create_dir_all(dir)
            .with_context(|| format!("agent.pin_dir: creating {}", dir.display()))?;
        let pins = Pins {
            dir: dir.to_owned(),
            maps,
            _lock: lock(dir)?,
        };
        for d in [pins.maps_dir(), pins.links_dir()] {
            std::fs::create_dir_all(&d)
                .with_context(|| format!("agent.pin_dir: creating {}", d.display()))?;
        }
        Ok(pins)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn maps_dir(&self) -> PathBuf {
        self.dir.join(format!("maps-v{PIN_LAYOUT}"))
    }

    fn links_dir(&self) -> PathBuf {
        self.dir.join("links")
    }

    /// Every map's name and where it is pinned.
    pub fn map_paths(&self) -> Vec<(String, PathBuf)> {
        let dir = self.maps_dir();
        self.maps
            .keys()
            .map(|name| (name.clone(), dir.join(name)))
            .collect()
    }

    /// Where the link of `interface` is pinned.
    pub fn link(&self, interface: &str) -> PathBuf {
        self.links_dir().join(interface)
    }

    /// Unpins the link of `interface`: the program leaves it once no agent holds the link.
    pub fn unpin_link(&self, interface: &str) -> Result<()> {
        unpin(&self.link(interface))
    }

    /// Whether an earlier agent left maps this build can take over. Fails, changing
    /// nothing, when what is pinned does not fit: maps of another layout while links are
    /// pinned (the program attached now reads those), a map of another shape (another
    /// build, or a changed `flow_table_entries`), or only some of the maps (a missing ring
    /// buffer, next-hop cache or interface list is no loss: it is created). Maps of another
    /// layout that no link uses any more are unpinned.
    pub fn inherited(&self) -> Result<bool> {
        let fix = format!(
            "`balancer-agent detach --config FILE` removes what {} holds (the connections \
             through it are lost)",
            self.dir.display()
        );
        let links = entries(&self.links_dir())?;
        let ours = format!("maps-v{PIN_LAYOUT}");
        for other in entries(&self.dir)? {
            let name = other.to_string_lossy();
            if !name.starts_with("maps-v") || name == ours {
                continue;
            }
            if !links.is_empty() {
                bail!(
                    "{} holds maps of another build ({name}, this one uses maps-v{PIN_LAYOUT}) \
                     and links to a program that uses them; {fix}",
                    self.dir.display()
                );
            }
            // No program uses them any more: they only hold memory.
            let n = unpin_all(&self.dir.join(&other))?;
            warn!(dir = %self.dir.display(), "unpinned {n} maps of another build ({name}), which no link used");
        }
        let mut found = Vec::new();
        let mut missing = Vec::new();
        for (name, path) in self.map_paths() {
            if !path.exists() {
                if !CREATED_IF_MISSING.contains(&name.as_str()) {
                    missing.push(name);
                }
                continue;
            }
            let info = MapInfo::from_pin(&path)
                .with_context(|| format!("reading the pinned map {}", path.display()))?;
            let pinned = Shape {
                kind: info.map_type().ok(),
                key_size: info.key_size(),
                value_size: info.value_size(),
                max_entries: info.max_entries(),
                flags: info.map_flags(),
            };
            let want = self.maps[&name];
            if pinned != want {
                let hint = if name == "FLOWS" && pinned.max_entries != want.max_entries {
                    format!(
                        " (agent.flow_table_entries is {}; the pinned table has {})",
                        want.max_entries, pinned.max_entries
                    )
                } else {
                    String::new()
                };
                bail!(
                    "the pinned map {} has {pinned}, where this agent needs {want}{hint}; \
                     {fix}",
                    path.display()
                );
            }
            found.push(name);
        }
        if !found.is_empty() && !missing.is_empty() {
            bail!(
                "{} holds some of the maps ({}) but not {}; {fix}",
                self.maps_dir().display(),
                found.join(", "),
                missing.join(", ")
            );
        }
        Ok(!found.is_empty())
    }

    /// Interfaces with a pinned link.
    pub fn linked(&self) -> Result<Vec<String>> {
        Ok(entries(&self.links_dir())?
            .into_iter()
            .map(|n| n.to_string_lossy().into_owned())
            .collect())
    }
}

/// Unpins what agents pinned under `dir`: links first (each detaches once no agent holds
/// it), then maps of every layout; then removes `dir` if nothing else is in it. Returns the
/// interfaces it detached and how many maps it unpinned.
pub fn remove(dir: &Path) -> Result<(Vec<String>, usize)> {
    on_bpffs(dir)?;
    // As `open` refuses it: what a mount's root holds may be anyone's.
    not_a_mount(dir)?;
    let held = lock(dir)?;
    let links = dir.join("links");
    let interfaces = entries(&links)?
        .into_iter()
        .map(|n| n.to_string_lossy().into_owned())
        .collect();
    unpin_all(&links)?;
    let mut maps = 0;
    for sub in entries(dir)? {
        if sub.to_string_lossy().starts_with("maps-v") {
            maps += unpin_all(&dir.join(sub))?;
        }
    }
    let rest = entries(dir)?;
    if !rest.is_empty() {
        bail!(
            "unpinned {maps} maps and the links of {}, but left the directory: it also holds {:?}",
            dir.display(),
            rest
        );
    }
    std::fs::remove_dir(dir).with_context(|| format!("removing {}", dir.display()))?;
    drop(held);
    Ok((interfaces, maps))
}

/// Unpins every object in `sub` and removes it; returns how many there were.
fn unpin_all(sub: &Path) -> Result<usize> {
    let names = entries(sub)?;
    for name in &names {
        unpin(&sub.join(name))?;
    }
    if sub.exists() {
        std::fs::remove_dir(sub).with_context(|| format!("removing {}", sub.display()))?;
    }
    Ok(names.len())
}

/// Removes the pin at `path`; one already gone (a link unpinned before an attach that
/// failed, say) is no error.
fn unpin(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        done => done.with_context(|| format!("unpinning {}", path.display())),
    }
}

/// `dir` must be a directory of its own inside a bpffs, never a mount's root: `detach`
/// removes it, and a root is shared with other software's pins.
fn not_a_mount(dir: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let (Ok(own), Some(parent)) = (std::fs::metadata(dir), dir.parent()) else {
        return Ok(());
    };
    let parent = std::fs::metadata(parent)
        .with_context(|| format!("agent.pin_dir: reading {}", parent.display()))?;
    if own.dev() != parent.dev() {
        bail!(
            "agent.pin_dir: {} is a mount point; name a directory inside it (for example {})",
            dir.display(),
            dir.join("balancer").display()
        );
    }
    Ok(())
}

/// An exclusive lock on `dir`, held while the returned file is open: a second agent on the
/// same pins would fight the first over every map.
fn lock(dir: &Path) -> Result<std::fs::File> {
    let file = std::fs::File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    // SAFETY: a valid fd, owned by `file` for the call.
    if unsafe {
        libc::flock(
            std::os::fd::AsRawFd::as_raw_fd(&file),
            libc::LOCK_EX | libc::LOCK_NB,
        )
    } != 0
    {
        bail!(
            "another agent is using {} (agent.pin_dir): stop it first",
            dir.display()
        );
    }
    Ok(file)
}

/// The names in `dir`, sorted; none when it does not exist.
fn entries(dir: &Path) -> Result<Vec<std::ffi::OsString>> {
    let read = match std::fs::read_dir(dir) {
        Ok(read) => read,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    let mut names = read
        .map(|e| e.map(|e| e.file_name()))
        .collect::<std::io::Result<Vec<_>>>()
        .with_context(|| format!("reading {}", dir.display()))?;
    names.sort();
    Ok(names)
}

/// Pins can only live on bpffs: checks the nearest existing ancestor of `dir`.
fn on_bpffs(dir: &Path) -> Result<()> {
    let existing = dir
        .ancestors()
        .find(|a| a.exists())
        .context("agent.pin_dir has no existing ancestor")?;
    let path = CString::new(existing.as_os_str().as_bytes()).context("agent.pin_dir")?;
    // SAFETY: a zeroed statfs is a valid buffer; the path is NUL-terminated.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(path.as_ptr(), &mut fs) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("agent.pin_dir: statfs {}", existing.display()));
    }
    if fs.f_type as i64 != BPF_FS_MAGIC {
        bail!(
            "agent.pin_dir: {} is not on a bpffs mount ({} is not bpffs; mount one with \
             `mount -t bpf bpf /sys/fs/bpf`)",
            dir.display(),
            existing.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pin already gone counts as unpinned (a reload after a failed relink unpins it
    /// again); anything else that fails is an error.
    #[test]
    fn unpinning_what_is_gone_is_done() {
        let dir = tempfile::tempdir().unwrap();
        let pin = dir.path().join("link_g0");
        std::fs::write(&pin, b"").unwrap();
        unpin(&pin).unwrap();
        assert!(!pin.exists());
        unpin(&pin).unwrap();
        let e = unpin(dir.path()).unwrap_err();
        assert!(format!("{e:#}").contains("unpinning"), "{e:#}");
    }
}
