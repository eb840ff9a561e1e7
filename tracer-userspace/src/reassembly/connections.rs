//! The connection table: kernel events in, finished HTTP exchanges out.
//!
//! A connection is keyed by process and fd and carries the kernel's `conn_id` (its open
//! time), so a data record for a reused fd can never be mixed into an older connection.

use std::collections::VecDeque;
use std::net::SocketAddr;

use foldhash::{HashMap, HashMapExt};

use crate::kernel::events::{ConnOpen, DataTransfer, Direction, KernelEvent};

use crate::gym::rollout_id::{RolloutId, rollout_id_from_body_tail, rollout_id_from_run_body};
use crate::model::context::WriterTask;
use crate::model::counters::counters;
use crate::model::evidence::{Token, response_id_token};
use crate::model::exchange::RequestHead;
use crate::model::exchange::ResponseHead;
use crate::model::exchange::Role;
use crate::model::exchange::{
    AbortReason, HttpExchange, InboundSocket, ModelCall, OpaqueTls, Outcome, RequestStart, SocketId,
};
use crate::model::genai::{BodyView, GenAiOperation, top_level_model, usage};
use crate::model::ids::SpanId;
use crate::reassembly::http::{
    BodySample, Head, MessageEvent, MessageStream, ParseError, RequestContext, StreamKind,
    Transfer, WantsBody,
};

counters! {
    /// What reassembly could not follow, by reason: every request it drops is counted here.
    pub struct ReassemblyCounters {
        /// Message starts whose bytes were not HTTP/1.x. Not a loss for other protocols (HTTP/2,
        /// gRPC, databases): a connection with 3 parse errors and nothing in flight is given up
        /// (`connections_not_http`).
        note parse_not_http,
        /// Message heads longer than the capture (`--capture-bytes`) or 16 KiB. The span is built
        /// from the header lines captured, and headers past them (a `traceparent`, a cookie) are
        /// missing: raise `--capture-bytes` (at most 8192).
        lost parse_head_too_large,
        /// Messages that began in bytes the kernel did not capture: not traced. A message that
        /// starts mid-transfer, past the captured bytes (after a body in the same read or write),
        /// is not seen; the connection resumes at the next transfer that starts a message.
        lost parse_uncaptured_start,
        /// Chunked bodies whose chunk sizes were not all captured. The body's end is then taken
        /// from a transfer that ends in `0\r\n\r\n`, so the message's end time may be off.
        note parse_lost_chunk_framing,
        /// Data records for a connection the agent's table does not hold. Their bytes are dropped:
        /// its open record was lost (`events_lost_in_kernel`), it was not admitted
        /// (`connections_dropped`), or it had just been evicted or given up.
        lost data_without_connection,
        /// Responses with no request in flight to pair with: no span. The request was not seen (a
        /// lost record, or a head that could not be parsed: see `parse_*`).
        lost responses_without_request,
        /// Requests given up because 64 on one connection awaited responses. The limit is 64
        /// requests or 64 KiB of their heads; the oldest is exported as aborted (`error.type`
        /// `tracer_overflow`). Usually the responses were not being parsed (see `parse_*`).
        lost requests_dropped_overflow,
        /// Connections not tracked: the table could evict nothing. Only with `--max-connections 0`.
        lost connections_dropped,
        /// Connections evicted from the full table, least recently active first. Requests in flight
        /// on them are exported as aborted (`requests_evicted`) and later requests on them are not
        /// traced: raise `--max-connections`.
        lost connections_evicted,
        /// Connections evicted because all connections together buffered over 256 MiB. The bound is
        /// `MAX_BUFFERED_BYTES`, and these are also in `connections_evicted`. Healthy traffic holds
        /// next to nothing there: look for peers that send heads a few bytes at a time on many
        /// connections.
        lost connections_evicted_for_memory,
        /// Requests in flight on evicted connections, exported as aborted. Their spans carry
        /// `error.type` `tracer_evicted`: raise `--max-connections`.
        lost requests_evicted,
        /// Connections given up as not HTTP/1.x after 3 parse errors. The kernel stops capturing
        /// them. Not a loss for other protocols (HTTP/2, gRPC, databases).
        note connections_not_http,
        /// Message writes whose Python task context the kernel could not read. That write gives no
        /// task-context evidence (see `context_chains_empty` and `context_reads_failed`); the call
        /// is placed by other evidence.
        note task_contexts_unreadable,
        /// Task-context records not followed by the write they announced. Not a loss by itself: the
        /// write's record was lost, or its connection is not tracked.
        note task_contexts_unused,
        /// The most connections tracked at once. A high-water mark, never above
        /// `--max-connections`: near it, raise `--max-connections` before evictions start.
        note connections_tracked_peak,
    }
}

impl ReassemblyCounters {
    pub fn count_parse_error(&mut self, error: ParseError) {
        match error {
            ParseError::NotHttp => self.parse_not_http += 1,
            ParseError::HeadTooLarge => self.parse_head_too_large += 1,
            ParseError::UncapturedStart => self.parse_uncaptured_start += 1,
            ParseError::LostChunkFraming => self.parse_lost_chunk_framing += 1,
        }
    }

    /// Heads that could not be parsed, whatever the reason.
    pub fn parse_errors(&self) -> u64 {
        self.parse_not_http
            + self.parse_head_too_large
            + self.parse_uncaptured_start
            + self.parse_lost_chunk_framing
    }
}

/// Requests a single connection may have in flight (pipelining depth) before the oldest is
/// given up as lost.
pub(crate) const MAX_IN_FLIGHT_PER_CONNECTION: usize = 64;

/// Bytes of request heads (method, path, the headers kept) one connection may hold for its
/// requests in flight; past it the oldest is given up as lost. Together with
/// [`MAX_HEAD_BYTES`](crate::reassembly::http::MAX_HEAD_BYTES) per direction and the body prefix, this
/// bounds what one connection can make the agent hold, whatever its peer sends.
const MAX_IN_FLIGHT_HEAD_BYTES: usize = 64 * 1024;

/// Bytes all connections together may hold in partial heads, body prefixes and heads in
/// flight (each connection holds at most ~2 × 16 KiB + 8 KiB + 64 KiB of them). Past it the
/// least recently active connections are evicted: peers that send heads a few bytes at a
/// time on many connections cannot grow the agent past it. Healthy traffic holds next to
/// nothing here (a head is parsed as soon as it is complete).
const MAX_BUFFERED_BYTES: usize = 256 << 20;

/// When the table is full, the least recently active connections are found by one scan of
/// the table and kept as a queue of eviction candidates: this fraction of the table per
/// scan, so that a flood of new connections costs a scan per this many opens, not per open.
const EVICTION_SCAN_FRACTION: usize = 16;

#[derive(Debug)]
struct InFlight {
    head: RequestHead,
    start_ns: u64,
    run_rollout_id: Option<RolloutId>,
    span_id: SpanId,
    /// A call to an OpenAI-compatible endpoint (client role): what its bodies said so far.
    model_call: Option<Box<ModelCall>>,
}

/// Calls whose bodies are read for their model and token counts.
fn is_model_call(head: &RequestHead) -> bool {
    GenAiOperation::from_path(&head.path).is_some()
}

fn body_view(sample: &BodySample) -> BodyView<'_> {
    let (prefix, tail) = sample.unframed();
    BodyView {
        prefix,
        complete: sample.complete,
        tail,
    }
}

/// What a connection's bytes on the socket are, decided by its first captured bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Transport {
    Undecided,
    /// HTTP (or anything else) in the clear.
    Plain,
    /// TLS records: the socket's bytes are ciphertext, the HTTP comes from the uprobes on
    /// the TLS library (see [`super::tls`]).
    Tls,
}

/// A TLS handshake record (content type 22, protocol major version 3): how every TLS
/// connection starts, in both directions.
fn starts_tls_handshake(bytes: &[u8]) -> bool {
    matches!(bytes, [0x16, 0x03, minor, ..] if *minor <= 0x04)
}

#[derive(Debug)]
struct Connection {
    conn_id: u64,
    role: Role,
    transport: Transport,
    local: Option<SocketAddr>,
    peer: Option<SocketAddr>,
    requests: MessageStream,
    responses: MessageStream,
    in_flight: VecDeque<InFlight>,
    /// Requests seen on this connection so far.
    requests_seen: u64,
    /// The response head being received, if it is a final (non-1xx) one.
    current_response: Option<ResponseHead>,
    parse_errors: u32,
    /// Monotonic ns of the last record seen on it: the table evicts the stalest first.
    last_activity_ns: u64,
    /// Sum of [`RequestHead::heap_bytes`] over `in_flight`.
    in_flight_head_bytes: usize,
    /// TLS records sent and received (ciphertext bytes), for a connection whose plaintext
    /// never shows (see [`OpaqueTls`]).
    tls_bytes: [u64; 2],
    opened_ns: u64,
}

impl Connection {
    /// Decides what the socket carries from its first captured bytes; the transport decided
    /// now, if it was decided now.
    fn decide_transport(&mut self, captured: &[u8]) -> Option<Transport> {
        if self.transport != Transport::Undecided || captured.is_empty() {
            return None;
        }
        self.transport = if starts_tls_handshake(captured) {
            Transport::Tls
        } else {
            Transport::Plain
        };
        Some(self.transport)
    }

    /// Eviction order: connections without a request in flight (idle keep-alive, abandoned,
    /// half a head) go before those waiting on a response, each by last activity. A slow
    /// request (a long /run) keeps its connection silent but is not abandoned.
    fn eviction_rank(&self) -> (bool, u64) {
        (!self.in_flight.is_empty(), self.last_activity_ns)
    }

    /// Bytes held for it beyond its fixed size: heads being collected, a body prefix,
    /// the heads of its requests in flight.
    fn buffered_bytes(&self) -> usize {
        self.requests.buffered_bytes() + self.responses.buffered_bytes() + self.in_flight_head_bytes
    }

    /// The oldest request in flight, which the next response answers.
    fn pop_request(&mut self) -> Option<InFlight> {
        let request = self.in_flight.pop_front()?;
        self.in_flight_head_bytes -= request.head.heap_bytes();
        Some(request)
    }
}

/// A connection that was among the least recently active when the table was last scanned.
/// It is evicted only if it has not been active since.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct EvictionCandidate {
    rank: (bool, u64),
    id: SocketId,
    conn_id: u64,
}

/// A connection that keeps failing to parse is not HTTP (a database client, TLS); after this
/// many errors it is dropped and the kernel is told to stop reporting it.
const MAX_PARSE_ERRORS: u32 = 3;

/// Every connection of the traced processes, at most `max_connections`; when full, a new
/// connection evicts the least recently active one (see [`Connection::eviction_rank`]).
pub struct ConnectionTable {
    pub counters: ReassemblyCounters,
    connections: HashMap<SocketId, Connection>,
    max_connections: usize,
    /// Stalest last, so `pop` gives the next to evict.
    eviction_candidates: Vec<EvictionCandidate>,
    /// Sum of [`Connection::buffered_bytes`] over the table, at most `max_buffered_bytes`.
    buffered_bytes: usize,
    max_buffered_bytes: usize,
    /// Inbound requests whose body is read for a rollout id.
    wants_body: Option<WantsBody>,
    /// Task contexts the kernel read for the write that comes next on a connection (its
    /// `conn_id`, the chain): held from one record to the next, so kept out of `Connection`,
    /// whose size every idle connection pays.
    pending_contexts: HashMap<SocketId, (u64, WriterTask)>,
    scratch_events: Vec<MessageEvent>,
    scratch_errors: Vec<ParseError>,
    /// TLS connections that ended without a readable request, for the caller to take.
    pub ended_opaque: Vec<OpaqueTls>,
    /// Processes whose connection was just found to be TLS (one entry per connection), for
    /// the caller to take.
    pub tls_opened: Vec<u32>,
    /// See [`ConnectionTable::take_ciphertext`].
    last_was_ciphertext: bool,
    /// Client connections by (local, peer) address: which callers of a server are traced
    /// sockets ([`ConnectionTable::is_traced_client`]). The pair, not the local address
    /// alone: Linux gives one ephemeral port to connections to different servers.
    client_ends: HashMap<(SocketAddr, SocketAddr), SocketId>,
    /// Connections that left the table (closed, evicted, replaced), as (client, server)
    /// addresses, for the caller to take: what waited for their other end waits no more.
    pub ended_connections: Vec<(SocketAddr, SocketAddr)>,
}

/// What the table asks of the caller besides exchanges.
#[derive(Debug, PartialEq, Eq)]
pub enum TableAction {
    /// Stop capturing this socket in the kernel: it is not HTTP/1.x (`not_http`: the kernel
    /// keeps it, ignored, so that its transfers do not count as ones on unknown sockets), or
    /// it was evicted from the table or closed by an exec (the kernel forgets it).
    Untrack {
        id: SocketId,
        conn_id: u64,
        not_http: bool,
    },
    /// A request started; reported before anything that depends on it (boxed: the other
    /// actions are small and many).
    Started(Box<RequestStart>),
    /// A started request's body named its rollout.
    RolloutFromBody {
        span_id: SpanId,
        rollout_id: RolloutId,
    },
    /// The response to an inbound request (server role) is being written by this task.
    ResponseWriter { span_id: SpanId, writer: WriterTask },
    /// A response body started with an id (see [`response_id_token`]).
    ResponseId { span_id: SpanId, token: Token },
}

impl ConnectionTable {
    pub fn new(max_connections: usize) -> Self {
        Self {
            connections: HashMap::new(),
            max_connections,
            eviction_candidates: Vec::new(),
            buffered_bytes: 0,
            max_buffered_bytes: MAX_BUFFERED_BYTES,
            wants_body: None,
            pending_contexts: HashMap::new(),
            scratch_events: Vec::new(),
            scratch_errors: Vec::new(),
            ended_opaque: Vec::new(),
            tls_opened: Vec::new(),
            last_was_ciphertext: false,
            client_ends: HashMap::new(),
            ended_connections: Vec::new(),
            counters: ReassemblyCounters::default(),
        }
    }

    /// Inbound requests that `wants_body` accepts get `run_rollout_id` read from their body.
    pub fn reading_run_bodies(mut self, wants_body: WantsBody) -> Self {
        self.wants_body = Some(wants_body);
        self
    }

    #[cfg(test)]
    fn with_max_buffered_bytes(mut self, max_buffered_bytes: usize) -> Self {
        self.max_buffered_bytes = max_buffered_bytes;
        self
    }

    pub fn open_connections(&self) -> usize {
        self.connections.len()
    }

    /// Whether the last transfer applied was TLS ciphertext (the table does not parse it: it
    /// is the TLS sessions' evidence). Reset by the call.
    pub fn take_ciphertext(&mut self) -> bool {
        std::mem::take(&mut self.last_was_ciphertext)
    }

    /// Applies a TLS plaintext transfer, already tied to its connection.
    pub fn apply_plaintext(
        &mut self,
        data: &DataTransfer<'_>,
        exchanges: &mut Vec<HttpExchange>,
        actions: &mut Vec<TableAction>,
    ) {
        let mut counters = self.counters;
        self.data(data, true, &mut counters, exchanges, actions);
        self.counters = counters;
    }

    /// Applies one kernel event; finished exchanges are appended to `exchanges`.
    pub fn apply(
        &mut self,
        event: &KernelEvent<'_>,
        exchanges: &mut Vec<HttpExchange>,
        actions: &mut Vec<TableAction>,
    ) {
        // Copied out and back (a few words) so the helpers below can borrow `self` whole.
        let mut counters = self.counters;
        self.apply_counted(event, &mut counters, exchanges, actions);
        self.counters = counters;
    }

    fn apply_counted(
        &mut self,
        event: &KernelEvent<'_>,
        counters: &mut ReassemblyCounters,
        exchanges: &mut Vec<HttpExchange>,
        actions: &mut Vec<TableAction>,
    ) {
        match event {
            KernelEvent::Open(open) => self.open(open, counters, exchanges, actions),
            KernelEvent::Close {
                pid,
                fd,
                conn_id,
                timestamp_ns,
            } => {
                let id = SocketId { pid: *pid, fd: *fd };
                if self
                    .connections
                    .get(&id)
                    .is_some_and(|c| c.conn_id == *conn_id)
                {
                    let connection = self.remove(&id).expect("checked above");
                    self.ended_opaque.extend(finish(
                        id.pid,
                        connection,
                        *timestamp_ns,
                        AbortReason::ConnectionClosed,
                        counters,
                        exchanges,
                    ));
                }
            }
            KernelEvent::Data(data) => self.data(data, false, counters, exchanges, actions),
            // The pipeline ties TLS records to their connection and hands them on as
            // [`ConnectionTable::apply_plaintext`] and task contexts with the socket's fd.
            KernelEvent::ProcessFork { .. }
            | KernelEvent::SpawnContext { .. }
            | KernelEvent::TlsData(_) => {}
            KernelEvent::TaskContext(context) => {
                let id = SocketId {
                    pid: context.pid,
                    fd: context.fd,
                };
                if self
                    .connections
                    .get(&id)
                    .is_some_and(|c| c.conn_id == context.conn_id)
                {
                    let stale = self
                        .pending_contexts
                        .insert(id, (context.conn_id, context.writer));
                    counters.task_contexts_unused += u64::from(stale.is_some());
                    counters.task_contexts_unreadable += u64::from(context.writer.chain.is_none());
                } else {
                    counters.task_contexts_unused += 1;
                }
            }
            KernelEvent::ProcessExit { pid, timestamp_ns } => {
                self.end_process(
                    *pid,
                    *timestamp_ns,
                    AbortReason::ProcessExited,
                    counters,
                    exchanges,
                    actions,
                );
            }
            KernelEvent::ProcessExec {
                pid, timestamp_ns, ..
            } => {
                self.end_process(
                    *pid,
                    *timestamp_ns,
                    AbortReason::ProcessExec,
                    counters,
                    exchanges,
                    actions,
                );
            }
        }
    }

    /// Ends every connection of a process that exited or exec'd. The kernel still holds the
    /// sockets it knew: they are gone (or, after an exec, if one was not close-on-exec, belong
    /// to a program whose messages start anew), so each is untracked by its key. That is the
    /// whole of an exit's kernel cleanup: a walk of the kernel's socket map per exit stalled
    /// the agent behind a CLI that spawns hundreds of processes per rollout (the periodic
    /// sweep finds what a lost record left).
    fn end_process(
        &mut self,
        pid: u32,
        timestamp_ns: u64,
        reason: AbortReason,
        counters: &mut ReassemblyCounters,
        exchanges: &mut Vec<HttpExchange>,
        actions: &mut Vec<TableAction>,
    ) {
        let ids: Vec<SocketId> = self
            .connections
            .keys()
            .filter(|id| id.pid == pid)
            .copied()
            .collect();
        for id in ids {
            actions.push(TableAction::Untrack {
                id,
                conn_id: self.connections[&id].conn_id,
                not_http: false,
            });
            if let Some(connection) = self.remove(&id) {
                self.ended_opaque.extend(finish(
                    id.pid,
                    connection,
                    timestamp_ns,
                    reason,
                    counters,
                    exchanges,
                ));
            }
        }
    }

    fn open(
        &mut self,
        open: &ConnOpen,
        counters: &mut ReassemblyCounters,
        exchanges: &mut Vec<HttpExchange>,
        actions: &mut Vec<TableAction>,
    ) {
        let id = SocketId {
            pid: open.pid,
            fd: open.fd,
        };
        if let Some(stale) = self.remove(&id) {
            // The close of the previous connection on this fd was not seen.
            self.ended_opaque.extend(finish(
                id.pid,
                stale,
                open.timestamp_ns,
                AbortReason::ConnectionClosed,
                counters,
                exchanges,
            ));
        }
        if self.connections.len() >= self.max_connections
            && !self.evict_stalest(open.timestamp_ns, counters, exchanges, actions)
        {
            counters.connections_dropped += 1;
            return;
        }
        if open.role == Role::Client
            && let (Some(local), Some(peer)) = (open.local, open.peer)
        {
            self.client_ends.insert((local, peer), id);
        }
        self.connections.insert(
            id,
            Connection {
                conn_id: open.conn_id,
                role: open.role,
                transport: Transport::Undecided,
                local: open.local,
                peer: open.peer,
                requests: match (open.role, self.wants_body) {
                    (Role::Server, Some(wants)) => MessageStream::keeping_bodies(wants),
                    (Role::Server, None) => MessageStream::new(StreamKind::Requests),
                    (Role::Client, _) => MessageStream::keeping_bodies(is_model_call),
                },
                responses: MessageStream::new(StreamKind::Responses),
                in_flight: VecDeque::new(),
                tls_bytes: [0; 2],
                opened_ns: open.timestamp_ns,
                requests_seen: 0,
                current_response: None,
                parse_errors: 0,
                last_activity_ns: open.timestamp_ns,
                in_flight_head_bytes: 0,
            },
        );
        counters.connections_tracked_peak = counters
            .connections_tracked_peak
            .max(self.connections.len() as u64);
    }

    /// Makes room for one connection by evicting the least recently active one: its requests
    /// in flight end as [`AbortReason::Evicted`] and the kernel stops capturing it. False
    /// when there is nothing to evict (a table of size 0).
    fn evict_stalest(
        &mut self,
        timestamp_ns: u64,
        counters: &mut ReassemblyCounters,
        exchanges: &mut Vec<HttpExchange>,
        actions: &mut Vec<TableAction>,
    ) -> bool {
        for rescanned in [false, true] {
            if rescanned {
                self.scan_for_eviction();
            }
            while let Some(candidate) = self.eviction_candidates.pop() {
                let still_stale = self.connections.get(&candidate.id).is_some_and(|c| {
                    c.conn_id == candidate.conn_id && c.eviction_rank() == candidate.rank
                });
                if !still_stale {
                    continue; // closed, or active since the scan
                }
                let (in_flight, _) = candidate.rank;
                if in_flight && !rescanned {
                    // Connections that became idle since the scan go first: look again.
                    self.eviction_candidates.clear();
                    break;
                }
                let connection = self.remove(&candidate.id).expect("checked");
                counters.connections_evicted += 1;
                counters.requests_evicted += connection.in_flight.len() as u64;
                actions.push(TableAction::Untrack {
                    id: candidate.id,
                    conn_id: candidate.conn_id,
                    not_http: false,
                });
                self.ended_opaque.extend(finish(
                    candidate.id.pid,
                    connection,
                    timestamp_ns,
                    AbortReason::Evicted,
                    counters,
                    exchanges,
                ));
                return true;
            }
        }
        false
    }

    /// Refills the eviction candidates with the stalest part of the table.
    fn scan_for_eviction(&mut self) {
        let mut candidates: Vec<EvictionCandidate> = self
            .connections
            .iter()
            .map(|(id, c)| EvictionCandidate {
                rank: c.eviction_rank(),
                id: *id,
                conn_id: c.conn_id,
            })
            .collect();
        let keep = (candidates.len() / EVICTION_SCAN_FRACTION).max(1);
        if keep < candidates.len() {
            candidates.select_nth_unstable(keep - 1);
            candidates.truncate(keep);
        }
        candidates.sort_unstable_by(|a, b| b.cmp(a));
        self.eviction_candidates = candidates;
    }

    /// `plaintext`: TLS plaintext from the uprobes, as opposed to the socket's own bytes.
    fn data(
        &mut self,
        data: &DataTransfer<'_>,
        plaintext: bool,
        counters: &mut ReassemblyCounters,
        exchanges: &mut Vec<HttpExchange>,
        actions: &mut Vec<TableAction>,
    ) {
        let id = SocketId {
            pid: data.pid,
            fd: data.fd,
        };
        let Some(connection) = self.connections.get_mut(&id) else {
            counters.data_without_connection += 1;
            return;
        };
        if connection.conn_id != data.conn_id {
            counters.data_without_connection += 1;
            return;
        }
        if plaintext {
            connection.transport = Transport::Tls;
        } else {
            if connection.decide_transport(data.captured) == Some(Transport::Tls) {
                self.tls_opened.push(data.pid);
            }
            if connection.transport == Transport::Tls {
                // Ciphertext: the TLS sessions' evidence, not HTTP.
                let direction = usize::from(data.direction == Direction::Write);
                connection.tls_bytes[direction] += data.total_len;
                connection.last_activity_ns = connection.last_activity_ns.max(data.timestamp_ns);
                self.last_was_ciphertext = true;
                return;
            }
        }
        connection.last_activity_ns = connection.last_activity_ns.max(data.timestamp_ns);
        let buffered_before = connection.buffered_bytes();
        // Server: reads are requests. Client: writes are requests.
        let is_request = (connection.role == Role::Server) == (data.direction == Direction::Read);
        // The kernel emits a context right before the write it was read for: on anything
        // else it is stale.
        let pending = self
            .pending_contexts
            .remove(&id)
            .filter(|(conn_id, _)| *conn_id == data.conn_id)
            .map(|(_, writer)| writer);
        let writer = match data.direction {
            Direction::Write => pending,
            Direction::Read => {
                counters.task_contexts_unused += u64::from(pending.is_some());
                None
            }
        };
        let transfer = Transfer {
            captured: data.captured,
            total_len: data.total_len,
            tail: data.tail,
            timestamp_ns: data.timestamp_ns,
            seq: data.seq,
        };
        let events = &mut self.scratch_events;
        let errors = &mut self.scratch_errors;
        events.clear();
        errors.clear();
        if is_request {
            connection
                .requests
                .feed(transfer, |_| RequestContext::default(), events, errors);
        } else {
            // One write can answer several pipelined requests: each response head is
            // matched with its own request (a HEAD's response has no body).
            let in_flight = &connection.in_flight;
            connection.responses.feed(
                transfer,
                |answered| {
                    let request = in_flight.get(answered);
                    RequestContext {
                        is_head: request.is_some_and(|r| r.head.method == "HEAD"),
                        keeps_body: request.is_some_and(|r| r.model_call.is_some()),
                    }
                },
                events,
                errors,
            );
        }
        for error in errors.iter() {
            counters.count_parse_error(*error);
        }
        connection.parse_errors += errors.len() as u32;
        for event in events.drain(..) {
            let message = Message {
                pid: id.pid,
                fd: id.fd,
                is_request,
                writer,
            };
            on_message_event(&message, connection, event, counters, exchanges, actions);
        }
        self.buffered_bytes = self.buffered_bytes - buffered_before + connection.buffered_bytes();
        if connection.parse_errors >= MAX_PARSE_ERRORS && connection.in_flight.is_empty() {
            actions.push(TableAction::Untrack {
                id,
                conn_id: connection.conn_id,
                not_http: true,
            });
            self.remove(&id);
            counters.connections_not_http += 1;
        }
        while self.buffered_bytes > self.max_buffered_bytes
            && self.evict_stalest(data.timestamp_ns, counters, exchanges, actions)
        {
            counters.connections_evicted_for_memory += 1;
        }
    }

    /// Takes a connection out of the table, keeping the buffered-bytes total.
    fn remove(&mut self, id: &SocketId) -> Option<Connection> {
        self.pending_contexts.remove(id);
        let connection = self.connections.remove(id)?;
        self.buffered_bytes -= connection.buffered_bytes();
        if let (Some(local), Some(peer)) = (connection.local, connection.peer) {
            let pair = match connection.role {
                Role::Client => {
                    if self.client_ends.get(&(local, peer)) == Some(id) {
                        self.client_ends.remove(&(local, peer));
                    }
                    (local, peer)
                }
                Role::Server => (peer, local),
            };
            self.ended_connections.push(pair);
        }
        Some(connection)
    }

    /// Whether the connection from `client` to `server` is a traced process's: its connect
    /// was reported before it could write, so every request it sends will be seen.
    pub fn is_traced_client(&self, client: SocketAddr, server: SocketAddr) -> bool {
        self.client_ends.contains_key(&(client, server))
    }

    /// Requests still waiting for their response (reported at shutdown: they are not
    /// exported, not being finished).
    pub fn in_flight_requests(&self) -> usize {
        self.connections.values().map(|c| c.in_flight.len()).sum()
    }
}

/// What the rest of the pipeline learns when a request's head has been read.
fn request_start(
    message: &Message,
    connection: &Connection,
    head: &RequestHead,
    span_id: SpanId,
    tcp_seq: Option<u32>,
) -> RequestStart {
    RequestStart {
        pid: message.pid,
        role: connection.role,
        local: connection.local,
        peer: connection.peer,
        sequence: connection.requests_seen,
        tcp_seq,
        span_id,
        method: head.method.clone(),
        path: head.path.clone(),
        traceparent: head.traceparent.clone(),
        session_tokens: head.session_tokens.clone(),
        context: message
            .writer
            .and_then(|writer| writer.chain)
            .filter(|_| connection.role == Role::Client),
        lineage: message
            .writer
            .and_then(|writer| writer.lineage)
            .filter(|_| connection.role == Role::Client),
        inbound_socket: (connection.role == Role::Server
            && connection.transport == Transport::Plain)
            .then_some(InboundSocket {
                fd: message.fd,
                conn_id: connection.conn_id,
                requests_before: connection.requests_seen as u32,
            }),
    }
}

/// Which message an event of the parser belongs to.
struct Message {
    pid: u32,
    fd: i32,
    is_request: bool,
    /// What the kernel read of the task that wrote it (writes only).
    writer: Option<WriterTask>,
}

fn on_message_event(
    message: &Message,
    connection: &mut Connection,
    event: MessageEvent,
    counters: &mut ReassemblyCounters,
    exchanges: &mut Vec<HttpExchange>,
    actions: &mut Vec<TableAction>,
) {
    let Message {
        pid,
        fd: _,
        is_request,
        writer,
    } = *message;
    match (is_request, event) {
        (
            true,
            MessageEvent::Head {
                head: Head::Request(head),
                first_byte_ns,
                first_byte_seq,
            },
        ) => {
            let head_bytes = head.heap_bytes();
            while (connection.in_flight.len() >= MAX_IN_FLIGHT_PER_CONNECTION
                || connection.in_flight_head_bytes + head_bytes > MAX_IN_FLIGHT_HEAD_BYTES)
                && let Some(oldest) = connection.pop_request()
            {
                counters.requests_dropped_overflow += 1;
                exchanges.push(exchange(
                    pid,
                    connection,
                    oldest,
                    Outcome::Aborted(AbortReason::Overflow),
                    first_byte_ns,
                ));
            }
            connection.in_flight_head_bytes += head_bytes;
            let span_id = SpanId::random();
            let start = request_start(message, connection, &head, span_id, first_byte_seq);
            actions.push(TableAction::Started(Box::new(start)));
            connection.requests_seen += 1;
            let model_call = match connection.role {
                Role::Client => GenAiOperation::from_path(&head.path),
                Role::Server => None,
            };
            connection.in_flight.push_back(InFlight {
                head,
                start_ns: first_byte_ns,
                run_rollout_id: None,
                span_id,
                model_call: model_call.map(|operation| Box::new(ModelCall::new(operation))),
            });
        }
        (
            false,
            MessageEvent::Head {
                head: Head::Response(head),
                ..
            },
        ) => {
            if let (Role::Server, Some(writer), Some(request)) =
                (connection.role, writer, connection.in_flight.front())
                && (writer.chain.is_some() || writer.lineage.is_some())
            {
                actions.push(TableAction::ResponseWriter {
                    span_id: request.span_id,
                    writer,
                });
            }
            connection.current_response = (head.status >= 200).then_some(head);
        }
        (
            false,
            MessageEvent::End {
                last_byte_ns,
                stream,
                ..
            },
        ) => {
            let Some(response) = connection.current_response.take() else {
                return; // the end of an interim (1xx) response
            };
            match connection.pop_request() {
                Some(request) => exchanges.push(HttpExchange {
                    stream,
                    ..exchange(
                        pid,
                        connection,
                        request,
                        Outcome::Response(response),
                        stream.map_or(last_byte_ns, |stream| stream.last_data_ns),
                    )
                }),
                // The request was sent before the connection was traced.
                None => counters.responses_without_request += 1,
            }
        }
        (true, MessageEvent::Body(sample)) => {
            // The body is read for the few fields that name the rollout, then let go: its
            // start for an agent's `/run` (kept when asked for), its end for every request;
            // and a model call's for the model it asks for.
            if let Some(request) = connection.in_flight.back_mut() {
                if let Some(call) = &mut request.model_call {
                    call.request_model = top_level_model(&body_view(&sample));
                }
                let from_prefix = (!sample.prefix.is_empty())
                    .then(|| rollout_id_from_run_body(&sample.prefix, sample.complete))
                    .flatten();
                let from_tail = sample.tail.as_deref().and_then(rollout_id_from_body_tail);
                request.run_rollout_id = match (from_prefix, from_tail) {
                    (Some(a), Some(b)) if a != b => None,
                    (a, b) => a.or(b),
                };
                if let Some(rollout_id) = &request.run_rollout_id {
                    actions.push(TableAction::RolloutFromBody {
                        span_id: request.span_id,
                        rollout_id: rollout_id.clone(),
                    });
                }
            }
        }
        (false, MessageEvent::Body(sample)) => {
            if let (Some(request), Some(_)) = (
                connection.in_flight.front_mut(),
                &connection.current_response,
            ) && let Some(call) = &mut request.model_call
            {
                let body = body_view(&sample);
                call.response_model = top_level_model(&body);
                call.usage = usage(&body);
            }
            if let (Some(token), Some(request), Some(_)) = (
                response_id_token(&sample.prefix),
                connection.in_flight.front(),
                &connection.current_response,
            ) {
                actions.push(TableAction::ResponseId {
                    span_id: request.span_id,
                    token,
                });
            }
        }
        // The end of a request body changes nothing: the exchange ends with its response.
        (true, MessageEvent::End { .. }) => {}
        (_, MessageEvent::Head { .. }) => {}
    }
}

fn exchange(
    pid: u32,
    connection: &Connection,
    request: InFlight,
    outcome: Outcome,
    end_ns: u64,
) -> HttpExchange {
    HttpExchange {
        pid,
        role: connection.role,
        local: connection.local,
        peer: connection.peer,
        request: request.head,
        outcome,
        start_ns: request.start_ns,
        end_ns: end_ns.max(request.start_ns),
        stream: None,
        run_rollout_id: request.run_rollout_id,
        span_id: request.span_id,
        tls: connection.transport == Transport::Tls,
        model_call: request.model_call,
    }
}

/// A connection ended: a response that runs until close completes, the rest is aborted; a
/// TLS connection that carried no readable request is what it gives back.
fn finish(
    pid: u32,
    mut connection: Connection,
    timestamp_ns: u64,
    reason: AbortReason,
    counters: &mut ReassemblyCounters,
    exchanges: &mut Vec<HttpExchange>,
) -> Option<OpaqueTls> {
    let mut events = Vec::new();
    connection.responses.close(timestamp_ns, &mut events);
    for event in events {
        // A response end cannot start a request: nothing is pushed.
        let message = Message {
            pid,
            fd: -1,
            is_request: false,
            writer: None,
        };
        on_message_event(
            &message,
            &mut connection,
            event,
            counters,
            exchanges,
            &mut Vec::new(),
        );
    }
    // A response whose head arrived was answered, even if the rest of its body never was
    // read: a client that gives up on a 5xx body (aiohttp's raise_for_status) closes here.
    if let Some(response) = connection.current_response.take()
        && let Some(request) = connection.in_flight.pop_front()
    {
        exchanges.push(exchange(
            pid,
            &connection,
            request,
            Outcome::Response(response),
            timestamp_ns,
        ));
    }
    while let Some(request) = connection.in_flight.pop_front() {
        exchanges.push(exchange(
            pid,
            &connection,
            request,
            Outcome::Aborted(reason),
            timestamp_ns,
        ));
    }
    (connection.transport == Transport::Tls && connection.requests_seen == 0).then(|| OpaqueTls {
        pid,
        role: connection.role,
        local: connection.local,
        peer: connection.peer,
        opened_ns: connection.opened_ns,
        ended_ns: timestamp_ns.max(connection.opened_ns),
        bytes_sent: connection.tls_bytes[1],
        bytes_received: connection.tls_bytes[0],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::exchange::StreamTimes;
    use std::net::{IpAddr, Ipv4Addr};

    fn open(fd: i32, conn_id: u64, role: Role) -> KernelEvent<'static> {
        KernelEvent::Open(ConnOpen {
            pid: 7,
            fd,
            conn_id,
            timestamp_ns: conn_id,
            role,
            local: Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000)),
            peer: Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 40000)),
        })
    }

    /// A server's caller is a traced socket when that very connection is one: the same
    /// ephemeral port on a connection to another server is someone else's; a closed
    /// connection is no one's; every end that leaves the table is reported.
    #[test]
    fn traced_client_ends_are_known_by_both_addresses_until_they_leave() {
        let mut table = ConnectionTable::new(16);
        let (mut exchanges, mut actions) = (Vec::new(), Vec::new());
        // Local 8000 -> peer 40000, as a client this time.
        table.apply(&open(3, 1, Role::Client), &mut exchanges, &mut actions);
        let at = |port| SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
        assert!(table.is_traced_client(at(8000), at(40000)));
        assert!(
            !table.is_traced_client(at(8000), at(40001)),
            "same port, other server"
        );
        let close = KernelEvent::Close {
            pid: 7,
            fd: 3,
            conn_id: 1,
            timestamp_ns: 2,
        };
        table.apply(&close, &mut exchanges, &mut actions);
        assert!(!table.is_traced_client(at(8000), at(40000)));
        assert_eq!(table.ended_connections, [(at(8000), at(40000))]);
    }

    fn data(
        fd: i32,
        conn_id: u64,
        direction: Direction,
        ts: u64,
        bytes: &'static [u8],
    ) -> KernelEvent<'static> {
        KernelEvent::Data(DataTransfer {
            pid: 7,
            tid: 7,
            fd,
            conn_id,
            timestamp_ns: ts,
            direction,
            captured: bytes,
            total_len: bytes.len() as u64,
            tail: &[],
            seq: None,
        })
    }

    fn run(
        events: &[KernelEvent<'static>],
    ) -> (Vec<HttpExchange>, ReassemblyCounters, Vec<TableAction>) {
        let mut table = ConnectionTable::new(16);
        let mut exchanges = Vec::new();
        let mut actions = Vec::new();
        for event in events {
            table.apply(event, &mut exchanges, &mut actions);
        }
        (exchanges, table.counters, actions)
    }

    const GET: &[u8] = b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n";
    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
    const FAIL: &[u8] = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n";

    #[test]
    fn keep_alive_requests_pair_with_their_responses_in_order() {
        let (exchanges, stats, _) = run(&[
            open(5, 100, Role::Server),
            data(5, 100, Direction::Read, 110, GET),
            data(5, 100, Direction::Write, 120, OK),
            data(5, 100, Direction::Read, 130, GET),
            data(5, 100, Direction::Write, 150, FAIL),
        ]);
        assert_eq!(exchanges.len(), 2);
        assert_eq!((exchanges[0].start_ns, exchanges[0].end_ns), (110, 120));
        assert_eq!((exchanges[1].start_ns, exchanges[1].end_ns), (130, 150));
        let Outcome::Response(second) = &exchanges[1].outcome else {
            panic!()
        };
        assert_eq!(second.status, 500);
        assert_eq!(stats.responses_without_request, 0);
    }

    #[test]
    fn pipelined_requests_answer_in_order() {
        const TWO: &[u8] = b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\n";
        let (exchanges, _, _) = run(&[
            open(5, 100, Role::Server),
            data(5, 100, Direction::Read, 110, TWO),
            data(5, 100, Direction::Write, 120, OK),
            data(5, 100, Direction::Write, 130, FAIL),
        ]);
        let paths: Vec<_> = exchanges.iter().map(|e| e.request.path.as_str()).collect();
        assert_eq!(paths, ["/a", "/b"]);
        assert_eq!(exchanges[1].end_ns, 130);
    }

    #[test]
    fn fd_reuse_does_not_mix_connections() {
        let (exchanges, stats, _) = run(&[
            open(5, 100, Role::Server),
            data(5, 100, Direction::Read, 110, GET),
            KernelEvent::Close {
                pid: 7,
                fd: 5,
                conn_id: 100,
                timestamp_ns: 115,
            },
            open(5, 200, Role::Server),
            // A late record of the old connection must not land in the new one.
            data(5, 100, Direction::Write, 116, OK),
            data(5, 200, Direction::Read, 210, GET),
            data(5, 200, Direction::Write, 220, OK),
        ]);
        assert_eq!(exchanges.len(), 2);
        assert_eq!(
            exchanges[0].outcome,
            Outcome::Aborted(AbortReason::ConnectionClosed)
        );
        assert_eq!(exchanges[0].end_ns, 115);
        assert!(matches!(exchanges[1].outcome, Outcome::Response(_)));
        assert_eq!(stats.data_without_connection, 1);
    }

    #[test]
    fn client_connections_pair_writes_with_reads() {
        let (exchanges, _, _) = run(&[
            open(9, 300, Role::Client),
            data(9, 300, Direction::Write, 310, GET),
            data(9, 300, Direction::Read, 330, OK),
        ]);
        assert_eq!(exchanges.len(), 1);
        assert_eq!(exchanges[0].role, Role::Client);
        assert_eq!((exchanges[0].start_ns, exchanges[0].end_ns), (310, 330));
    }

    #[test]
    fn process_exit_aborts_in_flight_requests() {
        let (exchanges, _, actions) = run(&[
            open(5, 100, Role::Server),
            open(6, 101, Role::Server),
            data(5, 100, Direction::Read, 110, GET),
            KernelEvent::ProcessExit {
                pid: 7,
                timestamp_ns: 500,
            },
        ]);
        // The kernel still holds both sockets: each is untracked by its key (no walk of the
        // kernel's map per exit).
        assert_eq!(untracked(&actions), [5, 6]);
        assert_eq!(exchanges.len(), 1);
        assert_eq!(
            exchanges[0].outcome,
            Outcome::Aborted(AbortReason::ProcessExited)
        );
    }

    #[test]
    fn exec_ends_the_connections_it_closed() {
        let (exchanges, _, actions) = run(&[
            open(5, 100, Role::Server),
            open(6, 101, Role::Server),
            data(5, 100, Direction::Read, 110, GET),
            KernelEvent::ProcessExec {
                pid: 7,
                timestamp_ns: 500,
                comm: *b"python3\0\0\0\0\0\0\0\0\0",
            },
            // The new program's connection on a reused fd is a new connection.
            open(5, 600, Role::Server),
            data(5, 600, Direction::Read, 610, GET),
            data(5, 600, Direction::Write, 620, OK),
        ]);
        assert_eq!(
            untracked(&actions),
            [5, 6],
            "the kernel forgets the closed sockets"
        );
        assert_eq!(exchanges.len(), 2);
        assert_eq!(
            (exchanges[0].outcome.clone(), exchanges[0].end_ns),
            (Outcome::Aborted(AbortReason::ProcessExec), 500)
        );
        assert!(matches!(exchanges[1].outcome, Outcome::Response(_)));
    }

    #[test]
    fn non_http_connections_are_untracked() {
        let (exchanges, stats, actions) = run(&[
            open(5, 100, Role::Server),
            data(5, 100, Direction::Read, 110, b"\x00\x01binary"),
            data(5, 100, Direction::Write, 111, b"\x00\x02binary"),
            data(5, 100, Direction::Read, 112, b"*1\r\n$4\r\nPING\r\n"),
            data(5, 100, Direction::Read, 113, b"GETX nonsense"),
            // A desynchronised stream only errs again once something looks like a start.
            data(5, 100, Direction::Read, 114, b"GET \x00\x00\x00\r\n\r\n"),
        ]);
        assert!(exchanges.is_empty());
        assert_eq!(stats.connections_not_http, 1);
        assert_eq!(
            actions,
            vec![TableAction::Untrack {
                id: SocketId { pid: 7, fd: 5 },
                conn_id: 100,
                not_http: true,
            }]
        );
    }

    fn untracked(actions: &[TableAction]) -> Vec<i32> {
        let mut fds: Vec<i32> = actions
            .iter()
            .filter_map(|action| match action {
                TableAction::Untrack { id, .. } => Some(id.fd),
                _ => None,
            })
            .collect();
        fds.sort_unstable();
        fds
    }

    #[test]
    fn a_full_table_evicts_the_least_recently_active_connections() {
        let mut events = Vec::new();
        for fd in 0..16 {
            events.push(open(fd, 1000 + fd as u64, Role::Server));
        }
        // fd 0 opened first but is the one in use: it must survive.
        events.push(data(0, 1000, Direction::Read, 2000, GET));
        events.push(data(0, 1000, Direction::Write, 2001, OK));
        for fd in 16..20 {
            events.push(open(fd, 3000 + fd as u64, Role::Server));
        }
        events.push(data(0, 1000, Direction::Read, 4000, GET));
        events.push(data(0, 1000, Direction::Write, 4001, OK));
        let (exchanges, stats, actions) = run(&events);
        assert_eq!(stats.connections_evicted, 4);
        assert_eq!(stats.connections_dropped, 0);
        assert_eq!(
            stats.connections_tracked_peak, 16,
            "full, never past the bound"
        );
        assert_eq!(untracked(&actions), [1, 2, 3, 4]);
        assert_eq!(exchanges.len(), 2, "the healthy connection kept its state");
        assert!(
            exchanges
                .iter()
                .all(|e| matches!(e.outcome, Outcome::Response(_)))
        );
    }

    #[test]
    fn idle_connections_are_evicted_before_ones_waiting_on_a_response() {
        let mut events = vec![open(0, 100, Role::Server)];
        // A slow request: its connection is silent longer than any other, but not abandoned.
        events.push(data(0, 100, Direction::Read, 101, GET));
        for fd in 1..16 {
            events.push(open(fd, 200 + fd as u64, Role::Server));
        }
        events.push(open(16, 300, Role::Server));
        events.push(data(0, 100, Direction::Write, 400, OK));
        let (exchanges, stats, actions) = run(&events);
        assert_eq!(untracked(&actions), [1]);
        assert_eq!(stats.requests_evicted, 0);
        assert_eq!(exchanges.len(), 1);
        assert!(matches!(exchanges[0].outcome, Outcome::Response(_)));
    }

    #[test]
    fn requests_of_an_evicted_connection_end_as_evicted() {
        let mut events = Vec::new();
        for fd in 0..16 {
            events.push(open(fd, 100 + fd as u64, Role::Server));
            events.push(data(
                fd,
                100 + fd as u64,
                Direction::Read,
                200 + fd as u64,
                GET,
            ));
        }
        events.push(open(16, 300, Role::Server));
        let (exchanges, stats, actions) = run(&events);
        assert_eq!(untracked(&actions), [0]);
        assert_eq!(stats.requests_evicted, 1);
        assert_eq!(exchanges.len(), 1);
        assert_eq!(exchanges[0].outcome, Outcome::Aborted(AbortReason::Evicted));
        assert_eq!(AbortReason::Evicted.as_error_type(), "tracer_evicted");
    }

    #[test]
    fn a_flood_of_opens_keeps_the_table_at_its_bound() {
        let mut table = ConnectionTable::new(100);
        let (mut exchanges, mut actions) = (Vec::new(), Vec::new());
        for fd in 0..10_000 {
            table.apply(
                &open(fd, 10 + fd as u64, Role::Server),
                &mut exchanges,
                &mut actions,
            );
            assert!(table.open_connections() <= 100);
        }
        assert_eq!(table.counters.connections_evicted, 9_900);
        assert_eq!(actions.len(), 9_900);
    }

    #[test]
    fn partial_heads_on_many_connections_are_bounded_in_bytes() {
        let mut table = ConnectionTable::new(16).with_max_buffered_bytes(10_000);
        let (mut exchanges, mut actions) = (Vec::new(), Vec::new());
        let partial: &'static [u8] = format!("GET / HTTP/1.1\r\nX-Slow: {}", "a".repeat(4000))
            .leak()
            .as_bytes();
        for fd in 0..6 {
            let conn_id = 100 + fd as u64;
            for event in [
                open(fd, conn_id, Role::Server),
                data(fd, conn_id, Direction::Read, 200 + fd as u64, partial),
            ] {
                table.apply(&event, &mut exchanges, &mut actions);
            }
            assert!(table.buffered_bytes <= 10_000, "{}", table.buffered_bytes);
        }
        assert_eq!(table.counters.connections_evicted_for_memory, 4);
        assert_eq!(untracked(&actions), [0, 1, 2, 3], "the stalest go first");
        let close = KernelEvent::Close {
            pid: 7,
            fd: 5,
            conn_id: 105,
            timestamp_ns: 300,
        };
        table.apply(&close, &mut exchanges, &mut actions);
        assert!(
            table.buffered_bytes < 5_000,
            "a closed connection gives its bytes back"
        );
    }

    #[test]
    fn pipelined_heads_are_bounded_in_bytes() {
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(10_000));
        let pipelined: &'static [u8] = long.repeat(10).leak().as_bytes();
        let (exchanges, stats, _) = run(&[
            open(5, 100, Role::Server),
            data(5, 100, Direction::Read, 110, pipelined),
        ]);
        // Six heads of ~10 KB fit in MAX_IN_FLIGHT_HEAD_BYTES; the oldest four are given up.
        assert_eq!(stats.requests_dropped_overflow, 4);
        assert_eq!(exchanges.len(), 4);
        assert!(
            exchanges
                .iter()
                .all(|e| e.outcome == Outcome::Aborted(AbortReason::Overflow))
        );
    }

    #[test]
    fn a_response_cut_off_in_its_body_keeps_its_status() {
        const PARTIAL: &[u8] =
            b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 100\r\n\r\n{\"detail\"";
        let (exchanges, _, _) = run(&[
            open(5, 100, Role::Client),
            data(
                5,
                100,
                Direction::Write,
                10,
                b"POST /verify HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            ),
            data(5, 100, Direction::Read, 20, PARTIAL),
            KernelEvent::Close {
                pid: 7,
                fd: 5,
                conn_id: 100,
                timestamp_ns: 30,
            },
        ]);
        assert_eq!(exchanges.len(), 1);
        assert!(matches!(
            &exchanges[0].outcome,
            Outcome::Response(response) if response.status == 500
        ));
        assert_eq!(exchanges[0].end_ns, 30);
    }

    /// The Codex CLI's model call, as both ends see it: the client reads the last event and
    /// closes; the server, its loop saturated, closes seconds later without the closing chunk.
    /// Both exchanges end with the stream's last data.
    #[test]
    fn a_streamed_answer_ends_with_its_last_event_on_both_ends() {
        const REQUEST: &[u8] = b"POST /v1/responses HTTP/1.1\r\ncontent-length: 0\r\n\r\n";
        const HEAD_AND_FIRST: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
transfer-encoding: chunked\r\n\r\n10\r\ndata: created\n\n\r\n";
        const LAST: &[u8] = b"12\r\ndata: completed\n\n\r\n";
        for (role, response) in [
            (Role::Client, Direction::Read),
            (Role::Server, Direction::Write),
        ] {
            let request = match role {
                Role::Client => Direction::Write,
                Role::Server => Direction::Read,
            };
            let (exchanges, _, _) = run(&[
                open(5, 100, role),
                data(5, 100, request, 10, REQUEST),
                data(5, 100, response, 20, HEAD_AND_FIRST),
                data(5, 100, response, 30, LAST),
                KernelEvent::Close {
                    pid: 7,
                    fd: 5,
                    conn_id: 100,
                    timestamp_ns: 3_000,
                },
            ]);
            assert_eq!(exchanges.len(), 1, "{role:?}");
            assert!(matches!(&exchanges[0].outcome, Outcome::Response(r) if r.status == 200));
            assert_eq!(exchanges[0].end_ns, 30, "{role:?}");
            assert_eq!(
                exchanges[0].stream,
                Some(StreamTimes {
                    first_data_ns: 20,
                    last_data_ns: 30
                })
            );
        }
    }

    #[test]
    fn responses_in_one_write_each_answer_their_own_request() {
        // Pipelined GET, HEAD, GET answered in one write: the HEAD's response has a
        // content-length but no body, which only the request it answers can tell.
        const TWO_GETS_AND_A_HEAD: &[u8] =
            b"GET /a HTTP/1.1\r\n\r\nHEAD /b HTTP/1.1\r\n\r\nGET /c HTTP/1.1\r\n\r\n";
        const THREE_RESPONSES: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok\
            HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n\
            HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
        let (exchanges, stats, _) = run(&[
            open(5, 100, Role::Server),
            data(5, 100, Direction::Read, 110, TWO_GETS_AND_A_HEAD),
            data(5, 100, Direction::Write, 120, THREE_RESPONSES),
        ]);
        let statuses: Vec<_> = exchanges
            .iter()
            .map(|e| match &e.outcome {
                Outcome::Response(response) => (e.request.path.as_str(), response.status),
                Outcome::Aborted(_) => (e.request.path.as_str(), 0),
            })
            .collect();
        assert_eq!(statuses, [("/a", 200), ("/b", 200), ("/c", 404)]);
        assert_eq!(stats.parse_not_http, 0);
    }
}

#[cfg(test)]
mod evidence_tests {
    use super::*;
    use crate::kernel::events::TaskContext;
    use crate::model::context::ContextChain;
    use crate::model::evidence::{TokenKind, cookie_tokens};
    use std::net::{IpAddr, Ipv4Addr};

    fn open(role: Role) -> KernelEvent<'static> {
        KernelEvent::Open(ConnOpen {
            pid: 7,
            fd: 5,
            conn_id: 100,
            timestamp_ns: 100,
            role,
            local: Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 40000)),
            peer: Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000)),
        })
    }

    fn transfer<'a>(
        direction: Direction,
        captured: &'a [u8],
        total_len: u64,
        tail: &'a [u8],
    ) -> KernelEvent<'a> {
        KernelEvent::Data(DataTransfer {
            pid: 7,
            tid: 7,
            fd: 5,
            conn_id: 100,
            timestamp_ns: 200,
            direction,
            captured,
            total_len,
            tail,
            seq: None,
        })
    }

    fn context(links: &[u64]) -> KernelEvent<'static> {
        KernelEvent::TaskContext(TaskContext {
            pid: 7,
            tid: 7,
            fd: 5,
            conn_id: 100,
            timestamp_ns: 150,
            writer: WriterTask {
                chain: ContextChain::new(links),
                lineage: None,
            },
        })
    }

    fn apply(events: &[KernelEvent<'_>]) -> (Vec<TableAction>, ReassemblyCounters) {
        let mut table = ConnectionTable::new(16);
        let (mut exchanges, mut actions) = (Vec::new(), Vec::new());
        for event in events {
            table.apply(event, &mut exchanges, &mut actions);
        }
        (actions, table.counters)
    }

    /// A TLS connection: its ciphertext is no HTTP (and no parse error), its plaintext is; the
    /// model call it carries is an `https` exchange with its model and token counts.
    #[test]
    fn a_tls_connection_is_parsed_from_its_plaintext_only() {
        let mut table = ConnectionTable::new(16);
        let (mut exchanges, mut actions) = (Vec::new(), Vec::new());
        table.apply(&open(Role::Client), &mut exchanges, &mut actions);
        let client_hello = transfer(Direction::Write, b"\x16\x03\x01\x02\x00\x01", 517, b"");
        let KernelEvent::Data(hello) = &client_hello else {
            unreachable!()
        };
        table.apply(
            &KernelEvent::Data(hello.clone()),
            &mut exchanges,
            &mut actions,
        );
        assert!(table.take_ciphertext());
        assert_eq!(table.tls_opened, [7]);
        let body = br#"{"input":"hi","model":"m-1"}"#;
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nContent-Length: {}\r\n\r\n{}",
            body.len(),
            String::from_utf8_lossy(body)
        );
        let KernelEvent::Data(request) = transfer(
            Direction::Write,
            request.as_bytes(),
            request.len() as u64,
            b"",
        ) else {
            unreachable!()
        };
        table.apply_plaintext(&request, &mut exchanges, &mut actions);
        let response_body = br#"{"id":"c","model":"m-1-0301","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#;
        let response = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{}",
            response_body.len(),
            String::from_utf8_lossy(response_body)
        );
        // The ciphertext of the response comes first, then its plaintext.
        let records = transfer(Direction::Read, b"\x17\x03\x03\x00\xff", 300, b"");
        let KernelEvent::Data(records) = &records else {
            unreachable!()
        };
        table.apply(
            &KernelEvent::Data(records.clone()),
            &mut exchanges,
            &mut actions,
        );
        assert!(table.take_ciphertext());
        let KernelEvent::Data(response) = transfer(
            Direction::Read,
            response.as_bytes(),
            response.len() as u64,
            b"",
        ) else {
            unreachable!()
        };
        table.apply_plaintext(&response, &mut exchanges, &mut actions);
        assert_eq!(table.counters.parse_errors(), 0);
        let [exchange] = exchanges.as_slice() else {
            panic!("{exchanges:?}")
        };
        assert!(exchange.tls);
        let call = exchange.model_call.as_deref().expect("a model call");
        assert_eq!(call.request_model.as_deref(), Some("m-1"));
        assert_eq!(call.response_model.as_deref(), Some("m-1-0301"));
        assert_eq!(
            (call.usage.input_tokens, call.usage.output_tokens),
            (Some(3), Some(4))
        );
    }

    /// A call whose 11 KB body is captured only in its first 4 KiB: its cookie and task
    /// context come with its start, its rollout id from the tail of the write.
    #[test]
    fn a_calls_start_carries_its_context_and_cookies_and_its_tail_names_the_rollout() {
        let body_end = br#"x", "_ng_task_index": 3, "_ng_rollout_index": 1}"#;
        let head = b"POST /seed_session HTTP/1.1\r\nCookie: session=eyJzZXNzaW9u.Z1x2.sig\r\nContent-Length: 11000\r\n\r\n{\"input\": \"xxxx";
        let total = (head.len() - 15 + 11000) as u64;
        let (actions, counters) = apply(&[
            open(Role::Client),
            context(&[3, 2, 1]),
            transfer(Direction::Write, head, total, body_end),
        ]);
        let [
            TableAction::Started(start),
            TableAction::RolloutFromBody {
                span_id,
                rollout_id,
            },
        ] = actions.as_slice()
        else {
            panic!("{actions:?}")
        };
        assert_eq!(start.context, ContextChain::new(&[3, 2, 1]));
        assert_eq!(
            start.session_tokens,
            cookie_tokens(b"session=eyJzZXNzaW9u.Z1x2.sig")
        );
        assert_eq!((*span_id, rollout_id.as_str()), (start.span_id, "3-1"));
        assert_eq!(counters.task_contexts_unused, 0);
    }

    /// The context is the write's it precedes: a read in between, or a second context before
    /// the write, leaves the earlier one unused (counted), never moved to another message.
    #[test]
    fn a_context_belongs_to_the_next_write_only() {
        let request = b"POST /v1/responses HTTP/1.1\r\nContent-Length: 0\r\n\r\n";
        let (actions, counters) = apply(&[
            open(Role::Client),
            context(&[9, 1]),
            context(&[3, 2, 1]),
            transfer(Direction::Write, request, request.len() as u64, &[]),
            context(&[4, 1]),
            transfer(
                Direction::Read,
                b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
                38,
                &[],
            ),
            transfer(Direction::Write, request, request.len() as u64, &[]),
        ]);
        let starts: Vec<Option<ContextChain>> = actions
            .iter()
            .filter_map(|a| match a {
                TableAction::Started(start) => Some(start.context),
                _ => None,
            })
            .collect();
        assert_eq!(starts, [ContextChain::new(&[3, 2, 1]), None]);
        assert_eq!(
            counters.task_contexts_unused, 2,
            "one overwritten, one before a read"
        );
    }

    /// A server's response: the context it is written under, and the id its body starts with.
    #[test]
    fn a_response_reports_its_context_and_its_echoed_id() {
        let (actions, _) = apply(&[
            open(Role::Server),
            transfer(
                Direction::Read,
                b"POST /v1/responses HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
                51,
                &[],
            ),
            context(&[5, 1]),
            transfer(
                Direction::Write,
                b"HTTP/1.1 200 OK\r\ncontent-length: 36\r\n\r\n",
                39,
                &[],
            ),
            transfer(
                Direction::Write,
                br#"{"id":"resp_0123456789","status":1}"#,
                36,
                &[],
            ),
        ]);
        let [
            TableAction::Started(start),
            TableAction::ResponseWriter { span_id, writer },
            TableAction::ResponseId {
                span_id: answered,
                token,
            },
        ] = actions.as_slice()
        else {
            panic!("{actions:?}")
        };
        assert_eq!((*span_id, *answered), (start.span_id, start.span_id));
        assert_eq!(writer.chain, ContextChain::new(&[5, 1]));
        assert_eq!(*token, Token::of(TokenKind::ResponseId, b"resp_0123456789"));
    }
}
