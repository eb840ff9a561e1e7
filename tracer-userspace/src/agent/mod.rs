//! The running agent: loads the probes, assembles the pipeline with its exporters, keeps the
//! set of traced processes up to date (named PIDs, discovery, forks, exits), and handles
//! signals and shutdown. The work itself is the pipeline core's ([`crate::pipeline`]).

mod attach;
mod context_reads;
mod task_lineage;
mod tls_probes;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use aya::maps::MapData;
use aya::maps::RingBuf;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use tokio::io::unix::AsyncFd;
use tokio::runtime::Handle;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use crate::config::cli::{Discover, InjectTraceparent, RunArgs, TaskLineageMode};
use crate::config::export_plan::ExportPlan;
use crate::export::{ExportLimits, SpanPipeline};
use crate::kernel::loader::{KernelCounters, LoadOptions, LoadedProbes, preflight};
use crate::model::ids::MintKey;
use crate::model::service::{AgentResource, GymLabels};
use crate::model::span::SpanRecord;
use crate::ops::counters::{AgentCounters, CounterSnapshot, HostCounters};
use crate::ops::exit_summary::{self, Verdict};
use crate::ops::health::{Gauges, Health};
use crate::pipeline::recording::{RecordedConfig, Recorder};
use crate::pipeline::{Lifecycle, Pipeline, PipelineConfig, PipelineOutput};
use crate::processes::discovery::{GymServer, ProcScanner};
use crate::processes::harvest::connect_address;
use crate::processes::identity::parent_pid;
use crate::processes::{TracedProcess, log_lifecycle};
use crate::report::RunReport;
use crate::signals::clock::WallClock;
use crate::signals::metrics::Metrics;
use crate::stitch::GroupKey;
use crate::stitch::injection::TraceInjection;
use crate::stitch::{Injection, StitchConfig};
use tracer_abi::{InjectKey, InjectTrace};

use crate::processes::event_loop::LoopSampler;
use attach::{Harvest, check_pids, labels_of, labels_of_named, spawn_harvest};
use context_reads::ContextReads;
use task_lineage::TaskLineages;
use tls_probes::TlsProbes;

/// How often `--discover` rescans /proc: servers that start are traced within this.
const DISCOVERY_INTERVAL: Duration = Duration::from_secs(1);
/// How often the kernel's socket and pending-call maps are swept of entries of processes and
/// threads that are gone (normally deleted at the process's exit record; this catches the
/// ones whose record was lost).
const KERNEL_SWEEP_INTERVAL: Duration = Duration::from_secs(10);
/// How often held spans are checked for release.
const RELEASE_TICK: Duration = Duration::from_millis(100);
/// How often the counters behind /metrics and the self-telemetry are refreshed.
const HEALTH_PUBLISH_INTERVAL: Duration = Duration::from_secs(1);
/// How often freed heap is given back to the kernel ([`trim_heap`]).
const HEAP_TRIM_INTERVAL: Duration = Duration::from_secs(10);
/// The final export of the agent's own metrics, after the spans' and the servers' metrics'
/// (each bounded by --shutdown-timeout): one attempt's worth.
const SELF_TELEMETRY_SHUTDOWN: Duration = Duration::from_secs(1);

type Ring = AsyncFd<RingBuf<MapData>>;

/// The pipeline with what the agent adds around it: the kernel, the exporters, discovery and
/// route harvests, and its own counters.
struct Agent {
    pipeline: Pipeline<Metrics>,
    /// The pipeline's last step's output, its buffers kept between steps.
    output: PipelineOutput,
    spans: SpanPipeline,
    counters: AgentCounters,
    scanner: Option<ProcScanner>,
    health: Arc<Health>,
    exporters: Handle,
    /// Route harvests run on the exporters' runtime and report here.
    harvests: mpsc::UnboundedSender<Result<Harvest, String>>,
    harvest_routes: bool,
    /// Kernel map entries deleted for processes and threads that are gone.
    kernel_entries_swept: u64,
    /// Which processes' asyncio task contexts the kernel reads.
    context_reads: ContextReads,
    /// Which TLS libraries carry the SSL uprobes.
    tls_probes: TlsProbes,
    /// Which processes carry the task-creation probe.
    task_lineage: TaskLineages<aya::programs::uprobe::UProbeLinkId>,
    /// How busy each traced server's event loop is (`gym.server.loop.utilization`).
    loop_sampler: LoopSampler,
    /// `--health-listen` is on: the live view is made for `GET /rollouts`.
    health_listening: bool,
    /// `--report`: what is exported, kept for the batch report written at exit.
    report: Option<RunReport>,
}

/// Runs on the caller's current-thread runtime; `exporters` is the runtime everything that
/// talks to the network or stdout is spawned on (see `main::run_agent`).
pub async fn run(args: RunArgs, exporters: Handle) -> Result<()> {
    check_pids(&args.pids)?;
    let health = Arc::new(Health::default());
    serve_health(&args, &exporters, &health).await?;
    preflight()?;
    let mint_key = MintKey::random();
    let mut probes = LoadedProbes::load(&LoadOptions {
        capture_bytes: args.capture_bytes,
        ring_buffer_bytes: args.ring_buffer_bytes,
        max_connections: args.max_connections,
        inject_traceparent: args.inject_traceparent.scope(),
        mint_key,
        max_tasks: lineage_mode(&args).map_or(0, |_| args.max_tasks),
    })?;
    if let Err(why) = &probes.features.socket_addresses {
        tracing::warn!("connection addresses are off ({why}); spans will lack client.address");
    }
    // SAFETY: the ring buffer owns its map fd and keeps it open until it is dropped, which
    // happens only when the AsyncFd is.
    let mut ring = unsafe { AsyncFd::register(probes.take_ring_buffer()?) }
        .map_err(|error| anyhow::anyhow!("polling the ring buffer: {error}"))?;
    let plan = crate::config::export_plan::export_plan(&args)?;
    let agent_resource = AgentResource::new(
        args.service_name.clone(),
        args.resource_attributes
            .clone()
            .map(|list| list.0)
            .unwrap_or_default(),
    );
    let self_telemetry = crate::ops::telemetry::start(
        &exporters,
        &plan.metrics,
        &agent_resource,
        Duration::from_secs(args.metric_interval),
        health.clone(),
    )?;
    let (harvests, mut harvest_results) = mpsc::unbounded_channel();
    let config = pipeline_config(&args, agent_resource, mint_key);
    let recorded = args.record.as_ref().map(|_| RecordedConfig::of(&config));
    let mut agent = Agent {
        output: PipelineOutput::default(),
        pipeline: Pipeline::new(
            config,
            Metrics::new(
                plan.metrics.clone(),
                Duration::from_secs(args.metric_interval),
                exporters.clone(),
                health.export.clone(),
            ),
        ),
        spans: SpanPipeline::start(
            &exporters,
            &plan.spans,
            export_limits(&args),
            health.export.clone(),
        )?,
        counters: AgentCounters::default(),
        scanner: args
            .discover
            .map(|Discover::Gym| ProcScanner::new(PathBuf::from("/proc"))),
        health,
        exporters,
        harvests,
        harvest_routes: !args.no_route_harvest,
        kernel_entries_swept: 0,
        context_reads: if args.no_task_contexts {
            ContextReads::disabled()
        } else {
            ContextReads::default()
        },
        tls_probes: if args.no_tls {
            TlsProbes::disabled()
        } else {
            TlsProbes::new(args.tls_probe_scope)
        },
        task_lineage: TaskLineages::new(lineage_mode(&args).unwrap_or(TaskLineageMode::Off)),
        loop_sampler: LoopSampler::new(PathBuf::from("/proc")),
        health_listening: args.health_listen.is_some(),
        report: args
            .report
            .clone()
            .map(|path| RunReport::new(path, args.report_trace_url.clone())),
    };
    if let (Some(path), Some(recorded)) = (&args.record, recorded) {
        let recorder = Recorder::create(path, recorded)
            .with_context(|| format!("creating the recording {}", path.display()))?;
        agent.pipeline.record_to(recorder);
    }
    let started = Instant::now();
    for &pid in &args.pids {
        let (labels, server) = labels_of_named(pid, &args);
        agent.attach(&mut probes, pid, labels, server)?;
    }
    agent.discover(&mut probes);
    if let Some(path) = &args.ready_file {
        std::fs::write(path, format!("{}\n", std::process::id()))
            .with_context(|| format!("writing the ready file {}", path.display()))?;
    }
    log_start(&args, &plan);
    agent.health.set_probes_attached(true);
    agent
        .run_until_stopped(&mut probes, &mut ring, &mut harvest_results)
        .await?;
    // Detach first so nothing new arrives, then take what is still on the ring.
    let kernel = probes.kernel_counters();
    drop(probes);
    let snapshot = agent.drain_and_release(&mut ring, kernel);
    agent
        .shutdown(snapshot, self_telemetry, &args, started)
        .await
}

async fn serve_health(args: &RunArgs, exporters: &Handle, health: &Arc<Health>) -> Result<()> {
    if let Some(listen) = args.health_listen {
        // Up before the probes, so a readiness probe sees 503 until they are attached.
        let bound = exporters
            .spawn(crate::ops::health::serve(listen.0, health.clone()))
            .await
            .context("starting the health endpoint")??;
        tracing::info!("serving /healthz and /metrics on http://{bound}");
    }
    Ok(())
}

/// `--task-lineage`, unless nothing could be probed (the probe reads the threads the task
/// contexts' reads register).
/// `--task-lineage`, as it applies: with `--inject-traceparent`, `auto` is every process (the
/// kernel knows a handler's request for its first call only through its lineage).
fn lineage_mode(args: &RunArgs) -> Option<TaskLineageMode> {
    let injecting = args.inject_traceparent != InjectTraceparent::Off;
    match args.task_lineage {
        _ if args.no_task_contexts => None,
        TaskLineageMode::Off => None,
        TaskLineageMode::Auto if injecting => Some(TaskLineageMode::On),
        mode => Some(mode),
    }
}

fn export_limits(args: &RunArgs) -> ExportLimits {
    ExportLimits {
        batch_size: args.export_batch_size,
        queue_size: args.export_queue_size,
        buffer_spans: args.export_buffer_spans,
        shutdown_timeout: Duration::from_millis(args.shutdown_timeout),
    }
}

fn pipeline_config(
    args: &RunArgs,
    agent_resource: AgentResource,
    mint_key: MintKey,
) -> PipelineConfig {
    PipelineConfig {
        clock: WallClock::measure(),
        max_connections: args.max_connections,
        routes: args.routes.clone(),
        agent_resource,
        groups: args.span_groups,
        stitch: StitchConfig {
            max_pending: args.max_stitching_spans,
            max_nodes: args.max_stitching_spans.saturating_mul(4),
            injection: (args.inject_traceparent != InjectTraceparent::Off).then(|| Injection {
                every_call: args.inject_traceparent == InjectTraceparent::All,
                mint_key,
            }),
        },
    }
}

fn log_start(args: &RunArgs, plan: &ExportPlan) {
    tracing::info!(
        "{} → {}",
        match (&args.discover, args.pids.len()) {
            (Some(Discover::Gym), 0) => "watching for Gym servers".to_string(),
            (Some(Discover::Gym), n) =>
                format!("tracing {n} named process(es) and watching for Gym servers"),
            (None, n) => format!("tracing {n} named process(es)"),
        },
        if plan.spans.describe() == plan.metrics.describe() {
            plan.spans.describe()
        } else {
            format!(
                "spans: {}; metrics: {}",
                plan.spans.describe(),
                plan.metrics.describe()
            )
        }
    );
}

impl Agent {
    /// The event loop: the ring buffer, timers, harvest results and signals, until SIGINT,
    /// SIGTERM, or every traced process has exited.
    async fn run_until_stopped(
        &mut self,
        probes: &mut LoadedProbes,
        ring: &mut Ring,
        harvest_results: &mut mpsc::UnboundedReceiver<Result<Harvest, String>>,
    ) -> Result<()> {
        let every = |period: Duration| {
            let mut interval = tokio::time::interval(period);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            interval
        };
        let mut publish = every(HEALTH_PUBLISH_INTERVAL);
        let mut release = every(RELEASE_TICK);
        let mut rescan = every(DISCOVERY_INTERVAL);
        let mut sweep = every(KERNEL_SWEEP_INTERVAL);
        let mut python_rescan = every(context_reads::RESCAN_INTERVAL);
        let mut heap_trim = every(HEAP_TRIM_INTERVAL);
        // The kernel wakes the agent only when a lot is waiting (RING_WAKEUP_BYTES); otherwise
        // the ring is drained on a short timer. Waking per record was most of the agent's CPU.
        let mut drain = every(Duration::from_millis(tracer_abi::RING_DRAIN_INTERVAL_MS));
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut terminate = signal(SignalKind::terminate())?;
        loop {
            tokio::select! {
                readable = ring.readable_mut() => {
                    let mut guard = readable.context("waiting on the ring buffer")?;
                    self.drain(guard.get_inner_mut());
                    guard.clear_ready();
                }
                _ = drain.tick() => self.drain(ring.get_mut()),
                _ = release.tick() => self.pipeline.release(Instant::now()),
                _ = publish.tick() => self.publish(probes.kernel_counters()),
                _ = rescan.tick(), if self.scanner.is_some() => self.discover(probes),
                _ = sweep.tick() => self.kernel_entries_swept += probes.sweep_gone(),
                _ = python_rescan.tick() => {
                    let traced: Vec<u32> = self.pipeline.traced_pids().collect();
                    self.context_reads.rescan(traced.iter().copied(), probes);
                    let runtimes = traced.iter().map(|&pid| (pid, self.context_reads.runtime(pid)));
                    self.task_lineage.rescan(runtimes, probes);
                    self.tls_probes.rescan(traced, probes);
                }
                _ = heap_trim.tick() => trim_heap(),
                Some(result) = harvest_results.recv() => self.harvested(result),
                _ = interrupt.recv() => break,
                _ = terminate.recv() => break,
            }
            self.apply_output(probes);
            if self.scanner.is_none() && self.pipeline.traces_nothing() {
                tracing::info!("every traced process has exited");
                break;
            }
        }
        Ok(())
    }

    fn drain(&mut self, ring: &mut RingBuf<MapData>) {
        let now = Instant::now();
        let trace = tracing::enabled!(target: RECORDS_TARGET, tracing::Level::TRACE);
        while let Some(record) = ring.next() {
            if trace {
                trace_record(&record);
            }
            self.pipeline.handle_record(&record, now, &mut ());
        }
    }

    /// Hands the pipeline's output on: released spans to the exporters, sockets and
    /// processes to stop following to the kernel.
    fn apply_output(&mut self, probes: &mut LoadedProbes) {
        let mut output = std::mem::take(&mut self.output);
        self.pipeline.deliver(&mut output);
        self.offer_released(&mut output.released);
        for &(socket, conn_id, not_http) in &output.untrack {
            probes.untrack_socket(socket.pid, socket.fd, conn_id, not_http);
        }
        for change in output.injections.drain(..) {
            self.apply_injection(probes, change);
        }
        let mut exited = Vec::new();
        for change in output.lifecycle.drain(..) {
            match change {
                // Unless a later fork in the batch adopted a new process with its pid.
                Lifecycle::NotAdopted(pid) if self.pipeline.is_traced(pid) => {}
                Lifecycle::NotAdopted(pid) => {
                    probes.untrace_pid(pid);
                    self.task_lineage.forget(pid, probes);
                    self.context_reads.forget(pid, probes);
                }
                Lifecycle::Exited { pid, known, logged } => {
                    exited.push(pid);
                    self.release(probes, pid);
                    self.count_exit(pid, known, logged);
                }
                Lifecycle::Execd(pid) => {
                    // A new program: its runtime and TLS library, if any, are looked at afresh
                    // on the rescan (or when it opens a TLS connection).
                    self.task_lineage.forget(pid, probes);
                    self.context_reads.forget(pid, probes);
                    self.tls_probes.forget(pid, probes);
                    log_exec(pid, &self.pipeline);
                }
            }
        }
        // After the exec'd processes are forgotten: a batch that holds an exec and then the
        // new program's first TLS connection must not judge that program twice. A process
        // that exited is not looked at.
        for &pid in &output.tls_opened {
            if !exited.contains(&pid) {
                self.tls_probes.tls_opened(pid, probes);
            }
        }
        output.clear();
        self.output = output;
    }

    /// Gives the kernel a handler's trace for its next outbound requests, or takes it back.
    fn apply_injection(&mut self, probes: &mut LoadedProbes, change: TraceInjection) {
        match change {
            TraceInjection::Publish {
                pid,
                handler,
                trace,
                owner,
            } => {
                let key = inject_key(pid, handler);
                let value = InjectTrace {
                    trace: trace.0,
                    owner_conn_id: owner.conn_id,
                    owner_fd: owner.fd,
                    owner_responses: owner.requests_before,
                };
                if probes.publish_trace(key, value).is_err() {
                    self.counters.traces_not_published += 1;
                }
            }
            TraceInjection::Withdraw { pid, handler } => {
                probes.withdraw_trace(inject_key(pid, handler));
            }
        }
    }

    fn attach(
        &mut self,
        probes: &mut LoadedProbes,
        pid: u32,
        labels: GymLabels,
        server: Option<GymServer>,
    ) -> Result<()> {
        probes.trace_pid(pid)?;
        let process = self.pipeline.attach(pid, labels);
        self.counters.processes_attached += 1;
        tracing::info!(pid, "attached pid {pid} as {}", process.identity.labels);
        self.context_reads.attach(pid, probes);
        let runtime = self.context_reads.runtime(pid);
        self.task_lineage
            .attach(pid, server.as_ref(), runtime, probes);
        self.tls_probes.attach(pid, probes);
        // Callers name this server as `peer.service` by the address they connect to.
        // (Only literal addresses: a host name would need a DNS lookup here.)
        if let Some(server) = &server
            && let Some(port) = server.port
        {
            let host = server.host.as_deref();
            if host.is_none_or(|h| h == "localhost" || h.parse::<std::net::IpAddr>().is_ok()) {
                let server_type = server.server_type.as_deref().and_then(|t| t.parse().ok());
                self.pipeline
                    .name_peer(connect_address(host, port), &server.name, server_type);
            }
        }
        if self.harvest_routes {
            let self_ports = self.pipeline.self_ports();
            spawn_harvest(
                &self.exporters,
                pid,
                server,
                self_ports,
                self.harvests.clone(),
            );
        }
        Ok(())
    }

    /// One `--discover` scan: exits first (a pid that was reused, or re-exec'd as another
    /// server, is in both), then the servers that started.
    fn discover(&mut self, probes: &mut LoadedProbes) {
        let Some(scanner) = self.scanner.as_mut() else {
            return;
        };
        let found = scanner.scan();
        // A server the scan saw go: forgotten here if its exit record was lost. Only an
        // attached process: the pid of one the scan saw (a child it skipped, or one that has
        // exited since) may belong to a followed child by now, which its records own.
        for pid in found.exited {
            if self
                .pipeline
                .process(pid)
                .is_some_and(|process| process.parent.is_none())
            {
                self.forget(probes, pid);
            }
        }
        for (pid, error) in &found.config_errors {
            tracing::warn!(pid, "pid {pid}: {error}");
        }
        for (pid, server) in found.started {
            // A traced server's descendant inherits its environment: it is followed from its
            // fork record (adopted, or counted as unfollowed), not attached as a server. The
            // record may still be on the ring, so the kernel's filter is asked too.
            // One gone since the scan (no parent to read) is not attached either.
            let Some(parent) = parent_pid(pid) else {
                continue;
            };
            if self.pipeline.is_traced(pid)
                || probes.follows_as_child(pid)
                || self.pipeline.is_traced(parent)
                || probes.follows_as_child(parent)
            {
                continue;
            }
            let name = server.name.clone();
            // A server found later must not stop the agent (the kernel's PID filter may be
            // full of a traced process's children): it is reported and the rest traced.
            if let Err(error) = self.attach(probes, pid, labels_of(&server), Some(server)) {
                self.counters.processes_not_traced += 1;
                tracing::warn!(
                    pid,
                    "pid {pid} ({name}) is not traced: {error:#}; the PID filter holds {} \
                     processes, children of traced servers included",
                    tracer_abi::MAX_TRACED_PIDS
                );
            }
        }
    }

    fn harvested(&mut self, result: Result<Harvest, String>) {
        match result {
            Ok(Harvest { root, templates }) => {
                self.counters.route_tables_harvested += 1;
                self.pipeline.set_harvested_routes(root, &templates);
                // Requests served before this line are named from Gym's known routes only.
                tracing::info!(
                    pid = root,
                    "pid {root}: {} route templates from its /openapi.json",
                    templates.len()
                );
            }
            Err(message) => {
                self.counters.route_harvests_failed += 1;
                tracing::warn!("{message}; naming routes from Gym's known routes");
            }
        }
    }

    /// A traced process exited (seen gone by `--discover`, its exit record lost): stop
    /// filtering it and free what was kept for it.
    fn forget(&mut self, probes: &mut LoadedProbes, pid: u32) {
        let logged = self
            .pipeline
            .process(pid)
            .is_some_and(TracedProcess::is_logged);
        let known = self.pipeline.forget(pid);
        self.release(probes, pid);
        self.count_exit(pid, known, logged);
    }

    /// What the driver keeps for an exited process: its filter entry (if user space added
    /// it), probes and context reads. None was made for a new process with its pid yet: they
    /// are made at attach and rescans, between batches.
    fn release(&mut self, probes: &mut LoadedProbes, pid: u32) {
        probes.untrace_exited_pid(pid);
        self.task_lineage.forget(pid, probes);
        self.context_reads.forget(pid, probes);
        self.tls_probes.forget(pid, probes);
    }

    fn count_exit(&mut self, pid: u32, known: bool, logged: bool) {
        if !known {
            return;
        }
        self.counters.processes_exited += 1;
        log_lifecycle(logged, pid, format_args!("pid {pid} exited"));
    }

    /// Every stage's counters as of now.
    fn snapshot(&self, kernel: KernelCounters) -> CounterSnapshot {
        let events_lost_by_cpu = kernel.events_lost_by_cpu;
        let core = self.pipeline.counters();
        CounterSnapshot {
            host: HostCounters {
                events_lost_in_kernel: events_lost_by_cpu.iter().sum(),
                fork_threads_ignored: kernel.threads_ignored,
                forks_unfollowed_filter_full: kernel.forks_unfollowed,
                sockets_untracked_map_full: kernel.sockets_untracked_map_full,
                transfers_on_unknown_sockets: kernel.transfers_on_unknown_sockets,
                socket_calls_untracked_map_full: kernel.socket_calls_untracked_map_full,
                kernel_entries_swept: self.kernel_entries_swept,
                environ_unreadable: self.scanner.as_ref().map_or(0, ProcScanner::unreadable),
                python_runtimes_read: self.context_reads.counters.runtimes_read,
                python_runtimes_off: self.context_reads.counters.runtimes_off,
                python_processes_not_python: self.context_reads.counters.not_python,
                python_threads_registered: self.context_reads.counters.threads_registered,
                python_threads_not_registered: self.context_reads.counters.threads_not_registered,
                context_chains_read: kernel.context_chains_read,
                context_chains_empty: kernel.context_chains_empty,
                context_thread_unknown: kernel.context_thread_unknown,
                context_not_a_context: kernel.context_not_a_context,
                context_reads_failed: kernel.context_reads_failed,
                context_records_lost: kernel.context_records_lost,
                traceparents_injected: kernel.injection.written,
                traceparents_handed_over: kernel.injection.handed_over,
                traceparents_not_known: kernel.injection.no_trace,
                traceparents_carried: kernel.injection.carried,
                traceparents_head_unscanned: kernel.injection.head_unscanned,
                traceparents_owner_answered: kernel.injection.owner_answered,
                traceparents_not_delivered: kernel.injection.not_delivered,
                traceparents_failed: kernel.injection.failed,
                inject_sockets_map_full: kernel.injection.sockets_map_full,
                lineage_processes: self.task_lineage.counters.lineage_processes,
                lineage_processes_off: self.task_lineage.counters.lineage_processes_off,
                lineage_tasks_probed: kernel.lineage.tasks_probed(),
                lineage_request_roots: kernel.lineage.request_roots,
                lineage_roots_without_request: kernel.lineage.roots_without_request,
                lineage_other_roots: kernel.lineage.other_roots,
                lineage_inherited: kernel.lineage.inherited,
                lineage_creator_unseen: kernel.lineage.creator_unseen,
                lineage_creator_unreadable: kernel.lineage.creator_unreadable,
                lineage_tasks_forgotten: self.task_lineage.counters.lineage_tasks_forgotten,
            },
            pipeline: core.pipeline,
            reassembly: core.reassembly,
            tls: core.tls,
            tls_probes: self.tls_probes.counters,
            stitch: core.stitch,
            insight: core.insight,
            agent: self.counters,
            events_lost_by_cpu,
        }
    }

    /// Makes the counters and levels of now readable by /metrics and the self-telemetry.
    fn publish(&mut self, kernel: KernelCounters) {
        self.publish_insight();
        let snapshot = self.snapshot(kernel);
        let levels = self.pipeline.levels();
        self.health.publish(
            &snapshot,
            Gauges {
                processes_traced: levels.processes_traced as u64,
                connections_tracked: levels.connections_tracked as u64,
                spans_pending: levels.spans_pending as u64,
                resident_memory_bytes: resident_memory_bytes(),
            },
        );
    }

    /// The servers' event-loop load, into the gauges and the live view; the live view, for
    /// `GET /rollouts`.
    fn publish_insight(&mut self) {
        let now = Instant::now();
        let traced: Vec<u32> = self.pipeline.traced_pids().collect();
        let mut utilization = foldhash::HashMap::default();
        for &pid in &traced {
            if let Some(share) = self.loop_sampler.sample(pid, now) {
                utilization.insert(pid, share);
                self.pipeline.set_loop_utilization(pid, share);
                if let (Some(report), Some(process)) =
                    (&mut self.report, self.pipeline.process(pid))
                {
                    report.add_loop_load(&process.identity, share);
                }
            }
        }
        self.loop_sampler.retain(|pid| traced.contains(&pid));
        self.pipeline.publish_levels(&utilization);
        if self.health_listening {
            let view = self.pipeline.rollouts_view(now);
            match serde_json::to_string(&view) {
                Ok(json) => self.health.publish_rollouts(json),
                Err(error) => tracing::warn!("the live view could not be written: {error}"),
            }
        }
    }

    /// Takes what is still on the ring (the probes are detached) and releases every held
    /// span.
    fn drain_and_release(&mut self, ring: &mut Ring, kernel: KernelCounters) -> CounterSnapshot {
        self.drain(ring.get_mut());
        self.pipeline.release_all();
        let mut output = std::mem::take(&mut self.output);
        self.pipeline.deliver(&mut output);
        self.pipeline.flush_recording();
        self.offer_released(&mut output.released);
        self.snapshot(kernel)
    }

    /// Released spans to the exporters (and to the report's copy).
    fn offer_released(&mut self, released: &mut Vec<SpanRecord>) {
        if let Some(report) = &mut self.report {
            report.add_spans(released);
        }
        let (queued, dropped) = self.spans.offer(released);
        self.counters.spans_queued += queued as u64;
        self.counters.spans_dropped_queue_full += dropped as u64;
    }

    /// Flushes spans and metrics (side by side, each within --shutdown-timeout; the agent's
    /// own metrics last, so that they count what the flush dropped), then reports every
    /// counter: the exit summary (text for people, one record in a JSON log) and the summary file.
    async fn shutdown(
        self,
        snapshot: CounterSnapshot,
        self_telemetry: Option<SdkMeterProvider>,
        args: &RunArgs,
        started: Instant,
    ) -> Result<()> {
        let levels = self.pipeline.levels();
        let in_flight = levels.requests_in_flight as u64;
        let open_connections = levels.connections_tracked as u64;
        let Agent {
            pipeline,
            spans,
            health,
            report,
            ..
        } = self;
        let metrics = pipeline.into_metrics();
        let shutdown_timeout = Duration::from_millis(args.shutdown_timeout);
        let (totals, ()) = tokio::join!(spans.shutdown(), metrics.shutdown(shutdown_timeout));
        if let Some(provider) = self_telemetry {
            health.publish(&snapshot, health.snapshot().1);
            crate::export::shutdown_providers(vec![provider], SELF_TELEMETRY_SHUTDOWN).await;
        }
        if let Some(path) = &args.ready_file {
            let _ = std::fs::remove_file(path);
        }
        let mut counters = snapshot.counters();
        // The exporter's final totals, then its other counters (drops by reason).
        counters.extend([
            ("spans_exported", totals.spans_exported),
            ("spans_lost_in_export", totals.spans_failed),
        ]);
        counters.extend(
            health
                .export
                .counters()
                .into_iter()
                .filter(|(name, _)| !matches!(*name, "spans_exported" | "spans_lost_in_export")),
        );
        counters.extend([
            (
                "metric_exports_failed",
                health.export.metric_exports_failed(),
            ),
            ("requests_in_flight_at_exit", in_flight),
            ("connections_open_at_exit", open_connections),
        ]);
        if let Some(tree) = &totals.tree {
            counters.extend(tree.counters());
        }
        if crate::ops::logging::is_json() {
            tracing::info!(
                verdict = %Verdict::of(&counters),
                counters = %serde_json::Value::Object(counters_json(&counters)),
                events_lost_by_cpu = %lost_by_cpu(&snapshot.events_lost_by_cpu),
                "stopped"
            );
        } else {
            eprint!("{}", exit_summary::render(&counters, started.elapsed()));
        }
        if let Some(path) = &args.summary_file {
            write_summary(path, &counters, &snapshot.events_lost_by_cpu)?;
        }
        if let Some(report) = report {
            // Last: a page that cannot be written fails the run after everything else.
            tracing::info!("{}", report.finish()?);
        }
        Ok(())
    }
}

/// `RUST_LOG=gym_tracer::records=trace` logs every task-context record and the first bytes of
/// every write (never more than the first line: headers may hold credentials).
const RECORDS_TARGET: &str = "gym_tracer::records";

fn trace_record(record: &[u8]) {
    use crate::kernel::events::{Direction, KernelEvent, decode};
    let direction_name = |direction| match direction {
        Direction::Read => "read",
        Direction::Write => "write",
    };
    // A request or status line, never more: bodies and header values stay out of logs.
    let first_line = |captured: &[u8]| {
        let line = captured
            .split(|&b| b == b'\r' || b == b'?')
            .next()
            .unwrap_or_default();
        let line = &line[..line.len().min(60)];
        if line.is_ascii() && line.iter().all(|b| !b.is_ascii_control()) {
            String::from_utf8_lossy(line).into_owned()
        } else {
            format!("<{} bytes>", captured.len())
        }
    };
    match decode(record) {
        Ok(KernelEvent::TaskContext(context)) => tracing::trace!(
            target: RECORDS_TARGET,
            "context pid={} tid={} fd={} conn={} chain={:x?} lineage={:?}",
            context.pid,
            context.tid,
            context.fd,
            context.conn_id,
            context.writer.chain.as_ref().map(|chain| chain.links()),
            context.writer.lineage
        ),
        Ok(KernelEvent::Data(data)) => tracing::trace!(
            target: RECORDS_TARGET,
            "{} pid={} tid={} fd={} conn={} len={} tail={} {:?}",
            direction_name(data.direction),
            data.pid,
            data.tid,
            data.fd,
            data.conn_id,
            data.total_len,
            data.tail.len(),
            first_line(data.captured)
        ),
        Ok(KernelEvent::TlsData(data)) => tracing::trace!(
            target: RECORDS_TARGET,
            "tls {} pid={} tid={} ssl={:x} entered={} len={} tail={} {:?}",
            direction_name(data.direction),
            data.pid,
            data.tid,
            data.ssl,
            data.start_ns,
            data.total_len,
            data.tail.len(),
            first_line(data.captured)
        ),
        _ => {}
    }
}

/// The kernel's key of a handler's published trace.
fn inject_key(pid: u32, handler: GroupKey) -> InjectKey {
    let (kind, handler) = match handler {
        GroupKey::Context(context) => (tracer_abi::INJECT_BY_CONTEXT, context),
        GroupKey::Origin(origin) => (tracer_abi::INJECT_BY_ORIGIN, origin),
    };
    InjectKey {
        tgid: pid,
        kind,
        handler,
    }
}

/// `cpu:lost` pairs, e.g. `0:0,1:12`.
fn lost_by_cpu(lost: &[u64]) -> String {
    let pairs: Vec<String> = lost
        .iter()
        .enumerate()
        .map(|(cpu, lost)| format!("{cpu}:{lost}"))
        .collect();
    pairs.join(",")
}

fn log_exec(pid: u32, pipeline: &Pipeline<Metrics>) {
    let Some(process) = pipeline.process(pid) else {
        return;
    };
    // /proc is read only for a line that is written.
    if !process.lifecycle_logged_now() {
        return;
    }
    let program = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    log_lifecycle(
        process.is_logged(),
        pid,
        format_args!(
            "pid {pid} exec'd {:?}; its connections are ended, it stays traced as {}",
            program.trim_end(),
            process.identity.labels
        ),
    );
}

/// Writes the exit summary (`--summary-file`) whole or not at all: a reader never sees half.
/// Every counter as one JSON object: the summary file's `counters`, and the JSON log's
/// `stopped` record.
fn counters_json(counters: &[(&str, u64)]) -> serde_json::Map<String, serde_json::Value> {
    counters
        .iter()
        .map(|(name, value)| ((*name).to_string(), (*value).into()))
        .collect()
}

fn write_summary(path: &Path, counters: &[(&str, u64)], lost_by_cpu: &[u64]) -> Result<()> {
    let counters = counters_json(counters);
    let summary = serde_json::json!({ "counters": counters, "events_lost_by_cpu": lost_by_cpu });
    let partial = path.with_extension("partial");
    std::fs::write(&partial, format!("{summary}\n"))
        .and_then(|()| std::fs::rename(&partial, path))
        .with_context(|| format!("writing the summary file {}", path.display()))
}

/// Gives the pages of freed heap back to the kernel. glibc keeps what a burst freed (spans
/// buffered while the collector was slow, a spike of requests in the graph) in its arenas,
/// so without this the agent's RSS, and its cgroup's memory charge, stay at the burst's
/// high-water mark.
fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes no pointers; it locks each arena while it trims it.
    unsafe {
        libc::malloc_trim(0);
    }
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
