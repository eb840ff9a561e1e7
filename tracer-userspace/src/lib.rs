//! gym-tracer: attaches to NeMo Gym's HTTP server processes from the kernel and exports the
//! spans and metrics their own telemetry would have produced.
//!
//! Data flow, one module per stage: `discovery` (which processes) → `loader` (kernel
//! programs, PID filter) → ring buffer → `events` (decode) → `connections` (per-connection
//! state, `http` reassembly) → `classify` (Gym meaning: routes, rollout ids, `gym.*` spans,
//! from `gym` and the per-process state in `processes`, fed by `harvest`) → `spans` /
//! `metrics` → `export` (with `retry`: the buffer and backoff for collector outages).
//! `agent` assembles it. Around it: `config` (flags, environment and the config file),
//! `logging` (the agent's own log), `health` (/healthz, /metrics), `telemetry` (the agent's
//! own counters as `gym_tracer.*` OTel metrics), `doctor` (what this host supports) and
//! `reference` (the generated docs).
//!
//! The binary (`main.rs`) only dispatches the command line; everything is in this library so
//! that the fuzz target (`fuzz/`) and its corpus replay ([`fuzzing`]) drive the same code.

pub mod agent;
mod btf;
mod classify;
pub mod cli;
mod clock;
pub mod config;
mod connections;
mod discovery;
pub mod doctor;
mod events;
mod export;
pub mod fuzzing;
mod gym;
mod harvest;
mod health;
mod http;
mod identity;
mod loader;
pub mod logging;
mod metrics;
mod processes;
pub mod reference;
mod spans;
mod stats;
mod stitch;
mod telemetry;
