//! Which inbound request made an outbound call, from evidence, never a guess.
//!
//! A uvicorn server runs every request on one thread, interleaved, and Gym's middleware runs
//! each handler in child tasks, so neither timing nor nesting says which request a call
//! belongs to. Evidence does, where there is any:
//! - the call's own: the rollout id it names (its `/ng-rollout/<id>` prefix, the `_ng_*`
//!   fields its body ends with) against the in-flight requests of that rollout; a session
//!   cookie it carries against the in-flight requests that carried the same cookie;
//! - its handler task's ([`context_keys`]): calls with the same task context were made by the
//!   same handler, so a call placed by evidence places the others ("group");
//! - the callee's answer: the id an upstream's response starts with, echoed at the start of
//!   the inbound request's own response; and, where no middleware splits tasks, the task
//!   context the inbound request's response is written under.
//!
//! Each item narrows the set of in-flight inbound requests; items that name none are no
//! information, a single survivor decides, an empty intersection is a contradiction, several
//! survivors wait for more evidence. A request that is itself a result of the group's calls
//! (an agent's call to its own `/v1/responses`) is never a candidate. A task context is
//! valid only while its owner is in flight: a group whose owner finished before a call
//! started is a new handler at a reused address.

use super::context_keys::TaskKey;
use super::{Evidence, Node, Parent, Stitcher, Undecided};
use crate::model::context::{ContextChain, Lineage, WriterTask};
use crate::model::evidence::Token;
use crate::model::exchange::Role;
use crate::model::ids::SpanId;

/// What groups a process's calls: the handler task's context (the root of its chain), or,
/// with `--task-lineage`, the request root all the calls' tasks descend from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GroupKey {
    /// A context's address: the calls of one handler task, valid while the request it
    /// serves is in flight (a freed context's address is reused by a later request).
    Context(u64),
    /// A request root's serial: every call of one inbound request, whatever task made it,
    /// even after its response (a background task's); never reused.
    Origin(u64),
}

/// The calls one handler task (or request root) made, and the request it serves once
/// evidence said so.
#[derive(Debug, Default)]
pub(super) struct Group {
    members: Vec<SpanId>,
    owner: Option<SpanId>,
}

impl Group {
    /// The request the group's handler serves, once evidence said so.
    pub(super) fn owner(&self) -> Option<SpanId> {
        self.owner
    }

    /// A group whose request is known before any of its calls is seen.
    pub(super) fn owned_by(owner: SpanId) -> Self {
        Self {
            members: Vec::new(),
            owner: Some(owner),
        }
    }
}

/// What the call's own evidence says.
enum Verdict {
    One(SpanId, Evidence),
    Undecided(Undecided),
}

impl Stitcher {
    /// The group key of a call: its process and request root, else its handler task
    /// context.
    pub(super) fn group_key(&self, node: &Node) -> Option<(u32, GroupKey)> {
        if let Some(origin) = node.origin {
            return Some((node.pid, GroupKey::Origin(origin.0)));
        }
        match self.tails.key(node.pid, node.context.as_ref()?) {
            TaskKey::Root(root) => Some((node.pid, GroupKey::Context(root))),
            TaskKey::TailUnknown | TaskKey::LoopLevel => None,
        }
    }

    /// Whether `request` was in flight when the graph's clock read `at`.
    pub(super) fn in_flight_at(&self, request: SpanId, at: u64) -> bool {
        self.nodes
            .get(&request)
            .is_some_and(|n| n.started < at && n.ended.is_none_or(|ended| ended > at))
    }

    /// Adds a call to its handler's group (a new group where the old owner finished before
    /// the call started: the context's address was reused).
    pub(super) fn join_group(&mut self, call: SpanId) {
        let Some(node) = self.nodes.get(&call) else {
            return;
        };
        let Some(key) = self.group_key(node) else {
            return;
        };
        let started = node.started;
        let stale = matches!(key.1, GroupKey::Context(_))
            && self
                .groups
                .get(&key)
                .and_then(|g| g.owner)
                .is_some_and(|owner| !self.in_flight_at(owner, started));
        let nodes = &self.nodes;
        let group = self.groups.entry(key).or_default();
        if stale {
            *group = Group::default();
        }
        group.members.retain(|m| nodes.contains_key(m));
        group.members.push(call);
    }

    /// A placed call's body named a rollout its parent does not belong to: the evidence
    /// contradicts itself, so the edge is taken back.
    pub(super) fn recheck_rollout(&mut self, call: SpanId) {
        let Some(node) = self.nodes.get(&call) else {
            return;
        };
        let (Parent::Local(parent), Some(rollout)) = (node.parent, node.rollout.as_ref()) else {
            return;
        };
        // An edge below which a span went out stays: taking it back would leave that span
        // in another trace than the call's.
        if node.trace.is_none()
            && self
                .effective_rollout(parent)
                .is_some_and(|theirs| theirs != rollout)
            && let Some(node) = self.nodes.get_mut(&call)
        {
            node.undecided = Some(Undecided::Contradicted);
            self.draw_edge(call, Parent::None);
            self.await_evidence(call);
        }
    }

    /// Gives an unplaced call its parent if the evidence decides it; otherwise records why not.
    pub(super) fn place_call(&mut self, call: SpanId) {
        let Some(node) = self.nodes.get(&call) else {
            return;
        };
        if node.role != Role::Client || node.parent != Parent::None {
            return;
        }
        // A process with no request of its own in flight that a server spawned for one (a CLI
        // agent's model calls) works for that request.
        if !self.inbound.contains_key(&node.pid) {
            if let Some(spawner) = self.spawner_of(node.pid, node.started) {
                self.set_parent(call, spawner, Evidence::Spawn);
                return;
            }
            if self.await_spawner(call) {
                return;
            }
        }
        self.place_by_evidence(call);
    }

    /// [`Stitcher::place_call`] for a call of a process that serves requests, or that no
    /// request spawned.
    fn place_by_evidence(&mut self, call: SpanId) {
        let Some(node) = self.nodes.get(&call) else {
            return;
        };
        let started = node.started;
        let key = self.group_key(node);
        if let Some(key) = key
            && let Some(owner) = self.groups.get(&key).and_then(|g| g.owner)
        {
            let how = match key.1 {
                GroupKey::Origin(_) => Some(Evidence::Lineage),
                GroupKey::Context(_) => self
                    .in_flight_at(owner, started)
                    .then_some(Evidence::TaskContext),
            };
            if let Some(how) = how {
                self.set_parent(call, owner, how);
                // Its trace may have settled since the group was bound.
                self.publish_trace(key, owner);
                return;
            }
        }
        let verdict = if node.context.is_some() || node.origin.is_some() {
            self.own_evidence(call, key)
        } else if let Some(by_session) = self.session_holder(call) {
            // A thread whose contexts are not read (an MCP client's event loop in a thread of
            // its own) still names its request by the sessions it carries.
            match by_session {
                Ok(parent) => Verdict::One(parent, Evidence::Session),
                Err(why) => Verdict::Undecided(why),
            }
        } else {
            let (pid, rollout, hidden) = (node.pid, node.rollout.clone(), node.inbound_hidden);
            match self.choose_caller_without_context(pid, rollout.as_ref(), hidden) {
                Ok((parent, how)) => Verdict::One(parent, how),
                Err(why) => Verdict::Undecided(why),
            }
        };
        match verdict {
            Verdict::One(parent, how) => {
                self.set_parent(call, parent, how);
                self.bind_group(key, parent, Evidence::TaskContext);
            }
            Verdict::Undecided(why) => {
                if let Some(node) = self.nodes.get_mut(&call) {
                    node.undecided = Some(why);
                }
            }
        }
    }

    pub(super) fn set_parent(&mut self, call: SpanId, parent: SpanId, how: Evidence) {
        // A span of the call's (or below it) already went out in a trace of its own: the
        // edge came too late, and drawing it would name a parent in another trace.
        let fixed = self.nodes.get(&call).and_then(|node| node.trace);
        if fixed.is_some_and(|trace| trace != self.trace_of(parent)) {
            self.counters.parents_decided_late += 1;
            return;
        }
        if let Some(node) = self.nodes.get_mut(&call) {
            node.undecided = None;
        }
        self.draw_edge(call, Parent::Local(parent));
        let counter = match how {
            Evidence::Lineage => &mut self.counters.parents_by_lineage,
            Evidence::RolloutId => &mut self.counters.parents_by_rollout_id,
            Evidence::Session => &mut self.counters.parents_by_session,
            Evidence::TaskContext => &mut self.counters.parents_by_task_context,
            Evidence::ResponseContext => &mut self.counters.parents_by_response_context,
            Evidence::EchoedId => &mut self.counters.parents_by_echoed_id,
            Evidence::OnlyInbound => &mut self.counters.parents_by_only_inbound,
            Evidence::Nesting => &mut self.counters.parents_by_nesting,
            Evidence::Spawn => &mut self.counters.parents_by_spawn,
        };
        *counter += 1;
    }

    /// The group now serves `owner`: its unplaced calls that started while `owner` was in
    /// flight get it too, as decided by `how`. A group that already serves another request
    /// keeps it (counted).
    pub(super) fn bind_group(
        &mut self,
        key: Option<(u32, GroupKey)>,
        owner: SpanId,
        how: Evidence,
    ) {
        let Some(group) = key.and_then(|k| self.groups.get_mut(&k)) else {
            return;
        };
        match group.owner {
            Some(existing) if existing != owner => {
                match key.map(|(_, key)| key) {
                    Some(GroupKey::Origin(_)) => self.counters.lineage_conflicts += 1,
                    _ => self.counters.task_context_conflicts += 1,
                }
                return;
            }
            Some(_) => {}
            None => group.owner = Some(owner),
        }
        let members = group.members.clone();
        if let Some(key) = key {
            self.index_owner(key, owner);
        }
        for member in members {
            if self.placeable_under(owner, member, key) {
                self.set_parent(member, owner, how);
            }
        }
        if let Some(key) = key {
            self.spawner_bound(key.0, key.1);
            self.publish_trace(key, owner);
        }
    }

    /// Whether `member`, a call of the group `key`, has no parent yet and may have `owner`.
    /// A request root's calls are its request's whenever they started.
    fn placeable_under(&self, owner: SpanId, member: SpanId, key: Option<(u32, GroupKey)>) -> bool {
        let lineage = matches!(key, Some((_, GroupKey::Origin(_))));
        self.nodes.get(&member).is_some_and(|node| {
            node.parent == Parent::None
                && (lineage
                    || (self.in_flight_at(owner, node.started)
                        && !self.excluded(owner, member, key)))
        })
    }

    /// Intersects what each item of the call's own evidence allows. Each item is looked up
    /// by what it names (the rollout's requests, the cookie's holders) and only those are
    /// checked as candidates; without evidence, the scan of the requests in flight stops at
    /// the second candidate.
    fn own_evidence(&self, call: SpanId, key: Option<(u32, GroupKey)>) -> Verdict {
        let Some(node) = self.nodes.get(&call) else {
            return Verdict::Undecided(Undecided::NoEvidence);
        };
        let candidate =
            |x: &SpanId| self.in_flight_at(*x, node.started) && !self.excluded(*x, call, key);
        let in_flight = || {
            self.inbound
                .get(&node.pid)
                .into_iter()
                .flat_map(|l| l.values())
        };
        let mut survivors: Option<Vec<SpanId>> = None;
        let mut decided_by = Evidence::OnlyInbound;
        let mut narrow = |named: Vec<SpanId>, how: Evidence| {
            if named.is_empty() {
                return; // names no request in flight: no information
            }
            decided_by = how;
            survivors = Some(match survivors.take() {
                None => named,
                Some(before) => before.into_iter().filter(|x| named.contains(x)).collect(),
            });
        };
        if let Some(rollout) = &node.rollout {
            let same = self
                .in_flight_of_rollout(node.pid, rollout)
                .filter(|x| candidate(x))
                .collect();
            narrow(same, Evidence::RolloutId);
        }
        if let Some(holders) = self.session_holders_of(call, key) {
            narrow(holders, Evidence::Session);
        }
        match survivors.as_deref() {
            Some([one]) => Verdict::One(*one, decided_by),
            Some([]) => Verdict::Undecided(Undecided::Contradicted),
            Some(_) => Verdict::Undecided(Undecided::Ambiguous),
            None => {
                let mut candidates = in_flight().filter(|x| candidate(x));
                match (candidates.next(), candidates.next()) {
                    (None, _) => Verdict::Undecided(Undecided::NoInbound),
                    (Some(_), None) if node.inbound_hidden => {
                        Verdict::Undecided(Undecided::NoEvidence)
                    }
                    // Its request root names its request, and it is not this one (not in the
                    // graph, or not said yet): the root's response will tell.
                    (Some(_), None) if node.origin.is_some() => {
                        Verdict::Undecided(Undecided::NoEvidence)
                    }
                    (Some(only), None) => Verdict::One(*only, Evidence::OnlyInbound),
                    _ => Verdict::Undecided(Undecided::NoEvidence),
                }
            }
        }
    }

    /// The candidate requests (in flight at the call's start, not caused by its handler) that
    /// carried every session the call carries that any of them carried; `None` where its
    /// sessions name no candidate.
    fn session_holders_of(
        &self,
        call: SpanId,
        key: Option<(u32, GroupKey)>,
    ) -> Option<Vec<SpanId>> {
        let node = self.nodes.get(&call)?;
        let mut survivors: Option<Vec<SpanId>> = None;
        for token in &node.session_tokens {
            let holders: Vec<SpanId> = self
                .session_holders
                .get(&(node.pid, *token))
                .into_iter()
                .flatten()
                .filter(|x| self.in_flight_at(**x, node.started) && !self.excluded(**x, call, key))
                .copied()
                .collect();
            if holders.is_empty() {
                continue; // names no request in flight: no information
            }
            survivors = Some(match survivors.take() {
                None => holders,
                Some(before) => before.into_iter().filter(|x| holders.contains(x)).collect(),
            });
        }
        survivors
    }

    /// For a call without a task context: the one in-flight request that carried every
    /// session the call carries (`Err` where they name several, or one of another rollout
    /// than the call names), `None` where they name no request in flight.
    fn session_holder(&self, call: SpanId) -> Option<Result<SpanId, Undecided>> {
        let node = self.nodes.get(&call)?;
        Some(match self.session_holders_of(call, None)?.as_slice() {
            [one] => match (&node.rollout, self.effective_rollout(*one)) {
                (Some(named), Some(theirs)) if named != theirs => Err(Undecided::Contradicted),
                _ => Ok(*one),
            },
            [] => Err(Undecided::Contradicted),
            _ => Err(Undecided::Ambiguous),
        })
    }

    /// Whether `candidate` descends from `call` or from a call of the same handler: a request
    /// the handler caused cannot be the one it serves.
    fn excluded(&self, candidate: SpanId, call: SpanId, key: Option<(u32, GroupKey)>) -> bool {
        let mut id = candidate;
        for _ in 0..super::MAX_DEPTH {
            if id == call {
                return true;
            }
            let Some(node) = self.nodes.get(&id) else {
                return false;
            };
            if node.role == Role::Client && key.is_some() && self.group_key(node) == key {
                return true;
            }
            match node.parent {
                Parent::Local(parent) => id = parent,
                _ => return false,
            }
        }
        false
    }

    /// The response to inbound `request` is being written by `writer`: a task of a request
    /// root binds the root's calls to the request; the chain teaches the loop's tail and,
    /// where the handler itself writes (no middleware task between), its calls are the
    /// request's.
    pub fn response_writer(&mut self, request: SpanId, writer: WriterTask) {
        if let Some(Lineage::Request { origin, .. }) = writer.lineage {
            self.origin_answers(request, origin);
        }
        if let Some(context) = writer.chain {
            self.response_context(request, context);
        }
    }

    fn response_context(&mut self, request: SpanId, context: ContextChain) {
        let Some(node) = self.nodes.get(&request) else {
            return;
        };
        let pid = node.pid;
        if self.tails.learn_response(pid, &context) {
            self.regroup(pid);
        }
        let TaskKey::Root(root) = self.tails.key(pid, &context) else {
            return;
        };
        let key = Some((pid, GroupKey::Context(root)));
        let Some(group) = self.groups.get(&(pid, GroupKey::Context(root))) else {
            return;
        };
        // A group already serving a request is another handler's: the response is written by
        // a middleware task at a reused address, or by a handler whose calls were placed.
        if group.owner.is_none()
            && group
                .members
                .iter()
                .any(|m| self.placeable_under(request, *m, key))
        {
            self.bind_group(key, request, Evidence::ResponseContext);
        }
    }

    /// A response started with an id: a call's is remembered; an inbound request's places
    /// the call whose response carried the same id (the server echoes its upstream's).
    pub fn response_id(&mut self, request: SpanId, token: Token) {
        let Some(node) = self.nodes.get(&request) else {
            return;
        };
        let pid = node.pid;
        match node.role {
            Role::Client => {
                self.echoed.insert((pid, token), request);
            }
            Role::Server => {
                let Some(&call) = self.echoed.get(&(pid, token)) else {
                    return;
                };
                let Some(call_node) = self.nodes.get(&call) else {
                    return;
                };
                let key = self.group_key(call_node);
                if self.placeable_under(request, call, key) {
                    self.set_parent(call, request, Evidence::EchoedId);
                    self.bind_group(key, request, Evidence::TaskContext);
                }
            }
        }
    }

    /// The loop's tail changed: every call of the process is regrouped by its new key, each
    /// group served by the request its placed calls have, and unplaced calls placed again.
    fn regroup(&mut self, pid: u32) {
        self.counters.task_context_regroups += 1;
        // Request roots' groups do not depend on the loop's tail.
        self.groups
            .retain(|(p, key), _| *p != pid || matches!(key, GroupKey::Origin(_)));
        let mut calls: Vec<(u64, SpanId)> = self
            .nodes
            .iter()
            .filter(|(_, n)| {
                n.pid == pid && n.role == Role::Client && n.context.is_some() && n.origin.is_none()
            })
            .map(|(id, n)| (n.started, *id))
            .collect();
        calls.sort_unstable_by_key(|(started, _)| *started);
        for (_, call) in &calls {
            self.join_group(*call);
            let node = &self.nodes[call];
            if let (Some(key), Parent::Local(parent)) = (self.group_key(node), node.parent)
                && let Some(group) = self.groups.get_mut(&key)
                && group.owner.is_none()
            {
                group.owner = Some(parent);
                self.index_owner(key, parent);
            }
        }
        for (_, call) in calls {
            self.place_call(call);
        }
    }

    pub(super) fn count_undecided(&mut self, why: Option<Undecided>) {
        let counter = match why {
            Some(Undecided::NoInbound) => &mut self.counters.parents_no_request_in_flight,
            Some(Undecided::Ambiguous) => &mut self.counters.parents_ambiguous,
            Some(Undecided::Contradicted) => &mut self.counters.parents_contradicted,
            Some(Undecided::NoEvidence) | None => &mut self.counters.parents_no_evidence,
        };
        *counter += 1;
    }

    /// A traced process is gone: its event loops' tails and its sessions go with it (a new
    /// process may reuse its pid and addresses). Its calls' groups go as the calls leave the graph.
    pub fn forget_process(&mut self, pid: u32) {
        self.process_gone(pid);
        self.forget_spawn(pid);
        self.tails.forget(pid);
        self.withdraw_process(pid);
        self.sessions.retain(|(owner, _), _| *owner != pid);
    }

    /// Forgets the groups and echoed ids of calls that left the graph (a request root's
    /// group lasts while its request is in the graph: a call may still come).
    pub(super) fn forget_gone_calls(&mut self) {
        let nodes = &self.nodes;
        self.groups.retain(|(_, key), group| {
            group.members.retain(|m| nodes.contains_key(m));
            !group.members.is_empty()
                || matches!(key, GroupKey::Origin(_))
                    && group.owner.is_some_and(|owner| nodes.contains_key(&owner))
        });
        self.inbound_sockets.retain(|_, id| nodes.contains_key(id));
        self.groups_by_owner
            .retain(|owner, _| nodes.contains_key(owner));
        self.echoed.retain(|_, call| nodes.contains_key(call));
        let gone: Vec<SpanId> = self
            .published_by_owner
            .keys()
            .filter(|owner| !self.nodes.contains_key(owner))
            .copied()
            .collect();
        for owner in gone {
            self.withdraw_traces(owner);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::super::{StartFacts, StitchConfig, Stitcher};
    use super::{Evidence, Undecided};
    use crate::gym::rollout_id::RolloutId;
    use crate::model::context::{ContextChain, WriterTask};
    use crate::model::evidence::{Token, TokenKind};
    use crate::model::exchange::{RequestStart, Role};
    use crate::model::ids::SpanId;
    use crate::model::span::{SpanKind, SpanRecord};
    use crate::pipeline::testing;

    const AGENT: u32 = 1;
    const MODEL: u32 = 2;
    /// The event loop's own contexts, bottom last, as every chain of these processes ends.
    const LOOP: [u64; 2] = [0xb0, 0xa0];

    fn chain(task: &[u64]) -> ContextChain {
        let links: Vec<u64> = task.iter().chain(LOOP.iter()).copied().collect();
        ContextChain::new(&links).unwrap()
    }

    fn writer(chain: ContextChain) -> WriterTask {
        WriterTask {
            chain: Some(chain),
            lineage: None,
        }
    }

    fn cookie(session: &str) -> Token {
        Token::of(TokenKind::Cookie, session.as_bytes())
    }

    struct Scene {
        stitcher: Stitcher,
        now: Instant,
        next_port: u16,
    }

    impl Scene {
        fn new() -> Self {
            Self {
                stitcher: Stitcher::new(StitchConfig {
                    max_pending: 1000,
                    max_nodes: 1000,
                    injection: None,
                }),
                now: Instant::now(),
                next_port: 40000,
            }
        }

        fn port(&mut self) -> u16 {
            self.next_port += 1;
            self.next_port
        }

        /// An inbound request to `pid`, carrying `sessions`.
        fn inbound(&mut self, pid: u32, path: &str, sessions: &[Token]) -> RequestStart {
            let port = self.port();
            let mut start = testing::start(pid, Role::Server, (8000, port), 0, "POST", path);
            start.session_tokens = sessions.to_vec();
            self.register(start)
        }

        /// A call from `pid` made under the task contexts `task` (innermost first).
        fn call(&mut self, pid: u32, task: &[u64], sessions: &[Token]) -> RequestStart {
            let port = self.port();
            let mut start = testing::start(pid, Role::Client, (port, 9000), 0, "POST", "/x");
            start.session_tokens = sessions.to_vec();
            start.context = Some(chain(task));
            self.register(start)
        }

        /// Starts `start` in the stitcher, without a rollout id from its path.
        fn register(&mut self, start: RequestStart) -> RequestStart {
            let facts = StartFacts {
                rollout_id: None,
                emits_own: true,
                emits_semantic: false,
                inbound_hidden: false,
                caller_traced: false,
                caller_seen_here: false,
            };
            self.stitcher.start(&start, facts, self.now);
            start
        }

        fn rollout(&mut self, request: &RequestStart, id: &str) {
            let id = RolloutId::parse(id).unwrap();
            self.stitcher.set_rollout(request.span_id, id);
        }

        fn parent(&self, request: &RequestStart) -> Option<SpanId> {
            match self.stitcher.nodes[&request.span_id].parent {
                super::Parent::Local(parent) => Some(parent),
                _ => None,
            }
        }

        fn undecided(&self, request: &RequestStart) -> Option<Undecided> {
            self.stitcher.nodes[&request.span_id].undecided
        }

        fn finish(&mut self, request: &RequestStart) {
            self.stitcher.finish(request.span_id);
        }

        /// `call`'s callee, another traced process over the same connection, answers and
        /// the call ends: both spans held (or released into `out`).
        fn answered_by_a_traced_callee(&mut self, call: &RequestStart, out: &mut Vec<SpanRecord>) {
            let callee = super::super::testing_server_of(call);
            self.stitcher
                .start(&callee, super::super::testing_facts(), self.now);
            for (request, kind) in [(&callee, SpanKind::Server), (call, SpanKind::Client)] {
                let span = testing::span("own", kind, request.span_id);
                let role = super::super::SpanRole::Own;
                self.stitcher.hold(request.span_id, role, span, out);
                self.finish(request);
            }
        }
    }

    /// The only inbound request the tracer sees decides a call, unless its process may have
    /// one it cannot see yet (an HTTPS request held until its TLS session is tied).
    #[test]
    fn the_only_request_in_flight_is_no_evidence_while_one_may_be_hidden() {
        let mut s = Scene::new();
        let visible = s.inbound(AGENT, "/run", &[]);
        let port = s.port();
        let mut start = testing::start(AGENT, Role::Client, (port, 9000), 0, "POST", "/x");
        start.context = Some(chain(&[0x1, 0x10]));
        let facts = StartFacts {
            rollout_id: None,
            emits_own: true,
            emits_semantic: false,
            inbound_hidden: true,
            caller_traced: false,
            caller_seen_here: false,
        };
        s.stitcher.start(&start, facts, s.now);
        assert_eq!(s.parent(&start), None);
        assert_eq!(s.undecided(&start), Some(Undecided::NoEvidence));
        let seen = s.call(AGENT, &[0x2, 0x20], &[]);
        assert_eq!(s.parent(&seen), Some(visible.span_id));
    }

    /// Gym's MCP shape: two handlers serve one rollout each, and their MCP calls are written
    /// from another thread whose task contexts are not read. The session token each carries
    /// names its handler's request; a call whose token names no request in flight, or
    /// names two, is left without a parent.
    #[test]
    fn a_call_without_a_task_context_is_placed_by_its_session() {
        let mut s = Scene::new();
        let (token_a, token_b) = (
            Token::of(TokenKind::SessionHeader, b"token-of-rollout-a"),
            Token::of(TokenKind::SessionHeader, b"token-of-rollout-b"),
        );
        let handler_a = s.inbound(AGENT, "/v1/responses", &[token_a]);
        let handler_b = s.inbound(AGENT, "/v1/responses", &[token_b]);
        let from_thread = |s: &mut Scene, sessions: &[Token]| {
            let port = s.port();
            let mut start = testing::start(AGENT, Role::Client, (port, 9000), 0, "POST", "/mcp");
            start.session_tokens = sessions.to_vec();
            s.register(start)
        };
        let mcp_b = from_thread(&mut s, &[token_b]);
        let mcp_a = from_thread(&mut s, &[token_a]);
        assert_eq!(s.parent(&mcp_a), Some(handler_a.span_id));
        assert_eq!(s.parent(&mcp_b), Some(handler_b.span_id));
        let both = from_thread(&mut s, &[token_a, token_b]);
        assert_eq!(s.undecided(&both), Some(Undecided::Contradicted));
        let unknown = from_thread(&mut s, &[Token::of(TokenKind::SessionHeader, b"another")]);
        assert_eq!(
            s.parent(&unknown),
            None,
            "two requests in flight, nothing names one"
        );
        assert_eq!(s.stitcher.counters.parents_by_session, 2);
    }

    /// A handler that placed a call spawns a CLI (pid 50), which spawns a helper (pid 51):
    /// their calls hang under the handler's request, whatever else is in flight. A process
    /// spawned outside any request places its calls as any other process.
    #[test]
    fn a_spawned_process_works_for_the_request_that_spawned_it() {
        let mut s = Scene::new();
        let run_a = s.inbound(AGENT, "/run", &[]);
        let run_b = s.inbound(AGENT, "/run", &[]);
        s.rollout(&run_a, "1-0");
        s.rollout(&run_b, "2-0");
        let seed_a = s.call(AGENT, &[0x1, 0x10], &[]);
        s.rollout(&seed_a, "1-0");
        assert_eq!(s.parent(&seed_a), Some(run_a.span_id));
        s.stitcher
            .response_writer(run_b.span_id, writer(chain(&[0x50])));
        s.stitcher.spawned(AGENT, 50, &writer(chain(&[0x10])));
        s.stitcher.forked(50, 51);
        s.stitcher.forked(AGENT, 60); // a worker started by a plain fork
        let from = |s: &mut Scene, pid: u32| {
            let port = s.port();
            let start = testing::start(pid, Role::Client, (port, 9000), 0, "POST", "/v1/responses");
            s.register(start)
        };
        let (cli, helper, worker) = (from(&mut s, 50), from(&mut s, 51), from(&mut s, 60));
        assert_eq!(s.parent(&cli), Some(run_a.span_id));
        assert_eq!(s.parent(&helper), Some(run_a.span_id));
        assert_eq!(s.parent(&worker), None);
        assert_eq!(s.undecided(&worker), Some(Undecided::NoInbound));
        // Spawned by the other handler before any call of its was placed: its calls wait
        // until one is.
        s.stitcher.spawned(AGENT, 70, &writer(chain(&[0x20])));
        let early = from(&mut s, 70);
        assert_eq!(s.parent(&early), None);
        let seed_b = s.call(AGENT, &[0x2, 0x20], &[]);
        s.rollout(&seed_b, "2-0");
        assert_eq!(s.parent(&seed_b), Some(run_b.span_id));
        assert_eq!(s.parent(&early), Some(run_b.span_id));
        assert!(s.stitcher.spawns.is_idle(), "nothing waits any more");
        assert_eq!(s.stitcher.counters.parents_by_spawn, 3);
        assert_eq!(s.stitcher.counters.processes_spawned_in_requests, 2);
    }

    /// Two rollouts of Gym's agent at once, as CAUSALITY.md measured them: /run's handler
    /// (task 0x10 / 0x20) calls seed_session (ids at the end of its body), the agent's own
    /// /v1/responses (the session cookie) and verify; the self-call's handler (0x30 / 0x40)
    /// calls the model (no cookie) and a tool (the session cookie). Gym's middleware writes
    /// each response from a task of its own (0x50…), so responses bind nothing.
    #[test]
    fn concurrent_gym_rollouts_each_get_their_own_calls() {
        let mut s = Scene::new();
        let (run_a, run_b) = (s.inbound(AGENT, "/run", &[]), s.inbound(AGENT, "/run", &[]));
        s.rollout(&run_a, "1-0");
        s.rollout(&run_b, "2-0");
        let seed_a = s.call(AGENT, &[0x1, 0x10], &[]);
        let seed_b = s.call(AGENT, &[0x2, 0x20], &[]);
        s.rollout(&seed_b, "2-0");
        s.rollout(&seed_a, "1-0");
        assert_eq!(s.parent(&seed_a), Some(run_a.span_id));
        assert_eq!(s.parent(&seed_b), Some(run_b.span_id));
        let (session_a, session_b) = (cookie("session=a"), cookie("session=b"));
        let self_a = s.call(AGENT, &[0x3, 0x10], &[session_a]);
        let self_b = s.call(AGENT, &[0x4, 0x20], &[session_b]);
        // No response seen yet: the loop's tail, so the handler's key, is unknown.
        assert_eq!(s.parent(&self_a), None);
        assert_eq!(s.undecided(&self_a), Some(Undecided::NoEvidence));
        let nested_a = s.inbound(AGENT, "/v1/responses", &[session_a]);
        let nested_b = s.inbound(AGENT, "/v1/responses", &[session_b]);
        let model_a = s.call(AGENT, &[0x5, 0x30], &[]);
        let model_b = s.call(AGENT, &[0x6, 0x40], &[]);
        let tool_b = s.call(AGENT, &[0x7, 0x40], &[session_b]);
        assert_eq!(
            s.parent(&tool_b),
            Some(nested_b.span_id),
            "the cookie decides"
        );
        assert_eq!(s.parent(&model_b), None, "its group is not known yet");
        // The first response (some middleware task) teaches the loop's tail: every call is
        // regrouped by its handler and placed by the group's placed call.
        s.stitcher
            .response_writer(nested_b.span_id, writer(chain(&[0x50])));
        assert_eq!(s.parent(&self_a), Some(run_a.span_id));
        assert_eq!(s.parent(&self_b), Some(run_b.span_id));
        assert_eq!(s.parent(&model_b), Some(nested_b.span_id));
        assert_eq!(s.parent(&model_a), None, "its tool call has not come yet");
        let tool_a = s.call(AGENT, &[0x8, 0x30], &[session_a]);
        assert_eq!(s.parent(&tool_a), Some(nested_a.span_id));
        assert_eq!(s.parent(&model_a), Some(nested_a.span_id));
        // The self-calls' own inbound requests carried the cookie too, but a request the
        // handler's own call caused is never its parent.
        let verify_a = s.call(AGENT, &[0x9, 0x10], &[session_a]);
        assert_eq!(s.parent(&verify_a), Some(run_a.span_id));
        let counters = s.stitcher.counters;
        assert_eq!(counters.parents_by_rollout_id, 2);
        assert_eq!(counters.parents_by_session, 2);
        assert_eq!(counters.parents_by_task_context, 5);
        assert_eq!(counters.task_context_conflicts, 0);
    }

    #[test]
    fn a_reused_context_address_starts_a_new_group() {
        let mut s = Scene::new();
        let warm = s.inbound(AGENT, "/warm", &[]);
        s.stitcher
            .response_writer(warm.span_id, writer(chain(&[0x90])));
        s.finish(&warm);
        let run_a = s.inbound(AGENT, "/run", &[]);
        let other = s.inbound(AGENT, "/run", &[]);
        s.rollout(&run_a, "1-0");
        let seed_a = s.call(AGENT, &[0x1, 0x10], &[]);
        s.rollout(&seed_a, "1-0");
        assert_eq!(s.parent(&seed_a), Some(run_a.span_id));
        s.finish(&seed_a);
        s.finish(&run_a);
        // A later handler at the freed address 0x10: not run_a's, which has ended.
        let later = s.call(AGENT, &[0x2, 0x10], &[]);
        assert_eq!(
            s.parent(&later),
            Some(other.span_id),
            "the only one in flight"
        );
        assert_eq!(s.stitcher.counters.parents_by_task_context, 0);
        let third = s.inbound(AGENT, "/run", &[]);
        let again = s.call(AGENT, &[0x3, 0x10], &[]);
        assert_eq!(
            s.parent(&again),
            Some(other.span_id),
            "the group now serves `other`"
        );
        assert_ne!(s.parent(&again), Some(third.span_id));
    }

    #[test]
    fn evidence_that_names_two_requests_decides_nothing() {
        let mut s = Scene::new();
        let (run_a, run_b) = (s.inbound(AGENT, "/run", &[]), s.inbound(AGENT, "/run", &[]));
        s.rollout(&run_a, "1-0");
        let holder_b = s.inbound(AGENT, "/v1/responses", &[cookie("session=b")]);
        s.rollout(&holder_b, "2-0");
        let call = s.call(AGENT, &[0x1, 0x10], &[cookie("session=b")]);
        assert_eq!(s.parent(&call), Some(holder_b.span_id));
        // Its body then names another rollout: the edge is taken back.
        s.rollout(&call, "1-0");
        assert_eq!(s.parent(&call), None);
        assert_eq!(s.undecided(&call), Some(Undecided::Contradicted));
        let _ = (run_b, holder_b);
        // Two requests of one rollout and nothing else: wait, never pick.
        let mut s = Scene::new();
        let run = s.inbound(AGENT, "/run", &[]);
        let nested = s.inbound(AGENT, "/ng-rollout/1-0/v1/responses", &[]);
        s.rollout(&run, "1-0");
        s.rollout(&nested, "1-0");
        let call = s.call(AGENT, &[0x1, 0x10], &[]);
        s.rollout(&call, "1-0");
        assert_eq!(s.undecided(&call), Some(Undecided::Ambiguous));
    }

    /// The model server: each handler makes one upstream call, and its response echoes the
    /// upstream's response id. Two at once, answered in the other order.
    #[test]
    fn an_echoed_response_id_binds_the_upstream_call() {
        let mut s = Scene::new();
        let (x1, x2) = (
            s.inbound(MODEL, "/v1/responses", &[]),
            s.inbound(MODEL, "/v1/responses", &[]),
        );
        let (u1, u2) = (
            s.call(MODEL, &[0x1, 0x10], &[]),
            s.call(MODEL, &[0x2, 0x20], &[]),
        );
        let (t1, t2) = (
            Token::of(TokenKind::ResponseId, b"resp_1"),
            Token::of(TokenKind::ResponseId, b"resp_2"),
        );
        s.stitcher.response_id(u2.span_id, t2);
        s.stitcher.response_id(u1.span_id, t1);
        s.stitcher.response_id(x2.span_id, t2);
        s.stitcher.response_id(x1.span_id, t1);
        assert_eq!(s.parent(&u1), Some(x1.span_id));
        assert_eq!(s.parent(&u2), Some(x2.span_id));
        assert_eq!(s.stitcher.counters.parents_by_echoed_id, 2);
    }

    /// The echoed id comes after the callee's spans went out: the call's trace was fixed
    /// then (a root's), so the late edge is not drawn, and no span names a parent in another
    /// trace.
    #[test]
    fn an_echo_that_arrives_late_still_places_the_upstream_call() {
        let mut s = Scene::new();
        let (x1, _x2) = (
            s.inbound(MODEL, "/v1/responses", &[]),
            s.inbound(MODEL, "/v1/responses", &[]),
        );
        let upstream = s.call(MODEL, &[0x1, 0x10], &[]);
        assert_eq!(s.parent(&upstream), None);
        // The callee, another traced process over the same connection, answers; the call
        // ends. Both spans wait while the requests that could be the call's are in flight,
        // however long that is.
        let mut out = Vec::new();
        s.answered_by_a_traced_callee(&upstream, &mut out);
        s.stitcher
            .release(s.now + Duration::from_secs(60), &mut out);
        assert!(out.is_empty(), "{out:?}");
        // A minute later the model server's answer echoes the upstream's id.
        let token = Token::of(TokenKind::ResponseId, b"resp_late");
        s.stitcher.response_id(upstream.span_id, token);
        s.stitcher.response_id(x1.span_id, token);
        s.stitcher
            .release(s.now + Duration::from_secs(60), &mut out);
        let [served, call] = &out[..] else {
            panic!("{out:?}")
        };
        assert_eq!(call.parent_span_id, Some(x1.span_id));
        assert_eq!(served.parent_span_id, Some(call.span_id));
        assert_eq!(served.trace_id, call.trace_id);
        assert_eq!(s.stitcher.counters.parents_by_echoed_id, 1);
    }

    /// Released early (too many held), the callee's span fixed its trace: the echo that
    /// comes after is not drawn, so no span names a parent in another trace.
    #[test]
    fn a_parent_decided_after_the_callee_went_out_is_not_drawn() {
        let mut s = Scene::new();
        s.stitcher.config.max_pending = 1;
        let (x1, x2) = (
            s.inbound(MODEL, "/v1/responses", &[]),
            s.inbound(MODEL, "/v1/responses", &[]),
        );
        let upstream = s.call(MODEL, &[0x1, 0x10], &[]);
        let mut out = Vec::new();
        s.answered_by_a_traced_callee(&upstream, &mut out);
        let [served] = &out[..] else {
            panic!("{out:?}")
        };
        let served = served.clone();
        assert_eq!(s.stitcher.counters.spans_released_early, 1);
        assert_eq!(served.parent_span_id, Some(upstream.span_id));
        // Now the echo binds the call: too late.
        let token = Token::of(TokenKind::ResponseId, b"resp_late");
        s.stitcher.response_id(upstream.span_id, token);
        s.stitcher.response_id(x1.span_id, token);
        assert_eq!(s.parent(&upstream), None);
        assert_eq!(s.stitcher.counters.parents_decided_late, 1);
        assert_eq!(s.stitcher.counters.parents_by_echoed_id, 0);
        s.finish(&x1);
        s.finish(&x2);
        s.stitcher.release(s.now, &mut out);
        let call = &out[1];
        assert_eq!(
            (call.parent_span_id, call.trace_id),
            (None, served.trace_id)
        );
    }

    /// A plain FastAPI handler writes its own response: the response's task context binds
    /// the handler's calls. Behind BaseHTTPMiddleware another task writes it: nothing binds.
    #[test]
    fn a_response_written_by_the_handler_binds_its_calls() {
        let mut s = Scene::new();
        let (y1, y2) = (s.inbound(AGENT, "/a", &[]), s.inbound(AGENT, "/b", &[]));
        let warm = s.inbound(AGENT, "/warm", &[]);
        s.stitcher
            .response_writer(warm.span_id, writer(chain(&[0x90])));
        let c1 = s.call(AGENT, &[0x1, 0x10], &[]);
        let c2 = s.call(AGENT, &[0x2, 0x20], &[]);
        let c3 = s.call(AGENT, &[0x3, 0x20], &[]);
        assert_eq!(s.undecided(&c1), Some(Undecided::NoEvidence));
        s.stitcher
            .response_writer(y2.span_id, writer(chain(&[0x20])));
        assert_eq!(
            (s.parent(&c2), s.parent(&c3)),
            (Some(y2.span_id), Some(y2.span_id))
        );
        s.stitcher
            .response_writer(y1.span_id, writer(chain(&[0x77])));
        assert_eq!(s.parent(&c1), None, "written by a middleware task");
        assert_eq!(s.stitcher.counters.parents_by_response_context, 2);
        let _ = Evidence::ResponseContext;
    }
}
