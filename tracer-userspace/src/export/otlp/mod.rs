//! Export over OTLP, gRPC or HTTP/protobuf: the option types, the transports, the span sink
//! with its retry buffer, and the metric exporter.

pub mod encode;
pub mod environment;
pub mod failure;
pub mod http_spans;
pub mod metrics;
pub mod options;
pub mod outage;
pub mod retry;
pub mod sink;
pub mod transport;

pub use failure::error_chain;
pub use transport::check_otlp_options;

/// What is exported; the OTLP/HTTP path and the SDK's per-signal environment variables
/// follow from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    Traces,
    Metrics,
}

impl Signal {
    pub const ALL: [Signal; 2] = [Signal::Traces, Signal::Metrics];

    /// `traces` or `metrics`, as the OTLP/HTTP path and the variables' names spell it.
    pub fn name(self) -> &'static str {
        match self {
            Signal::Traces => "traces",
            Signal::Metrics => "metrics",
        }
    }

    pub(crate) fn headers_var(self) -> &'static str {
        match self {
            Signal::Traces => opentelemetry_otlp::OTEL_EXPORTER_OTLP_TRACES_HEADERS,
            Signal::Metrics => opentelemetry_otlp::OTEL_EXPORTER_OTLP_METRICS_HEADERS,
        }
    }

    pub(crate) fn compression_var(self) -> &'static str {
        match self {
            Signal::Traces => opentelemetry_otlp::OTEL_EXPORTER_OTLP_TRACES_COMPRESSION,
            Signal::Metrics => opentelemetry_otlp::OTEL_EXPORTER_OTLP_METRICS_COMPRESSION,
        }
    }
}
