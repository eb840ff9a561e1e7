//! Spans built from HTTP exchanges: names, kinds, ids, timing and OTel HTTP semantic-convention
//! attributes. The exporters turn a [`SpanRecord`] into JSON lines or OTLP.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use crate::gym::ServerType;
use crate::gym::span_groups::{SpanGroup, SpanGroups};
use crate::model::attributes as attr;
use crate::model::exchange::Outcome;
use crate::model::exchange::RequestHead;
use crate::model::exchange::Role;
use crate::model::exchange::{HttpExchange, ModelCall, OpaqueTls};
use crate::model::genai::provider_name;
use crate::model::ids::{SpanId, TraceId, parse_traceparent};
use crate::model::service::ServiceIdentity;
use crate::model::span::{
    AttributeValue, Attributes, SpanFacts, SpanKind, SpanRecord, SpanStatus, Text,
};
use crate::signals::clock::WallClock;
use crate::signals::meaning::RequestMeaning;
use crate::signals::openinference::{self, OpenInferenceKind};
use crate::signals::outcome::http_outcome;

/// What the spans of one finished request are built from.
pub struct RequestView<'a> {
    pub exchange: &'a HttpExchange,
    pub service: &'a Arc<ServiceIdentity>,
    /// The Gym server type of the process, when known.
    pub server_type: Option<ServerType>,
    pub meaning: &'a RequestMeaning,
    /// The id the `gym.*` span was given when the request started (its calls already hang
    /// under it).
    pub semantic_span_id: Option<SpanId>,
    /// The Gym server a CLIENT span calls, when known.
    pub peer: Option<&'a Peer>,
}

/// A traced Gym server, as its callers reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// `peer.service`.
    pub name: String,
    pub server_type: Option<ServerType>,
}

/// The spans of one request, as the span groups allow: for an inbound request its SERVER span
/// and the `gym.*` INTERNAL span (its child, same timing) when the route is one Gym wraps; for
/// an outbound call its CLIENT span. Trace ids and parents are provisional (an inbound
/// `traceparent`, else none): the stitcher sets them.
pub fn request_spans(
    view: &RequestView<'_>,
    groups: SpanGroups,
    clock: WallClock,
    out: &mut Vec<SpanRecord>,
) {
    let first = out.len();
    build_spans(view, groups, clock, out);
    for span in &mut out[first..] {
        span.facts.server_type = view.server_type;
    }
}

fn build_spans(
    view: &RequestView<'_>,
    groups: SpanGroups,
    clock: WallClock,
    out: &mut Vec<SpanRecord>,
) {
    let RequestView {
        exchange,
        service,
        meaning,
        semantic_span_id,
        peer,
        ..
    } = *view;
    if exchange.role == Role::Client {
        if groups.contains(SpanGroup::HttpClient) {
            out.push(client_span(exchange, service, meaning, peer, clock));
        }
        return;
    }
    let server = server_span(exchange, service, meaning, clock);
    let semantic = meaning
        .semantic
        .filter(|semantic| groups.contains(semantic.group))
        .map(|semantic| SpanRecord {
            service: service.clone(),
            name: semantic.name.into(),
            kind: SpanKind::Internal,
            trace_id: server.trace_id,
            span_id: semantic_span_id.unwrap_or_else(SpanId::random),
            // Without the SERVER span, the semantic span hangs where it would have.
            parent_span_id: if groups.contains(SpanGroup::Server) {
                Some(server.span_id)
            } else {
                server.parent_span_id
            },
            parent_is_remote: !groups.contains(SpanGroup::Server) && server.parent_is_remote,
            start_unix_ns: server.start_unix_ns,
            end_unix_ns: server.end_unix_ns,
            attributes: {
                let mut attributes = Attributes::with_capacity(GYM_SPAN_ATTRIBUTES);
                gym_attributes(service, meaning, &mut attributes);
                attributes.extend(
                    OpenInferenceKind::of_group(semantic.group).map(OpenInferenceKind::attribute),
                );
                attributes
            },
            status: server.status,
            facts: SpanFacts {
                verify: semantic.group == SpanGroup::Verify,
                rollout_id: meaning.rollout_id.clone(),
                ..SpanFacts::default()
            },
        });
    if groups.contains(SpanGroup::Server) {
        out.push(server);
    }
    out.extend(semantic);
}

/// The CLIENT span of an outbound call, named `HTTP {method}` as Gym names it.
fn client_span(
    exchange: &HttpExchange,
    service: &Arc<ServiceIdentity>,
    meaning: &RequestMeaning,
    peer: Option<&Peer>,
    clock: WallClock,
) -> SpanRecord {
    let request = &exchange.request;
    let capacity = match exchange.model_call {
        Some(_) => SPAN_ATTRIBUTES_CAPACITY + MODEL_CALL_ATTRIBUTES,
        None => SPAN_ATTRIBUTES_CAPACITY,
    };
    let mut attributes = request_attributes(request, capacity);
    let scheme = url_scheme(exchange);
    attributes.push((attr::URL_SCHEME, AttributeValue::Str(scheme.into())));
    if let Some(peer) = exchange.peer {
        // The query string was never kept: `path` has none.
        attributes.push((
            attr::URL_FULL,
            AttributeValue::Str(url_full(scheme, peer, &request.path).into()),
        ));
        attributes.push((
            attr::SERVER_ADDRESS,
            AttributeValue::Str(ip_text(peer.ip())),
        ));
        attributes.push((attr::SERVER_PORT, AttributeValue::Int(peer.port() as i64)));
    }
    if let Some(peer) = peer {
        attributes.push((
            attr::PEER_SERVICE,
            AttributeValue::Str(peer.name.clone().into()),
        ));
    }
    let first_event = time_to_first_event(exchange);
    attributes.extend(
        first_event
            .clone()
            .map(|seconds| (attr::GYM_TRACER_TIME_TO_FIRST_EVENT, seconds)),
    );
    if let Some(call) = &exchange.model_call {
        model_call_attributes(call, request, &mut attributes);
        attributes.extend(
            first_event.map(|seconds| (attr::GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, seconds)),
        );
        // An agent's /v1/responses speaks the model API but runs a turn of the agent (its
        // gym.agent.* span is AGENT): calling it is calling the agent. (Without a kind, LLM
        // UIs would infer LLM from the gen_ai.* attributes.)
        let callee_is_agent = peer.is_some_and(|peer| peer.server_type == Some(ServerType::Agent));
        if callee_is_agent {
            attributes.push(OpenInferenceKind::Agent.attribute());
        } else {
            openinference::llm_attributes(call, &mut attributes);
        }
    }
    let status = outcome_attributes(&exchange.outcome, &mut attributes);
    if let Some(id) = &meaning.rollout_id {
        attributes.push((
            attr::GYM_ROLLOUT_ID,
            AttributeValue::Str(id.shared().into()),
        ));
    }
    let usage = exchange.model_call.as_ref().map(|call| call.usage);
    let tokens = |count: Option<u64>| count.map(|n| i64::try_from(n).unwrap_or(i64::MAX));
    let facts = SpanFacts {
        peer_traced: peer.is_some(),
        input_tokens: tokens(usage.and_then(|usage| usage.input_tokens)),
        output_tokens: tokens(usage.and_then(|usage| usage.output_tokens)),
        status_code: http_outcome(&exchange.outcome).status_code,
        rollout_id: meaning.rollout_id.clone(),
        ..SpanFacts::default()
    };
    SpanRecord {
        service: service.clone(),
        name: client_span_name(&request.method),
        kind: SpanKind::Client,
        trace_id: TraceId::random(),
        span_id: exchange.span_id,
        parent_span_id: None,
        parent_is_remote: false,
        start_unix_ns: clock.to_unix_ns(exchange.start_ns),
        end_unix_ns: clock.to_unix_ns(exchange.end_ns),
        attributes,
        status,
        facts,
    }
}

/// For a streamed answer, the seconds from the request's first byte to its first data.
fn time_to_first_event(exchange: &HttpExchange) -> Option<AttributeValue> {
    let stream = exchange.stream?;
    let nanos = stream.first_data_ns.saturating_sub(exchange.start_ns);
    Some(AttributeValue::Double(nanos as f64 / 1e9))
}

/// `HTTP {method}`, as Gym names a CLIENT span; shared for the registered methods.
pub(crate) fn client_span_name(method: &str) -> Text {
    const NAMES: [&str; 9] = [
        "HTTP GET",
        "HTTP POST",
        "HTTP PUT",
        "HTTP DELETE",
        "HTTP PATCH",
        "HTTP HEAD",
        "HTTP OPTIONS",
        "HTTP CONNECT",
        "HTTP TRACE",
    ];
    match NAMES
        .into_iter()
        .find(|name| name["HTTP ".len()..] == *method)
    {
        Some(name) => Text::Static(name),
        None => Text::Owned(format!("HTTP {method}")),
    }
}

/// The GenAI semantic conventions' attributes of a model call, where its bodies named them.
fn model_call_attributes(call: &ModelCall, request: &RequestHead, attributes: &mut Attributes) {
    let text = |value: &str| AttributeValue::Str(value.to_owned().into());
    attributes.push((
        attr::GEN_AI_OPERATION_NAME,
        AttributeValue::Str(call.operation.operation_name().into()),
    ));
    if let Some(provider) = request.host.as_deref().and_then(provider_name) {
        attributes.push((
            attr::GEN_AI_PROVIDER_NAME,
            AttributeValue::Str(provider.into()),
        ));
    }
    if let Some(model) = &call.request_model {
        attributes.push((attr::GEN_AI_REQUEST_MODEL, text(model)));
    }
    if let Some(model) = &call.response_model {
        attributes.push((attr::GEN_AI_RESPONSE_MODEL, text(model)));
    }
    let count = |tokens: u64| AttributeValue::Int(i64::try_from(tokens).unwrap_or(i64::MAX));
    if let Some(tokens) = call.usage.input_tokens {
        attributes.push((attr::GEN_AI_USAGE_INPUT_TOKENS, count(tokens)));
    }
    if let Some(tokens) = call.usage.output_tokens {
        attributes.push((attr::GEN_AI_USAGE_OUTPUT_TOKENS, count(tokens)));
    }
}

/// The span of a TLS connection whose requests could not be read (see [`OpaqueTls`]): named
/// `TLS`, CLIENT or SERVER by the process's end, from connect (or accept) to close, with the
/// addresses and the bytes of records each way. A root: nothing decides its parent.
pub fn opaque_tls_span(
    connection: &OpaqueTls,
    service: &Arc<ServiceIdentity>,
    clock: WallClock,
) -> SpanRecord {
    let mut attributes: Attributes = vec![
        (attr::NETWORK_TRANSPORT, AttributeValue::Str("tcp".into())),
        (attr::TLS_PROTOCOL_NAME, AttributeValue::Str("tls".into())),
    ];
    let (server, client) = match connection.role {
        Role::Client => (connection.peer, None),
        Role::Server => (connection.local, connection.peer),
    };
    if let Some(server) = server {
        attributes.push((
            attr::SERVER_ADDRESS,
            AttributeValue::Str(ip_text(server.ip())),
        ));
        attributes.push((
            attr::SERVER_PORT,
            AttributeValue::Int(i64::from(server.port())),
        ));
    }
    if let Some(client) = client {
        attributes.push((
            attr::CLIENT_ADDRESS,
            AttributeValue::Str(ip_text(client.ip())),
        ));
    }
    let bytes = |count: u64| AttributeValue::Int(i64::try_from(count).unwrap_or(i64::MAX));
    attributes.push((attr::GYM_TRACER_BYTES_SENT, bytes(connection.bytes_sent)));
    attributes.push((
        attr::GYM_TRACER_BYTES_RECEIVED,
        bytes(connection.bytes_received),
    ));
    SpanRecord {
        service: service.clone(),
        name: "TLS".into(),
        kind: match connection.role {
            Role::Client => SpanKind::Client,
            Role::Server => SpanKind::Server,
        },
        trace_id: TraceId::random(),
        span_id: SpanId::random(),
        parent_span_id: None,
        parent_is_remote: false,
        start_unix_ns: clock.to_unix_ns(connection.opened_ns),
        end_unix_ns: clock.to_unix_ns(connection.ended_ns),
        attributes,
        status: SpanStatus::Unset,
        facts: SpanFacts::default(),
    }
}

/// `https` for an exchange whose plaintext came from the TLS library.
pub fn url_scheme(exchange: &HttpExchange) -> &'static str {
    if exchange.tls { "https" } else { "http" }
}

/// What SERVER and CLIENT spans both say about the request.
/// `capacity`: room for the span's attributes, so that the list is allocated once.
fn request_attributes(request: &RequestHead, capacity: usize) -> Attributes {
    let mut attributes = Attributes::with_capacity(capacity);
    let method = match attr::registered_method(&request.method) {
        Some(known) => Text::Static(known),
        None => Text::Owned(request.method.clone()),
    };
    attributes.push((attr::HTTP_REQUEST_METHOD, AttributeValue::Str(method)));
    let version = match request.version_minor {
        0 => Text::Static("1.0"),
        1 => Text::Static("1.1"),
        minor => Text::Owned(format!("1.{minor}")),
    };
    attributes.push((attr::NETWORK_PROTOCOL_VERSION, AttributeValue::Str(version)));
    attributes
}

/// An address as `Display` writes it, without its cost (the formatter's padding support made
/// it 4 % of the agent's CPU): loopback borrowed, other IPv4 addresses written digit by digit.
fn ip_text(ip: IpAddr) -> Text {
    match ip {
        IpAddr::V4(v4) if v4 == Ipv4Addr::LOCALHOST => Text::Static("127.0.0.1"),
        IpAddr::V6(v6) if v6 == Ipv6Addr::LOCALHOST => Text::Static("::1"),
        IpAddr::V4(v4) => {
            let mut text = String::with_capacity(15);
            for (index, octet) in v4.octets().into_iter().enumerate() {
                if index > 0 {
                    text.push('.');
                }
                push_decimal(&mut text, octet.into());
            }
            Text::Owned(text)
        }
        IpAddr::V6(v6) => Text::Owned(v6.to_string()),
    }
}

/// Appends `value` in decimal (an octet or a port).
fn push_decimal(text: &mut String, value: u32) {
    if value >= 10 {
        push_decimal(text, value / 10);
    }
    text.push(char::from(b'0' + (value % 10) as u8));
}

/// `{scheme}://{address}{path}`, as `format!` with the address's `Display` would write it.
fn url_full(scheme: &str, address: SocketAddr, path: &str) -> String {
    if let SocketAddr::V6(v6) = address
        && v6.scope_id() != 0
    {
        return format!("{scheme}://{address}{path}");
    }
    let ip = ip_text(address.ip());
    let mut url = String::with_capacity(scheme.len() + ip.len() + path.len() + 11);
    url.push_str(scheme);
    url.push_str("://");
    match address {
        SocketAddr::V4(_) => url.push_str(&ip),
        SocketAddr::V6(_) => {
            url.push('[');
            url.push_str(&ip);
            url.push(']');
        }
    }
    url.push(':');
    push_decimal(&mut url, address.port().into());
    url.push_str(path);
    url
}

/// Attributes a SERVER or CLIENT span is allocated room for: the fullest request's (15, a
/// streamed answer's) and what the stitcher adds.
const SPAN_ATTRIBUTES_CAPACITY: usize = 17;
/// A `gym.*` span's: server name, rollout id, OpenInference kind, and the stitcher's mark of
/// an unjoined parent when it is the outermost span.
const GYM_SPAN_ATTRIBUTES: usize = 4;
/// ... and what a model call adds to its CLIENT span: the GenAI attributes (7 with a
/// streamed answer's time to its first chunk) and the OpenInference ones (5).
const MODEL_CALL_ATTRIBUTES: usize = 12;

/// The response status (or why there is none) as attributes; ERROR for 5xx and aborts.
fn outcome_attributes(outcome: &Outcome, attributes: &mut Attributes) -> SpanStatus {
    let outcome = http_outcome(outcome);
    if let Some(status) = outcome.status_code {
        attributes.push((
            attr::HTTP_RESPONSE_STATUS_CODE,
            AttributeValue::Int(i64::from(status)),
        ));
    }
    match outcome.error_type {
        Some(error) => {
            attributes.push((attr::ERROR_TYPE, AttributeValue::Str(error.value().into())));
            SpanStatus::Error
        }
        None => SpanStatus::Unset,
    }
}

/// `nemo.gym.server.name` and `nemo.gym.rollout.id`, where known.
fn gym_attributes(
    service: &ServiceIdentity,
    meaning: &RequestMeaning,
    attributes: &mut Attributes,
) {
    if let Some(name) = service.server_name_attribute() {
        attributes.push((attr::GYM_SERVER_NAME, name.clone()));
    }
    if let Some(id) = &meaning.rollout_id {
        attributes.push((
            attr::GYM_ROLLOUT_ID,
            AttributeValue::Str(id.shared().into()),
        ));
    }
}

/// The SERVER span of an inbound request, named `{method} {route}`.
fn server_span(
    exchange: &HttpExchange,
    service: &Arc<ServiceIdentity>,
    meaning: &RequestMeaning,
    clock: WallClock,
) -> SpanRecord {
    let request = &exchange.request;
    let mut attributes = request_attributes(request, SPAN_ATTRIBUTES_CAPACITY);
    attributes.push((
        attr::URL_PATH,
        AttributeValue::Str(request.path.clone().into()),
    ));
    attributes.push((
        attr::URL_SCHEME,
        AttributeValue::Str(url_scheme(exchange).into()),
    ));
    // A guessed template is fine for a name, not for `http.route`, which dashboards group
    // by: that must be the server's own.
    if let Some(route) = meaning.route.http_route() {
        attributes.push((attr::HTTP_ROUTE, AttributeValue::Str(route.into())));
    }
    let name = meaning.route.span_name(&request.method);
    // server.address is the host the client asked for (the Host header), else the local
    // address the connection arrived on.
    let (host, port) = match request.host.as_deref().map(split_host_port) {
        Some((host, port)) => (
            Some(Text::Owned(host.to_string())),
            port.or(exchange.local.map(|a| a.port())),
        ),
        None => (
            exchange.local.map(|a| ip_text(a.ip())),
            exchange.local.map(|a| a.port()),
        ),
    };
    if let Some(host) = host {
        attributes.push((attr::SERVER_ADDRESS, AttributeValue::Str(host)));
    }
    if let Some(port) = port {
        attributes.push((attr::SERVER_PORT, AttributeValue::Int(port as i64)));
    }
    if let Some(peer) = exchange.peer {
        attributes.push((
            attr::CLIENT_ADDRESS,
            AttributeValue::Str(ip_text(peer.ip())),
        ));
        attributes.push((
            attr::NETWORK_PEER_PORT,
            AttributeValue::Int(peer.port() as i64),
        ));
    }
    if let Some(agent) = &request.user_agent {
        attributes.push((
            attr::USER_AGENT_ORIGINAL,
            AttributeValue::Str(agent.clone().into()),
        ));
    }
    attributes.extend(
        time_to_first_event(exchange)
            .map(|seconds| (attr::GYM_TRACER_TIME_TO_FIRST_EVENT, seconds)),
    );
    let status = outcome_attributes(&exchange.outcome, &mut attributes);
    gym_attributes(service, meaning, &mut attributes);
    if meaning.tool_call
        && let Some(route) = meaning.route.http_route()
    {
        openinference::tool_attributes(route, &mut attributes);
    }
    let parent = request.traceparent.as_deref().and_then(parse_traceparent);
    let route = meaning.route.http_route().cloned();
    let facts = SpanFacts {
        verify: route.as_deref() == Some("/verify"),
        route,
        status_code: http_outcome(&exchange.outcome).status_code,
        rollout_id: meaning.rollout_id.clone(),
        ..SpanFacts::default()
    };
    SpanRecord {
        service: service.clone(),
        name: name.into(),
        kind: SpanKind::Server,
        trace_id: parent
            .map(|(trace, _)| trace)
            .unwrap_or_else(TraceId::random),
        span_id: exchange.span_id,
        parent_span_id: parent.map(|(_, span)| span),
        parent_is_remote: parent.is_some(),
        start_unix_ns: clock.to_unix_ns(exchange.start_ns),
        end_unix_ns: clock.to_unix_ns(exchange.end_ns),
        attributes,
        status,
        facts,
    }
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
    use crate::gym::rollout_id::RolloutId;
    use crate::gym::routes::RouteName;
    use crate::gym::semantics::SemanticSpan;
    use crate::model::exchange::AbortReason;
    use crate::model::exchange::RequestHead;
    use crate::model::exchange::ResponseHead;
    use crate::model::exchange::StreamTimes;
    use crate::model::service::GymLabels;
    use crate::pipeline::testing;

    fn exchange(outcome: Outcome, traceparent: Option<&str>) -> HttpExchange {
        let request = RequestHead {
            host: Some("localhost:8000".into()),
            user_agent: Some("ua".into()),
            traceparent: traceparent.map(String::from),
            ..testing::request("POST", "/ng-rollout/r-7/verify")
        };
        testing::exchange(1, Role::Server, request, outcome)
    }

    fn ok() -> Outcome {
        testing::response(200)
    }

    fn verify_meaning() -> RequestMeaning {
        RequestMeaning {
            route: RouteName::Template("/verify".into()),
            rollout_id: RolloutId::parse("r-7"),
            semantic: Some(SemanticSpan {
                name: "gym.verify",
                group: SpanGroup::Verify,
            }),
            tool_call: false,
        }
    }

    #[test]
    fn openinference_kinds_mark_the_evaluator_and_the_tool_and_nothing_else() {
        let all = spans(&exchange(ok(), None), &verify_meaning(), "server,verify");
        let kinds: Vec<_> = all
            .iter()
            .map(|span| {
                (
                    span.name.as_ref(),
                    str_attr(span, "openinference.span.kind"),
                )
            })
            .collect();
        assert_eq!(
            kinds,
            [("POST /verify", None), ("gym.verify", Some("EVALUATOR"))]
        );
        let tool = RequestMeaning {
            route: RouteName::Template("/get_weather".into()),
            semantic: None,
            tool_call: true,
            ..verify_meaning()
        };
        let all = spans(&exchange(ok(), None), &tool, "server");
        assert_eq!(str_attr(&all[0], "openinference.span.kind"), Some("TOOL"));
        assert_eq!(str_attr(&all[0], "tool.name"), Some("get_weather"));
    }

    fn gym_service() -> Arc<ServiceIdentity> {
        Arc::new(ServiceIdentity::of_process(
            std::process::id(),
            GymLabels {
                server_name: Some("math".into()),
                ..GymLabels::default()
            },
            &crate::model::service::AgentResource::default(),
            None,
        ))
    }

    fn spans(exchange: &HttpExchange, meaning: &RequestMeaning, groups: &str) -> Vec<SpanRecord> {
        let mut out = Vec::new();
        let view = RequestView {
            exchange,
            service: &gym_service(),
            server_type: None,
            meaning,
            semantic_span_id: None,
            peer: None,
        };
        request_spans(
            &view,
            groups.parse().unwrap(),
            WallClock::measure(),
            &mut out,
        );
        out
    }

    /// Every span of an outbound `call` to the Gym server `peer_name`.
    fn call_spans(
        call: &HttpExchange,
        peer_name: &str,
        server_type: Option<ServerType>,
    ) -> Vec<SpanRecord> {
        let peer = Peer {
            name: peer_name.into(),
            server_type,
        };
        let view = RequestView {
            exchange: call,
            service: &gym_service(),
            server_type: Some(ServerType::Agent),
            meaning: &verify_meaning(),
            semantic_span_id: None,
            peer: Some(&peer),
        };
        let mut out = Vec::new();
        request_spans(
            &view,
            "all".parse().unwrap(),
            WallClock::measure(),
            &mut out,
        );
        out
    }

    fn attr<'a>(span: &'a SpanRecord, key: &str) -> Option<&'a AttributeValue> {
        span.attributes
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
    }

    fn str_attr<'a>(span: &'a SpanRecord, key: &str) -> Option<&'a str> {
        match attr(span, key) {
            Some(AttributeValue::Str(value)) => Some(value),
            _ => None,
        }
    }

    #[test]
    fn server_span_has_semconv_attributes_and_adopts_traceparent() {
        let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let all = spans(
            &exchange(ok(), Some(traceparent)),
            &verify_meaning(),
            "server",
        );
        assert_eq!(all.len(), 1, "only the server group is on");
        let span = &all[0];
        assert_eq!(span.name, "POST /verify");
        assert_eq!(span.kind, SpanKind::Server);
        assert_eq!(span.status, SpanStatus::Unset);
        assert_eq!(span.end_unix_ns - span.start_unix_ns, 4_000);
        assert_eq!(str_attr(span, "http.route"), Some("/verify"));
        assert_eq!(str_attr(span, "url.path"), Some("/ng-rollout/r-7/verify"));
        assert_eq!(str_attr(span, "server.address"), Some("localhost"));
        assert_eq!(attr(span, "server.port"), Some(&AttributeValue::Int(8000)));
        assert_eq!(str_attr(span, "client.address"), Some("127.0.0.1"));
        assert_eq!(
            attr(span, "http.response.status_code"),
            Some(&AttributeValue::Int(200))
        );
        assert_eq!(str_attr(span, "nemo.gym.server.name"), Some("math"));
        assert_eq!(str_attr(span, "nemo.gym.rollout.id"), Some("r-7"));
        assert_eq!(span.trace_id.0[0], 0x0a);
        assert_eq!(
            span.parent_span_id,
            Some(SpanId([0xb7, 0xad, 0x6b, 0x71, 0x69, 0x20, 0x33, 0x31]))
        );
    }

    #[test]
    fn semantic_span_is_a_child_with_the_same_timing() {
        let all = spans(&exchange(ok(), None), &verify_meaning(), "per_rollout");
        let [server, verify] = &all[..] else {
            panic!("expected two spans, got {all:?}");
        };
        assert_eq!(verify.name, "gym.verify");
        assert_eq!(verify.kind, SpanKind::Internal);
        assert_eq!(verify.trace_id, server.trace_id);
        assert_eq!(verify.parent_span_id, Some(server.span_id));
        assert_eq!(
            (verify.start_unix_ns, verify.end_unix_ns),
            (server.start_unix_ns, server.end_unix_ns)
        );
        let keys: Vec<&str> = verify.attributes.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            [
                "nemo.gym.server.name",
                "nemo.gym.rollout.id",
                "openinference.span.kind"
            ]
        );
    }

    #[test]
    fn groups_gate_each_span() {
        let exchange = exchange(ok(), None);
        let names = |groups| -> Vec<String> {
            spans(&exchange, &verify_meaning(), groups)
                .into_iter()
                .map(|s| s.name.to_string())
                .collect()
        };
        assert_eq!(names("default"), ["POST /verify"]);
        assert_eq!(names("verify"), ["gym.verify"]);
        let alone = spans(&exchange, &verify_meaning(), "verify");
        assert_eq!(
            alone[0].parent_span_id, None,
            "no server span to hang under"
        );
    }

    #[test]
    fn a_model_api_call_is_llm_and_a_call_of_an_agent_is_agent() {
        use crate::model::exchange::ModelCall;
        use crate::model::genai::GenAiOperation;
        let mut call = testing::exchange(
            1,
            Role::Client,
            testing::request("POST", "/v1/responses"),
            ok(),
        );
        call.model_call = Some(Box::new(ModelCall::new(GenAiOperation::Responses)));
        let kind_calling = |server_type| {
            let out = call_spans(&call, "callee", server_type);
            str_attr(&out[0], "openinference.span.kind").map(String::from)
        };
        assert_eq!(
            kind_calling(Some(ServerType::Model)).as_deref(),
            Some("LLM")
        );
        assert_eq!(
            kind_calling(None).as_deref(),
            Some("LLM"),
            "a model API outside Gym"
        );
        assert_eq!(
            kind_calling(Some(ServerType::Agent)).as_deref(),
            Some("AGENT")
        );
    }

    /// A streamed answer's spans say how long its first event took, on either end; a model
    /// call's in the GenAI conventions' key too. Other answers say nothing of it.
    #[test]
    fn a_streamed_answer_records_the_time_to_its_first_event() {
        use crate::model::exchange::ModelCall;
        use crate::model::genai::GenAiOperation;
        let streamed = Some(StreamTimes {
            first_data_ns: 251_000, // the request's first byte moved at 1_000
            last_data_ns: 5_000_000,
        });
        let mut call = testing::exchange(
            1,
            Role::Client,
            testing::request("POST", "/v1/responses"),
            ok(),
        );
        call.model_call = Some(Box::new(ModelCall::new(GenAiOperation::Responses)));
        call.stream = streamed;
        let mut server = exchange(ok(), None);
        server.stream = streamed;
        let client = call_spans(&call, "policy_model", Some(ServerType::Model));
        let server = spans(&server, &verify_meaning(), "server");
        let seconds = Some(&AttributeValue::Double(250e-6));
        for span in [&client[0], &server[0]] {
            assert_eq!(
                attr(span, "gym_tracer.response.time_to_first_event"),
                seconds
            );
        }
        assert_eq!(
            attr(&client[0], "gen_ai.response.time_to_first_chunk"),
            seconds
        );
        assert_eq!(
            attr(&server[0], "gen_ai.response.time_to_first_chunk"),
            None
        );
        let plain = spans(&exchange(ok(), None), &verify_meaning(), "server");
        assert_eq!(
            attr(&plain[0], "gym_tracer.response.time_to_first_event"),
            None
        );
    }

    /// The attribute lists are allocated once: the fullest spans (a model call with every
    /// GenAI field, a server span with every field) fit their room, with two to spare for
    /// what the stitcher adds (the rollout id, an unjoined parent).
    #[test]
    fn attribute_lists_are_allocated_at_their_final_size() {
        use crate::model::exchange::ModelCall;
        use crate::model::genai::{GenAiOperation, TokenUsage};
        let mut call = testing::exchange(
            1,
            Role::Client,
            RequestHead {
                host: Some("api.openai.com".into()),
                ..testing::request("POST", "/v1/responses")
            },
            testing::response(503),
        );
        call.peer = Some("10.0.0.9:443".parse().unwrap());
        call.model_call = Some(Box::new(ModelCall {
            request_model: Some("m".into()),
            response_model: Some("m-1".into()),
            usage: TokenUsage {
                input_tokens: Some(3),
                output_tokens: Some(4),
            },
            ..ModelCall::new(GenAiOperation::Responses)
        }));
        let streamed = Some(StreamTimes {
            first_data_ns: 2_000,
            last_data_ns: 5_000,
        });
        call.stream = streamed;
        let mut out = call_spans(&call, "policy_model", Some(ServerType::Model));
        let mut server = exchange(testing::response(503), None);
        server.peer = Some("10.0.0.8:5000".parse().unwrap());
        server.stream = streamed;
        out.extend(spans(&server, &verify_meaning(), "server"));
        for span in &out {
            let capacity = span.attributes.capacity();
            assert!(
                span.attributes.len() + 2 <= capacity
                    && [
                        SPAN_ATTRIBUTES_CAPACITY,
                        SPAN_ATTRIBUTES_CAPACITY + MODEL_CALL_ATTRIBUTES
                    ]
                    .contains(&capacity),
                "{}: {} attributes in room for {capacity}",
                span.name,
                span.attributes.len()
            );
        }
    }

    #[test]
    fn client_span_names_are_http_and_the_method() {
        for method in attr::REGISTERED_METHODS.into_iter().chain(["PROPFIND"]) {
            assert_eq!(client_span_name(method), format!("HTTP {method}"));
        }
        assert!(matches!(client_span_name("POST"), Text::Static(_)));
    }

    #[test]
    fn guessed_routes_name_the_span_but_are_not_http_route() {
        let meaning = RequestMeaning {
            route: RouteName::Heuristic("/items/{id}".into()),
            rollout_id: None,
            semantic: None,
            tool_call: false,
        };
        let all = spans(&exchange(ok(), None), &meaning, "all");
        assert_eq!(all[0].name, "POST /items/{id}");
        assert!(attr(&all[0], "http.route").is_none());
        assert!(attr(&all[0], "nemo.gym.rollout.id").is_none());
        let unnamed = RequestMeaning {
            route: RouteName::Unnamed,
            ..meaning
        };
        assert_eq!(
            spans(&exchange(ok(), None), &unnamed, "all")[0].name,
            "POST"
        );
    }

    #[test]
    fn server_errors_and_aborts_are_errors() {
        let failed = Outcome::Response(ResponseHead {
            status: 503,
            version_minor: 1,
            sessions_set: Vec::new(),
        });
        let all = spans(&exchange(failed, None), &verify_meaning(), "all");
        assert!(all.iter().all(|s| s.status == SpanStatus::Error));
        let aborted = spans(
            &exchange(Outcome::Aborted(AbortReason::ConnectionClosed), None),
            &verify_meaning(),
            "server",
        );
        assert_eq!(aborted[0].status, SpanStatus::Error);
        assert_eq!(
            str_attr(&aborted[0], "error.type"),
            Some("connection_closed")
        );
        assert!(aborted[0].parent_span_id.is_none());
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

    #[test]
    fn addresses_read_as_their_display_writes_them() {
        let addresses: [SocketAddr; 7] = [
            "127.0.0.1:8000".parse().unwrap(),
            "10.0.0.1:1".parse().unwrap(),
            "192.168.100.255:65535".parse().unwrap(),
            "0.0.0.0:0".parse().unwrap(),
            "[::1]:443".parse().unwrap(),
            "[2001:db8::7]:8080".parse().unwrap(),
            "[fe80::1%2]:80".parse().unwrap(),
        ];
        for address in addresses {
            assert_eq!(ip_text(address.ip()), address.ip().to_string());
            assert_eq!(
                url_full("http", address, "/v1/responses"),
                format!("http://{address}/v1/responses")
            );
        }
    }
}
