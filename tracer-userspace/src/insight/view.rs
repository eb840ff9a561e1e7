//! `GET /rollouts`: what the live view shows, as JSON. The agent writes it; `gym-tracer top`
//! reads it (from this host or another), so both sides share these types.

use serde::{Deserialize, Serialize};

/// How many rollouts in flight the view lists (the slowest first); `in_flight` counts all.
pub const MAX_LISTED: usize = 1000;

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RolloutsView {
    /// Rollouts in flight now, across every agent server.
    pub in_flight: usize,
    /// The slowest [`MAX_LISTED`] of them, slowest first.
    pub rollouts: Vec<LiveRollout>,
    pub completed: Completed,
    pub servers: Vec<ServerLoad>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LiveRollout {
    /// Not yet known while the `/run` body is being read.
    pub rollout_id: Option<String>,
    pub trace_id: String,
    pub agent: String,
    pub elapsed_s: f64,
    /// The phase it is in now (`model`, `tool`, `verify`, `queue`, `external`, `agent`).
    pub phase: String,
    /// The request it is in now, the deepest one in flight.
    pub span: LiveSpan,
    pub model_calls: i64,
    pub tool_calls: i64,
    pub straggler: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LiveSpan {
    /// `POST /v1/responses` for a request a server is handling, `HTTP POST` for a call.
    pub name: String,
    /// The server handling it (for a call: the caller), by Gym name or pid.
    pub server: String,
    /// For a call: whom it calls (`peer.service`, else the address).
    pub peer: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Completed {
    pub count: u64,
    /// Over the last 1,024 completed rollouts.
    pub p50_s: Option<f64>,
    pub p90_s: Option<f64>,
    /// Since the agent started.
    pub max_s: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ServerLoad {
    pub name: String,
    pub pid: u32,
    /// `agent`, `model`, `resources`, or null when not known.
    pub server_type: Option<String>,
    /// The share of the last second its event-loop (main) thread was on a CPU, 0–1.
    pub loop_utilization: Option<f64>,
    /// The 90th percentile of how long its last requests from traced clients waited before
    /// it read them.
    pub queue_delay_p90_s: Option<f64>,
    pub requests_in_flight: usize,
}
