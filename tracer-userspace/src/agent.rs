//! The running agent: wires loader → reader → connection table → spans/metrics → exporters,
//! and handles start-up, signals and shutdown.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{SignalKind, signal};

use crate::cli::RunArgs;
use crate::clock::WallClock;
use crate::connections::{ConnectionTable, HttpExchange, TableAction};
use crate::events::{KernelEvent, decode};
use crate::export::{ExportTarget, SpanPipeline};
use crate::identity::ServiceIdentity;
use crate::loader::{LoadOptions, LoadedProbes, preflight};
use crate::metrics::Metrics;
use crate::spans::server_span;
use crate::stats::Stats;

/// Everything downstream of the ring buffer.
struct Pipeline {
    clock: WallClock,
    table: ConnectionTable,
    services: HashMap<u32, Arc<ServiceIdentity>>,
    spans: SpanPipeline,
    metrics: Metrics,
    stats: Stats,
    exchanges: Vec<HttpExchange>,
    actions: Vec<TableAction>,
    exited: Vec<u32>,
}

impl Pipeline {
    fn handle_record(&mut self, bytes: &[u8]) {
        self.stats.events_in += 1;
        let event = match decode(bytes) {
            Ok(event) => event,
            Err(_) => {
                self.stats.events_undecodable += 1;
                return;
            }
        };
        if let KernelEvent::ProcessExit { pid, .. } = event {
            self.exited.push(pid);
        }
        self.table.apply(
            &event,
            &mut self.stats,
            &mut self.exchanges,
            &mut self.actions,
        );
        for exchange in self.exchanges.drain(..) {
            self.stats.exchanges += 1;
            let Some(service) = self.services.get(&exchange.pid) else {
                continue;
            };
            self.metrics.record(&exchange);
            if let Some(span) = server_span(&exchange, service, self.clock) {
                if self.spans.offer(span) {
                    self.stats.spans_queued += 1;
                } else {
                    self.stats.spans_dropped_queue_full += 1;
                }
            }
        }
    }
}

fn check_pids(pids: &[u32]) -> Result<()> {
    for pid in pids {
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            bail!("no process with pid {pid} (is it running, and in this PID namespace?)");
        }
    }
    Ok(())
}

pub async fn run(args: RunArgs) -> Result<()> {
    check_pids(&args.pids)?;
    preflight()?;
    let mut probes = LoadedProbes::load(&LoadOptions {
        capture_bytes: args.capture_bytes,
        ring_buffer_bytes: args.ring_buffer_bytes,
    })?;
    if let Err(why) = &probes.features.socket_addresses {
        eprintln!(
            "gym-tracer: warning: connection addresses are off ({why}); spans will lack client.address"
        );
    }
    // SAFETY: the ring buffer owns its map fd and keeps it open until it is dropped, which
    // happens only when the AsyncFd is.
    let mut ring = unsafe { AsyncFd::register(probes.take_ring_buffer()?) }
        .map_err(|error| anyhow::anyhow!("polling the ring buffer: {error}"))?;

    let target = match &args.otlp_endpoint {
        Some(endpoint) if !endpoint.is_empty() => ExportTarget::Otlp {
            endpoint: endpoint.clone(),
            protocol: args.otlp_protocol,
        },
        _ => ExportTarget::JsonLines,
    };
    let mut pipeline = Pipeline {
        clock: WallClock::measure(),
        table: ConnectionTable::new(args.max_connections),
        services: HashMap::new(),
        spans: SpanPipeline::start(&target)?,
        metrics: Metrics::new(target.clone(), Duration::from_secs(args.metric_interval)),
        stats: Stats::default(),
        exchanges: Vec::new(),
        actions: Vec::new(),
        exited: Vec::new(),
    };
    for &pid in &args.pids {
        let service = Arc::new(ServiceIdentity::of_process(
            pid,
            args.service_name.as_deref(),
        ));
        pipeline.metrics.add_service(&service)?;
        pipeline.services.insert(pid, service);
        probes.trace_pid(pid)?;
    }
    if let Some(path) = &args.ready_file {
        std::fs::write(path, format!("{}\n", std::process::id()))
            .with_context(|| format!("writing the ready file {}", path.display()))?;
    }
    eprintln!(
        "gym-tracer: tracing pid {} → {}",
        args.pids
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        match &target {
            ExportTarget::JsonLines => "JSON lines on stdout".to_string(),
            ExportTarget::Otlp { endpoint, protocol } => format!("OTLP {protocol:?} {endpoint}"),
        }
    );

    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut live = args.pids.len();
    loop {
        tokio::select! {
            readable = ring.readable_mut() => {
                let mut guard = readable.context("waiting on the ring buffer")?;
                let ring = guard.get_inner_mut();
                while let Some(record) = ring.next() {
                    pipeline.handle_record(&record);
                }
                guard.clear_ready();
            }
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
        }
        for action in pipeline.actions.drain(..) {
            let TableAction::Untrack { id, conn_id } = action;
            probes.untrack_socket(id.pid, id.fd, conn_id);
        }
        for pid in pipeline.exited.drain(..) {
            if pipeline.services.contains_key(&pid) {
                probes.untrace_pid(pid);
                live -= 1;
                eprintln!("gym-tracer: pid {pid} exited");
            }
        }
        if live == 0 {
            eprintln!("gym-tracer: every traced process has exited");
            break;
        }
    }

    // Detach first so nothing new arrives, then take what is still on the ring.
    let lost = probes.lost_events();
    drop(probes);
    let ring = ring.get_mut();
    while let Some(record) = ring.next() {
        pipeline.handle_record(&record);
    }
    pipeline.stats.events_lost_in_kernel = lost;
    let in_flight = pipeline.table.in_flight_requests();
    let open_connections = pipeline.table.open_connections();
    let Pipeline {
        spans,
        metrics,
        stats,
        ..
    } = pipeline;
    let totals = spans.shutdown().await;
    metrics.shutdown().await;
    if let Some(path) = &args.ready_file {
        let _ = std::fs::remove_file(path);
    }
    eprintln!(
        "gym-tracer: stopped. {stats} spans_exported={} spans_export_failed={} requests_in_flight_at_exit={in_flight} connections_open_at_exit={open_connections}",
        totals.spans_exported, totals.spans_failed
    );
    Ok(())
}
