//! One HTTP request and its outcome, as reassembly hands it on: who sent it (process, role,
//! addresses), its head, and how it ended.

use std::net::SocketAddr;

use crate::gym::rollout_id::RolloutId;

use super::context::{ContextChain, Lineage};
use super::evidence::Token;
use super::genai::{GenAiOperation, TokenUsage};

use super::ids::SpanId;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The traced process accepted the connection.
    Server,
    /// The traced process connected out.
    Client,
}

/// The parts of a request head the tracer uses. Bodies are never kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    /// Path without the query string: queries can carry secrets and are never exported.
    pub path: String,
    pub version_minor: u8,
    pub host: Option<String>,
    pub user_agent: Option<String>,
    pub traceparent: Option<String>,
    pub expects_continue: bool,
    /// Session tokens of its `Cookie` headers and its session token header (hashes, see
    /// [`Token`]): evidence of which request a call belongs to, never exported.
    pub session_tokens: Vec<Token>,
    /// The head did not fit in the capture: some headers may be missing.
    pub truncated: bool,
}

impl RequestHead {
    /// Bytes it holds on the heap, for the per-connection bound on requests in flight.
    pub fn heap_bytes(&self) -> usize {
        let optional = |value: &Option<String>| value.as_ref().map_or(0, String::len);
        self.method.len()
            + self.path.len()
            + optional(&self.host)
            + optional(&self.user_agent)
            + optional(&self.traceparent)
            + self.session_tokens.len() * size_of::<Token>()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResponseHead {
    pub status: u16,
    pub version_minor: u8,
    /// Tokens of the signed session cookies its `Set-Cookie` headers set (hashes, see
    /// [`Token`]): a later request that carries one belongs to the same session. Never
    /// exported.
    pub sessions_set: Vec<Token>,
}

/// A connection in one traced process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SocketId {
    pub pid: u32,
    pub fd: i32,
}

/// Why an exchange ended without a response.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AbortReason {
    /// The connection closed before the response was complete.
    ConnectionClosed,
    /// The traced process exited.
    ProcessExited,
    /// The traced process replaced its program (`execve`), closing its sockets.
    ProcessExec,
    /// Too many requests were in flight on the connection.
    Overflow,
    /// The connection table was full and this connection was the least recently active.
    Evicted,
}

impl AbortReason {
    /// The `error.type` value exported for it.
    pub fn as_error_type(self) -> &'static str {
        match self {
            AbortReason::ConnectionClosed => "connection_closed",
            AbortReason::ProcessExited => "process_exited",
            AbortReason::ProcessExec => "process_exec",
            AbortReason::Overflow => "tracer_overflow",
            AbortReason::Evicted => "tracer_evicted",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Response(ResponseHead),
    Aborted(AbortReason),
}

/// One request and what became of it: the unit from which spans and metrics are built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpExchange {
    pub pid: u32,
    pub role: Role,
    pub local: Option<SocketAddr>,
    pub peer: Option<SocketAddr>,
    pub request: RequestHead,
    pub outcome: Outcome,
    /// Monotonic ns when the request's first byte moved.
    pub start_ns: u64,
    /// Monotonic ns when the response's last byte moved (or the abort was seen); for an event
    /// stream, when its last data moved (see [`StreamTimes`]).
    pub end_ns: u64,
    /// For a response that streamed server-sent events: when its data moved.
    pub stream: Option<StreamTimes>,
    /// The rollout id named by the request body, for requests whose body was kept (see
    /// [`ConnectionTable::new`]).
    pub run_rollout_id: Option<RolloutId>,
    /// Given when the request started (see [`TableAction::Started`]).
    pub span_id: SpanId,
    /// It went over TLS (its plaintext came from the uprobes on the TLS library).
    pub tls: bool,
    /// For a call to an OpenAI-compatible endpoint: its model and token counts.
    pub model_call: Option<Box<ModelCall>>,
}

/// When the data of a streamed answer (`text/event-stream`) moved, on one end of its
/// connection: the stream ends with its last event, not with the chunk that closes it, which
/// a saturated server writes seconds later, after the client that read the last event has
/// gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamTimes {
    /// Monotonic ns of the first transfer that carried some of its data.
    pub first_data_ns: u64,
    /// Monotonic ns of the last one.
    pub last_data_ns: u64,
}

/// A TLS connection that ended without a request the tracer could read (its process's TLS
/// library is not probed, or its plaintext never found it): what the syscalls showed of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpaqueTls {
    pub pid: u32,
    pub role: Role,
    pub local: Option<SocketAddr>,
    pub peer: Option<SocketAddr>,
    pub opened_ns: u64,
    pub ended_ns: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
}

/// What a call to an OpenAI-compatible endpoint says about its model and tokens, read from
/// the few body fields that name them (see [`super::genai`]); nothing else of the bodies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelCall {
    pub operation: GenAiOperation,
    pub request_model: Option<String>,
    pub response_model: Option<String>,
    pub usage: TokenUsage,
}

impl ModelCall {
    pub fn new(operation: GenAiOperation) -> Self {
        Self {
            operation,
            request_model: None,
            response_model: None,
            usage: TokenUsage::default(),
        }
    }
}

/// A request whose head was just seen. Its span id exists from now on, so that the calls it
/// makes and the server that receives it can refer to it before it ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestStart {
    pub pid: u32,
    pub role: Role,
    pub local: Option<SocketAddr>,
    pub peer: Option<SocketAddr>,
    /// Which request of its connection this is (0 for the first): the client and the server
    /// of one connection count the same requests in the same order.
    pub sequence: u64,
    /// The TCP sequence number of the request's first byte, when the kernel read it: the
    /// client's and the server's are equal, on any host, whatever NAT did to the addresses.
    pub tcp_seq: Option<u32>,
    pub span_id: SpanId,
    pub method: String,
    pub path: String,
    pub traceparent: Option<String>,
    /// The request's session tokens (see [`RequestHead::session_tokens`]).
    pub session_tokens: Vec<Token>,
    /// For a call (client role): the Python task context its first write ran under, when
    /// the kernel could read it.
    pub context: Option<ContextChain>,
    /// For a call: its writing task's lineage, in a process whose task creations are probed.
    pub lineage: Option<Lineage>,
    /// For an inbound request on a plaintext connection: where its response will be
    /// written, as the kernel names it.
    pub inbound_socket: Option<InboundSocket>,
}

/// The connection an inbound request arrived on, and how many requests came before it on
/// that connection: its response is the connection's next after theirs, so the kernel can
/// tell by counting responses whether it has been answered (`tracer_abi::InjectTrace`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct InboundSocket {
    pub fd: i32,
    /// The kernel's id of the connection (its open time), so a reused fd is told apart.
    pub conn_id: u64,
    pub requests_before: u32,
}
