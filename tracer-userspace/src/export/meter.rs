//! Meter providers, one per resource, reading into the exporter the target names: stdout
//! lines (JSON, or for people next to `--output tree`) or OTLP.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use opentelemetry_sdk::metrics::SdkMeterProvider;

use super::json::StdoutMetricExporter;
use super::otlp::metrics::CountedMetricExporter;
use super::{ExportTarget, StdoutFormat};
use crate::export::status::ExportStatus;

/// Builds a meter provider with `resource` that exports to `target` every `interval` and
/// once more at shutdown; failed OTLP exports are counted in `status`. Must be called
/// inside the tokio runtime.
pub fn meter_provider(
    target: &ExportTarget,
    resource: &opentelemetry_sdk::Resource,
    interval: Duration,
    status: &Arc<ExportStatus>,
) -> Result<SdkMeterProvider> {
    use opentelemetry_sdk::metrics::periodic_reader_with_async_runtime::PeriodicReader;
    use opentelemetry_sdk::runtime::Tokio;
    let mut builder = SdkMeterProvider::builder().with_resource(resource.clone());
    if let Some(format) = target.stdout {
        let exporter = StdoutMetricExporter {
            human: format == StdoutFormat::Tree,
        };
        builder = builder.with_reader(
            PeriodicReader::builder(exporter, Tokio)
                .with_interval(interval)
                .build(),
        );
    }
    if let Some(options) = &target.otlp {
        let exporter = CountedMetricExporter::new(options, status.clone())?;
        builder = builder.with_reader(
            PeriodicReader::builder(exporter, Tokio)
                .with_interval(interval)
                .build(),
        );
    }
    // With neither, instruments record into a provider that nothing reads.
    let provider = builder.build();
    Ok(provider)
}

/// Stops `providers` after their final export, giving up after `timeout` (a collector that
/// is down would otherwise hold the agent for the exporter's retries). Shutdown blocks until
/// the export is done, so it runs off the runtime's workers; one left behind is abandoned
/// when the runtime stops (`main` does not wait for it).
pub async fn shutdown_providers(providers: Vec<SdkMeterProvider>, timeout: Duration) {
    if providers.is_empty() {
        return;
    }
    let count = providers.len();
    let shutdown = tokio::task::spawn_blocking(move || {
        for provider in providers {
            if let Err(error) = provider.shutdown() {
                tracing::warn!("final metric export failed: {error}");
            }
        }
    });
    if tokio::time::timeout(timeout, shutdown).await.is_err() {
        tracing::warn!(
            "final metric export failed: not done within --shutdown-timeout ({} ms) for \
             {count} meter provider(s); their last values are not exported",
            timeout.as_millis()
        );
    }
}
