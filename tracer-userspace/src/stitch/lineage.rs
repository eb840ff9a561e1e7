//! Task lineage as evidence (`--task-lineage`): the kernel names the request root each
//! writing task descends from (see `tracer-ebpf/src/lineage.rs`), and, when the root was
//! created while its inbound request was being read, that request. A call whose root was
//! born so hangs under its request at once; the calls of a root born otherwise wait for a
//! response written by one of its tasks (a root is created for one request and answers only
//! that one). Calls whose lineage names no request keep the other evidence, counted by why.

use std::collections::hash_map::Entry;

use super::calls::{Group, GroupKey};
use super::{Evidence, Node, Stitcher};
use crate::model::context::{Lineage, OriginId};
use crate::model::ids::SpanId;

impl Stitcher {
    /// A call's lineage at its start: its request root becomes its group, and the inbound
    /// request the root was born for is returned if the graph holds it.
    pub(super) fn lineage_at_start(
        &mut self,
        node: &mut Node,
        lineage: Option<Lineage>,
    ) -> Option<SpanId> {
        match lineage? {
            Lineage::Request { origin, request } => {
                node.origin = Some(origin);
                let socket = request?;
                let born_of = self
                    .inbound_sockets
                    .get(&(node.pid, socket))
                    .copied()
                    .filter(|id| self.nodes.contains_key(id));
                self.counters.lineage_requests_unmatched += u64::from(born_of.is_none());
                born_of
            }
            Lineage::Background => {
                self.counters.lineage_calls_background += 1;
                None
            }
            Lineage::Unknown | Lineage::Unseen => {
                self.counters.lineage_calls_unseen += 1;
                None
            }
            Lineage::NoTask => {
                self.counters.lineage_calls_no_task += 1;
                None
            }
            Lineage::Unreadable => {
                self.counters.lineage_calls_unreadable += 1;
                None
            }
        }
    }

    /// The response to inbound `request` is being written by a task of request root
    /// `origin`: the root was created for it, and the calls of the root's tasks are its.
    pub(super) fn origin_answers(&mut self, request: SpanId, origin: OriginId) {
        let Some(pid) = self.nodes.get(&request).map(|node| node.pid) else {
            return;
        };
        let key = (pid, GroupKey::Origin(origin.0));
        match self.groups.entry(key) {
            Entry::Occupied(_) => self.bind_group(Some(key), request, Evidence::Lineage),
            Entry::Vacant(vacant) => {
                vacant.insert(Group::owned_by(request));
                self.index_owner(key, request);
                self.spawner_bound(pid, GroupKey::Origin(origin.0));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::super::{Parent, StartFacts, StitchConfig, Stitcher};
    use crate::model::context::{Lineage, OriginId, WriterTask};
    use crate::model::exchange::{InboundSocket, RequestStart, Role};
    use crate::model::ids::SpanId;
    use crate::pipeline::testing;

    const JUDGE: u32 = 3;

    fn stitcher() -> Stitcher {
        Stitcher::new(StitchConfig {
            max_pending: 1000,
            max_nodes: 1000,
            injection: None,
        })
    }

    fn facts() -> StartFacts {
        super::super::testing_facts()
    }

    fn socket(fd: i32) -> InboundSocket {
        InboundSocket {
            fd,
            conn_id: 1000 + fd as u64,
            requests_before: 2,
        }
    }

    /// A `/verify` arriving on connection `fd`.
    fn verify(s: &mut Stitcher, fd: i32) -> RequestStart {
        let port = 40000 + fd as u16;
        let mut start = testing::start(JUDGE, Role::Server, (8000, port), 2, "POST", "/verify");
        start.inbound_socket = Some(socket(fd));
        s.start(&start, facts(), Instant::now());
        start
    }

    /// A judge call written by a task of request root `origin`.
    fn judge_call(s: &mut Stitcher, lineage: Lineage) -> RequestStart {
        let mut start = testing::start(
            JUDGE,
            Role::Client,
            (50000, 9000),
            0,
            "POST",
            "/v1/responses",
        );
        start.lineage = Some(lineage);
        s.start(&start, facts(), Instant::now());
        start
    }

    fn parent(s: &Stitcher, call: &RequestStart) -> Option<SpanId> {
        match s.nodes[&call.span_id].parent {
            Parent::Local(parent) => Some(parent),
            _ => None,
        }
    }

    fn born(origin: u64, fd: i32) -> Lineage {
        Lineage::Request {
            origin: OriginId(origin),
            request: Some(socket(fd)),
        }
    }

    /// Many `/verify`s at once, each judge call written by a task its own request's root
    /// spawned: each hangs under its own request, decided as it starts.
    #[test]
    fn a_call_hangs_under_the_request_its_root_was_born_for() {
        let mut s = stitcher();
        let requests: Vec<RequestStart> = (0..4).map(|fd| verify(&mut s, fd)).collect();
        let calls: Vec<RequestStart> = (0..4)
            .rev()
            .map(|fd| judge_call(&mut s, born(0x100 + fd as u64, fd)))
            .collect();
        for (call, fd) in calls.iter().zip((0..4).rev()) {
            assert_eq!(parent(&s, call), Some(requests[fd].span_id));
        }
        assert_eq!(s.counters.parents_by_lineage, 4);
        // A second call of one root (a gather sibling, a later call) joins its group.
        let sibling = judge_call(&mut s, born(0x102, 2));
        assert_eq!(parent(&s, &sibling), Some(requests[2].span_id));
    }

    /// A root whose request the kernel did not see being read (pipelined): its calls wait
    /// for a response written by one of its tasks, then all hang there; a response of
    /// another root binds nothing of this one.
    #[test]
    fn a_root_without_a_birth_is_bound_by_its_response() {
        let mut s = stitcher();
        let (first, second) = (verify(&mut s, 1), verify(&mut s, 2));
        let unborn = |origin| Lineage::Request {
            origin: OriginId(origin),
            request: None,
        };
        let a = judge_call(&mut s, unborn(0x200));
        let b = judge_call(&mut s, unborn(0x200));
        assert_eq!((parent(&s, &a), parent(&s, &b)), (None, None));
        let writer = |origin| WriterTask {
            chain: None,
            lineage: Some(unborn(origin)),
        };
        s.response_writer(first.span_id, writer(0x300));
        assert_eq!(parent(&s, &a), None);
        s.response_writer(second.span_id, writer(0x200));
        assert_eq!(
            (parent(&s, &a), parent(&s, &b)),
            (Some(second.span_id), Some(second.span_id))
        );
        // After its response, a background task of that root still belongs to it.
        s.finish(second.span_id);
        let late = judge_call(&mut s, unborn(0x200));
        assert_eq!(parent(&s, &late), Some(second.span_id));
        // A root answers one request: a response of another request under it is a conflict.
        s.response_writer(first.span_id, writer(0x200));
        assert_eq!(s.counters.lineage_conflicts, 1);
        assert_eq!(s.counters.parents_by_lineage, 3);
    }

    /// Lineage that names no request decides nothing and says why; the other evidence
    /// (here: the only request in flight) still works for a process without contexts.
    #[test]
    fn lineage_without_a_request_is_counted_by_reason() {
        let mut s = stitcher();
        let only = verify(&mut s, 1);
        for lineage in [
            Lineage::Background,
            Lineage::Unknown,
            Lineage::Unseen,
            Lineage::NoTask,
            Lineage::Unreadable,
        ] {
            let call = judge_call(&mut s, lineage);
            assert_eq!(parent(&s, &call), Some(only.span_id), "{lineage:?}");
        }
        let c = s.counters;
        assert_eq!(
            (
                c.lineage_calls_background,
                c.lineage_calls_unseen,
                c.lineage_calls_no_task,
                c.lineage_calls_unreadable,
                c.parents_by_lineage,
            ),
            (1, 2, 1, 1, 0)
        );
        // A birth the graph does not hold (evicted): counted, then decided by a response.
        let gone = Lineage::Request {
            origin: OriginId(0x9),
            request: Some(socket(99)),
        };
        let call = judge_call(&mut s, gone);
        assert_eq!(s.counters.lineage_requests_unmatched, 1);
        assert_eq!(
            parent(&s, &call),
            None,
            "lineage calls never fall back to a guess"
        );
    }
}
