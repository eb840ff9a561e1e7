//! The agent's own log on stderr: `tracing` events, as text for people or one JSON object
//! per line for log collectors, filtered by RUST_LOG.

use std::io::IsTerminal;
use std::sync::OnceLock;

use tracing_subscriber::EnvFilter;

use crate::config::cli::LogFormat;

/// Installs the global subscriber. `auto` picks text on a terminal and JSON otherwise (a
/// pipe, a file, journald, a container log).
pub fn init(format: LogFormat) {
    // Without RUST_LOG: the SDK's own warnings repeat what the agent already reports once
    // per streak of failed exports ("exporting spans failed …"), so only its errors show.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new("info,opentelemetry=error,opentelemetry_sdk=error,opentelemetry_otlp=error")
    });
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stderr().is_terminal(),
    };
    let _ = JSON.set(json);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init();
    } else {
        builder.with_ansi(std::io::stderr().is_terminal()).init();
    }
}

static JSON: OnceLock<bool> = OnceLock::new();

/// Whether the log is JSON lines (for collectors) rather than text (for people): the exit
/// summary is a block of text for people, one record for collectors.
pub fn is_json() -> bool {
    JSON.get().copied().unwrap_or(false)
}
