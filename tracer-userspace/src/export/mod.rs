//! Exporters: JSON lines on stdout (the default), trace trees on stdout (`--output tree`), or
//! OTLP over gRPC or HTTP/protobuf.
//!
//! Spans go through a bounded queue to one export task, which batches them and hands each
//! batch to a [`SpanSink`]; the OTLP sink groups it by traced process and sends each group
//! with that process's resource. Metrics use one SDK meter provider per traced process,
//! because a provider has one resource.
//!
//! This module imports neither the CLI nor the config: the option types are in
//! [`otlp::options`], and those two build them.

pub(crate) mod json;
pub mod status;
mod meter;
pub mod otlp;
mod tree;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use tokio::sync::{mpsc, watch};

use crate::export::status::ExportStatus;
use crate::model::span::SpanRecord;
use json::JsonLinesSink;
pub use meter::{meter_provider, shutdown_providers};
use otlp::options::OtlpOptions;
use otlp::sink::OtlpSpanSink;
pub use tree::TreeCounters;
use tree::{TreeOptions, TreePrinter};

/// Where one signal goes: to a collector over OTLP, to stdout, both (`otlp,console`: the
/// same spans, with the same ids, in both places), or nowhere (`none`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportTarget {
    pub otlp: Option<OtlpOptions>,
    pub stdout: Option<StdoutFormat>,
}

/// How a signal is written to stdout (`--output`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StdoutFormat {
    JsonLines,
    /// Each finished trace as an indented tree, for a human; the servers' metrics as lines
    /// for people, the agent's own not at all (the `stopped.` line says it all).
    Tree,
}

impl ExportTarget {
    pub const NOWHERE: ExportTarget = ExportTarget {
        otlp: None,
        stdout: None,
    };

    pub fn stdout(format: StdoutFormat) -> Self {
        Self {
            otlp: None,
            stdout: Some(format),
        }
    }

    /// Where the signal goes, for the start line and `check-config`.
    pub fn describe(&self) -> String {
        let otlp = self.otlp.as_ref().map(|otlp| {
            let (protocol, url) = match otlp.protocol {
                otlp::options::OtlpProtocol::Grpc => ("gRPC", otlp.endpoint.url().to_owned()),
                otlp::options::OtlpProtocol::HttpProtobuf => {
                    ("HTTP", otlp.endpoint.http_url(otlp.signal))
                }
            };
            format!(
                "OTLP/{protocol} {}",
                otlp::options::printable_endpoint(&url)
            )
        });
        let stdout = self.stdout.map(|format| match format {
            StdoutFormat::JsonLines => "JSON lines on stdout".to_owned(),
            StdoutFormat::Tree => "stdout for people (--output tree)".to_owned(),
        });
        match (otlp, stdout) {
            (Some(otlp), Some(stdout)) => format!("{otlp} and {stdout}"),
            (Some(one), None) | (None, Some(one)) => one,
            (None, None) => "nowhere (exporter `none`)".into(),
        }
    }
}

/// How spans are queued, batched and kept on their way out, whatever the sink.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportLimits {
    pub batch_size: usize,
    pub queue_size: usize,
    /// Spans held for retry while the collector fails (OTLP only); past it the oldest are
    /// dropped and counted.
    pub buffer_spans: usize,
    /// How long the final export may take at shutdown; what is left after it is counted.
    pub shutdown_timeout: Duration,
}

const BATCH_DELAY: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, Debug, Default)]
pub struct ExportTotals {
    pub spans_exported: u64,
    pub spans_failed: u64,
    /// Set for [`ExportTarget::Tree`].
    pub tree: Option<TreeCounters>,
}

/// Spans cross to the export task in batches (one per release tick), not one by one: each
/// send may wake the task on the other thread, and a wake-up per span cost the agent more
/// than building the span.
pub struct SpanPipeline {
    sender: mpsc::UnboundedSender<Vec<SpanRecord>>,
    /// Spans sent and not yet taken by the export task; bounded by `queue_size`.
    queued: Arc<AtomicUsize>,
    queue_size: usize,
    task: tokio::task::JoinHandle<ExportTotals>,
    /// Set to the final export's deadline when shutdown begins: it also cuts short an
    /// attempt already waiting on a slow collector.
    shutdown: watch::Sender<Option<Instant>>,
    shutdown_timeout: Duration,
}

/// Where the export task sends spans. One task owns the sink and calls it in this order:
/// `export` for each batch as it is cut, `flush` once per tick while spans can still arrive
/// (at least every [`BATCH_DELAY`]), and `shutdown` once, after the queue has closed and its
/// last batch was exported. Nothing else touches the sink, so it needs no locking.
///
/// Counting: every span given to `export` ends up counted exactly once — exported, or dropped
/// with its [`SpanDrop`](crate::export::status::SpanDrop) reason — in `status`, or, for a sink that
/// counts itself, in the totals `shutdown` returns. A failure is recorded in `status`, never
/// returned: the export task has no one to return it to, and must go on with the next batch.
pub trait SpanSink: Send + 'static {
    /// Takes one batch of at most `--export-batch-size` spans, in queue order. Must not wait
    /// on the network (the queue fills meanwhile): a remote sink holds the batch, within its
    /// own bound, and sends it from `flush`.
    fn export(&mut self, batch: Vec<SpanRecord>, status: &ExportStatus);

    /// Sends or prints what is held and due; may wait on the network, bounded by the sink's
    /// own timeouts and cut short when shutdown begins.
    fn flush(&mut self, status: &ExportStatus) -> impl Future<Output = ()> + Send;

    /// The final export: delivers what is held within the shutdown deadline, counts what
    /// is left as dropped, and returns the totals for the exit summary.
    fn shutdown(self, status: &ExportStatus) -> impl Future<Output = ExportTotals> + Send;
}

impl SpanPipeline {
    /// The export task, and the gRPC channel, live on `runtime`.
    /// `status` is told the outcome of every batch (for `/healthz` and `/metrics`).
    pub fn start(
        runtime: &tokio::runtime::Handle,
        target: &ExportTarget,
        limits: ExportLimits,
        status: Arc<ExportStatus>,
    ) -> Result<Self> {
        let _runtime = runtime.enter();
        let (shutdown, shutdown_receiver) = watch::channel(None);
        let (sender, receiver) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let queue = QueueReceiver {
            receiver,
            queued: queued.clone(),
        };
        let batch_size = limits.batch_size;
        let tree = || TreePrinter::new(TreeOptions::default(), std::io::stdout());
        let otlp = target
            .otlp
            .as_ref()
            .map(|options| OtlpSpanSink::new(options, limits.buffer_spans, shutdown_receiver))
            .transpose()?;
        let task = match (otlp, target.stdout) {
            (None, None) => spawn_export(DiscardSink, queue, batch_size, status),
            (None, Some(StdoutFormat::JsonLines)) => {
                spawn_export(JsonLinesSink, queue, batch_size, status)
            }
            (None, Some(StdoutFormat::Tree)) => spawn_export(tree(), queue, batch_size, status),
            (Some(otlp), None) => spawn_export(otlp, queue, batch_size, status),
            (Some(otlp), Some(StdoutFormat::JsonLines)) => spawn_export(
                Mirrored::new(otlp, JsonLinesSink),
                queue,
                batch_size,
                status,
            ),
            (Some(otlp), Some(StdoutFormat::Tree)) => {
                spawn_export(Mirrored::new(otlp, tree()), queue, batch_size, status)
            }
        };
        Ok(Self {
            sender,
            queued,
            queue_size: limits.queue_size,
            task,
            shutdown,
            shutdown_timeout: limits.shutdown_timeout,
        })
    }

    /// Queues the spans in `spans` (leaving it empty) as far as the queue has room; returns
    /// how many were queued and how many dropped because it was full (the caller counts).
    pub fn offer(&self, spans: &mut Vec<SpanRecord>) -> (usize, usize) {
        let room = self
            .queue_size
            .saturating_sub(self.queued.load(Ordering::Relaxed));
        let dropped = spans.len().saturating_sub(room);
        spans.truncate(spans.len() - dropped);
        let queued = spans.len();
        if queued > 0 {
            self.queued.fetch_add(queued, Ordering::Relaxed);
            // The next batch is likely as large: it starts with room for as many.
            let batch = std::mem::replace(spans, Vec::with_capacity(queued));
            if let Err(unsent) = self.sender.send(batch) {
                // The export task is gone (it only stops at shutdown).
                self.queued.fetch_sub(queued, Ordering::Relaxed);
                return (0, dropped + unsent.0.len());
            }
        }
        (queued, dropped)
    }

    /// Exports everything queued (for OTLP within the shutdown timeout; what is left is
    /// counted), then stops.
    pub async fn shutdown(self) -> ExportTotals {
        self.shutdown
            .send_replace(Some(Instant::now() + self.shutdown_timeout));
        drop(self.sender);
        self.task.await.unwrap_or_default()
    }
}

/// `--traces-exporter none`: spans are counted and let go.
struct DiscardSink;

impl SpanSink for DiscardSink {
    fn export(&mut self, batch: Vec<SpanRecord>, status: &ExportStatus) {
        status.record_discarded(batch.len() as u64);
    }

    async fn flush(&mut self, _status: &ExportStatus) {}

    async fn shutdown(self, _status: &ExportStatus) -> ExportTotals {
        ExportTotals::default()
    }
}

/// The same spans to two sinks (`--traces-exporter otlp,console`). The primary's outcome is
/// what the counters report (spans the collector accepted or lost); the mirror (stdout)
/// counts into a status of its own, and only its failures are logged.
struct Mirrored<P, M> {
    primary: P,
    mirror: M,
    mirror_status: ExportStatus,
}

impl<P: SpanSink, M: SpanSink> Mirrored<P, M> {
    fn new(primary: P, mirror: M) -> Self {
        Self {
            primary,
            mirror,
            mirror_status: ExportStatus::default(),
        }
    }
}

impl<P: SpanSink, M: SpanSink> SpanSink for Mirrored<P, M> {
    fn export(&mut self, batch: Vec<SpanRecord>, status: &ExportStatus) {
        self.mirror.export(batch.clone(), &self.mirror_status);
        self.primary.export(batch, status);
    }

    async fn flush(&mut self, status: &ExportStatus) {
        self.mirror.flush(&self.mirror_status).await;
        self.primary.flush(status).await;
    }

    async fn shutdown(self, status: &ExportStatus) -> ExportTotals {
        let mirrored = self.mirror.shutdown(&self.mirror_status).await;
        if mirrored.spans_failed > 0 {
            tracing::warn!(
                "{} spans could not be written to stdout (they went to the collector)",
                mirrored.spans_failed
            );
        }
        ExportTotals {
            tree: mirrored.tree,
            ..self.primary.shutdown(status).await
        }
    }
}

/// The export task's end of the span queue.
struct QueueReceiver {
    receiver: mpsc::UnboundedReceiver<Vec<SpanRecord>>,
    queued: Arc<AtomicUsize>,
}

fn spawn_export<S: SpanSink>(
    sink: S,
    queue: QueueReceiver,
    batch_size: usize,
    status: Arc<ExportStatus>,
) -> tokio::task::JoinHandle<ExportTotals> {
    tokio::spawn(run_span_export(sink, queue, batch_size, status))
}

/// Cuts the queue into batches of `batch_size`, or what came within [`BATCH_DELAY`], and
/// drives `sink` until the queue closes.
async fn run_span_export<S: SpanSink>(
    mut sink: S,
    mut queue: QueueReceiver,
    batch_size: usize,
    status: Arc<ExportStatus>,
) -> ExportTotals {
    let mut batch = Vec::new();
    loop {
        let deadline = tokio::time::sleep(BATCH_DELAY);
        tokio::pin!(deadline);
        let open = loop {
            tokio::select! {
                received = queue.receiver.recv() => match received {
                    Some(spans) => {
                        queue.queued.fetch_sub(spans.len(), Ordering::Relaxed);
                        if batch.is_empty() {
                            // Taken whole: copying every span record into the batch was
                            // as many memory moves as encoding them.
                            batch = spans;
                        } else {
                            batch.extend(spans);
                        }
                        if batch.len() >= batch_size {
                            break true;
                        }
                    }
                    None => break false,
                },
                _ = &mut deadline => break true,
            }
        };
        while !batch.is_empty() {
            let rest = batch.split_off(batch.len().min(batch_size));
            sink.export(std::mem::replace(&mut batch, rest), &status);
        }
        if !open {
            return sink.shutdown(&status).await;
        }
        sink.flush(&status).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::model::ids::SpanId;
    use crate::model::ids::TraceId;
    use crate::model::span::SpanKind;
    use crate::pipeline::testing;

    #[derive(Debug, PartialEq, Eq)]
    enum Call {
        Export(usize),
        Flush,
        Shutdown,
    }

    /// Records what the export task asks of it, and counts every span as exported.
    struct RecordingSink(Arc<Mutex<Vec<Call>>>);

    impl SpanSink for RecordingSink {
        fn export(&mut self, batch: Vec<SpanRecord>, status: &ExportStatus) {
            status.record_success(batch.len() as u64, false);
            self.0.lock().unwrap().push(Call::Export(batch.len()));
        }

        async fn flush(&mut self, _status: &ExportStatus) {
            self.0.lock().unwrap().push(Call::Flush);
        }

        async fn shutdown(self, status: &ExportStatus) -> ExportTotals {
            self.0.lock().unwrap().push(Call::Shutdown);
            ExportTotals {
                spans_exported: status.spans_exported(),
                ..ExportTotals::default()
            }
        }
    }

    fn span(id: u8) -> SpanRecord {
        SpanRecord {
            trace_id: TraceId([id; 16]),
            start_unix_ns: 10,
            end_unix_ns: 20,
            ..testing::span("GET /health", SpanKind::Server, SpanId([id; 8]))
        }
    }

    #[tokio::test]
    async fn batches_are_cut_at_the_batch_size_and_shutdown_comes_once_last() {
        let (sender, receiver) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(5));
        sender.send((1..=5).map(span).collect()).unwrap();
        drop(sender);
        let calls = Arc::new(Mutex::new(Vec::new()));
        let queue = QueueReceiver {
            receiver,
            queued: queued.clone(),
        };
        let status = Arc::new(ExportStatus::default());
        let totals = run_span_export(RecordingSink(calls.clone()), queue, 2, status.clone()).await;
        assert_eq!(
            *calls.lock().unwrap(),
            [
                Call::Export(2),
                Call::Export(2),
                Call::Export(1),
                Call::Flush,
                Call::Shutdown
            ]
        );
        assert_eq!(totals.spans_exported, 5);
        assert_eq!(queued.load(Ordering::Relaxed), 0);
    }
}
