//! The running agent: wires loader → reader → connection table → Gym classification →
//! spans/metrics → exporters, keeps the set of traced processes up to date (named PIDs,
//! discovery, forks, exits), and handles start-up, signals and shutdown.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::io::unix::AsyncFd;
use tokio::runtime::Handle;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use crate::classify::{classify, semantic_at_start, wants_run_body};
use crate::cli::{Discover, Output, RunArgs};
use crate::clock::WallClock;
use crate::connections::{ConnectionTable, HttpExchange, RequestStart, TableAction};
use crate::discovery::{GymServer, ProcScanner, gym_server_from_env, read_process_env};
use crate::events::{KernelEvent, Role, decode};
use crate::export::{ExportLimits, ExportTarget, SpanPipeline};
use crate::gym::ServerType;
use crate::gym::routes::{RouteName, RouteTemplate, strip_rollout_prefix, templates_from_openapi};
use crate::gym::span_groups::{SpanGroup, SpanGroups};
use crate::harvest::{SelfPorts, connect_address, fetch_openapi, listening_ports};
use crate::health::{Gauges, Health};
use crate::identity::{AgentResource, GymLabels};
use crate::loader::{LoadOptions, LoadedProbes, preflight};
use crate::metrics::Metrics;
use crate::processes::ProcessTable;
use crate::spans::{RequestView, SpanId, SpanRecord, request_spans};
use crate::stats::Stats;
use crate::stitch::{StartFacts, StitchConfig, Stitcher};

/// How often `--discover` rescans /proc: servers that start are traced within this.
const DISCOVERY_INTERVAL: Duration = Duration::from_secs(1);

/// A server found before it listens is asked for its routes again, this often and this
/// many times.
const HARVEST_RETRY: Duration = Duration::from_secs(1);
const HARVEST_ATTEMPTS: u32 = 60;

/// How often held spans are checked for release.
const RELEASE_TICK: Duration = Duration::from_millis(100);
/// How often the counters behind /metrics and the self-telemetry are refreshed.
const HEALTH_PUBLISH_INTERVAL: Duration = Duration::from_secs(1);

/// Server addresses remembered for `peer.service`. A server listening on a wildcard
/// address is reached at as many local addresses as a peer chooses (all of 127/8), so this
/// is bounded; past it a server's new address is not named (counted: peer_names_dropped).
const MAX_PEER_NAMES: usize = 4096;

/// The final export of the agent's own metrics, after the spans' and the servers' metrics'
/// (each bounded by --shutdown-timeout): one attempt's worth.
const SELF_TELEMETRY_SHUTDOWN: Duration = Duration::from_secs(1);

/// What the kernel said about traced processes, handled between ring-buffer batches.
#[derive(Debug)]
enum Lifecycle {
    Exited(u32),
    /// A fork event that was a thread or a child that could not be adopted: take it out of
    /// the kernel filter again.
    NotAProcess(u32),
}

/// A route table harvested from a server, for it and its forked workers.
struct Harvest {
    root: u32,
    templates: Vec<RouteTemplate>,
}

/// Everything downstream of the ring buffer.
struct Pipeline {
    clock: WallClock,
    table: ConnectionTable,
    processes: ProcessTable,
    groups: SpanGroups,
    self_ports: SelfPorts,
    spans: SpanPipeline,
    metrics: Metrics,
    stats: Stats,
    stitcher: Stitcher,
    /// Requests the agent itself made (route harvests), dropped when they end.
    own_requests: std::collections::HashSet<SpanId>,
    /// Listening addresses of traced Gym servers → server name, for `peer.service`.
    peer_names: HashMap<SocketAddr, String>,
    exchanges: Vec<HttpExchange>,
    actions: Vec<TableAction>,
    /// Sockets to stop capturing, applied to the kernel between ring-buffer batches.
    untrack: Vec<TableAction>,
    lifecycle: Vec<Lifecycle>,
    span_batch: Vec<SpanRecord>,
    released: Vec<SpanRecord>,
    /// Read by the --health-listen endpoint.
    health: Arc<Health>,
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
        match event {
            KernelEvent::ProcessExit { pid, .. } => self.lifecycle.push(Lifecycle::Exited(pid)),
            KernelEvent::ProcessExec { pid, .. } => self.exec(pid),
            // Adopted at once: the child's own records may follow in this same batch.
            KernelEvent::ProcessFork { parent, child } => self.adopt(parent, child),
            _ => {}
        }
        self.table.apply(
            &event,
            &mut self.stats,
            &mut self.exchanges,
            &mut self.actions,
        );
        // Starts first: a request's span id must be known before anything refers to it.
        let mut actions = std::mem::take(&mut self.actions);
        for action in actions.drain(..) {
            match action {
                TableAction::Started(start) => self.start_request(&start),
                TableAction::RolloutFromBody {
                    span_id,
                    rollout_id,
                } => self.stitcher.set_rollout(span_id, rollout_id),
                untrack @ TableAction::Untrack { .. } => self.untrack.push(untrack),
            }
        }
        self.actions = actions;
        let mut exchanges = std::mem::take(&mut self.exchanges);
        for exchange in exchanges.drain(..) {
            self.handle_exchange(&exchange);
        }
        self.exchanges = exchanges;
    }

    fn start_request(&mut self, start: &RequestStart) {
        if start.role == Role::Server && self.is_own(start) {
            self.own_requests.insert(start.span_id);
            return;
        }
        let Some(process) = self.processes.get_mut(start.pid) else {
            return;
        };
        let stripped = strip_rollout_prefix(&start.path);
        let rollout_id = stripped.rollout_id;
        let facts = match start.role {
            Role::Server => {
                // A server that replaced another on the same address renames it.
                if let (Some(local), Some(name)) = (start.local, process.identity.server_name())
                    && self.peer_names.get(&local).map(String::as_str) != Some(name)
                {
                    if self.peer_names.len() < MAX_PEER_NAMES
                        || self.peer_names.contains_key(&local)
                    {
                        self.peer_names.insert(local, name.to_string());
                    } else {
                        self.stats.peer_names_dropped += 1;
                    }
                }
                let semantic = semantic_at_start(process, &start.method, stripped.route_path);
                StartFacts {
                    rollout_id,
                    emits_own: self.groups.contains(SpanGroup::Server),
                    emits_semantic: semantic.is_some_and(|s| self.groups.contains(s.group)),
                }
            }
            Role::Client => StartFacts {
                rollout_id,
                emits_own: self.groups.contains(SpanGroup::HttpClient),
                emits_semantic: false,
            },
        };
        self.stitcher.start(start, facts, std::time::Instant::now());
    }

    fn handle_exchange(&mut self, exchange: &HttpExchange) {
        self.stats.exchanges += 1;
        let now = std::time::Instant::now();
        if self.own_requests.remove(&exchange.span_id) {
            self.stats.self_requests_ignored += 1;
            self.stitcher.finish(exchange.span_id, now);
            return;
        }
        let Some(process) = self.processes.get_mut(exchange.pid) else {
            self.stitcher.finish(exchange.span_id, now);
            return;
        };
        let meaning = classify(process, exchange);
        if exchange.role == Role::Server && meaning.route == RouteName::Unnamed {
            self.stats.requests_unnamed += 1;
        }
        let identity = process.identity.clone();
        let peer_service = exchange
            .peer
            .filter(|_| exchange.role == Role::Client)
            .and_then(|peer| self.peer_names.get(&peer))
            .map(String::as_str);
        self.metrics
            .record(&identity, exchange, &meaning, peer_service);
        let view = RequestView {
            exchange,
            service: &identity,
            meaning: &meaning,
            semantic_span_id: self.stitcher.semantic_span_id(exchange.span_id),
            peer_service,
        };
        request_spans(&view, self.groups, self.clock, &mut self.span_batch);
        self.stitcher.hold_all(
            exchange.span_id,
            &mut self.span_batch,
            now,
            &mut self.released,
        );
        self.stitcher.finish(exchange.span_id, now);
        self.offer_released();
    }

    /// Copies into `stats` the counters other parts keep (the stitcher, the kernel's loss
    /// counter, discovery), for /metrics and the closing line.
    fn collect_stats(&mut self, events_lost_by_cpu: Vec<u64>, scanner: Option<&ProcScanner>) {
        self.stats.stitch = self.stitcher.stats;
        self.stats.events_lost_in_kernel = events_lost_by_cpu.iter().sum();
        self.stats.events_lost_by_cpu = events_lost_by_cpu;
        self.stats.environ_unreadable = scanner.map_or(0, ProcScanner::unreadable);
    }

    /// Makes the counters and levels of now readable by /metrics and the self-telemetry.
    fn publish(&mut self, events_lost_by_cpu: Vec<u64>, scanner: Option<&ProcScanner>) {
        self.collect_stats(events_lost_by_cpu, scanner);
        self.health.publish(
            &self.stats,
            Gauges {
                processes_traced: self.processes.len() as u64,
                connections_tracked: self.table.open_connections() as u64,
                spans_pending: self.stitcher.held() as u64,
                resident_memory_bytes: resident_memory_bytes(),
            },
        );
    }

    /// Hands the spans the stitcher let go of to the exporters.
    fn offer_released(&mut self) {
        let (queued, dropped) = self.spans.offer(&mut self.released);
        self.stats.spans_queued += queued as u64;
        self.stats.spans_dropped_queue_full += dropped as u64;
    }

    /// The agent's own route harvest arrives at the server like any client's request: its
    /// connection was marked when the agent opened it (the mark is used up here).
    fn is_own(&self, start: &RequestStart) -> bool {
        match (start.peer, start.local) {
            (Some(peer), Some(local)) => {
                peer.ip() == local.ip() && self.self_ports.take(peer.port(), local.port())
            }
            _ => false,
        }
    }

    /// A traced process replaced its program. It stays traced under its identity (a
    /// launcher that execs its server, uvicorn's spawned workers); the table ends the
    /// connections the exec closed.
    fn exec(&mut self, pid: u32) {
        let Some(process) = self.processes.get_mut(pid) else {
            return;
        };
        self.stats.processes_execd += 1;
        let program = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        tracing::info!(
            pid,
            "pid {pid} exec'd {:?}; its connections are ended, it stays traced as {}",
            program.trim_end(),
            describe(&process.identity.labels)
        );
    }

    fn adopt(&mut self, parent: u32, child: u32) {
        if !is_process(child) {
            self.stats.fork_threads_ignored += 1;
            self.lifecycle.push(Lifecycle::NotAProcess(child));
            return;
        }
        match self.processes.adopt_child(parent, child) {
            Some(process) => {
                self.stats.forks_followed += 1;
                tracing::info!(
                    pid = child,
                    parent,
                    "attached pid {child} as {} (child of pid {parent})",
                    describe(&process.identity.labels)
                );
            }
            None => self.lifecycle.push(Lifecycle::NotAProcess(child)),
        }
    }
}

/// Writes the exit summary (`--summary-file`) whole or not at all: a reader never sees half.
fn write_summary(
    path: &std::path::Path,
    counters: &[(&str, u64)],
    lost_by_cpu: &[u64],
) -> Result<()> {
    let counters: serde_json::Map<String, serde_json::Value> = counters
        .iter()
        .map(|(name, value)| ((*name).to_string(), (*value).into()))
        .collect();
    let summary = serde_json::json!({ "counters": counters, "events_lost_by_cpu": lost_by_cpu });
    let partial = path.with_extension("partial");
    std::fs::write(&partial, format!("{summary}\n"))
        .and_then(|()| std::fs::rename(&partial, path))
        .with_context(|| format!("writing the summary file {}", path.display()))
}

/// The agent's resident set size (VmRSS), 0 if /proc cannot say.
fn resident_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .unwrap_or(0)
}

/// A fork event's child is a process (not a thread) if it leads its own thread group.
fn is_process(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Tgid:"))
                .and_then(|tgid| tgid.trim().parse::<u32>().ok())
        })
        == Some(pid)
}

fn describe(labels: &GymLabels) -> String {
    match (&labels.server_name, labels.server_type) {
        (Some(name), Some(kind)) => format!("{name} ({})", kind.config_key()),
        (Some(name), None) => format!("{name} (type unknown)"),
        (None, _) => "a process that is not a Gym server".to_string(),
    }
}

/// A traced process exited: stop filtering it and free what was kept for it.
fn forget(pipeline: &mut Pipeline, probes: &mut LoadedProbes, pid: u32) {
    probes.untrace_pid(pid);
    if pipeline.processes.remove(pid).is_some() {
        pipeline.metrics.remove_service(pid);
        pipeline.stats.processes_exited += 1;
        tracing::info!(pid, "pid {pid} exited");
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

/// Labels from a Gym server's environment and config.
fn labels_of(server: &GymServer) -> GymLabels {
    GymLabels {
        server_name: Some(server.name.clone()),
        server_type: server
            .server_type
            .as_deref()
            .and_then(ServerType::from_config_key),
        server_type_key: server.server_type.clone(),
        service_group: server.service_group.clone(),
    }
}

/// Labels of a `--pid` process: its Gym environment if it has one, then the flags.
fn labels_of_named(pid: u32, args: &RunArgs) -> (GymLabels, Option<GymServer>) {
    let server = read_process_env(&PathBuf::from("/proc"), pid)
        .ok()
        .and_then(|env| match gym_server_from_env(&env) {
            Ok(server) => server,
            Err(error) => {
                tracing::warn!(pid, "pid {pid}: {error}");
                Some(error.into_server())
            }
        });
    let mut labels = server.as_ref().map(labels_of).unwrap_or_default();
    if args.server_name.is_some() {
        labels.server_name = args.server_name.clone();
    }
    if let Some(server_type) = args.server_type {
        labels.server_type = Some(server_type);
        labels.server_type_key = Some(server_type.config_key().to_string());
    }
    (labels, server)
}

/// Where to ask a server for its routes: its configured port, else what it listens on.
/// Blocking: a configured host may need a DNS lookup.
fn harvest_address(pid: u32, server: Option<&GymServer>) -> Option<SocketAddr> {
    if let Some(port) = server.and_then(|s| s.port) {
        return Some(connect_address(
            server.and_then(|s| s.host.as_deref()),
            port,
        ));
    }
    let listening = listening_ports(pid).ok()?;
    listening
        .first()
        .map(|addr| connect_address(Some(&addr.ip().to_string()), addr.port()))
}

/// Asks one server for its `/openapi.json`, patiently: a server found at start-up may not
/// listen yet. Gives up quietly (Gym's known routes still name its requests).
fn spawn_harvest(
    exporters: &Handle,
    pid: u32,
    server: Option<GymServer>,
    self_ports: SelfPorts,
    results: mpsc::UnboundedSender<Result<Harvest, String>>,
) {
    exporters.spawn(async move {
        let mut last_error = String::from("it never listened");
        for _ in 0..HARVEST_ATTEMPTS {
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                return;
            }
            let lookup = server.clone();
            let address =
                tokio::task::spawn_blocking(move || harvest_address(pid, lookup.as_ref()))
                    .await
                    .ok()
                    .flatten();
            if let Some(address) = address {
                match fetch_openapi(address, &self_ports).await {
                    Ok(document) => {
                        let result = templates_from_openapi(&document)
                            .map(|templates| Harvest {
                                root: pid,
                                templates,
                            })
                            .map_err(|error| format!("pid {pid}: /openapi.json: {error}"));
                        let _ = results.send(result);
                        return;
                    }
                    Err(error) => last_error = error.to_string(),
                }
            }
            tokio::time::sleep(HARVEST_RETRY).await;
        }
        let _ = results.send(Err(format!("pid {pid}: no route table: {last_error}")));
    });
}

/// Runs on the caller's current-thread runtime; `exporters` is the runtime everything that
/// talks to the network or stdout is spawned on (see `main::run_agent`).
pub async fn run(args: RunArgs, exporters: Handle) -> Result<()> {
    check_pids(&args.pids)?;
    let health = Arc::new(Health::default());
    if let Some(listen) = args.health_listen {
        // Up before the probes, so a readiness probe sees 503 until they are attached.
        let bound = exporters
            .spawn(crate::health::serve(listen.0, health.clone()))
            .await
            .context("starting the health endpoint")??;
        tracing::info!("serving /healthz and /metrics on http://{bound}");
    }
    preflight()?;
    let mut probes = LoadedProbes::load(&LoadOptions {
        capture_bytes: args.capture_bytes,
        ring_buffer_bytes: args.ring_buffer_bytes,
    })?;
    if let Err(why) = &probes.features.socket_addresses {
        tracing::warn!("connection addresses are off ({why}); spans will lack client.address");
    }
    // SAFETY: the ring buffer owns its map fd and keeps it open until it is dropped, which
    // happens only when the AsyncFd is.
    let mut ring = unsafe { AsyncFd::register(probes.take_ring_buffer()?) }
        .map_err(|error| anyhow::anyhow!("polling the ring buffer: {error}"))?;

    let target = match crate::config::otlp_options(&args) {
        Some(options) => ExportTarget::Otlp(options),
        None => match args.output {
            Output::Json => ExportTarget::JsonLines,
            Output::Tree => ExportTarget::Tree,
        },
    };
    let shutdown_timeout = Duration::from_millis(args.shutdown_timeout);
    let agent_resource = AgentResource::new(
        args.service_name.clone(),
        args.resource_attributes
            .clone()
            .map(|list| list.0)
            .unwrap_or_default(),
    );
    let self_telemetry = crate::telemetry::start(
        &exporters,
        &target,
        &agent_resource,
        Duration::from_secs(args.metric_interval),
        health.clone(),
    )?;
    let mut pipeline = Pipeline {
        clock: WallClock::measure(),
        table: ConnectionTable::new(args.max_connections).reading_run_bodies(wants_run_body),
        processes: ProcessTable::new(args.routes.clone(), agent_resource),
        groups: args.span_groups,
        self_ports: SelfPorts::new(),
        spans: SpanPipeline::start(
            &exporters,
            &target,
            ExportLimits {
                batch_size: args.export_batch_size,
                queue_size: args.export_queue_size,
                buffer_spans: args.export_buffer_spans,
                shutdown_timeout,
            },
            health.export.clone(),
        )?,
        metrics: Metrics::new(
            target.clone(),
            Duration::from_secs(args.metric_interval),
            exporters.clone(),
            health.export.clone(),
        ),
        stats: Stats::default(),
        stitcher: Stitcher::new(StitchConfig {
            delay: Duration::from_millis(args.stitch_delay_ms),
            max_pending: args.max_pending_spans,
            max_nodes: args.max_pending_spans.saturating_mul(4),
        }),
        own_requests: std::collections::HashSet::new(),
        peer_names: HashMap::new(),
        exchanges: Vec::new(),
        actions: Vec::new(),
        untrack: Vec::new(),
        lifecycle: Vec::new(),
        span_batch: Vec::new(),
        released: Vec::new(),
        health,
    };
    let (harvest_tx, mut harvest_rx) = mpsc::unbounded_channel();
    let harvest = !args.no_route_harvest;

    let attach = |pipeline: &mut Pipeline,
                  probes: &mut LoadedProbes,
                  pid: u32,
                  labels: GymLabels,
                  server: Option<GymServer>|
     -> Result<()> {
        probes.trace_pid(pid)?;
        let process = pipeline.processes.attach(pid, labels);
        pipeline.stats.processes_attached += 1;
        tracing::info!(
            pid,
            "attached pid {pid} as {}",
            describe(&process.identity.labels)
        );
        // Callers name this server as `peer.service` by the address they connect to.
        // (Only literal addresses: a host name would need a DNS lookup here.)
        if let Some(server) = &server
            && let Some(port) = server.port
        {
            let host = server.host.as_deref();
            if host.is_none_or(|h| h == "localhost" || h.parse::<std::net::IpAddr>().is_ok()) {
                pipeline
                    .peer_names
                    .insert(connect_address(host, port), server.name.clone());
            }
        }
        if harvest {
            spawn_harvest(
                &exporters,
                pid,
                server,
                pipeline.self_ports.clone(),
                harvest_tx.clone(),
            );
        }
        Ok(())
    };

    for &pid in &args.pids {
        let (labels, server) = labels_of_named(pid, &args);
        attach(&mut pipeline, &mut probes, pid, labels, server)?;
    }
    let mut scanner = args
        .discover
        .map(|Discover::Gym| ProcScanner::new(PathBuf::from("/proc")));
    let discover = |pipeline: &mut Pipeline,
                    probes: &mut LoadedProbes,
                    scanner: &mut ProcScanner|
     -> Result<()> {
        let found = scanner.scan();
        // Exits first: a pid that was reused (or re-exec'd as another server) is in both.
        for pid in found.exited {
            forget(pipeline, probes, pid);
        }
        for (pid, error) in &found.config_errors {
            tracing::warn!(pid, "pid {pid}: {error}");
        }
        for (pid, server) in found.started {
            if pipeline.processes.contains(pid) {
                continue;
            }
            let name = server.name.clone();
            // A server found later must not stop the agent (the kernel's PID filter may be
            // full of a traced process's children): it is reported and the rest traced.
            if let Err(error) = attach(pipeline, probes, pid, labels_of(&server), Some(server)) {
                pipeline.stats.processes_not_traced += 1;
                tracing::warn!(
                    pid,
                    "pid {pid} ({name}) is not traced: {error:#}; the PID filter holds {} \
                     processes, children of traced servers included",
                    tracer_abi::MAX_TRACED_PIDS
                );
            }
        }
        Ok(())
    };
    if let Some(scanner) = scanner.as_mut() {
        discover(&mut pipeline, &mut probes, scanner)?;
    }
    if let Some(path) = &args.ready_file {
        std::fs::write(path, format!("{}\n", std::process::id()))
            .with_context(|| format!("writing the ready file {}", path.display()))?;
    }
    tracing::info!(
        "{} → {}",
        match (&args.discover, args.pids.len()) {
            (Some(Discover::Gym), 0) => "watching for Gym servers".to_string(),
            (Some(Discover::Gym), n) =>
                format!("tracing {n} named process(es) and watching for Gym servers"),
            (None, n) => format!("tracing {n} named process(es)"),
        },
        match &target {
            ExportTarget::JsonLines => "JSON lines on stdout".to_string(),
            ExportTarget::Tree => "a tree per trace on stdout".to_string(),
            ExportTarget::Otlp(otlp) => format!(
                "OTLP {:?} {}",
                otlp.protocol,
                crate::export::otlp::options::printable_endpoint(&otlp.endpoint)
            ),
        }
    );

    pipeline.health.set_probes_attached(true);
    let mut publish = tokio::time::interval(HEALTH_PUBLISH_INTERVAL);
    publish.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut release = tokio::time::interval(RELEASE_TICK);
    release.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut rescan = tokio::time::interval(DISCOVERY_INTERVAL);
    rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The kernel wakes the agent only when a lot is waiting (RING_WAKEUP_BYTES); otherwise
    // the ring is drained on a short timer. Waking per record was most of the agent's CPU.
    let mut drain =
        tokio::time::interval(Duration::from_millis(tracer_abi::RING_DRAIN_INTERVAL_MS));
    drain.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
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
            _ = drain.tick() => {
                let ring = ring.get_mut();
                while let Some(record) = ring.next() {
                    pipeline.handle_record(&record);
                }
            }
            _ = release.tick() => {
                pipeline.stitcher.release(std::time::Instant::now(), &mut pipeline.released);
                pipeline.offer_released();
            }
            _ = publish.tick() => {
                pipeline.publish(probes.lost_events_by_cpu(), scanner.as_ref());
            }
            _ = rescan.tick(), if scanner.is_some() => {
                if let Some(scanner) = scanner.as_mut() {
                    discover(&mut pipeline, &mut probes, scanner)?;
                }
            }
            Some(result) = harvest_rx.recv() => match result {
                Ok(Harvest { root, templates }) => {
                    pipeline.stats.route_tables_harvested += 1;
                    pipeline.processes.set_harvested_routes(root, &templates);
                    // Requests served before this line are named from Gym's known routes only.
                    tracing::info!(
                        pid = root,
                        "pid {root}: {} route templates from its /openapi.json",
                        templates.len()
                    );
                }
                Err(message) => {
                    pipeline.stats.route_harvests_failed += 1;
                    tracing::warn!("{message}; naming routes from Gym's known routes");
                }
            },
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
        }
        for action in pipeline.untrack.drain(..) {
            if let TableAction::Untrack { id, conn_id } = action {
                probes.untrack_socket(id.pid, id.fd, conn_id);
            }
        }
        for change in std::mem::take(&mut pipeline.lifecycle) {
            match change {
                Lifecycle::NotAProcess(pid) => probes.untrace_pid(pid),
                Lifecycle::Exited(pid) => forget(&mut pipeline, &mut probes, pid),
            }
        }
        if scanner.is_none() && pipeline.processes.is_empty() {
            tracing::info!("every traced process has exited");
            break;
        }
    }

    // Detach first so nothing new arrives, then take what is still on the ring.
    let lost = probes.lost_events_by_cpu();
    drop(probes);
    let ring = ring.get_mut();
    while let Some(record) = ring.next() {
        pipeline.handle_record(&record);
    }
    pipeline.stitcher.release_all(&mut pipeline.released);
    pipeline.offer_released();
    pipeline.collect_stats(lost.clone(), scanner.as_ref());
    let in_flight = pipeline.table.in_flight_requests();
    let open_connections = pipeline.table.open_connections();
    let Pipeline {
        spans,
        metrics,
        stats,
        health,
        ..
    } = pipeline;
    // Spans and metrics are flushed side by side, each within --shutdown-timeout; the
    // agent's own metrics last, so that they count what the flush dropped.
    let (totals, ()) = tokio::join!(spans.shutdown(), metrics.shutdown(shutdown_timeout));
    if let Some(provider) = self_telemetry {
        health.publish(&stats, health.snapshot().1);
        crate::export::shutdown_providers(vec![provider], SELF_TELEMETRY_SHUTDOWN).await;
    }
    if let Some(path) = &args.ready_file {
        let _ = std::fs::remove_file(path);
    }
    if let Some(path) = &args.summary_file {
        let mut counters: Vec<(&str, u64)> = stats.counters().to_vec();
        counters.extend(health.export.counters());
        counters.extend([
            (
                "metric_exports_failed",
                health.export.metric_exports_failed(),
            ),
            ("requests_in_flight_at_exit", in_flight as u64),
            ("connections_open_at_exit", open_connections as u64),
        ]);
        if let Some(tree) = &totals.tree {
            counters.extend(tree.counters());
        }
        write_summary(path, &counters, &stats.events_lost_by_cpu)?;
    }
    let tree_summary = totals.tree.map(|t| format!(" {t}")).unwrap_or_default();
    let export_counters: String = health
        .export
        .counters()
        .iter()
        .filter(|(name, _)| !matches!(*name, "spans_exported" | "spans_export_failed"))
        .map(|(name, value)| format!(" {name}={value}"))
        .collect();
    tracing::info!(
        "stopped. {stats} spans_exported={} spans_export_failed={}{export_counters} metric_exports_failed={} requests_in_flight_at_exit={in_flight} connections_open_at_exit={open_connections}{tree_summary}",
        totals.spans_exported,
        totals.spans_failed,
        health.export.metric_exports_failed()
    );
    Ok(())
}
