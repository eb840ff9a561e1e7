//! Builders of the messages between stages, for every stage's unit tests: one place that
//! knows how to make a plausible exchange, request start or span, so a test names only what
//! it is about.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::model::exchange::{
    HttpExchange, Outcome, RequestHead, RequestStart, ResponseHead, Role,
};
use crate::model::ids::SpanId;
use crate::model::service::ServiceIdentity;
use crate::model::span::{SpanKind, SpanRecord};

/// `127.0.0.1:port`.
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// An HTTP/1.1 request head with no optional headers.
pub fn request(method: &str, path: &str) -> RequestHead {
    RequestHead {
        method: method.into(),
        path: path.into(),
        version_minor: 1,
        host: None,
        user_agent: None,
        traceparent: None,
        expects_continue: false,
        session_tokens: Vec::new(),
        truncated: false,
    }
}

/// An HTTP/1.1 response with this status.
pub fn response(status: u16) -> Outcome {
    Outcome::Response(ResponseHead {
        status,
        version_minor: 1,
        sessions_set: Vec::new(),
    })
}

/// A finished exchange of process `pid`, between 1 µs and 5 µs, on 127.0.0.1:8000 (the
/// server's side) ↔ 127.0.0.1:50000 (the client's).
pub fn exchange(pid: u32, role: Role, request: RequestHead, outcome: Outcome) -> HttpExchange {
    let (local, peer) = match role {
        Role::Server => (loopback(8000), loopback(50000)),
        Role::Client => (loopback(50000), loopback(8000)),
    };
    HttpExchange {
        pid,
        role,
        local: Some(local),
        peer: Some(peer),
        request,
        outcome,
        start_ns: 1_000,
        end_ns: 5_000,
        run_rollout_id: None,
        span_id: SpanId::random(),
        tls: false,
        model_call: None,
        stream: None,
    }
}

/// A request start on the connection 127.0.0.1:`local` ↔ 127.0.0.1:`peer`.
pub fn start(
    pid: u32,
    role: Role,
    (local, peer): (u16, u16),
    sequence: u64,
    method: &str,
    path: &str,
) -> RequestStart {
    RequestStart {
        pid,
        role,
        local: Some(loopback(local)),
        peer: Some(loopback(peer)),
        sequence,
        tcp_seq: None,
        span_id: SpanId::random(),
        method: method.into(),
        path: path.into(),
        traceparent: None,
        session_tokens: Vec::new(),
        context: None,
        lineage: None,
        inbound_socket: None,
    }
}

/// A span of service `svc` with no attributes, parent or trace id yet.
pub fn span(name: &str, kind: SpanKind, span_id: SpanId) -> SpanRecord {
    SpanRecord::bare(Arc::new(ServiceIdentity::named("svc")), name, kind, span_id)
}
