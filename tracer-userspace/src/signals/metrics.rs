//! Metrics recorded from HTTP exchanges, one SDK meter provider per traced process: the
//! stable HTTP server histogram and Gym's `gym.*` instruments, each dimensioned by
//! `nemo.gym.server.name` (Gym records the `gym.*` ones without attributes).

use foldhash::{HashMap, HashMapExt};
use std::hash::Hash;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{BoundHistogram, Histogram, Meter, MeterProvider};
use opentelemetry_sdk::metrics::SdkMeterProvider;

use crate::export::status::ExportStatus;
use crate::export::{ExportTarget, meter_provider, shutdown_providers};
use crate::gym::routes::RouteName;
use crate::gym::span_groups::SpanGroup;
use crate::model::attributes as attr;
use crate::model::exchange::Role;
use crate::model::exchange::{AbortReason, Outcome};
use crate::model::exchange::{HttpExchange, ModelCall};
use crate::model::genai::provider_name;
use crate::model::rollout::Phase;
use crate::model::rollout::RolloutSummary;
use crate::model::service::ServiceIdentity;
use crate::signals::meaning::RequestMeaning;
use crate::signals::outcome::http_outcome;
use crate::signals::spans::url_scheme;

/// `http.request.method` as the HTTP semantic conventions dimension it: a method outside the
/// registered set is `_OTHER`, so a peer that invents methods cannot grow the series.
fn method_attribute(method: &str) -> KeyValue {
    KeyValue::new(
        attr::HTTP_REQUEST_METHOD,
        registered_method_or_other(method),
    )
}

/// `http.response.status_code`, and `error.type` for 5xx and aborts.
fn push_outcome(outcome: &Outcome, attributes: &mut Vec<KeyValue>) {
    let outcome = http_outcome(outcome);
    if let Some(status) = outcome.status_code {
        attributes.push(KeyValue::new(
            attr::HTTP_RESPONSE_STATUS_CODE,
            i64::from(status),
        ));
    }
    if let Some(error) = outcome.error_type {
        attributes.push(KeyValue::new(attr::ERROR_TYPE, error.value()));
    }
}

/// How many attribute sets of one instrument a process keeps bound. Past it a request
/// records through the SDK's attribute lookup (which caps series itself), so that peers
/// that vary their statuses or ports cannot grow the agent.
const MAX_BOUND_SERIES: usize = 256;

/// What sets a request's `http.response.status_code` and `error.type`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum OutcomeKey {
    Status(u16),
    Aborted(AbortReason),
}

impl OutcomeKey {
    fn of(outcome: &Outcome) -> Self {
        match outcome {
            Outcome::Response(response) => Self::Status(response.status),
            Outcome::Aborted(reason) => Self::Aborted(*reason),
        }
    }
}

/// The attributes of one `http.server.request.duration` series as a map key: a histogram
/// bound to them records without building, sorting and hashing `KeyValue`s per request.
#[derive(Clone, PartialEq, Eq, Hash)]
struct ServerSeries {
    method: &'static str,
    tls: bool,
    http_1_0: bool,
    route: Option<Arc<str>>,
    outcome: OutcomeKey,
}

/// ... and of one `http.client.request.duration` series (`peer.service` aside: see
/// [`ClientSeriesGroup`]).
#[derive(Clone, PartialEq, Eq, Hash)]
struct ClientSeries {
    method: &'static str,
    peer: Option<SocketAddr>,
    outcome: OutcomeKey,
}

/// The client series of one key by `peer.service`: one name per peer address in practice,
/// so a short list, looked up without allocating the name.
type ClientSeriesGroup = Vec<(Option<Box<str>>, BoundHistogram<f64>)>;

/// The attributes of a model call's GenAI series, `error.type` and the token type aside.
/// Shared names: one call's three series keys are clones of one key.
#[derive(Clone, PartialEq, Eq, Hash)]
struct ModelSeries {
    operation: &'static str,
    provider: Option<&'static str>,
    request_model: Option<Arc<str>>,
    response_model: Option<Arc<str>>,
    peer: Option<SocketAddr>,
}

/// Histograms bound per series, at most [`MAX_BOUND_SERIES`].
struct BoundSeries<K, T = f64> {
    by_key: HashMap<K, BoundHistogram<T>>,
}

impl<K, T> Default for BoundSeries<K, T> {
    fn default() -> Self {
        Self {
            by_key: HashMap::new(),
        }
    }
}

impl<K: Hash + Eq, T> BoundSeries<K, T> {
    /// Records `value` in `key`'s series. The attributes are built (by `fill`, into
    /// `scratch`) only for a series seen the first time, or past the cap.
    fn record(
        &mut self,
        histogram: &Histogram<T>,
        key: K,
        value: T,
        scratch: &mut Vec<KeyValue>,
        fill: impl FnOnce(&mut Vec<KeyValue>),
    ) {
        if let Some(bound) = self.by_key.get(&key) {
            bound.record(value);
            return;
        }
        scratch.clear();
        fill(scratch);
        if self.by_key.len() < MAX_BOUND_SERIES {
            let bound = histogram.bind(scratch);
            bound.record(value);
            self.by_key.insert(key, bound);
        } else {
            histogram.record(value, scratch);
        }
    }
}

/// The GenAI metrics of a model call, by server (the process's resource and its Gym server
/// name) and model: the duration, and each token count its response reported. Each series is
/// bound on first use, as the HTTP ones are.
fn record_model_call(
    service: &mut ServiceMetrics,
    exchange: &HttpExchange,
    call: &ModelCall,
    elapsed_s: f64,
    attributes: &mut Vec<KeyValue>,
) {
    let series = ModelSeries {
        operation: call.operation.operation_name(),
        provider: exchange.request.host.as_deref().and_then(provider_name),
        request_model: call.request_model.as_deref().map(Arc::from),
        response_model: call.response_model.as_deref().map(Arc::from),
        peer: exchange.peer,
    };
    let server_name = &service.server_name;
    let fill = |attributes: &mut Vec<KeyValue>| {
        attributes.extend(server_name.iter().cloned());
        attributes.push(KeyValue::new(attr::GEN_AI_OPERATION_NAME, series.operation));
        if let Some(provider) = series.provider {
            attributes.push(KeyValue::new(attr::GEN_AI_PROVIDER_NAME, provider));
        }
        if let Some(model) = &series.request_model {
            attributes.push(KeyValue::new(attr::GEN_AI_REQUEST_MODEL, model.to_string()));
        }
        if let Some(model) = &series.response_model {
            attributes.push(KeyValue::new(
                attr::GEN_AI_RESPONSE_MODEL,
                model.to_string(),
            ));
        }
        if let Some(peer) = series.peer {
            attributes.push(KeyValue::new(attr::SERVER_ADDRESS, peer.ip().to_string()));
            attributes.push(KeyValue::new(attr::SERVER_PORT, peer.port() as i64));
        }
    };
    for (kind, tokens) in [
        ("input", call.usage.input_tokens),
        ("output", call.usage.output_tokens),
    ] {
        if let Some(tokens) = tokens {
            let key = (series.clone(), kind);
            service.model_tokens.record(
                &service.gen_ai_tokens,
                key,
                tokens,
                attributes,
                |attributes| {
                    fill(attributes);
                    attributes.push(KeyValue::new(attr::GEN_AI_TOKEN_TYPE, kind));
                },
            );
        }
    }
    let outcome = OutcomeKey::of(&exchange.outcome);
    service.model_durations.record(
        &service.gen_ai_duration,
        (series.clone(), outcome),
        elapsed_s,
        attributes,
        |attributes| {
            fill(attributes);
            push_outcome(&exchange.outcome, attributes);
            // The duration takes error.type only (the HTTP status is the HTTP metric's).
            attributes.retain(|kv| kv.key.as_str() != attr::HTTP_RESPONSE_STATUS_CODE);
        },
    );
}

/// One instrument as exported: the reference in the README is generated from these.
pub struct Instrument {
    pub name: &'static str,
    pub kind: &'static str,
    pub unit: &'static str,
    pub description: &'static str,
}

const SERVER_DURATION: Instrument = Instrument {
    name: "http.server.request.duration",
    kind: "histogram",
    unit: "s",
    description: "Duration of HTTP server requests.",
};
const CLIENT_DURATION: Instrument = Instrument {
    name: "http.client.request.duration",
    kind: "histogram",
    unit: "s",
    description: "Duration of HTTP client requests.",
};
const ROLLOUT_DURATION: Instrument = Instrument {
    name: "gym.rollout.duration_ms",
    kind: "histogram",
    unit: "ms",
    description: "Wall-clock duration of one rollout (agent /run).",
};
const VERIFY_DURATION: Instrument = Instrument {
    name: "gym.verify.duration_ms",
    kind: "histogram",
    unit: "ms",
    description: "Wall-clock duration of one verification (resources /verify).",
};
const VERIFY_SUCCESS_RATE: Instrument = Instrument {
    name: "gym.verify.success_rate",
    kind: "gauge",
    unit: "",
    description: "Fraction of /verify calls whose handler completed, since the tracer attached.",
};
const VERIFY_CALLS: Instrument = Instrument {
    name: "gym.verify.calls",
    kind: "counter",
    unit: "",
    description: "/verify calls, by whether the handler completed (succeeded).",
};

const GEN_AI_DURATION: Instrument = Instrument {
    name: "gen_ai.client.operation.duration",
    kind: "histogram",
    unit: "s",
    description: "Duration of calls to OpenAI-compatible endpoints (GenAI semantic conventions).",
};
const GEN_AI_TOKENS: Instrument = Instrument {
    name: "gen_ai.client.token.usage",
    kind: "histogram",
    unit: "{token}",
    description: "Tokens a model call used, by gen_ai.token.type (input, output), from its response's usage.",
};

const PHASE_DURATION: Instrument = Instrument {
    name: "gym.rollout.phase.duration",
    kind: "histogram",
    unit: "s",
    description: "A completed rollout's time on its critical path in each phase (gym.rollout.phase: model, tool, verify, queue, external, agent), per agent server.",
};
const QUEUE_DELAY: Instrument = Instrument {
    name: "gym.server.queue_delay",
    kind: "histogram",
    unit: "s",
    description: "How long a rollout's request waited between a traced client's first write and this server's first read, by http.route.",
};
const LOOP_UTILIZATION: Instrument = Instrument {
    name: "gym.server.loop.utilization",
    kind: "gauge",
    unit: "1",
    description: "The share of the last second the server's event-loop (main) thread was on a CPU, from /proc.",
};
const ROLLOUTS_IN_FLIGHT: Instrument = Instrument {
    name: "gym.rollouts.in_flight",
    kind: "gauge",
    unit: "{rollout}",
    description: "Rollouts (/run requests) an agent server is handling now.",
};
const STRAGGLERS: Instrument = Instrument {
    name: "gym.rollouts.stragglers",
    kind: "counter",
    unit: "{rollout}",
    description: "Rollouts that took more than 3x the median of their agent server's completed rollouts (once 20 completed).",
};

pub const INSTRUMENTS: [&Instrument; 13] = [
    &SERVER_DURATION,
    &CLIENT_DURATION,
    &ROLLOUT_DURATION,
    &VERIFY_DURATION,
    &VERIFY_SUCCESS_RATE,
    &VERIFY_CALLS,
    &GEN_AI_DURATION,
    &GEN_AI_TOKENS,
    &PHASE_DURATION,
    &QUEUE_DELAY,
    &LOOP_UTILIZATION,
    &ROLLOUTS_IN_FLIGHT,
    &STRAGGLERS,
];

/// Bucket boundaries of the rollout-level durations (phases, queueing), in seconds: Gym's
/// rollouts take from milliseconds to minutes.
const ROLLOUT_BOUNDARIES_S: [f64; 15] = [
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// The levels a traced process's gauges show, set each second by the driver.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ServerLevels {
    pub loop_utilization: Option<f64>,
    /// An agent server's rollouts in flight (none for other servers).
    pub rollouts_in_flight: Option<u64>,
}

/// [`ServerLevels`] as the observable gauges read them (an absent value: not observed).
#[derive(Debug)]
struct LevelCells {
    loop_utilization_bits: AtomicU64,
    rollouts_in_flight: AtomicU64,
}

const ABSENT: u64 = u64::MAX;

impl Default for LevelCells {
    fn default() -> Self {
        Self {
            loop_utilization_bits: AtomicU64::new(ABSENT),
            rollouts_in_flight: AtomicU64::new(ABSENT),
        }
    }
}

fn register_level_instruments(
    meter: &Meter,
    cells: &Arc<LevelCells>,
    server_name: Option<&KeyValue>,
) {
    let attributes: Vec<KeyValue> = server_name.into_iter().cloned().collect();
    let (utilization, utilization_attributes) = (cells.clone(), attributes.clone());
    meter
        .f64_observable_gauge(LOOP_UTILIZATION.name)
        .with_unit(LOOP_UTILIZATION.unit)
        .with_description(LOOP_UTILIZATION.description)
        .with_callback(move |observer| {
            let bits = utilization.loop_utilization_bits.load(Ordering::Relaxed);
            if bits != ABSENT {
                observer.observe(f64::from_bits(bits), &utilization_attributes);
            }
        })
        .build();
    let in_flight = cells.clone();
    meter
        .u64_observable_gauge(ROLLOUTS_IN_FLIGHT.name)
        .with_unit(ROLLOUTS_IN_FLIGHT.unit)
        .with_description(ROLLOUTS_IN_FLIGHT.description)
        .with_callback(move |observer| {
            let count = in_flight.rollouts_in_flight.load(Ordering::Relaxed);
            if count != ABSENT {
                observer.observe(count, &attributes);
            }
        })
        .build();
}

/// Bucket boundaries the GenAI semantic conventions advise for
/// `gen_ai.client.operation.duration`, in seconds.
const GEN_AI_DURATION_BOUNDARIES_S: [f64; 14] = [
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];
/// ... and for `gen_ai.client.token.usage`.
const GEN_AI_TOKEN_BOUNDARIES: [f64; 14] = [
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0, 67108864.0,
];

/// Bucket boundaries the OTel HTTP semantic conventions specify for
/// `http.server.request.duration`, in seconds.
pub const HTTP_DURATION_BOUNDARIES_S: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];

struct ServiceMetrics {
    provider: SdkMeterProvider,
    /// `nemo.gym.server.name`, when the process is a Gym server.
    server_name: Option<KeyValue>,
    server_duration: Histogram<f64>,
    client_duration: Histogram<f64>,
    rollout_duration: Histogram<f64>,
    verify_duration: Histogram<f64>,
    gen_ai_duration: Histogram<f64>,
    gen_ai_tokens: Histogram<u64>,
    /// Read by the observable `gym.verify.calls` and `gym.verify.success_rate`.
    verify_tally: Arc<VerifyTally>,
    /// Read by the observable `gym.server.loop.utilization` and `gym.rollouts.in_flight`.
    levels: Arc<LevelCells>,
    phase_duration: Histogram<f64>,
    queue_delay: Histogram<f64>,
    stragglers: opentelemetry::metrics::Counter<u64>,
    /// The `gym.*` durations bound to `server_name`, from the first request of each.
    rollout_bound: Option<BoundHistogram<f64>>,
    verify_bound: Option<BoundHistogram<f64>>,
    server_series: BoundSeries<ServerSeries>,
    model_durations: BoundSeries<(ModelSeries, OutcomeKey)>,
    model_tokens: BoundSeries<(ModelSeries, &'static str), u64>,
    client_series: HashMap<ClientSeries, ClientSeriesGroup>,
    /// How many histograms `client_series` holds, over all its groups.
    client_series_bound: usize,
}

impl ServiceMetrics {
    /// A `gym.*` duration (ms), bound to the process's server name on first use (an
    /// instrument never recorded exports nothing, as Gym's).
    fn record_group(&mut self, group: SpanGroup, elapsed_ms: f64) {
        let (histogram, bound) = match group {
            SpanGroup::Rollout => (&self.rollout_duration, &mut self.rollout_bound),
            SpanGroup::Verify => (&self.verify_duration, &mut self.verify_bound),
            _ => return,
        };
        let server_name: Vec<KeyValue> = match bound {
            Some(bound) => return bound.record(elapsed_ms),
            None => self.server_name.iter().cloned().collect(),
        };
        bound
            .insert(histogram.bind(&server_name))
            .record(elapsed_ms);
    }

    /// `http.client.request.duration` of one call.
    fn record_client(
        &mut self,
        exchange: &HttpExchange,
        peer_service: Option<&str>,
        elapsed_s: f64,
        scratch: &mut Vec<KeyValue>,
    ) {
        let key = ClientSeries {
            method: registered_method_or_other(&exchange.request.method),
            peer: exchange.peer,
            outcome: OutcomeKey::of(&exchange.outcome),
        };
        let bound = self.client_series.get(&key).and_then(|group| {
            group
                .iter()
                .find(|(name, _)| name.as_deref() == peer_service)
        });
        if let Some((_, bound)) = bound {
            return bound.record(elapsed_s);
        }
        client_attributes(exchange, peer_service, scratch);
        if self.client_series_bound < MAX_BOUND_SERIES {
            let bound = self.client_duration.bind(scratch);
            bound.record(elapsed_s);
            let group = self.client_series.entry(key).or_default();
            group.push((peer_service.map(Box::from), bound));
            self.client_series_bound += 1;
        } else {
            self.client_duration.record(elapsed_s, scratch);
        }
    }
}

fn registered_method_or_other(method: &str) -> &'static str {
    attr::registered_method(method).unwrap_or("_OTHER")
}

/// The attributes of `http.client.request.duration`, into `attributes` (cleared first).
fn client_attributes(
    exchange: &HttpExchange,
    peer_service: Option<&str>,
    attributes: &mut Vec<KeyValue>,
) {
    attributes.clear();
    attributes.push(method_attribute(&exchange.request.method));
    if let Some(peer) = exchange.peer {
        attributes.push(KeyValue::new(attr::SERVER_ADDRESS, peer.ip().to_string()));
        attributes.push(KeyValue::new(attr::SERVER_PORT, peer.port() as i64));
    }
    if let Some(name) = peer_service {
        attributes.push(KeyValue::new(attr::PEER_SERVICE, name.to_string()));
    }
    push_outcome(&exchange.outcome, attributes);
}

/// The attributes of `http.server.request.duration` after the server name.
fn server_attributes(exchange: &HttpExchange, route: &RouteName, attributes: &mut Vec<KeyValue>) {
    attributes.extend([
        method_attribute(&exchange.request.method),
        KeyValue::new(attr::URL_SCHEME, url_scheme(exchange)),
        KeyValue::new(
            attr::NETWORK_PROTOCOL_VERSION,
            if exchange.request.version_minor == 0 {
                "1.0"
            } else {
                "1.1"
            },
        ),
    ]);
    if let RouteName::Template(route) = route {
        attributes.push(KeyValue::new(attr::HTTP_ROUTE, route.clone()));
    }
    push_outcome(&exchange.outcome, attributes);
}

/// /verify calls seen since attach, and how many succeeded: the success rate is the
/// cumulative fraction, as Gym defines it (per process, since it started). Counted here and
/// read by observable instruments when metrics are collected, so that a /verify costs two
/// increments instead of two more SDK calls.
#[derive(Debug, Default)]
struct VerifyTally {
    total: AtomicU64,
    succeeded: AtomicU64,
}

impl VerifyTally {
    fn counts(&self) -> (u64, u64) {
        // `succeeded` first: never more than the `total` read after it.
        let succeeded = self.succeeded.load(Ordering::Relaxed);
        (self.total.load(Ordering::Relaxed).max(succeeded), succeeded)
    }
}

/// `gym.verify.success_rate` and `gym.verify.calls`, observed from `tally` with the
/// process's `server_name` (nothing before the first /verify, as the synchronous
/// instruments they replace).
fn register_verify_instruments(
    meter: &Meter,
    tally: &Arc<VerifyTally>,
    server_name: Option<&KeyValue>,
) {
    let attributes: Vec<KeyValue> = server_name.into_iter().cloned().collect();
    let (rate_tally, rate_attributes) = (tally.clone(), attributes.clone());
    meter
        .f64_observable_gauge(VERIFY_SUCCESS_RATE.name)
        .with_description(VERIFY_SUCCESS_RATE.description)
        .with_callback(move |observer| {
            let (total, succeeded) = rate_tally.counts();
            if total > 0 {
                observer.observe(succeeded as f64 / total as f64, &rate_attributes);
            }
        })
        .build();
    let calls_tally = tally.clone();
    meter
        .u64_observable_counter(VERIFY_CALLS.name)
        .with_description(VERIFY_CALLS.description)
        .with_callback(move |observer| {
            let (total, succeeded) = calls_tally.counts();
            for (count, outcome) in [(succeeded, true), (total - succeeded, false)] {
                if count > 0 {
                    let mut with_outcome = attributes.clone();
                    with_outcome.push(KeyValue::new("succeeded", outcome));
                    observer.observe(count, &with_outcome);
                }
            }
        })
        .build();
}

/// Where the per-request metrics go: the agent's OTel instruments, or nothing (the fuzzer).
pub trait RequestMetrics {
    fn record(
        &mut self,
        service: &ServiceIdentity,
        exchange: &HttpExchange,
        meaning: &RequestMeaning,
        peer_service: Option<&str>,
    );

    /// The process exited: its instruments can go.
    fn remove_service(&mut self, pid: u32);

    /// A rollout the insight stage completed.
    fn record_rollout(&mut self, _rollout: &RolloutSummary) {}

    /// A traced process's levels for the gauges, each second.
    fn set_levels(&mut self, _pid: u32, _levels: ServerLevels) {}
}

/// Records nothing.
impl RequestMetrics for () {
    fn record(
        &mut self,
        _: &ServiceIdentity,
        _: &HttpExchange,
        _: &RequestMeaning,
        _: Option<&str>,
    ) {
    }

    fn remove_service(&mut self, _: u32) {}
}

pub struct Metrics {
    target: ExportTarget,
    interval: Duration,
    services: HashMap<u32, ServiceMetrics>,
    /// Where the providers' periodic readers and exporters run.
    runtime: tokio::runtime::Handle,
    /// The attributes of the measurement being recorded (kept to reuse its allocation).
    scratch: Vec<KeyValue>,
    /// Where failed exports are counted.
    status: Arc<ExportStatus>,
}

impl Metrics {
    pub fn new(
        target: ExportTarget,
        interval: Duration,
        runtime: tokio::runtime::Handle,
        status: Arc<ExportStatus>,
    ) -> Self {
        Self {
            target,
            interval,
            services: HashMap::new(),
            runtime,
            scratch: Vec::new(),
            status,
        }
    }

    /// Creates the provider of a traced process, on its first request: forked helpers that
    /// never serve HTTP cost nothing.
    fn add_service(&mut self, service: &ServiceIdentity) -> Result<()> {
        let _runtime = self.runtime.enter();
        let provider =
            meter_provider(&self.target, &service.resource, self.interval, &self.status)?;
        let meter = provider.meter("gym-tracer");
        let server_duration = meter
            .f64_histogram(SERVER_DURATION.name)
            .with_unit(SERVER_DURATION.unit)
            .with_description(SERVER_DURATION.description)
            .with_boundaries(HTTP_DURATION_BOUNDARIES_S.to_vec())
            .build();
        let client_duration = meter
            .f64_histogram(CLIENT_DURATION.name)
            .with_unit(CLIENT_DURATION.unit)
            .with_description(CLIENT_DURATION.description)
            .with_boundaries(HTTP_DURATION_BOUNDARIES_S.to_vec())
            .build();
        let rollout_duration = meter
            .f64_histogram(ROLLOUT_DURATION.name)
            .with_unit(ROLLOUT_DURATION.unit)
            .with_description(ROLLOUT_DURATION.description)
            .build();
        let verify_duration = meter
            .f64_histogram(VERIFY_DURATION.name)
            .with_unit(VERIFY_DURATION.unit)
            .with_description(VERIFY_DURATION.description)
            .build();
        let gen_ai_duration = meter
            .f64_histogram(GEN_AI_DURATION.name)
            .with_unit(GEN_AI_DURATION.unit)
            .with_description(GEN_AI_DURATION.description)
            .with_boundaries(GEN_AI_DURATION_BOUNDARIES_S.to_vec())
            .build();
        let gen_ai_tokens = meter
            .u64_histogram(GEN_AI_TOKENS.name)
            .with_unit(GEN_AI_TOKENS.unit)
            .with_description(GEN_AI_TOKENS.description)
            .with_boundaries(GEN_AI_TOKEN_BOUNDARIES.to_vec())
            .build();
        let server_name = service
            .server_name()
            .map(|name| KeyValue::new(attr::GYM_SERVER_NAME, Arc::<str>::from(name)));
        let verify_tally = Arc::new(VerifyTally::default());
        register_verify_instruments(&meter, &verify_tally, server_name.as_ref());
        let levels = Arc::new(LevelCells::default());
        register_level_instruments(&meter, &levels, server_name.as_ref());
        let phase_duration = meter
            .f64_histogram(PHASE_DURATION.name)
            .with_unit(PHASE_DURATION.unit)
            .with_description(PHASE_DURATION.description)
            .with_boundaries(ROLLOUT_BOUNDARIES_S.to_vec())
            .build();
        let queue_delay = meter
            .f64_histogram(QUEUE_DELAY.name)
            .with_unit(QUEUE_DELAY.unit)
            .with_description(QUEUE_DELAY.description)
            .with_boundaries(ROLLOUT_BOUNDARIES_S.to_vec())
            .build();
        let stragglers = meter
            .u64_counter(STRAGGLERS.name)
            .with_unit(STRAGGLERS.unit)
            .with_description(STRAGGLERS.description)
            .build();
        self.services.insert(
            service.pid,
            ServiceMetrics {
                provider,
                server_name,
                server_duration,
                client_duration,
                rollout_duration,
                verify_duration,
                gen_ai_duration,
                gen_ai_tokens,
                verify_tally,
                levels,
                phase_duration,
                queue_delay,
                stragglers,
                rollout_bound: None,
                verify_bound: None,
                server_series: BoundSeries::default(),
                model_durations: BoundSeries::default(),
                model_tokens: BoundSeries::default(),
                client_series: HashMap::new(),
                client_series_bound: 0,
            },
        );
        Ok(())
    }

    /// Stops a process's provider after one last export, off the runtime's workers: the
    /// process has exited, and nothing of it is kept.
    fn remove_service_now(&mut self, pid: u32) {
        if let Some(service) = self.services.remove(&pid) {
            self.runtime.spawn_blocking(move || {
                if let Err(error) = service.provider.shutdown() {
                    tracing::warn!(pid, "final metric export for pid {pid} failed: {error}");
                }
            });
        }
    }

    /// The metrics of a process, made on first use; `None` (logged) when they cannot be.
    fn service(&mut self, identity: &ServiceIdentity) -> Option<&mut ServiceMetrics> {
        if !self.services.contains_key(&identity.pid)
            && let Err(error) = self.add_service(identity)
        {
            tracing::warn!(
                pid = identity.pid,
                "no metrics for pid {}: {error:#}",
                identity.pid
            );
            return None;
        }
        self.services.get_mut(&identity.pid)
    }

    /// A completed rollout's phases and straggler flag (on its agent server), and its calls'
    /// queueing (on each callee).
    fn record_rollout_now(&mut self, rollout: &RolloutSummary) {
        if let Some(service) = self.service(&rollout.agent) {
            for phase in Phase::ALL {
                let mut attributes: Vec<KeyValue> = service.server_name.iter().cloned().collect();
                attributes.push(KeyValue::new("gym.rollout.phase", phase.as_str()));
                service
                    .phase_duration
                    .record(rollout.phases.get(phase) as f64 / 1e9, &attributes);
            }
            if rollout.straggler {
                let attributes: Vec<KeyValue> = service.server_name.iter().cloned().collect();
                service.stragglers.add(1, &attributes);
            }
        }
        for (server, route, delay_ns) in &rollout.queue_delays {
            if let Some(service) = self.service(server) {
                let mut attributes: Vec<KeyValue> = service.server_name.iter().cloned().collect();
                if let Some(route) = route {
                    attributes.push(KeyValue::new(attr::HTTP_ROUTE, route.to_string()));
                }
                service
                    .queue_delay
                    .record(*delay_ns as f64 / 1e9, &attributes);
            }
        }
    }

    fn set_levels_now(&mut self, pid: u32, levels: ServerLevels) {
        if let Some(service) = self.services.get(&pid) {
            let cells = &service.levels;
            cells.loop_utilization_bits.store(
                levels.loop_utilization.map_or(ABSENT, f64::to_bits),
                Ordering::Relaxed,
            );
            cells.rollouts_in_flight.store(
                levels.rollouts_in_flight.unwrap_or(ABSENT),
                Ordering::Relaxed,
            );
        }
    }

    /// `peer_service`: the Gym server name of a call's peer, when known.
    fn record_now(
        &mut self,
        identity: &ServiceIdentity,
        exchange: &HttpExchange,
        meaning: &RequestMeaning,
        peer_service: Option<&str>,
    ) {
        if self.service(identity).is_none() {
            return;
        }
        let Some(service) = self.services.get_mut(&identity.pid) else {
            return;
        };
        let elapsed_ns = exchange.end_ns.saturating_sub(exchange.start_ns) as f64;
        // Once per request on the hot path: a series seen before records into its bound
        // histogram; attributes are built only for a new one.
        let attributes = &mut self.scratch;
        if exchange.role == Role::Client {
            service.record_client(exchange, peer_service, elapsed_ns / 1e9, attributes);
            if let Some(call) = &exchange.model_call {
                record_model_call(service, exchange, call, elapsed_ns / 1e9, attributes);
            }
            return;
        }
        if let Some(group) = meaning.semantic.map(|semantic| semantic.group) {
            if group == SpanGroup::Verify {
                // Succeeded = the handler completed: a reward of 0 is a success, a 5xx or a
                // dropped connection is not.
                let succeeded = matches!(
                    &exchange.outcome,
                    Outcome::Response(response) if response.status < 500
                );
                let tally = &service.verify_tally;
                tally.total.fetch_add(1, Ordering::Relaxed);
                tally
                    .succeeded
                    .fetch_add(u64::from(succeeded), Ordering::Relaxed);
            }
            service.record_group(group, elapsed_ns / 1e6);
        }
        let key = ServerSeries {
            method: registered_method_or_other(&exchange.request.method),
            tls: exchange.tls,
            http_1_0: exchange.request.version_minor == 0,
            route: match &meaning.route {
                RouteName::Template(route) => Some(route.clone()),
                _ => None,
            },
            outcome: OutcomeKey::of(&exchange.outcome),
        };
        let server_name = &service.server_name;
        service.server_series.record(
            &service.server_duration,
            key,
            elapsed_ns / 1e9,
            attributes,
            |attributes| {
                attributes.extend(server_name.iter().cloned());
                server_attributes(exchange, &meaning.route, attributes);
            },
        );
    }

    /// Exports every provider's final values and stops them, within `timeout`.
    pub async fn shutdown(self, timeout: Duration) {
        let providers: Vec<SdkMeterProvider> =
            self.services.into_values().map(|s| s.provider).collect();
        shutdown_providers(providers, timeout).await;
    }
}
impl RequestMetrics for Metrics {
    fn record(
        &mut self,
        service: &ServiceIdentity,
        exchange: &HttpExchange,
        meaning: &RequestMeaning,
        peer_service: Option<&str>,
    ) {
        self.record_now(service, exchange, meaning, peer_service);
    }

    fn remove_service(&mut self, pid: u32) {
        self.remove_service_now(pid);
    }

    fn record_rollout(&mut self, rollout: &RolloutSummary) {
        self.record_rollout_now(rollout);
    }

    fn set_levels(&mut self, pid: u32, levels: ServerLevels) {
        self.set_levels_now(pid, levels);
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::Value;
    use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
    use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader};

    use super::*;

    /// (status attribute, count) of every point of the one histogram `exporter` holds.
    fn points(exporter: &InMemoryMetricExporter) -> Vec<(i64, u64)> {
        let exported = exporter
            .get_finished_metrics()
            .expect("metrics were exported");
        let last = exported.last().expect("one export");
        let metric = last
            .scope_metrics()
            .next()
            .unwrap()
            .metrics()
            .next()
            .unwrap();
        let AggregatedMetrics::F64(MetricData::Histogram(histogram)) = metric.data() else {
            panic!("not an f64 histogram");
        };
        let mut points: Vec<(i64, u64)> = histogram
            .data_points()
            .map(|point| {
                let status = point
                    .attributes()
                    .find(|kv| kv.key.as_str() == "status")
                    .map(|kv| match &kv.value {
                        Value::I64(status) => *status,
                        other => panic!("status is {other:?}"),
                    })
                    .expect("every point has the status");
                (status, point.count())
            })
            .collect();
        points.sort();
        points
    }

    #[test]
    fn bound_series_record_each_series_once_bound_and_past_the_cap_through_the_sdk() {
        let exporter = InMemoryMetricExporter::default();
        let provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(exporter.clone()).build())
            .build();
        let histogram = provider.meter("test").f64_histogram("duration").build();
        let mut series = BoundSeries::default();
        let mut scratch = Vec::new();
        let mut filled = 0;
        let statuses = (0..MAX_BOUND_SERIES as i64 + 2).chain([0, 1, MAX_BOUND_SERIES as i64]);
        for status in statuses {
            series.record(&histogram, status, 0.5, &mut scratch, |attributes| {
                filled += 1;
                attributes.push(KeyValue::new("status", status));
            });
        }
        // Attributes were built for each new series and for each request past the cap.
        assert_eq!(filled, MAX_BOUND_SERIES + 2 + 1);
        assert_eq!(series.by_key.len(), MAX_BOUND_SERIES);
        provider.force_flush().unwrap();
        let points = points(&exporter);
        assert_eq!(points.len(), MAX_BOUND_SERIES + 2, "one point per series");
        for (status, count) in points {
            let expected = if [0, 1, MAX_BOUND_SERIES as i64].contains(&status) {
                2
            } else {
                1
            };
            assert_eq!(count, expected, "status {status}");
        }
    }
}
