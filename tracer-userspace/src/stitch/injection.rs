//! The traces the kernel may write into outbound requests (`--inject-traceparent`).
//!
//! The kernel inserts `traceparent` synchronously, inside the write, so it can only carry
//! what is known before the call is written: the trace of the request the writing handler
//! serves. That is known once evidence bound the handler's group ([`super::calls`]) and the
//! request's trace is settled (a rollout id, an inbound `traceparent`, or a span already
//! released: a trace that could still change is never published). A group's first call is
//! what usually binds it, so it leaves without a header; the calls after it carry one.
//!
//! A task context's address belongs to its request only until that request is answered;
//! the publication names the request's connection and the responses it had before it, and
//! the kernel stops using it once the count moves ([`tracer_abi::InjectTrace`]).

use super::{GroupKey, MAX_DEPTH, Parent, Stitcher};
use crate::model::exchange::InboundSocket;
use crate::model::ids::{SpanId, TraceId};

/// A change to the kernel's published traces, for the driver to apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceInjection {
    /// Requests written by the tasks of `handler` (a task context, or with
    /// `--task-lineage` a request root) of process `pid` carry `trace`, while the request on
    /// `owner` is unanswered.
    Publish {
        pid: u32,
        handler: GroupKey,
        trace: TraceId,
        owner: InboundSocket,
    },
    Withdraw {
        pid: u32,
        handler: GroupKey,
    },
}

impl Stitcher {
    /// The group `key` serves `owner`: publishes `owner`'s trace for it, when injection is
    /// on, the trace is settled and the request still unanswered on a plaintext connection.
    pub(super) fn publish_trace(&mut self, key: (u32, GroupKey), owner: SpanId) {
        if self.config.injection.is_none() || self.published.get(&key) == Some(&owner) {
            return;
        }
        let Some(node) = self.nodes.get(&owner) else {
            return;
        };
        let Some(socket) = node.inbound_socket.filter(|_| node.ended.is_none()) else {
            return;
        };
        let Some(trace) = self.settled_trace(owner) else {
            self.counters.traces_unsettled += 1;
            return;
        };
        self.counters.traces_published += 1;
        self.published.insert(key, owner);
        self.published_by_owner.entry(owner).or_default().push(key);
        self.injections.push(TraceInjection::Publish {
            pid: key.0,
            handler: key.1,
            trace,
            owner: socket,
        });
    }

    /// The group `key` was bound to `owner`: indexed, so that `owner`'s trace settling
    /// publishes it without a scan of every group.
    pub(super) fn index_owner(&mut self, key: (u32, GroupKey), owner: SpanId) {
        if self.config.injection.is_some() {
            // A request has a handful of groups: the list stays short.
            let keys = self.groups_by_owner.entry(owner).or_default();
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
    }

    /// `owner`'s trace may have settled (its rollout became known): its bound handlers that
    /// were not published yet are.
    pub(super) fn publish_traces_of(&mut self, owner: SpanId) {
        if self.config.injection.is_none() {
            return;
        }
        let Some(keys) = self.groups_by_owner.get(&owner) else {
            return;
        };
        let keys: Vec<(u32, GroupKey)> = keys
            .iter()
            .filter(|key| {
                self.groups.get(key).and_then(|group| group.owner()) == Some(owner)
                    && !self.published.contains_key(key)
            })
            .copied()
            .collect();
        for key in keys {
            self.publish_trace(key, owner);
        }
    }

    /// `owner` was answered or forgotten: the traces published for its handlers go.
    pub(super) fn withdraw_traces(&mut self, owner: SpanId) {
        let Some(keys) = self.published_by_owner.remove(&owner) else {
            return;
        };
        for key in keys {
            // A key published again since for another request is that one's now.
            if self.published.get(&key) == Some(&owner) {
                self.published.remove(&key);
                self.injections.push(TraceInjection::Withdraw {
                    pid: key.0,
                    handler: key.1,
                });
            }
        }
    }

    /// A process is gone: its publications go with it.
    pub(super) fn withdraw_process(&mut self, pid: u32) {
        let owners: Vec<SpanId> = self
            .published
            .iter()
            .filter(|((owner_pid, _), _)| *owner_pid == pid)
            .map(|(_, owner)| *owner)
            .collect();
        for owner in owners {
            self.withdraw_traces(owner);
        }
    }

    /// Takes the changes made since the last call.
    pub fn take_injections(&mut self) -> Vec<TraceInjection> {
        std::mem::take(&mut self.injections)
    }

    /// `id`'s trace, if nothing still to come can change it: fixed by a released span, or
    /// decided by a remote parent or its root's rollout id. A root's random trace is not
    /// settled: its rollout may yet be learned.
    fn settled_trace(&self, mut id: SpanId) -> Option<TraceId> {
        let start = id;
        for _ in 0..MAX_DEPTH {
            let node = self.nodes.get(&id)?;
            if let Some(trace) = node.trace {
                return Some(trace);
            }
            match node.parent {
                Parent::Remote(trace, _) => return Some(trace),
                Parent::Local(parent) if self.nodes.contains_key(&parent) => id = parent,
                Parent::Local(_) => return None,
                Parent::None => {
                    return node
                        .minted_trace
                        .or_else(|| self.effective_rollout(start).map(super::rollout_trace_id));
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Instant;

    use super::super::GroupKey;
    use super::super::{Injection, StartFacts, StitchConfig, Stitcher};
    use super::TraceInjection;
    use crate::gym::rollout_id::RolloutId;
    use crate::model::context::{ContextChain, WriterTask};
    use crate::model::exchange::{InboundSocket, RequestStart, Role};
    use crate::model::ids::{MintKey, TraceId};
    use crate::pipeline::testing;

    const AGENT: u32 = 1;
    const LOOP: [u64; 2] = [0xb0, 0xa0];
    const HANDLER: u64 = 0x100;

    fn chain(task: &[u64]) -> ContextChain {
        let links: Vec<u64> = task.iter().chain(LOOP.iter()).copied().collect();
        ContextChain::new(&links).expect("a chain")
    }

    fn writer(chain: ContextChain) -> WriterTask {
        WriterTask {
            chain: Some(chain),
            lineage: None,
        }
    }

    fn facts(rollout: Option<&str>) -> StartFacts {
        StartFacts {
            rollout_id: rollout.map(|r| RolloutId::parse(r).expect("an id")),
            emits_own: true,
            emits_semantic: false,
            inbound_hidden: false,
            caller_traced: false,
            caller_seen_here: false,
        }
    }

    const KEY: MintKey = MintKey([0x5eed, 0xc0ffee]);

    fn stitcher(inject: bool) -> Stitcher {
        Stitcher::new(StitchConfig {
            max_pending: 100,
            max_nodes: 1000,
            injection: inject.then_some(Injection {
                every_call: true,
                mint_key: KEY,
            }),
        })
    }

    fn inbound(stitcher: &mut Stitcher, port: u16, rollout: Option<&str>) -> RequestStart {
        let mut start = testing::start(AGENT, Role::Server, (8000, port), 0, "POST", "/run");
        start.inbound_socket = Some(InboundSocket {
            fd: i32::from(port),
            conn_id: 7,
            requests_before: 0,
        });
        stitcher.start(&start, facts(rollout), Instant::now());
        // A response under the loop's own contexts teaches the loop's tail.
        stitcher.response_writer(start.span_id, writer(chain(&[0x999])));
        start
    }

    fn call(stitcher: &mut Stitcher, port: u16, rollout: Option<&str>) -> RequestStart {
        let mut start = testing::start(AGENT, Role::Client, (port, 9000), 0, "POST", "/tool");
        start.context = Some(chain(&[0x500 + u64::from(port), HANDLER]));
        stitcher.start(&start, facts(None), Instant::now());
        if let Some(rollout) = rollout {
            stitcher.set_rollout(start.span_id, RolloutId::parse(rollout).expect("an id"));
        }
        start
    }

    #[test]
    fn a_bound_handler_of_a_known_rollout_is_published_until_its_request_ends() {
        let mut stitcher = stitcher(true);
        let run = inbound(&mut stitcher, 1000, Some("3-0"));
        // The first call names the rollout: it binds the handler, and from now on its
        // calls may carry the trace.
        call(&mut stitcher, 2000, Some("3-0"));
        let published = stitcher.take_injections();
        assert_eq!(published.len(), 1, "{published:?}");
        let TraceInjection::Publish {
            pid,
            handler,
            trace,
            owner,
        } = published[0]
        else {
            panic!("{published:?}");
        };
        assert_eq!(
            (pid, handler, owner.fd),
            (AGENT, GroupKey::Context(HANDLER), 1000)
        );
        // The trace its kernel minted for /run (connection 7, its first request), not the
        // rollout's: the kernel may have written it into the handler's first calls.
        assert_eq!(trace, TraceId::minted(KEY, AGENT, 7, 0));
        assert_ne!(
            trace,
            super::super::rollout_trace_id(&RolloutId::parse("3-0").expect("an id"))
        );
        // Later calls of the group change nothing; the request's end withdraws it.
        call(&mut stitcher, 2001, None);
        assert!(stitcher.take_injections().is_empty());
        stitcher.finish(run.span_id);
        assert_eq!(
            stitcher.take_injections(),
            vec![TraceInjection::Withdraw {
                pid: AGENT,
                handler: GroupKey::Context(HANDLER)
            }]
        );
    }

    /// An inbound request from another host's Gym server, without a header.
    fn inbound_from_another_host(stitcher: &mut Stitcher, port: u16) -> RequestStart {
        let mut start = testing::start(AGENT, Role::Server, (8000, port), 0, "POST", "/run");
        start.peer = Some(SocketAddr::from(([10, 0, 0, 9], port)));
        start.inbound_socket = Some(InboundSocket {
            fd: i32::from(port),
            conn_id: 7,
            requests_before: 0,
        });
        let facts = StartFacts {
            caller_traced: true,
            ..facts(None)
        };
        stitcher.start(&start, facts, Instant::now());
        stitcher.response_writer(start.span_id, writer(chain(&[0x999])));
        start
    }

    #[test]
    fn a_request_without_a_header_is_a_root_of_the_trace_its_kernel_minted() {
        let mut injecting = stitcher(true);
        // Its rollout known or not, /run's trace is the minted one from its start, and so is
        // its calls' (whose ids the kernel's header carries).
        for (port, rollout) in [(1000, Some("3-0")), (1001, None)] {
            let run = inbound(&mut injecting, port, rollout);
            let minted = TraceId::minted(KEY, AGENT, 7, 0);
            assert_eq!(injecting.trace_of(run.span_id), minted);
            assert_eq!(injecting.settled_trace(run.span_id), Some(minted));
        }
        // Without the flag, the rollout's trace.
        let mut off = stitcher(false);
        let run = inbound(&mut off, 1000, Some("3-0"));
        assert_eq!(
            off.trace_of(run.span_id),
            super::super::rollout_trace_id(&RolloutId::parse("3-0").expect("an id"))
        );
    }

    #[test]
    fn a_trace_that_may_still_change_is_never_published() {
        let mut stitcher = stitcher(true);
        // A call from another host's Gym server without a header is in its rollout's trace
        // (which names its caller's span), random until its rollout id turns up: the
        // handler's calls, bound by the only request in flight, publish nothing yet.
        let run = inbound_from_another_host(&mut stitcher, 1000);
        let placed = call(&mut stitcher, 2000, None);
        assert!(stitcher.nodes[&placed.span_id].parent != super::Parent::None);
        assert!(stitcher.take_injections().is_empty());
        assert_eq!(stitcher.counters.traces_unsettled, 1);
        // Its body's ids arrive: the trace is settled, and published then.
        let rollout = RolloutId::parse("4-1").expect("an id");
        stitcher.set_rollout(run.span_id, rollout.clone());
        let published = stitcher.take_injections();
        let trace = super::super::rollout_trace_id(&rollout);
        assert!(
            matches!(
                published[..],
                [TraceInjection::Publish {
                    handler: GroupKey::Context(HANDLER),
                    trace: published_trace,
                    ..
                }] if published_trace == trace
            ),
            "{published:?}"
        );
    }

    #[test]
    fn without_the_flag_nothing_is_published() {
        let mut stitcher = stitcher(false);
        inbound(&mut stitcher, 1000, Some("3-0"));
        call(&mut stitcher, 2000, Some("3-0"));
        assert!(stitcher.take_injections().is_empty());
    }
}
