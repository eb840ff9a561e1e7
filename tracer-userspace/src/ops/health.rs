//! Optional local HTTP endpoint for probes and scrapers: `/healthz` (probes attached, exporter
//! reachable), `/metrics` (the agent's own counters in Prometheus text format) and
//! `/rollouts` (the live view of rollouts in flight, JSON; what `gym-tracer top` shows).
//!
//! Deliberately tiny: a few GETs a minute from a kubelet or Prometheus, answered from a
//! snapshot the pipeline publishes, so serving them never touches the hot path. Connections
//! are capped and time out, so a misbehaving client cannot make the agent hold memory.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::export::status::ExportStatus;
use crate::ops::counters::CounterSnapshot;

/// Requests served at once; more connections are closed at once.
const MAX_CONNECTIONS: usize = 16;
/// A request head larger than this is refused.
const MAX_REQUEST_BYTES: usize = 8192;
/// A client has this long to send its request and read the answer.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(5);

/// Levels the pipeline publishes with each snapshot (not counters: they go up and down).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gauges {
    pub processes_traced: u64,
    pub connections_tracked: u64,
    pub spans_pending: u64,
    /// The agent's resident set size.
    pub resident_memory_bytes: u64,
}

/// State shared between the pipeline (writer) and the endpoint (reader).
#[derive(Debug, Default)]
pub struct Health {
    probes_attached: AtomicBool,
    snapshot: Mutex<(CounterSnapshot, Gauges)>,
    /// The last live view of rollouts, as JSON (`crate::insight::view::RolloutsView`).
    rollouts: Mutex<Arc<str>>,
    pub export: Arc<ExportStatus>,
}

impl Health {
    pub fn set_probes_attached(&self, attached: bool) {
        self.probes_attached.store(attached, Ordering::Relaxed);
    }

    pub fn publish(&self, stats: &CounterSnapshot, gauges: Gauges) {
        let mut snapshot = self
            .snapshot
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        snapshot.0.clone_from(stats);
        snapshot.1 = gauges;
    }

    /// The live view of rollouts, as the pipeline last made it.
    pub fn publish_rollouts(&self, json: String) {
        *self
            .rollouts
            .lock()
            .unwrap_or_else(|poison| poison.into_inner()) = json.into();
    }

    fn rollouts_body(&self) -> Arc<str> {
        let body = self
            .rollouts
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone();
        if body.is_empty() {
            // Before the first publish: an empty view, not an empty body.
            return r#"{"in_flight":0,"rollouts":[],"completed":{"count":0,"p50_s":null,"p90_s":null,"max_s":null},"servers":[]}"#.into();
        }
        body
    }

    /// The last published counters and levels.
    pub fn snapshot(&self) -> (CounterSnapshot, Gauges) {
        self.snapshot
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone()
    }

    fn healthy(&self) -> bool {
        self.probes_attached.load(Ordering::Relaxed) && self.export.reachable()
    }

    /// The `/healthz` body: JSON, so a person with curl and a probe both can read it.
    fn healthz_body(&self) -> String {
        let last_error = self
            .export
            .last_error
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone();
        serde_json::json!({
            "status": if self.healthy() { "ok" } else { "unhealthy" },
            "probes_attached": self.probes_attached.load(Ordering::Relaxed),
            "exporter": {
                "reachable": self.export.reachable(),
                "consecutive_failures": self.export.consecutive_failures.load(Ordering::Relaxed),
                "last_error": last_error,
            },
        })
        .to_string()
    }

    /// The `/metrics` body, Prometheus text exposition format 0.0.4.
    pub fn prometheus_text(&self) -> String {
        let (stats, gauges) = self.snapshot();
        let mut out = String::with_capacity(4096);
        let mut counter = |name: &str, value: u64| {
            let _ = writeln!(out, "# TYPE gym_tracer_{name}_total counter");
            let _ = writeln!(out, "gym_tracer_{name}_total {value}");
        };
        for (name, value) in stats.counters() {
            counter(name, value);
        }
        for (name, value) in self.export.counters() {
            counter(name, value);
        }
        counter("metric_exports_failed", self.export.metric_exports_failed());
        let _ = writeln!(out, "# TYPE gym_tracer_events_lost_by_cpu_total counter");
        for (cpu, lost) in stats.events_lost_by_cpu.iter().enumerate() {
            let _ = writeln!(
                out,
                "gym_tracer_events_lost_by_cpu_total{{cpu=\"{cpu}\"}} {lost}"
            );
        }
        let gauge_lines = [
            ("processes_traced", gauges.processes_traced),
            ("connections_tracked", gauges.connections_tracked),
            ("spans_pending", gauges.spans_pending),
            ("spans_buffered", self.export.spans_buffered()),
            ("resident_memory_bytes", gauges.resident_memory_bytes),
            (
                "probes_attached",
                u64::from(self.probes_attached.load(Ordering::Relaxed)),
            ),
            ("exporter_reachable", u64::from(self.export.reachable())),
        ];
        for (name, value) in gauge_lines {
            let _ = writeln!(out, "# TYPE gym_tracer_{name} gauge");
            let _ = writeln!(out, "gym_tracer_{name} {value}");
        }
        let _ = writeln!(out, "# TYPE gym_tracer_build_info gauge");
        let _ = writeln!(
            out,
            "gym_tracer_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        out
    }
}

/// Binds now (so a taken port fails the start with a clear error) and serves in the
/// background until the runtime stops.
pub async fn serve(listen: SocketAddr, health: Arc<Health>) -> Result<SocketAddr> {
    let listener = TcpListener::bind(listen).await.with_context(|| {
        format!("--health-listen {listen}: cannot listen there (port taken, or not an address of this host?)")
    })?;
    let bound = listener.local_addr()?;
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                continue; // dropping the stream closes it
            };
            let health = health.clone();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(CONNECTION_TIMEOUT, answer(stream, &health)).await;
                drop(slot);
            });
        }
    });
    Ok(bound)
}

async fn answer(mut stream: TcpStream, health: &Health) -> std::io::Result<()> {
    let mut buffer = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let (method, path) = loop {
        let read = stream.read(&mut chunk).await?;
        if read == 0 {
            return Ok(());
        }
        buffer.extend_from_slice(&chunk[..read]);
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&buffer) {
            Ok(httparse::Status::Complete(_)) => {
                break (
                    request.method.unwrap_or_default().to_owned(),
                    request.path.unwrap_or_default().to_owned(),
                );
            }
            Ok(httparse::Status::Partial) if buffer.len() < MAX_REQUEST_BYTES => continue,
            _ => {
                return respond(
                    &mut stream,
                    "400 Bad Request",
                    "text/plain",
                    "bad request\n",
                )
                .await;
            }
        }
    };
    let path = path.split('?').next().unwrap_or_default();
    if method != "GET" && method != "HEAD" {
        return respond(
            &mut stream,
            "405 Method Not Allowed",
            "text/plain",
            "GET only\n",
        )
        .await;
    }
    match path {
        "/healthz" => {
            let status = if health.healthy() {
                "200 OK"
            } else {
                "503 Service Unavailable"
            };
            respond(
                &mut stream,
                status,
                "application/json",
                &health.healthz_body(),
            )
            .await
        }
        "/metrics" => {
            let body = health.prometheus_text();
            respond(&mut stream, "200 OK", "text/plain; version=0.0.4", &body).await
        }
        "/rollouts" => {
            let body = health.rollouts_body();
            respond(&mut stream, "200 OK", "application/json", &body).await
        }
        _ => {
            respond(
                &mut stream,
                "404 Not Found",
                "text/plain",
                "try /healthz, /metrics or /rollouts\n",
            )
            .await
        }
    }
}

async fn respond(
    stream: &mut TcpStream,
    status: &str,
    content_type: &str,
    body: &str,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::status::SpanDrop;

    #[test]
    fn unhealthy_until_probes_attach_and_while_exports_fail() {
        let health = Health::default();
        assert!(!health.healthy(), "nothing attached yet");
        health.set_probes_attached(true);
        assert!(health.healthy(), "nothing exported yet counts as reachable");
        health.export.record_failure("connection refused".into());
        health.export.record_dropped(SpanDrop::Rejected, 3);
        assert!(!health.healthy());
        assert!(health.healthz_body().contains("connection refused"));
        health.export.record_success(5, true);
        assert!(health.healthy(), "one success clears it");
        assert_eq!(health.export.spans_exported(), 5);
        assert_eq!(health.export.spans_failed(), 3);
    }

    #[test]
    fn prometheus_text_has_every_counter_once() {
        let health = Health::default();
        let mut stats = CounterSnapshot::default();
        stats.pipeline.events_in = 42;
        health.publish(
            &stats,
            Gauges {
                connections_tracked: 7,
                ..Gauges::default()
            },
        );
        let text = health.prometheus_text();
        assert!(text.contains("gym_tracer_events_in_total 42\n"), "{text}");
        assert!(
            text.contains("gym_tracer_connections_tracked 7\n"),
            "{text}"
        );
        for (name, _) in stats.counters() {
            let line = format!("# TYPE gym_tracer_{name}_total counter\n");
            assert_eq!(text.matches(&line).count(), 1, "{name}");
        }
        for line in text.lines().filter(|line| !line.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').unwrap();
            assert!(name.starts_with("gym_tracer_"), "{line}");
            assert!(value.parse::<u64>().is_ok(), "{line}");
        }
    }
}
