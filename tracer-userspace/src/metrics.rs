//! Metrics recorded from HTTP exchanges, one SDK meter provider per traced process.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Result;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Histogram, MeterProvider};
use opentelemetry_sdk::metrics::SdkMeterProvider;

use crate::connections::{HttpExchange, Outcome};
use crate::events::Role;
use crate::export::{ExportTarget, meter_provider};
use crate::identity::ServiceIdentity;

/// Bucket boundaries the OTel HTTP semantic conventions specify for
/// `http.server.request.duration`, in seconds.
pub const HTTP_DURATION_BOUNDARIES_S: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];

struct ServiceMetrics {
    provider: SdkMeterProvider,
    server_duration: Histogram<f64>,
}

pub struct Metrics {
    target: ExportTarget,
    interval: Duration,
    services: HashMap<u32, ServiceMetrics>,
}

impl Metrics {
    pub fn new(target: ExportTarget, interval: Duration) -> Self {
        Self {
            target,
            interval,
            services: HashMap::new(),
        }
    }

    /// Creates the provider of a newly traced process. Inside the tokio runtime.
    pub fn add_service(&mut self, service: &ServiceIdentity) -> Result<()> {
        let provider = meter_provider(&self.target, service, self.interval)?;
        let meter = provider.meter("gym-tracer");
        let server_duration = meter
            .f64_histogram("http.server.request.duration")
            .with_unit("s")
            .with_description("Duration of HTTP server requests.")
            .with_boundaries(HTTP_DURATION_BOUNDARIES_S.to_vec())
            .build();
        self.services.insert(
            service.pid,
            ServiceMetrics {
                provider,
                server_duration,
            },
        );
        Ok(())
    }

    pub fn record(&self, exchange: &HttpExchange) {
        let Some(service) = self.services.get(&exchange.pid) else {
            return;
        };
        if exchange.role != Role::Server {
            return;
        }
        let seconds = exchange.end_ns.saturating_sub(exchange.start_ns) as f64 / 1e9;
        let mut attributes = vec![
            KeyValue::new("http.request.method", exchange.request.method.clone()),
            KeyValue::new("url.scheme", "http"),
            KeyValue::new(
                "network.protocol.version",
                format!("1.{}", exchange.request.version_minor),
            ),
        ];
        match &exchange.outcome {
            Outcome::Response(response) => {
                attributes.push(KeyValue::new(
                    "http.response.status_code",
                    response.status as i64,
                ));
                if response.status >= 500 {
                    attributes.push(KeyValue::new("error.type", response.status.to_string()));
                }
            }
            Outcome::Aborted(reason) => {
                attributes.push(KeyValue::new("error.type", reason.as_error_type()))
            }
        }
        service.server_duration.record(seconds, &attributes);
    }

    /// Exports every provider's final values and stops them.
    pub async fn shutdown(self) {
        let providers: Vec<SdkMeterProvider> =
            self.services.into_values().map(|s| s.provider).collect();
        // Shutdown blocks until the final export is done; keep it off the runtime's workers.
        let _ = tokio::task::spawn_blocking(move || {
            for provider in providers {
                if let Err(error) = provider.shutdown() {
                    eprintln!("gym-tracer: final metric export failed: {error}");
                }
            }
        })
        .await;
    }
}
