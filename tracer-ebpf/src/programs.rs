//! gym-tracer's kernel side: syscall tracepoints that report the TCP traffic of traced
//! processes to user space, OpenSSL uprobes that report their TLS plaintext, and task/sched
//! tracepoints that keep the PID filter in step with the processes they create and end.
//!
//! What each program checks first, so that an untraced process pays as little as the
//! kernel allows:
//! - `enter_*` (read, write, their vectored and msghdr forms, accept, connect): the PID
//!   filter: the tgid's bit in two array words (`USER_PID_BITS`, `CHILD_PID_BITS`), which
//!   the verifier inlines into a few instructions, and only for a set bit a hash lookup
//!   (`TRACED_PIDS`). A read or write then looks its fd up in `SOCKETS` and goes no further
//!   unless the fd is a tracked TCP socket; only then are its arguments remembered for the
//!   exit. Nothing is copied on enter.
//! - `exit_call` (every `sys_exit_*`): the bitmaps, then the thread's entry in
//!   `PENDING_CALLS`, which exists only for threads of traced processes whose enter passed
//!   the filter, and holds a call only between such an enter and its exit. An accept or
//!   connect then walks the socket with the BTF offsets; a transfer looks up `SOCKETS` again
//!   and copies at most the message's remaining capture budget from user memory. A write that
//!   starts an HTTP message also looks the thread up in `PYTHON_THREADS` (one lookup; a
//!   non-Python process stops there) and, for a registered CPython thread, walks its running
//!   task's contextvars chain: one read for `PyThreadState.context`, then one 16-byte read
//!   (`ob_type`, `ctx_prev`) per link, at most `MAX_CONTEXT_DEPTH`, each link checked to be a
//!   `Context` before it is recorded or followed. The chain goes to the ring just before the
//!   write's data record.
//! - With `--inject-traceparent` only (`INJECT_TRACEPARENT`, a read-only global the verifier
//!   prunes on when it is 0): the enter of a write on a traced client socket reads the
//!   message's first 4 bytes and, for a request, its first 1,024 bytes (request line, head's
//!   end, a `traceparent` already there), then the writing task's context chain, each link
//!   looked up in `INJECT_TRACES`; a hit arms the header for the `sk_msg` program
//!   (`injection.rs`) in `INJECT_ARMED`, which the exit removes.
//! - `enter_close`: the PID filter, then `SOCKETS`.
//! - `new_task` (`task/task_newtask`, in the parent's context): the PID filter on the parent,
//!   then `clone_flags`: a new thread (`CLONE_THREAD`) is counted and skipped, so only a new
//!   process enters the filter.
//! - `process_exit`, `process_exec`: the PID filter; `process_exit` then deletes the exiting
//!   thread's `PYTHON_THREADS` and `PENDING_CALLS` entries (two hash deletes per thread exit
//!   of a traced process), and at a process's end its `TRACED_PIDS` entry if the kernel added
//!   it (a followed child).
//! - `ssl_write`, `ssl_write_ex`, `ssl_read`, `ssl_read_ex` (uprobes on OpenSSL, hit by
//!   every process that maps the library file): the PID filter; a traced call's arguments
//!   are remembered in `TLS_CALLS`. `ssl_return` (their uretprobe): the thread's `TLS_CALLS`
//!   entry, then the plaintext is captured as for a socket, budgeted per `SSL*`.
//!
//! The offsets the fork and exit programs read come from the tracepoints' `format` files
//! (`TRACEPOINT_LAYOUT`), the socket walk's from BTF (`KERNEL_OFFSETS`), both set by user
//! space at load time. Parsing happens in user space.

use core::intrinsics::{AtomicOrdering, atomic_xadd};
use core::ptr;

use crate::lineage;

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_kernel,
        bpf_probe_read_user,
        generated::{bpf_get_current_task, bpf_probe_read_user as probe_read_user_raw},
    },
    macros::{map, tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, ProgramArray, RingBuf},
    programs::{ProbeContext, RetProbeContext, TracePointContext},
};
use tracer_abi::{
    AF_INET, AF_INET6, ArmedInjection, CALL_ACCEPT, CALL_CONNECT, CALL_NONE,
    CALL_ON_UNKNOWN_SOCKET, CALL_READ_BUFFER, CALL_READ_IOVEC, CALL_READ_MSGHDR, CALL_WRITE_BUFFER,
    CALL_WRITE_IOVEC, CALL_WRITE_MSGHDR, CLONE_THREAD, CONTEXT_CHAIN_EMPTY, CONTEXT_CHAIN_READ,
    CONTEXT_LOST, CONTEXT_NOT_A_CONTEXT, CONTEXT_OUTCOMES, CONTEXT_READ_FAILED,
    CONTEXT_THREAD_UNKNOWN, ConnOpenEvent, DATA_SEQ_KNOWN, DEFAULT_CAPTURE_BYTES, DIRECTION_READ,
    DIRECTION_WRITE, DataEvent, DataEventHeader, EventHeader, EventKind, FIELD_ABSENT, INJECT_ALL,
    INJECT_BY_CONTEXT, INJECT_BY_ORIGIN, INJECT_CARRIED, INJECT_HANDED_OVER, INJECT_HEAD_UNSCANNED,
    INJECT_NO_TRACE, INJECT_NOT_DELIVERED, INJECT_OFF, INJECT_OUTCOMES, INJECT_OWNER_DONE,
    INJECT_REMOTE, INJECT_SCAN_BYTES, IPPROTO_TCP, InboundTrace, InjectKey, InjectTrace,
    KernelOffsets, LINEAGE_REQUEST, LastRead, LocalCallKey, MAX_CAPTURE_BYTES, MAX_CONTEXT_DEPTH,
    MAX_INJECT_TRACES, MAX_IOVECS, MAX_PENDING_CALLS, MAX_PYTHON_THREADS, MAX_TLS_SESSIONS,
    MAX_TRACED_PIDS, PID_BITMAP_WORDS, PendingCall, PendingTlsCall, ProcessExecEvent,
    ProcessForkEvent, PythonThread, RING_WAKEUP_BYTES, ROLE_CLIENT, ROLE_SERVER, SOCK_STREAM,
    SocketKey, SocketState, TAIL_BYTES, TRACED_AS_CHILD, TRACEPARENT_LINE, TaskContextEvent,
    TaskLineage, ThreadCalls, TlsBudget, TlsDataEvent, TlsDataHeader, TlsKey, TracepointLayout,
    UNTRACKED_PENDING_CALLS_FULL, UNTRACKED_REASONS, UNTRACKED_SOCKET_MAP_FULL,
    UNTRACKED_UNKNOWN_SOCKET_TRANSFER, WRITER_TASK, minted_trace, peer_on_host, pid_bit,
};

/// Bytes captured from the start of each HTTP message; set by user space at load time.
#[unsafe(no_mangle)]
static CAPTURE_BYTES: u32 = DEFAULT_CAPTURE_BYTES;

/// Kernel struct field offsets from BTF; set by user space at load time.
#[unsafe(no_mangle)]
static KERNEL_OFFSETS: KernelOffsets = KernelOffsets {
    valid: 0,
    task_files: 0,
    files_fdt: 0,
    fdtable_fd: 0,
    file_private_data: 0,
    socket_type: 0,
    socket_sk: 0,
    sock_family: 0,
    sock_daddr: 0,
    sock_rcv_saddr: 0,
    sock_dport: 0,
    sock_num: 0,
    sock_v6_daddr: 0,
    sock_v6_rcv_saddr: 0,
    socket_file: 0,
    seq_valid: 0,
    sock_protocol: 0,
    tcp_write_seq: 0,
    tcp_copied_seq: 0,
};

/// Tracepoint field offsets from the `format` files; set by user space at load time (it
/// refuses to load on a layout the programs cannot read).
#[unsafe(no_mangle)]
static TRACEPOINT_LAYOUT: TracepointLayout = TracepointLayout {
    new_task_pid: 0,
    new_task_clone_flags: 0,
    new_task_clone_flags_size: 0,
    exit_group_dead: FIELD_ABSENT,
};

/// Process ids (tgids) to trace, filled by user space.
#[map]
static TRACED_PIDS: HashMap<u32, u8> = HashMap::with_max_entries(MAX_TRACED_PIDS, 0);

/// The PID filter's first step: one bit per pid that user space traces (`TRACED_BY_USER`),
/// written by user space alone. An array lookup is inlined by the verifier into a few
/// instructions, where a hash lookup costs an untraced syscall ~100 ns at each of its enter
/// and exit; a process whose bit is clear in both bitmaps is not traced, one whose bit is set
/// is looked up in `TRACED_PIDS`, which stays the truth.
#[map]
static USER_PID_BITS: Array<u64> = Array::with_max_entries(PID_BITMAP_WORDS, 0);

/// The same for the children `new_task` adds (`TRACED_AS_CHILD`), written by the kernel
/// alone: set at the fork, cleared at the process's exit, each with an atomic add of a bit
/// known to be in the other state (a pid is forked once before it exits, so no two programs
/// change one bit at once; the add keeps the word's other bits). Two bitmaps, so that no bit
/// has two writers that cannot share a lock.
#[map]
static CHILD_PID_BITS: Array<u64> = Array::with_max_entries(PID_BITMAP_WORDS, 0);

/// Arguments of a socket call between its enter and exit, per thread. The entry stays from the
/// thread's first socket call to its exit (`process_exit` deletes it), marked [`CALL_NONE`]
/// between calls: the enter writes it in place and the exit clears one field, where an
/// insert and a delete per syscall cost about 250 ns. A plain hash, like `SOCKETS` and for
/// the same reason: an LRU would evict the entry of a thread blocked in a long call, and its
/// connection or transfer would be lost uncounted. User space deletes the entries of
/// processes that are gone.
#[map]
pub(crate) static PENDING_CALLS: HashMap<u64, ThreadCalls> =
    HashMap::with_max_entries(MAX_PENDING_CALLS, 0);

/// TCP sockets of traced processes, from accept/connect until close. Sized by user space from
/// `--max-connections`. A plain hash: the kernel's LRU hash evicts long before `max_entries`
/// (its free lists are per CPU, and a CPU short of free entries evicts its own rather than
/// take another CPU's), silently, so idle keep-alive connections were forgotten. A socket
/// that does not fit is counted here instead, and user space deletes the entries of
/// processes that died without closing their sockets.
#[map]
static SOCKETS: HashMap<SocketKey, SocketState> = HashMap::with_max_entries(65536, 0);

/// Records for user space. Its size is set at load time (`--ring-buffer-bytes`).
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(8 << 20, 0);

/// Where a data record is assembled before it is copied to the ring buffer.
#[map]
static DATA_SCRATCH: PerCpuArray<DataEvent> = PerCpuArray::with_max_entries(1, 0);

/// Records the ring buffer refused because it was full, per CPU.
#[map]
static LOST_EVENTS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// New threads of traced processes, kept out of the PID filter, per CPU.
#[map]
static THREADS_IGNORED: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// New processes of traced processes the full PID filter could not take, per CPU.
#[map]
static FORKS_UNFOLLOWED: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Connections and transfers of traced processes the kernel did not follow, per CPU, by
/// reason (`UNTRACKED_*`).
#[map]
static UNTRACKED: PerCpuArray<u64> = PerCpuArray::with_max_entries(UNTRACKED_REASONS, 0);

/// CPython threads of traced processes whose running context can be read, by thread id;
/// filled by user space from the interpreter's thread states (issue #13). An entry is
/// removed by user space when its process is forgotten or its thread is gone from a
/// rescan, and here when the thread exits.
#[map]
static PYTHON_THREADS: HashMap<u32, PythonThread> =
    HashMap::with_max_entries(MAX_PYTHON_THREADS, 0);

/// What happened at each message-start write of a traced process, per CPU (`CONTEXT_*`).
#[map]
static CONTEXT_READS: PerCpuArray<u64> = PerCpuArray::with_max_entries(CONTEXT_OUTCOMES, 0);

/// `SSL_read`/`SSL_write` calls of traced processes between uprobe and uretprobe, per thread
/// (see [`PENDING_CALLS`] for why a plain hash).
#[map]
static TLS_CALLS: HashMap<u64, PendingTlsCall> = HashMap::with_max_entries(MAX_PENDING_CALLS, 0);

/// Capture budgets per `SSL*` of a traced process. An LRU: an entry evicted, or left behind by
/// a freed `SSL`, costs at most the capture of one message's continuation.
#[map]
static TLS_BUDGETS: LruHashMap<TlsKey, TlsBudget> =
    LruHashMap::with_max_entries(MAX_TLS_SESSIONS, 0);

/// Where a TLS plaintext record is assembled.
#[map]
static TLS_SCRATCH: PerCpuArray<TlsDataEvent> = PerCpuArray::with_max_entries(1, 0);

/// `--inject-traceparent`: [`INJECT_OFF`], or which outbound request writes are armed for the
/// `sk_msg` program ([`INJECT_ALL`], [`INJECT_REMOTE`]). Set by user space at load time.
#[unsafe(no_mangle)]
static INJECT_TRACEPARENT: u32 = INJECT_OFF;

/// The agent's secret for [`minted_trace`], random per run. Set by user space at load time.
#[unsafe(no_mangle)]
static MINT_KEY: [u64; 2] = [0; 2];

/// Traces user space published for handler tasks whose request it knows ([`InjectTrace`]).
#[map]
static INJECT_TRACES: HashMap<InjectKey, InjectTrace> =
    HashMap::with_max_entries(MAX_INJECT_TRACES, 0);

/// The `traceparent` of each traced server socket's current inbound request, when it carried
/// one (see [`InboundTrace`]); written at the request's first read, deleted at close. An LRU:
/// one evicted only costs a handler's first calls their header.
#[map]
static INBOUND_TRACES: LruHashMap<SocketKey, InboundTrace> =
    LruHashMap::with_max_entries(MAX_INJECT_TRACES, 0);

/// The traces callers on this host left for their callees' first reads under
/// [`INJECT_REMOTE`] (see [`LocalCallKey`]), taken by the callee's scan. An LRU: a call
/// whose callee is not traced leaves an entry that ages out.
#[map]
static LOCAL_CALL_TRACES: LruHashMap<LocalCallKey, [u8; 16]> =
    LruHashMap::with_max_entries(MAX_INJECT_TRACES, 0);

/// Threads whose request write, at its enter, took its trace from the kernel's own knowledge
/// (the inbound request its task descends from): the write's record need not wake the agent
/// at once, since the handler's next call needs nothing from user space. Taken at the exit.
#[map]
static TRACE_KNOWN_AT_WRITE: LruHashMap<u32, u8> =
    LruHashMap::with_max_entries(MAX_INJECT_TRACES, 0);

/// The header a write's enter armed for the `sk_msg` program inside the same call, by thread.
#[map]
pub(crate) static INJECT_ARMED: HashMap<u32, ArmedInjection> =
    HashMap::with_max_entries(MAX_PENDING_CALLS, 0);

/// What happened to request writes with injection on, by `INJECT_*` index.
#[map]
pub(crate) static INJECTIONS: PerCpuArray<u64> = PerCpuArray::with_max_entries(INJECT_OUTCOMES, 0);

/// Where a request write's start is scanned, with room for the 16-byte windows read at its end.
#[map]
static INJECT_SCRATCH: PerCpuArray<[u8; INJECT_SCAN_BYTES + 16]> =
    PerCpuArray::with_max_entries(1, 0);

const EINPROGRESS: i64 = 115;

/// Bounds `value` with `mask` in a way the optimiser cannot drop. LLVM removes a clamp it
/// can prove redundant, and the verifier, which tracks ranges less precisely, then rejects
/// the access; the volatile read hides the value from LLVM and the mask bounds it for the
/// verifier.
#[inline(always)]
fn bounded(value: usize, mask: usize) -> usize {
    // SAFETY: reads a local.
    unsafe { ptr::read_volatile(&value) & mask }
}
const CAPTURE_MASK: usize = MAX_CAPTURE_BYTES - 1;
/// Bounds a tail length (at most [`TAIL_BYTES`]) for the verifier.
const TAIL_MASK: usize = 2 * TAIL_BYTES - 1;

/// Offsets of the syscall arguments in a `syscalls/sys_enter_*` record, and of the return
/// value in a `sys_exit_*` record (see the tracepoint's `format` file).
const ARG0: usize = 16;
const ARG1: usize = 24;
const ARG2: usize = 32;
const RET: usize = 16;

/// Whether `tgid` may be traced: false means it is not (see [`USER_PID_BITS`]).
#[inline(always)]
fn may_be_traced(tgid: u32) -> bool {
    let (word, bit) = pid_bit(tgid);
    let user = USER_PID_BITS.get(word).copied();
    let child = CHILD_PID_BITS.get(word).copied();
    match (user, child) {
        (Some(user), Some(child)) => (user | child) & bit != 0,
        // A pid past the bitmaps (none on Linux today): the hash decides.
        _ => true,
    }
}

#[inline(always)]
pub(crate) fn traced_tgid() -> Option<(u64, u32)> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    if !may_be_traced(tgid) {
        return None;
    }
    // SAFETY: the value is only tested for presence.
    unsafe { TRACED_PIDS.get(&tgid) }?;
    Some((pid_tgid, tgid))
}

/// Sets (`set`) or clears a pid's bit in [`CHILD_PID_BITS`] if it is in the other state.
#[inline(always)]
fn mark_child(pid: u32, set: bool) {
    let (word, bit) = pid_bit(pid);
    let Some(value) = CHILD_PID_BITS.get_ptr_mut(word) else {
        return;
    };
    // SAFETY: a map value; its only writers are this function's calls, on distinct bits.
    unsafe {
        let is_set = ptr::read_volatile(value) & bit != 0;
        if is_set != set {
            let delta = if set { bit } else { bit.wrapping_neg() };
            let _ = atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(value, delta);
        }
    }
}

#[inline(always)]
fn count(counter: &PerCpuArray<u64>) {
    count_at(counter, 0);
}

#[inline(always)]
pub(crate) fn count_at(counter: &PerCpuArray<u64>, index: u32) {
    if let Some(counter) = counter.get_ptr_mut(index) {
        // SAFETY: per-CPU value, no concurrent writer on this CPU.
        unsafe { *counter += 1 };
    }
}

#[inline(always)]
fn count_lost() {
    count(&LOST_EVENTS);
}

#[inline(always)]
fn tracepoint_layout() -> TracepointLayout {
    // SAFETY: a global set at load time; read_volatile keeps the compiler from folding it.
    unsafe { ptr::read_volatile(&TRACEPOINT_LAYOUT) }
}

/// Posts without waking the agent (it drains on a timer) unless a lot is waiting.
#[inline(always)]
fn wakeup_flags() -> u64 {
    if EVENTS.query(BPF_RB_AVAIL_DATA as u64) >= RING_WAKEUP_BYTES {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        BPF_RB_NO_WAKEUP as u64
    }
}

#[inline(always)]
fn emit<T>(record: &T) {
    if EVENTS.output::<T>(record, wakeup_flags()).is_err() {
        count_lost();
    }
}

fn header(kind: EventKind, pid_tgid: u64, fd: i32, conn_id: u64) -> EventHeader {
    EventHeader {
        kind: kind as u8,
        _pad: [0; 3],
        tgid: (pid_tgid >> 32) as u32,
        tid: pid_tgid as u32,
        fd,
        // SAFETY: a helper with no arguments.
        timestamp_ns: unsafe { bpf_ktime_get_ns() },
        conn_id,
    }
}

// ---------------------------------------------------------------------------------------
// sys_enter_*: remember the arguments of socket calls made by traced processes.
// ---------------------------------------------------------------------------------------

#[inline(always)]
fn remember(ctx: &TracePointContext, call: u32) -> u32 {
    let Some((pid_tgid, tgid)) = traced_tgid() else {
        return 0;
    };
    // SAFETY: offsets from the syscall tracepoint format, identical for every syscall.
    let (fd, buffer, count) = unsafe {
        (
            ctx.read_at::<u64>(ARG0).unwrap_or(0) as i32,
            ctx.read_at::<u64>(ARG1).unwrap_or(0),
            ctx.read_at::<u64>(ARG2).unwrap_or(0),
        )
    };
    let is_transfer = call != CALL_ACCEPT && call != CALL_CONNECT;
    let mut call = call;
    let mut seq = None;
    if is_transfer {
        // SAFETY: the value is copied out.
        match unsafe { SOCKETS.get(&SocketKey { tgid, fd }) }.copied() {
            Some(state) if state.ignored != 0 => {
                forget_last_read(pid_tgid, call);
                return 0;
            }
            Some(state) => {
                seq = sequence_number(state.sk, is_write_call(call));
                if let Some(seq) = seq
                    && state.role == ROLE_CLIENT
                    && is_write_call(call)
                    && injecting()
                {
                    arm_injection(pid_tgid, fd, call, buffer, count, seq);
                }
            }
            // Only the exit knows whether it moved bytes, so it is the exit that counts it.
            None if is_tcp_socket(fd) => {
                forget_last_read(pid_tgid, call);
                call = CALL_ON_UNKNOWN_SOCKET;
            }
            None => {
                forget_last_read(pid_tgid, call);
                return 0;
            }
        }
    }
    let pending = PendingCall {
        call,
        fd,
        buffer,
        count,
        seq: seq.unwrap_or(0),
        seq_known: u32::from(seq.is_some()),
        // SAFETY: a helper with no arguments.
        entered_ns: unsafe { bpf_ktime_get_ns() },
    };
    remember_pending(pid_tgid, &pending);
    0
}

/// Writes the thread's pending call into its entry, which stays (marked [`CALL_NONE`] by the
/// exit) until the thread exits: an in-place write and a flag instead of a hash update at
/// every enter and a delete at every exit, the two costliest steps of a traced syscall.
#[inline(always)]
fn remember_pending(pid_tgid: u64, pending: &PendingCall) {
    if let Some(slot) = PENDING_CALLS.get_ptr_mut(&pid_tgid) {
        // SAFETY: the entry is only written by its own thread's programs (and deleted at
        // that thread's exit).
        unsafe { (*slot).pending = *pending };
    } else if PENDING_CALLS
        .insert(
            &pid_tgid,
            &ThreadCalls {
                pending: *pending,
                last_read: LastRead::default(),
            },
            BPF_ANY as u64,
        )
        .is_err()
    {
        count_at(&UNTRACKED, UNTRACKED_PENDING_CALLS_FULL);
    }
}

/// A read on anything but a traced socket: what the thread parses next is not an inbound
/// request the task-creation probe could name (see [`LastRead`]).
#[inline(always)]
fn forget_last_read(pid_tgid: u64, call: u32) {
    if !is_read_call(call) {
        return;
    }
    if let Some(slot) = PENDING_CALLS.get_ptr_mut(&pid_tgid) {
        // SAFETY: the thread's own entry (see `remember_pending`).
        unsafe { (*slot).last_read.conn_id = 0 };
    }
}

#[inline(always)]
fn is_read_call(call: u32) -> bool {
    matches!(call, CALL_READ_BUFFER | CALL_READ_IOVEC | CALL_READ_MSGHDR)
}

#[inline(always)]
fn is_write_call(call: u32) -> bool {
    matches!(
        call,
        CALL_WRITE_BUFFER | CALL_WRITE_IOVEC | CALL_WRITE_MSGHDR
    )
}

/// The TCP sequence number of the next byte a write sends (`write_seq`) or a read returns
/// (`copied_seq`), read at the syscall's entry: at its exit the kernel has moved it on by
/// what was transferred (and, for a write, by anything inserted on the way).
#[inline(always)]
fn sequence_number(sk: u64, writing: bool) -> Option<u32> {
    if sk == 0 {
        return None;
    }
    let off = kernel_offsets();
    let field = if writing {
        off.tcp_write_seq
    } else {
        off.tcp_copied_seq
    };
    // SAFETY: read through the helper, which fails cleanly on a bad address.
    unsafe { bpf_probe_read_kernel((sk + field as u64) as *const u32).ok() }
}

/// `sk` when it is a `tcp_sock` whose sequence numbers can be read: TCP proper (an MPTCP
/// socket is a stream socket too, with other fields at these offsets), offsets known.
#[inline(always)]
fn tcp_sock_of(sk: u64) -> u64 {
    let off = kernel_offsets();
    if sk == 0 || off.seq_valid == 0 {
        return 0;
    }
    // SAFETY: read through the helper, which fails cleanly on a bad address.
    let protocol = unsafe { bpf_probe_read_kernel((sk + off.sock_protocol as u64) as *const u16) };
    if protocol == Ok(IPPROTO_TCP) { sk } else { 0 }
}

#[tracepoint]
pub fn enter_read_buffer(ctx: TracePointContext) -> u32 {
    remember(&ctx, CALL_READ_BUFFER)
}

#[tracepoint]
pub fn enter_write_buffer(ctx: TracePointContext) -> u32 {
    remember(&ctx, CALL_WRITE_BUFFER)
}

#[tracepoint]
pub fn enter_read_iovec(ctx: TracePointContext) -> u32 {
    remember(&ctx, CALL_READ_IOVEC)
}

#[tracepoint]
pub fn enter_write_iovec(ctx: TracePointContext) -> u32 {
    remember(&ctx, CALL_WRITE_IOVEC)
}

#[tracepoint]
pub fn enter_read_msghdr(ctx: TracePointContext) -> u32 {
    remember(&ctx, CALL_READ_MSGHDR)
}

#[tracepoint]
pub fn enter_write_msghdr(ctx: TracePointContext) -> u32 {
    remember(&ctx, CALL_WRITE_MSGHDR)
}

#[tracepoint]
pub fn enter_accept(ctx: TracePointContext) -> u32 {
    remember(&ctx, CALL_ACCEPT)
}

#[tracepoint]
pub fn enter_connect(ctx: TracePointContext) -> u32 {
    remember(&ctx, CALL_CONNECT)
}

/// A close needs no exit: the socket is gone from the process either way.
#[tracepoint]
pub fn enter_close(ctx: TracePointContext) -> u32 {
    let Some((pid_tgid, tgid)) = traced_tgid() else {
        return 0;
    };
    // SAFETY: syscall tracepoint layout.
    let fd = unsafe { ctx.read_at::<u64>(ARG0).unwrap_or(0) } as i32;
    let key = SocketKey { tgid, fd };
    // SAFETY: the value is copied out before the entry is removed.
    let Some(state) = (unsafe { SOCKETS.get(&key) }).copied() else {
        return 0;
    };
    let _ = SOCKETS.remove(&key);
    if injecting() && state.role == ROLE_SERVER {
        let _ = INBOUND_TRACES.remove(&key);
    }
    emit(&header(EventKind::ConnClose, pid_tgid, fd, state.conn_id));
    0
}

/// Follows forks in the kernel, before the child runs: a uvicorn worker or reloader child
/// accepts its first connection long before user space could add it to the filter.
/// `task_newtask` fires in `copy_process`, in the parent's context, with the clone flags, so a
/// new thread can be told from a new process here: threads share their process's tgid,
/// which the filter already holds, and adding each one would fill the filter with entries
/// that never match (`bpf_get_current_pid_tgid` reports the tgid).
#[tracepoint]
pub fn new_task(ctx: TracePointContext) -> u32 {
    let Some((pid_tgid, _)) = traced_tgid() else {
        return 0;
    };
    let layout = tracepoint_layout();
    // SAFETY: offsets from the task_newtask format file; the read goes through the helper.
    let clone_flags = unsafe {
        if layout.new_task_clone_flags_size == 8 {
            ctx.read_at::<u64>(layout.new_task_clone_flags as usize)
                .unwrap_or(CLONE_THREAD)
        } else {
            ctx.read_at::<u32>(layout.new_task_clone_flags as usize)
                .map_or(CLONE_THREAD, u64::from)
        }
    };
    if clone_flags & CLONE_THREAD != 0 {
        count(&THREADS_IGNORED);
        return 0;
    }
    // SAFETY: as above.
    let child_pid = unsafe {
        ctx.read_at::<i32>(layout.new_task_pid as usize)
            .unwrap_or(0)
    };
    if child_pid <= 0 {
        return 0;
    }
    let child_pid = child_pid as u32;
    if TRACED_PIDS.insert(&child_pid, &TRACED_AS_CHILD, 0).is_err() {
        count(&FORKS_UNFOLLOWED);
        return 0;
    }
    mark_child(child_pid, true);
    // A Python server forking (a CLI agent, a verifier, a sandbox): the task that forks says
    // which request the child works for. Other processes' forks pay the one lookup.
    if python_thread(pid_tgid).is_some() {
        report_task_context(EventKind::SpawnContext, pid_tgid, -1, u64::from(child_pid));
    }
    emit(&ProcessForkEvent {
        header: header(EventKind::ProcessFork, pid_tgid, -1, 0),
        child_pid,
        _pad: 0,
    });
    0
}

/// Reports the end of a traced process: its last thread (`group_dead`), or on kernels whose
/// `sched_process_exit` lacks that field, its thread-group leader (see
/// `tracepoint_format::layout_from_formats` in user space for what that misses).
#[tracepoint]
pub fn process_exit(ctx: TracePointContext) -> u32 {
    let Some((pid_tgid, tgid)) = traced_tgid() else {
        return 0;
    };
    // Every thread's exit passes here: its context-read entry goes with it (a no-op for
    // threads that have none).
    let _ = PYTHON_THREADS.remove(&(pid_tgid as u32));
    let _ = PENDING_CALLS.remove(&pid_tgid);
    let layout = tracepoint_layout();
    let process_ends = if layout.exit_group_dead == FIELD_ABSENT {
        pid_tgid as u32 == tgid
    } else {
        // SAFETY: offset from the sched_process_exit format file; read through the helper.
        unsafe {
            ctx.read_at::<u8>(layout.exit_group_dead as usize)
                .unwrap_or(0)
                != 0
        }
    };
    if process_ends {
        mark_child(tgid, false);
        // A child the kernel added leaves the filter with its process, not when user space
        // reads the exit: a CLI that spawns hundreds of helpers a second on a busy host gets
        // ahead of the agent, and the filter must not fill with processes already gone.
        // SAFETY: the value is copied out at once.
        if unsafe { TRACED_PIDS.get(&tgid) }.copied() == Some(TRACED_AS_CHILD) {
            let _ = TRACED_PIDS.remove(&tgid);
        }
        emit(&header(EventKind::ProcessExit, pid_tgid, -1, 0));
    }
    0
}

/// An exec closes the process's close-on-exec sockets (all of Python's) without a `close`
/// call: user space ends their connections here. The pid stays traced.
#[tracepoint]
pub fn process_exec(_ctx: TracePointContext) -> u32 {
    let Some((pid_tgid, _)) = traced_tgid() else {
        return 0;
    };
    emit(&ProcessExecEvent {
        header: header(EventKind::ProcessExec, pid_tgid, -1, 0),
        // The new program's: the tracepoint runs after the exec took effect.
        comm: bpf_get_current_comm().unwrap_or_default(),
    });
    0
}

// ---------------------------------------------------------------------------------------
// sys_exit_*: one program for every syscall; the pending call says what the result means.
// ---------------------------------------------------------------------------------------

#[tracepoint]
pub fn exit_call(ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // Only threads of traced processes have entries: the others stop at the bitmaps.
    if !may_be_traced((pid_tgid >> 32) as u32) {
        return 0;
    }
    let Some(slot) = PENDING_CALLS.get_ptr_mut(&pid_tgid) else {
        return 0;
    };
    // SAFETY: the thread's own entry (see `remember_pending`), copied out, then marked done;
    // an entry already done (a traced thread's syscall that is no socket call) is not written.
    let call = unsafe { (*slot).pending };
    if call.call == CALL_NONE {
        return 0;
    }
    // SAFETY: as above.
    unsafe { (*slot).pending.call = CALL_NONE };
    if is_write_call(call.call) && injecting() && INJECT_ARMED.remove(&(pid_tgid as u32)).is_ok() {
        // The `sk_msg` program takes what it uses: what is left never reached it.
        count_at(&INJECTIONS, INJECT_NOT_DELIVERED);
    }
    // SAFETY: syscall exit tracepoint layout.
    let ret = unsafe { ctx.read_at::<i64>(RET).unwrap_or(-1) };
    match call.call {
        CALL_ACCEPT if ret >= 0 => on_open(pid_tgid, ret as i32, ROLE_SERVER),
        CALL_CONNECT if ret == 0 || ret == -EINPROGRESS => on_open(pid_tgid, call.fd, ROLE_CLIENT),
        CALL_ACCEPT | CALL_CONNECT => {}
        CALL_ON_UNKNOWN_SOCKET if ret > 0 => {
            count_at(&UNTRACKED, UNTRACKED_UNKNOWN_SOCKET_TRANSFER);
        }
        CALL_ON_UNKNOWN_SOCKET => {}
        _ if ret > 0 => {
            let read = on_transfer(pid_tgid, &call, ret as u64);
            if is_read_call(call.call) {
                // SAFETY: as above.
                unsafe { (*slot).last_read = read };
            }
        }
        _ => {}
    }
    if injecting() {
        scan_queued_inbound(&ctx);
    }
    0
}

fn on_open(pid_tgid: u64, fd: i32, role: u8) {
    // SAFETY: a helper with no arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let mut event = ConnOpenEvent {
        header: header(EventKind::ConnOpen, pid_tgid, fd, now),
        role,
        ..Default::default()
    };
    let Some(sk) = read_socket_addresses(fd, &mut event) else {
        return; // not a TCP socket over IPv4/IPv6
    };
    let capture = capture_bytes();
    let state = SocketState {
        conn_id: now,
        read_budget: capture,
        write_budget: capture,
        role,
        ignored: 0,
        peer_on_host: u8::from(peer_on_host(
            event.family,
            &event.local_addr,
            &event.peer_addr,
        )),
        _pad: 0,
        responses: 0,
        sk: tcp_sock_of(sk),
    };
    let key = SocketKey {
        tgid: (pid_tgid >> 32) as u32,
        fd,
    };
    if SOCKETS.insert(&key, &state, BPF_ANY as u64).is_err() {
        // Its transfers then count as transfers on unknown sockets.
        count_at(&UNTRACKED, UNTRACKED_SOCKET_MAP_FULL);
        return;
    }
    emit(&event);
}

#[inline(always)]
fn capture_bytes() -> u32 {
    // SAFETY: a global set at load time; read_volatile keeps the compiler from folding it.
    let value = unsafe { ptr::read_volatile(&CAPTURE_BYTES) };
    value.min(MAX_CAPTURE_BYTES as u32)
}

#[inline(always)]
unsafe fn kernel_u64(address: u64) -> Option<u64> {
    // SAFETY: the helper checks the address and fails cleanly on a bad one.
    unsafe { bpf_probe_read_kernel(address as *const u64).ok() }
}

#[inline(always)]
fn kernel_offsets() -> KernelOffsets {
    // SAFETY: a global set at load time; read_volatile keeps the compiler from folding it.
    unsafe { ptr::read_volatile(&KERNEL_OFFSETS) }
}

/// The current task's `struct file` for `fd` and its `private_data` (the `struct socket` if
/// the file is a socket): task → files → fdtable → fd[fd] → file.
fn file_of_fd(off: &KernelOffsets, fd: i32) -> Option<(u64, u64)> {
    if off.valid == 0 || fd < 0 {
        return None;
    }
    // SAFETY: every dereference goes through bpf_probe_read_kernel, which fails cleanly.
    unsafe {
        let task = bpf_get_current_task();
        let files = kernel_u64(task + off.task_files as u64)?;
        let fdt = kernel_u64(files + off.files_fdt as u64)?;
        let fd_array = kernel_u64(fdt + off.fdtable_fd as u64)?;
        let file = kernel_u64(fd_array + (fd as u64) * 8)?;
        let private_data = kernel_u64(file + off.file_private_data as u64)?;
        Some((file, private_data))
    }
}

/// Whether `fd` is a TCP socket over IPv4/IPv6: a socket's file is the one its `struct
/// socket` points back at. Reached only by transfers of traced processes on fds `SOCKETS`
/// does not hold. False when the offsets are unknown (such transfers are then not counted).
fn is_tcp_socket(fd: i32) -> bool {
    let off = kernel_offsets();
    let Some((file, socket)) = file_of_fd(&off, fd) else {
        return false;
    };
    // SAFETY: every dereference goes through bpf_probe_read_kernel, which fails cleanly.
    unsafe {
        if socket == 0 || kernel_u64(socket + off.socket_file as u64) != Some(file) {
            return false;
        }
        let socket_type =
            bpf_probe_read_kernel((socket + off.socket_type as u64) as *const u16).unwrap_or(0);
        let Some(sk) = kernel_u64(socket + off.socket_sk as u64) else {
            return false;
        };
        let family =
            bpf_probe_read_kernel((sk + off.sock_family as u64) as *const u16).unwrap_or(0);
        socket_type == SOCK_STREAM && (family == AF_INET || family == AF_INET6)
    }
}

/// Walks task → files → fdtable → file → socket → sock to fill in the 4-tuple, and returns
/// the `struct sock` (0 when it could not be read). None for sockets that are not TCP over
/// IPv4/IPv6. When the offsets are unknown, or a read fails, the connection is still traced,
/// just without addresses (family 0).
fn read_socket_addresses(fd: i32, event: &mut ConnOpenEvent) -> Option<u64> {
    let off = kernel_offsets();
    let Some((_, socket)) = file_of_fd(&off, fd) else {
        return Some(0);
    };
    // SAFETY: every dereference goes through bpf_probe_read_kernel, which fails cleanly.
    unsafe {
        let socket_type =
            bpf_probe_read_kernel((socket + off.socket_type as u64) as *const u16).unwrap_or(0);
        if socket_type != SOCK_STREAM {
            return None;
        }
        let Some(sk) = kernel_u64(socket + off.socket_sk as u64) else {
            return Some(0);
        };
        let family =
            bpf_probe_read_kernel((sk + off.sock_family as u64) as *const u16).unwrap_or(0);
        match family {
            AF_INET => {
                let peer: [u8; 4] =
                    bpf_probe_read_kernel((sk + off.sock_daddr as u64) as *const [u8; 4])
                        .unwrap_or([0; 4]);
                let local: [u8; 4] =
                    bpf_probe_read_kernel((sk + off.sock_rcv_saddr as u64) as *const [u8; 4])
                        .unwrap_or([0; 4]);
                event.peer_addr[..4].copy_from_slice(&peer);
                event.local_addr[..4].copy_from_slice(&local);
            }
            AF_INET6 => {
                event.peer_addr =
                    bpf_probe_read_kernel((sk + off.sock_v6_daddr as u64) as *const [u8; 16])
                        .unwrap_or([0; 16]);
                event.local_addr =
                    bpf_probe_read_kernel((sk + off.sock_v6_rcv_saddr as u64) as *const [u8; 16])
                        .unwrap_or([0; 16]);
            }
            _ => return None,
        }
        event.family = family;
        let dport = bpf_probe_read_kernel((sk + off.sock_dport as u64) as *const u16).unwrap_or(0);
        event.peer_port = u16::from_be(dport);
        event.local_port =
            bpf_probe_read_kernel((sk + off.sock_num as u64) as *const u16).unwrap_or(0);
        Some(sk)
    }
}

/// `struct iovec` in user memory.
#[repr(C)]
#[derive(Clone, Copy)]
struct UserIovec {
    base: u64,
    len: u64,
}

/// The first fields of `struct user_msghdr`.
#[repr(C)]
#[derive(Clone, Copy)]
struct UserMsghdr {
    name: u64,
    name_len: u64,
    iov: u64,
    iov_len: u64,
}

/// The iovec array and its length for a vectored call; a single-buffer call is one iovec.
#[inline(always)]
fn iovecs_of(call: &PendingCall, moved: u64) -> (u64, u64, UserIovec) {
    match call.call {
        CALL_READ_BUFFER | CALL_WRITE_BUFFER => (
            0,
            1,
            UserIovec {
                base: call.buffer,
                len: moved,
            },
        ),
        CALL_READ_MSGHDR | CALL_WRITE_MSGHDR => {
            // SAFETY: user memory read through the helper.
            let msg = unsafe { bpf_probe_read_user(call.buffer as *const UserMsghdr) };
            match msg {
                Ok(msg) => (msg.iov, msg.iov_len, UserIovec { base: 0, len: 0 }),
                Err(_) => (0, 0, UserIovec { base: 0, len: 0 }),
            }
        }
        _ => (call.buffer, call.count, UserIovec { base: 0, len: 0 }),
    }
}

#[inline(always)]
fn iovec_at(array: u64, index: u64, single: &UserIovec) -> Option<UserIovec> {
    if array == 0 {
        return if index == 0 { Some(*single) } else { None };
    }
    // SAFETY: user memory read through the helper.
    unsafe { bpf_probe_read_user((array + index * 16) as *const UserIovec).ok() }
}

/// HTTP/1.x messages start with a method (requests) or `HTTP` (responses). Seeing one resets
/// the capture budget of that direction, so each message's head is captured and its body,
/// beyond the budget, is reported by length only.
#[inline(always)]
fn starts_http_message(first: [u8; 4]) -> bool {
    matches!(
        &first,
        b"HTTP"
            | b"GET "
            | b"POST"
            | b"PUT "
            | b"HEAD"
            | b"DELE"
            | b"PATC"
            | b"OPTI"
            | b"CONN"
            | b"TRAC"
    )
}

/// Captures one transfer. For a read, returns what the thread last read: this read, if it
/// was on a traced server socket. A function of its own (a BPF-to-BPF call), like `on_open`:
/// inlined, its stack and `on_open`'s together would pass the verifier's 512 bytes.
#[inline(never)]
fn on_transfer(pid_tgid: u64, call: &PendingCall, moved: u64) -> LastRead {
    let tgid = (pid_tgid >> 32) as u32;
    let key = SocketKey { tgid, fd: call.fd };
    let Some(socket) = SOCKETS.get_ptr_mut(&key) else {
        return LastRead::default();
    };
    let reading = is_read_call(call.call);
    // SAFETY: a map value owned by this CPU for the duration of the program.
    let read = match unsafe { &*socket } {
        state if reading && state.role == ROLE_SERVER => LastRead {
            conn_id: state.conn_id,
            fd: call.fd,
            responses: state.responses,
        },
        _ => LastRead::default(),
    };
    let Some(event) = DATA_SCRATCH.get_ptr_mut(0) else {
        return read;
    };
    let (array, count, single) = iovecs_of(call, moved);
    let Some(first) = iovec_at(array, 0, &single) else {
        return read;
    };

    // SAFETY: `socket` and `event` point into map values owned by this CPU for the duration
    // of the program; user memory is read only through the helpers.
    unsafe {
        let socket = &mut *socket;
        let event = &mut *event;
        let first_bytes: [u8; 4] =
            bpf_probe_read_user(first.base as *const [u8; 4]).unwrap_or([0; 4]);
        let budget = if reading {
            &mut socket.read_budget
        } else {
            &mut socket.write_budget
        };
        let message_start = starts_http_message(first_bytes);
        if !reading && &first_bytes == b"HTTP" {
            socket.responses = socket.responses.wrapping_add(1);
        }
        if message_start {
            *budget = capture_bytes();
            if !reading {
                report_task_context(EventKind::TaskContext, pid_tgid, call.fd, socket.conn_id);
            }
        }
        // One byte short of the maximum, so that every length fits the mask.
        let want = moved.min(*budget as u64).min(CAPTURE_MASK as u64);

        let mut copied: u64 = 0;
        let mut seen: u64 = 0; // bytes of `moved` covered by the iovecs looked at so far
        let mut tail_from: u64 = 0;
        let mut tail_len: u64 = 0;
        for index in 0..MAX_IOVECS as u64 {
            if index >= count || seen >= moved {
                break;
            }
            let Some(iov) = iovec_at(array, index, &single) else {
                break;
            };
            let in_segment = iov.len.min(moved - seen);
            if copied < want {
                let offset = bounded(copied as usize, CAPTURE_MASK);
                let length = bounded(in_segment.min(want - copied) as usize, CAPTURE_MASK);
                let destination = event.payload.as_mut_ptr().add(offset);
                if probe_read_user_raw(destination.cast(), length as u32, iov.base as *const _) != 0
                {
                    break;
                }
                copied += length as u64;
            }
            seen += in_segment;
            if in_segment > 0 {
                tail_len = in_segment.min(TAIL_BYTES as u64);
                tail_from = iov.base + in_segment - tail_len;
            }
        }
        *budget = budget.saturating_sub(copied as u32);
        if reading && message_start && socket.role == ROLE_SERVER && injecting() {
            queue_inbound_scan(tgid, call.fd, socket, copied);
        }

        event.header = DataEventHeader {
            header: header(EventKind::Data, pid_tgid, call.fd, socket.conn_id),
            direction: if reading {
                DIRECTION_READ
            } else {
                DIRECTION_WRITE
            },
            flags: if call.seq_known != 0 {
                DATA_SEQ_KNOWN
            } else {
                0
            },
            tail_len: 0,
            captured_len: copied as u32,
            total_len: moved,
            seq: call.seq,
            _pad: 0,
        };
        if !reading && call.entered_ns != 0 {
            // When the bytes could first reach the peer (see `DataEventHeader`).
            event.header.header.timestamp_ns = call.entered_ns;
        }
        // The tail follows the head in the payload: a masked offset below MAX_CAPTURE_BYTES
        // plus at most TAIL_BYTES stays inside the doubled scratch payload.
        let head = bounded(copied as usize, CAPTURE_MASK);
        let mut tail = 0;
        if copied < moved && seen == moved && tail_len > 0 {
            let length = bounded(tail_len as usize, TAIL_MASK).min(TAIL_BYTES);
            let destination = event.payload.as_mut_ptr().add(head);
            if probe_read_user_raw(destination.cast(), length as u32, tail_from as *const _) == 0 {
                event.header.tail_len = length as u16;
                tail = length;
            }
        }

        let size = size_of::<DataEventHeader>() + head + bounded(tail, TAIL_MASK).min(TAIL_BYTES);
        let record =
            core::slice::from_raw_parts(ptr::from_mut(event).cast_const().cast::<u8>(), size);
        // With injection on, the agent must see a call's evidence before the handler writes
        // its next call, so a client write's record wakes it at once, unless the kernel knew
        // the handler's trace itself (task lineage), as it will for the next call.
        let flags = if !reading
            && socket.role == ROLE_CLIENT
            && injecting()
            && TRACE_KNOWN_AT_WRITE.remove(&(pid_tgid as u32)).is_err()
        {
            BPF_RB_FORCE_WAKEUP as u64
        } else {
            wakeup_flags()
        };
        if EVENTS.output::<[u8]>(record, flags).is_err() {
            count_lost();
        }
    }
    read
}

// ---------------------------------------------------------------------------------------
// OpenSSL uprobes: the plaintext of TLS connections. Attached by user space to each libssl
// file its traced processes map (every process that maps the file hits them, so each checks
// the PID filter first), entry and return: the plaintext and its length are known only at
// return for reads, and the bytes moved only at return for both.
// ---------------------------------------------------------------------------------------

#[inline(always)]
fn tls_enter(ctx: &ProbeContext, direction: u8, extended: bool) -> u32 {
    let Some((pid_tgid, _)) = traced_tgid() else {
        return 0;
    };
    let call = PendingTlsCall {
        ssl: ctx.arg::<u64>(0).unwrap_or(0),
        buffer: ctx.arg::<u64>(1).unwrap_or(0),
        moved_out: if extended {
            ctx.arg::<u64>(3).unwrap_or(0)
        } else {
            0
        },
        // SAFETY: a helper with no arguments.
        start_ns: unsafe { bpf_ktime_get_ns() },
        direction: u32::from(direction),
        _pad: 0,
    };
    if TLS_CALLS.insert(&pid_tgid, &call, BPF_ANY as u64).is_err() {
        count_at(&UNTRACKED, UNTRACKED_PENDING_CALLS_FULL);
    }
    0
}

/// `int SSL_write(SSL *ssl, const void *buf, int num)`
#[uprobe]
pub fn ssl_write(ctx: ProbeContext) -> u32 {
    tls_enter(&ctx, DIRECTION_WRITE, false)
}

/// `int SSL_write_ex(SSL *s, const void *buf, size_t num, size_t *written)`
#[uprobe]
pub fn ssl_write_ex(ctx: ProbeContext) -> u32 {
    tls_enter(&ctx, DIRECTION_WRITE, true)
}

/// `int SSL_read(SSL *ssl, void *buf, int num)`
#[uprobe]
pub fn ssl_read(ctx: ProbeContext) -> u32 {
    tls_enter(&ctx, DIRECTION_READ, false)
}

/// `int SSL_read_ex(SSL *ssl, void *buf, size_t num, size_t *readbytes)`
#[uprobe]
pub fn ssl_read_ex(ctx: ProbeContext) -> u32 {
    tls_enter(&ctx, DIRECTION_READ, true)
}

/// The return of any of the four: only a call its uprobe remembered (a traced process's) goes
/// further than the one lookup.
#[uretprobe]
pub fn ssl_return(ctx: RetProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: the value is copied out before the entry is removed.
    let Some(call) = (unsafe { TLS_CALLS.get(&pid_tgid) }).copied() else {
        return 0;
    };
    let _ = TLS_CALLS.remove(&pid_tgid);
    let returned: i32 = ctx.ret::<i32>();
    let moved = if call.moved_out != 0 {
        if returned != 1 {
            return 0;
        }
        user_u64(call.moved_out).unwrap_or(0)
    } else if returned > 0 {
        returned as u64
    } else {
        0
    };
    if moved > 0 && call.buffer != 0 {
        on_tls_transfer(pid_tgid, &call, moved);
    }
    0
}

/// Reports the plaintext of one TLS call: the head of each HTTP message (budgeted per `SSL*`
/// as for sockets) and the tail of what was not captured. A write that starts a message also
/// reports the writing task's context, as a socket write does.
fn on_tls_transfer(pid_tgid: u64, call: &PendingTlsCall, moved: u64) {
    let tgid = (pid_tgid >> 32) as u32;
    let Some(event) = TLS_SCRATCH.get_ptr_mut(0) else {
        return;
    };
    let reading = call.direction == u32::from(DIRECTION_READ);
    let key = TlsKey {
        ssl: call.ssl,
        tgid,
        _pad: 0,
    };
    // SAFETY: the value is copied out.
    let known = unsafe { TLS_BUDGETS.get(&key) }.copied();
    let mut budget = known.unwrap_or_default();
    // SAFETY: user memory is read only through the helpers; `event` points into a map value
    // owned by this CPU for the duration of the program.
    unsafe {
        let event = &mut *event;
        let first: [u8; 4] = bpf_probe_read_user(call.buffer as *const [u8; 4]).unwrap_or([0; 4]);
        let slot = if reading {
            &mut budget.read
        } else {
            &mut budget.write
        };
        let message_start = moved >= 4 && starts_http_message(first);
        if message_start {
            *slot = capture_bytes();
            if !reading {
                report_task_context(EventKind::TaskContext, pid_tgid, -1, call.ssl);
            }
        }
        let want = moved.min(*slot as u64).min(CAPTURE_MASK as u64);
        let mut copied = bounded(want as usize, CAPTURE_MASK);
        if copied > 0
            && probe_read_user_raw(
                event.payload.as_mut_ptr().cast(),
                copied as u32,
                call.buffer as *const _,
            ) != 0
        {
            copied = 0;
        }
        *slot = slot.saturating_sub(copied as u32);
        if message_start || copied > 0 {
            let _ = TLS_BUDGETS.insert(&key, &budget, BPF_ANY as u64);
        }
        event.header = TlsDataHeader {
            data: DataEventHeader {
                header: header(EventKind::TlsData, pid_tgid, -1, call.ssl),
                direction: if reading {
                    DIRECTION_READ
                } else {
                    DIRECTION_WRITE
                },
                // TLS plaintext has no place in the TCP byte stream.
                flags: 0,
                tail_len: 0,
                captured_len: copied as u32,
                total_len: moved,
                seq: 0,
                _pad: 0,
            },
            start_ns: call.start_ns,
        };
        let head = bounded(copied, CAPTURE_MASK);
        let mut tail = 0;
        if (copied as u64) < moved {
            let length = bounded(moved.min(TAIL_BYTES as u64) as usize, TAIL_MASK).min(TAIL_BYTES);
            let from = call.buffer + moved - length as u64;
            let destination = event.payload.as_mut_ptr().add(head);
            if probe_read_user_raw(destination.cast(), length as u32, from as *const _) == 0 {
                event.header.data.tail_len = length as u16;
                tail = length;
            }
        }
        let size = size_of::<TlsDataHeader>() + head + bounded(tail, TAIL_MASK).min(TAIL_BYTES);
        let record =
            core::slice::from_raw_parts(ptr::from_mut(event).cast_const().cast::<u8>(), size);
        if EVENTS.output::<[u8]>(record, wakeup_flags()).is_err() {
            count_lost();
        }
    }
}

/// A user-space u64, `None` when the read faults.
#[inline(always)]
fn user_u64(address: u64) -> Option<u64> {
    // SAFETY: the helper checks the address and fails cleanly on a bad one.
    unsafe { bpf_probe_read_user(address as *const u64).ok() }
}

/// The thread's [`PythonThread`] entry, when it is this process's and its layout is one
/// the kernel reads (`ctx_prev` right after `ob_type`, read in one go).
#[inline(always)]
pub(crate) fn python_thread(pid_tgid: u64) -> Option<PythonThread> {
    // SAFETY: the value is copied out.
    match unsafe { PYTHON_THREADS.get(&(pid_tgid as u32)) } {
        Some(thread)
            if thread.tgid == (pid_tgid >> 32) as u32
                && thread.context_prev == thread.object_type + 8 =>
        {
            Some(*thread)
        }
        _ => None,
    }
}

/// Reads the thread's contextvars chain into `chain`, innermost first: one read for
/// `PyThreadState.context`, then one 16-byte read (`ob_type`, `ctx_prev`) per link, each
/// link checked to be a `Context` before it is recorded or followed. Returns the links read,
/// why the walk stopped early ([`NO_STOP`] if it did not) and whether it ended at NULL (a
/// chain longer than [`MAX_CONTEXT_DEPTH`] did not).
#[inline(always)]
pub(crate) fn read_context_chain(
    thread: &PythonThread,
    chain: &mut [u64; MAX_CONTEXT_DEPTH],
) -> (usize, u32, bool) {
    let mut context = user_u64(thread.thread_state + thread.thread_context as u64).unwrap_or(0);
    let mut links = 0;
    let mut stopped = NO_STOP;
    for index in 0..MAX_CONTEXT_DEPTH {
        if context == 0 {
            break;
        }
        // SAFETY: user memory read through the helper.
        let Ok([kind, previous]) = (unsafe {
            bpf_probe_read_user((context + thread.object_type as u64) as *const [u64; 2])
        }) else {
            stopped = CONTEXT_READ_FAILED;
            break;
        };
        if kind != thread.context_type {
            stopped = CONTEXT_NOT_A_CONTEXT;
            break;
        }
        chain[index] = context;
        links = index + 1;
        context = previous;
    }
    (links, stopped, stopped == NO_STOP && context == 0)
}

/// Reports the writing thread's contextvars chain and, in a process whose task creations are
/// probed, the running task's lineage ([`lineage::writer_lineage`]), just before its data
/// record, if user space registered the thread as a CPython thread of this process. A
/// non-Python traced process pays the one lookup. A function of its own (a BPF-to-BPF call):
/// inlined, its locals would add to those of the exit program, whose stack and `on_open`'s
/// together must fit the verifier's 512 bytes.
#[inline(never)]
fn report_task_context(kind: EventKind, pid_tgid: u64, fd: i32, conn_id: u64) {
    let Some(thread) = python_thread(pid_tgid) else {
        count_at(&CONTEXT_READS, CONTEXT_THREAD_UNKNOWN);
        return;
    };
    let Some(mut entry) = EVENTS.reserve::<TaskContextEvent>(0) else {
        count_at(&CONTEXT_READS, CONTEXT_LOST);
        count_lost();
        return;
    };
    let record = entry.as_mut_ptr();
    let depth;
    let stopped;
    // SAFETY: `record` points at the reserved ring-buffer space, owned by this program until
    // it is submitted; every field is written before the submit. The chain is read straight
    // into it: the verifier counts every byte of stack.
    unsafe {
        (*record).header = header(kind, pid_tgid, fd, conn_id);
        (*record).chain = [0; MAX_CONTEXT_DEPTH];
        (*record).task = 0;
        (*record).lineage = TaskLineage::default();
        let (links, why, complete) = read_context_chain(&thread, &mut (*record).chain);
        stopped = why;
        // A chain cut short (a failed read, a link that is no Context, more links than
        // MAX_CONTEXT_DEPTH) lacks its loop's links: reported empty, never as a shorter
        // chain.
        depth = if complete { links as u32 } else { 0 };
        (*record).depth = depth;
        (*record).writer = lineage::writer_lineage(
            (pid_tgid >> 32) as u32,
            &(*record).chain,
            links,
            &mut (*record).task,
            &mut (*record).lineage,
        );
    }
    entry.submit(wakeup_flags());
    count_at(
        &CONTEXT_READS,
        if depth > 0 {
            CONTEXT_CHAIN_READ
        } else {
            CONTEXT_CHAIN_EMPTY
        },
    );
    if stopped != NO_STOP {
        count_at(&CONTEXT_READS, stopped);
    }
}

/// A walk that ended at NULL or at [`MAX_CONTEXT_DEPTH`].
pub(crate) const NO_STOP: u32 = u32::MAX;

// ---------------------------------------------------------------------------------------
// traceparent injection (`--inject-traceparent`): a traced process's outbound request,
// written by a handler task whose request's trace user space has published, gets a
// `traceparent` line after its request line. The write's enter checks the bytes and arms the
// line for the thread; `sk_msg`, inside the same call, inserts it; the exit disarms.
// ---------------------------------------------------------------------------------------

#[inline(always)]
fn injecting() -> bool {
    // SAFETY: a global set at load time; read_volatile keeps the compiler from folding it.
    unsafe { ptr::read_volatile(&INJECT_TRACEPARENT) != INJECT_OFF }
}

/// Whether a write on this client socket may carry the header: every one with
/// [`INJECT_ALL`], one to a peer off this host with [`INJECT_REMOTE`].
#[inline(always)]
fn injects_into(socket: &SocketState) -> bool {
    // SAFETY: as in `injecting`.
    match unsafe { ptr::read_volatile(&INJECT_TRACEPARENT) } {
        INJECT_ALL => true,
        INJECT_REMOTE => socket.peer_on_host == 0,
        _ => false,
    }
}

/// An 8-byte window of the scratch at `at` (masked into it), as a little-endian number.
#[inline(always)]
fn window(scan: &[u8; INJECT_SCAN_BYTES + 16], at: usize) -> u64 {
    let at = bounded(at, INJECT_SCAN_BYTES - 1);
    // SAFETY: `at` < INJECT_SCAN_BYTES and the scratch has 16 bytes beyond it.
    unsafe { ptr::read_unaligned(scan.as_ptr().add(at).cast::<u64>()) }
}

const LOWER_LETTERS: u64 = 0x2020_2020_2020_2000; // bytes 1..8: ASCII letters to lower case
const TRACEPA: u64 = u64::from_le_bytes(*b"\ntracepa");
const RENT_COLON: u64 = u64::from_le_bytes(*b"rent:\0\0\0");
const HTTP_1: u64 = u64::from_le_bytes(*b"HTTP/1.\0");

/// Arms the `traceparent` line for a request write of a traced client socket, when the write
/// starts a plaintext HTTP/1.x request whose head (all of it in the scanned bytes) carries
/// none, and the writing task's request has a published, still valid trace.
#[inline(always)]
fn arm_injection(pid_tgid: u64, fd: i32, call: u32, buffer: u64, count: u64, seq: u32) {
    let pending = PendingCall {
        call,
        fd: 0,
        buffer,
        count,
        seq,
        seq_known: 1,
        entered_ns: 0,
    };
    let (array, _, single) = iovecs_of(&pending, count);
    let Some(first) = iovec_at(array, 0, &single) else {
        return;
    };
    // SAFETY: user memory read through the helper.
    let Ok(start) = (unsafe { bpf_probe_read_user(first.base as *const [u8; 4]) }) else {
        return;
    };
    if !starts_http_message(start) || &start == b"HTTP" {
        return; // not the start of a request
    }
    let Some(scan) = INJECT_SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: per-CPU scratch owned by this program while it runs.
    let scan = unsafe { &mut *scan };
    let length = bounded(
        first.len.min(INJECT_SCAN_BYTES as u64) as usize,
        2 * INJECT_SCAN_BYTES - 1,
    )
    .min(INJECT_SCAN_BYTES);
    // SAFETY: at most INJECT_SCAN_BYTES into a scratch that has them.
    if unsafe {
        probe_read_user_raw(
            scan.as_mut_ptr().cast(),
            length as u32,
            first.base as *const _,
        )
    } != 0
    {
        return;
    }
    // Two passes over the bytes: the request line's end (an HTTP/1.x request line: the
    // header goes after it), then every line end, for an empty line (the head's end) or a
    // line that starts with `t` (a `traceparent` already there). The verifier walks a loop
    // once per state it can tell apart at its exits, so nothing but the flags is ever
    // compared after the loops: `insert_at` is only stored.
    let mut insert_at = 0;
    let mut request_line = false;
    for at in 0..INJECT_SCAN_BYTES {
        if at >= length {
            break;
        }
        if scan[bounded(at, INJECT_SCAN_BYTES - 1)] == b'\n' {
            request_line = at >= 9 && window(scan, at - 9) & 0x00ff_ffff_ffff_ffff == HTTP_1;
            insert_at = at + 1;
            break;
        }
    }
    if !request_line {
        count_at(&INJECTIONS, INJECT_HEAD_UNSCANNED);
        return;
    }
    let mut head_ends = false;
    let mut carried = false;
    for at in 0..INJECT_SCAN_BYTES {
        if at + 2 >= length {
            break;
        }
        if scan[bounded(at, INJECT_SCAN_BYTES - 1)] != b'\n' {
            continue;
        }
        let next = scan[bounded(at + 1, INJECT_SCAN_BYTES - 1)];
        if next == b'\r' {
            head_ends = true;
            break;
        }
        if next | 0x20 == b't'
            && at + 13 <= length
            && window(scan, at) | LOWER_LETTERS == TRACEPA
            && (window(scan, at + 8) | 0x0000_0000_2020_2020) & 0xff_ffff_ffff == RENT_COLON
        {
            carried = true;
            break;
        }
    }
    if carried {
        count_at(&INJECTIONS, INJECT_CARRIED);
        return;
    }
    if !head_ends {
        count_at(&INJECTIONS, INJECT_HEAD_UNSCANNED);
        return;
    }
    let Some(trace) = handler_trace(pid_tgid) else {
        return;
    };
    // Looked up again only now: a decision carried through the scans above would have the
    // verifier walk them once per outcome, past its instruction limit.
    let key = SocketKey {
        tgid: (pid_tgid >> 32) as u32,
        fd,
    };
    // SAFETY: the value is copied out.
    let Some(socket) = (unsafe { SOCKETS.get(&key) }).copied() else {
        return;
    };
    if !injects_into(&socket) {
        // A call on this host under `remote`: no header, the trace left for the callee.
        if let Some((client_port, server_port)) = ports_of(socket.sk) {
            let key = LocalCallKey {
                seq,
                client_port,
                server_port,
            };
            let _ = LOCAL_CALL_TRACES.insert(&key, &trace, BPF_ANY as u64);
            count_at(&INJECTIONS, INJECT_HANDED_OVER);
        }
        return;
    }
    let mut armed = ArmedInjection {
        line: *b"traceparent: 00-################################-################-01\r\n",
        _pad: [0; 2],
        insert_at: insert_at as u32,
        first_bytes: window(scan, 0),
    };
    hex_into(&mut armed.line, 16, &trace);
    hex_into(
        &mut armed.line,
        49,
        &tracer_abi::call_span_id(&trace, seq).to_be_bytes(),
    );
    let _ = INJECT_ARMED.insert(&(pid_tgid as u32), &armed, BPF_ANY as u64);
}

/// An inbound request's first read, whose captured head [`scan_inbound_trace`] looks at
/// for a `traceparent` once the exit program is done (see there why it is a program of its
/// own).
#[repr(C)]
#[derive(Clone, Copy)]
struct InboundScan {
    key: SocketKey,
    conn_id: u64,
    request: u32,
    /// Bytes of `DATA_SCRATCH`'s payload captured; 0: nothing queued.
    length: u32,
    /// Where the scan found the header's value (a scratch field, see the scan).
    position: u32,
    _pad: u32,
}

/// The scan queued by this CPU's exit program, for the program it tail-calls.
#[map]
static INBOUND_SCANS: PerCpuArray<InboundScan> = PerCpuArray::with_max_entries(1, 0);

/// Slot 0: [`scan_inbound_trace`], set by user space at load.
#[map]
static TAIL_CALLS: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// Field by field: the exit program's stack is at the verifier's limit.
#[inline(always)]
fn queue_inbound_scan(tgid: u32, fd: i32, socket: &SocketState, length: u64) {
    if let Some(scan) = INBOUND_SCANS.get_ptr_mut(0) {
        // SAFETY: a per-CPU value, owned by this program while it runs.
        unsafe {
            (*scan).key.tgid = tgid;
            (*scan).key.fd = fd;
            (*scan).conn_id = socket.conn_id;
            (*scan).request = socket.responses;
            (*scan).length = length.min(INJECT_SCAN_BYTES as u64) as u32;
        }
    }
}

/// Hands a queued scan to [`scan_inbound_trace`]: a tail call does not come back (on
/// success), so it is the exit program's last act.
#[inline(always)]
fn scan_queued_inbound(ctx: &TracePointContext) {
    let queued = INBOUND_SCANS
        .get_ptr_mut(0)
        // SAFETY: as in `queue_inbound_scan`.
        .is_some_and(|scan| unsafe { (*scan).length } != 0);
    if queued {
        // SAFETY: the tail-called program is a tracepoint program of the same context.
        unsafe { TAIL_CALLS.tail_call(ctx, 0) };
    }
}

/// The `traceparent` an inbound request's head carries in its first captured bytes (at most
/// [`INJECT_SCAN_BYTES`] looked at), kept as the trace of that request (its connection and
/// number): `traceparent: 00-<32 hex>-...`, the name in any case, up to two spaces after the
/// colon. A request without one (or with another version, a malformed value, a zero trace)
/// gets the trace [`minted_trace`] gives it, which user space computes too, so that its
/// handler's first call carries the trace its spans are exported in. Run by a
/// tail call from the exit program, after its record went out: the scan's loop, checked as
/// part of the exit program, took the verifier past its million instructions (it checks a
/// function once per path that calls it); as a program of its own it is checked once.
#[tracepoint]
pub fn scan_inbound_trace(_ctx: TracePointContext) -> u32 {
    let (Some(queued), Some(event)) = (INBOUND_SCANS.get_ptr_mut(0), DATA_SCRATCH.get_ptr(0))
    else {
        return 0;
    };
    // SAFETY: per-CPU values, owned by this program while it runs (the exit program that
    // filled them tail-called it on this CPU).
    let (scan, payload, seq) = unsafe {
        let scan = *queued;
        (*queued).length = 0;
        let header = &(*event).header;
        let seq = (header.flags & DATA_SEQ_KNOWN != 0).then_some(header.seq);
        (scan, &(*event).payload, seq)
    };
    let trace = carried_trace(payload, scan.length as usize, queued)
        .or_else(|| handed_over_trace(&scan, seq))
        .unwrap_or_else(|| {
            // SAFETY: as in `injecting`.
            let key = unsafe { ptr::read_volatile(&MINT_KEY) };
            minted_trace(key, scan.key.tgid, scan.conn_id, scan.request)
        });
    let entry = InboundTrace {
        trace,
        conn_id: scan.conn_id,
        request: scan.request,
        _pad: 0,
    };
    let _ = INBOUND_TRACES.insert(&scan.key, &entry, BPF_ANY as u64);
    0
}

/// The trace a caller on this host left for this request (see [`LocalCallKey`]), taken.
#[inline(always)]
fn handed_over_trace(scan: &InboundScan, seq: Option<u32>) -> Option<[u8; 16]> {
    let seq = seq?;
    // SAFETY: the value is copied out.
    let socket = unsafe { SOCKETS.get(&scan.key) }.copied()?;
    let (server_port, client_port) = ports_of(socket.sk)?;
    let key = LocalCallKey {
        seq,
        client_port,
        server_port,
    };
    // SAFETY: the value is copied out.
    let trace = unsafe { LOCAL_CALL_TRACES.get(&key) }.copied()?;
    let _ = LOCAL_CALL_TRACES.remove(&key);
    Some(trace)
}

/// A socket's (local, peer) ports, from its `struct sock`.
#[inline(always)]
fn ports_of(sk: u64) -> Option<(u16, u16)> {
    if sk == 0 {
        return None;
    }
    let off = kernel_offsets();
    // SAFETY: read through the helper, which fails cleanly on a bad address.
    unsafe {
        let local = bpf_probe_read_kernel((sk + off.sock_num as u64) as *const u16).ok()?;
        let peer = bpf_probe_read_kernel((sk + off.sock_dport as u64) as *const u16).ok()?;
        Some((local, u16::from_be(peer)))
    }
}

/// The trace of the `traceparent` in the first `length` bytes of `payload`, if it is valid.
#[inline(always)]
fn carried_trace(
    payload: &[u8; 2 * MAX_CAPTURE_BYTES],
    length: usize,
    queued: *mut InboundScan,
) -> Option<[u8; 16]> {
    let byte = |at: usize| payload[bounded(at, 2 * MAX_CAPTURE_BYTES - 1)];
    let window = |at: usize| {
        let at = bounded(at, MAX_CAPTURE_BYTES - 1);
        // SAFETY: `at` < MAX_CAPTURE_BYTES and the payload has twice that.
        unsafe { ptr::read_unaligned(payload.as_ptr().add(at).cast::<u64>()) }
    };
    let mut value = 0;
    for at in 0..INJECT_SCAN_BYTES {
        if at + 64 >= length {
            break;
        }
        if byte(at) != b'\n' {
            continue;
        }
        // The blank line that ends the head: the body (Gym's are KBs of JSON) is not scanned.
        if matches!(byte(at + 1), b'\r' | b'\n') {
            break;
        }
        if window(at) | LOWER_LETTERS == TRACEPA
            && (window(at + 8) | 0x0000_0000_2020_2020) & 0xff_ffff_ffff == RENT_COLON
        {
            value = at + 13;
            break;
        }
    }
    if value == 0 {
        return None;
    }
    // Through a map value, the verifier forgets which of the positions matched: otherwise it
    // checks what follows once per position, past its instruction limit.
    // SAFETY: as above.
    let mut value = unsafe {
        ptr::write_volatile(&raw mut (*queued).position, value as u32);
        ptr::read_volatile(&raw const (*queued).position) as usize & (MAX_CAPTURE_BYTES - 1)
    };
    for _ in 0..2 {
        if byte(value) == b' ' {
            value += 1;
        }
    }
    if window(value) & 0xff_ffff != VERSION_00 || byte(value + 35) != b'-' {
        return None;
    }
    // Branch-free, through a table: a branch per digit would have the verifier walk every
    // combination of digit kinds.
    let mut trace = [0u8; 16];
    let (mut invalid, mut any) = (0u8, 0u8);
    for index in 0..16 {
        let high = HEX_DIGITS[byte(value + 3 + 2 * index) as usize];
        let low = HEX_DIGITS[byte(value + 4 + 2 * index) as usize];
        invalid |= high | low;
        trace[index] = (high << 4) | (low & 0x0f);
        any |= trace[index];
    }
    (invalid & 0xf0 == 0 && any != 0).then_some(trace)
}

const VERSION_00: u64 = u64::from_le_bytes(*b"00-\0\0\0\0\0");

/// A byte's value as a hex digit, 0xff for any other byte.
static HEX_DIGITS: [u8; 256] = {
    let mut table = [0xffu8; 256];
    let mut digit = 0;
    while digit < 10 {
        table[b'0' as usize + digit] = digit as u8;
        digit += 1;
    }
    let mut letter = 0;
    while letter < 6 {
        table[b'a' as usize + letter] = 10 + letter as u8;
        table[b'A' as usize + letter] = 10 + letter as u8;
        letter += 1;
    }
    table
};

#[inline(always)]
fn hex_into<const N: usize>(line: &mut [u8; TRACEPARENT_LINE], at: usize, bytes: &[u8; N]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (index, byte) in bytes.iter().enumerate() {
        line[at + 2 * index] = DIGITS[(byte >> 4) as usize];
        line[at + 2 * index + 1] = DIGITS[(byte & 15) as usize];
    }
}

/// The trace published for the writing task: with `--task-lineage`, its request root's;
/// else the first link of its contextvars chain that has one. Used only if that entry's
/// request is still unanswered (else it is deleted: the context's address now belongs to
/// another request). Counts why there is none.
#[inline(always)]
fn handler_trace(pid_tgid: u64) -> Option<[u8; 16]> {
    let tgid = (pid_tgid >> 32) as u32;
    let Some(thread) = python_thread(pid_tgid) else {
        count_at(&INJECTIONS, INJECT_NO_TRACE);
        return None;
    };
    let mut chain = [0u64; MAX_CONTEXT_DEPTH];
    let (links, _, _) = read_context_chain(&thread, &mut chain);
    let mut task = 0;
    let mut lineage = TaskLineage::default();
    let writer = lineage::writer_lineage(tgid, &chain, links, &mut task, &mut lineage);
    if writer == WRITER_TASK && lineage.kind == LINEAGE_REQUEST {
        if let Some(trace) = inbound_trace(tgid, &lineage) {
            let _ = TRACE_KNOWN_AT_WRITE.insert(&(pid_tgid as u32), &1, BPF_ANY as u64);
            return Some(trace);
        }
        let key = InjectKey {
            tgid,
            kind: INJECT_BY_ORIGIN,
            handler: lineage.origin,
        };
        if let Some(found) = published_trace(tgid, &key) {
            return found;
        }
    }
    for index in 0..MAX_CONTEXT_DEPTH {
        if index >= links {
            break;
        }
        let key = InjectKey {
            tgid,
            kind: INJECT_BY_CONTEXT,
            handler: chain[index],
        };
        if let Some(found) = published_trace(tgid, &key) {
            return found;
        }
    }
    count_at(&INJECTIONS, INJECT_NO_TRACE);
    None
}

/// The trace the inbound request a request root was born for carried in its own
/// `traceparent`, while that request is unanswered.
#[inline(always)]
fn inbound_trace(tgid: u32, lineage: &TaskLineage) -> Option<[u8; 16]> {
    if lineage.birth_conn_id == 0 {
        return None;
    }
    let key = SocketKey {
        tgid,
        fd: lineage.birth_fd,
    };
    // SAFETY: the values are copied out.
    let (entry, socket) = unsafe { (INBOUND_TRACES.get(&key).copied()?, SOCKETS.get(&key)?) };
    let born_for = |conn_id: u64, request: u32| {
        conn_id == lineage.birth_conn_id && request == lineage.birth_responses
    };
    (born_for(entry.conn_id, entry.request) && born_for(socket.conn_id, socket.responses))
        .then_some(entry.trace)
}

/// The trace published under `key`, if any: `Some(Some(trace))` while its request is
/// unanswered, `Some(None)` (the entry deleted, counted) once it is.
#[inline(always)]
fn published_trace(tgid: u32, key: &InjectKey) -> Option<Option<[u8; 16]>> {
    // SAFETY: the value is copied out.
    let entry = unsafe { INJECT_TRACES.get(key) }.copied()?;
    let owner = SocketKey {
        tgid,
        fd: entry.owner_fd,
    };
    // SAFETY: the value is copied out.
    let unanswered = unsafe { SOCKETS.get(&owner) }.is_some_and(|socket| {
        socket.conn_id == entry.owner_conn_id && socket.responses == entry.owner_responses
    });
    if unanswered {
        return Some(Some(entry.trace));
    }
    let _ = INJECT_TRACES.remove(key);
    count_at(&INJECTIONS, INJECT_OWNER_DONE);
    Some(None)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    loop {}
}
