//! Processes a traced server spawns while it serves a request: a CLI agent (Gym's
//! `codex_agent` runs the `codex` CLI per rollout), a verifier, a sandbox. The process works
//! for the request its forking task was serving, and so do its descendants, whatever
//! language they are written in: their calls hang under that request.
//!
//! The kernel reads the forking thread's task context at the fork, as at a message's first
//! write ([`tracer_abi::EventKind::SpawnContext`]): the fork belongs to the handler's group the
//! way a call would, and the group's request is the spawner — known at once under task lineage
//! or once a call of the handler was placed (a Gym agent's first call names its rollout), else
//! when the group is bound later. Otherwise the only request in flight at the fork is the
//! spawner; a fork under none of these works for no request (counted) and its calls are placed
//! as any other process's. A descendant of a spawned process inherits its spawner.

use foldhash::HashMap;

use super::calls::GroupKey;
use super::context_keys::TaskKey;
use super::{Stitcher, shrink_if_sparse};
use crate::model::context::{Lineage, WriterTask};
use crate::model::ids::SpanId;

/// Who a spawned process works for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Spawner {
    /// The request its forking task was serving.
    Request(SpanId),
    /// The handler group it was forked under, whose request was not known at the fork.
    Group(u32, GroupKey),
    /// Forked outside any request the evidence names.
    Unknown,
}

/// Spawned processes by pid, while they live, and the calls of theirs that wait for their
/// spawner's group to be bound.
#[derive(Default)]
pub(super) struct Spawns {
    by_pid: HashMap<u32, Spawner>,
    /// Per group, the calls waiting for it (while a request of its process is in flight:
    /// they are among that process's open calls, see [`Stitcher::await_spawner`]).
    waiting: HashMap<(u32, GroupKey), Vec<SpanId>>,
    /// The group each waiting call waits for (its process's open calls hold it).
    waiting_in: HashMap<SpanId, (u32, GroupKey)>,
}

impl Spawns {
    /// Whether no call waits for its spawner.
    #[cfg(test)]
    pub(super) fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.waiting_in.is_empty()
    }
}

impl Stitcher {
    /// `pid` forked `child` under the task context `writer`.
    pub fn spawned(&mut self, pid: u32, child: u32, writer: &WriterTask) {
        let key = match (writer.lineage, writer.chain.as_ref()) {
            (Some(Lineage::Request { origin, .. }), _) => Some(GroupKey::Origin(origin.0)),
            (_, Some(chain)) => match self.tails.key(pid, chain) {
                TaskKey::Root(root) => Some(GroupKey::Context(root)),
                TaskKey::TailUnknown | TaskKey::LoopLevel => None,
            },
            _ => None,
        };
        // The request the forking task's root was born for, as for a call's lineage, else
        // the request its group was bound to.
        let born_of = match writer.lineage {
            Some(Lineage::Request {
                request: Some(socket),
                ..
            }) => self.inbound_sockets.get(&(pid, socket)).copied(),
            _ => None,
        };
        let at = self.seq;
        let owner = born_of
            .or_else(|| {
                key.and_then(|key| self.groups.get(&(pid, key)))
                    .and_then(|group| group.owner())
            })
            .filter(|owner| self.in_flight_at(*owner, at + 1));
        // A lineage root that names no request in flight names none: its request is not this
        // one (as for a call).
        let only = match key {
            Some(GroupKey::Origin(_)) => None,
            _ => self.only_in_flight(pid),
        };
        let spawner = match (owner, only, key) {
            (Some(owner), _, _) => Spawner::Request(owner),
            (None, Some(only), _) => Spawner::Request(only),
            (None, None, Some(key)) => Spawner::Group(pid, key),
            (None, None, None) => Spawner::Unknown,
        };
        match spawner {
            Spawner::Unknown => self.counters.processes_spawned_outside_requests += 1,
            _ => self.counters.processes_spawned_in_requests += 1,
        }
        self.spawns.by_pid.insert(child, spawner);
    }

    /// `pid` forked `child` (after its [`Stitcher::spawned`], if the kernel read a context):
    /// a descendant of a spawned process works for the same request.
    pub fn forked(&mut self, pid: u32, child: u32) {
        if self.spawns.by_pid.contains_key(&child) {
            return;
        }
        if let Some(spawner) = self.spawns.by_pid.get(&pid).copied() {
            self.spawns.by_pid.insert(child, spawner);
        }
    }

    /// The request a call of `pid` that started at `started` works for: the one that spawned
    /// `pid` (or an ancestor), if it is known and was still in flight.
    pub(super) fn spawner_of(&self, pid: u32, started: u64) -> Option<SpanId> {
        let request = match *self.spawns.by_pid.get(&pid)? {
            Spawner::Request(request) => Some(request),
            Spawner::Group(owner_pid, key) => self
                .groups
                .get(&(owner_pid, key))
                .and_then(|group| group.owner()),
            Spawner::Unknown => None,
        };
        request.filter(|r| self.in_flight_at(*r, started))
    }

    /// An unplaced call of `pid`, spawned under a handler group that is not bound yet: it
    /// waits among the open calls of the spawner's process, as a call of that process would,
    /// until the group is bound ([`Stitcher::spawner_bound`]) or no request that could be its
    /// spawner is in flight. Whether it waits.
    pub(super) fn await_spawner(&mut self, call: SpanId) -> bool {
        let Some(node) = self.nodes.get(&call) else {
            return false;
        };
        let Some(Spawner::Group(owner_pid, key)) = self.spawns.by_pid.get(&node.pid).copied()
        else {
            return false;
        };
        if node.awaiting.is_some() || self.inbound.contains_key(&node.pid) {
            return false;
        }
        let started = node.started;
        let candidates = self
            .inbound
            .get(&owner_pid)
            .and_then(|list| list.keys().next())
            .is_some_and(|oldest| *oldest < started);
        if !candidates {
            return false;
        }
        if let Some(node) = self.nodes.get_mut(&call) {
            node.awaiting = Some(super::settle::Awaiting::Evidence);
            node.undecided = Some(super::Undecided::NoEvidence);
        }
        self.open_calls
            .entry(owner_pid)
            .or_default()
            .insert(started, call);
        self.spawns
            .waiting
            .entry((owner_pid, key))
            .or_default()
            .push(call);
        self.spawns.waiting_in.insert(call, (owner_pid, key));
        true
    }

    /// The process among whose open calls `call` waits (its spawner's, or its own), as it
    /// stops waiting.
    pub(super) fn evidence_pid(&mut self, call: SpanId, own: u32) -> u32 {
        let Some(group) = self.spawns.waiting_in.remove(&call) else {
            return own;
        };
        if let Some(calls) = self.spawns.waiting.get_mut(&group) {
            calls.retain(|waiting| *waiting != call);
            if calls.is_empty() {
                self.spawns.waiting.remove(&group);
            }
        }
        group.0
    }

    /// The group `key` of `pid` was bound: the calls of the processes spawned under it hang
    /// under its request now (those processes may have exited meanwhile).
    pub(super) fn spawner_bound(&mut self, pid: u32, key: GroupKey) {
        let Some(owner) = self.groups.get(&(pid, key)).and_then(|group| group.owner()) else {
            return;
        };
        // (Each call leaves `waiting_in` as it settles, or as its wait closes.)
        for call in self.spawns.waiting.remove(&(pid, key)).unwrap_or_default() {
            let Some(node) = self.nodes.get(&call) else {
                continue;
            };
            if node.parent == super::Parent::None && self.in_flight_at(owner, node.started) {
                self.set_parent(call, owner, super::Evidence::Spawn);
            }
        }
    }

    /// The one inbound request in flight in `pid`, if exactly one is.
    fn only_in_flight(&self, pid: u32) -> Option<SpanId> {
        let list = self.inbound.get(&pid)?;
        let mut requests = list.values();
        match (requests.next(), requests.next()) {
            (Some(only), None) => Some(*only),
            _ => None,
        }
    }

    /// A process is gone: it works for nobody any more.
    pub(super) fn forget_spawn(&mut self, pid: u32) {
        self.spawns.by_pid.remove(&pid);
        shrink_if_sparse(&mut self.spawns.by_pid);
        // The spawner's process is gone: its groups are bound by nothing any more.
        let nodes = &self.nodes;
        self.spawns.waiting.retain(|(owner, _), calls| {
            calls.retain(|call| nodes.get(call).is_some_and(|n| n.awaiting.is_some()));
            *owner != pid && !calls.is_empty()
        });
        self.spawns
            .waiting_in
            .retain(|call, _| nodes.contains_key(call));
    }
}
