//! The agent's user-space cost per request, without the kernel, the machine's other
//! processes or the network: Gym-shaped traffic made of the records the kernel would write,
//! driven through the pipeline core as the agent drives it, the released spans encoded as
//! the OTLP/HTTP exporter encodes them. On a noisy machine the whole-system figures of
//! `cargo xtask bench` move by ±20 % between runs; this one is single-threaded and
//! compute-bound, so a change to the pipeline shows in it (run by `cargo xtask bench`, and
//! under `valgrind --tool=callgrind` for instruction counts).
//!
//! Metrics are left out (the SDK's histograms need an exporter and a runtime); everything
//! else a request costs the agent's hot thread and its export thread is in.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use tracer_abi::{
    AF_INET, ConnOpenEvent, DATA_SEQ_KNOWN, DIRECTION_READ, DIRECTION_WRITE, DataEventHeader,
    EventHeader, EventKind, ROLE_CLIENT, ROLE_SERVER,
};

use crate::export::otlp::encode::encode_trace_request;
use crate::gym::ServerType;
use crate::gym::span_groups::SpanGroups;
use crate::model::exchange::SocketId;
use crate::model::service::{AgentResource, GymLabels};
use crate::model::span::SpanRecord;
use crate::pipeline::recording::Recording;
use crate::pipeline::replay::{self, record_bytes};
use crate::pipeline::{Pipeline, PipelineConfig, PipelineOutput};
use crate::signals::clock::WallClock;
use crate::stitch::StitchConfig;

/// The traffic one run drives.
#[derive(Clone, Copy, Debug)]
pub enum Workload {
    /// A resources server's `/verify`, called by an untraced client over keep-alive
    /// connections: its SERVER span and its `gym.verify` span.
    Verify,
    /// An agent server's calls to a model server's `/v1/responses`, both traced, over
    /// loopback: a CLIENT span, and a SERVER span (with its `gym.model` span) stitched under
    /// it across the processes by the requests' TCP sequence numbers.
    CrossProcess,
}

/// What one run measured.
#[derive(Clone, Copy, Debug)]
pub struct Cost {
    pub requests: u64,
    pub spans: u64,
    /// Time in the pipeline core (records in, spans released), per request.
    pub pipeline_ns_per_request: f64,
    /// Time encoding the released spans, per span.
    pub encode_ns_per_span: f64,
    /// SERVER spans placed under their caller's CLIENT span.
    pub stitched: u64,
}

impl Cost {
    pub fn ns_per_span(&self) -> f64 {
        let spans_per_request = self.spans as f64 / self.requests.max(1) as f64;
        self.pipeline_ns_per_request / spans_per_request.max(1.0) + self.encode_ns_per_span
    }
}

const AGENT: u32 = 7_000_001;
const MODEL: u32 = 7_000_002;
const RESOURCES: u32 = 7_000_003;
const SERVER_PORT: u16 = 8000;
/// Keep-alive connections the requests go round (the bench's wrk uses 32).
const CONNECTIONS: u32 = 32;
/// The request rate the traffic's timestamps say: the bench's /verify rate.
const REQUEST_INTERVAL: Duration = Duration::from_micros(500);
/// How often the agent releases held spans (its drain timer).
const RELEASE_EVERY: u64 = 20;

const VERIFY: &[u8] = b"POST /verify HTTP/1.1\r\nhost: 127.0.0.1:8000\r\naccept: */*\r\naccept-encoding: gzip, deflate\r\nconnection: keep-alive\r\nuser-agent: python-httpx/0.28.1\r\ncontent-type: application/json\r\ncontent-length: 86\r\n\r\n{\"responses_create_params\": {\"input\": []}, \"response\": {\"output\": [], \"id\": \"resp_1\"}}";
const VERIFIED: &[u8] = b"HTTP/1.1 200 OK\r\ndate: Thu, 03 Dec 2026 07:00:00 GMT\r\nserver: uvicorn\r\ncontent-length: 59\r\ncontent-type: application/json\r\n\r\n{\"reward\": 1.0, \"response\": {\"output\": [], \"id\": \"resp_1\"}}";
const RESPONSES: &[u8] = b"POST /v1/responses HTTP/1.1\r\nhost: 127.0.0.1:8000\r\naccept: */*\r\naccept-encoding: gzip, deflate\r\nconnection: keep-alive\r\nuser-agent: python-httpx/0.28.1\r\ncontent-type: application/json\r\ncontent-length: 38\r\n\r\n{\"input\": [], \"model\": \"policy-model\"}";
const RESPONDED: &[u8] = b"HTTP/1.1 200 OK\r\ndate: Thu, 03 Dec 2026 07:00:00 GMT\r\nserver: uvicorn\r\ncontent-length: 45\r\ncontent-type: application/json\r\n\r\n{\"id\": \"resp_1\", \"output\": [], \"usage\": null}";

/// Drives `requests` requests of `workload` through a fresh pipeline.
pub fn measure(workload: Workload, requests: u64) -> Cost {
    let mut traffic = Traffic::new(workload);
    let mut pipeline = Pipeline::new(
        PipelineConfig {
            clock: WallClock::measure(),
            max_connections: 65_536,
            routes: Vec::new(),
            agent_resource: AgentResource::new(Some("gym".to_string()), Vec::new()),
            groups: SpanGroups::ALL,
            stitch: StitchConfig {
                max_pending: 100_000,
                max_nodes: 400_000,
                injection: None,
            },
        },
        (),
    );
    for (pid, server_type) in [
        (AGENT, ServerType::Agent),
        (MODEL, ServerType::Model),
        (RESOURCES, ServerType::Resources),
    ] {
        pipeline.attach(pid, GymLabels::example_server(server_type));
    }
    let mut encoder = Encoder::new();
    let epoch = Instant::now();
    let mut pipeline_time = Duration::ZERO;
    let mut records = traffic.opens();
    let mut output = PipelineOutput::default();
    for request in 0..requests + 1 {
        // The last round only lets the held spans go.
        let last = request == requests;
        if !last {
            records.extend(traffic.request(request));
        }
        let now = epoch + traffic.now();
        let started = Instant::now();
        for record in &records {
            pipeline.handle_record(record, now, &mut ());
        }
        if last {
            pipeline.release_all();
        } else if request % RELEASE_EVERY == 0 {
            pipeline.release(now);
        }
        pipeline.deliver(&mut output);
        pipeline_time += started.elapsed();
        records.clear();
        encoder.encode(&output.released);
        output.clear();
    }
    encoder.cost(
        requests,
        pipeline_time,
        pipeline.counters().stitch.cross_process_links,
    )
}

/// The OTLP/HTTP exporter's encoding of released spans, timed apart from the pipeline.
struct Encoder {
    resource: opentelemetry_sdk::Resource,
    body: Vec<u8>,
    time: Duration,
    spans: u64,
}

impl Encoder {
    fn new() -> Self {
        Self {
            resource: opentelemetry_sdk::Resource::builder_empty()
                .with_service_name("gym")
                .build(),
            body: Vec::with_capacity(1 << 20),
            time: Duration::ZERO,
            spans: 0,
        }
    }

    fn encode(&mut self, released: &[SpanRecord]) {
        if released.is_empty() {
            return;
        }
        let started = Instant::now();
        self.body.clear();
        encode_trace_request(&self.resource, released, &mut self.body);
        self.time += started.elapsed();
        self.spans += released.len() as u64;
    }

    /// The figures of `requests` that took `pipeline_time` in the core, encoding aside.
    fn cost(&self, requests: u64, pipeline_time: Duration, stitched: u64) -> Cost {
        Cost {
            requests,
            spans: self.spans,
            pipeline_ns_per_request: pipeline_time.as_nanos() as f64 / requests.max(1) as f64,
            encode_ns_per_span: self.time.as_nanos() as f64 / self.spans.max(1) as f64,
            stitched,
        }
    }
}

/// The recorded run of the real Gym servers (`tracer-userspace/testdata/`, see
/// [`crate::pipeline::recording`]), fed `rounds` times to a fresh core as the agent fed it,
/// insight included: the floor of the real agent on Gym's own traffic (~11 KB bodies,
/// context records, rollouts in flight together).
pub fn measure_recording(recording: &Recording<'_>, rounds: u64) -> Cost {
    let mut encoder = Encoder::new();
    let (mut total, mut requests, mut stitched) = (Duration::ZERO, 0, 0);
    for _ in 0..rounds {
        let mut pipeline = Pipeline::new(recording.config.pipeline_config(), ());
        let started = Instant::now();
        recording.feed(&mut pipeline, started, &mut (), |output| {
            encoder.encode(&output.released);
        });
        total += started.elapsed();
        let counters = pipeline.counters();
        requests += counters.pipeline.requests_traced;
        stitched += counters.stitch.cross_process_links;
    }
    // The encoding happened inside the feed: its time is taken out of the core's.
    let pipeline_time = total.saturating_sub(encoder.time);
    encoder.cost(requests, pipeline_time, stitched)
}

/// The records the kernel would write for the workload, with its clock and the
/// connections' sequence numbers.
struct Traffic {
    workload: Workload,
    now_ns: u64,
    /// Per connection: the next request byte's and response byte's sequence numbers.
    seq: Vec<(u32, u32)>,
}

impl Traffic {
    fn new(workload: Workload) -> Self {
        Self {
            workload,
            now_ns: 1_000_000_000,
            seq: (0..CONNECTIONS)
                .map(|c| (c.wrapping_mul(0x9E37_79B9), c.wrapping_mul(0x85EB_CA6B)))
                .collect(),
        }
    }

    fn now(&self) -> Duration {
        Duration::from_nanos(self.now_ns)
    }

    /// The connections, opened once and kept alive.
    fn opens(&self) -> Vec<Vec<u8>> {
        let mut records = Vec::new();
        for connection in 0..CONNECTIONS {
            let fd = 10 + connection as i32;
            let client = loopback(40_000 + connection as u16);
            let server = loopback(SERVER_PORT);
            match self.workload {
                Workload::Verify => {
                    records.push(open(
                        RESOURCES,
                        fd,
                        ROLE_SERVER,
                        server,
                        client,
                        self.now_ns,
                    ));
                }
                Workload::CrossProcess => {
                    records.push(open(AGENT, fd, ROLE_CLIENT, client, server, self.now_ns));
                    records.push(open(MODEL, fd, ROLE_SERVER, server, client, self.now_ns));
                }
            }
        }
        records
    }

    /// One request and its response, on connection `request % CONNECTIONS`.
    fn request(&mut self, request: u64) -> Vec<Vec<u8>> {
        self.now_ns += REQUEST_INTERVAL.as_nanos() as u64;
        let connection = (request % u64::from(CONNECTIONS)) as usize;
        let fd = 10 + connection as i32;
        let (request_seq, response_seq) = self.seq[connection];
        let (ask, answer) = match self.workload {
            Workload::Verify => (VERIFY, VERIFIED),
            Workload::CrossProcess => (RESPONSES, RESPONDED),
        };
        self.seq[connection] = (
            request_seq.wrapping_add(ask.len() as u32),
            response_seq.wrapping_add(answer.len() as u32),
        );
        let t = self.now_ns;
        match self.workload {
            Workload::Verify => vec![
                data(RESOURCES, fd, DIRECTION_READ, ask, request_seq, t),
                data(
                    RESOURCES,
                    fd,
                    DIRECTION_WRITE,
                    answer,
                    response_seq,
                    t + 300_000,
                ),
            ],
            Workload::CrossProcess => vec![
                data(AGENT, fd, DIRECTION_WRITE, ask, request_seq, t),
                data(MODEL, fd, DIRECTION_READ, ask, request_seq, t + 20_000),
                data(
                    MODEL,
                    fd,
                    DIRECTION_WRITE,
                    answer,
                    response_seq,
                    t + 300_000,
                ),
                data(AGENT, fd, DIRECTION_READ, answer, response_seq, t + 320_000),
            ],
        }
    }
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port)
}

/// A record's header from process `pid`'s socket `fd` (one connection per fd: its id is
/// derived from both).
fn header(kind: EventKind, pid: u32, fd: i32, timestamp_ns: u64) -> EventHeader {
    let conn_id = (u64::from(pid) << 16) | fd as u64;
    replay::header(kind, SocketId { pid, fd }, conn_id, timestamp_ns)
}

fn open(
    pid: u32,
    fd: i32,
    role: u8,
    local: SocketAddr,
    peer: SocketAddr,
    timestamp_ns: u64,
) -> Vec<u8> {
    let mut event = ConnOpenEvent {
        header: header(EventKind::ConnOpen, pid, fd, timestamp_ns),
        role,
        family: AF_INET,
        local_port: local.port(),
        peer_port: peer.port(),
        ..ConnOpenEvent::default()
    };
    for (field, address) in [(&mut event.local_addr, local), (&mut event.peer_addr, peer)] {
        if let IpAddr::V4(v4) = address.ip() {
            field[..4].copy_from_slice(&v4.octets());
        }
    }
    record_bytes(&event)
}

fn data(pid: u32, fd: i32, direction: u8, bytes: &[u8], seq: u32, timestamp_ns: u64) -> Vec<u8> {
    let mut record = record_bytes(&DataEventHeader {
        header: header(EventKind::Data, pid, fd, timestamp_ns),
        direction,
        flags: DATA_SEQ_KNOWN,
        captured_len: bytes.len() as u32,
        total_len: bytes.len() as u64,
        seq,
        ..DataEventHeader::default()
    });
    record.extend_from_slice(bytes);
    record
}

/// The stitcher alone with `in_flight` rollouts in flight in one process (an agent's `/run`
/// each, its rollout known), each making one call that names its rollout: nanoseconds per
/// call (start, placement, span held and released, finish), over `rounds` rounds. Flat from
/// 64 to 16,384 in flight when nothing on the way scans the requests in flight.
pub fn stitch_ns_per_call(in_flight: u32, rounds: u32) -> f64 {
    use crate::gym::rollout_id::RolloutId;
    use crate::model::exchange::{RequestStart, Role};
    use crate::model::ids::SpanId;
    use crate::model::service::ServiceIdentity;
    use crate::model::span::{SpanKind, SpanRecord};
    use crate::stitch::{SpanRole, StartFacts, Stitcher};

    let service = std::sync::Arc::new(ServiceIdentity::named("agent"));

    let loopback = |port: u32| SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port as u16);
    let start = |role, local, peer, path: String| RequestStart {
        pid: AGENT,
        role,
        local: Some(loopback(local)),
        peer: Some(loopback(peer)),
        sequence: 0,
        tcp_seq: None,
        span_id: SpanId::random(),
        method: "POST".into(),
        path,
        traceparent: None,
        session_tokens: Vec::new(),
        context: None,
        lineage: None,
        inbound_socket: None,
    };
    let facts = |rollout: &str| StartFacts {
        rollout_id: RolloutId::parse(rollout),
        emits_own: true,
        emits_semantic: false,
        inbound_hidden: false,
        caller_traced: false,
        caller_seen_here: false,
    };
    let mut stitcher = Stitcher::new(StitchConfig {
        max_pending: 1 << 20,
        max_nodes: 1 << 22,
        injection: None,
    });
    let now = Instant::now();
    let mut out = Vec::new();
    let mut elapsed = Duration::ZERO;
    for round in 0..rounds {
        let rollout = |i: u32| format!("{i}-{round}");
        let runs: Vec<RequestStart> = (0..in_flight)
            .map(|i| {
                let run = start(Role::Server, 8000, 10_000 + i, "/run".into());
                stitcher.start(&run, facts(&rollout(i)), now);
                run
            })
            .collect();
        let timed = Instant::now();
        for i in 0..in_flight {
            let path = format!("/ng-rollout/{}/v1/responses", rollout(i));
            let call = start(Role::Client, 30_000 + i, 9000, path);
            stitcher.start(&call, facts(&rollout(i)), now);
            let span =
                SpanRecord::bare(service.clone(), "HTTP POST", SpanKind::Client, call.span_id);
            stitcher.hold(call.span_id, SpanRole::Own, span, &mut out);
            stitcher.finish(call.span_id);
        }
        elapsed += timed.elapsed();
        for run in &runs {
            stitcher.finish(run.span_id);
        }
        stitcher.release(now, &mut out);
        out.clear();
    }
    elapsed.as_nanos() as f64 / f64::from(in_flight * rounds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_of_each_workload_yields_its_spans() {
        let verify = measure(Workload::Verify, 200);
        assert_eq!(
            verify.spans, 400,
            "a SERVER and a gym.verify span per /verify"
        );
        let cross = measure(Workload::CrossProcess, 200);
        assert_eq!(
            cross.spans, 600,
            "a CLIENT, a SERVER and a gym.model span per call"
        );
        assert_eq!(
            cross.stitched, 200,
            "each SERVER span under its CLIENT span"
        );
        assert_eq!(verify.stitched, 0);
        assert!(verify.pipeline_ns_per_request > 0.0 && cross.encode_ns_per_span > 0.0);
    }
}
