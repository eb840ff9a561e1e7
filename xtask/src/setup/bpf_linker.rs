//! bpf-linker, built against the nightly toolchain's own libLLVM.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::command::{capture, run_checked};
use crate::ctx::Ctx;

/// What `rustc +nightly -vV` tells us about the compiler's bundled LLVM.
#[derive(Debug, PartialEq, Eq)]
struct RustcInfo {
    /// e.g. `1.97.0-nightly`
    release: String,
    llvm_major: u32,
    llvm_minor: u32,
}

impl RustcInfo {
    /// Parses `rustc -vV` output (`release: ...` and `LLVM version: X.Y.Z` lines).
    fn parse(vv: &str) -> Result<Self> {
        let field = |name: &str| {
            vv.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
                .with_context(|| format!("`rustc +nightly -vV` has no `{name}` line"))
        };
        let release = field("release:")?.to_string();
        let llvm = field("LLVM version:")?;
        let mut parts = llvm.split('.');
        let mut number = |what: &str| -> Result<u32> {
            parts
                .next()
                .and_then(|p| p.parse().ok())
                .with_context(|| format!("cannot read the LLVM {what} version from `{llvm}`"))
        };
        let llvm_major = number("major")?;
        let llvm_minor = number("minor")?;
        Ok(Self {
            release,
            llvm_major,
            llvm_minor,
        })
    }

    /// The name rustc gives its libLLVM, e.g. `libLLVM.so.22.1-rust-1.97.0-nightly`.
    fn soname(&self) -> String {
        format!(
            "libLLVM.so.{}.{}-rust-{}",
            self.llvm_major, self.llvm_minor, self.release
        )
    }

    /// Per-toolchain prefix dir name, so a nightly update gets a fresh prefix.
    fn prefix_name(&self) -> String {
        format!(
            "llvm-{}.{}-rust-{}",
            self.llvm_major, self.llvm_minor, self.release
        )
    }

    /// The bpf-linker cargo feature matching the LLVM major version.
    fn linker_feature(&self) -> String {
        format!("llvm-{}", self.llvm_major)
    }
}

/// bpf-linker links the eBPF object; it must use the nightly's own libLLVM, so we build
/// it against an LLVM_PREFIX that points at the sysroot's library.
pub(super) fn ensure_bpf_linker(ctx: &Ctx) -> Result<()> {
    println!("xtask: checking for bpf-linker");
    if capture(ctx.cmd("bpf-linker").arg("--version")).is_some() {
        return Ok(());
    }
    let vv = capture(ctx.cmd("rustc").args(["+nightly", "-vV"]))
        .context("`rustc +nightly -vV` failed: make sure the nightly toolchain is installed")?;
    let info = RustcInfo::parse(&vv)?;
    let sysroot = capture(ctx.cmd("rustc").args(["+nightly", "--print", "sysroot"]))
        .context("`rustc +nightly --print sysroot` failed: reinstall the nightly toolchain")?;
    let sysroot_lib = PathBuf::from(sysroot.trim()).join("lib");
    let libllvm = find_libllvm(&sysroot_lib, &info.soname())?;
    let prefix = ctx
        .home
        .join(".local/share/gym-tracer")
        .join(info.prefix_name());
    println!(
        "xtask: linking {} into {}",
        libllvm.display(),
        prefix.display()
    );
    make_llvm_prefix(&prefix, &libllvm)?;

    let feature = info.linker_feature();
    println!(
        "xtask: installing bpf-linker (LLVM_PREFIX={}, feature {feature}); this takes about a minute",
        prefix.display()
    );
    run_checked(
        ctx.cmd("cargo")
            .args([
                "install",
                "bpf-linker",
                "--no-default-features",
                "--features",
                &feature,
            ])
            .env("LLVM_PREFIX", &prefix),
        "installing bpf-linker failed: check the output above (network access to crates.io, \
         a C++ toolchain) and retry `cargo xtask setup`",
    )?;
    println!("xtask: verifying bpf-linker");
    run_checked(
        ctx.cmd("bpf-linker").arg("--version"),
        "bpf-linker was installed but does not run: check that ~/.cargo/bin is on PATH and \
         that the nightly toolchain's libLLVM still exists, then rerun `cargo xtask setup`",
    )
}

/// The sysroot's libLLVM: the expected soname, else the one `libLLVM.so.*` file there.
fn find_libllvm(sysroot_lib: &Path, soname: &str) -> Result<PathBuf> {
    let expected = sysroot_lib.join(soname);
    if expected.exists() {
        return Ok(expected);
    }
    let entries = fs::read_dir(sysroot_lib)
        .with_context(|| format!("cannot list {}", sysroot_lib.display()))?;
    let mut found = Vec::new();
    for entry in entries {
        let name = entry?.file_name();
        if name.to_string_lossy().starts_with("libLLVM.so.") {
            found.push(sysroot_lib.join(name));
        }
    }
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => bail!(
            "no libLLVM.so.* in {} (expected {soname}): reinstall the nightly toolchain \
             (`rustup toolchain install nightly --force --component rust-src`)",
            sysroot_lib.display()
        ),
        many => bail!(
            "several libLLVM.so.* in {} and none is {soname}: {many:?}; reinstall the nightly \
             toolchain",
            sysroot_lib.display()
        ),
    }
}

/// `P/lib/libLLVM.so` and `P/lib/<soname>`, both symlinks to the sysroot library.
fn make_llvm_prefix(prefix: &Path, libllvm: &Path) -> Result<()> {
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib).with_context(|| format!("cannot create {}", lib.display()))?;
    let file_name = libllvm
        .file_name()
        .context("libLLVM path has no file name")?;
    for link in [lib.join("libLLVM.so"), lib.join(file_name)] {
        match fs::remove_file(&link) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("cannot replace {}", link.display()));
            }
        }
        std::os::unix::fs::symlink(libllvm, &link)
            .with_context(|| format!("cannot create symlink {}", link.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)
binary: rustc
commit-hash: e50aa6fba4e63ab34c72bf9acfd2c307c1155d1a
commit-date: 2026-05-19
host: x86_64-unknown-linux-gnu
release: 1.97.0-nightly
LLVM version: 22.1.4
";

    #[test]
    fn parses_rustc_vv() {
        let info = RustcInfo::parse(SAMPLE).unwrap();
        assert_eq!(
            info,
            RustcInfo {
                release: "1.97.0-nightly".into(),
                llvm_major: 22,
                llvm_minor: 1,
            }
        );
        assert_eq!(info.soname(), "libLLVM.so.22.1-rust-1.97.0-nightly");
        assert_eq!(info.prefix_name(), "llvm-22.1-rust-1.97.0-nightly");
        assert_eq!(info.linker_feature(), "llvm-22");
    }

    #[test]
    fn rejects_output_without_llvm_line() {
        let err = RustcInfo::parse("release: 1.97.0-nightly\n").unwrap_err();
        assert!(err.to_string().contains("LLVM version"), "{err}");
    }

    #[test]
    fn finds_libllvm_by_soname_or_fallback() {
        let dir = std::env::temp_dir().join(format!("xtask-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("libLLVM-22-rust-x.so"), "").unwrap();
        fs::write(dir.join("libLLVM.so.22.1-rust-x"), "").unwrap();
        let exact = find_libllvm(&dir, "libLLVM.so.22.1-rust-x").unwrap();
        assert_eq!(exact, dir.join("libLLVM.so.22.1-rust-x"));
        let fallback = find_libllvm(&dir, "libLLVM.so.99.0-rust-y").unwrap();
        assert_eq!(fallback, dir.join("libLLVM.so.22.1-rust-x"));

        let prefix = dir.join("prefix");
        make_llvm_prefix(&prefix, &exact).unwrap();
        make_llvm_prefix(&prefix, &exact).unwrap(); // idempotent
        for name in ["libLLVM.so", "libLLVM.so.22.1-rust-x"] {
            assert_eq!(fs::read_link(prefix.join("lib").join(name)).unwrap(), exact);
        }
        fs::remove_dir_all(&dir).unwrap();
    }
}
