//! gym-tracer: attaches to NeMo Gym's HTTP server processes from the kernel and exports the
//! spans and metrics their own telemetry would have produced.
//!
//! ```text
//!  kernel (tracer-ebpf)           │ user space: one folder per stage, in data-flow order
//!  syscall + sched tracepoints    │
//!  PID filter before any copy ──ring buffer──▶ kernel ─▶ reassembly ─▶ pipeline core ─▶ export
//!                                 │  (decode)   (connections,  (stitch: parents,   (JSON lines,
//!                                 │              HTTP heads)    trace ids; signals:  tree, OTLP)
//!                                 │                             meaning, spans,
//!                                 │  processes: who each PID is  metrics; insight:
//!                                 │  (discovery, identity,       phases, stragglers,
//!                                 │   routes)                    live view)
//! ```
//!
//! Stages, each importing [`model`] (the messages between them) and the stages before it:
//! - `gym`: Gym's knowledge — routes, rollout ids, span groups, `gym.*` names. Pure.
//! - `model`: ids, the HTTP exchange, the span record, a process's identity, attribute keys,
//!   the counters each stage owns.
//! - `kernel`: loads the eBPF programs with the layouts they read (BTF, tracepoint formats),
//!   the PID filter, and decodes ring-buffer records.
//! - `processes`: discovery of Gym servers, their identity and harvested route tables.
//! - `reassembly`: the connection table and the HTTP/1.x parser: exchanges out.
//! - `stitch`: parents and trace ids from evidence; holds spans until they are decided.
//! - `signals`: an exchange's Gym meaning, its spans and its metric recordings.
//! - `insight`: after stitching: each rollout's time split along its critical path
//!   (`gym.rollout.phase.*`), stragglers, the servers' queueing and load, the live view
//!   (`GET /rollouts`, `gym-tracer top`).
//! - `export`: sinks behind one trait (JSON lines, trees, OTLP with retries).
//! - [`report`]: after the run (or from its JSON output): one HTML page about a batch of
//!   rollouts, its charts drawn as SVG.
//! - [`pipeline`]: the one pure core that drives the stages per record; the agent and the
//!   fuzz target ([`pipeline::replay`]) both drive it.
//! - [`agent`]: the running agent — kernel and exporters around the core, process lifecycle.
//! - [`ops`]: counters snapshot, /healthz and /metrics, self-telemetry, log, `doctor`,
//!   `reference`.
//! - [`config`]: the command line, environment and config file, layered.
//!
//! The binary (`main.rs`) only dispatches the command line.

mod gym;
mod model;

mod kernel;
mod processes;
mod reassembly;
mod stitch;
mod signals;
pub mod insight;
mod export;
pub mod report;

pub mod pipeline;
pub mod agent;
pub mod ops;
pub mod config;

/// The bench's floor programs (the `syscall_floor` example); the agent never loads them.
pub use kernel::floor;
