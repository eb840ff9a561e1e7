//! Stitching: which span is whose parent and which trace each one is in, so that one rollout
//! reads as one trace across the agent, model and resources processes.
//!
//! # How parents are decided
//!
//! This is the text `gym-tracer --help` and docs/how-it-works.md print ([`EDGE_RULES`]):
//!
#![doc = include_str!("edges.md")]
//!
//! # Where in the code
//!
//! Every request gets its span id when its head is seen ([`RequestStart`]), long before it
//! ends, so edges can be drawn while both ends are still in flight. A call's parent inside a
//! process is chosen in [`calls`] (the evidence, intersected) and [`lineage`] (the kernel's
//! task lineage); a process without task contexts is decided by
//! `Stitcher::choose_caller_without_context`. Across processes the connection keys live here;
//! across hosts a trace's id is [`rollout_trace_id`] and a CLIENT span's is decided in
//! [`call_ids`]. Trace ids are resolved when a span is released, not when it is
//! built: [`settle`] says, per kind of evidence, which event closes a span's chain.

/// How parents are decided, for people: `gym-tracer --help` and docs/how-it-works.md print
/// it, and it opens this module's doc. Keep it true to [`calls`], [`lineage`] and [`settle`].
pub const EDGE_RULES: &str = include_str!("edges.md");

mod call_ids;
mod calls;
pub mod context_keys;
pub mod injection;
mod lineage;
pub mod rollout_tops;
mod rollouts;
mod settle;
mod spawns;

use crate::model::counters::counters;
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

// The hot-path maps (these, the connection table's, the pipeline's, the metrics') hash with
// foldhash: seeded per process like std's SipHash, which was 7 % of the agent's CPU.
use foldhash::{HashMap, HashMapExt};

use crate::gym::rollout_id::RolloutId;
use crate::model::attributes as attr;
use crate::model::context::{ContextChain, OriginId};
use crate::model::evidence::Token;
use crate::model::exchange::InboundSocket;
use crate::model::exchange::RequestStart;
use crate::model::exchange::Role;
use crate::model::ids::MintKey;
use crate::model::ids::SpanId;
use crate::model::ids::TraceId;
use crate::model::ids::derived_id;
use crate::model::ids::parse_traceparent;
use crate::model::span::AttributeValue;
use crate::model::span::SpanKind;
use crate::model::span::SpanRecord;
use call_ids::{CallId, SharedIds};
pub use calls::GroupKey;
use context_keys::LoopTails;

/// A table whose capacity is more than this many times its length gives the memory back (a
/// burst of requests leaves its high-water mark otherwise).
const SHRINK_FACTOR: usize = 4;

/// Parent chains longer than this are cut (they cannot happen in a real call graph; the
/// bound keeps a corrupted graph from looping).
const MAX_DEPTH: usize = 64;

/// How long a session cookie names its rollout after it was opened or last carried: longer
/// than a rollout's pause between calls to one server (a slow model turn, a long tool).
const SESSION_LINGER: Duration = Duration::from_secs(1800);

#[derive(Clone, Copy, Debug)]
pub struct StitchConfig {
    /// Finished spans held at most; past it the oldest is released early (and counted).
    pub max_pending: usize,
    /// Requests (in flight or recently finished) the graph holds at most.
    pub max_nodes: usize,
    /// `--inject-traceparent`, when on.
    pub injection: Option<Injection>,
}

/// What the stitcher must know of `--inject-traceparent`: it publishes the traces of bound
/// handlers ([`injection`]), names the calls the kernel may write a header into with ids the
/// header carries ([`call_ids`]), and gives an inbound request without a header the trace the
/// kernel minted for it.
#[derive(Clone, Copy, Debug)]
pub struct Injection {
    /// Every call may carry a header (`all`), not only those to another host (`remote`).
    pub every_call: bool,
    pub mint_key: MintKey,
}

/// Which span of a request a held record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanRole {
    /// The SERVER or CLIENT span of the request itself.
    Own,
    /// The `gym.*` INTERNAL span of an inbound request.
    Semantic,
}

counters! {
    /// What the stitcher counts: every edge it could not decide, by reason.
    pub struct StitchCounters {
        /// Server spans linked to the client span of their caller on this host.
        traced cross_process_links,
        /// Server spans given a caller's client span on another host as parent. Matched by the TCP
        /// sequence number of the request's first byte; the caller's host's agent exports that
        /// parent.
        traced cross_host_parents,
        /// Server spans of calls from another host whose trace is not known here. Exported as roots
        /// marked `gym_tracer.parent.unjoined` (no rollout id, or no TCP sequence number): turn on
        /// Gym's `observability_enabled` (path prefixes), run the server on its callers' host, or
        /// run the callers' agent with `--inject-traceparent`.
        undecided cross_host_unjoined,
        /// Inbound requests given their rollout by a session cookie. The same resources server's
        /// response to a request of that rollout opened the session (`/seed_session`).
        traced rollouts_by_session,
        /// Server spans whose parent an inbound `traceparent` names. Another agent's injection, or
        /// the caller's own instrumentation.
        traced parents_from_traceparent,
        /// Handler traces given to the kernel for their next outbound requests. With
        /// `--inject-traceparent` only.
        traced traces_published,
        /// Handler traces held back from the kernel because they could still change. Counted at
        /// each try: a root with no rollout id yet is published if it settles while the request is
        /// in flight (then also in `traces_published`), else its calls leave without a
        /// `traceparent`.
        note traces_unsettled,
        /// Sessions opened for two different rollouts: no longer used as evidence.
        note sessions_conflicting,
        /// Calls left without a parent: several inbound requests fit their evidence. Counted when
        /// the call's span is released. Turn on Gym's `observability_enabled` (rollout ids on every
        /// call), or `--task-lineage on` for CPython 3.12 and 3.13 servers.
        undecided parents_ambiguous,
        /// Calls left without a parent because their evidence contradicted itself. Items named
        /// different requests, or a rollout the only request in flight does not belong to; counted
        /// when the call's span is released.
        undecided parents_contradicted,
        /// Calls left without a parent: their process had no request in flight. Expected for calls
        /// a process makes on its own (startup, background loops, a client script); a call made
        /// after its request was answered is placed only with `--task-lineage`. Counted when the
        /// call's span is released.
        undecided parents_no_request_in_flight,
        /// Calls left without a parent: nothing tied them to a request in flight. Counted when the
        /// call's span is released. Turn on Gym's `observability_enabled` (rollout ids on every
        /// call) or `--task-lineage on`, and check `python_runtimes_off` (no task contexts there).
        undecided parents_no_evidence,
        /// Calls given their parent by task lineage (`--task-lineage`). The task that wrote the
        /// call descends from the inbound request's root task.
        decided parents_by_lineage,
        /// Calls given their parent by the rollout id they name (path prefix or body).
        decided parents_by_rollout_id,
        /// Calls given their parent by a session the request carried too. A session cookie, or
        /// Gym's MCP session token header.
        decided parents_by_session,
        /// Calls given their parent by their handler task's context. Shared with a call of the same
        /// handler that other evidence placed.
        decided parents_by_task_context,
        /// Calls given their parent by the context a response was written under. Where no
        /// middleware task sits between the handler and the socket, the inbound request's response
        /// is written under the context of the handler that made the calls.
        decided parents_by_response_context,
        /// Calls given their parent by the response id the request's response echoed.
        decided parents_by_echoed_id,
        /// Calls given their parent as the only inbound request in flight. In a process without
        /// task contexts, or when no other evidence came.
        decided parents_by_only_inbound,
        /// Calls given their parent by nesting: the innermost request in flight. Only in processes
        /// without task contexts, when the requests in flight are nested.
        decided parents_by_nesting,
        /// Calls of a process a traced server spawned, given the request it was spawned for. A CLI
        /// agent, a verifier or a sandbox forked while a handler served the request, and their
        /// descendants.
        decided parents_by_spawn,
        /// Processes a traced Python server forked while serving a request. Their calls hang under
        /// it (`parents_by_spawn`).
        traced processes_spawned_in_requests,
        /// Processes a traced Python server forked outside any request the evidence names. Workers
        /// and helpers started at startup; their own calls are placed by their own requests.
        note processes_spawned_outside_requests,
        /// Handler tasks whose calls' evidence named a second inbound request. The task keeps the
        /// first; the calls its context placed stay as they were.
        note task_context_conflicts,
        /// Calls from tasks that belong to no request (timers, background loops). Their lineage
        /// names no inbound request; other evidence may still place them, else they are counted
        /// under `parents_*`.
        note lineage_calls_background,
        /// Calls from tasks with no recorded lineage. The task or an ancestor was created before
        /// the probe, or forgotten past `--max-tasks`; other evidence may still place them.
        note lineage_calls_unseen,
        /// Calls written outside any asyncio task. Loop callbacks, or a thread without an event
        /// loop; other evidence may still place them.
        note lineage_calls_no_task,
        /// Calls whose running task could not be read. Other evidence may still place them.
        note lineage_calls_unreadable,
        /// Calls whose lineage named an inbound request the graph no longer holds. Evicted, or on a
        /// connection the tracer does not follow: placed by a response of the same request root, or
        /// by other evidence.
        note lineage_requests_unmatched,
        /// Request roots whose evidence named two different inbound requests. The kernel's birth
        /// record and a response one of its tasks wrote disagree; their calls stay as they were.
        note lineage_conflicts,
        /// Regroupings of a process's calls after its loop's context tail changed. Not a loss.
        note task_context_regroups,
        /// Outbound requests to an address of this host. Each waits for its server end and ends in
        /// exactly one of `cross_process_links`, `local_calls_parented_by_header`,
        /// `spans_flushed_unmatched` or a `local_calls_unlinked_*` reason: their sum is this, once
        /// nothing waits.
        traced local_calls,
        /// Local calls whose server end took its parent from a `traceparent` header. The caller's
        /// own instrumentation named another parent, and the header wins.
        decided local_calls_parented_by_header,
        /// Local calls whose server end was not seen before the next request. Another request
        /// started on the connection first: the server is not traced, or missed the request.
        note local_calls_unlinked_next_request,
        /// Local calls whose server end was not seen before the connection ended. Usually a server
        /// that is not traced.
        note local_calls_unlinked_closed,
        /// Local calls whose server end was not seen before the calling process exited.
        note local_calls_unlinked_process_exit,
        /// Local calls still waiting for their server end when the agent shut down. Expected for
        /// calls in flight at exit.
        note local_calls_unlinked_shutdown,
        /// Server requests whose traced caller on this host was never seen. Exported as roots once
        /// the connection ended, carried its next request, or the process exited; check
        /// `events_lost_in_kernel` and `parse_*` for the caller's lost request.
        lost callers_unseen,
        /// Server spans released before their caller's client span was seen. The edge is lost:
        /// released early (`spans_released_early`), or a caller that was not known to be traced
        /// when the request started.
        lost spans_flushed_unmatched,
        /// Calls whose parent was decided after a span of theirs had gone out. That span (or one
        /// below, such as the callee's) is in a trace of its own, so the edge is not drawn: no span
        /// may name a parent in another trace. Usually spans released early: raise
        /// `--max-stitching-spans`.
        lost parents_decided_late,
        /// Rollouts summed up before every span that could be theirs was released. Past
        /// `MAX_WAITING_ROLLOUTS` (65,536) kept back at once: their phases may miss spans still
        /// held.
        lost rollouts_completed_early,
        /// Spans let go early because `--max-stitching-spans` were held. Released before their
        /// parents and trace settled, their edges may be missing (see `parents_decided_late`,
        /// `spans_flushed_unmatched`): raise `--max-stitching-spans`.
        note spans_released_early,
        /// Calls to another host released with the id an earlier call of their trace had. Their
        /// first bytes had one TCP sequence number; the later one went out under an id of its own,
        /// and its callee's SERVER span, named by the shared id, may hang under the earlier call.
        lost shared_call_ids_repeated,
        /// Shared call ids that left the window checked for repeats (as many as the request graph
        /// holds). A call of the same trace with the same TCP sequence number after that is not
        /// caught; two calls of one trace that far apart are rare.
        note shared_call_ids_forgotten,
        /// Finished requests dropped from the full request graph to make room. A call made after
        /// its caller answered then finds no parent. The graph holds 4 times
        /// `--max-stitching-spans` requests: raise it.
        lost stitch_nodes_evicted,
        /// Requests not entered into the full request graph: their spans stand alone. Every request
        /// in it was still needed; raise `--max-stitching-spans` (the graph holds 4 times as many
        /// requests).
        lost stitch_nodes_refused,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Parent {
    None,
    /// From an inbound `traceparent`: a span of a process seen only through its header.
    Remote(TraceId, SpanId),
    /// A request of this host: for a server, the caller's client request; for a client, the
    /// inbound request that made the call.
    Local(SpanId),
}

/// Why an outbound call has no parent yet (see the `parents_*` counters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Undecided {
    NoInbound,
    NoEvidence,
    Ambiguous,
    Contradicted,
}

/// What decided a call's parent (see the `parents_by_*` counters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Evidence {
    Lineage,
    RolloutId,
    Session,
    TaskContext,
    ResponseContext,
    EchoedId,
    OnlyInbound,
    Nesting,
    Spawn,
}

/// One request in the graph.
#[derive(Debug)]
struct Node {
    pid: u32,
    role: Role,
    /// When it started and finished, in the graph's own order ([`Stitcher::seq`]): a call
    /// can only belong to a request that was in flight when it started.
    started: u64,
    ended: Option<u64>,
    /// Inbound: the session tokens its request carried; outbound: the ones the call carries.
    session_tokens: Vec<Token>,
    /// Outbound: the task context of its first write (boxed: most requests have none, and
    /// every request in the graph pays the field).
    context: Option<Box<ContextChain>>,
    /// Outbound: the request root its writing task descends from (`--task-lineage`).
    origin: Option<OriginId>,
    /// Outbound, until placed: why it has no parent.
    undecided: Option<Undecided>,
    parent: Parent,
    /// Its own: the path prefix, the `/run` body, or adopted from the calls it made.
    rollout: Option<RolloutId>,
    /// Whether the request's own SERVER/CLIENT span is emitted (span groups).
    emits_own: bool,
    /// The `gym.*` span's id, when one will be emitted: the calls the request makes hang
    /// under it, as under Gym's `gym.rollout`.
    semantic_span_id: Option<SpanId>,
    /// Outbound: see [`StartFacts::inbound_hidden`].
    inbound_hidden: bool,
    /// The TCP sequence number of the request's first byte, when the kernel read it: both
    /// ends see it, so with the trace it names a call across hosts ([`SpanId::of_call`]).
    tcp_seq: Option<u32>,
    /// Client: the id its CLIENT span goes out with ([`call_ids`]).
    call_id: CallId,
    /// Inbound: its caller is a Gym server ([`StartFacts::caller_traced`]) on another host
    /// (its address is neither loopback nor the server's own).
    caller_on_other_host: bool,
    /// Inbound, plaintext: where its response goes ([`injection`]).
    inbound_socket: Option<InboundSocket>,
    /// Inbound, with `--inject-traceparent`: the trace this host's kernel gave it, which its
    /// handler's calls carry; its trace if it is a root.
    minted_trace: Option<TraceId>,
    /// Set when a span of the request (or of a descendant) is released: fixed from then on.
    trace: Option<TraceId>,
    /// Used if the request turns out to be a root without a rollout id.
    random_trace: TraceId,
    finished: bool,
    /// What its parent still waits for ([`settle`]); `None` once nothing can change it.
    awaiting: Option<settle::Awaiting>,
    /// What keeps it in the graph once finished: requests hanging under it, its own spans
    /// held, its connection key waiting for the server's end.
    children: Vec<SpanId>,
    held_spans: u32,
    keyed: bool,
}

impl Node {
    /// Whether anything still needs the request in the graph.
    fn pinned(&self) -> bool {
        !self.finished
            || !self.children.is_empty()
            || self.held_spans > 0
            || self.keyed
            || self.awaiting.is_some()
    }
}

fn shrink_if_sparse<K: std::hash::Hash + Eq, V>(map: &mut HashMap<K, V>) {
    if map.capacity() > SHRINK_FACTOR * map.len() + 1024 {
        map.shrink_to(2 * map.len());
    }
}

/// Where a request is in its connection, as both ends see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum RequestPosition {
    /// The TCP sequence number of its first byte: exact whatever either end missed (a
    /// request one end never saw, a retry, pipelining).
    Tcp(u32),
    /// Its ordinal on the connection, when the kernel could not read sequence numbers
    /// (TLS plaintext, a kernel without the offsets): right while both ends saw every request.
    Ordinal(u64),
}

impl RequestPosition {
    fn of(start: &RequestStart) -> Self {
        match start.tcp_seq {
            Some(seq) => Self::Tcp(seq),
            None => Self::Ordinal(start.sequence),
        }
    }
}

struct Held {
    node: SpanId,
    role: SpanRole,
    span: SpanRecord,
}

/// Whether a connection's two ends are on one host: the peer is a loopback address or this
/// host's own (a call between processes here, whose other end this agent may see).
fn on_one_host((local, peer): (SocketAddr, SocketAddr)) -> bool {
    let (local, peer) = (local.ip().to_canonical(), peer.ip().to_canonical());
    peer.is_loopback() || peer == local
}

/// The trace id of every span of a rollout: the first 16 bytes of
/// SHA-256("nemo.gym.rollout/" + rollout id).
pub fn rollout_trace_id(rollout_id: &RolloutId) -> TraceId {
    TraceId(derived_id(
        b"nemo.gym.rollout/",
        rollout_id.as_str().as_bytes(),
    ))
}

pub struct Stitcher {
    config: StitchConfig,
    nodes: HashMap<SpanId, Node>,
    /// Rollout tops released but kept back until their trees are whole ([`rollout_tops`]).
    rollout_tops: VecDeque<rollout_tops::RolloutTop>,
    /// In-flight inbound requests per process, by start: the candidates for an outbound
    /// call's parent.
    inbound: HashMap<u32, BTreeMap<u64, SpanId>>,
    /// In-flight inbound requests per (process, rollout they belong to): what a call naming
    /// a rollout looks up, instead of scanning the requests in flight ([`rollouts`]). An
    /// entry may be stale (checked on use), never missing.
    rollout_inbound: HashMap<(u32, RolloutId), Vec<SpanId>>,
    /// The stack of a walk down the graph, kept between walks so a walk allocates nothing.
    walk: Vec<SpanId>,
    /// Undecided calls per process, by start, while a candidate is in flight ([`settle`]).
    open_calls: HashMap<u32, BTreeMap<u64, SpanId>>,
    /// Per connection, the request of each end waiting for the other end's.
    waiting_clients: HashMap<settle::ConnectionPair, settle::Waiting>,
    waiting_servers: HashMap<settle::ConnectionPair, settle::Waiting>,
    /// Finished requests nothing needs, oldest first ([`settle::RETIRED_KEEP`]).
    retired: VecDeque<SpanId>,
    /// Held spans by handle, the handles in the order held, and per unsettled request the
    /// handles of the spans waiting for it; `woken`: requests settled since the last release.
    held: HashMap<u64, Held>,
    held_order: VecDeque<u64>,
    next_held: u64,
    blocked: HashMap<SpanId, Vec<u64>>,
    woken: Vec<SpanId>,
    /// Orders starts and finishes (see [`Node::started`]).
    seq: u64,
    tails: LoopTails,
    /// Calls per (process, handler task context or request root); see [`calls`].
    groups: HashMap<(u32, GroupKey), calls::Group>,
    /// In-graph inbound requests by where they arrived (`--task-lineage` names them so).
    inbound_sockets: HashMap<(u32, InboundSocket), SpanId>,
    /// In-flight inbound requests per (process, session token they carried).
    session_holders: HashMap<(u32, Token), Vec<SpanId>>,
    /// Calls per (process, id their response started with), while they are in the graph.
    echoed: HashMap<(u32, Token), SpanId>,
    /// Per (process, session token its responses opened): the rollout of the request it was
    /// opened for. A session outlives requests, so entries live [`SESSION_LINGER`].
    sessions: HashMap<(u32, Token), Session>,
    session_expiry: VecDeque<(Instant, (u32, Token))>,
    /// Handler groups whose trace the kernel was given, and the request each serves.
    published: HashMap<(u32, GroupKey), SpanId>,
    /// The same, by request: what its end withdraws, without a scan of them all.
    published_by_owner: HashMap<SpanId, Vec<(u32, GroupKey)>>,
    /// With injection, the groups bound to each in-flight request: what its trace settling
    /// publishes, without a scan of every group (keys whose group was bound anew since are
    /// skipped there).
    groups_by_owner: HashMap<SpanId, Vec<(u32, GroupKey)>>,
    /// Changes to the published traces not yet taken by the driver.
    injections: Vec<injection::TraceInjection>,
    /// The shared call ids given out lately ([`call_ids`]).
    shared_ids: SharedIds,
    /// Processes traced servers spawned, and the requests they work for ([`spawns`]).
    spawns: spawns::Spawns,
    pub counters: StitchCounters,
}

/// What the caller knows about a starting request besides the table's [`RequestStart`].
pub struct StartFacts {
    /// From the path prefix.
    pub rollout_id: Option<RolloutId>,
    /// Whether the request's own span will be emitted.
    pub emits_own: bool,
    /// Whether a `gym.*` span will be emitted for it (inbound only).
    pub emits_semantic: bool,
    /// A call started while its process may have an inbound request the tracer cannot see
    /// yet (an HTTPS request whose TLS session is not tied to its connection): the only
    /// request in flight that the tracer sees is then no evidence.
    pub inbound_hidden: bool,
    /// Inbound: the caller is a Gym server (any request to a Gym server but an agent's
    /// `/run`, which rollout collection sends), so an agent on the caller's host exports its
    /// CLIENT span. Only then may a SERVER span name a parent that is not on this host.
    pub caller_traced: bool,
    /// Inbound: the connection is a traced process's client connection on this host (its
    /// connect was reported before it could write), so its start will be seen: the request
    /// waits for it ([`settle`]).
    pub caller_seen_here: bool,
}

/// What a span's parent is, as [`Stitcher::parent_span_of`] finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ParentSpan {
    /// A span by its exported id: on this host (a SERVER or `gym.*` span), or named by a
    /// header or by the caller's host (`remote`).
    Span { id: SpanId, remote: bool },
    /// The CLIENT span of this call, whose exported id [`Stitcher::exported_call_id`] decides.
    Call(SpanId),
}

/// Where a request whose caller is on another host hangs (see [`Stitcher::cross_host_parent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CrossHost {
    /// Under its caller's CLIENT span, whose id both hosts derive from the trace and the
    /// sequence number.
    Joined(SpanId),
    /// A root: its trace is not known here (or the kernel read no sequence number).
    Unjoined,
}

/// The value of `gym_tracer.parent.unjoined` on a span left a root by [`CrossHost::Unjoined`].
pub const UNJOINED_REASON: &str = "caller_on_other_host";

/// What a session cookie says about the requests that carry it.
#[derive(Clone, Debug)]
enum Session {
    /// Opened for a request of this rollout; opened or carried last at the instant given.
    Rollout(RolloutId, Instant),
    /// Opened for requests of two rollouts: no evidence.
    Conflicting(Instant),
}

impl Stitcher {
    pub fn new(config: StitchConfig) -> Self {
        Self {
            config,
            nodes: HashMap::new(),
            rollout_tops: Default::default(),
            inbound: HashMap::new(),
            open_calls: HashMap::new(),
            rollout_inbound: HashMap::new(),
            walk: Vec::new(),
            waiting_clients: HashMap::new(),
            waiting_servers: HashMap::new(),
            retired: VecDeque::new(),
            held: HashMap::new(),
            held_order: VecDeque::new(),
            next_held: 0,
            blocked: HashMap::new(),
            woken: Vec::new(),
            seq: 0,
            tails: LoopTails::default(),
            groups: HashMap::new(),
            inbound_sockets: HashMap::new(),
            session_holders: HashMap::new(),
            echoed: HashMap::new(),
            sessions: HashMap::new(),
            session_expiry: VecDeque::new(),
            published: HashMap::new(),
            published_by_owner: HashMap::new(),
            groups_by_owner: HashMap::new(),
            injections: Vec::new(),
            shared_ids: SharedIds::new(config.max_nodes),
            spawns: spawns::Spawns::default(),
            counters: StitchCounters::default(),
        }
    }

    /// Finished spans waiting for their delay.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The span id a request's `gym.*` span must use (pre-allocated at start).
    pub fn semantic_span_id(&self, request: SpanId) -> Option<SpanId> {
        self.nodes.get(&request).and_then(|n| n.semantic_span_id)
    }

    /// Registers a request whose head was just seen, and draws the edges that are known now.
    pub fn start(&mut self, start: &RequestStart, facts: StartFacts, now: Instant) {
        if self.nodes.len() >= self.config.max_nodes && !self.evict_one() {
            self.counters.stitch_nodes_refused += 1;
            return;
        }
        let id = start.span_id;
        // The connection, as both ends name it, when its other end may be on this host.
        let pair = match (start.role, start.local, start.peer) {
            (Role::Server, Some(local), Some(peer)) => Some((peer, local)),
            (Role::Client, Some(local), Some(peer)) => Some((local, peer)),
            _ => None,
        }
        .filter(|_| start.local.zip(start.peer).is_some_and(on_one_host));
        let position = RequestPosition::of(start);
        let caller_on_other_host = start.role == Role::Server
            && facts.caller_traced
            && start
                .local
                .zip(start.peer)
                .is_some_and(|ends| !on_one_host(ends));
        self.seq += 1;
        let mut node = Node {
            pid: start.pid,
            role: start.role,
            started: self.seq,
            ended: None,
            session_tokens: start.session_tokens.clone(),
            context: start.context.map(Box::new),
            origin: None,
            undecided: None,
            parent: Parent::None,
            rollout: facts.rollout_id.clone(),
            emits_own: facts.emits_own,
            semantic_span_id: (start.role == Role::Server && facts.emits_semantic)
                .then(SpanId::random),
            inbound_hidden: facts.inbound_hidden,
            tcp_seq: start.tcp_seq,
            // Named elsewhere: by the callee's agent on another host (or a host unknown), or
            // by the header the kernel may write.
            call_id: match start.role {
                Role::Client => CallId::of_call(
                    start.tcp_seq,
                    self.config
                        .injection
                        .is_some_and(|inject| inject.every_call)
                        || !start.local.zip(start.peer).is_some_and(on_one_host),
                ),
                Role::Server => CallId::Own,
            },
            caller_on_other_host,
            inbound_socket: start.inbound_socket,
            // Not for a call from another host's Gym server: its trace is its rollout's, which
            // names its caller's CLIENT span (see `cross_host_parent`).
            minted_trace: match (self.config.injection, start.inbound_socket) {
                (Some(injection), Some(socket)) if !caller_on_other_host => Some(TraceId::minted(
                    injection.mint_key,
                    start.pid,
                    socket.conn_id,
                    socket.requests_before,
                )),
                _ => None,
            },
            trace: None,
            random_trace: TraceId::random(),
            finished: false,
            awaiting: None,
            children: Vec::new(),
            held_spans: 0,
            keyed: false,
        };
        let born_of = match start.role {
            Role::Client => self.lineage_at_start(&mut node, start.lineage),
            Role::Server => None,
        };
        self.nodes.insert(id, node);
        match start.role {
            Role::Server => self.start_inbound(start, &facts, pair, position, now),
            Role::Client => {
                if let Some(pair) = pair {
                    self.counters.local_calls += 1;
                    match self.take_other_end(Role::Server, pair, position) {
                        Some(server) => self.link_server(server, id),
                        None => {
                            let waiting = settle::Waiting {
                                position,
                                request: id,
                            };
                            self.wait_for_other_end(Role::Client, pair, waiting);
                        }
                    }
                }
                self.join_group(id);
                if let Some(owner) = born_of {
                    let key = self.nodes.get(&id).and_then(|n| self.group_key(n));
                    self.bind_group(key, owner, Evidence::Lineage);
                }
                self.place_call(id);
                self.await_evidence(id);
            }
        }
    }

    /// The server side of [`Stitcher::start`]: its caller (the client end, if seen; an
    /// inbound `traceparent`), its rollout, and its place among the process's candidates.
    fn start_inbound(
        &mut self,
        start: &RequestStart,
        facts: &StartFacts,
        pair: Option<settle::ConnectionPair>,
        position: RequestPosition,
        now: Instant,
    ) {
        let id = start.span_id;
        let remote = start.traceparent.as_deref().and_then(parse_traceparent);
        let client = pair.and_then(|pair| self.take_other_end(Role::Client, pair, position));
        let waiting = settle::Waiting {
            position,
            request: id,
        };
        match (remote, client) {
            // The header this host's kernel inserted (`--inject-traceparent`) names the
            // caller seen here: the local edge says the same and more.
            (Some((trace, span)), Some(client)) if self.is_injected_id(client, trace, span) => {
                self.counters.cross_process_links += 1;
                self.draw_edge(id, Parent::Local(client));
            }
            (Some((trace, span)), client) => {
                self.counters.parents_from_traceparent += 1;
                match (client, pair) {
                    (Some(_), _) => self.counters.local_calls_parented_by_header += 1,
                    // The caller, if seen later, may turn out to be who inserted it.
                    (None, Some(pair)) => self.wait_for_other_end(Role::Server, pair, waiting),
                    (None, None) => {}
                }
                self.draw_edge(id, Parent::Remote(trace, span));
            }
            (None, Some(client)) => {
                self.counters.cross_process_links += 1;
                self.draw_edge(id, Parent::Local(client));
            }
            (None, None) => {
                if let Some(pair) = pair {
                    if facts.caller_seen_here
                        && let Some(node) = self.nodes.get_mut(&id)
                    {
                        node.awaiting = Some(settle::Awaiting::Caller);
                    }
                    self.wait_for_other_end(Role::Server, pair, waiting);
                }
            }
        }
        let Some(node) = self.nodes.get_mut(&id) else {
            return;
        };
        let (pid, started) = (node.pid, node.started);
        if node.rollout.is_none() {
            let rollout = self.session_rollout(pid, &start.session_tokens, now);
            if let Some(node) = self.nodes.get_mut(&id) {
                node.rollout = rollout;
            }
        }
        self.inbound.entry(pid).or_default().insert(started, id);
        self.index_rollouts_below(id);
        if let Some(socket) = start.inbound_socket {
            self.inbound_sockets.insert((pid, socket), id);
        }
        for token in &start.session_tokens {
            self.session_holders
                .entry((pid, *token))
                .or_default()
                .push(id);
        }
    }

    /// Sets a request's parent, keeping the parent's count of requests under it.
    fn draw_edge(&mut self, child: SpanId, parent: Parent) {
        let Some(node) = self.nodes.get_mut(&child) else {
            return;
        };
        let before = std::mem::replace(&mut node.parent, parent);
        if let Parent::Local(new) = parent
            && let Some(parent_node) = self.nodes.get_mut(&new)
        {
            parent_node.children.push(child);
        }
        if let Parent::Local(old) = before {
            self.release_child(old, child);
        }
        if matches!(parent, Parent::Local(_)) {
            // Its rollout, and its subtree's, may be known now.
            self.index_rollouts_below(child);
        }
        if parent != Parent::None {
            self.settle(child);
        }
    }

    /// A request's body named its rollout (an agent's `/run`; any call whose body ends with
    /// Gym's `_ng_*` fields).
    pub fn set_rollout(&mut self, request: SpanId, rollout_id: RolloutId) {
        if let Some(node) = self.nodes.get_mut(&request) {
            node.rollout = Some(rollout_id);
            let role = node.role;
            self.index_rollouts_below(request);
            match role {
                Role::Client => {
                    self.recheck_rollout(request);
                    self.place_call(request);
                }
                // Its handlers' trace may have settled just now.
                Role::Server => self.publish_traces_of(request),
            }
        }
    }

    /// The rollout the request's sessions were opened for, when they name exactly one (each
    /// session it names stays another [`SESSION_LINGER`]).
    fn session_rollout(
        &mut self,
        pid: u32,
        session_tokens: &[Token],
        now: Instant,
    ) -> Option<RolloutId> {
        let mut named: Option<RolloutId> = None;
        for token in session_tokens {
            let Some(Session::Rollout(rollout, last)) = self.sessions.get_mut(&(pid, *token))
            else {
                continue;
            };
            *last = now;
            match &named {
                Some(first) if first != rollout => return None,
                Some(_) => {}
                None => named = Some(rollout.clone()),
            }
        }
        self.counters.rollouts_by_session += u64::from(named.is_some());
        named
    }

    /// The response to inbound `request` opened these sessions (see
    /// `pipeline::sessions_opened`): later requests that carry one belong to the request's
    /// rollout, if it has one.
    pub fn sessions_set(&mut self, request: SpanId, tokens: &[Token], now: Instant) {
        let Some(node) = self.nodes.get(&request) else {
            return;
        };
        let pid = node.pid;
        let Some(rollout) = self.effective_rollout(request).cloned() else {
            return;
        };
        for token in tokens {
            let key = (pid, *token);
            let entry = match self.sessions.get(&key) {
                Some(Session::Rollout(theirs, _)) if *theirs != rollout => {
                    self.counters.sessions_conflicting += 1;
                    Session::Conflicting(now)
                }
                Some(Session::Conflicting(_)) => Session::Conflicting(now),
                _ => Session::Rollout(rollout.clone(), now),
            };
            if !self.sessions.contains_key(&key) {
                // One queue entry per session: full, the one set longest ago goes.
                while self.sessions.len() >= self.config.max_nodes {
                    let Some((_, old)) = self.session_expiry.pop_front() else {
                        break;
                    };
                    self.sessions.remove(&old);
                }
                self.session_expiry.push_back((now + SESSION_LINGER, key));
            }
            self.sessions.insert(key, entry);
        }
    }

    /// Forgets sessions neither opened nor carried for [`SESSION_LINGER`].
    fn expire_sessions(&mut self, now: Instant) {
        while let Some((expiry, key)) = self.session_expiry.front().copied() {
            if expiry > now {
                break;
            }
            self.session_expiry.pop_front();
            let last = match self.sessions.get(&key) {
                Some(Session::Rollout(_, at) | Session::Conflicting(at)) => *at,
                None => continue,
            };
            if last + SESSION_LINGER <= now {
                self.sessions.remove(&key);
            } else {
                self.session_expiry.push_back((last + SESSION_LINGER, key));
            }
        }
    }

    /// For a call whose process gives no task contexts (not CPython, or an interpreter the
    /// tracer does not know): the in-flight inbound request of `pid` that made it, by its
    /// rollout id, else the only one in flight, else the innermost of nested ones. A call that
    /// names a rollout lends it to a parent that has none.
    fn choose_caller_without_context(
        &mut self,
        pid: u32,
        rollout: Option<&RolloutId>,
        inbound_hidden: bool,
    ) -> Result<(SpanId, Evidence), Undecided> {
        if let Some(rollout) = rollout {
            let same: Vec<SpanId> = self.in_flight_of_rollout(pid, rollout).collect();
            match same.as_slice() {
                [one] => return Ok((*one, Evidence::RolloutId)),
                [] => {}
                many => {
                    return self
                        .innermost_of_chain(many)
                        .map(|id| (id, Evidence::Nesting))
                        .ok_or(Undecided::Ambiguous);
                }
            }
        }
        // Without a rollout to look up, every request in flight is a candidate: nesting
        // looks at each (a process without task contexts has no better evidence).
        let candidates: Vec<SpanId> = self
            .inbound
            .get(&pid)
            .map(|list| list.values().copied().collect())
            .unwrap_or_default();
        match candidates.as_slice() {
            [] => Err(Undecided::NoInbound),
            [_] if inbound_hidden => Err(Undecided::NoEvidence),
            [only] => {
                let only = *only;
                match (rollout, self.effective_rollout(only)) {
                    // The only candidate belongs to another rollout.
                    (Some(_), Some(_)) => Err(Undecided::Contradicted),
                    (Some(rollout), None) => {
                        if let Some(node) = self.nodes.get_mut(&only) {
                            node.rollout = Some(rollout.clone());
                        }
                        self.index_rollouts_below(only);
                        Ok((only, Evidence::OnlyInbound))
                    }
                    (None, _) => Ok((only, Evidence::OnlyInbound)),
                }
            }
            many => {
                let many = many.to_vec();
                self.innermost_of_chain(&many)
                    .map(|id| (id, Evidence::Nesting))
                    .ok_or(Undecided::Ambiguous)
            }
        }
    }

    /// When the in-flight candidates are nested — each one called, directly or not, by the
    /// one before (an agent's `/run` awaiting its own `/v1/responses`) — the innermost is
    /// the one making calls: a handler that awaits a nested call makes none meanwhile. That
    /// is the documented best guess; candidates that are not one chain give `None`.
    fn innermost_of_chain(&self, candidates: &[SpanId]) -> Option<SpanId> {
        let mut by_depth: Vec<(usize, SpanId)> =
            candidates.iter().map(|id| (self.depth(*id), *id)).collect();
        by_depth.sort_by_key(|(depth, _)| *depth);
        let chained = by_depth
            .windows(2)
            .all(|pair| self.is_ancestor(pair[0].1, pair[1].1));
        chained
            .then(|| by_depth.last().map(|(_, id)| *id))
            .flatten()
    }

    fn depth(&self, mut id: SpanId) -> usize {
        for depth in 0..MAX_DEPTH {
            match self.nodes.get(&id).map(|n| n.parent) {
                Some(Parent::Local(parent)) => id = parent,
                _ => return depth,
            }
        }
        MAX_DEPTH
    }

    fn is_ancestor(&self, ancestor: SpanId, mut id: SpanId) -> bool {
        for _ in 0..MAX_DEPTH {
            match self.nodes.get(&id).map(|n| n.parent) {
                Some(Parent::Local(parent)) if parent == ancestor => return true,
                Some(Parent::Local(parent)) => id = parent,
                _ => return false,
            }
        }
        false
    }

    /// The client end of a server request that was waiting for it was seen: the request
    /// hangs under it, unless a span of the request is out already or another caller's
    /// `traceparent` named its parent (each counted: the local call is not linked).
    fn link_server(&mut self, server: SpanId, client: SpanId) {
        let Some(node) = self.nodes.get(&server) else {
            return;
        };
        let injected = matches!(node.parent,
            Parent::Remote(trace, span) if self.is_injected_id(client, trace, span));
        if node.trace.is_some() {
            // Its spans are out already, under a trace of their own.
            self.counters.spans_flushed_unmatched += 1;
            self.settle(server);
        } else if node.parent == Parent::None || injected {
            self.counters.cross_process_links += 1;
            self.draw_edge(server, Parent::Local(client));
        } else {
            self.counters.local_calls_parented_by_header += 1;
        }
    }

    /// A request ended (its spans, if any, are [`hold`](Self::hold)-ed by the caller).
    pub fn finish(&mut self, request: SpanId) {
        let Some(node) = self.nodes.get_mut(&request) else {
            return;
        };
        node.finished = true;
        self.seq += 1;
        node.ended = Some(self.seq);
        let (pid, role, started) = (node.pid, node.role, node.started);
        let sessions = std::mem::take(&mut node.session_tokens);
        self.withdraw_traces(request);
        self.groups_by_owner.remove(&request);
        if role == Role::Server {
            self.unindex_rollout(request);
        }
        if role == Role::Server
            && let Some(list) = self.inbound.get_mut(&pid)
        {
            list.remove(&started);
            if list.is_empty() {
                self.inbound.remove(&pid);
            }
            self.close_evidence(pid);
        }
        for token in sessions {
            if let Some(list) = self.session_holders.get_mut(&(pid, token)) {
                list.retain(|id| *id != request);
                if list.is_empty() {
                    self.session_holders.remove(&(pid, token));
                }
            }
        }
        self.maybe_retire(request);
    }

    /// Holds the spans one finished request produced (draining `spans`), each in the role
    /// its kind says: INTERNAL is the `gym.*` span, anything else the request's own.
    pub fn hold_all(
        &mut self,
        request: SpanId,
        spans: &mut Vec<SpanRecord>,
        out: &mut Vec<SpanRecord>,
    ) {
        for span in spans.drain(..) {
            let role = if span.kind == SpanKind::Internal {
                SpanRole::Semantic
            } else {
                SpanRole::Own
            };
            self.hold(request, role, span, out);
        }
    }

    /// Releases the spans whose chains settled, and forgets what nothing needs any more.
    pub fn release(&mut self, now: Instant, out: &mut Vec<SpanRecord>) {
        self.release_settled(out);
        if self.trim_retired(settle::RETIRED_KEEP) {
            self.forget_gone_calls();
        }
        self.expire_sessions(now);
        shrink_if_sparse(&mut self.nodes);
        shrink_if_sparse(&mut self.waiting_clients);
        shrink_if_sparse(&mut self.waiting_servers);
        shrink_if_sparse(&mut self.held);
        shrink_if_sparse(&mut self.blocked);
        if self.retired.capacity() > SHRINK_FACTOR * self.retired.len() + 1024 {
            self.retired.shrink_to(2 * self.retired.len());
        }
    }

    /// Sets a held span's trace and parent from the graph as it is now, and fixes its trace
    /// (and its ancestors') so that what is released later agrees.
    fn resolve(&mut self, held: Held) -> SpanRecord {
        let Held {
            node: id,
            role,
            mut span,
            ..
        } = held;
        let Some(node) = self.nodes.get(&id) else {
            // Evicted from the graph: the span stands alone.
            span.trace_id = TraceId::random();
            return span;
        };
        let emits_own = node.emits_own;
        // The request's outermost span: the one that hangs under its parent.
        let outermost = role == SpanRole::Own || !emits_own;
        let trace = self.trace_of(id);
        if role == SpanRole::Own && node.role == Role::Client {
            if node.parent == Parent::None {
                self.count_undecided(node.undecided);
            }
            span.span_id = self.exported_call_id(id, trace);
        }
        if outermost {
            match self.cross_host_parent(id) {
                Some(CrossHost::Joined(_)) => self.counters.cross_host_parents += 1,
                Some(CrossHost::Unjoined) => {
                    self.counters.cross_host_unjoined += 1;
                    span.attributes.push((
                        attr::GYM_TRACER_PARENT_UNJOINED,
                        AttributeValue::Str(UNJOINED_REASON.into()),
                    ));
                }
                None => {}
            }
        }
        let (parent, remote) = match role {
            SpanRole::Semantic if emits_own => (Some(id), false),
            _ => match self.parent_span_of(id) {
                None => (None, false),
                Some(ParentSpan::Span { id, remote }) => (Some(id), remote),
                Some(ParentSpan::Call(call)) => (Some(self.exported_call_id(call, trace)), false),
            },
        };
        span.parent_span_id = parent;
        span.parent_is_remote = remote;
        span.trace_id = trace;
        if span.facts.rollout_id.is_none()
            && let Some(rollout) = self.effective_rollout(id).cloned()
        {
            span.attributes.push((
                attr::GYM_ROLLOUT_ID,
                AttributeValue::Str(rollout.shared().into()),
            ));
            span.facts.rollout_id = Some(rollout);
        }
        self.fix_trace(id, trace);
        span
    }

    fn fix_trace(&mut self, mut id: SpanId, trace: TraceId) {
        for _ in 0..MAX_DEPTH {
            let Some(node) = self.nodes.get_mut(&id) else {
                return;
            };
            if node.trace.is_some() {
                return;
            }
            node.trace = Some(trace);
            match node.parent {
                Parent::Local(parent) => id = parent,
                _ => return,
            }
        }
    }

    /// The earliest start of a span the stitcher still holds: a span that started later
    /// cannot be below a request that ended before this (what a rollout's top waits for:
    /// [`rollout_tops`]).
    fn earliest_held_start(&self) -> Option<u64> {
        self.held.values().map(|held| held.span.start_unix_ns).min()
    }

    /// The rollout `request` belongs to, when known.
    pub fn rollout_of(&self, request: SpanId) -> Option<RolloutId> {
        self.effective_rollout(request).cloned()
    }

    /// The requests in flight under `root`, from it down to the deepest: at each level the
    /// one that started last (what the live view says a rollout is doing now).
    pub fn in_flight_chain(&self, root: SpanId) -> Vec<SpanId> {
        let mut chain = vec![root];
        let mut id = root;
        for _ in 0..MAX_DEPTH {
            let Some(node) = self.nodes.get(&id) else {
                break;
            };
            let next = node
                .children
                .iter()
                .filter_map(|child| Some((*child, self.nodes.get(child)?)))
                .filter(|(_, child)| child.ended.is_none())
                .max_by_key(|(_, child)| child.started);
            match next {
                Some((child, _)) => {
                    chain.push(child);
                    id = child;
                }
                None => break,
            }
        }
        chain
    }

    /// The rollout id a request belongs to: its own, else its caller's (carried down).
    fn effective_rollout(&self, mut id: SpanId) -> Option<&RolloutId> {
        for _ in 0..MAX_DEPTH {
            let node = self.nodes.get(&id)?;
            if let Some(rollout) = &node.rollout {
                return Some(rollout);
            }
            match node.parent {
                Parent::Local(parent) => id = parent,
                _ => return None,
            }
        }
        None
    }

    /// The trace `id`'s spans have (or will have, as the graph stands now).
    pub fn trace_of(&self, mut id: SpanId) -> TraceId {
        let start = id;
        for _ in 0..MAX_DEPTH {
            let Some(node) = self.nodes.get(&id) else {
                break;
            };
            if let Some(trace) = node.trace {
                return trace;
            }
            match node.parent {
                Parent::Remote(trace, _) => return trace,
                Parent::Local(parent) if self.nodes.contains_key(&parent) => id = parent,
                _ => {
                    // A root of this host: the trace its kernel gave it, else its rollout's,
                    // else its own random id.
                    return match (node.minted_trace, self.effective_rollout(start)) {
                        (Some(minted), _) => minted,
                        (None, Some(rollout)) => rollout_trace_id(rollout),
                        (None, None) => node.random_trace,
                    };
                }
            }
        }
        self.nodes
            .get(&start)
            .map_or_else(TraceId::random, |n| n.random_trace)
    }

    /// The span a request's own span hangs under: for a server, the caller's client span (on
    /// this host, on another host, or from `traceparent`); for a client, the gym.* span (or
    /// SERVER span) of the inbound request that made the call. Requests whose spans are not
    /// emitted are passed through.
    fn parent_span_of(&self, mut id: SpanId) -> Option<ParentSpan> {
        for _ in 0..MAX_DEPTH {
            let node = self.nodes.get(&id)?;
            match node.parent {
                Parent::None => {
                    return match self.cross_host_parent(id)? {
                        CrossHost::Joined(span) => Some(ParentSpan::Span {
                            id: span,
                            remote: true,
                        }),
                        CrossHost::Unjoined => None,
                    };
                }
                Parent::Remote(_, span) => {
                    return Some(ParentSpan::Span {
                        id: span,
                        remote: true,
                    });
                }
                Parent::Local(parent) => {
                    let local = |id| ParentSpan::Span { id, remote: false };
                    let Some(parent_node) = self.nodes.get(&parent) else {
                        return Some(local(parent));
                    };
                    if let Some(semantic) = parent_node.semantic_span_id {
                        return Some(local(semantic));
                    }
                    if parent_node.emits_own {
                        return Some(match parent_node.role {
                            Role::Client => ParentSpan::Call(parent),
                            Role::Server => local(parent),
                        });
                    }
                    id = parent;
                }
            }
        }
        None
    }

    /// For a request without a parent on this host whose caller is a Gym server on another
    /// host: its caller's CLIENT span, named by the trace and the request's TCP sequence
    /// number, when its trace is known here (a rollout id); otherwise it stays a root,
    /// unjoined.
    fn cross_host_parent(&self, id: SpanId) -> Option<CrossHost> {
        let node = self.nodes.get(&id)?;
        if node.parent != Parent::None || !node.caller_on_other_host {
            return None;
        }
        match (node.tcp_seq, self.effective_rollout(id)) {
            (Some(seq), Some(rollout)) => Some(CrossHost::Joined(SpanId::of_call(
                rollout_trace_id(rollout),
                seq,
            ))),
            _ => Some(CrossHost::Unjoined),
        }
    }
}

/// The server end, on another traced process, of the call `client` (same connection, same
/// request): what the callee's agent-side start looks like.
#[cfg(test)]
pub(crate) fn testing_server_of(client: &RequestStart) -> RequestStart {
    RequestStart {
        pid: client.pid + 1000,
        role: Role::Server,
        local: client.peer,
        peer: client.local,
        span_id: SpanId::random(),
        ..client.clone()
    }
}

#[cfg(test)]
pub(crate) fn testing_facts() -> StartFacts {
    StartFacts {
        rollout_id: None,
        emits_own: true,
        emits_semantic: false,
        inbound_hidden: false,
        caller_traced: false,
        caller_seen_here: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gym::ServerType;
    use crate::model::span::SpanKind;
    use crate::pipeline::testing;

    const AGENT: u32 = 1;
    const MODEL: u32 = 2;

    fn start(
        pid: u32,
        role: Role,
        local: u16,
        peer: u16,
        sequence: u64,
        path: &str,
    ) -> RequestStart {
        testing::start(pid, role, (local, peer), sequence, "POST", path)
    }

    fn facts(rollout: Option<&str>, semantic: bool) -> StartFacts {
        StartFacts {
            rollout_id: rollout.and_then(RolloutId::parse),
            emits_own: true,
            emits_semantic: semantic,
            inbound_hidden: false,
            caller_traced: false,
            caller_seen_here: false,
        }
    }

    /// The kernel's rule for which calls `--inject-traceparent remote` leaves alone and user
    /// space's for which calls get ids the header carries must agree: else a header names a
    /// span no agent exports.
    #[test]
    fn the_kernel_and_user_space_agree_on_which_peers_are_on_this_host() {
        use std::net::IpAddr;
        let addresses: Vec<IpAddr> = [
            "127.0.0.1",
            "127.3.2.1",
            "10.0.0.5",
            "10.0.0.9",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.5",
            "fd00::5",
            "fd00::9",
        ]
        .iter()
        .map(|text| text.parse().expect("an address"))
        .collect();
        let kernel = |local: IpAddr, peer: IpAddr| {
            let (family, local, peer) = match (local, peer) {
                (IpAddr::V4(local), IpAddr::V4(peer)) => {
                    let widen = |octets: [u8; 4]| {
                        let mut bytes = [0u8; 16];
                        bytes[..4].copy_from_slice(&octets);
                        bytes
                    };
                    (
                        tracer_abi::AF_INET,
                        widen(local.octets()),
                        widen(peer.octets()),
                    )
                }
                (local, peer) => {
                    let six = |ip: IpAddr| match ip {
                        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
                        IpAddr::V6(v6) => v6.octets(),
                    };
                    (tracer_abi::AF_INET6, six(local), six(peer))
                }
            };
            tracer_abi::peer_on_host(family, &local, &peer)
        };
        for &local in &addresses {
            for &peer in &addresses {
                let ends = (SocketAddr::new(local, 40000), SocketAddr::new(peer, 8000));
                assert_eq!(kernel(local, peer), on_one_host(ends), "{local} -> {peer}");
            }
        }
    }

    impl Stitcher {
        fn undecided(&self, call: SpanId) -> Option<Undecided> {
            self.nodes[&call].undecided
        }

        /// The request (or `gym.*` span) a request's span hangs under, as the graph stands.
        fn parent_request(&self, id: SpanId) -> Option<SpanId> {
            self.parent_span_of(id).map(|parent| match parent {
                ParentSpan::Span { id, .. } | ParentSpan::Call(id) => id,
            })
        }
    }

    fn span(name: &str, span_id: SpanId) -> SpanRecord {
        testing::span(name, SpanKind::Server, span_id)
    }

    fn config() -> StitchConfig {
        StitchConfig {
            max_pending: 100,
            max_nodes: 1000,
            injection: None,
        }
    }

    /// The rollout's `/run` and `gym.rollout` go out before its model call's spans (their
    /// parent was decided by the call's answer): they are kept back while the stitcher holds
    /// a span that started before the rollout ended, and follow the spans below them once it
    /// holds none. A rollout that ended before anything held started goes at once.
    #[test]
    fn a_rollout_top_waits_for_the_spans_still_held_that_could_be_below_it() {
        const MS: u64 = 1_000_000;
        let mut stitcher = Stitcher::new(config());
        let now = Instant::now();
        // A model server's request whose traced caller is not seen yet: held.
        let served = start(MODEL, Role::Server, 9000, 40000, 0, "/v1/responses");
        let waits_for_caller = StartFacts {
            caller_seen_here: true,
            ..facts(None, false)
        };
        stitcher.start(&served, waits_for_caller, now);
        let mut model = span("POST /v1/responses", served.span_id);
        (model.start_unix_ns, model.end_unix_ns) = (150 * MS, 850 * MS);
        let mut out = Vec::new();
        stitcher.hold(served.span_id, SpanRole::Own, model, &mut out);
        stitcher.finish(served.span_id);
        assert!(out.is_empty() && stitcher.held() == 1, "{out:?}");

        let agent_span = |name: &str, kind, id: u8, parent: Option<u8>, end_ms: u64| {
            let mut span = testing::span(name, kind, SpanId([id; 8]));
            span.parent_span_id = parent.map(|p| SpanId([p; 8]));
            (span.start_unix_ns, span.end_unix_ns) = (0, end_ms * MS);
            span.facts.server_type = Some(ServerType::Agent);
            span
        };
        let mut released = vec![
            agent_span("POST /run", SpanKind::Server, 1, None, 1000),
            agent_span("gym.rollout", SpanKind::Internal, 2, Some(1), 1000),
            agent_span("POST /seed_session", SpanKind::Client, 3, Some(2), 10),
            // Ended before the held span started: nothing held can be below it.
            agent_span("POST /run", SpanKind::Server, 11, None, 100),
            agent_span("gym.rollout", SpanKind::Internal, 12, Some(11), 100),
        ];
        stitcher.hold_rollout_tops(&mut released);
        let names = |spans: &[SpanRecord]| -> Vec<(String, u8)> {
            spans
                .iter()
                .map(|s| (s.name.as_str().to_owned(), s.span_id.0[0]))
                .collect()
        };
        assert_eq!(
            names(&released),
            [
                ("POST /seed_session".into(), 3),
                ("gym.rollout".into(), 12),
                ("POST /run".into(), 11)
            ]
        );
        assert!(stitcher.rollout_tops_waiting());

        let mut released = Vec::new();
        stitcher.release_all(&mut released);
        stitcher.hold_rollout_tops(&mut released);
        assert_eq!(
            names(&released)
                .iter()
                .map(|(name, _)| name.as_str())
                .collect::<Vec<_>>(),
            ["POST /v1/responses", "gym.rollout", "POST /run"]
        );
        assert!(!stitcher.rollout_tops_waiting());
        assert_eq!(stitcher.counters.rollouts_completed_early, 0);
    }

    /// One rollout: agent /run (8000) → model (9000) over one connection (client port 40000).
    /// `server_first`: the model's read is seen before the agent's write.
    fn rollout(server_first: bool) -> (Vec<SpanRecord>, StitchCounters) {
        let mut stitcher = Stitcher::new(config());
        let now = Instant::now();
        let run = start(AGENT, Role::Server, 8000, 50000, 0, "/run");
        stitcher.start(&run, facts(None, true), now);
        stitcher.set_rollout(run.span_id, RolloutId::parse("7-1").unwrap());
        let call = start(
            AGENT,
            Role::Client,
            40000,
            9000,
            0,
            "/ng-rollout/7-1/v1/responses",
        );
        let served = start(
            MODEL,
            Role::Server,
            9000,
            40000,
            0,
            "/ng-rollout/7-1/v1/responses",
        );
        if server_first {
            stitcher.start(&served, facts(Some("7-1"), true), now);
            stitcher.start(&call, facts(Some("7-1"), false), now);
        } else {
            stitcher.start(&call, facts(Some("7-1"), false), now);
            stitcher.start(&served, facts(Some("7-1"), true), now);
        }
        let mut out = Vec::new();
        let semantic = |s: &Stitcher, id| s.semantic_span_id(id).unwrap();
        let served_semantic = semantic(&stitcher, served.span_id);
        stitcher.hold(
            served.span_id,
            SpanRole::Own,
            span("POST /v1/responses", served.span_id),
            &mut out,
        );
        stitcher.hold(
            served.span_id,
            SpanRole::Semantic,
            span("gym.model.responses", served_semantic),
            &mut out,
        );
        stitcher.finish(served.span_id);
        stitcher.hold(
            call.span_id,
            SpanRole::Own,
            span("HTTP POST", call.span_id),
            &mut out,
        );
        stitcher.finish(call.span_id);
        let run_semantic = semantic(&stitcher, run.span_id);
        stitcher.hold(
            run.span_id,
            SpanRole::Own,
            span("POST /run", run.span_id),
            &mut out,
        );
        stitcher.hold(
            run.span_id,
            SpanRole::Semantic,
            span("gym.rollout", run_semantic),
            &mut out,
        );
        stitcher.finish(run.span_id);
        stitcher.release(now, &mut out);
        (out, stitcher.counters)
    }

    fn by_name<'a>(spans: &'a [SpanRecord], name: &str) -> &'a SpanRecord {
        spans.iter().find(|s| s.name == name).unwrap()
    }

    #[test]
    fn one_rollout_is_one_tree_whichever_end_is_seen_first() {
        for server_first in [false, true] {
            let (spans, stats) = rollout(server_first);
            assert_eq!(spans.len(), 5);
            let trace = rollout_trace_id(&RolloutId::parse("7-1").unwrap());
            assert!(spans.iter().all(|s| s.trace_id == trace), "{server_first}");
            let run = by_name(&spans, "POST /run");
            let rollout = by_name(&spans, "gym.rollout");
            let call = by_name(&spans, "HTTP POST");
            let served = by_name(&spans, "POST /v1/responses");
            let model = by_name(&spans, "gym.model.responses");
            assert_eq!(run.parent_span_id, None);
            assert_eq!(rollout.parent_span_id, Some(run.span_id));
            assert_eq!(call.parent_span_id, Some(rollout.span_id));
            assert_eq!(served.parent_span_id, Some(call.span_id));
            assert_eq!(model.parent_span_id, Some(served.span_id));
            assert_eq!(stats.cross_process_links, 1);
            assert_eq!(stats.spans_flushed_unmatched, 0);
        }
    }

    /// A request's server end, read while its traced caller's write was still unreported
    /// (`server_first`) or a minute after it (a saturated server's socket buffer).
    fn late_pair(server_first: bool) -> (Stitcher, RequestStart, RequestStart, Vec<SpanRecord>) {
        let mut stitcher = Stitcher::new(config());
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        let served = start(MODEL, Role::Server, 9000, 40000, 0, "/v1/responses");
        let call = start(AGENT, Role::Client, 40000, 9000, 0, "/v1/responses");
        let seen_here = StartFacts {
            caller_seen_here: true,
            ..facts(None, false)
        };
        let mut out = Vec::new();
        if server_first {
            stitcher.start(&served, seen_here, now);
        } else {
            stitcher.start(&call, facts(None, false), now);
            stitcher.release(later, &mut out);
            stitcher.start(&served, seen_here, later);
        }
        let own = span("POST /v1/responses", served.span_id);
        stitcher.hold(served.span_id, SpanRole::Own, own, &mut out);
        stitcher.finish(served.span_id);
        stitcher.release(later, &mut out);
        (stitcher, served, call, out)
    }

    #[test]
    fn a_server_end_waits_for_its_traced_callers_however_late() {
        // Read a minute after the write: the client's key waited.
        let (stitcher, served, call, out) = late_pair(false);
        assert_eq!(out[0].parent_span_id, Some(call.span_id));
        assert_eq!(
            stitcher.nodes[&served.span_id].parent,
            Parent::Local(call.span_id)
        );
        // Seen before its caller: its span waits for the caller's start, a minute later.
        let (mut stitcher, served, call, mut out) = late_pair(true);
        assert!(out.is_empty(), "waits for its caller");
        assert_eq!(stitcher.held(), 1);
        let later = Instant::now() + Duration::from_secs(60);
        stitcher.start(&call, facts(None, false), later);
        stitcher.release(later, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].span_id, served.span_id);
        assert_eq!(out[0].parent_span_id, Some(call.span_id));
        let counters = stitcher.counters;
        assert_eq!((counters.local_calls, counters.cross_process_links), (1, 1));
        assert_eq!(
            counters.spans_flushed_unmatched + counters.callers_unseen,
            0
        );
    }

    #[test]
    fn a_connection_that_ends_before_its_other_end_is_seen_gives_up_counted() {
        // The server end waited for a caller that never wrote (counted), then went out.
        let (mut stitcher, served, _, mut out) = late_pair(true);
        stitcher.connection_ended((
            SocketAddr::from(([127, 0, 0, 1], 40000)),
            SocketAddr::from(([127, 0, 0, 1], 9000)),
        ));
        stitcher.release(Instant::now(), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].span_id, served.span_id);
        assert_eq!(out[0].parent_span_id, None);
        assert_eq!(stitcher.counters.callers_unseen, 1);
        assert!(stitcher.waiting_servers.is_empty());
        // A call whose server end never came: its key goes with the connection.
        let mut stitcher = Stitcher::new(config());
        let call = start(AGENT, Role::Client, 40001, 9001, 0, "/v1/responses");
        stitcher.start(&call, facts(None, false), Instant::now());
        stitcher.connection_ended((
            SocketAddr::from(([127, 0, 0, 1], 40001)),
            SocketAddr::from(([127, 0, 0, 1], 9001)),
        ));
        assert!(stitcher.waiting_clients.is_empty());
        let counters = stitcher.counters;
        assert_eq!(
            (counters.local_calls, counters.local_calls_unlinked_closed),
            (1, 1)
        );
        // Its node is no longer pinned by the key: only its being in flight keeps it.
        assert!(stitcher.nodes[&call.span_id].pinned());
        stitcher.finish(call.span_id);
        assert!(!stitcher.nodes[&call.span_id].pinned());
    }

    #[test]
    fn a_server_end_of_an_untraced_caller_goes_at_once() {
        let mut stitcher = Stitcher::new(config());
        let served = start(MODEL, Role::Server, 9000, 40000, 0, "/v1/responses");
        stitcher.start(&served, facts(None, false), Instant::now());
        let mut out = Vec::new();
        let own = span("POST /v1/responses", served.span_id);
        stitcher.hold(served.span_id, SpanRole::Own, own, &mut out);
        assert_eq!(out.len(), 1, "nothing to wait for");
        // Its caller turned out to be traced after all (it attached late): counted.
        let call = start(AGENT, Role::Client, 40000, 9000, 0, "/v1/responses");
        stitcher.start(&call, facts(None, false), Instant::now());
        assert_eq!(stitcher.counters.spans_flushed_unmatched, 1);
        assert_eq!(stitcher.counters.cross_process_links, 0);
    }

    #[test]
    fn both_ends_meet_at_the_tcp_sequence_number_whatever_either_end_missed() {
        let mut stitcher = Stitcher::new(config());
        let now = Instant::now();
        // The server never saw the connection's first request (it attached late): by ordinal,
        // its first request would be the client's first, and pair wrongly.
        let first = RequestStart {
            tcp_seq: Some(1000),
            ..start(AGENT, Role::Client, 40000, 9000, 0, "/v1/responses")
        };
        let second = RequestStart {
            tcp_seq: Some(1300),
            ..start(AGENT, Role::Client, 40000, 9000, 1, "/v1/responses")
        };
        let served = RequestStart {
            tcp_seq: Some(1300),
            ..start(MODEL, Role::Server, 9000, 40000, 0, "/v1/responses")
        };
        for request in [&first, &second, &served] {
            stitcher.start(request, facts(None, false), now);
        }
        assert_eq!(
            stitcher.nodes[&served.span_id].parent,
            Parent::Local(second.span_id)
        );
        assert_eq!(stitcher.counters.cross_process_links, 1);
    }

    const HOST_A: [u8; 4] = [10, 0, 0, 1];
    const HOST_B: [u8; 4] = [10, 0, 0, 2];

    /// A request between two hosts: `from` (port 40000) calls `to` (port 9000), its first
    /// byte at TCP sequence number `seq`; `role` says which end this one is.
    fn between_hosts(pid: u32, role: Role, seq: u32, from: [u8; 4], to: [u8; 4]) -> RequestStart {
        let (client, server) = (
            SocketAddr::from((from, 40000)),
            SocketAddr::from((to, 9000)),
        );
        let (local, peer) = match role {
            Role::Client => (client, server),
            Role::Server => (server, client),
        };
        RequestStart {
            local: Some(local),
            peer: Some(peer),
            tcp_seq: Some(seq),
            ..start(pid, role, 0, 0, 0, "/seed_session")
        }
    }

    fn inbound_facts(rollout: Option<&str>, caller_traced: bool) -> StartFacts {
        StartFacts {
            caller_traced,
            ..facts(rollout, false)
        }
    }

    /// Holds, finishes and releases the request's own span: what its agent exports.
    fn export(stitcher: &mut Stitcher, request: &RequestStart, kind: SpanKind) -> SpanRecord {
        let now = Instant::now();
        let mut out = Vec::new();
        let own = testing::span("own", kind, request.span_id);
        stitcher.hold(request.span_id, SpanRole::Own, own, &mut out);
        stitcher.finish(request.span_id);
        stitcher.release(now, &mut out);
        out.pop().expect("released")
    }

    /// Two hosts, an agent each, nothing shared: the one on A exports the call with the id
    /// its request's sequence number gives; the one on B names that id as the SERVER span's
    /// parent, in the trace the rollout id gives both.
    #[test]
    fn a_caller_on_another_host_is_named_by_the_requests_sequence_number() {
        let (mut host_a, mut host_b) = (Stitcher::new(config()), Stitcher::new(config()));
        let now = Instant::now();
        let run = start(AGENT, Role::Server, 8000, 50000, 0, "/run");
        host_a.start(&run, facts(None, true), now);
        host_a.set_rollout(run.span_id, RolloutId::parse("7-1").unwrap());
        let call = between_hosts(AGENT, Role::Client, 5000, HOST_A, HOST_B);
        host_a.start(&call, facts(None, false), now);
        let served = between_hosts(MODEL, Role::Server, 5000, HOST_A, HOST_B);
        host_b.start(&served, inbound_facts(None, true), now);
        host_b.set_rollout(served.span_id, RolloutId::parse("7-1").unwrap());

        let exported_call = export(&mut host_a, &call, SpanKind::Client);
        let exported_served = export(&mut host_b, &served, SpanKind::Server);
        let trace = rollout_trace_id(&RolloutId::parse("7-1").unwrap());
        assert_eq!(exported_call.span_id, SpanId::of_call(trace, 5000));
        assert_eq!(exported_served.parent_span_id, Some(exported_call.span_id));
        assert!(exported_served.parent_is_remote);
        assert_eq!(exported_served.trace_id, exported_call.trace_id);
        assert_eq!(host_b.counters.cross_host_parents, 1);
        assert_eq!(host_b.counters.cross_host_unjoined, 0);
    }

    /// Two connections whose requests' first bytes have one TCP sequence number (the numbers
    /// of one host's connections meet far more often than 32 random bits would: #45): their
    /// CLIENT spans get two ids, whether both ends are on this host (ids of their own), the
    /// calls go to another host in two rollouts (the trace is in the derived id), or in one
    /// rollout (the second is caught, goes out under its own id, and is counted).
    #[test]
    fn requests_with_one_sequence_number_get_two_ids() {
        let now = Instant::now();
        // Two rollouts' `/run`s each make a call, from two ports, with one sequence number;
        // their CLIENT spans as released.
        let exported = |stitcher: &mut Stitcher, rollouts: [&str; 2], to: [u8; 4], port: u16| {
            let (mut runs, mut calls) = (Vec::new(), Vec::new());
            for (n, rollout) in (0..).zip(rollouts) {
                let run = start(AGENT, Role::Server, 8000, port + n, 0, "/run");
                stitcher.start(&run, facts(Some(rollout), true), now);
                let call = RequestStart {
                    local: Some(SocketAddr::from((HOST_A, port + 100 + n))),
                    ..between_hosts(AGENT, Role::Client, 5000, HOST_A, to)
                };
                stitcher.start(&call, facts(Some(rollout), false), now);
                runs.push(run.span_id);
                calls.push(call.span_id);
            }
            let mut out = Vec::new();
            for (run, call) in runs.into_iter().zip(calls) {
                let own = testing::span("HTTP POST", SpanKind::Client, call);
                stitcher.hold(call, SpanRole::Own, own, &mut out);
                stitcher.finish(call);
                stitcher.finish(run);
            }
            stitcher.release_all(&mut out);
            let ids: Vec<SpanId> = out.iter().map(|span| span.span_id).collect();
            assert_eq!(ids.len(), 2);
            assert_ne!(ids[0], ids[1], "{rollouts:?} to {to:?}");
            ids
        };
        let mut host_a = Stitcher::new(config());
        let local = exported(&mut host_a, ["1-0", "1-0"], HOST_A, 41000);
        assert!(local.iter().all(|id| {
            let trace = rollout_trace_id(&RolloutId::parse("1-0").unwrap());
            *id != SpanId::of_call(trace, 5000)
        }));
        let remote = exported(&mut host_a, ["2-0", "3-0"], HOST_B, 42000);
        for (id, rollout) in remote.iter().zip(["2-0", "3-0"]) {
            let trace = rollout_trace_id(&RolloutId::parse(rollout).unwrap());
            assert_eq!(*id, SpanId::of_call(trace, 5000));
        }
        assert_eq!(host_a.counters.shared_call_ids_repeated, 0);
        let same_trace = exported(&mut host_a, ["4-0", "4-0"], HOST_B, 43000);
        let trace = rollout_trace_id(&RolloutId::parse("4-0").unwrap());
        assert_eq!(same_trace[0], SpanId::of_call(trace, 5000));
        assert_eq!(host_a.counters.shared_call_ids_repeated, 1);
    }

    /// One keep-alive connection between the hosts reused by two rollouts, its requests
    /// pipelined, and a retry of the first on a new connection: each request keeps its own
    /// edge, since each has its own first byte.
    #[test]
    fn reused_pipelined_and_retried_requests_keep_their_own_edges() {
        let (mut host_a, mut host_b) = (Stitcher::new(config()), Stitcher::new(config()));
        let now = Instant::now();
        let mut calls = Vec::new();
        let mut runs = Vec::new();
        for (rollout, seq) in [("1-0", 100), ("2-0", 612), ("1-0", 9000)] {
            let run = start(AGENT, Role::Server, 8000, 50000, 0, "/run");
            host_a.start(&run, facts(Some(rollout), true), now);
            let call = between_hosts(AGENT, Role::Client, seq, HOST_A, HOST_B);
            host_a.start(&call, facts(Some(rollout), false), now);
            calls.push((rollout, call));
            runs.push(run.span_id);
        }
        // The runs answered: the retry, made while two runs of its rollout were in flight,
        // waits for no more evidence.
        for run in runs {
            host_a.finish(run);
        }
        // Host B reads the pipelined pair first, then the retry.
        let mut served = Vec::new();
        for (rollout, call) in &calls {
            let seq = call.tcp_seq.unwrap();
            let request = between_hosts(MODEL, Role::Server, seq, HOST_A, HOST_B);
            host_b.start(&request, inbound_facts(Some(rollout), true), now);
            served.push(request);
        }
        for ((rollout, call), request) in calls.iter().zip(&served) {
            let client = export(&mut host_a, call, SpanKind::Client);
            let server = export(&mut host_b, request, SpanKind::Server);
            assert_eq!(
                server.parent_span_id,
                Some(client.span_id),
                "rollout {rollout}"
            );
            assert_eq!(
                server.trace_id,
                rollout_trace_id(&RolloutId::parse(rollout).unwrap())
            );
            assert_eq!(client.trace_id, server.trace_id);
        }
        assert_eq!(host_b.counters.cross_host_parents, 3);
    }

    /// A parent is named only where the evidence decides it: without the trace (no rollout
    /// id) the span stays a root, marked; a caller that is no Gym server (rollout collection
    /// calling /run) or that is on this host (it would have been matched) names none.
    #[test]
    fn a_caller_on_another_host_is_left_out_where_the_trace_or_the_caller_is_unknown() {
        let mut host_b = Stitcher::new(config());
        let now = Instant::now();
        let unknown_trace = between_hosts(MODEL, Role::Server, 5000, HOST_A, HOST_B);
        host_b.start(&unknown_trace, inbound_facts(None, true), now);
        let span = export(&mut host_b, &unknown_trace, SpanKind::Server);
        assert_eq!(span.parent_span_id, None);
        assert!(
            span.attributes
                .iter()
                .any(|(key, value)| *key == attr::GYM_TRACER_PARENT_UNJOINED
                    && *value == AttributeValue::Str(UNJOINED_REASON.into()))
        );
        assert_eq!(host_b.counters.cross_host_unjoined, 1);

        let untraced_caller = between_hosts(AGENT, Role::Server, 6000, HOST_A, HOST_B);
        host_b.start(&untraced_caller, inbound_facts(Some("7-1"), false), now);
        let same_host = between_hosts(MODEL, Role::Server, 7000, HOST_B, HOST_B);
        host_b.start(&same_host, inbound_facts(Some("7-1"), true), now);
        for request in [&untraced_caller, &same_host] {
            let span = export(&mut host_b, request, SpanKind::Server);
            assert_eq!(span.parent_span_id, None);
            assert!(
                span.attributes
                    .iter()
                    .all(|(key, _)| *key != attr::GYM_TRACER_PARENT_UNJOINED)
            );
        }
        assert_eq!(host_b.counters.cross_host_unjoined, 1);
        assert_eq!(host_b.counters.cross_host_parents, 0);
    }

    /// A resources server's tool call names no rollout, but carries the session cookie that
    /// `/seed_session`'s response set for its rollout; a cookie set for two rollouts is no
    /// evidence.
    #[test]
    fn a_session_cookie_names_the_rollout_it_was_set_for() {
        let mut host_b = Stitcher::new(config());
        let now = Instant::now();
        let session = Token::of(crate::model::evidence::TokenKind::Cookie, b"session=abc");
        let seed = between_hosts(MODEL, Role::Server, 100, HOST_A, HOST_B);
        host_b.start(&seed, inbound_facts(None, true), now);
        host_b.set_rollout(seed.span_id, RolloutId::parse("7-1").unwrap());
        host_b.sessions_set(seed.span_id, &[session], now);
        export(&mut host_b, &seed, SpanKind::Server);
        let tool = RequestStart {
            session_tokens: vec![session],
            ..between_hosts(MODEL, Role::Server, 900, HOST_A, HOST_B)
        };
        host_b.start(&tool, inbound_facts(None, true), now);
        let span = export(&mut host_b, &tool, SpanKind::Server);
        assert_eq!(
            span.trace_id,
            rollout_trace_id(&RolloutId::parse("7-1").unwrap())
        );
        assert_eq!(
            span.parent_span_id,
            Some(SpanId::of_call(span.trace_id, 900))
        );
        assert_eq!(host_b.counters.rollouts_by_session, 1);

        let other = between_hosts(MODEL, Role::Server, 2000, HOST_A, HOST_B);
        host_b.start(&other, inbound_facts(Some("8-1"), true), now);
        host_b.sessions_set(other.span_id, &[session], now);
        assert_eq!(host_b.counters.sessions_conflicting, 1);
        let later = RequestStart {
            session_tokens: vec![session],
            ..between_hosts(MODEL, Role::Server, 3000, HOST_A, HOST_B)
        };
        host_b.start(&later, inbound_facts(None, true), now);
        assert_eq!(
            export(&mut host_b, &later, SpanKind::Server).parent_span_id,
            None
        );
        assert_eq!(host_b.counters.rollouts_by_session, 1);
    }

    #[test]
    fn calls_pick_their_parent_by_rollout_id_or_not_at_all() {
        let mut stitcher = Stitcher::new(config());
        let now = Instant::now();
        let a = start(AGENT, Role::Server, 8000, 50000, 0, "/run");
        let b = start(AGENT, Role::Server, 8000, 50001, 0, "/run");
        stitcher.start(&a, facts(Some("a"), false), now);
        stitcher.start(&b, facts(Some("b"), false), now);
        let for_b = start(AGENT, Role::Client, 40000, 9000, 0, "/ng-rollout/b/verify");
        stitcher.start(&for_b, facts(Some("b"), false), now);
        assert_eq!(stitcher.parent_request(for_b.span_id), Some(b.span_id));
        // Two in flight, no id on the call: no parent, counted.
        let anonymous = start(AGENT, Role::Client, 40001, 9000, 0, "/verify");
        stitcher.start(&anonymous, facts(None, false), now);
        assert_eq!(stitcher.parent_request(anonymous.span_id), None);
        assert_eq!(
            stitcher.undecided(anonymous.span_id),
            Some(Undecided::Ambiguous)
        );
        // One in flight but of another rollout: contradicting evidence, no edge.
        stitcher.finish(a.span_id);
        let for_c = start(AGENT, Role::Client, 40002, 9000, 0, "/ng-rollout/c/verify");
        stitcher.start(&for_c, facts(Some("c"), false), now);
        assert_eq!(stitcher.parent_request(for_c.span_id), None);
        assert_eq!(
            stitcher.undecided(for_c.span_id),
            Some(Undecided::Contradicted)
        );
        // Counted once each, when their spans are released.
        let mut out = Vec::new();
        for call in [&anonymous, &for_c] {
            stitcher.hold(
                call.span_id,
                SpanRole::Own,
                span("HTTP POST", call.span_id),
                &mut out,
            );
        }
        stitcher.release_all(&mut out);
        assert_eq!(
            (
                stitcher.counters.parents_ambiguous,
                stitcher.counters.parents_contradicted
            ),
            (1, 1)
        );
    }

    #[test]
    fn calls_of_a_nested_self_call_hang_under_the_innermost_request() {
        let mut stitcher = Stitcher::new(config());
        let now = Instant::now();
        // The agent's /run calls the agent's own /v1/responses, which calls the model.
        let run = start(AGENT, Role::Server, 8000, 50000, 0, "/run");
        stitcher.start(&run, facts(Some("r"), true), now);
        let self_call = start(
            AGENT,
            Role::Client,
            40000,
            8000,
            0,
            "/ng-rollout/r/v1/responses",
        );
        stitcher.start(&self_call, facts(Some("r"), false), now);
        let nested = start(
            AGENT,
            Role::Server,
            8000,
            40000,
            0,
            "/ng-rollout/r/v1/responses",
        );
        stitcher.start(&nested, facts(Some("r"), true), now);
        let model_call = start(
            AGENT,
            Role::Client,
            40001,
            9000,
            0,
            "/ng-rollout/r/v1/responses",
        );
        stitcher.start(&model_call, facts(Some("r"), false), now);
        let tool_call = start(AGENT, Role::Client, 40002, 7000, 0, "/get_weather");
        stitcher.start(&tool_call, facts(None, false), now);
        let nested_semantic = stitcher.semantic_span_id(nested.span_id);
        assert_eq!(stitcher.parent_request(model_call.span_id), nested_semantic);
        assert_eq!(stitcher.parent_request(tool_call.span_id), nested_semantic);
        assert_eq!(
            stitcher.effective_rollout(tool_call.span_id).cloned(),
            RolloutId::parse("r")
        );
        // Two unrelated requests are not a chain: no parent.
        let other = start(AGENT, Role::Server, 8000, 50001, 0, "/run");
        stitcher.start(&other, facts(Some("s"), true), now);
        let anonymous = start(AGENT, Role::Client, 40003, 7000, 0, "/get_weather");
        stitcher.start(&anonymous, facts(None, false), now);
        assert_eq!(stitcher.parent_request(anonymous.span_id), None);
        assert_eq!(
            stitcher.undecided(anonymous.span_id),
            Some(Undecided::Ambiguous)
        );
    }

    #[test]
    fn a_run_without_an_id_adopts_the_one_its_calls_carry() {
        let mut stitcher = Stitcher::new(config());
        let now = Instant::now();
        let run = start(AGENT, Role::Server, 8000, 50000, 0, "/run");
        stitcher.start(&run, facts(None, true), now);
        let call = start(AGENT, Role::Client, 40000, 9000, 0, "/ng-rollout/r9/verify");
        stitcher.start(&call, facts(Some("r9"), false), now);
        let mut out = Vec::new();
        stitcher.hold(
            run.span_id,
            SpanRole::Own,
            span("POST /run", run.span_id),
            &mut out,
        );
        stitcher.release_all(&mut out);
        let expected = rollout_trace_id(&RolloutId::parse("r9").unwrap());
        assert_eq!(out[0].trace_id, expected);
        assert!(out[0].attributes.iter().any(|(k, v)| *k == "nemo.gym.rollout.id"
            && *v == AttributeValue::Str("r9".into())));
    }

    #[test]
    fn a_traceparent_wins() {
        let mut stitcher = Stitcher::new(config());
        let now = Instant::now();
        let mut served = start(MODEL, Role::Server, 9000, 40000, 0, "/v1/responses");
        served.traceparent = Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
        stitcher.start(&served, facts(None, false), now);
        let call = start(AGENT, Role::Client, 40000, 9000, 0, "/v1/responses");
        stitcher.start(&call, facts(None, false), now);
        assert_eq!(stitcher.trace_of(served.span_id).0[0], 0x0a);
        assert_eq!(stitcher.counters.cross_process_links, 0);
        assert_eq!(stitcher.counters.local_calls_parented_by_header, 1);
    }

    /// With `--inject-traceparent`, a call from one traced process to another on this host
    /// arrives with the header this agent's kernel inserted: it names the caller's exported
    /// CLIENT span, so the local edge is kept (it also carries the rollout down), whichever
    /// end is seen first. A header naming anything else still wins.
    #[test]
    fn a_header_this_agent_injected_keeps_the_local_edge() {
        let header = |seq: u32| {
            let trace =
                parse_traceparent("00-0af7651916cd43dd8448eb211c80319c-0000000000000001-01")
                    .expect("a header")
                    .0;
            let span = crate::model::ids::hex(&SpanId::of_call(trace, seq).0);
            Some(format!("00-0af7651916cd43dd8448eb211c80319c-{span}-01"))
        };
        for server_first in [false, true] {
            let mut stitcher = Stitcher::new(config());
            let now = Instant::now();
            let mut call = start(AGENT, Role::Client, 40000, 9000, 0, "/v1/responses");
            call.tcp_seq = Some(77);
            let mut served = start(MODEL, Role::Server, 9000, 40000, 0, "/v1/responses");
            served.tcp_seq = Some(77);
            served.traceparent = header(77);
            if server_first {
                stitcher.start(&served, facts(None, false), now);
                stitcher.start(&call, facts(None, false), now);
            } else {
                stitcher.start(&call, facts(None, false), now);
                stitcher.start(&served, facts(None, false), now);
            }
            assert_eq!(
                stitcher.nodes[&served.span_id].parent,
                Parent::Local(call.span_id),
                "server first: {server_first}"
            );
            assert_eq!(stitcher.counters.cross_process_links, 1);
        }
        // A header from the caller's own instrumentation names its own span: it wins.
        let mut stitcher = Stitcher::new(config());
        let now = Instant::now();
        let mut call = start(AGENT, Role::Client, 40001, 9000, 0, "/x");
        call.tcp_seq = Some(78);
        let mut served = start(MODEL, Role::Server, 9000, 40001, 0, "/x");
        served.tcp_seq = Some(78);
        served.traceparent = header(5);
        stitcher.start(&call, facts(None, false), now);
        stitcher.start(&served, facts(None, false), now);
        assert!(matches!(
            stitcher.nodes[&served.span_id].parent,
            Parent::Remote(_, _)
        ));
    }

    #[test]
    fn held_spans_are_bounded_oldest_first() {
        let mut stitcher = Stitcher::new(StitchConfig {
            max_pending: 2,
            ..config()
        });
        let now = Instant::now();
        let mut out = Vec::new();
        let mut ids = Vec::new();
        for port in 0..3 {
            // Each waits for a traced caller that has not written yet.
            let request = start(MODEL, Role::Server, 9000, 41000 + port, 0, "/x");
            let facts = StartFacts {
                caller_seen_here: true,
                ..facts(None, false)
            };
            stitcher.start(&request, facts, now);
            let own = span("POST /x", request.span_id);
            stitcher.hold(request.span_id, SpanRole::Own, own, &mut out);
            ids.push(request.span_id);
        }
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].span_id, ids[0], "the oldest goes first");
        assert_eq!(stitcher.held(), 2);
        assert_eq!(stitcher.counters.spans_released_early, 1);
    }

    #[test]
    fn one_key_per_connection_waits() {
        let mut stitcher = Stitcher::new(config());
        let now = Instant::now();
        // Calls over one connection to a local server that is not traced: each next request
        // gives up the one before it (its server end would have come first), counted.
        for sequence in 0..200 {
            let call = start(AGENT, Role::Client, 40000, 9000, sequence, "/");
            stitcher.start(&call, facts(None, false), now);
            stitcher.finish(call.span_id);
        }
        assert_eq!(stitcher.waiting_clients.len(), 1);
        stitcher.release_all(&mut Vec::new());
        let counters = stitcher.counters;
        assert_eq!(counters.local_calls, 200);
        assert_eq!(counters.local_calls_unlinked_next_request, 199);
        assert_eq!(counters.local_calls_unlinked_shutdown, 1);
        // A call to another host waits for nothing here.
        let remote = RequestStart {
            peer: Some(SocketAddr::from(([10, 0, 0, 1], 80))),
            ..start(AGENT, Role::Client, 40001, 80, 0, "/")
        };
        stitcher.start(&remote, facts(None, false), now);
        assert!(stitcher.waiting_clients.is_empty());
        assert_eq!(stitcher.counters.local_calls, 200);
    }

    #[test]
    fn finished_requests_stay_while_needed_then_a_bounded_while() {
        let mut stitcher = Stitcher::new(StitchConfig {
            max_nodes: 4 * settle::RETIRED_KEEP,
            ..config()
        });
        let now = Instant::now();
        let mut out = Vec::new();
        let run = start(AGENT, Role::Server, 8000, 50000, 0, "/run");
        stitcher.start(&run, facts(Some("r1"), false), now);
        let call = start(AGENT, Role::Client, 40000, 9000, 0, "/ng-rollout/r1/x");
        stitcher.start(&call, facts(Some("r1"), false), now);
        stitcher.finish(run.span_id);
        stitcher.release(now, &mut out);
        assert!(
            stitcher.nodes.contains_key(&run.span_id),
            "a call hangs under it"
        );
        stitcher.finish(call.span_id);
        stitcher.connection_ended((
            SocketAddr::from(([127, 0, 0, 1], 40000)),
            SocketAddr::from(([127, 0, 0, 1], 9000)),
        ));
        stitcher.release(now, &mut out);
        assert_eq!(
            stitcher.retired.len(),
            1,
            "the call retired, kept; the run holds it"
        );
        // As many other requests retire after it: the call goes, then the run retires.
        let mut port = 0;
        let mut retire_others = |stitcher: &mut Stitcher, out: &mut Vec<SpanRecord>| {
            for _ in 0..settle::RETIRED_KEEP {
                port += 1;
                let other = start(AGENT, Role::Server, 8001, port, 0, "/y");
                stitcher.start(&other, facts(None, false), now);
                stitcher.finish(other.span_id);
            }
            stitcher.release(now, out);
        };
        retire_others(&mut stitcher, &mut out);
        assert!(!stitcher.nodes.contains_key(&call.span_id));
        assert!(stitcher.nodes.contains_key(&run.span_id));
        retire_others(&mut stitcher, &mut out);
        assert!(!stitcher.nodes.contains_key(&run.span_id));
        assert_eq!(stitcher.retired.len(), settle::RETIRED_KEEP);
    }

    /// A request's rollout learned after it started (its caller placed later) is looked up
    /// like one its head named: the calls that name the rollout find it.
    #[test]
    fn a_rollout_carried_down_later_is_found_by_the_calls_that_name_it() {
        let mut stitcher = Stitcher::new(config());
        let now = Instant::now();
        let run1 = start(AGENT, Role::Server, 8000, 50001, 0, "/run");
        let run2 = start(AGENT, Role::Server, 8000, 50002, 0, "/run");
        stitcher.start(&run1, facts(Some("1-0"), false), now);
        stitcher.start(&run2, facts(Some("2-0"), false), now);
        // The agent's call: two /run in flight, nothing names one yet.
        let call = start(AGENT, Role::Client, 40000, 9000, 0, "/v1/responses");
        stitcher.start(&call, facts(None, false), now);
        assert_eq!(stitcher.nodes[&call.span_id].parent, Parent::None);
        // The model server reads it (linked at once), and another rollout's request.
        let served = start(MODEL, Role::Server, 9000, 40000, 0, "/v1/responses");
        stitcher.start(&served, facts(None, false), now);
        let other = start(
            MODEL,
            Role::Server,
            9000,
            40001,
            0,
            "/ng-rollout/2-0/v1/responses",
        );
        stitcher.start(&other, facts(Some("2-0"), false), now);
        // The call's body tail names rollout 1-0: it, and the model's request, are 1-0's.
        stitcher.set_rollout(call.span_id, RolloutId::parse("1-0").unwrap());
        assert_eq!(
            stitcher.nodes[&call.span_id].parent,
            Parent::Local(run1.span_id)
        );
        // The model server's upstream call names 1-0 too: its request is found by it.
        let upstream = start(MODEL, Role::Client, 41000, 443, 0, "/v1/responses");
        stitcher.start(&upstream, facts(Some("1-0"), false), now);
        assert_eq!(
            stitcher.nodes[&upstream.span_id].parent,
            Parent::Local(served.span_id)
        );
        assert_eq!(stitcher.counters.parents_by_rollout_id, 2);
    }
}
