// Rebuild the object when bpf-linker changes: it is the linker, so cargo cannot see it.
fn main() {
    if let Ok(linker) = which::which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
