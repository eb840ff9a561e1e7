//! Whole rollouts as they leave the stitcher: the spans of each rollout gathered by trace;
//! when its `gym.rollout` span arrives (the stitcher lets it go only once no span it still
//! holds could be below it: [`crate::stitch::rollout_tops`]), its phases, counts, tokens and
//! straggler flag are put on that span, and the metrics record them.

use foldhash::{HashMap, HashSet};
use std::collections::VecDeque;
use std::sync::Arc;

use super::critical_path::{self, PathSpan, SpanClass, phases};
use super::stats::Window;
use crate::gym::ServerType;
use crate::model::attributes as attr;
use crate::model::ids::{SpanId, TraceId};
use crate::model::rollout::RolloutSummary;
use crate::model::service::ServiceIdentity;
use crate::model::span::{AttributeValue, SpanFacts, SpanKind, SpanRecord, Text};
use crate::stitch::rollout_tops::is_rollout_top;
use crate::stitch::rollout_trace_id;

/// Spans of rollouts still running, over all of them: past it the oldest rollout's spans
/// are given up (`rollout_spans_evicted`). About 150 bytes each: 40 MB at most.
pub const MAX_GATHERED_SPANS: usize = 262_144;
/// Traces of `/run`s seen starting, kept until their rollout completes; past this many the
/// oldest is forgotten (a `/run` that never became a `gym.rollout`: its span group is off).
const RUN_TRACES_KEEP: usize = 65_536;
/// Span ids of ended rollouts remembered, so that a span of one that comes after its end is
/// counted (`rollout_spans_after_end`), not gathered for a rollout that will never end.
const ENDED_KEEP: usize = 65_536;
/// A straggler takes more than this many times its agent's median rollout…
pub const STRAGGLER_FACTOR: u64 = 3;
/// …once the agent has completed at least this many.
pub const STRAGGLER_MIN_COMPLETED: u64 = 20;

/// What is kept of a span of a running rollout.
#[derive(Clone, Debug)]
struct Gathered {
    span_id: SpanId,
    parent: Option<SpanId>,
    start_ns: u64,
    end_ns: u64,
    kind: SpanKind,
    server_type: Option<ServerType>,
    service: Arc<ServiceIdentity>,
    facts: SpanFacts,
}

/// The rollouts' side of the insight stage.
#[derive(Default)]
pub struct Rollouts {
    gathering: HashMap<TraceId, Vec<Gathered>>,
    /// Traces in the order their first span came (eviction order).
    order: VecDeque<TraceId>,
    gathered: usize,
    ended: HashSet<SpanId>,
    ended_order: VecDeque<SpanId>,
    /// The traces of `/run`s seen starting: a span in one is a rollout's even without the
    /// rollout id (a `/run` whose body named none).
    run_traces: HashSet<TraceId>,
    run_traces_order: VecDeque<TraceId>,
    /// Completed rollouts' durations per agent server (by name, else pid).
    pub by_agent: HashMap<String, Window>,
    /// Every agent's completed rollouts.
    pub completed: Window,
    pub counters: super::InsightCounters,
}

impl Rollouts {
    /// Looks at one batch of released spans: gathers those of rollouts, then completes every
    /// rollout whose `gym.rollout` span is in the batch (its phases and counts go onto that
    /// span). The stitcher lets a rollout's top go only once its tree is whole
    /// ([`crate::stitch::rollout_tops`]): nothing of it is still to come.
    pub fn observe(
        &mut self,
        batch: &mut [SpanRecord],
        server_type: &impl Fn(&ServiceIdentity) -> Option<ServerType>,
        done: &mut Vec<RolloutSummary>,
    ) {
        for span in batch.iter() {
            self.gather(span, server_type);
        }
        for span in batch.iter_mut() {
            if is_rollout_top(span) {
                done.extend(self.complete(span));
            }
        }
    }

    fn gather(
        &mut self,
        span: &SpanRecord,
        server_type: &impl Fn(&ServiceIdentity) -> Option<ServerType>,
    ) {
        if let Some(parent) = span.parent_span_id
            && self.ended.contains(&parent)
        {
            self.counters.rollout_spans_after_end += 1;
            self.remember_ended(span.span_id);
            return;
        }
        if span.facts.rollout_id.is_none() && !self.run_traces.contains(&span.trace_id) {
            return; // not part of a rollout: nothing here is asked of it
        }
        let gathered = Gathered {
            span_id: span.span_id,
            parent: span.parent_span_id,
            start_ns: span.start_unix_ns,
            end_ns: span.end_unix_ns.max(span.start_unix_ns),
            kind: span.kind,
            server_type: server_type(&span.service),
            service: span.service.clone(),
            facts: span.facts.clone(),
        };
        while self.gathered >= MAX_GATHERED_SPANS {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some(spans) = self.gathering.remove(&oldest) {
                self.gathered -= spans.len();
                self.counters.rollout_spans_evicted += spans.len() as u64;
            }
        }
        let spans = self.gathering.entry(span.trace_id).or_insert_with(|| {
            self.order.push_back(span.trace_id);
            Vec::new()
        });
        spans.push(gathered);
        self.gathered += 1;
    }

    /// The rollout whose `gym.rollout` span this is has ended: its gathered subtree becomes
    /// its phases and counts.
    fn complete(&mut self, rollout_span: &mut SpanRecord) -> Option<RolloutSummary> {
        let trace = rollout_span.trace_id;
        if self.run_traces.remove(&trace) {
            self.run_traces_order.retain(|t| *t != trace);
        }
        let mut spans = self.gathering.remove(&trace).unwrap_or_default();
        self.gathered -= spans.len();
        let Some(root) = spans.iter().position(|s| s.span_id == rollout_span.span_id) else {
            // Not gathered: no rollout id, and its /run was not seen starting.
            self.counters.rollouts_not_gathered += 1;
            self.put_back(trace, spans);
            return None;
        };
        let (path_spans, members) = subtree(&spans, root);
        let phases = phases(&path_spans, 0);
        let counts = counts(&spans, &members, &path_spans);
        let duration_ns = rollout_span
            .end_unix_ns
            .saturating_sub(rollout_span.start_unix_ns);
        let agent_key = agent_key(&rollout_span.service);
        let window = self.by_agent.entry(agent_key).or_default();
        let straggler = window.count() >= STRAGGLER_MIN_COMPLETED
            && window
                .median()
                .is_some_and(|median| duration_ns > STRAGGLER_FACTOR * median);
        window.push(duration_ns);
        self.completed.push(duration_ns);
        self.counters.rollouts_completed += 1;
        // Its own /run SERVER span (its parent) is in its trace, not under it.
        let run = usize::from(
            rollout_span
                .parent_span_id
                .is_some_and(|parent| spans.iter().any(|s| s.span_id == parent)),
        );
        self.counters.rollout_spans_outside_tree += (spans.len() - members.len() - run) as u64;
        let attributes = &mut rollout_span.attributes;
        for (phase, ms) in phases.whole_ms() {
            attributes.push((phase.attribute(), AttributeValue::Int(ms as i64)));
        }
        attributes.push((
            attr::GYM_ROLLOUT_MODEL_CALLS,
            AttributeValue::Int(counts.model_calls),
        ));
        attributes.push((
            attr::GYM_ROLLOUT_TOOL_CALLS,
            AttributeValue::Int(counts.tool_calls),
        ));
        if let Some(tokens) = counts.input_tokens {
            attributes.push((attr::GEN_AI_USAGE_INPUT_TOKENS, AttributeValue::Int(tokens)));
        }
        if let Some(tokens) = counts.output_tokens {
            attributes.push((
                attr::GEN_AI_USAGE_OUTPUT_TOKENS,
                AttributeValue::Int(tokens),
            ));
        }
        rollout_span.facts.input_tokens = counts.input_tokens;
        rollout_span.facts.output_tokens = counts.output_tokens;
        if straggler {
            self.counters.rollout_stragglers += 1;
            attributes.push((attr::GYM_ROLLOUT_STRAGGLER, AttributeValue::Bool(true)));
        }
        for &member in &members {
            self.remember_ended(spans[member].span_id);
        }
        // A trace of its own rollout holds nothing else that will end; a shared trace (a
        // traced driver's) keeps the other rollouts' spans.
        let own_trace = (rollout_span.facts.rollout_id.as_ref())
            .is_some_and(|id| rollout_trace_id(id) == trace);
        if !own_trace {
            let mut index = 0;
            let members: HashSet<usize> = members.iter().copied().collect();
            spans.retain(|_| {
                let keep = !members.contains(&index);
                index += 1;
                keep
            });
            self.counters.rollout_spans_outside_tree -= (spans.len() - run) as u64;
            self.put_back(trace, spans);
        }
        Some(RolloutSummary {
            agent: rollout_span.service.clone(),
            duration_ns,
            phases,
            straggler,
            queue_delays: counts.queue_delays,
        })
    }

    /// A `/run` started, its spans to be in `trace`.
    pub fn run_started(&mut self, trace: TraceId) {
        if self.run_traces.insert(trace) {
            self.run_traces_order.push_back(trace);
        }
        while self.run_traces_order.len() > RUN_TRACES_KEEP {
            if let Some(oldest) = self.run_traces_order.pop_front() {
                self.run_traces.remove(&oldest);
            }
        }
    }

    /// A `/run` that started with trace `started` ended with trace `now`.
    pub fn run_trace_now(&mut self, started: TraceId, now: TraceId) {
        if started != now && self.run_traces.remove(&started) {
            self.run_traces_order.retain(|t| *t != started);
            self.run_started(now);
        }
    }

    fn put_back(&mut self, trace: TraceId, spans: Vec<Gathered>) {
        if !spans.is_empty() {
            self.gathered += spans.len();
            self.gathering.insert(trace, spans);
        }
    }

    fn remember_ended(&mut self, span: SpanId) {
        if self.ended_order.len() >= ENDED_KEEP
            && let Some(oldest) = self.ended_order.pop_front()
        {
            self.ended.remove(&oldest);
        }
        if self.ended.insert(span) {
            self.ended_order.push_back(span);
        }
    }

    /// A trace's gathered spans so far (the live view's counts of a running rollout).
    pub fn calls_so_far(&self, trace: TraceId) -> (i64, i64) {
        let Some(spans) = self.gathering.get(&trace) else {
            return (0, 0);
        };
        let by_id: HashMap<SpanId, usize> = spans
            .iter()
            .enumerate()
            .map(|(index, span)| (span.span_id, index))
            .collect();
        let mut model = 0;
        let mut tools = 0;
        for span in spans.iter().filter(|s| s.kind == SpanKind::Server) {
            let caller = span.parent.and_then(|p| by_id.get(&p)).map(|&i| &spans[i]);
            match span.server_type {
                Some(ServerType::Model) => model += 1,
                Some(ServerType::Resources) if is_tool_call(span, caller) => tools += 1,
                _ => {}
            }
        }
        (model, tools)
    }

    #[cfg(test)]
    pub fn gathered(&self) -> usize {
        self.gathered
    }
}

/// The rollout's subtree under `spans[root]` ([`critical_path::subtree`]).
fn subtree(spans: &[Gathered], root: usize) -> (Vec<PathSpan>, Vec<usize>) {
    critical_path::subtree(
        0..spans.len(),
        root,
        |i| spans[i].span_id,
        |i| spans[i].parent,
        |i| PathSpan {
            start_ns: spans[i].start_ns,
            end_ns: spans[i].end_ns,
            class: class_of(&spans[i]),
            children: Vec::new(),
        },
    )
}

fn class_of(span: &Gathered) -> SpanClass {
    SpanClass::of(
        span.kind,
        span.server_type,
        span.facts.verify,
        span.facts.peer_traced,
    )
}

/// A call from an agent server to a resources server, other than `/seed_session` and
/// `/verify`: `span` is the resources server's SERVER span, `caller` its parent.
fn is_tool_call(span: &Gathered, caller: Option<&Gathered>) -> bool {
    let route = span.facts.route.as_deref().unwrap_or_default();
    caller.is_some_and(|c| c.server_type == Some(ServerType::Agent))
        && route != "/seed_session"
        && route != "/verify"
}

struct Counts {
    model_calls: i64,
    tool_calls: i64,
    input_tokens: Option<i64>,
    output_tokens: Option<i64>,
    queue_delays: Vec<(Arc<ServiceIdentity>, Option<Text>, u64)>,
}

/// Calls to model servers (with the tokens their answers used) and tool calls, and how long
/// each call to a traced server waited for it, over the subtree's SERVER spans.
fn counts(spans: &[Gathered], members: &[usize], tree: &[PathSpan]) -> Counts {
    let mut counts = Counts {
        model_calls: 0,
        tool_calls: 0,
        input_tokens: None,
        output_tokens: None,
        queue_delays: Vec::new(),
    };
    for (position, &member) in members.iter().enumerate() {
        let caller = &spans[member];
        if caller.kind != SpanKind::Client {
            continue;
        }
        for &child in &tree[position].children {
            let server = &spans[members[child]];
            if server.kind != SpanKind::Server {
                continue;
            }
            counts.queue_delays.push((
                server.service.clone(),
                server.facts.route.clone().map(Text::Shared),
                server.start_ns.saturating_sub(caller.start_ns),
            ));
            match server.server_type {
                Some(ServerType::Model) => {
                    counts.model_calls += 1;
                    add(&mut counts.input_tokens, caller.facts.input_tokens);
                    add(&mut counts.output_tokens, caller.facts.output_tokens);
                }
                Some(ServerType::Resources) if is_tool_call(server, Some(caller)) => {
                    counts.tool_calls += 1;
                }
                _ => {}
            }
        }
    }
    counts
}

fn add(total: &mut Option<i64>, tokens: Option<i64>) {
    if let Some(tokens) = tokens {
        *total = Some(total.unwrap_or(0).saturating_add(tokens));
    }
}

/// An agent server by name (its worker processes share it), else by pid.
pub fn agent_key(service: &ServiceIdentity) -> String {
    service
        .server_name()
        .map_or_else(|| format!("pid {}", service.pid), str::to_owned)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::gym::ServerKind;
    use crate::gym::rollout_id::RolloutId;
    use crate::model::rollout::Phase;
    use crate::model::service::GymLabels;
    use crate::stitch::rollout_tops::GYM_ROLLOUT;

    const MS: u64 = 1_000_000;

    fn server(pid: u32, name: &str, kind: ServerType) -> Arc<ServiceIdentity> {
        let labels = GymLabels {
            server_name: Some(name.into()),
            server_kind: Some(ServerKind::Known(kind)),
            service_group: None,
        };
        Arc::new(ServiceIdentity::from_attributes(
            pid,
            labels,
            BTreeMap::new(),
        ))
    }

    fn span(
        service: &Arc<ServiceIdentity>,
        name: &str,
        kind: SpanKind,
        (id, parent): (u8, Option<u8>),
        (start_ms, end_ms): (u64, u64),
    ) -> SpanRecord {
        let mut span = SpanRecord::bare(service.clone(), name, kind, SpanId([id; 8]));
        let rollout = RolloutId::parse("r-1").unwrap();
        span.trace_id = rollout_trace_id(&rollout);
        span.parent_span_id = parent.map(|p| SpanId([p; 8]));
        span.start_unix_ns = start_ms * MS;
        span.end_unix_ns = end_ms * MS;
        span.attributes.push((
            attr::GYM_ROLLOUT_ID,
            AttributeValue::Str(rollout.as_str().to_owned().into()),
        ));
        span.facts.rollout_id = Some(rollout);
        span
    }

    fn int(span: &SpanRecord, key: &str) -> Option<i64> {
        span.attributes.iter().find_map(|(k, v)| match v {
            AttributeValue::Int(n) if *k == key => Some(*n),
            _ => None,
        })
    }

    /// The rollout's `/run` and `gym.rollout` go out before its model call's spans (their
    /// parent was decided by the call's answer); the stitcher lets its top go once its tree is
    /// whole, and the rollout is read whole then: its phases, counts and tokens.
    #[test]
    fn a_rollout_is_read_whole_when_its_top_arrives() {
        let agent = server(10, "simple_agent", ServerType::Agent);
        let model = server(20, "policy_model", ServerType::Model);
        let types = |service: &ServiceIdentity| service.labels.server_kind.as_ref()?.known();
        let mut rollouts = Rollouts::default();
        let mut done = Vec::new();

        let mut call = span(
            &agent,
            "HTTP POST",
            SpanKind::Client,
            (3, Some(2)),
            (100, 900),
        );
        call.attributes
            .push((attr::GEN_AI_USAGE_INPUT_TOKENS, AttributeValue::Int(42)));
        call.facts.input_tokens = Some(42);
        let mut batch = vec![
            call,
            span(
                &model,
                "POST /v1/responses",
                SpanKind::Server,
                (4, Some(3)),
                (150, 850),
            ),
        ];
        rollouts.observe(&mut batch, &types, &mut done);
        assert!(done.is_empty(), "{done:?}");
        let mut top = span(
            &agent,
            GYM_ROLLOUT,
            SpanKind::Internal,
            (2, Some(1)),
            (0, 1000),
        );
        top.facts.server_type = Some(ServerType::Agent);
        let mut batch = vec![
            top,
            span(&agent, "POST /run", SpanKind::Server, (1, None), (0, 1000)),
        ];
        rollouts.observe(&mut batch, &types, &mut done);
        let rollout = &batch[0];
        let phase = |phase: Phase| int(rollout, phase.attribute());
        assert_eq!(phase(Phase::Model), Some(700));
        assert_eq!(phase(Phase::Queue), Some(100));
        assert_eq!(phase(Phase::Agent), Some(200));
        assert_eq!(int(rollout, attr::GYM_ROLLOUT_MODEL_CALLS), Some(1));
        assert_eq!(int(rollout, attr::GYM_ROLLOUT_TOOL_CALLS), Some(0));
        assert_eq!(int(rollout, attr::GEN_AI_USAGE_INPUT_TOKENS), Some(42));
        assert_eq!(int(rollout, attr::GEN_AI_USAGE_OUTPUT_TOKENS), None);
        // The typed facts say the same as the attributes (the batch report reads them).
        assert_eq!(
            (rollout.facts.input_tokens, rollout.facts.output_tokens),
            (Some(42), None)
        );
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].queue_delays.len(), 1);
        assert_eq!(done[0].queue_delays[0].2, 50 * MS);

        // A span of it released after all that is counted, not gathered for good.
        let mut late = vec![span(
            &model,
            "HTTP POST",
            SpanKind::Client,
            (5, Some(4)),
            (200, 800),
        )];
        rollouts.observe(&mut late, &types, &mut done);
        let counters = rollouts.counters;
        assert_eq!(
            (
                counters.rollouts_completed,
                counters.rollout_spans_after_end,
                counters.rollout_spans_outside_tree
            ),
            (1, 1, 0)
        );
        assert_eq!(rollouts.gathered(), 0);
    }
}
