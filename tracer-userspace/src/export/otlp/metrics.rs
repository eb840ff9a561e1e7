//! The OTLP metric exporter the meter providers read into.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::Temporality;
use opentelemetry_sdk::metrics::data::ResourceMetrics;
use opentelemetry_sdk::metrics::exporter::PushMetricExporter;

use super::options::OtlpOptions;
use super::transport::otlp_metric_exporter;
use crate::export::status::ExportStatus;

/// The OTLP metric exporter, counting its failures in `status` (the SDK only logs them).
#[derive(Debug)]
pub struct CountedMetricExporter {
    inner: opentelemetry_otlp::MetricExporter,
    status: Arc<ExportStatus>,
}

impl CountedMetricExporter {
    pub fn new(options: &OtlpOptions, status: Arc<ExportStatus>) -> Result<Self> {
        Ok(Self {
            inner: otlp_metric_exporter(options)?,
            status,
        })
    }
}

impl PushMetricExporter for CountedMetricExporter {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let result = self.inner.export(metrics).await;
        if result.is_err() {
            self.status.record_metric_export_failure();
        }
        result
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn temporality(&self) -> Temporality {
        self.inner.temporality()
    }
}
