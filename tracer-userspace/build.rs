//! Builds the eBPF object (crate `tracer-ebpf`) with the nightly toolchain and bpf-linker,
//! so that `cargo build` of the agent always embeds programs that match its ABI crate.
/// With `AYA_BUILD_SKIP=1` (aya-build's own switch) nothing is built and an empty object is
/// embedded instead: builds that never load programs (the fuzz target) skip the eBPF
/// toolchain, and the loader says so if such a binary is asked to attach.
fn main() -> anyhow::Result<()> {
    let skip = std::env::var("AYA_BUILD_SKIP")
        .is_ok_and(|value| value == "1" || value.eq_ignore_ascii_case("true"));
    if skip {
        let out_dir =
            std::env::var_os("OUT_DIR").ok_or_else(|| anyhow::anyhow!("OUT_DIR not set"))?;
        for object in ["tracer-ebpf", "tracer-ebpf-inject", "tracer-ebpf-floor"] {
            std::fs::write(std::path::Path::new(&out_dir).join(object), [])?;
        }
    }
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
