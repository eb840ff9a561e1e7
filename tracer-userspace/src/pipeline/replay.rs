//! Replays an arbitrary sequence of kernel events through the agent's reassembly path: the
//! body of the fuzz target (`fuzz/fuzz_targets/http_reassembly.rs`) and of the unit test that
//! replays its committed corpus (`fuzz/corpus/http_reassembly/`).
//!
//! The input is a script of operations ([`Script`] writes one; [`replay`] reads one), not one
//! buffer: what breaks reassembly is an order of events — a head split across reads, a close
//! in the middle of a body, a late record of a connection whose fd was reused. Each operation
//! is encoded as the kernel sends it (the ABI record bytes) and goes through the same code the
//! agent runs: the pipeline core ([`Pipeline::handle_record`]), as the agent drives it.
//! After every operation the replay checks the bounds and invariants the agent relies on, and panics when one fails so
//! that the fuzzer reports it.
//!
//! The script format, one operation after another (an operation cut short ends the script):
//!
//! | opcode % 8 | operation | fields after the opcode byte |
//! |---|---|---|
//! | 0 | connection opened | slot, flags (bit 0: client role, bit 1: no addresses) |
//! | 1 | read or write | slot, flags (bit 0: write, bit 1: stale conn id, bit 2: gap × 65536, bit 3: timestamp 1 µs late, bit 4: captured bytes repeated up to the capture limit), µs elapsed (u8), captured length (u16 LE) and bytes, uncaptured gap (u16 LE), tail length (u8, at most 255) and bytes |
//! | 2 | connection closed | slot, flags (bit 1: stale conn id) |
//! | 3 | process exited | process |
//! | 4 | process forked | parent process, child process |
//! | 5 | raw record | length (u8) and bytes, decoded as they are |
//! | 6 | time passes | milliseconds (u16 LE); held spans are released |
//! | 7 | TLS plaintext (an uprobe's record) | slot (its `SSL*` is the slot's), flags (bit 0: write, bit 1: the call was entered 2 µs before it returned, so a transfer of the slot just before falls inside it), captured length (u16 LE) and bytes |
//!
//! A slot is one of [`SLOTS`] sockets (three processes × three fds); a process is one of
//! three PIDs (no real process has them: PIDs past the kernel's maximum).

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use tracer_abi::{
    AF_INET, ConnOpenEvent, DIRECTION_READ, DIRECTION_WRITE, DataEventHeader, EventHeader,
    EventKind, MAX_CAPTURE_BYTES, ProcessForkEvent, ROLE_CLIENT, ROLE_SERVER, TAIL_BYTES,
    TlsDataHeader,
};

use crate::gym::ServerType;
use crate::gym::span_groups::SpanGroups;
use crate::kernel::events::{DataTransfer, KernelEvent};
use crate::model::exchange::{HttpExchange, Outcome, RequestStart, Role, SocketId};
use crate::model::ids::{MintKey, SpanId};
use crate::model::service::{AgentResource, GymLabels};
use crate::model::span::SpanRecord;
use crate::pipeline::{Observer, Pipeline, PipelineConfig, PipelineCounters, PipelineOutput};
use crate::reassembly::connections::{
    ConnectionTable, MAX_IN_FLIGHT_PER_CONNECTION, ReassemblyCounters, TableAction,
};
use crate::reassembly::tls::TlsCounters;
use crate::signals::clock::WallClock;
use crate::signals::meaning::wants_run_body;
use crate::stitch::{Injection, StitchConfig, StitchCounters};

/// Sockets a script can name: three processes with three fds each.
pub const SLOTS: usize = 9;
/// Fewer than [`SLOTS`], so that the table's bound is reached.
const MAX_CONNECTIONS: usize = 6;
/// Small, so that the stitcher's bounds are reached too.
const MAX_PENDING_SPANS: usize = 8;
/// Above `/proc/sys/kernel/pid_max`'s ceiling (2^22): never a real process.
const PIDS: [u32; 3] = [5_000_001, 5_000_002, 5_000_003];
const SERVER_PORT: u16 = 8000;

const OP_OPEN: u8 = 0;
const OP_DATA: u8 = 1;
const OP_CLOSE: u8 = 2;
const OP_EXIT: u8 = 3;
const OP_FORK: u8 = 4;
const OP_RAW: u8 = 5;
const OP_TICK: u8 = 6;
const OP_TLS: u8 = 7;
const OPS: u8 = 8;

/// `TLS_ENTERED_EARLY`: the TLS call's entry lies 2 µs before its return.
const TLS_ENTERED_EARLY: u8 = 2;

const OPEN_CLIENT: u8 = 1;
const OPEN_NO_ADDRESSES: u8 = 2;
const DATA_WRITE: u8 = 1;
const STALE: u8 = 2;
const DATA_LARGE_GAP: u8 = 4;
const DATA_LATE: u8 = 8;
/// Lets a short script fill the capture buffer (long heads, the head size limit).
const DATA_REPEAT: u8 = 16;

/// What a replay saw, for tests that check more than "no panic".
#[derive(Debug, Default)]
pub struct ReplaySummary {
    pub pipeline: PipelineCounters,
    pub reassembly: ReassemblyCounters,
    pub tls: TlsCounters,
    pub stitch: StitchCounters,
    /// Exchanges that ended with a response.
    pub responses: u64,
    /// Exchanges that ended without one (closed, exited, overflow).
    pub aborts: u64,
    pub spans_released: u64,
    /// Each request start and each exchange, described (sorted at the end).
    pub started: Vec<String>,
    pub ended: Vec<String>,
}

/// Runs one script; panics if an invariant of the reassembly path fails.
pub fn replay(script: &[u8]) -> ReplaySummary {
    let mut replay = Replay::new();
    let mut reader = Reader { bytes: script };
    while let Some(()) = replay.step(&mut reader) {
        replay.check();
    }
    replay.finish()
}

/// Writes scripts (seed inputs and tests), the inverse of [`replay`]'s reader.
#[derive(Clone, Debug, Default)]
pub struct Script {
    bytes: Vec<u8>,
}

impl Script {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    pub fn open(mut self, slot: u8, role: Role) -> Self {
        let flags = if role == Role::Client { OPEN_CLIENT } else { 0 };
        self.bytes.extend([OP_OPEN, slot, flags]);
        self
    }

    /// A transfer captured whole.
    pub fn read(self, slot: u8, bytes: &[u8]) -> Self {
        self.transfer(slot, 0, bytes, 0, &[])
    }

    pub fn write(self, slot: u8, bytes: &[u8]) -> Self {
        self.transfer(slot, DATA_WRITE, bytes, 0, &[])
    }

    /// A transfer of `captured.len() + gap` bytes of which the kernel captured the first
    /// `captured` and the last `tail`.
    pub fn transfer(mut self, slot: u8, flags: u8, captured: &[u8], gap: u16, tail: &[u8]) -> Self {
        let captured = &captured[..captured.len().min(usize::from(u16::MAX))];
        let tail = &tail[tail.len().saturating_sub(TAIL_BYTES)..];
        self.bytes.extend([OP_DATA, slot, flags, 1]);
        self.bytes
            .extend((captured.len() as u16).to_le_bytes().iter().chain(captured));
        self.bytes.extend(gap.to_le_bytes());
        self.bytes.push(tail.len() as u8);
        self.bytes.extend(tail);
        self
    }

    pub fn close(mut self, slot: u8) -> Self {
        self.bytes.extend([OP_CLOSE, slot, 0]);
        self
    }

    pub fn exit(mut self, process: u8) -> Self {
        self.bytes.extend([OP_EXIT, process]);
        self
    }

    pub fn fork(mut self, parent: u8, child: u8) -> Self {
        self.bytes.extend([OP_FORK, parent, child]);
        self
    }

    pub fn raw(mut self, record: &[u8]) -> Self {
        let record = &record[..record.len().min(usize::from(u8::MAX))];
        self.bytes.push(OP_RAW);
        self.bytes.push(record.len() as u8);
        self.bytes.extend(record);
        self
    }

    /// TLS plaintext of `slot`'s `SSL*` (`flags`: [`DATA_WRITE`], [`TLS_ENTERED_EARLY`]).
    pub fn tls(mut self, slot: u8, flags: u8, captured: &[u8]) -> Self {
        let captured = &captured[..captured.len().min(usize::from(u16::MAX))];
        self.bytes.extend([OP_TLS, slot, flags]);
        self.bytes
            .extend((captured.len() as u16).to_le_bytes().iter().chain(captured));
        self
    }

    pub fn tick(mut self, ms: u16) -> Self {
        self.bytes.push(OP_TICK);
        self.bytes.extend(ms.to_le_bytes());
        self
    }
}

/// Reads a script; `None` when it ends.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn u8(&mut self) -> Option<u8> {
        let (&first, rest) = self.bytes.split_first()?;
        self.bytes = rest;
        Some(first)
    }

    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes([self.u8()?, self.u8()?]))
    }

    /// Up to `len` bytes: fewer when the script ends first, so a mutated length still reads.
    fn take(&mut self, len: usize) -> &'a [u8] {
        let (taken, rest) = self.bytes.split_at(len.min(self.bytes.len()));
        self.bytes = rest;
        taken
    }
}

fn slot_socket(slot: u8) -> SocketId {
    let slot = usize::from(slot) % SLOTS;
    SocketId {
        pid: PIDS[slot % PIDS.len()],
        fd: 3 + (slot / PIDS.len()) as i32,
    }
}

/// Addresses as on one host: a client socket of fd n connects from port 40000 + n, and a
/// server socket of fd n was connected from there, so clients and servers of the script pair
/// up (the stitcher's cross-process links).
fn addresses(socket: SocketId, role: Role) -> (SocketAddr, SocketAddr) {
    let host = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let server = SocketAddr::new(host, SERVER_PORT);
    let ephemeral = SocketAddr::new(host, 40000 + socket.fd as u16);
    match role {
        Role::Server => (server, ephemeral),
        Role::Client => (ephemeral, server),
    }
}

/// The bytes of a `#[repr(C)]` ABI record, as the kernel writes it to the ring buffer.
pub(crate) fn record_bytes<T: Copy>(record: &T) -> Vec<u8> {
    // SAFETY: the ABI structs are plain old data whose padding is explicit `_pad` fields
    // (tracer-abi asserts their sizes), so every byte is initialised.
    unsafe { std::slice::from_raw_parts(std::ptr::from_ref(record).cast::<u8>(), size_of::<T>()) }
        .to_vec()
}

pub(crate) fn header(
    kind: EventKind,
    socket: SocketId,
    conn_id: u64,
    timestamp_ns: u64,
) -> EventHeader {
    EventHeader {
        kind: kind as u8,
        tgid: socket.pid,
        tid: socket.pid,
        fd: socket.fd,
        timestamp_ns,
        conn_id,
        ..EventHeader::default()
    }
}

/// The agent's pipeline core, driven by the script instead of the ring buffer, with the
/// bookkeeping that the invariants are checked against.
struct Replay {
    pipeline: Pipeline<()>,
    output: PipelineOutput,
    checks: Checks,
    /// `Instant` of monotonic time 0, for the stitcher's delays.
    epoch: Instant,
    now_ns: u64,
    /// Connections opened per slot so far: the current conn id derives from it.
    generations: [u64; SLOTS],
}

/// What the replay checks as the pipeline runs (its [`Observer`]).
struct Checks {
    /// Requests the table started and has not ended: each must end exactly once.
    in_flight: HashSet<SpanId>,
    summary: ReplaySummary,
    /// The same events with every transfer split in two: reassembly must not depend on
    /// how the bytes were cut into reads.
    split: SplitReplay,
}

impl Observer for Checks {
    fn event(&mut self, event: &KernelEvent<'_>) {
        self.split.apply(event);
    }

    fn started(&mut self, start: &RequestStart) {
        self.summary.started.push(describe_start(start));
        assert!(
            self.in_flight.insert(start.span_id),
            "span id {:?} started twice",
            start.span_id
        );
        assert!(PIDS.contains(&start.pid), "a request of an unknown process");
    }

    fn body_rollout(&mut self, request: SpanId) {
        assert!(
            self.in_flight.contains(&request),
            "a body for a request that is not in flight"
        );
    }

    fn untracked(&mut self, socket: SocketId) {
        assert!(PIDS.contains(&socket.pid), "untracking an unknown socket");
    }

    fn ended(&mut self, exchange: &HttpExchange) {
        self.summary.ended.push(describe_exchange(exchange));
        assert!(
            self.in_flight.remove(&exchange.span_id),
            "an exchange that never started or ended twice: {exchange:?}"
        );
        assert!(
            exchange.start_ns <= exchange.end_ns,
            "an exchange that ends before it starts: {exchange:?}"
        );
        match exchange.outcome {
            Outcome::Response(_) => self.summary.responses += 1,
            Outcome::Aborted(_) => self.summary.aborts += 1,
        }
    }

    fn built(&mut self, spans: &[SpanRecord]) {
        for span in spans {
            assert!(
                span.start_unix_ns <= span.end_unix_ns,
                "a span that ends before it starts: {span:?}"
            );
        }
    }
}

/// A second connection table fed the same events, each transfer cut in two at a point the
/// script chooses (its timestamp): HTTP/1.x framing does not depend on read boundaries, so
/// as long as neither side lost framing (a parse error), both must see the same requests
/// end the same way.
struct SplitReplay {
    table: ConnectionTable,
    exchanges: Vec<HttpExchange>,
    actions: Vec<TableAction>,
    ended: Vec<String>,
    started: Vec<String>,
}

impl SplitReplay {
    fn apply(&mut self, event: &KernelEvent<'_>) {
        match event {
            KernelEvent::Data(data) if data.captured.len() >= 2 => {
                let len = data.captured.len();
                let at = 1 + (data.timestamp_ns / 1_000) as usize % (len - 1);
                let first = DataTransfer {
                    captured: &data.captured[..at],
                    total_len: at as u64,
                    tail: &[],
                    ..data.clone()
                };
                let second = DataTransfer {
                    captured: &data.captured[at..],
                    total_len: data.total_len - at as u64,
                    ..data.clone()
                };
                self.apply_whole(&KernelEvent::Data(first));
                self.apply_whole(&KernelEvent::Data(second));
            }
            _ => self.apply_whole(event),
        }
    }

    fn apply_whole(&mut self, event: &KernelEvent<'_>) {
        self.table
            .apply(event, &mut self.exchanges, &mut self.actions);
        for action in self.actions.drain(..) {
            if let TableAction::Started(start) = action {
                self.started.push(describe_start(&start));
            }
        }
        for exchange in self.exchanges.drain(..) {
            self.ended.push(describe_exchange(&exchange));
        }
    }
}

/// A request start as both replays must agree on it (span ids are random, so not those).
fn describe_start(start: &RequestStart) -> String {
    format!(
        "pid {} {:?} #{} {} {} traceparent {:?}",
        start.pid, start.role, start.sequence, start.method, start.path, start.traceparent
    )
}

fn describe_exchange(exchange: &HttpExchange) -> String {
    format!(
        "pid {} {:?} {:?} → {:?} at {}..{} rollout {:?}",
        exchange.pid,
        exchange.role,
        exchange.request,
        exchange.outcome,
        exchange.start_ns,
        exchange.end_ns,
        exchange.run_rollout_id
    )
}

impl Replay {
    fn new() -> Self {
        let config = PipelineConfig {
            clock: WallClock::measure(),
            max_connections: MAX_CONNECTIONS,
            routes: Vec::new(),
            agent_resource: AgentResource::new(Some("fuzz".to_string()), Vec::new()),
            groups: SpanGroups::ALL,
            stitch: StitchConfig {
                max_pending: MAX_PENDING_SPANS,
                max_nodes: MAX_PENDING_SPANS * 4,
                // Injection's paths too: publication, shared call ids, minted traces.
                injection: Some(Injection {
                    every_call: true,
                    mint_key: MintKey([1, 2]),
                }),
            },
        };
        let mut pipeline = Pipeline::new(config, ());
        // A Gym agent server, a resources server and (only once forked) a plain process.
        for (pid, server_type) in [
            (PIDS[0], ServerType::Agent),
            (PIDS[1], ServerType::Resources),
        ] {
            pipeline.attach(pid, GymLabels::example_server(server_type));
        }
        Self {
            pipeline,
            output: PipelineOutput::default(),
            checks: Checks {
                in_flight: HashSet::new(),
                summary: ReplaySummary::default(),
                split: SplitReplay {
                    table: ConnectionTable::new(MAX_CONNECTIONS).reading_run_bodies(wants_run_body),
                    exchanges: Vec::new(),
                    actions: Vec::new(),
                    ended: Vec::new(),
                    started: Vec::new(),
                },
            },
            epoch: Instant::now(),
            now_ns: 1_000_000,
            generations: [0; SLOTS],
        }
    }

    fn conn_id(&self, slot: u8, stale: bool) -> u64 {
        let slot = usize::from(slot) % SLOTS;
        let generation = self.generations[slot] - u64::from(stale && self.generations[slot] > 0);
        generation * SLOTS as u64 + slot as u64
    }

    fn now(&self) -> Instant {
        self.epoch + Duration::from_nanos(self.now_ns)
    }

    /// An [`OP_TLS`] operation's record: what the uprobes report for the slot's `SSL*`.
    fn tls_record(&self, script: &mut Reader<'_>) -> Option<Vec<u8>> {
        let slot = script.u8()?;
        let flags = script.u8()?;
        let len = script.u16()?;
        let captured = script.take(usize::from(len).min(MAX_CAPTURE_BYTES));
        let socket = slot_socket(slot);
        let tls = TlsDataHeader {
            data: DataEventHeader {
                header: EventHeader {
                    fd: -1,
                    ..header(
                        EventKind::TlsData,
                        socket,
                        0x1000 + u64::from(slot) % SLOTS as u64,
                        self.now_ns,
                    )
                },
                direction: if flags & DATA_WRITE != 0 {
                    DIRECTION_WRITE
                } else {
                    DIRECTION_READ
                },
                captured_len: captured.len() as u32,
                total_len: captured.len() as u64,
                ..DataEventHeader::default()
            },
            start_ns: self.now_ns
                - if flags & TLS_ENTERED_EARLY != 0 {
                    2_000
                } else {
                    0
                },
        };
        let mut record = record_bytes(&tls);
        record.extend_from_slice(captured);
        Some(record)
    }

    /// Reads and applies one operation.
    fn step(&mut self, script: &mut Reader<'_>) -> Option<()> {
        self.now_ns += 1_000;
        let record = match script.u8()? % OPS {
            OP_OPEN => {
                let slot = script.u8()?;
                let flags = script.u8()?;
                let socket = slot_socket(slot);
                let role = if flags & OPEN_CLIENT != 0 {
                    Role::Client
                } else {
                    Role::Server
                };
                self.generations[usize::from(slot) % SLOTS] += 1;
                let mut open = ConnOpenEvent {
                    header: header(
                        EventKind::ConnOpen,
                        socket,
                        self.conn_id(slot, false),
                        self.now_ns,
                    ),
                    role: if role == Role::Client {
                        ROLE_CLIENT
                    } else {
                        ROLE_SERVER
                    },
                    ..ConnOpenEvent::default()
                };
                if flags & OPEN_NO_ADDRESSES == 0 {
                    let (local, peer) = addresses(socket, role);
                    open.family = AF_INET;
                    open.local_port = local.port();
                    open.peer_port = peer.port();
                    open.local_addr[..4].copy_from_slice(&[127, 0, 0, 1]);
                    open.peer_addr[..4].copy_from_slice(&[127, 0, 0, 1]);
                }
                record_bytes(&open)
            }
            OP_DATA => {
                let slot = script.u8()?;
                let flags = script.u8()?;
                self.now_ns += u64::from(script.u8()?) * 1_000;
                let len = script.u16()?;
                let mut captured = script
                    .take(usize::from(len).min(MAX_CAPTURE_BYTES))
                    .to_vec();
                if flags & DATA_REPEAT != 0 && !captured.is_empty() {
                    captured = captured
                        .iter()
                        .copied()
                        .cycle()
                        .take(MAX_CAPTURE_BYTES)
                        .collect();
                }
                let mut gap = u64::from(script.u16()?);
                if flags & DATA_LARGE_GAP != 0 {
                    gap <<= 16;
                }
                let tail_len = script.u8()?;
                let tail = script.take(usize::from(tail_len).min(TAIL_BYTES));
                let timestamp_ns = self.now_ns - if flags & DATA_LATE != 0 { 1_000 } else { 0 };
                let data = DataEventHeader {
                    header: header(
                        EventKind::Data,
                        slot_socket(slot),
                        self.conn_id(slot, flags & STALE != 0),
                        timestamp_ns,
                    ),
                    direction: if flags & DATA_WRITE != 0 {
                        DIRECTION_WRITE
                    } else {
                        DIRECTION_READ
                    },
                    tail_len: tail.len() as u16,
                    captured_len: captured.len() as u32,
                    total_len: captured.len() as u64 + gap,
                    ..DataEventHeader::default()
                };
                let mut record = record_bytes(&data);
                record.extend_from_slice(&captured);
                record.extend_from_slice(tail);
                record
            }
            OP_CLOSE => {
                let slot = script.u8()?;
                let flags = script.u8()?;
                record_bytes(&header(
                    EventKind::ConnClose,
                    slot_socket(slot),
                    self.conn_id(slot, flags & STALE != 0),
                    self.now_ns,
                ))
            }
            OP_EXIT => {
                let pid = PIDS[usize::from(script.u8()?) % PIDS.len()];
                let socket = SocketId { pid, fd: -1 };
                record_bytes(&header(EventKind::ProcessExit, socket, 0, self.now_ns))
            }
            OP_FORK => {
                let parent = PIDS[usize::from(script.u8()?) % PIDS.len()];
                let child = PIDS[usize::from(script.u8()?) % PIDS.len()];
                let socket = SocketId {
                    pid: parent,
                    fd: -1,
                };
                record_bytes(&ProcessForkEvent {
                    header: header(EventKind::ProcessFork, socket, 0, self.now_ns),
                    child_pid: child,
                    ..ProcessForkEvent::default()
                })
            }
            OP_RAW => {
                let len = script.u8()?;
                script.take(usize::from(len)).to_vec()
            }
            OP_TLS => self.tls_record(script)?,
            OP_TICK => {
                self.now_ns += u64::from(script.u16()?) * 1_000_000;
                self.pipeline.release(self.now());
                self.apply_output();
                return Some(());
            }
            _ => unreachable!("opcode taken modulo OPS"),
        };
        self.pipeline
            .handle_record(&record, self.now(), &mut self.checks);
        self.apply_output();
        Some(())
    }

    /// What the agent does with the pipeline's output, minus the kernel: exits are
    /// forgotten, released spans counted.
    fn apply_output(&mut self) {
        self.pipeline.deliver(&mut self.output);
        self.checks.summary.spans_released += self.output.released.len() as u64;
        // Exits were forgotten at their records.
        self.output.clear();
    }

    /// The bounds the agent's memory depends on, and no request lost without a trace.
    fn check(&self) {
        let levels = self.pipeline.levels();
        let open = levels.connections_tracked;
        assert!(open <= MAX_CONNECTIONS, "{open} connections tracked");
        let in_flight = levels.requests_in_flight;
        assert!(
            in_flight <= open * MAX_IN_FLIGHT_PER_CONNECTION,
            "{in_flight} requests in flight on {open} connections"
        );
        // Every request the table started is either still in flight or became an exchange.
        assert_eq!(
            in_flight,
            self.checks.in_flight.len(),
            "requests vanished without an exchange"
        );
        assert!(levels.spans_pending <= MAX_PENDING_SPANS);
    }

    fn finish(mut self) -> ReplaySummary {
        let checks = &mut self.checks;
        // TLS plaintext reaches the table only through the pipeline's TLS sessions, which
        // split ciphertext would not tie: scripts with TLS records are not compared.
        let core = self.pipeline.counters();
        if core.reassembly.parse_errors() == 0
            && checks.split.table.counters.parse_errors() == 0
            && core.tls.tls_records == 0
        {
            for list in [
                &mut checks.summary.started,
                &mut checks.summary.ended,
                &mut checks.split.started,
                &mut checks.split.ended,
            ] {
                // Exits end connections in hash order, which differs between the tables.
                list.sort_unstable();
            }
            assert_eq!(
                checks.summary.started, checks.split.started,
                "requests started differently when reads were split"
            );
            assert_eq!(
                checks.summary.ended, checks.split.ended,
                "requests ended differently when reads were split"
            );
        }
        self.pipeline.release_all();
        self.apply_output();
        assert!(
            !self.pipeline.rollouts_waiting(),
            "a rollout kept back after every span was released"
        );
        let mut summary = std::mem::take(&mut self.checks.summary);
        let core = self.pipeline.counters();
        summary.pipeline = core.pipeline;
        summary.reassembly = core.reassembly;
        summary.tls = core.tls;
        summary.stitch = core.stitch;
        summary
    }
}

/// Seed scripts: the shapes of real Gym traffic, for the fuzzer to start from.
pub fn seed_scripts() -> Vec<(&'static str, Vec<u8>)> {
    const GET: &[u8] = b"GET /health HTTP/1.1\r\nHost: localhost:8000\r\n\r\n";
    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: text/plain\r\n\r\nok";
    const VERIFY: &[u8] = b"POST /verify HTTP/1.1\r\nhost: localhost:8000\r\ncontent-type: application/json\r\ncontent-length: 28\r\n\r\n{\"response\": {\"output\": []}}";
    const VERIFIED: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 14\r\ncontent-type: application/json\r\n\r\n{\"reward\":1.0}";
    const RUN: &[u8] = b"POST /run HTTP/1.1\r\nhost: localhost:8000\r\ncontent-length: 59\r\n\r\n{\"rollout_id\": \"r-0001\", \"responses_create_params\": {}}    ";
    const CHUNKED: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n";
    const CHUNKED_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1000\r\n";
    const PIPELINED: &[u8] =
        b"GET /a HTTP/1.1\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\r\nHEAD /b HTTP/1.1\r\n\r\nGET /c?q=1 HTTP/1.1\r\n\r\n";
    const CLIENT_CALL: &[u8] =
        b"POST /v1/responses HTTP/1.1\r\nhost: localhost:8000\r\ncontent-length: 2\r\n\r\n{}";
    const FAIL: &[u8] = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n";
    let server = Role::Server;
    vec![
        (
            "get_keep_alive",
            Script::new()
                .open(1, server)
                .read(1, GET)
                .write(1, OK)
                .read(1, GET)
                .write(1, OK)
                .close(1)
                .into_bytes(),
        ),
        (
            "post_content_length",
            Script::new()
                .open(1, server)
                .read(1, VERIFY)
                .write(1, VERIFIED)
                .tick(100)
                .into_bytes(),
        ),
        (
            "head_split_across_reads",
            Script::new()
                .open(1, server)
                .read(1, &VERIFY[..7])
                .read(1, &VERIFY[7..40])
                .read(1, &VERIFY[40..])
                .write(1, &VERIFIED[..20])
                .write(1, &VERIFIED[20..])
                .into_bytes(),
        ),
        (
            "chunked_response",
            Script::new()
                .open(0, server)
                .read(0, GET)
                .write(0, CHUNKED)
                .into_bytes(),
        ),
        (
            "chunked_past_capture",
            Script::new()
                .open(0, server)
                .read(0, GET)
                .transfer(0, DATA_WRITE, CHUNKED_HEAD, 4096, b"\r\n0\r\n\r\n")
                .into_bytes(),
        ),
        (
            "pipelined",
            Script::new()
                .open(1, server)
                .read(1, PIPELINED)
                .write(1, OK)
                .write(1, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
                .write(1, FAIL)
                .into_bytes(),
        ),
        (
            "run_with_rollout_body_and_calls",
            Script::new()
                .open(0, server)
                .read(0, RUN)
                .open(3, Role::Client)
                .write(3, CLIENT_CALL)
                .open(4, server)
                .read(4, CLIENT_CALL)
                .write(4, VERIFIED)
                .read(3, VERIFIED)
                .write(0, CHUNKED)
                .tick(100)
                .into_bytes(),
        ),
        (
            "half_request_then_close",
            Script::new()
                .open(2, server)
                .read(2, &VERIFY[..30])
                .close(2)
                .into_bytes(),
        ),
        (
            "fd_reuse_and_exit",
            Script::new()
                .open(1, server)
                .read(1, GET)
                .close(1)
                .open(1, server)
                .transfer(1, DATA_WRITE | STALE, OK, 0, &[])
                .read(1, GET)
                .fork(1, 2)
                .exit(1)
                .into_bytes(),
        ),
        (
            // asyncio's TLS: the plaintext of a call, then the records that carry it (TLS
            // 1.3: 22 bytes more), then the answer's records and plaintext.
            "tls_memory_bio",
            Script::new()
                .open(0, Role::Client)
                .write(0, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
                .read(0, b"\x16\x03\x03\x00\x7a\x02\x00\x00\x76\x03\x03")
                .tls(0, DATA_WRITE, CLIENT_CALL)
                .transfer(
                    0,
                    DATA_WRITE,
                    b"\x17\x03\x03",
                    CLIENT_CALL.len() as u16 + 22 - 3,
                    &[],
                )
                .transfer(0, 0, b"\x17\x03\x03", OK.len() as u16 + 22 - 3, &[])
                .tls(0, 0, OK)
                .into_bytes(),
        ),
        (
            "not_http",
            Script::new()
                .open(1, server)
                .read(1, b"SSH-2.0-OpenSSH_9.6\r\n")
                .read(1, b"GETX nonsense\r\n\r\n")
                .raw(&[2, 0, 0, 0, 1, 2, 3])
                .into_bytes(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus_dir() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/http_reassembly")
    }

    /// Every committed corpus input replays without a failed invariant (the fuzzer's finds
    /// stay fixed).
    #[test]
    fn the_fuzz_corpus_replays_cleanly() {
        let mut replayed = 0;
        for entry in std::fs::read_dir(corpus_dir()).expect("the fuzz corpus directory") {
            let path = entry.expect("a corpus entry").path();
            let script = std::fs::read(&path).expect("a corpus file");
            let result = std::panic::catch_unwind(|| replay(&script));
            assert!(result.is_ok(), "{} fails its replay", path.display());
            replayed += 1;
        }
        assert!(replayed > 0, "the fuzz corpus is empty");
    }

    #[test]
    fn seeds_exercise_what_they_are_named_for() {
        let seeds: std::collections::HashMap<_, _> = seed_scripts().into_iter().collect();
        let get = replay(&seeds["get_keep_alive"]);
        assert_eq!((get.responses, get.aborts), (2, 0));
        assert_eq!(get.spans_released, 2);
        let pipelined = replay(&seeds["pipelined"]);
        assert_eq!((pipelined.responses, pipelined.aborts), (3, 0));
        let chunked = replay(&seeds["chunked_past_capture"]);
        assert_eq!((chunked.responses, chunked.aborts), (1, 0));
        let run = replay(&seeds["run_with_rollout_body_and_calls"]);
        assert_eq!((run.responses, run.aborts), (3, 0));
        assert_eq!(run.stitch.cross_process_links, 1);
        let half = replay(&seeds["half_request_then_close"]);
        assert_eq!((half.responses, half.aborts), (0, 0));
        let reuse = replay(&seeds["fd_reuse_and_exit"]);
        assert_eq!((reuse.responses, reuse.aborts), (0, 2));
        assert_eq!(reuse.reassembly.data_without_connection, 1);
        let tls = replay(&seeds["tls_memory_bio"]);
        assert_eq!((tls.responses, tls.aborts), (1, 0));
        assert_eq!(tls.tls.tls_sessions_by_record_length, 1);
        assert_eq!(tls.reassembly.parse_errors(), 0);
        let garbage = replay(&seeds["not_http"]);
        assert_eq!(garbage.pipeline.events_undecodable, 1);
        assert!(garbage.reassembly.parse_not_http >= 1);
    }

    /// Whatever read boundaries the split replay picks, a chunked body whose framing is
    /// lost is counted (the blind fallback's end depends on where reads end, so such a
    /// replay is not compared).
    #[test]
    fn a_chunked_body_whose_framing_is_lost_is_counted_wherever_reads_end() {
        const BAD_CHUNKS: &[u8] =
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n0\r\n\r\n";
        // Ticks of different lengths move the clock, and so the split point, over every byte.
        for ms in 0..BAD_CHUNKS.len() as u16 {
            let script = Script::new()
                .open(1, Role::Server)
                .read(1, b"GET / HTTP/1.1\r\n\r\n")
                .tick(ms)
                .write(1, BAD_CHUNKS);
            let summary = replay(&script.into_bytes());
            assert_eq!(
                summary.reassembly.parse_lost_chunk_framing, 1,
                "after {ms} ms"
            );
        }
    }

    /// Writes the seed scripts into the corpus directory (run once after changing them).
    #[test]
    #[ignore = "writes files: cargo test -p tracer-userspace --lib write_seed_corpus -- --ignored"]
    fn write_seed_corpus() {
        let dir = corpus_dir();
        std::fs::create_dir_all(&dir).unwrap();
        for (name, script) in seed_scripts() {
            std::fs::write(dir.join(format!("seed-{name}")), script).unwrap();
        }
    }
}
