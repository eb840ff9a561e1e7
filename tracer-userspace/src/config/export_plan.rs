//! Where each signal goes. OpenTelemetry configures traces and metrics apart
//! (`OTEL_TRACES_EXPORTER`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, ...), each per-signal
//! setting winning over its generic `OTEL_EXPORTER_OTLP_*` form; a trace-only backend such
//! as Arize Phoenix needs exactly that (it answers metric exports with 405).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};

use crate::config::cli::{Output, RunArgs, SignalExporter};
use crate::export::otlp::Signal;
use crate::export::otlp::options::{
    HeaderList, OtlpCompression, OtlpEndpoint, OtlpOptions, OtlpProtocol, printable_endpoint,
};
use crate::export::{ExportTarget, StdoutFormat};

/// The exporter of each signal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportPlan {
    pub spans: ExportTarget,
    /// The servers' metrics and the agent's own.
    pub metrics: ExportTarget,
}

/// Resolves, and checks, where spans and metrics go (files read, the SDK's environment
/// compared), so that a bad setting fails before anything is loaded into the kernel.
pub fn export_plan(args: &RunArgs) -> Result<ExportPlan> {
    Ok(ExportPlan {
        spans: signal_target(args, Signal::Traces)?,
        metrics: signal_target(args, Signal::Metrics)?,
    })
}

/// One signal's own settings, each unset unless given for that signal.
struct SignalSettings<'a> {
    exporters: &'a [SignalExporter],
    endpoint: Option<&'a String>,
    protocol: Option<OtlpProtocol>,
    headers: Option<&'a HeaderList>,
    timeout: Option<u64>,
    compression: Option<OtlpCompression>,
    ca_file: Option<&'a PathBuf>,
    client_cert: Option<&'a PathBuf>,
    client_key: Option<&'a PathBuf>,
}

fn own_settings(args: &RunArgs, signal: Signal) -> SignalSettings<'_> {
    match signal {
        Signal::Traces => {
            let own = &args.traces;
            SignalSettings {
                exporters: &own.traces_exporter,
                endpoint: own.otlp_traces_endpoint.as_ref(),
                protocol: own.otlp_traces_protocol,
                headers: own.otlp_traces_headers.as_ref(),
                timeout: own.otlp_traces_timeout,
                compression: own.otlp_traces_compression,
                ca_file: own.otlp_traces_ca_file.as_ref(),
                client_cert: own.otlp_traces_client_cert.as_ref(),
                client_key: own.otlp_traces_client_key.as_ref(),
            }
        }
        Signal::Metrics => {
            let own = &args.metrics;
            SignalSettings {
                exporters: &own.metrics_exporter,
                endpoint: own.otlp_metrics_endpoint.as_ref(),
                protocol: own.otlp_metrics_protocol,
                headers: own.otlp_metrics_headers.as_ref(),
                timeout: own.otlp_metrics_timeout,
                compression: own.otlp_metrics_compression,
                ca_file: own.otlp_metrics_ca_file.as_ref(),
                client_cert: own.otlp_metrics_client_cert.as_ref(),
                client_key: own.otlp_metrics_client_key.as_ref(),
            }
        }
    }
}

/// OpenTelemetry's default endpoints, for an `otlp` exporter given none.
fn default_endpoint(protocol: OtlpProtocol) -> &'static str {
    match protocol {
        OtlpProtocol::Grpc => "http://localhost:4317",
        OtlpProtocol::HttpProtobuf => "http://localhost:4318",
    }
}

fn signal_target(args: &RunArgs, signal: Signal) -> Result<ExportTarget> {
    let own = own_settings(args, signal);
    let non_empty = |url: &&String| !url.is_empty();
    let configured = own
        .endpoint
        .filter(non_empty)
        .map(|url| OtlpEndpoint::Signal(url.clone()))
        .or_else(|| {
            args.otlp_endpoint
                .as_ref()
                .filter(non_empty)
                .map(|url| OtlpEndpoint::Base(url.clone()))
        });
    let protocol = own.protocol.unwrap_or(args.otlp_protocol);
    let stdout = match args.output {
        Output::Json => StdoutFormat::JsonLines,
        Output::Tree => StdoutFormat::Tree,
    };
    let wants = |exporter| own.exporters.contains(&exporter);
    if wants(SignalExporter::None) && own.exporters.len() > 1 {
        bail!(
            "--{}-exporter: `none` cannot be combined with another exporter",
            signal.name()
        );
    }
    let (to_otlp, to_stdout) = if own.exporters.is_empty() {
        (configured.is_some(), configured.is_none())
    } else {
        (wants(SignalExporter::Otlp), wants(SignalExporter::Console))
    };
    let stdout = to_stdout.then_some(stdout);
    if !to_otlp {
        return Ok(ExportTarget { otlp: None, stdout });
    }
    let endpoint =
        configured.unwrap_or_else(|| OtlpEndpoint::Base(default_endpoint(protocol).to_owned()));
    let endpoint_flag = match endpoint {
        OtlpEndpoint::Base(_) => "--otlp-endpoint".to_owned(),
        OtlpEndpoint::Signal(_) => format!("--otlp-{}-endpoint", signal.name()),
    };
    let scheme = endpoint.url().split_once("://").map(|(scheme, _)| scheme);
    if !matches!(scheme, Some("http" | "https")) {
        bail!(
            "{endpoint_flag} `{}` must start with http:// or https:// \
             (e.g. http://collector:4317 for gRPC, http://collector:4318 for HTTP)",
            printable_endpoint(endpoint.url())
        );
    }
    let ca_file = own.ca_file.or(args.otlp_ca_file.as_ref()).cloned();
    // The certificate and its key are one setting: the signal's pair, else the generic one.
    let (cert, key, prefix) = if own.client_cert.is_some() || own.client_key.is_some() {
        (
            own.client_cert,
            own.client_key,
            format!("--otlp-{}-", signal.name()),
        )
    } else {
        (
            args.otlp_client_cert.as_ref(),
            args.otlp_client_key.as_ref(),
            "--otlp-".to_owned(),
        )
    };
    let client_identity = match (cert, key) {
        (Some(cert), Some(key)) => Some((cert.clone(), key.clone())),
        (Some(_), None) => bail!("{prefix}client-cert needs {prefix}client-key"),
        (None, Some(_)) => bail!("{prefix}client-key needs {prefix}client-cert"),
        (None, None) => None,
    };
    if (ca_file.is_some() || client_identity.is_some()) && scheme == Some("http") {
        bail!(
            "TLS files are set for {} (a CA file or client certificate) but the endpoint `{}` \
             ({endpoint_flag}) is plain http://; use https:// to reach the collector over TLS",
            signal.name(),
            printable_endpoint(endpoint.url())
        );
    }
    let options = OtlpOptions {
        signal,
        endpoint,
        protocol,
        headers: own
            .headers
            .or(args.otlp_headers.as_ref())
            .cloned()
            .unwrap_or(HeaderList(Vec::new())),
        timeout: Duration::from_millis(own.timeout.unwrap_or(args.otlp_timeout)),
        compression: own.compression.unwrap_or(args.otlp_compression),
        ca_file,
        client_identity,
    };
    // The certificate files' contents and the SDK's own environment variables, as the
    // exporters will read them.
    crate::export::otlp::check_otlp_options(&options)?;
    Ok(ExportTarget {
        otlp: Some(options),
        stdout,
    })
}
