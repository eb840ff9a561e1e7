//! The pipeline core: kernel records in; finished spans, metric recordings and instructions
//! for the kernel out. No I/O of its own (a `--record` file is written through the writer the
//! driver hands it): the agent drives it with the ring buffer and hands its output to the
//! exporters and the probes; the fuzz target ([`replay`]) drives the very same code with
//! scripted records and checks its invariants through an [`Observer`]; a [`recording`] of a
//! real run drives it in the replay test, `gym-tracer replay` and [`cost`]. Every driver
//! steps it the same way (see [`Pipeline`]), and reads it only through its accessors.
//!
//! Per record: `kernel::events::decode` → `reassembly::connections::ConnectionTable::apply`
//! (request starts, bodies' rollout ids, finished exchanges) → at a start, the stitcher learns
//! the request; at an end, `signals` gives it its meaning, metrics and spans, which the
//! stitcher holds until their parents and trace ids are decided, then releases.

pub mod cost;
pub mod recording;
pub mod replay;

#[cfg(test)]
pub mod testing;

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::net::SocketAddr;
use std::time::Instant;

use crate::gym::ServerType;
use crate::gym::routes::{RouteName, RouteTemplate, strip_rollout_prefix};
use crate::gym::span_groups::{SpanGroup, SpanGroups};
use crate::insight::rollouts::agent_key;
use crate::insight::view::RolloutsView;
use crate::insight::{Insight, InsightCounters, ProcessView};
use crate::kernel::events::{DataTransfer, KernelEvent, TaskContext, decode};
use crate::model::counters::counters;
use crate::model::evidence::Token;
use crate::model::exchange::{HttpExchange, OpaqueTls, Outcome, RequestStart, Role, SocketId};
use crate::model::ids::SpanId;
use crate::model::service::{AgentResource, GymLabels};
use crate::model::span::SpanRecord;
use crate::pipeline::recording::{Input, Recorder};
use crate::processes::harvest::SelfPorts;
use crate::processes::{ProcessTable, TracedProcess, log_lifecycle};
use crate::reassembly::connections::{ConnectionTable, ReassemblyCounters, TableAction};
use crate::reassembly::tls::{ConnectionKey, Released, TlsCounters, TlsRecord, TlsSessions};
use crate::signals::clock::WallClock;
use crate::signals::meaning::{caller_is_gym_server, classify, semantic_at_start, wants_run_body};
use crate::signals::metrics::{RequestMetrics, ServerLevels};
use crate::signals::spans::{Peer, RequestView, opaque_tls_span, request_spans};
use crate::stitch::injection::TraceInjection;
use crate::stitch::{StartFacts, StitchConfig, StitchCounters, Stitcher};

/// Server addresses remembered for `peer.service`. A server listening on a wildcard
/// address is reached at as many local addresses as a peer chooses (all of 127/8), so this
/// is bounded; past it a server's new address is not named (counted: peer_names_dropped).
pub const MAX_PEER_NAMES: usize = 4096;

counters! {
    /// What the core itself counts (each stage it drives counts its own).
    pub struct PipelineCounters {
        /// Records read from the kernel's ring buffer.
        traced events_in,
        /// Records from the kernel that the agent could not decode. Should be 0: the agent and its
        /// eBPF object do not match; report a bug with the agent's log.
        lost events_undecodable,
        /// HTTP requests followed to their end, served and sent, aborted ones included.
        traced requests_traced,
        /// Served requests whose span is named by their method alone. The server had over 256
        /// guessed route names (ids the guess missed), or the path was no route (`*`, a full URL):
        /// name them with `--route TEMPLATE`.
        note requests_unnamed,
        /// The agent's own requests to the servers (the route harvest), not exported. Not a loss.
        note self_requests_ignored,
        /// Traced processes that replaced their program (`execve`). Their connections ended and
        /// their requests in flight were exported as aborted (`process_exec`); the new program is
        /// looked at afresh.
        note processes_execd,
        /// Forked children traced with their parent's identity (uvicorn workers).
        traced forks_followed,
        /// Server addresses not remembered for `peer.service` (past 4,096). Calls to those
        /// addresses carry no `peer.service` (`MAX_PEER_NAMES`).
        note peer_names_dropped,
        /// TLS connections that ended with no request the tracer could read. Each is exported as
        /// one `TLS` span. Expected with `--no-tls`; otherwise their process's TLS library is one
        /// the uprobes do not cover (see `tls_processes_unprobed` and the log).
        lost tls_connections_unread,
        /// Inputs left out of `--record FILE` (at 1 GiB, or a write failed: see the log). The
        /// agent itself went on as before.
        note inputs_not_recorded,
    }
}

/// Sees what flows between the stages, for checks the core itself does not make (the fuzz
/// target's invariants). Every method defaults to nothing.
pub trait Observer {
    /// A record decoded into an event, before any stage saw it.
    fn event(&mut self, _event: &KernelEvent<'_>) {}
    /// The connection table started a request.
    fn started(&mut self, _start: &RequestStart) {}
    /// A started request's body named its rollout.
    fn body_rollout(&mut self, _request: SpanId) {}
    /// The table gave up a socket (the kernel is told to stop capturing it).
    fn untracked(&mut self, _socket: SocketId) {}
    /// A request ended (with or without a response).
    fn ended(&mut self, _exchange: &HttpExchange) {}
    /// The spans built for one ended request, before the stitcher holds them.
    fn built(&mut self, _spans: &[SpanRecord]) {}
}

impl Observer for () {}

/// What happened to a traced process, for the driver to act on between ring-buffer batches
/// (they involve the kernel's PID filter and /proc).
#[derive(Debug, PartialEq, Eq)]
pub enum Lifecycle {
    /// Its end: the pipeline forgot it at the exit record (`known`: it was traced; `logged`:
    /// see [`TracedProcess::is_logged`]); the driver frees the rest.
    Exited { pid: u32, known: bool, logged: bool },
    /// Replaced its program; it stays traced, the connections the exec closed are ended.
    Execd(u32),
    /// A forked child that could not be adopted (its parent is no longer known): take it
    /// out of the kernel filter again. The kernel reports processes only, never threads.
    NotAdopted(u32),
}

/// What the pipeline hands back to its driver at the end of a step ([`Pipeline::deliver`]).
/// The driver owns one, acts on it and clears it: its buffers are swapped in and out, not
/// reallocated.
#[derive(Default)]
pub struct PipelineOutput {
    /// Spans let go of, complete with trace ids and parents, after the insight stage saw
    /// them (a rollout's top leaves once its tree is whole).
    pub released: Vec<SpanRecord>,
    /// Sockets to stop capturing in the kernel (`pid`, `fd`, `conn_id`, and whether the
    /// kernel keeps it as not HTTP: see [`TableAction::Untrack`]).
    pub untrack: Vec<(SocketId, u64, bool)>,
    pub lifecycle: Vec<Lifecycle>,
    /// Processes that just opened a TLS connection (one entry per connection): the driver
    /// makes sure their TLS library is probed.
    pub tls_opened: Vec<u32>,
    /// Handler traces the kernel is to write into outbound requests, or to forget.
    pub injections: Vec<TraceInjection>,
}

impl PipelineOutput {
    /// Empties every list, keeping their buffers.
    pub fn clear(&mut self) {
        self.released.clear();
        self.untrack.clear();
        self.lifecycle.clear();
        self.tls_opened.clear();
        self.injections.clear();
    }
}

/// Every stage's counters inside the core, as of now.
#[derive(Clone, Copy, Debug, Default)]
pub struct CoreCounters {
    pub pipeline: PipelineCounters,
    pub reassembly: ReassemblyCounters,
    pub tls: TlsCounters,
    pub stitch: StitchCounters,
    pub insight: InsightCounters,
}

/// What the core holds as of now (levels: they go up and down).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CoreLevels {
    pub processes_traced: usize,
    pub connections_tracked: usize,
    pub requests_in_flight: usize,
    pub spans_pending: usize,
}

pub struct PipelineConfig {
    /// Kernel timestamps to wall time (measured at start; a recording's own when replayed).
    pub clock: WallClock,
    pub max_connections: usize,
    /// `--routes`: templates that name requests before Gym's known routes and the harvest.
    pub routes: Vec<RouteTemplate>,
    pub agent_resource: AgentResource,
    pub groups: SpanGroups,
    pub stitch: StitchConfig,
}

/// Everything downstream of the ring buffer and upstream of the exporters. Closed: a driver
/// (the agent, the fuzz target's [`replay`], [`cost`]) feeds it records and time, and takes
/// what it produced with [`Pipeline::deliver`], which fixes the order of the stages' last
/// steps; it reads the stages only through the accessors below.
///
/// A step, as every driver takes it:
/// 1. [`Pipeline::handle_record`] for each ring-buffer record of a batch;
/// 2. [`Pipeline::release`] when the release timer ticks ([`Pipeline::release_all`] at the
///    end);
/// 3. [`Pipeline::deliver`], then act on the [`PipelineOutput`] and clear it.
pub struct Pipeline<M: RequestMetrics> {
    clock: WallClock,
    table: ConnectionTable,
    /// Ties TLS plaintext to its connection before the table sees it.
    tls: TlsSessions,
    processes: ProcessTable,
    groups: SpanGroups,
    /// Port pairs of the agent's own route harvests (shared with the harvest tasks).
    self_ports: SelfPorts,
    metrics: M,
    stitcher: Stitcher,
    /// After the stitcher: rollouts' phases and stragglers, the live view.
    insight: Insight,
    /// Requests the agent itself made (route harvests), dropped when they end.
    own_requests: HashSet<SpanId>,
    /// Listening addresses of traced Gym servers → server name (for `peer.service`) and type.
    peer_names: HashMap<SocketAddr, Peer>,
    counters: PipelineCounters,
    /// What this step produced so far, for [`Pipeline::deliver`].
    output: PipelineOutput,
    /// `--record FILE`: every input, as it comes.
    recorder: Option<Recorder>,
    /// The route harvest's marks used up by the record being handled (when recording).
    own_marks_taken: Vec<(u16, u16)>,
    exchanges: Vec<HttpExchange>,
    actions: Vec<TableAction>,
    span_batch: Vec<SpanRecord>,
}

impl<M: RequestMetrics> Pipeline<M> {
    pub fn new(config: PipelineConfig, metrics: M) -> Self {
        Self {
            clock: config.clock,
            table: ConnectionTable::new(config.max_connections).reading_run_bodies(wants_run_body),
            tls: TlsSessions::default(),
            processes: ProcessTable::new(config.routes, config.agent_resource),
            groups: config.groups,
            self_ports: SelfPorts::new(),
            metrics,
            stitcher: Stitcher::new(config.stitch),
            insight: Insight::default(),
            own_requests: HashSet::new(),
            peer_names: HashMap::new(),
            counters: PipelineCounters::default(),
            output: PipelineOutput::default(),
            recorder: None,
            own_marks_taken: Vec::new(),
            exchanges: Vec::new(),
            actions: Vec::new(),
            span_batch: Vec::new(),
        }
    }

    /// Writes every input from now on to `recorder` ([`recording`]).
    pub fn record_to(&mut self, recorder: Recorder) {
        self.recorder = Some(recorder);
    }

    /// Writes out what the recorder holds (at shutdown).
    pub fn flush_recording(&mut self) {
        if let Some(recorder) = &mut self.recorder {
            recorder.flush();
        }
    }

    fn record(&mut self, input: Input<'_>, at: Instant) {
        if let Some(recorder) = &mut self.recorder
            && !recorder.write(&input, at)
        {
            self.counters.inputs_not_recorded += 1;
        }
    }

    /// [`Self::record`] at the clock's now, read only when recording (steps call it).
    fn record_now(&mut self, input: impl FnOnce() -> Input<'static>) {
        if self.recorder.is_some() {
            self.record(input(), Instant::now());
        }
    }

    /// One ring-buffer record, at `now` (the stitcher's clock).
    pub fn handle_record(&mut self, bytes: &[u8], now: Instant, observer: &mut impl Observer) {
        self.apply_record(bytes, now, observer);
        if self.recorder.is_some() {
            // The route harvest's marks this record used up, before it: fed again, the
            // record finds them.
            for (client_port, server_port) in std::mem::take(&mut self.own_marks_taken) {
                let input = Input::OwnRequest {
                    client_port,
                    server_port,
                };
                self.record(input, now);
            }
            self.record(Input::Record(bytes), now);
        }
    }

    fn apply_record(&mut self, bytes: &[u8], now: Instant, observer: &mut impl Observer) {
        self.counters.events_in += 1;
        let Ok(event) = decode(bytes) else {
            self.counters.events_undecodable += 1;
            return;
        };
        observer.event(&event);
        match event {
            KernelEvent::ProcessExec { pid, .. } if self.processes.contains(pid) => {
                self.counters.processes_execd += 1;
                self.tls.process_gone(pid);
                self.output.lifecycle.push(Lifecycle::Execd(pid));
            }
            // Adopted at once: the child's own records may follow in this same batch.
            KernelEvent::ProcessFork { parent, child } => {
                self.adopt(parent, child);
                self.stitcher.forked(parent, child);
            }
            KernelEvent::SpawnContext {
                pid,
                child,
                ref writer,
            } => self.stitcher.spawned(pid, child, writer),
            _ => {}
        }
        match &event {
            KernelEvent::TlsData(transfer) => {
                let mut released = Vec::new();
                if let Some(connection) = self.tls.plaintext(transfer, &mut released) {
                    let data = DataTransfer {
                        pid: transfer.pid,
                        tid: transfer.tid,
                        fd: connection.id.fd,
                        conn_id: connection.conn_id,
                        timestamp_ns: transfer.timestamp_ns,
                        direction: transfer.direction,
                        captured: transfer.captured,
                        total_len: transfer.total_len,
                        tail: transfer.tail,
                        // Plaintext has no place in the TCP byte stream.
                        seq: None,
                    };
                    self.table
                        .apply_plaintext(&data, &mut self.exchanges, &mut self.actions);
                }
                self.apply_released(released, now, observer);
            }
            KernelEvent::TaskContext(context) if context.fd < 0 => {
                if let Some(connection) = self.tls.context(context) {
                    self.apply_context(context, connection);
                }
            }
            KernelEvent::Data(data) => {
                self.table
                    .apply(&event, &mut self.exchanges, &mut self.actions);
                self.output.tls_opened.append(&mut self.table.tls_opened);
                if self.table.take_ciphertext() {
                    let mut released = Vec::new();
                    self.tls.ciphertext(data, &mut released);
                    self.apply_released(released, now, observer);
                }
            }
            KernelEvent::Close {
                pid, fd, conn_id, ..
            } => {
                self.tls.closed(SocketId { pid: *pid, fd: *fd }, *conn_id);
                self.table
                    .apply(&event, &mut self.exchanges, &mut self.actions);
            }
            _ => self
                .table
                .apply(&event, &mut self.exchanges, &mut self.actions),
        }
        self.after_table(now, observer);
        // After the requests the exit or exec cut off are ended under the identity they were
        // served under, and before the next record: pids wrap, and the next process with this
        // pid may start within the same batch.
        match event {
            KernelEvent::ProcessExit { pid, .. } => {
                let logged = self
                    .processes
                    .get(pid)
                    .is_some_and(TracedProcess::is_logged);
                let known = self.forget_process(pid);
                self.output
                    .lifecycle
                    .push(Lifecycle::Exited { pid, known, logged });
            }
            KernelEvent::ProcessExec { pid, comm, .. } => {
                let length = comm.iter().position(|&b| b == 0).unwrap_or(comm.len());
                self.processes
                    .execd(pid, &String::from_utf8_lossy(&comm[..length]));
            }
            _ => {}
        }
    }

    /// TLS records whose connection just became known, in the order they were reported.
    fn apply_released(
        &mut self,
        released: Vec<Released>,
        now: Instant,
        observer: &mut impl Observer,
    ) {
        for Released {
            pid,
            connection,
            records,
        } in released
        {
            for record in records {
                match record {
                    TlsRecord::Context(context) => self.apply_context(&context, connection),
                    TlsRecord::Data(data) => self.table.apply_plaintext(
                        &data.on(pid, connection),
                        &mut self.exchanges,
                        &mut self.actions,
                    ),
                }
                // Each record's starts and ends before the next record's.
                self.after_table(now, observer);
            }
        }
    }

    fn apply_context(&mut self, context: &TaskContext, connection: ConnectionKey) {
        let on_socket = TaskContext {
            fd: connection.id.fd,
            conn_id: connection.conn_id,
            ..*context
        };
        self.table.apply(
            &KernelEvent::TaskContext(on_socket),
            &mut self.exchanges,
            &mut self.actions,
        );
    }

    /// Acts on what the table reported for the last event it applied.
    fn after_table(&mut self, now: Instant, observer: &mut impl Observer) {
        for connection in std::mem::take(&mut self.table.ended_opaque) {
            self.opaque_tls(&connection);
        }
        // Starts first: a request's span id must be known before anything refers to it.
        let mut actions = std::mem::take(&mut self.actions);
        for action in actions.drain(..) {
            match action {
                TableAction::Started(start) => {
                    observer.started(&start);
                    self.start_request(&start, now);
                }
                TableAction::RolloutFromBody {
                    span_id,
                    rollout_id,
                } => {
                    observer.body_rollout(span_id);
                    self.stitcher.set_rollout(span_id, rollout_id);
                }
                TableAction::ResponseWriter { span_id, writer } => {
                    self.stitcher.response_writer(span_id, writer);
                }
                TableAction::ResponseId { span_id, token } => {
                    self.stitcher.response_id(span_id, token);
                }
                TableAction::Untrack {
                    id,
                    conn_id,
                    not_http,
                } => {
                    observer.untracked(id);
                    // Its close will not be reported: its TLS sessions are untied now.
                    self.tls.closed(id, conn_id);
                    self.output.untrack.push((id, conn_id, not_http));
                }
            }
        }
        self.actions = actions;
        let mut exchanges = std::mem::take(&mut self.exchanges);
        for exchange in exchanges.drain(..) {
            observer.ended(&exchange);
            self.end_request(&exchange, now, observer);
        }
        self.exchanges = exchanges;
        for pair in self.table.ended_connections.drain(..) {
            self.stitcher.connection_ended(pair);
        }
    }

    /// Releases the spans whose chains settled (called on a timer: it batches, the events
    /// decide).
    pub fn release(&mut self, now: Instant) {
        self.record(Input::Release, now);
        self.stitcher.release(now, &mut self.output.released);
    }

    /// Releases every held span (shutdown).
    pub fn release_all(&mut self) {
        self.record_now(|| Input::ReleaseAll);
        self.tls.give_up_held();
        self.stitcher.release_all(&mut self.output.released);
    }

    /// Ends a step: the stitcher keeps back the tops of rollouts whose trees are not whole
    /// yet, the insight stage reads the spans released since the last step (rollouts that
    /// ended get their phases, and the metrics record them), and what the step produced is
    /// swapped into `into`, which the driver cleared after the last step.
    pub fn deliver(&mut self, into: &mut PipelineOutput) {
        self.record_now(|| Input::Deliver);
        self.observe_released();
        self.output
            .injections
            .append(&mut self.stitcher.take_injections());
        debug_assert!(into.released.is_empty() && into.lifecycle.is_empty());
        std::mem::swap(&mut self.output, into);
    }

    fn observe_released(&mut self) {
        // The stitcher's last word on what leaves: a rollout's top waits for its tree.
        self.stitcher.hold_rollout_tops(&mut self.output.released);
        let processes = &self.processes;
        let server_type = |service: &crate::model::service::ServiceIdentity| {
            processes
                .get(service.pid)
                .and_then(|process| process.server_type)
                .or_else(|| service.labels.server_kind.as_ref()?.known())
        };
        self.insight
            .observe(&mut self.output.released, &server_type);
        for summary in self.insight.finished.drain(..) {
            self.metrics.record_rollout(&summary);
        }
    }

    /// The live view of rollouts in flight, completed rollouts and the servers' load.
    pub fn rollouts_view(&self, now: Instant) -> RolloutsView {
        let process = |pid: u32| {
            let process = self.processes.get(pid)?;
            Some(ProcessView {
                name: agent_key(&process.identity),
                server_type: process.server_type,
            })
        };
        let peer = |address: SocketAddr| self.peer_names.get(&address).map(|p| p.name.clone());
        self.insight.view(now, &self.stitcher, process, peer)
    }

    /// A traced process's event-loop thread was on a CPU for `share` of the last interval:
    /// kept for the live view, and with the rollouts it has in flight, for the gauges.
    pub fn set_loop_utilization(&mut self, pid: u32, share: f64) {
        self.insight.set_loop_utilization(pid, share);
    }

    /// Hands the gauges their levels: each traced process's loop utilization, and each agent
    /// server's rollouts in flight.
    pub fn publish_levels(&mut self, utilization: &HashMap<u32, f64>) {
        let runs = self.insight.runs_in_flight();
        for pid in self.processes.pids().collect::<Vec<_>>() {
            let is_agent = self
                .processes
                .get(pid)
                .is_some_and(|p| p.server_type == Some(ServerType::Agent));
            let levels = ServerLevels {
                loop_utilization: utilization.get(&pid).copied(),
                rollouts_in_flight: is_agent.then(|| runs.get(&pid).copied().unwrap_or(0)),
            };
            self.metrics.set_levels(pid, levels);
        }
    }

    /// Names `address` as server `name` (of `server_type`, when known) for `peer.service`,
    /// within [`MAX_PEER_NAMES`]; a server that took over an address renames it.
    pub fn name_peer(&mut self, address: SocketAddr, name: &str, server_type: Option<ServerType>) {
        let known = self.peer_names.get(&address);
        if known.is_some_and(|peer| peer.name == name && peer.server_type == server_type) {
            return;
        }
        // Recorded when it changes something: every served request names its address.
        if self.recorder.is_some() {
            let input = Input::NamePeer {
                address,
                name,
                server_type,
            };
            self.record(input, Instant::now());
        }
        if self.peer_names.len() < MAX_PEER_NAMES || self.peer_names.contains_key(&address) {
            let peer = Peer {
                name: name.to_string(),
                server_type,
            };
            self.peer_names.insert(address, peer);
        } else {
            self.counters.peer_names_dropped += 1;
        }
    }

    /// Traces `pid` as a process labelled `labels`.
    pub fn attach(&mut self, pid: u32, labels: GymLabels) -> &TracedProcess {
        if self.recorder.is_some() {
            let labels = labels.clone();
            self.record(Input::Attach { pid, labels }, Instant::now());
        }
        self.processes.attach(pid, labels)
    }

    /// A traced process, as the core knows it.
    pub fn process(&self, pid: u32) -> Option<&TracedProcess> {
        self.processes.get(pid)
    }

    pub fn is_traced(&self, pid: u32) -> bool {
        self.processes.contains(pid)
    }

    /// Whether no process is traced (any more).
    pub fn traces_nothing(&self) -> bool {
        self.processes.is_empty()
    }

    /// The traced processes' pids (their order is the table's).
    pub fn traced_pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.processes.pids()
    }

    /// Route templates read from `root`'s `/openapi.json`, for it and its children.
    pub fn set_harvested_routes(&mut self, root: u32, templates: &[RouteTemplate]) {
        if self.recorder.is_some() {
            let templates = templates.iter().map(RouteTemplate::as_str).collect();
            self.record(Input::Routes { root, templates }, Instant::now());
        }
        self.processes.set_harvested_routes(root, templates);
    }

    /// The port pairs of the agent's own route harvests, for the harvest tasks to mark.
    pub fn self_ports(&self) -> SelfPorts {
        self.self_ports.clone()
    }

    /// Every stage's counters.
    pub fn counters(&self) -> CoreCounters {
        CoreCounters {
            pipeline: self.counters,
            reassembly: self.table.counters,
            tls: self.tls.counters,
            stitch: self.stitcher.counters,
            insight: self.insight.counters(),
        }
    }

    /// What the core holds now.
    pub fn levels(&self) -> CoreLevels {
        CoreLevels {
            processes_traced: self.processes.len(),
            connections_tracked: self.table.open_connections(),
            requests_in_flight: self.table.in_flight_requests(),
            spans_pending: self.stitcher.held(),
        }
    }

    /// Whether rollout tops still wait for spans the stitcher holds (none should once
    /// everything was released).
    pub fn rollouts_waiting(&self) -> bool {
        self.stitcher.rollout_tops_waiting()
    }

    /// The metrics recorder back, for its final flush.
    pub fn into_metrics(self) -> M {
        self.metrics
    }

    /// A traced process is gone: free what was kept for it.
    pub fn forget(&mut self, pid: u32) -> bool {
        self.record_now(|| Input::Forget { pid });
        self.forget_process(pid)
    }

    fn forget_process(&mut self, pid: u32) -> bool {
        let known = self.processes.remove(pid).is_some();
        self.tls.process_gone(pid);
        self.insight.process_gone(pid);
        if known {
            self.metrics.remove_service(pid);
        }
        self.stitcher.forget_process(pid);
        known
    }

    fn start_request(&mut self, start: &RequestStart, now: Instant) {
        if start.role == Role::Server && self.is_own(start) {
            self.own_requests.insert(start.span_id);
            if let (Some(peer), Some(local), Some(_)) = (start.peer, start.local, &self.recorder) {
                self.own_marks_taken.push((peer.port(), local.port()));
            }
            return;
        }
        let Some(process) = self.processes.get_mut(start.pid) else {
            return;
        };
        let stripped = strip_rollout_prefix(&start.path);
        let rollout_id = stripped.rollout_id;
        let run = start.role == Role::Server
            && process.server_type == Some(ServerType::Agent)
            && stripped.route_path == "/run";
        let facts = match start.role {
            Role::Server => {
                let semantic = semantic_at_start(process, &start.method, stripped.route_path);
                let server_name = process.identity.server_name().map(str::to_owned);
                let server_type = process.server_type;
                let facts = StartFacts {
                    rollout_id,
                    emits_own: self.groups.contains(SpanGroup::Server),
                    emits_semantic: semantic.is_some_and(|s| self.groups.contains(s.group)),
                    inbound_hidden: false,
                    caller_traced: caller_is_gym_server(process, stripped.route_path),
                    caller_seen_here: start
                        .peer
                        .zip(start.local)
                        .is_some_and(|(peer, local)| self.table.is_traced_client(peer, local)),
                };
                if let (Some(local), Some(name)) = (start.local, server_name) {
                    self.name_peer(local, &name, server_type);
                }
                facts
            }
            Role::Client => StartFacts {
                rollout_id,
                emits_own: self.groups.contains(SpanGroup::HttpClient),
                emits_semantic: false,
                inbound_hidden: self.tls.hides_inbound(start.pid),
                caller_traced: false,
                caller_seen_here: false,
            },
        };
        self.stitcher.start(start, facts, now);
        let run_trace = run.then(|| self.stitcher.trace_of(start.span_id));
        self.insight.request_started(start, now, run_trace);
    }

    fn end_request(&mut self, exchange: &HttpExchange, now: Instant, observer: &mut impl Observer) {
        self.counters.requests_traced += 1;
        let stitcher = &self.stitcher;
        self.insight
            .request_ended(exchange.span_id, || stitcher.trace_of(exchange.span_id));
        if self.own_requests.remove(&exchange.span_id) {
            self.counters.self_requests_ignored += 1;
            self.stitcher.finish(exchange.span_id);
            return;
        }
        let Some(process) = self.processes.get_mut(exchange.pid) else {
            self.stitcher.finish(exchange.span_id);
            return;
        };
        let meaning = classify(process, exchange);
        if exchange.role == Role::Server && meaning.route == RouteName::Unnamed {
            self.counters.requests_unnamed += 1;
        }
        if let Some(opened) = sessions_opened(process.server_type, exchange) {
            self.stitcher.sessions_set(exchange.span_id, &opened, now);
        }
        let identity = process.identity.clone();
        let server_type = process.server_type;
        let peer = exchange
            .peer
            .filter(|_| exchange.role == Role::Client)
            .and_then(|peer| self.peer_names.get(&peer));
        self.metrics.record(
            &identity,
            exchange,
            &meaning,
            peer.map(|peer| peer.name.as_str()),
        );
        let view = RequestView {
            exchange,
            service: &identity,
            server_type,
            meaning: &meaning,
            semantic_span_id: self.stitcher.semantic_span_id(exchange.span_id),
            peer,
        };
        request_spans(&view, self.groups, self.clock, &mut self.span_batch);
        observer.built(&self.span_batch);
        self.stitcher.hold_all(
            exchange.span_id,
            &mut self.span_batch,
            &mut self.output.released,
        );
        self.stitcher.finish(exchange.span_id);
    }

    /// A TLS connection whose requests were never read: one span of what the syscalls showed
    /// (connection, timing, bytes), straight out (no request refers to it).
    fn opaque_tls(&mut self, connection: &OpaqueTls) {
        let Some(process) = self.processes.get(connection.pid) else {
            return;
        };
        let kind = match connection.role {
            Role::Client => SpanGroup::HttpClient,
            Role::Server => SpanGroup::Server,
        };
        self.counters.tls_connections_unread += 1;
        if self.groups.contains(kind) {
            let span = opaque_tls_span(connection, &process.identity, self.clock);
            self.output.released.push(span);
        }
    }

    /// The agent's own route harvest arrives at the server like any client's request: its
    /// connection was marked when the agent opened it (the mark is used up here).
    fn is_own(&self, start: &RequestStart) -> bool {
        match (start.peer, start.local) {
            (Some(peer), Some(local)) => {
                peer.ip() == local.ip() && self.self_ports.take(peer.port(), local.port())
            }
            _ => false,
        }
    }

    fn adopt(&mut self, parent: u32, child: u32) {
        match self.processes.adopt_child(parent, child) {
            Some(process) => {
                self.counters.forks_followed += 1;
                log_lifecycle(
                    process.is_logged(),
                    child,
                    format_args!(
                        "attached pid {child} as {} (child of pid {parent})",
                        process.identity.labels
                    ),
                );
            }
            None => self.output.lifecycle.push(Lifecycle::NotAdopted(child)),
        }
    }
}

/// The sessions a Gym resources server opened with its response to `exchange`: the session
/// cookies it set that the request did not carry. A resources server's session is one
/// rollout's (`/seed_session` opens it); a cookie the client already carried, or one set by
/// another kind of server (a constant or per-client cookie), says nothing about the rollout.
fn sessions_opened(server_type: Option<ServerType>, exchange: &HttpExchange) -> Option<Vec<Token>> {
    let Outcome::Response(response) = &exchange.outcome else {
        return None;
    };
    if exchange.role != Role::Server || server_type != Some(ServerType::Resources) {
        return None;
    }
    let opened: Vec<Token> = response
        .sessions_set
        .iter()
        .filter(|token| !exchange.request.session_tokens.contains(token))
        .copied()
        .collect();
    (!opened.is_empty()).then_some(opened)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::evidence::cookie_tokens;
    use crate::model::exchange::ResponseHead;

    fn seed(carried: &[u8], set: &[u8]) -> HttpExchange {
        let mut request = testing::request("POST", "/seed_session");
        request.session_tokens = cookie_tokens(carried);
        let response = Outcome::Response(ResponseHead {
            status: 200,
            version_minor: 1,
            sessions_set: cookie_tokens(set),
        });
        testing::exchange(1, Role::Server, request, response)
    }

    /// Only a session a resources server opens names a rollout: not a cookie the client
    /// already carried (the Gym-shaped servers' constant one), nor another server's.
    #[test]
    fn a_session_is_opened_by_a_resources_servers_new_cookie_only() {
        let opened = seed(b"", b"session=eyJzZXNzaW9u.Z1x2.sig");
        assert_eq!(
            sessions_opened(Some(ServerType::Resources), &opened),
            Some(cookie_tokens(b"session=eyJzZXNzaW9u.Z1x2.sig"))
        );
        assert_eq!(sessions_opened(Some(ServerType::Model), &opened), None);
        assert_eq!(sessions_opened(None, &opened), None);
        let carried = seed(
            b"session=eyJzZXNzaW9u.Z1x2.sig",
            b"session=eyJzZXNzaW9u.Z1x3.sig2",
        );
        assert_eq!(sessions_opened(Some(ServerType::Resources), &carried), None);
    }
}
