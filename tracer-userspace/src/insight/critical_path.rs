//! A rollout's wall time split along its critical path: the chain of spans that decided when
//! it ended. Walking back from the root's end, the time goes to the child that finished last
//! before the cursor (and, inside it, to its own children the same way), and what no child
//! covers goes to the span itself, as Jaeger's critical-path view attributes it. Where a
//! rollout's calls run one at a time this is, at each instant, the deepest span active; of
//! parallel calls, the one that finished later holds the path.
//!
//! Pure: spans in, nanoseconds per [`Phase`] out (or the path itself, for the batch report's
//! timelines); the sum is the root's duration exactly.

use foldhash::{HashMap, HashMapExt};
use std::hash::Hash;

use super::phases::Context;
use crate::gym::ServerType;
use crate::model::rollout::{Phase, PhaseNs};
use crate::model::span::SpanKind;

/// What the walk needs of one span of the rollout.
#[derive(Clone, Debug)]
pub struct PathSpan {
    pub start_ns: u64,
    pub end_ns: u64,
    pub class: SpanClass,
    /// Indices of its children in the walk's span list.
    pub children: Vec<usize>,
}

/// The subtree under span `root` as the walk takes it (index 0 the root), and the index of
/// each of its members: the one rollout-tree builder of the insight stage and the batch
/// report. `candidates` are the indices of the spans that may be in it (its trace's); `id`
/// and `parent` give a span's id and its parent's, `path_span` what the walk needs of it.
/// A cycle in bad input ends the walk once every candidate was taken.
pub fn subtree<K: Hash + Eq>(
    candidates: impl ExactSizeIterator<Item = usize>,
    root: usize,
    id: impl Fn(usize) -> K,
    parent: impl Fn(usize) -> Option<K>,
    path_span: impl Fn(usize) -> PathSpan,
) -> (Vec<PathSpan>, Vec<usize>) {
    let count = candidates.len();
    let mut children: HashMap<K, Vec<usize>> = HashMap::with_capacity(count);
    for index in candidates {
        if let Some(parent) = parent(index) {
            children.entry(parent).or_default().push(index);
        }
    }
    let mut members = vec![root];
    let mut tree = vec![path_span(root)];
    let mut next = 0;
    while next < members.len() && members.len() <= count {
        let below = children
            .get(&id(members[next]))
            .map_or(&[][..], Vec::as_slice);
        for &child in below {
            tree[next].children.push(members.len());
            members.push(child);
            tree.push(path_span(child));
        }
        next += 1;
    }
    (tree, members)
}

/// What decides the phase of a span's own time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanClass {
    /// A span of an agent server (or of a process that is not a Gym server).
    Agent,
    /// A span of a model server: its time and its subtree's are the model's.
    Model,
    /// A span of a resources server; `verify` when it is `/verify`'s SERVER or `gym.verify`.
    Resources { verify: bool },
    /// A call; `callee_traced` when its peer is a traced server (named by `peer.service`, or
    /// its SERVER span is a child).
    Call { callee_traced: bool },
}

impl SpanClass {
    /// The class of a span of `kind` exported for a server of `server_type`; `verify` when it
    /// is `/verify`'s SERVER span or `gym.verify`, `peer_traced` when a call's `peer.service`
    /// names a traced server. (A call whose SERVER span is below it is known traced by the
    /// walk itself.)
    pub fn of(
        kind: SpanKind,
        server_type: Option<ServerType>,
        verify: bool,
        peer_traced: bool,
    ) -> SpanClass {
        match (kind, server_type) {
            (_, Some(ServerType::Model)) => SpanClass::Model,
            (SpanKind::Client, _) => SpanClass::Call {
                callee_traced: peer_traced,
            },
            (_, Some(ServerType::Resources)) => SpanClass::Resources { verify },
            _ => SpanClass::Agent,
        }
    }
}

/// One stretch of the critical path: `spans[span]`'s own time from `start_ns` to `end_ns`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub span: usize,
    pub phase: Phase,
    pub start_ns: u64,
    pub end_ns: u64,
}

/// Deep enough for any rollout Gym makes (about eight levels); a deeper chain is a loop.
const MAX_DEPTH: usize = 64;

/// The phases of the subtree of `spans[root]`, along its critical path.
pub fn phases(spans: &[PathSpan], root: usize) -> PhaseNs {
    let mut phases = PhaseNs::default();
    path(spans, root, &mut |segment| {
        phases.add(segment.phase, segment.end_ns - segment.start_ns);
    });
    phases
}

/// The critical path of the subtree of `spans[root]`, in time order; the segments tile the
/// root's window.
pub fn segments(spans: &[PathSpan], root: usize) -> Vec<Segment> {
    let mut segments = Vec::new();
    path(spans, root, &mut |segment| segments.push(segment));
    segments.reverse(); // the walk goes back from the end
    segments
}

/// Hands each non-empty segment of the path to `segment`, latest first.
fn path(spans: &[PathSpan], root: usize, segment: &mut dyn FnMut(Segment)) {
    let Some(span) = spans.get(root) else {
        return;
    };
    let mut order = Vec::new();
    walk(
        spans,
        root,
        (span.start_ns, span.end_ns),
        Context::Agent,
        segment,
        &mut order,
        0,
    );
}

/// Attributes `window` (clipped to the span) of `spans[index]` to its phases.
fn walk(
    spans: &[PathSpan],
    index: usize,
    window: (u64, u64),
    inherited: Context,
    segment: &mut dyn FnMut(Segment),
    order: &mut Vec<usize>,
    depth: usize,
) {
    let own_time = |segment: &mut dyn FnMut(Segment), phase, start_ns, end_ns| {
        if end_ns > start_ns {
            segment(Segment {
                span: index,
                phase,
                start_ns,
                end_ns,
            });
        }
    };
    let span = &spans[index];
    let floor = span.start_ns.max(window.0);
    let mut cursor = span.end_ns.min(window.1);
    if cursor <= floor {
        return;
    }
    let context = inherited.within(span.class);
    let own = own_phase(span, spans, context);
    if depth < MAX_DEPTH {
        // The children by end, latest first: at each step the first one that overlaps what
        // is left of the window is the one that finished last before the cursor.
        let first = order.len();
        order.extend(&span.children);
        order[first..].sort_unstable_by_key(|&child| std::cmp::Reverse(spans[child].end_ns));
        for position in first..order.len() {
            let child = &spans[order[position]];
            if child.start_ns >= cursor || child.end_ns <= floor {
                continue; // starts after the path left it, or ends before the window
            }
            let child_end = child.end_ns.min(cursor);
            own_time(segment, own, child_end, cursor);
            let next = order[position];
            walk(
                spans,
                next,
                (floor, child_end),
                context,
                segment,
                order,
                depth + 1,
            );
            cursor = child.start_ns.max(floor);
            if cursor <= floor {
                break;
            }
        }
        order.truncate(first);
    }
    own_time(segment, own, floor, cursor);
}

/// The phase of the time a span spends on the path with none of its children.
fn own_phase(span: &PathSpan, spans: &[PathSpan], context: Context) -> Phase {
    // Before the callee read the request, and after it answered until the caller read the
    // answer: a call whose callee's SERVER span is below it waits on a traced server.
    let answered_below = matches!(span.class, SpanClass::Call { .. })
        && span
            .children
            .iter()
            .any(|&child| !matches!(spans[child].class, SpanClass::Call { .. }));
    context.own_phase(span.class, answered_below)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::rollout::PerPhase;

    const MS: u64 = 1_000_000;

    /// A tree from `(parent, start_ms, end_ms, class)` rows; row 0 is the root.
    fn tree(rows: &[(Option<usize>, u64, u64, SpanClass)]) -> Vec<PathSpan> {
        let mut spans: Vec<PathSpan> = rows
            .iter()
            .map(|&(_, start, end, class)| PathSpan {
                start_ns: start * MS,
                end_ns: end * MS,
                class,
                children: Vec::new(),
            })
            .collect();
        for (index, &(parent, ..)) in rows.iter().enumerate() {
            if let Some(parent) = parent {
                spans[parent].children.push(index);
            }
        }
        spans
    }

    fn ms(phases: &PhaseNs) -> PerPhase<(Phase, u64)> {
        Phase::ALL.map(|phase| (phase, phases.get(phase) / MS))
    }

    const AGENT: SpanClass = SpanClass::Agent;
    const MODEL: SpanClass = SpanClass::Model;
    const TOOL: SpanClass = SpanClass::Resources { verify: false };
    const VERIFY: SpanClass = SpanClass::Resources { verify: true };
    const TRACED_CALL: SpanClass = SpanClass::Call {
        callee_traced: true,
    };
    const UNTRACED_CALL: SpanClass = SpanClass::Call {
        callee_traced: false,
    };

    fn expect(
        model: u64,
        tool: u64,
        verify: u64,
        queue: u64,
        external: u64,
        agent: u64,
    ) -> PerPhase<(Phase, u64)> {
        [
            (Phase::Model, model),
            (Phase::Tool, tool),
            (Phase::Verify, verify),
            (Phase::Queue, queue),
            (Phase::External, external),
            (Phase::Agent, agent),
        ]
    }

    /// A model call, a tool call and /verify one after another: each call's time before its
    /// server read it and after it answered is queueing, the model server's upstream call is
    /// the model's, the rest is the agent's.
    #[test]
    fn sequential_calls_split_into_their_phases() {
        let spans = tree(&[
            (None, 0, 1000, AGENT),             // 0 gym.rollout
            (Some(0), 10, 510, TRACED_CALL),    // 1 call to the model server
            (Some(1), 30, 500, MODEL),          // 2 its SERVER span
            (Some(2), 40, 490, UNTRACED_CALL),  // 3 the model server's upstream call
            (Some(0), 520, 620, TRACED_CALL),   // 4 a tool call
            (Some(4), 525, 615, TOOL),          // 5
            (Some(0), 700, 990, TRACED_CALL),   // 6 /verify
            (Some(6), 700, 980, VERIFY),        // 7
            (Some(7), 710, 720, UNTRACED_CALL), // 8 an external call from /verify
        ]);
        let phases = phases(&spans, 0);
        assert_eq!(phases.total(), 1000 * MS);
        assert_eq!(ms(&phases), expect(470, 90, 270, 30 + 10 + 10, 10, 110));
    }

    /// The path itself: in time order, tiling the root's window, each stretch on the span
    /// that held it.
    #[test]
    fn the_path_tiles_the_rollout_in_time_order() {
        let spans = tree(&[
            (None, 0, 100, AGENT),          // 0
            (Some(0), 10, 60, TRACED_CALL), // 1
            (Some(1), 20, 50, MODEL),       // 2
            (Some(0), 5, 30, TRACED_CALL),  // 3 overlaps 1, ends first
            (Some(3), 5, 30, TOOL),         // 4
        ]);
        let path: Vec<(usize, Phase, u64, u64)> = segments(&spans, 0)
            .iter()
            .map(|s| (s.span, s.phase, s.start_ns / MS, s.end_ns / MS))
            .collect();
        assert_eq!(
            path,
            [
                (0, Phase::Agent, 0, 5),
                (4, Phase::Tool, 5, 10),
                (1, Phase::Queue, 10, 20),
                (2, Phase::Model, 20, 50),
                (1, Phase::Queue, 50, 60),
                (0, Phase::Agent, 60, 100),
            ]
        );
    }

    /// Of two calls in flight at once, the one that finished later holds the path; the other
    /// counts only where it alone was running.
    #[test]
    fn of_parallel_calls_the_later_finishing_is_critical() {
        let spans = tree(&[
            (None, 0, 1000, AGENT),           // 0
            (Some(0), 100, 900, TRACED_CALL), // 1 the slow one
            (Some(1), 100, 900, MODEL),       // 2
            (Some(0), 50, 600, TRACED_CALL),  // 3 started first, finished first
            (Some(3), 50, 600, TOOL),         // 4
            (Some(0), 150, 200, TRACED_CALL), // 5 inside the slow one's window: off the path
            (Some(5), 150, 200, VERIFY),      // 6
        ]);
        let phases = phases(&spans, 0);
        assert_eq!(phases.total(), 1000 * MS);
        // 0-50 agent, 50-100 the first call (tool), 100-900 the slow one (model), 900-1000 agent.
        assert_eq!(ms(&phases), expect(800, 50, 0, 0, 0, 150));
    }

    /// A call to a server nobody traces is external time; one whose callee is traced but
    /// whose SERVER span is not in the rollout is queueing as a whole (nothing says when the
    /// server read it).
    #[test]
    fn a_call_whose_server_is_untraced_is_external() {
        let spans = tree(&[
            (None, 0, 100, AGENT),
            (Some(0), 10, 40, UNTRACED_CALL),
            (Some(0), 50, 90, TRACED_CALL),
        ]);
        let phases = phases(&spans, 0);
        assert_eq!(ms(&phases), expect(0, 0, 0, 40, 30, 30));
    }

    /// A failed call ends early, and its server's span (which ran on after the client gave
    /// up) is clipped to the call's window: the sum is still the rollout's duration.
    #[test]
    fn a_failed_call_is_clipped_to_its_window() {
        let spans = tree(&[
            (None, 0, 300, AGENT),
            (Some(0), 100, 200, TRACED_CALL), // the client gave up at 200
            (Some(1), 110, 400, TOOL),        // the server answered at 400, past the rollout
        ]);
        let phases = phases(&spans, 0);
        assert_eq!(phases.total(), 300 * MS);
        assert_eq!(ms(&phases), expect(0, 90, 0, 10, 0, 200));
    }

    /// A judge call from /verify: the model server's time is the model's, the wait before
    /// it read the call is queueing, /verify's own time is verify.
    #[test]
    fn a_judge_call_inside_verify_is_model_time() {
        let spans = tree(&[
            (None, 0, 100, AGENT),
            (Some(0), 0, 100, TRACED_CALL),
            (Some(1), 0, 100, VERIFY),
            (Some(2), 20, 80, TRACED_CALL),
            (Some(3), 30, 70, MODEL),
        ]);
        let phases = phases(&spans, 0);
        assert_eq!(ms(&phases), expect(40, 0, 40, 20, 0, 0));
    }
}
