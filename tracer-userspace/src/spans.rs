//! Spans built from HTTP exchanges: names, kinds, ids, timing and OTel HTTP semantic-convention
//! attributes. The exporters turn a [`SpanRecord`] into JSON lines or OTLP.

use std::sync::Arc;

use rand::Rng;

use crate::clock::WallClock;
use crate::connections::{HttpExchange, Outcome};
use crate::events::Role;
use crate::identity::ServiceIdentity;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Server,
    #[expect(
        dead_code,
        reason = "CLIENT spans are built from client exchanges in [stitching]"
    )]
    Client,
    #[expect(dead_code, reason = "gym.* INTERNAL spans come with [gym-semantics]")]
    Internal,
}

impl SpanKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SpanKind::Server => "SERVER",
            SpanKind::Client => "CLIENT",
            SpanKind::Internal => "INTERNAL",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanStatus {
    Unset,
    Error,
}

impl SpanStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            SpanStatus::Unset => "UNSET",
            SpanStatus::Error => "ERROR",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum AttributeValue {
    Str(String),
    Int(i64),
}

pub type Attributes = Vec<(&'static str, AttributeValue)>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SpanId(pub [u8; 8]);

impl TraceId {
    pub fn random() -> Self {
        loop {
            let id: [u8; 16] = rand::rng().random();
            if id != [0; 16] {
                return Self(id);
            }
        }
    }
}

impl SpanId {
    pub fn random() -> Self {
        loop {
            let id: [u8; 8] = rand::rng().random();
            if id != [0; 8] {
                return Self(id);
            }
        }
    }
}

/// A finished span: it has an end time by construction.
#[derive(Clone, Debug)]
pub struct SpanRecord {
    pub service: Arc<ServiceIdentity>,
    pub name: String,
    pub kind: SpanKind,
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub parent_span_id: Option<SpanId>,
    /// The parent came from an inbound `traceparent` header (another process's span).
    pub parent_is_remote: bool,
    pub start_unix_ns: u64,
    pub end_unix_ns: u64,
    pub attributes: Attributes,
    pub status: SpanStatus,
}

/// A W3C `traceparent` header: `00-<trace-id>-<parent-id>-<flags>`.
pub fn parse_traceparent(value: &str) -> Option<(TraceId, SpanId)> {
    let mut parts = value.trim().split('-');
    let version = parts.next()?;
    let trace = parts.next()?;
    let parent = parts.next()?;
    let flags = parts.next()?;
    let mut version_byte = [0u8; 1];
    decode_hex(version, &mut version_byte)?;
    if version.len() != 2
        || version == "ff"
        || trace.len() != 32
        || parent.len() != 16
        || flags.len() != 2
    {
        return None;
    }
    let mut trace_id = [0u8; 16];
    let mut span_id = [0u8; 8];
    decode_hex(trace, &mut trace_id)?;
    decode_hex(parent, &mut span_id)?;
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some((TraceId(trace_id), SpanId(span_id)))
}

fn decode_hex(text: &str, out: &mut [u8]) -> Option<()> {
    let bytes = text.as_bytes();
    if bytes.len() != out.len() * 2 {
        return None;
    }
    for (i, byte) in out.iter_mut().enumerate() {
        let high = (bytes[2 * i] as char).to_digit(16)?;
        let low = (bytes[2 * i + 1] as char).to_digit(16)?;
        *byte = (high * 16 + low) as u8;
    }
    Some(())
}

/// The SERVER span of an inbound request. Client exchanges are not turned into spans yet.
pub fn server_span(
    exchange: &HttpExchange,
    service: &Arc<ServiceIdentity>,
    clock: WallClock,
) -> Option<SpanRecord> {
    if exchange.role != Role::Server {
        return None;
    }
    let request = &exchange.request;
    let mut attributes: Attributes = vec![
        (
            "http.request.method",
            AttributeValue::Str(request.method.clone()),
        ),
        ("url.path", AttributeValue::Str(request.path.clone())),
        ("url.scheme", AttributeValue::Str("http".into())),
        (
            "network.protocol.version",
            AttributeValue::Str(format!("1.{}", request.version_minor)),
        ),
    ];
    // server.address is the host the client asked for (the Host header), else the local
    // address the connection arrived on.
    let (host, port) = match request.host.as_deref().map(split_host_port) {
        Some((host, port)) => (
            Some(host.to_string()),
            port.or(exchange.local.map(|a| a.port())),
        ),
        None => (
            exchange.local.map(|a| a.ip().to_string()),
            exchange.local.map(|a| a.port()),
        ),
    };
    if let Some(host) = host {
        attributes.push(("server.address", AttributeValue::Str(host)));
    }
    if let Some(port) = port {
        attributes.push(("server.port", AttributeValue::Int(port as i64)));
    }
    if let Some(peer) = exchange.peer {
        attributes.push(("client.address", AttributeValue::Str(peer.ip().to_string())));
        attributes.push(("network.peer.port", AttributeValue::Int(peer.port() as i64)));
    }
    if let Some(agent) = &request.user_agent {
        attributes.push(("user_agent.original", AttributeValue::Str(agent.clone())));
    }
    let status = match &exchange.outcome {
        Outcome::Response(response) => {
            attributes.push((
                "http.response.status_code",
                AttributeValue::Int(response.status as i64),
            ));
            if response.status >= 500 {
                attributes.push((
                    "error.type",
                    AttributeValue::Str(response.status.to_string()),
                ));
                SpanStatus::Error
            } else {
                SpanStatus::Unset
            }
        }
        Outcome::Aborted(reason) => {
            attributes.push((
                "error.type",
                AttributeValue::Str(reason.as_error_type().into()),
            ));
            SpanStatus::Error
        }
    };
    let parent = request.traceparent.as_deref().and_then(parse_traceparent);
    Some(SpanRecord {
        service: service.clone(),
        name: format!("{} {}", request.method, request.path),
        kind: SpanKind::Server,
        trace_id: parent
            .map(|(trace, _)| trace)
            .unwrap_or_else(TraceId::random),
        span_id: SpanId::random(),
        parent_span_id: parent.map(|(_, span)| span),
        parent_is_remote: parent.is_some(),
        start_unix_ns: clock.to_unix_ns(exchange.start_ns),
        end_unix_ns: clock.to_unix_ns(exchange.end_ns),
        attributes,
        status,
    })
}

/// `host:port`, `[v6]:port` or a bare host.
fn split_host_port(value: &str) -> (&str, Option<u16>) {
    if let Some(rest) = value.strip_prefix('[')
        && let Some((host, tail)) = rest.split_once(']')
    {
        return (host, tail.strip_prefix(':').and_then(|p| p.parse().ok()));
    }
    match value.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => (host, port.parse().ok()),
        _ => (value, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connections::AbortReason;
    use crate::http::{RequestHead, ResponseHead};

    fn exchange(outcome: Outcome, traceparent: Option<&str>) -> HttpExchange {
        HttpExchange {
            pid: 1,
            role: Role::Server,
            local: Some("127.0.0.1:8000".parse().unwrap()),
            peer: Some("127.0.0.1:50000".parse().unwrap()),
            request: RequestHead {
                method: "POST".into(),
                path: "/verify".into(),
                version_minor: 1,
                host: Some("localhost:8000".into()),
                user_agent: Some("ua".into()),
                traceparent: traceparent.map(String::from),
                expects_continue: false,
                truncated: false,
            },
            outcome,
            start_ns: 1_000,
            end_ns: 5_000,
        }
    }

    fn attr<'a>(span: &'a SpanRecord, key: &str) -> Option<&'a AttributeValue> {
        span.attributes
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
    }

    #[test]
    fn server_span_has_semconv_attributes_and_adopts_traceparent() {
        let service = Arc::new(ServiceIdentity::for_test("svc"));
        let clock = WallClock::measure();
        let ok = Outcome::Response(ResponseHead {
            status: 200,
            version_minor: 1,
        });
        let span = server_span(
            &exchange(
                ok,
                Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            ),
            &service,
            clock,
        )
        .unwrap();
        assert_eq!(span.name, "POST /verify");
        assert_eq!(span.kind, SpanKind::Server);
        assert_eq!(span.status, SpanStatus::Unset);
        assert_eq!(span.end_unix_ns - span.start_unix_ns, 4_000);
        assert_eq!(
            attr(&span, "server.address"),
            Some(&AttributeValue::Str("localhost".into()))
        );
        assert_eq!(attr(&span, "server.port"), Some(&AttributeValue::Int(8000)));
        assert_eq!(
            attr(&span, "client.address"),
            Some(&AttributeValue::Str("127.0.0.1".into()))
        );
        assert_eq!(
            attr(&span, "http.response.status_code"),
            Some(&AttributeValue::Int(200))
        );
        assert!(
            attr(&span, "http.route").is_none(),
            "no route template is known yet"
        );
        assert_eq!(span.trace_id.0[0], 0x0a);
        assert_eq!(
            span.parent_span_id,
            Some(SpanId([0xb7, 0xad, 0x6b, 0x71, 0x69, 0x20, 0x33, 0x31]))
        );
    }

    #[test]
    fn server_errors_and_aborts_are_errors() {
        let service = Arc::new(ServiceIdentity::for_test("svc"));
        let clock = WallClock::measure();
        let failed = Outcome::Response(ResponseHead {
            status: 503,
            version_minor: 1,
        });
        assert_eq!(
            server_span(&exchange(failed, None), &service, clock)
                .unwrap()
                .status,
            SpanStatus::Error
        );
        let aborted = server_span(
            &exchange(Outcome::Aborted(AbortReason::ConnectionClosed), None),
            &service,
            clock,
        )
        .unwrap();
        assert_eq!(aborted.status, SpanStatus::Error);
        assert_eq!(
            attr(&aborted, "error.type"),
            Some(&AttributeValue::Str("connection_closed".into()))
        );
        assert!(aborted.parent_span_id.is_none());
    }

    #[test]
    fn traceparent_validation() {
        assert!(
            parse_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").is_some()
        );
        assert!(
            parse_traceparent("00-00000000000000000000000000000000-b7ad6b7169203331-01").is_none()
        );
        assert!(
            parse_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b71692033-01").is_none()
        );
        assert!(
            parse_traceparent("zz-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").is_none()
        );
        assert!(
            parse_traceparent("00-0af7651916cd43dd8448eb211c8031xx-b7ad6b7169203331-01").is_none()
        );
        assert!(parse_traceparent("garbage").is_none());
    }
}
