//! The floor programs (`tracer-ebpf/src/floor.rs`), loaded by the bench's `syscall_floor`
//! example and never by the agent: the same tracepoints as the agent's with programs that
//! return at once, or that capture one process's transfers with nothing but a tgid compare,
//! a per-thread stash, one user copy and one ring record. Measured beside the agent, they show
//! how much of a per-syscall figure is the kernel's and how much the agent's (issue #18).

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{MapData, PerCpuArray, RingBuf},
};

use crate::kernel::loader::{Attachment, attachments, tracepoint};

/// The floor object built by `build.rs` (empty in an `AYA_BUILD_SKIP=1` build).
static FLOOR_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracer-ebpf-floor"));

/// The syscalls whose transfers the capture floor copies: those of plain buffers, which are
/// what `bench/syscall_tax.c` makes.
const CAPTURED_SYSCALLS: [&str; 4] = ["read", "recvfrom", "write", "sendto"];

/// What the floor programs do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloorMode {
    /// Every tracepoint the agent uses, each with a program that returns at once.
    Empty,
    /// The same, but the transfers of `pid` through [`CAPTURED_SYSCALLS`] are captured.
    Capture { pid: u32 },
}

/// The loaded, attached floor programs; dropping this detaches them.
pub struct FloorProbes {
    ebpf: Ebpf,
    ring: RingBuf<MapData>,
}

/// What the capture floor delivered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FloorDrained {
    pub records: u64,
    pub bytes: u64,
}

impl FloorProbes {
    pub fn attach(mode: FloorMode) -> Result<Self> {
        if FLOOR_OBJECT.is_empty() {
            bail!("this build has no floor programs (AYA_BUILD_SKIP was set): rebuild without it");
        }
        let target = match mode {
            FloorMode::Empty => 0u32,
            FloorMode::Capture { pid } => pid,
        };
        let mut ebpf = EbpfLoader::new()
            .override_global("TARGET_TGID", &target, true)
            .load(FLOOR_OBJECT)
            .context("loading the floor programs")?;
        for program in ["floor_empty", "floor_enter", "floor_exit"] {
            tracepoint(&mut ebpf, program)?
                .load()
                .with_context(|| format!("the kernel verifier rejected {program}"))?;
        }
        for Attachment { category, name, .. } in attachments() {
            let program = match mode {
                FloorMode::Capture { .. } if is_captured(category, &name, "sys_enter_") => {
                    "floor_enter"
                }
                FloorMode::Capture { .. } if is_captured(category, &name, "sys_exit_") => {
                    "floor_exit"
                }
                _ => "floor_empty",
            };
            tracepoint(&mut ebpf, program)?
                .attach(category, &name)
                .with_context(|| format!("attaching {program} to {category}/{name}"))?;
        }
        let map = ebpf
            .take_map("FLOOR_EVENTS")
            .context("FLOOR_EVENTS missing from the floor object")?;
        let ring = RingBuf::try_from(map).context("FLOOR_EVENTS is not a ring buffer")?;
        Ok(Self { ebpf, ring })
    }

    /// Reads every record waiting in the ring.
    pub fn drain(&mut self) -> FloorDrained {
        let mut drained = FloorDrained::default();
        while let Some(record) = self.ring.next() {
            drained.records += 1;
            drained.bytes += record.len() as u64;
        }
        drained
    }

    /// Records the ring refused, over all CPUs.
    pub fn lost(&self) -> Result<u64> {
        let map = self
            .ebpf
            .map("FLOOR_LOST")
            .context("FLOOR_LOST missing from the floor object")?;
        let lost: PerCpuArray<_, u64> = PerCpuArray::try_from(map)?;
        Ok(lost.get(&0, 0)?.iter().sum())
    }
}

fn is_captured(category: &str, name: &str, prefix: &str) -> bool {
    category == "syscalls"
        && name
            .strip_prefix(prefix)
            .is_some_and(|syscall| CAPTURED_SYSCALLS.contains(&syscall))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_capture_floor_takes_the_plain_buffer_transfers_the_agent_also_traces() {
        let all = attachments();
        for syscall in CAPTURED_SYSCALLS {
            for prefix in ["sys_enter_", "sys_exit_"] {
                let name = format!("{prefix}{syscall}");
                assert!(
                    all.iter()
                        .any(|a| a.category == "syscalls" && a.name == name),
                    "the agent does not attach to {name}"
                );
                assert!(is_captured("syscalls", &name, prefix));
            }
        }
        assert!(!is_captured("syscalls", "sys_enter_readv", "sys_enter_"));
        assert!(!is_captured("syscalls", "sys_enter_read", "sys_exit_"));
        assert!(!is_captured("sched", "sys_enter_read", "sys_enter_"));
    }
}
