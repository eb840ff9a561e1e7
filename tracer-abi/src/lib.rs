//! The kernel/user ABI of gym-tracer: every struct that crosses the ring buffer or sits in a
//! map shared by the eBPF programs and the agent. `#[repr(C)]`, fixed sizes asserted at
//! compile time, so a change on one side that the other does not know about fails the build.
#![no_std]

/// Upper bound on the bytes of one read/write that the kernel copies to user space.
///
/// A power of two so the eBPF side can bound offsets with a mask (the verifier needs a
/// provable bound); the per-CPU scratch value holds twice this, and a per-CPU value of
/// 32 KiB or more fails with E2BIG on the target kernel.
pub const MAX_CAPTURE_BYTES: usize = 8192;

/// Default for `--capture-bytes`: enough for a request line and several KiB of headers.
pub const DEFAULT_CAPTURE_BYTES: u32 = 4096;

/// Bytes taken from the end of every read/write whose data was not captured in full: user space
/// sees the terminating `0\r\n\r\n` of a chunked body, Gym's `_ng_*` ids, which sit in the
/// last ~40–100 bytes of an 11 KB request body, and the `usage` object at the end of a model
/// response (~250 bytes with OpenAI's `*_details` and the fields after it), without receiving
/// the body. They follow the captured head in the record's payload. A power of two.
pub const TAIL_BYTES: usize = 512;

/// How many iovecs of one `readv`/`writev`/`sendmsg`/`recvmsg` are looked at.
pub const MAX_IOVECS: u32 = 4;

/// The kernel wakes the agent only once this many bytes wait on the ring buffer; below it
/// records are posted without a wake-up and the agent drains the ring every
/// [`RING_DRAIN_INTERVAL_MS`]. A wake-up per record cost the agent more than the records.
pub const RING_WAKEUP_BYTES: u64 = 256 * 1024;

/// How often the agent drains the ring buffer without being woken. Each drain is a wake-up
/// of the agent whether or not anything waits, so this is its idle cost (10 per second);
/// busy hosts reach [`RING_WAKEUP_BYTES`] first and are drained sooner. A drain runs with the
/// agent's caches cold (the traced servers and the load ran in between), so its cost per
/// request falls with the batch: 25 ms cost ~25 % more CPU per request than 100 ms, and 5 ms
/// about 4 µs more at 600 requests/s in wake-ups alone. Spans wait for their stitch delay
/// (500 ms) anyway; traceparent injection wakes the agent itself.
pub const RING_DRAIN_INTERVAL_MS: u64 = 100;

/// Kinds of record on the ring buffer; the first byte of every record.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    ConnOpen = 1,
    Data = 2,
    ConnClose = 3,
    ProcessExit = 4,
    ProcessFork = 5,
    /// A traced process replaced its program (`execve`): the sockets it had open close
    /// without a `close` call the agent could see.
    ProcessExec = 6,
    /// The contextvars chain of the Python task that is writing a message (see
    /// [`TaskContextEvent`]); it precedes that write's [`EventKind::Data`] record, or for
    /// TLS that write's [`EventKind::TlsData`] record (then `fd` is -1 and `conn_id` the
    /// `SSL*`).
    TaskContext = 7,
    /// Plaintext a traced process passed to or got from OpenSSL (see [`TlsDataHeader`]).
    TlsData = 8,
    /// The contextvars chain of the Python task that is forking a process (a
    /// [`TaskContextEvent`] whose `conn_id` is the child's pid, `fd` -1); it precedes the
    /// fork's [`EventKind::ProcessFork`] record. Only for a thread user space registered.
    SpawnContext = 9,
}

impl EventKind {
    pub fn from_u8(value: u8) -> Option<Self> {
        match value {
            1 => Some(Self::ConnOpen),
            2 => Some(Self::Data),
            3 => Some(Self::ConnClose),
            4 => Some(Self::ProcessExit),
            5 => Some(Self::ProcessFork),
            6 => Some(Self::ProcessExec),
            7 => Some(Self::TaskContext),
            8 => Some(Self::TlsData),
            9 => Some(Self::SpawnContext),
            _ => None,
        }
    }
}

/// Which end of the TCP connection the traced process is.
pub const ROLE_SERVER: u8 = 1;
pub const ROLE_CLIENT: u8 = 2;

/// Direction of a data transfer, seen from the traced process.
pub const DIRECTION_READ: u8 = 1;
pub const DIRECTION_WRITE: u8 = 2;

/// Address families as the kernel reports them in `sock_common.skc_family`.
pub const AF_INET: u16 = 2;
pub const AF_INET6: u16 = 10;

/// Common prefix of every ring-buffer record.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct EventHeader {
    /// An [`EventKind`] as u8.
    pub kind: u8,
    pub _pad: [u8; 3],
    /// Thread-group id (the process id user space knows).
    pub tgid: u32,
    /// Thread id.
    pub tid: u32,
    pub fd: i32,
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) when the syscall returned; for a data record's
    /// write, when it was entered (see [`DataEventHeader`]).
    pub timestamp_ns: u64,
    /// Identifies one connection across fd reuse: the monotonic time it was opened.
    pub conn_id: u64,
}

/// A TCP connection was accepted or connected by a traced process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ConnOpenEvent {
    pub header: EventHeader,
    /// [`ROLE_SERVER`] or [`ROLE_CLIENT`].
    pub role: u8,
    pub _pad: u8,
    /// [`AF_INET`], [`AF_INET6`], or 0 when the socket could not be read.
    pub family: u16,
    /// Host byte order.
    pub local_port: u16,
    /// Host byte order.
    pub peer_port: u16,
    /// IPv4 in the first four bytes, or IPv6; network byte order.
    pub local_addr: [u8; 16],
    pub peer_addr: [u8; 16],
}

/// Fixed part of a data record. The payload follows it on the ring: `captured_len` bytes from
/// the start of the transfer, then `tail_len` bytes from its end.
///
/// `header.timestamp_ns` is when the bytes moved as each end saw them: a write's entry (its
/// bytes may reach the peer from then on) and a read's return (they had arrived). So the
/// writer of a message never stamps a byte later than its reader: a callee's SERVER span lies
/// within its caller's CLIENT span even when the writer's syscall returns late (on loopback
/// the receiver runs, on the other CPU, before the sender's write returns; 1.5 ms was seen).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DataEventHeader {
    pub header: EventHeader,
    /// [`DIRECTION_READ`] or [`DIRECTION_WRITE`].
    pub direction: u8,
    /// [`DATA_SEQ_KNOWN`] when `seq` holds the transfer's TCP sequence number.
    pub flags: u8,
    /// Bytes of the transfer's end that follow the captured head in the payload (at most
    /// [`TAIL_BYTES`]); 0 when the whole transfer was captured. They are the last bytes of
    /// the transfer's last buffer (a vectored call's last iovec), and may repeat bytes of the
    /// head when the transfer is only a little longer than the capture.
    pub tail_len: u16,
    /// Bytes of the transfer's start in the payload.
    pub captured_len: u32,
    /// Bytes the syscall actually moved (its return value).
    pub total_len: u64,
    /// The TCP sequence number of the transfer's first byte, read at the syscall's entry:
    /// `tcp_sock.write_seq` for a write, `copied_seq` for a read. Both ends of a connection
    /// agree on it (the sender's write_seq of a byte is the receiver's copied_seq of it), so it
    /// keys a message across hosts.
    pub seq: u32,
    pub _pad: u32,
}

/// [`DataEventHeader::flags`]: `seq` is known.
pub const DATA_SEQ_KNOWN: u8 = 1;

/// The span id of the CLIENT span of a call that another agent must name without seeing it:
/// the request, in trace `trace`, whose first byte has TCP sequence number `seq`. The caller's
/// agent exports its CLIENT span with it, its kernel writes it into an injected
/// `traceparent`, and the callee's agent (on another host, sharing nothing) names it as the
/// SERVER span's parent. Both ends know the trace (the header, or a rollout id both see) and
/// the number, which NAT leaves alone (unlike the addresses).
///
/// Why the trace goes in: a sequence number alone is 32 bits, and the numbers of one host's
/// connections are far from independent, so calls of two rollouts shared ids. With the
/// trace, two calls share an id only if they are in one trace and their first bytes have one
/// number; the stitcher checks for that before export.
///
/// SplitMix64's finalizer, twice, over the trace's two halves and a tag with the number in
/// its low 32 bits: for one trace a bijection of the number (two requests of a trace with
/// different numbers never share an id), and cheap enough for an eBPF program. Changing it
/// breaks joins between agents of two versions: it is versioned by its tag.
pub const fn call_span_id(trace: &[u8; 16], seq: u32) -> u64 {
    const TAG_V2: u64 = 0x6774_7232; // "gtr2"
    let high = u64::from_be_bytes([
        trace[0], trace[1], trace[2], trace[3], trace[4], trace[5], trace[6], trace[7],
    ]);
    let low = u64::from_be_bytes([
        trace[8], trace[9], trace[10], trace[11], trace[12], trace[13], trace[14], trace[15],
    ]);
    let id = splitmix64_finalizer(splitmix64_finalizer(high ^ ((TAG_V2 << 32) | seq as u64)) ^ low);
    // 0 is not a valid span id; the one (trace, seq) that gives it gets 1.
    if id == 0 { 1 } else { id }
}

/// `INJECT_TRACEPARENT`, the eBPF side's global: no request is changed.
pub const INJECT_OFF: u32 = 0;
/// `INJECT_TRACEPARENT`: every outbound request of a traced process may carry the header.
pub const INJECT_ALL: u32 = 1;
/// `INJECT_TRACEPARENT`: only requests to a peer that is not on this host (not loopback, not
/// the socket's own address) may; the others go out byte for byte.
pub const INJECT_REMOTE: u32 = 2;

/// Whether a connection's peer is on this host: loopback, or the connection's own address (a
/// connection to one of the host's addresses gets that address as its source). Under
/// [`INJECT_REMOTE`] such a call goes out unchanged, and so does one whose addresses could
/// not be read (`family` 0). The kernel decides it at connect, user space from the same
/// addresses.
#[inline(always)]
pub fn peer_on_host(family: u16, local: &[u8; 16], peer: &[u8; 16]) -> bool {
    match family {
        AF_INET => peer[0] == 127 || local[..4] == peer[..4],
        AF_INET6 => {
            const LOOPBACK: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
            const V4_MAPPED: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];
            *peer == LOOPBACK || (peer[..12] == V4_MAPPED && peer[12] == 127) || local == peer
        }
        _ => true,
    }
}

/// The trace of an inbound request that carries no `traceparent`, on a host whose agent
/// injects: the kernel gives it as it reads the request, so that the handler's calls carry
/// it from their first, and user space computes the same from what it sees of the request
/// (its process, connection and ordinal), so the exported trace is the one on the wire.
///
/// `key` is the agent's secret, random per run, so that traces of two runs or two hosts are
/// as independent as random ones. Injective in (`conn_id`, `tgid`, `request`): `high` is, for
/// one connection, a bijection of (`tgid`, `request`), and `low` a bijection of `conn_id`
/// for one `high`; so two requests share a trace only if they share all three.
pub const fn minted_trace(key: [u64; 2], tgid: u32, conn_id: u64, request: u32) -> [u8; 16] {
    let per_connection = splitmix64_finalizer(key[0] ^ conn_id);
    let high = splitmix64_finalizer(per_connection ^ (((tgid as u64) << 32) | request as u64));
    let low = splitmix64_finalizer(key[1] ^ high ^ conn_id);
    let (high, low) = (high.to_be_bytes(), low.to_be_bytes());
    let mut trace = [0u8; 16];
    let mut index = 0;
    while index < 8 {
        trace[index] = high[index];
        trace[8 + index] = low[index];
        index += 1;
    }
    // An all-zero trace is invalid; the one input that gives it gets ...01.
    if u64::from_be_bytes(high) == 0 && u64::from_be_bytes(low) == 0 {
        trace[15] = 1;
    }
    trace
}

/// SplitMix64's output function: a bijection of `u64` that spreads every input bit.
const fn splitmix64_finalizer(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The per-CPU scratch value in which the eBPF side assembles a data record.
///
/// The payload is twice [`MAX_CAPTURE_BYTES`] so that a masked offset plus a masked length
/// always stays inside it, which is what lets the verifier accept the copy loop; the tail goes
/// at a masked offset too (below [`MAX_CAPTURE_BYTES`]), so head and tail always fit.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DataEvent {
    pub header: DataEventHeader,
    pub payload: [u8; 2 * MAX_CAPTURE_BYTES],
}

/// Fixed part of a TLS plaintext record, from the uprobes on `SSL_write`, `SSL_read` and their
/// `_ex` forms: `data.header.fd` is -1 (OpenSSL does not know it) and `data.header.conn_id`
/// is the `SSL*`, which user space maps to a connection (see `reassembly::tls`). The payload
/// follows as for [`DataEventHeader`]; `timestamp_ns` is when the call returned.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TlsDataHeader {
    pub data: DataEventHeader,
    /// `bpf_ktime_get_ns()` when the call was entered: a blocking socket's own read or write
    /// happens between the two, on the same thread.
    pub start_ns: u64,
}

/// The per-CPU scratch value in which a TLS plaintext record is assembled (as [`DataEvent`]).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TlsDataEvent {
    pub header: TlsDataHeader,
    pub payload: [u8; 2 * MAX_CAPTURE_BYTES],
}

/// An `SSL_read`/`SSL_write` call between its uprobe and its uretprobe, per thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PendingTlsCall {
    pub ssl: u64,
    pub buffer: u64,
    /// The `_ex` forms' `size_t *` out-argument for the bytes moved; 0 for the plain forms,
    /// whose return value is that count.
    pub moved_out: u64,
    pub start_ns: u64,
    /// [`DIRECTION_READ`] or [`DIRECTION_WRITE`].
    pub direction: u32,
    pub _pad: u32,
}

/// Key of the kernel's per-`SSL*` capture budgets (an `SSL*` is an address in one process).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TlsKey {
    pub ssl: u64,
    pub tgid: u32,
    pub _pad: u32,
}

/// Bytes of the current message still to be captured, per direction, for one `SSL*` (the
/// TLS counterpart of [`SocketState`]'s budgets).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TlsBudget {
    pub read: u32,
    pub write: u32,
}

/// `SSL*`s whose budgets the kernel keeps (an LRU: one evicted only loses the capture of a
/// message's continuation).
pub const MAX_TLS_SESSIONS: u32 = 16384;

/// A traced process created a new process (not a thread: the kernel skips those). The
/// kernel has already added `child_pid` to the PID filter so that nothing the child does
/// is missed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessForkEvent {
    /// `header.tgid` is the parent process.
    pub header: EventHeader,
    pub child_pid: u32,
    pub _pad: u32,
}

/// A traced process replaced its program. `comm` is the new program's task name (its file's
/// base name, cut at 15 bytes, NUL-padded), read as the exec happens: the process may be
/// gone before user space reads /proc, as a CLI's short-lived helpers are on a busy host.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessExecEvent {
    pub header: EventHeader,
    pub comm: [u8; 16],
}

/// Contexts read per chain: `PyThreadState.context`, then `ctx_prev` links. An asyncio
/// server's chain is 3 to 5 deep (the task's, the handler's, the event loop's two).
pub const MAX_CONTEXT_DEPTH: usize = 8;

/// The running task's contextvars chain in a traced CPython thread, read when that thread
/// writes the first bytes of an HTTP message (a request line, a status line) to a traced
/// socket. Emitted just before that write's data record, for the same `tgid`/`fd`/`conn_id`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct TaskContextEvent {
    pub header: EventHeader,
    /// Valid entries of `chain` (0 when the first read failed).
    pub depth: u32,
    /// What the writing task's lineage is (`WRITER_*`); [`WRITER_LINEAGE_OFF`] in a process
    /// whose task creations are not probed.
    pub writer: u32,
    /// Context addresses, innermost first; the walk stops at NULL, at a non-`Context`
    /// object, or at [`MAX_CONTEXT_DEPTH`].
    pub chain: [u64; MAX_CONTEXT_DEPTH],
    /// The running task (`TaskObj*`) when one was found, else 0.
    pub task: u64,
    /// Its lineage, when `writer` is [`WRITER_TASK`].
    pub lineage: TaskLineage,
}

/// What the kernel needs to read one CPython thread's running context: filled by user space
/// per thread id of a traced process whose interpreter it recognised.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonThread {
    /// Address of the thread's `PyThreadState`.
    pub thread_state: u64,
    /// Address of `PyContext_Type`: every link must be an object of this type.
    pub context_type: u64,
    /// `PyThreadState.context`.
    pub thread_context: u32,
    /// `PyContext.ctx_prev`. The kernel reads `ob_type` and `ctx_prev` in one 16-byte read,
    /// so this must be `object_type + 8` (16 and 8 in CPython 3.12 to 3.14); an entry that
    /// says otherwise is not used.
    pub context_prev: u32,
    /// `PyObject.ob_type`.
    pub object_type: u32,
    /// The process the thread belongs to: an entry is used only by that process's thread
    /// (a thread id outlives nothing, but an entry may outlive its thread by a rescan).
    pub tgid: u32,
}

/// Threads the `PYTHON_THREADS` map holds.
pub const MAX_PYTHON_THREADS: u32 = 16384;

/// Slots of the kernel's `CONTEXT_READS` per-CPU counter map: what happened at each
/// message-start write of a traced process (see [`TaskContextEvent`]).
/// A chain of at least one context was read and reported.
pub const CONTEXT_CHAIN_READ: u32 = 0;
/// The writing thread has no `PYTHON_THREADS` entry (not Python, runtime off, or a thread
/// started since the agent's last rescan): nothing was read or reported.
pub const CONTEXT_THREAD_UNKNOWN: u32 = 1;
/// The thread's current context was NULL or could not be read: reported with depth 0.
pub const CONTEXT_CHAIN_EMPTY: u32 = 2;
/// A walk stopped early at an object that is not a `Context` (never followed further).
pub const CONTEXT_NOT_A_CONTEXT: u32 = 3;
/// A read of a link or of its type failed mid-walk (the chain holds what was read before).
pub const CONTEXT_READ_FAILED: u32 = 4;
/// The ring buffer was full: no context record (the data record may follow).
pub const CONTEXT_LOST: u32 = 5;
pub const CONTEXT_OUTCOMES: u32 = 6;

// ---------------------------------------------------------------------------------------
// Task lineage (`--task-lineage`): which inbound request's handler made the running task
// ---------------------------------------------------------------------------------------

/// Bytes of the request-root coroutine's qualified name the kernel compares.
pub const ROOT_NAME_BYTES: usize = 32;

/// What the kernel needs to find the running asyncio task of a traced CPython process and to
/// recognise the task a server creates for each inbound request: written by user space when
/// it attaches the task-creation probe to the process (`task_created`). CPython 3.12 and
/// 3.13 keep the running task of each event loop in `_asyncio`'s module state
/// (`current_tasks`, a dict `{loop: task}`) and no link from a task to the task that
/// created it; the probe records that link at every `Task.__init__`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AsyncioProcess {
    /// `current_tasks`, found by the probe's first hit from the created task's type
    /// (`ht_module` → `md_state` → `current_tasks`); 0 until then. Its module lives as long
    /// as the interpreter, so it is looked up once.
    pub current_tasks: u64,
    /// `&PyDict_Type`: `current_tasks` must be a dict.
    pub dict_type: u64,
    /// `&PyCoro_Type`: a created task's coroutine is checked to be a coroutine before its
    /// name is read.
    pub coroutine_type: u64,
    /// `TaskObj.task_context`.
    pub task_context: u32,
    /// `PyHeapTypeObject.ht_module`.
    pub type_module: u32,
    /// `PyModuleObject.md_state`.
    pub module_state: u32,
    /// `asyncio_state.current_tasks` (private to `_asynciomodule.c`).
    pub state_current_tasks: u32,
    /// `PyCoroObject.cr_qualname`.
    pub coroutine_qualname: u32,
    /// Compact ASCII string: `length`, first byte.
    pub ascii_length: u32,
    pub ascii_data: u32,
    /// Bytes of `root_name` that count.
    pub root_name_len: u32,
    /// The qualified name of the coroutine the server runs each inbound request in
    /// (uvicorn's `RequestResponseCycle.run_asgi`): a task created for it is a request's
    /// root, whatever created it.
    pub root_name: [u8; ROOT_NAME_BYTES],
}

/// `PyDictObject` and its keys in CPython 3.12 and 3.13 (GIL builds), as `current_tasks` is
/// read: `ma_keys`; `dk_log2_index_bytes`, `dk_nentries`, the indices' start; entries of
/// `{hash, key, value}` after the indices, a deleted one with a NULL value.
pub const DICT_KEYS: u64 = 32;
pub const DICT_KEYS_LOG2_INDEX_BYTES: u64 = 9;
pub const DICT_KEYS_NENTRIES: u64 = 24;
pub const DICT_KEYS_INDICES: u64 = 32;
pub const DICT_ENTRY_BYTES: u64 = 24;
pub const DICT_ENTRY_VALUE: u64 = 16;
/// Entries of `current_tasks` looked at: one per event loop in a step at once, and a
/// deleted entry stays until the dict is resized (at 5 entries for a dict of one or two
/// loops). A dict with more is not read (the write's lineage is then unreadable).
pub const MAX_CURRENT_TASKS_ENTRIES: u32 = 8;

/// Key of the lineage the probe recorded for a task: a process and the task's address.
/// Every `Task.__init__` of a probed process writes its entry, so a running task's entry is
/// always its own: the address of a task that is alive belongs to no later task.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TaskKey {
    pub tgid: u32,
    pub _pad: u32,
    pub task: u64,
}

/// Which request-root task a task descends from, copied from its creator at creation.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskLineage {
    /// The root task's serial: unique for the agent's life (a root's address is reused by
    /// later tasks; its serial never is). 0 when `kind` is [`LINEAGE_UNKNOWN`].
    pub origin: u64,
    /// For a request root: the connection whose inbound request it was created for (the
    /// last read of the thread that created it, on a traced server socket), 0 when unknown.
    pub birth_conn_id: u64,
    pub birth_fd: i32,
    /// The responses that connection had begun before it: which of its requests it is.
    pub birth_responses: u32,
    /// `LINEAGE_*`.
    pub kind: u32,
    pub _pad: u32,
}

/// [`TaskLineage::kind`]: the task descends from a request root (`RequestResponseCycle.run_asgi`).
pub const LINEAGE_REQUEST: u32 = 1;
/// It descends from a task created outside any task that is no request root (a timer's, a
/// background task): no inbound request caused it.
pub const LINEAGE_OTHER_ROOT: u32 = 2;
/// Its creator's lineage is not known (created before the probe, or forgotten to the map's
/// bound): neither is its.
pub const LINEAGE_UNKNOWN: u32 = 3;

/// [`TaskContextEvent::writer`]: the process's task creations are not probed.
pub const WRITER_LINEAGE_OFF: u32 = 0;
/// The write ran in a task whose lineage the probe recorded (`TaskContextEvent::lineage`).
pub const WRITER_TASK: u32 = 1;
/// The write ran outside any task of the thread's event loop (loop callbacks, a thread
/// without a loop).
pub const WRITER_NO_TASK: u32 = 2;
/// The running task has no recorded lineage: created before the probe was attached, or
/// forgotten to the map's bound.
pub const WRITER_TASK_UNSEEN: u32 = 3;
/// The running task could not be read (`current_tasks` not found yet or unreadable, more
/// loops than are looked at, the thread not registered).
pub const WRITER_UNREADABLE: u32 = 4;

/// What the thread last read from a socket, for the probe to tell which inbound request a
/// request-root task is created for: a server creates it while it parses the bytes that read
/// returned, before any other read. `conn_id` 0: the last read was on a socket that is not a
/// traced server socket.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LastRead {
    pub conn_id: u64,
    pub fd: i32,
    /// `SocketState::responses` at the read.
    pub responses: u32,
}

/// Tasks whose lineage the kernel keeps (an LRU: a live task forgotten makes its writes
/// [`WRITER_TASK_UNSEEN`], counted by user space). About 56 bytes an entry.
pub const DEFAULT_MAX_TASKS: u32 = 131_072;

/// Slots of the kernel's `LINEAGE_PROBES` per-CPU counters: what each hit of the
/// task-creation probe found.
/// A request root whose inbound request is known.
pub const PROBE_REQUEST_ROOT: u32 = 0;
/// A request root created where no inbound request was being read (inside another task, as
/// uvicorn does for a pipelined request, or after a read on no traced server socket).
pub const PROBE_ROOT_WITHOUT_REQUEST: u32 = 1;
/// A task created outside any task that is no request root.
pub const PROBE_OTHER_ROOT: u32 = 2;
/// A task that inherited its creator's lineage.
pub const PROBE_INHERITED: u32 = 3;
/// A task whose creator has no recorded lineage.
pub const PROBE_CREATOR_UNSEEN: u32 = 4;
/// A task whose creator could not be read (recorded as [`LINEAGE_UNKNOWN`]).
pub const PROBE_CREATOR_UNREADABLE: u32 = 5;
pub const PROBE_OUTCOMES: u32 = 6;

// ---------------------------------------------------------------------------------------
// traceparent injection (`--inject-traceparent`)
// ---------------------------------------------------------------------------------------

/// Key of the published traces: a traced process and one of its handlers, named by
/// `kind`: the address of a handler task's contextvars `Context` (the root of its chain, see
/// `stitch::context_keys`), or with `--task-lineage` the serial of a request root.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct InjectKey {
    pub tgid: u32,
    /// [`INJECT_BY_CONTEXT`] or [`INJECT_BY_ORIGIN`].
    pub kind: u32,
    pub handler: u64,
}

/// [`InjectKey::kind`]: `handler` is a context's address.
pub const INJECT_BY_CONTEXT: u32 = 0;
/// [`InjectKey::kind`]: `handler` is a request root's serial ([`TaskLineage::origin`]).
pub const INJECT_BY_ORIGIN: u32 = 1;

/// What user space publishes once evidence decided which inbound request a handler task
/// serves and that request's trace is settled: the trace its next outbound requests carry.
/// A task context's address is reused by a later request once its own is answered, so the
/// entry names its request's connection (fd, `conn_id`) and the responses that connection had
/// begun before it (`owner_responses`): the kernel uses it only while that count is unchanged.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InjectTrace {
    pub trace: [u8; 16],
    pub owner_conn_id: u64,
    pub owner_fd: i32,
    pub owner_responses: u32,
}

/// The trace an inbound request's own `traceparent` header names, kept by the kernel per
/// server socket with `--inject-traceparent` (read at the request's first read): the calls of
/// the handler born for that request (see [`TaskLineage`]) carry it from their very first,
/// before user space has seen the request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InboundTrace {
    pub trace: [u8; 16],
    /// The connection (its `SocketState::conn_id`) and which of its requests (the responses
    /// it had begun before it).
    pub conn_id: u64,
    pub request: u32,
    pub _pad: u32,
}

/// `traceparent: 00-<32 hex>-<16 hex>-01\r\n`.
pub const TRACEPARENT_LINE: usize = 70;

/// A header armed by a write's `sys_enter` for the `sk_msg` program that runs inside the same
/// call, keyed by thread; removed at the call's exit whatever happened.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ArmedInjection {
    pub line: [u8; TRACEPARENT_LINE],
    pub _pad: [u8; 2],
    /// Where the line goes: just after the request line.
    pub insert_at: u32,
    /// The message's first 8 bytes as the write's buffer had them: `sk_msg` checks it sees
    /// the same message.
    pub first_bytes: u64,
}

/// Published traces the kernel map holds.
pub const MAX_INJECT_TRACES: u32 = 16384;

/// What happened to traced processes' outbound request writes with injection on, by index
/// of the kernel's `INJECT_OUTCOMES` counters.
pub const INJECT_WRITTEN: u32 = 0;
/// No trace published for the writing task (its request not known yet at the write).
pub const INJECT_NO_TRACE: u32 = 1;
/// The request already carried a `traceparent`: left as it is.
pub const INJECT_CARRIED: u32 = 2;
/// The request line or the end of the head was not in the scanned start of the write.
pub const INJECT_HEAD_UNSCANNED: u32 = 3;
/// A trace was published, but its request had been answered: the context is another's now.
pub const INJECT_OWNER_DONE: u32 = 4;
/// Armed, but the socket was not in the injection map (connected before the agent started).
pub const INJECT_NOT_DELIVERED: u32 = 5;
/// `sk_msg` saw other bytes than the armed write's, or could not insert.
pub const INJECT_FAILED: u32 = 6;
/// Traced client sockets that could not be put in the injection map (it was full).
pub const INJECT_SOCKETS_FULL: u32 = 7;
/// A call to a peer on this host under [`INJECT_REMOTE`]: left as it is, its trace handed to
/// the callee's first read under its [`LocalCallKey`] instead.
pub const INJECT_HANDED_OVER: u32 = 8;
pub const INJECT_OUTCOMES: u32 = 9;

/// A call on this host, as both its ends' kernel programs name it: the TCP sequence number
/// of its first byte and the connection's two ports. Under [`INJECT_REMOTE`] the caller's
/// write leaves the trace it would have written in a header under this key, for the callee's
/// first read of the request (a handler's calls to another host then carry the trace of the
/// request that called it over loopback, as with a header).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LocalCallKey {
    pub seq: u32,
    pub client_port: u16,
    pub server_port: u16,
}

/// Bytes of a request write scanned for its request line, the end of its head and a
/// `traceparent` it already carries.
pub const INJECT_SCAN_BYTES: usize = 1024;

/// Processes the PID filter map holds (named, discovered and forked children together). A
/// child that does not fit is counted as a lost event; a discovered server that does not
/// fit is reported (processes_not_traced).
pub const MAX_TRACED_PIDS: u32 = 8192;

/// Words of each of the PID filter's bitmaps: one bit for every pid Linux can hand out
/// (`PID_MAX_LIMIT`, 2^22 on 64-bit), 512 KiB each.
pub const PID_BITMAP_WORDS: u32 = (1 << 22) / 64;

/// The word of a PID filter bitmap that holds `pid`'s bit, and the bit.
pub const fn pid_bit(pid: u32) -> (u32, u64) {
    (pid / 64, 1 << (pid % 64))
}

/// Values of the PID filter map: why a process is traced.
pub const TRACED_BY_USER: u8 = 1;
pub const TRACED_AS_CHILD: u8 = 2;

/// Per-socket state kept in the kernel for traced processes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SocketState {
    pub conn_id: u64,
    /// Bytes of the current inbound message still to be captured.
    pub read_budget: u32,
    /// Bytes of the current outbound message still to be captured.
    pub write_budget: u32,
    pub role: u8,
    /// Non-zero once user space has stopped following the socket (not HTTP, or evicted from
    /// its table): the kernel still knows it, so its transfers are skipped without being
    /// counted as transfers on unknown sockets.
    pub ignored: u8,
    /// Non-zero when its peer is on this host ([`peer_on_host`]).
    pub peer_on_host: u8,
    pub _pad: u8,
    /// Writes on the socket that started with `HTTP`: the responses a server began. A
    /// published trace ([`InjectTrace`]) is valid while its request's connection has
    /// answered exactly the requests before it.
    pub responses: u32,
    /// The socket's `struct sock` (a `tcp_sock`), when it is TCP proper (not MPTCP) and the
    /// sequence-number offsets are known; 0 otherwise.
    pub sk: u64,
}

/// Key of the per-socket map: one process's file descriptor.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SocketKey {
    pub tgid: u32,
    pub fd: i32,
}

/// What an `enter` program remembers for the matching `exit` of the same thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PendingCall {
    /// One of the `CALL_*` constants.
    pub call: u32,
    pub fd: i32,
    /// The buffer, the iovec array, or the msghdr, depending on `call`.
    pub buffer: u64,
    /// The buffer length or the iovec count.
    pub count: u64,
    /// The TCP sequence number at entry (see [`DataEventHeader::seq`]), when `seq_known`.
    pub seq: u32,
    pub seq_known: u32,
    /// `bpf_ktime_get_ns()` at entry: a write's data record is stamped with it.
    pub entered_ns: u64,
}

/// A thread's entry in the kernel's per-thread call map: its pending call, and what it last
/// read, kept across its calls for the task-creation probe (see [`LastRead`]): set at the
/// exit of a read on a traced server socket, cleared by any other read the thread makes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadCalls {
    pub pending: PendingCall,
    pub last_read: LastRead,
}

/// Argument shapes the exit program understands.
/// A thread's entry whose call has been handled by its exit.
pub const CALL_NONE: u32 = 0;
pub const CALL_READ_BUFFER: u32 = 1;
pub const CALL_WRITE_BUFFER: u32 = 2;
pub const CALL_READ_IOVEC: u32 = 3;
pub const CALL_WRITE_IOVEC: u32 = 4;
pub const CALL_READ_MSGHDR: u32 = 5;
pub const CALL_WRITE_MSGHDR: u32 = 6;
pub const CALL_ACCEPT: u32 = 7;
pub const CALL_CONNECT: u32 = 8;
/// A transfer on a TCP socket `SOCKETS` does not hold: the exit only counts it (if it moved
/// bytes) as [`UNTRACKED_UNKNOWN_SOCKET_TRANSFER`].
pub const CALL_ON_UNKNOWN_SOCKET: u32 = 9;

/// Threads of traced processes that have made a socket call (`PENDING_CALLS` keeps each one's
/// entry until it exits), and that are inside an OpenSSL call at once (`TLS_CALLS`); a call
/// that does not fit is counted as [`UNTRACKED_PENDING_CALLS_FULL`].
pub const MAX_PENDING_CALLS: u32 = 16384;

/// Slots of the kernel's `UNTRACKED` per-CPU counter map: why the kernel did not follow a
/// connection or a transfer of a traced process.
/// A connection opened while `SOCKETS` (sized from `--max-connections`) was full.
pub const UNTRACKED_SOCKET_MAP_FULL: u32 = 0;
/// A transfer that moved bytes on a TCP socket the kernel does not know: opened before the
/// process was traced, or refused as [`UNTRACKED_SOCKET_MAP_FULL`].
pub const UNTRACKED_UNKNOWN_SOCKET_TRANSFER: u32 = 1;
/// A socket call (open or transfer) not followed because `PENDING_CALLS` was full.
pub const UNTRACKED_PENDING_CALLS_FULL: u32 = 2;
pub const UNTRACKED_REASONS: u32 = 3;

/// Field offsets inside kernel structs, read by user space from the kernel's BTF and passed
/// in as a global: Rust eBPF has no CO-RE relocations. `valid == 0` means they could not be
/// found; the programs then report connections without addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    pub valid: u32,
    pub task_files: u32,
    pub files_fdt: u32,
    pub fdtable_fd: u32,
    pub file_private_data: u32,
    pub socket_type: u32,
    pub socket_sk: u32,
    pub sock_family: u32,
    pub sock_daddr: u32,
    pub sock_rcv_saddr: u32,
    pub sock_dport: u32,
    pub sock_num: u32,
    pub sock_v6_daddr: u32,
    pub sock_v6_rcv_saddr: u32,
    /// `socket.file`: a socket's file points back at it, which tells a socket's fd from any
    /// other (whose `private_data` is something else).
    pub socket_file: u32,
    /// Non-zero when the three offsets below were found: TCP sequence numbers are then read.
    pub seq_valid: u32,
    /// `sock.sk_protocol` (a u16): only IPPROTO_TCP sockets are `tcp_sock`s (an MPTCP
    /// socket is a stream socket too, and its fields at these offsets are something else).
    pub sock_protocol: u32,
    /// `tcp_sock.write_seq`: the sequence number of the next byte the socket will send.
    pub tcp_write_seq: u32,
    /// `tcp_sock.copied_seq`: the sequence number of the next byte a read returns.
    pub tcp_copied_seq: u32,
}

/// Offsets of the tracepoint fields the fork and exit programs read, from the tracepoints'
/// `format` files and passed in as a global: tracepoint records are not a stable ABI
/// (`sched_process_fork`'s `child_pid` moved from 44 to 20), so nothing is assumed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TracepointLayout {
    /// `task/task_newtask` `pid`: the new task's id (4 bytes).
    pub new_task_pid: u32,
    /// `task/task_newtask` `clone_flags`.
    pub new_task_clone_flags: u32,
    /// 8 (`u64`, or `unsigned long` on 64-bit) or 4.
    pub new_task_clone_flags_size: u32,
    /// `sched/sched_process_exit` `group_dead` (1 byte), or [`FIELD_ABSENT`].
    pub exit_group_dead: u32,
}

/// A [`TracepointLayout`] offset for a field this kernel's tracepoint does not have.
pub const FIELD_ABSENT: u32 = u32::MAX;

/// `CLONE_THREAD` (linux/sched.h): the new task joins its parent's thread group.
pub const CLONE_THREAD: u64 = 0x0001_0000;

/// `SOCK_STREAM` as in `struct socket.type`.
pub const SOCK_STREAM: u16 = 1;

/// `IPPROTO_TCP` as in `struct sock.sk_protocol` (MPTCP's is 262).
pub const IPPROTO_TCP: u16 = 6;

const _: () = assert!(size_of::<EventHeader>() == 32);
const _: () = assert!(size_of::<ConnOpenEvent>() == 72);
const _: () = assert!(size_of::<DataEventHeader>() == 56);
const _: () = assert!(size_of::<ProcessForkEvent>() == 40);
const _: () = assert!(size_of::<ProcessExecEvent>() == 48);
const _: () = assert!(size_of::<DataEvent>() == 56 + 2 * MAX_CAPTURE_BYTES);
const _: () = assert!(TAIL_BYTES.is_power_of_two() && TAIL_BYTES <= MAX_CAPTURE_BYTES);
const _: () = assert!(size_of::<TlsDataHeader>() == 64);
const _: () = assert!(size_of::<PendingTlsCall>() == 40);
const _: () = assert!(size_of::<TlsKey>() == 16);
const _: () = assert!(size_of::<SocketState>() == 32);
const _: () = assert!(size_of::<SocketKey>() == 8);
const _: () = assert!(size_of::<PendingCall>() == 40);
const _: () = assert!(size_of::<ThreadCalls>() == 56);
const _: () = assert!(size_of::<KernelOffsets>() == 76);
const _: () = assert!(size_of::<TaskContextEvent>() == 40 + 8 * MAX_CONTEXT_DEPTH + 8 + 32);
const _: () = assert!(size_of::<AsyncioProcess>() == 24 + 32 + ROOT_NAME_BYTES);
const _: () = assert!(size_of::<TaskKey>() == 16);
const _: () = assert!(size_of::<TaskLineage>() == 32);
const _: () = assert!(size_of::<LastRead>() == 16);
const _: () = assert!(size_of::<ArmedInjection>() == 88);
const _: () = assert!(size_of::<InjectTrace>() == 32);
const _: () = assert!(size_of::<InjectKey>() == 16);
const _: () = assert!(size_of::<InboundTrace>() == 32);
const _: () = assert!(size_of::<PythonThread>() == 32);
const _: () = assert!(size_of::<TracepointLayout>() == 16);
const _: () = assert!(MAX_CAPTURE_BYTES.is_power_of_two());

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: these are #[repr(C)] structs of integers only, with no implicit padding
    // (SocketState's is the explicit `_pad` field; the size assertions above pin the layouts),
    // so every bit pattern is a valid value.
    unsafe impl aya::Pod for SocketKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for SocketState {}
    // SAFETY: as above.
    unsafe impl aya::Pod for KernelOffsets {}
    // SAFETY: as above (two u32 and two u64, no padding).
    unsafe impl aya::Pod for PendingCall {}
    // SAFETY: as above (a PendingCall and a LastRead, no padding).
    unsafe impl aya::Pod for ThreadCalls {}
    // SAFETY: as above.
    unsafe impl aya::Pod for TracepointLayout {}
    // SAFETY: as above (two u64 and four u32, no padding).
    unsafe impl aya::Pod for PythonThread {}
    // SAFETY: as above (u64, u32, explicit pad).
    unsafe impl aya::Pod for TlsKey {}
    // SAFETY: as above (two u32).
    unsafe impl aya::Pod for TlsBudget {}
    // SAFETY: as above (two u32, u64).
    unsafe impl aya::Pod for InjectKey {}
    // SAFETY: as above (16 bytes, u64, i32, u32; 32 bytes, asserted).
    unsafe impl aya::Pod for InjectTrace {}
    // SAFETY: as above (three u64, eight u32, a byte array; no padding, size asserted).
    unsafe impl aya::Pod for AsyncioProcess {}
    // SAFETY: as above (u32, explicit pad, u64).
    unsafe impl aya::Pod for TaskKey {}
    // SAFETY: as above (two u64, i32, three u32).
    unsafe impl aya::Pod for TaskLineage {}
    // SAFETY: as above (u64, i32, u32).
    unsafe impl aya::Pod for LastRead {}
}
