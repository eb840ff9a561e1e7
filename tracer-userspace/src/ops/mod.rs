//! Operating the agent: its counters, /healthz and /metrics, its own telemetry and log, and
//! the `doctor`, `reference`, `replay` and `top` commands.

pub mod counters;
pub mod doctor;
pub mod exit_summary;
pub mod health;
pub mod logging;
pub mod reference;
pub mod replay;
pub mod telemetry;
pub mod top;
