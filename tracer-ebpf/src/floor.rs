//! A measuring object the agent never loads: the least a syscall-tracepoint tracer can do on
//! this kernel, so that `cargo xtask bench` can show the floor under its per-syscall figures
//! (issue #18). The bench loads it with the `syscall_floor` example of `tracer-userspace`:
//! - `floor_empty`, attached where the agent attaches its programs, returns at once: what
//!   the tracepoints cost every process on the host before a program does anything;
//! - `floor_enter` / `floor_exit`, on the enters and exits of `read`, `recvfrom`, `write`
//!   and `sendto`, capture what one process moves: a compare with the one traced tgid (a
//!   global, cheaper than any map), the buffer remembered per thread at the enter (the data
//!   of a read exists only at its exit), and at the exit one copy of at most
//!   [`FLOOR_CAPTURE_BYTES`] from user memory and one ring-buffer record. No socket table,
//!   no HTTP test, no sequence number, no task context: every step the agent adds to these is
//!   above the floor.
#![no_std]
#![no_main]

use core::ptr;

use aya_ebpf::{
    bindings::BPF_RB_NO_WAKEUP,
    helpers::{bpf_get_current_pid_tgid, generated::bpf_probe_read_user},
    macros::{map, tracepoint},
    maps::{HashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
};

/// Bytes copied from the start of each transfer, at most (the agent's default capture).
const FLOOR_CAPTURE_BYTES: usize = 4096;
const CAPTURE_MASK: usize = FLOOR_CAPTURE_BYTES - 1;

/// Offsets of the buffer argument in a `sys_enter_*` record and of the return value in a
/// `sys_exit_*` record (see the tracepoint's `format` file).
const ARG1: usize = 24;
const RET: usize = 16;

/// The one process whose transfers are captured; set by the loader.
#[unsafe(no_mangle)]
static TARGET_TGID: u32 = 0;

/// The buffer of a thread's transfer between its enter and exit (0 between calls), by
/// `pid_tgid`: written in place, as the agent's `PENDING_CALLS` is.
#[map]
static FLOOR_CALLS: HashMap<u64, u64> = HashMap::with_max_entries(1024, 0);

/// Where a record is assembled before it is copied to the ring, as the agent does.
#[map]
static FLOOR_SCRATCH: PerCpuArray<FloorRecord> = PerCpuArray::with_max_entries(1, 0);

#[map]
static FLOOR_EVENTS: RingBuf = RingBuf::with_byte_size(1 << 22, 0);

/// Records the ring refused, per CPU.
#[map]
static FLOOR_LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// A captured transfer: its length, then the bytes copied. Twice the capture, so that a
/// masked length always fits (what lets the verifier accept the copy).
#[repr(C)]
struct FloorRecord {
    pid_tgid: u64,
    captured: u64,
    payload: [u8; 2 * FLOOR_CAPTURE_BYTES],
}

#[inline(always)]
fn bounded(value: usize, mask: usize) -> usize {
    // SAFETY: reads a local; the volatile read keeps LLVM from dropping the mask the
    // verifier needs.
    unsafe { ptr::read_volatile(&value) & mask }
}

/// The thread's `pid_tgid` when it belongs to the traced process.
#[inline(always)]
fn traced() -> Option<u64> {
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: a global set at load time; read_volatile keeps the compiler from folding it.
    let target = unsafe { ptr::read_volatile(&TARGET_TGID) };
    ((pid_tgid >> 32) as u32 == target).then_some(pid_tgid)
}

#[tracepoint]
pub fn floor_empty(_ctx: TracePointContext) -> u32 {
    0
}

#[tracepoint]
pub fn floor_enter(ctx: TracePointContext) -> u32 {
    let Some(pid_tgid) = traced() else {
        return 0;
    };
    // SAFETY: syscall tracepoint layout.
    let buffer = unsafe { ctx.read_at::<u64>(ARG1).unwrap_or(0) };
    if let Some(slot) = FLOOR_CALLS.get_ptr_mut(&pid_tgid) {
        // SAFETY: only this thread's programs write its entry.
        unsafe { *slot = buffer };
    } else {
        let _ = FLOOR_CALLS.insert(&pid_tgid, &buffer, 0);
    }
    0
}

#[tracepoint]
pub fn floor_exit(ctx: TracePointContext) -> u32 {
    let Some(pid_tgid) = traced() else {
        return 0;
    };
    let Some(slot) = FLOOR_CALLS.get_ptr_mut(&pid_tgid) else {
        return 0;
    };
    // SAFETY: this thread's own entry.
    let buffer = unsafe { core::mem::replace(&mut *slot, 0) };
    // SAFETY: syscall exit tracepoint layout.
    let moved = unsafe { ctx.read_at::<i64>(RET).unwrap_or(-1) };
    if buffer == 0 || moved <= 0 {
        return 0;
    }
    let Some(record) = FLOOR_SCRATCH.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: the per-CPU scratch is this program's for its run; user memory is read only
    // through the helper.
    unsafe {
        let record = &mut *record;
        let length = bounded((moved as usize).min(CAPTURE_MASK), CAPTURE_MASK);
        if bpf_probe_read_user(
            record.payload.as_mut_ptr().cast(),
            length as u32,
            buffer as *const _,
        ) != 0
        {
            return 0;
        }
        record.pid_tgid = pid_tgid;
        record.captured = length as u64;
        let size = 16 + length;
        let bytes =
            core::slice::from_raw_parts(ptr::from_mut(record).cast_const().cast::<u8>(), size);
        if FLOOR_EVENTS
            .output::<[u8]>(bytes, BPF_RB_NO_WAKEUP as u64)
            .is_err()
            && let Some(lost) = FLOOR_LOST.get_ptr_mut(0)
        {
            *lost += 1;
        }
    }
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}
