//! `cargo xtask setup`: bring a fresh Debian 12 machine (with rustup stable +
//! nightly) to the point where the workspace builds and tests. Every step
//! checks first, so reruns are cheap and only repair what is missing.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, ensure, Context as _, Result};

use crate::{cmd, real_backend};

/// Fixed location because its `lib/` becomes bpf-linker's RUNPATH: moving or
/// deleting it breaks the installed binary.
const LLVM_DIR: &str = "/var/cache/balancer/llvm-nightly";
/// Nightly rustc's LLVM 22; bpf-linker must use the same LLVM major as the
/// rustc that emits the bitcode it links.
const LIBLLVM_PREFIX: &str = "libLLVM.so.22.1-rust-";
const BPF_LINKER_VERSION: &str = "0.13.0";
/// haproxy is not used by tests yet; it is the baseline for the benchmarks. build-essential
/// (a C and C++ compiler: llama.cpp), python3-venv and python3-pip (llama.cpp's source and
/// its build tools come from PyPI) are on most machines already.
const DEBIAN_PACKAGES: &[&str] = &[
    "build-essential",
    "python3-venv",
    "python3-pip",
    "iproute2",
    "ethtool",
    "curl",
    "procps",
    "iputils-ping",
    "nftables",
    "haproxy",
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Install,
    DryRun,
    /// Report missing prerequisites as errors instead of installing them.
    Check,
}

struct Setup {
    mode: Mode,
}

pub fn run(dry_run: bool) -> Result<()> {
    // A dry run changes nothing, so it is useful (and allowed) without root.
    if !dry_run && !cmd::is_root()? {
        bail!("cargo xtask setup needs root (apt-get, bpffs); run it as root");
    }
    let setup = Setup {
        mode: if dry_run { Mode::DryRun } else { Mode::Install },
    };
    setup.rust_src()?;
    setup.stable_components()?;
    setup.bpf_linker()?;
    setup.debian_packages()?;
    setup.bpffs()?;
    setup.real_backend()?;
    Ok(())
}

/// What `cargo build` needs (the eBPF object is built with nightly + rust-src
/// and linked by bpf-linker), without installing anything or needing root.
pub fn check_build_prerequisites() -> Result<()> {
    let setup = Setup { mode: Mode::Check };
    setup.rust_src()?;
    setup.bpf_linker()
}

impl Setup {
    fn ok(&self, what: &str) {
        println!("ok: {what}");
    }

    /// Announces an install step; in check mode, fails instead.
    fn need(&self, what: &str) -> Result<()> {
        match self.mode {
            Mode::Install => println!("installing: {what}"),
            Mode::DryRun => println!("would install: {what}"),
            Mode::Check => bail!("{what} is missing; run `cargo xtask setup` (as root)"),
        }
        Ok(())
    }

    fn exec(&self, cmd: &mut Command) -> Result<()> {
        match self.mode {
            Mode::Install => cmd::run(cmd),
            Mode::DryRun => {
                println!("  would run: {}", cmd::display(cmd));
                Ok(())
            }
            Mode::Check => unreachable!("need() fails before anything runs in check mode"),
        }
    }

    fn rust_src(&self) -> Result<()> {
        let what = "rust-src for the nightly toolchain (builds core for bpfel-unknown-none)";
        if installed_components("nightly")?
            .iter()
            .any(|c| c == "rust-src")
        {
            self.ok(what);
            return Ok(());
        }
        self.need(what)?;
        self.exec(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))
    }

    fn stable_components(&self) -> Result<()> {
        let installed = installed_components("stable")?;
        // Installed components are listed with a target suffix, e.g.
        // `clippy-x86_64-unknown-linux-gnu`.
        let missing: Vec<&str> = ["rustfmt", "clippy"]
            .into_iter()
            .filter(|c| {
                !installed
                    .iter()
                    .any(|i| i == c || i.starts_with(&format!("{c}-")))
            })
            .collect();
        if missing.is_empty() {
            self.ok("rustfmt and clippy for the stable toolchain");
            return Ok(());
        }
        self.need(&format!(
            "{} for the stable toolchain",
            missing.join(" and ")
        ))?;
        self.exec(
            Command::new("rustup")
                .args(["component", "add", "--toolchain", "stable"])
                .args(&missing),
        )
    }

    fn bpf_linker(&self) -> Result<()> {
        let libllvm = nightly_libllvm()?;
        let lib_dir = Path::new(LLVM_DIR).join("lib");
        let soname = libllvm.file_name().expect("read_dir entries have names");
        // `libLLVM.so` is what bpf-linker's build links against; the versioned
        // name is its DT_NEEDED, which the loader looks up in the RUNPATH
        // (`lib_dir`), so both must point at the current nightly's library.
        let links = [lib_dir.join("libLLVM.so"), lib_dir.join(soname)];
        let stale: Vec<&PathBuf> = links
            .iter()
            .filter(|l| !fs::read_link(l).is_ok_and(|t| t == libllvm))
            .collect();
        let mut preview_lib_dir = None;
        if stale.is_empty() {
            self.ok(&format!(
                "symlinks {} -> {}",
                lib_dir.display(),
                libllvm.display()
            ));
        } else {
            self.need(&format!(
                "symlinks {} -> {}",
                lib_dir.display(),
                libllvm.display()
            ))?;
            self.exec(Command::new("mkdir").arg("-p").arg(&lib_dir))?;
            for link in stale {
                self.exec(Command::new("ln").arg("-sfn").arg(&libllvm).arg(link))?;
            }
            // Lets a dry run predict whether the existing binary will work
            // once the links exist.
            if self.mode == Mode::DryRun {
                preview_lib_dir = libllvm.parent();
            }
        }

        let what = format!("bpf-linker {BPF_LINKER_VERSION} (nightly's LLVM 22)");
        if bpf_linker_works(preview_lib_dir) {
            self.ok(&what);
            return Ok(());
        }
        self.need(&what)?;
        // --force: cargo considers the crate installed even when the binary
        // cannot load its libLLVM (e.g. after a nightly update).
        self.exec(
            Command::new("cargo")
                .env("LLVM_PREFIX", LLVM_DIR)
                .args(["+nightly", "install", "bpf-linker", "--version"])
                .arg(BPF_LINKER_VERSION)
                .args(["--no-default-features", "--features", "llvm-22", "--force"]),
        )?;
        if self.mode == Mode::Install {
            ensure!(
                bpf_linker_works(None),
                "bpf-linker was installed but `bpf-linker --version` does not report \
                 {BPF_LINKER_VERSION}"
            );
        }
        Ok(())
    }

    fn debian_packages(&self) -> Result<()> {
        let missing: Vec<&str> = DEBIAN_PACKAGES
            .iter()
            .copied()
            .filter(|p| !dpkg_installed(p))
            .collect();
        if missing.is_empty() {
            self.ok(&format!("Debian packages: {}", DEBIAN_PACKAGES.join(" ")));
            return Ok(());
        }
        self.need(&format!("Debian packages: {}", missing.join(" ")))?;
        self.exec(Command::new("apt-get").arg("update"))?;
        self.exec(
            Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(["install", "-y", "--no-install-recommends"])
                .args(&missing),
        )
    }

    fn bpffs(&self) -> Result<()> {
        let what = "bpffs mounted at /sys/fs/bpf";
        let mounts = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
        let mounted = mounts.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(1) == Some(&"/sys/fs/bpf") && f.get(2) == Some(&"bpf")
        });
        if mounted {
            self.ok(what);
            return Ok(());
        }
        self.need(what)?;
        self.exec(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]))
    }

    /// The real backend (llama-server + model) of the e2e_real tests, built or unpacked into
    /// its cache when missing; a quick check when present (`real_backend.rs`).
    fn real_backend(&self) -> Result<()> {
        let what = real_backend::describe();
        if self.mode == Mode::DryRun {
            if real_backend::is_present() {
                self.ok(&what);
            } else {
                self.need(&what)?;
                println!("  would run: cargo xtask real-backend");
            }
            return Ok(());
        }
        real_backend::ensure_present()?;
        self.ok(&what);
        Ok(())
    }
}

fn installed_components(toolchain: &str) -> Result<Vec<String>> {
    let out = cmd::query(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        toolchain,
        "--installed",
    ]))?;
    Ok(out.lines().map(|l| l.trim().to_owned()).collect())
}

/// The nightly sysroot's LLVM shared library, e.g.
/// `.../lib/libLLVM.so.22.1-rust-1.97.0-nightly`.
fn nightly_libllvm() -> Result<PathBuf> {
    let sysroot = cmd::query(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?;
    let lib = Path::new(sysroot.trim()).join("lib");
    let matches: Vec<PathBuf> = fs::read_dir(&lib)
        .with_context(|| format!("listing {}", lib.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(LIBLLVM_PREFIX))
        .map(|e| e.path())
        .collect();
    match matches.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!(
            "expected exactly one {}/{LIBLLVM_PREFIX}* (the nightly's LLVM 22), found {}: {:?}; \
             bpf-linker {BPF_LINKER_VERSION} needs LLVM 22",
            lib.display(),
            matches.len(),
            matches
        ),
    }
}

/// Runs whichever bpf-linker rustc would find on PATH (which includes
/// ~/.cargo/bin); it only starts if its libLLVM resolves.
fn bpf_linker_works(extra_lib_dir: Option<&Path>) -> bool {
    let mut cmd = Command::new("bpf-linker");
    cmd.arg("--version");
    if let Some(dir) = extra_lib_dir {
        cmd.env("LD_LIBRARY_PATH", dir);
    }
    cmd.output().is_ok_and(|o| {
        o.status.success()
            && String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .any(|w| w == BPF_LINKER_VERSION)
    })
}

fn dpkg_installed(package: &str) -> bool {
    // dpkg-query exits non-zero for packages it has never heard of: missing.
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout == b"install ok installed")
}
