//! Insight: where a rollout's time went, which rollouts straggle, which servers saturate. The
//! stage after stitching: it reads whole, stitched rollouts as their spans are released
//! ([`rollouts`]), and keeps the requests in flight for the live view ([`view`], served as
//! `GET /rollouts` and shown by `gym-tracer top`). No I/O of its own: the driver hands it
//! the event-loop threads' CPU shares it reads from /proc.

pub mod critical_path;
pub mod phases;
pub mod rollouts;
pub mod stats;
pub mod view;

use foldhash::{HashMap, HashMapExt};
use std::net::SocketAddr;
use std::time::Instant;

use crate::gym::ServerType;
use crate::gym::routes::strip_rollout_prefix;
use crate::model::counters::counters;
use crate::model::exchange::{RequestStart, Role};
use crate::model::ids::{SpanId, TraceId, hex};
use crate::model::rollout::{Phase, RolloutSummary};
use crate::model::service::ServiceIdentity;
use crate::model::span::{SpanKind, SpanRecord, Text};
use crate::signals::spans::client_span_name;
use crate::stitch::Stitcher;
use critical_path::SpanClass;
use phases::Context;
use rollouts::{Rollouts, STRAGGLER_FACTOR, STRAGGLER_MIN_COMPLETED};
use stats::Window;
use view::{Completed, LiveRollout, LiveSpan, MAX_LISTED, RolloutsView, ServerLoad};

/// Requests in flight the live view keeps, over every traced process (about 150 bytes
/// each); past it a request is not shown (`live_requests_untracked`).
pub const MAX_LIVE_REQUESTS: usize = 131_072;

counters! {
    /// What the insight stage counts.
    pub struct InsightCounters {
        /// Rollouts whose `gym.rollout` span went out with its phases.
        traced rollouts_completed,
        /// Completed rollouts flagged as stragglers (`gym.rollout.straggler`). Over 3 times their
        /// agent's median, once that agent completed 20.
        note rollout_stragglers,
        /// Rollouts whose `gym.rollout` span went out without phases. It carried no rollout id and
        /// its `/run` was not seen starting (the agent attached mid-rollout).
        lost rollouts_not_gathered,
        /// Spans of a rollout released after its `gym.rollout` span: not in its phases. The spans
        /// themselves are exported.
        note rollout_spans_after_end,
        /// Spans of running rollouts dropped from the phase bookkeeping for memory. Past
        /// `MAX_GATHERED_SPANS` (262,144) the oldest rollout's go: the spans are still exported,
        /// but its phases lack them.
        lost rollout_spans_evicted,
        /// Spans in a rollout's trace that are not under its `gym.rollout`. A call whose parent was
        /// not decided is a root of its own in the same trace (see `parents_*`).
        note rollout_spans_outside_tree,
        /// Requests in flight left out of the live view (`gym-tracer top`). Past
        /// `MAX_LIVE_REQUESTS` (131,072) at once, `/rollouts` does not show them; their spans are
        /// still exported.
        note live_requests_untracked,
    }
}

/// A request in flight, as the live view names it.
#[derive(Debug)]
struct LiveRequest {
    pid: u32,
    role: Role,
    /// Server: `POST /verify` (the rollout prefix stripped); call: `HTTP POST`.
    name: Text,
    verify: bool,
    peer: Option<SocketAddr>,
    started: Instant,
    /// An agent's `/run`: a rollout, and the trace its spans were to be in at its start.
    run: Option<TraceId>,
}

/// What the live view needs to know of a traced process.
pub struct ProcessView {
    pub name: String,
    pub server_type: Option<ServerType>,
}

#[derive(Default)]
struct ServerStats {
    queue_delays: Window,
    loop_utilization: Option<f64>,
}

#[derive(Default)]
pub struct Insight {
    pub rollouts: Rollouts,
    requests: HashMap<SpanId, LiveRequest>,
    servers: HashMap<u32, ServerStats>,
    /// Rollouts completed since the driver last took them (for the metrics).
    pub finished: Vec<RolloutSummary>,
}

impl Insight {
    pub fn counters(&self) -> InsightCounters {
        self.rollouts.counters
    }

    /// A request started; `run`: the trace of an agent server's `/run` as the stitcher sees it
    /// at its start (its spans are gathered by it until they carry the rollout's id).
    pub fn request_started(&mut self, start: &RequestStart, now: Instant, run: Option<TraceId>) {
        if let Some(trace) = run {
            self.rollouts.run_started(trace);
        }
        if self.requests.len() >= MAX_LIVE_REQUESTS {
            self.rollouts.counters.live_requests_untracked += 1;
            return;
        }
        let route = strip_rollout_prefix(&start.path).route_path;
        // A call's name is shared (`HTTP POST`); a served request's is its own.
        let name = match start.role {
            Role::Server => Text::Owned(format!("{} {route}", start.method)),
            Role::Client => client_span_name(&start.method),
        };
        self.requests.insert(
            start.span_id,
            LiveRequest {
                pid: start.pid,
                role: start.role,
                name,
                verify: start.role == Role::Server && route == "/verify",
                peer: start.peer,
                started: now,
                run,
            },
        );
    }

    /// A request ended; `trace`: its trace as the stitcher sees it now (a `/run`'s may have
    /// changed since it started: its body named the rollout).
    pub fn request_ended(&mut self, request: SpanId, trace: impl FnOnce() -> TraceId) {
        if let Some(LiveRequest {
            run: Some(started), ..
        }) = self.requests.remove(&request)
        {
            self.rollouts.run_trace_now(started, trace());
        }
    }

    pub fn process_gone(&mut self, pid: u32) {
        self.requests.retain(|_, request| request.pid != pid);
        self.servers.remove(&pid);
    }

    /// A batch of released spans: rollouts that ended get their phases ([`Rollouts::observe`]).
    pub fn observe(
        &mut self,
        batch: &mut [SpanRecord],
        server_type: &impl Fn(&ServiceIdentity) -> Option<ServerType>,
    ) {
        let first = self.finished.len();
        self.rollouts
            .observe(batch, server_type, &mut self.finished);
        for summary in &self.finished[first..] {
            for (server, _, delay) in &summary.queue_delays {
                let stats = self.servers.entry(server.pid).or_default();
                stats.queue_delays.push(*delay);
            }
        }
    }

    /// The share of the last interval a traced process's event-loop thread was on a CPU.
    pub fn set_loop_utilization(&mut self, pid: u32, share: f64) {
        self.servers.entry(pid).or_default().loop_utilization = Some(share);
    }

    /// Rollouts in flight per agent process.
    pub fn runs_in_flight(&self) -> HashMap<u32, u64> {
        let mut runs = HashMap::new();
        for request in self.requests.values().filter(|r| r.run.is_some()) {
            *runs.entry(request.pid).or_insert(0) += 1;
        }
        runs
    }

    /// The live view as of `now`. `process` names a traced process, `peer` a call's peer.
    pub fn view(
        &self,
        now: Instant,
        stitcher: &Stitcher,
        process: impl Fn(u32) -> Option<ProcessView>,
        peer: impl Fn(SocketAddr) -> Option<String>,
    ) -> RolloutsView {
        let mut live: Vec<LiveRollout> = self
            .requests
            .iter()
            .filter(|(_, request)| request.run.is_some())
            .map(|(&id, run)| self.live_rollout(id, run, now, stitcher, &process, &peer))
            .collect();
        let in_flight = live.len();
        live.sort_by(|a, b| b.elapsed_s.total_cmp(&a.elapsed_s));
        live.truncate(MAX_LISTED);
        let seconds = |ns: u64| ns as f64 / 1e9;
        let completed = &self.rollouts.completed;
        let mut in_flight_by_pid: HashMap<u32, usize> = HashMap::new();
        for request in self.requests.values().filter(|r| r.role == Role::Server) {
            *in_flight_by_pid.entry(request.pid).or_insert(0) += 1;
        }
        let mut servers: Vec<ServerLoad> = self
            .servers
            .keys()
            .chain(in_flight_by_pid.keys())
            .copied()
            .collect::<std::collections::BTreeSet<u32>>()
            .into_iter()
            .filter_map(|pid| {
                let view = process(pid)?;
                let stats = self.servers.get(&pid);
                Some(ServerLoad {
                    name: view.name,
                    pid,
                    server_type: view.server_type.map(|t| t.short_name().to_owned()),
                    loop_utilization: stats.and_then(|s| s.loop_utilization),
                    queue_delay_p90_s: stats
                        .and_then(|s| s.queue_delays.quantile(0.9))
                        .map(seconds),
                    requests_in_flight: in_flight_by_pid.get(&pid).copied().unwrap_or(0),
                })
            })
            .collect();
        servers.sort_by(|a, b| a.name.cmp(&b.name).then(a.pid.cmp(&b.pid)));
        RolloutsView {
            in_flight,
            rollouts: live,
            completed: Completed {
                count: completed.count(),
                p50_s: completed.median().map(seconds),
                p90_s: completed.quantile(0.9).map(seconds),
                max_s: completed.max().map(seconds),
            },
            servers,
        }
    }

    fn live_rollout(
        &self,
        id: SpanId,
        run: &LiveRequest,
        now: Instant,
        stitcher: &Stitcher,
        process: &impl Fn(u32) -> Option<ProcessView>,
        peer: &impl Fn(SocketAddr) -> Option<String>,
    ) -> LiveRollout {
        let elapsed = now.saturating_duration_since(run.started);
        let server_of = |pid: u32| process(pid).map_or_else(|| format!("pid {pid}"), |p| p.name);
        let agent = server_of(run.pid);
        let chain: Vec<&LiveRequest> = stitcher
            .in_flight_chain(id)
            .iter()
            .filter_map(|id| self.requests.get(id))
            .collect();
        let deepest = chain.last().copied().unwrap_or(run);
        let phase = phase_now(&chain, |pid| process(pid).and_then(|p| p.server_type), peer);
        let trace = stitcher.trace_of(id);
        let (model_calls, tool_calls) = self.rollouts.calls_so_far(trace);
        let straggler = self.rollouts.by_agent.get(&agent).is_some_and(|window| {
            window.count() >= STRAGGLER_MIN_COMPLETED
                && window.median().is_some_and(|median| {
                    elapsed.as_nanos() > u128::from(STRAGGLER_FACTOR * median)
                })
        });
        LiveRollout {
            rollout_id: stitcher.rollout_of(id).map(|id| id.as_str().to_owned()),
            trace_id: hex(&trace.0),
            agent,
            elapsed_s: elapsed.as_secs_f64(),
            phase: phase.as_str().to_owned(),
            span: LiveSpan {
                name: deepest.name.to_string(),
                server: server_of(deepest.pid),
                peer: (deepest.role == Role::Client)
                    .then(|| {
                        deepest
                            .peer
                            .map(|p| peer(p).unwrap_or_else(|| p.to_string()))
                    })
                    .flatten(),
            },
            model_calls,
            tool_calls,
            straggler,
        }
    }
}

/// The phase a rollout is in now, from its chain of requests in flight (`/run` first): the
/// rules of the critical path applied to the deepest one.
fn phase_now(
    chain: &[&LiveRequest],
    server_type: impl Fn(u32) -> Option<ServerType>,
    peer: &impl Fn(SocketAddr) -> Option<String>,
) -> Phase {
    let mut context = Context::Agent;
    let mut deepest = SpanClass::Agent;
    for request in chain {
        let kind = match request.role {
            Role::Client => SpanKind::Client,
            Role::Server => SpanKind::Server,
        };
        let callee_traced = request.peer.and_then(peer).is_some();
        deepest = SpanClass::of(
            kind,
            server_type(request.pid),
            request.verify,
            callee_traced,
        );
        context = context.within(deepest);
    }
    // Live, a callee's SERVER span is not below its call yet: only its name says it is traced.
    context.own_phase(deepest, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::testing::loopback;

    fn request(pid: u32, role: Role, name: &str, peer: u16) -> LiveRequest {
        LiveRequest {
            pid,
            role,
            name: name.to_owned().into(),
            verify: name == "POST /verify",
            peer: Some(loopback(peer)),
            started: Instant::now(),
            run: None,
        }
    }

    /// The phase now is the critical path's rule applied to the deepest request in flight.
    #[test]
    fn the_phase_now_is_the_deepest_requests() {
        let types = |pid: u32| match pid {
            1 => Some(ServerType::Agent),
            2 => Some(ServerType::Model),
            3 => Some(ServerType::Resources),
            _ => None,
        };
        // Port 8002 is a traced model server; 9000 nobody's.
        let peer =
            |address: SocketAddr| (address.port() == 8002).then(|| "policy_model".to_owned());
        let run = request(1, Role::Server, "POST /run", 50000);
        let to_model = request(1, Role::Client, "HTTP POST", 8002);
        let in_model = request(2, Role::Server, "POST /v1/responses", 50001);
        let upstream = request(2, Role::Client, "HTTP POST", 9000);
        let external = request(1, Role::Client, "HTTP POST", 9000);
        let verify = request(3, Role::Server, "POST /verify", 50002);
        let judge = request(3, Role::Client, "HTTP POST", 8002);
        let cases: [(&[&LiveRequest], Phase); 7] = [
            (&[&run], Phase::Agent),
            (&[&run, &to_model], Phase::Queue),
            (&[&run, &to_model, &in_model], Phase::Model),
            (&[&run, &to_model, &in_model, &upstream], Phase::Model),
            (&[&run, &external], Phase::External),
            (&[&run, &to_model, &verify], Phase::Verify),
            (&[&run, &to_model, &verify, &judge], Phase::Queue),
        ];
        for (chain, want) in cases {
            let names: Vec<&str> = chain.iter().map(|r| &*r.name).collect();
            assert_eq!(phase_now(chain, types, &peer), want, "{names:?}");
        }
    }
}
