//! Rebuild the eBPF object when the `bpf-linker` binary changes: cargo cannot see that the
//! linker is an input of this crate.
fn main() {
    match which::which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(_) => println!(
            "cargo:warning=bpf-linker is not on PATH; run `cargo xtask setup` to install it"
        ),
    }
}
