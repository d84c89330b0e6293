use anyhow::{anyhow, Context as _};
use aya_build::{Package, Toolchain};

// Builds the XDP objects with the nightly toolchain (build-std=core, bpf-linker) and leaves
// them in OUT_DIR, where `objects.rs` embeds them.
fn main() -> anyhow::Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or_else(|| anyhow!("balancer-agent has no parent directory"))?
        .join("balancer-ebpf");
    let root = root
        .to_str()
        .context("the eBPF crate's path is not UTF-8")?;
    aya_build::build_ebpf(
        [Package {
            name: "balancer-ebpf",
            root_dir: root,
            ..Default::default()
        }],
        Toolchain::default(),
    )
}
