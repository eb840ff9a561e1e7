//! Builds the eBPF object (crate `tracer-ebpf`) with the nightly toolchain and bpf-linker,
//! so that `cargo build` of the agent always embeds programs that match its ABI crate.
fn main() -> anyhow::Result<()> {
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "tracer-ebpf",
            root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../tracer-ebpf"),
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
    .map_err(|error| {
        anyhow::anyhow!(
            "building the eBPF programs failed: {error:#}\n\
             hint: run `cargo xtask setup` (installs nightly rust-src and bpf-linker)"
        )
    })
}
