//! Which handler task made a call: the root of its contextvars chain.
//!
//! Every task step of an asyncio server runs its task's context on top of the event loop's
//! own contexts, so a chain read at a write is `[task contexts…, loop contexts…]`. The loop's
//! part (its "tail") is the same for every chain of that loop; the link just above it is the
//! handler task's context, shared by every call the handler makes (aiohttp adds a fresh
//! context per call below it) and by no other live task (CAUSALITY.md: 17/17, 34/34, 0
//! clashes).
//!
//! The tail is learned per loop (per bottom link) from the chains of *responses*: a response
//! head is written by a task directly on top of the loop (the handler's, or a middleware's),
//! so a response chain without its first link is the loop's part. Call chains cannot teach
//! it: two calls of one handler differ only in aiohttp's per-call context, and a tail learned
//! from them would key each call by that short-lived context, whose address the next call
//! reuses. Until a response of that loop was seen, its calls have no key.

use foldhash::HashMap;

use crate::model::context::{ContextChain, MAX_CONTEXT_DEPTH};

/// The loop's part of every chain on one event loop: the common suffix of its response
/// chains without their first link, bottom first.
#[derive(Debug)]
struct LoopTail {
    suffix: Vec<u64>,
}

/// What a chain says about the task that wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskKey {
    /// The handler task's context address (valid while its request is in flight).
    Root(u64),
    /// The loop's tail is not known yet, or the chain does not end with it.
    TailUnknown,
    /// Written by the loop itself, outside any task.
    LoopLevel,
}

/// Loop tails per process and bottom link, at most [`MAX_LOOPS`] a process.
#[derive(Debug, Default)]
pub struct LoopTails {
    tails: HashMap<(u32, u64), LoopTail>,
}

/// Event loops remembered per process (threads that run a loop); more are not learned.
pub const MAX_LOOPS: usize = 64;

impl LoopTails {
    /// Learns from the chain a response head was written under; true when the tail of its
    /// loop changed (keys computed before are stale).
    pub fn learn_response(&mut self, pid: u32, chain: &ContextChain) -> bool {
        let links = chain.links();
        let Some((_, loop_part)) = links.split_first() else {
            return false;
        };
        let Some(&bottom) = loop_part.last() else {
            return false; // a response written at loop level teaches nothing
        };
        let loops_known = self.tails.keys().filter(|(p, _)| *p == pid).count();
        match self.tails.get_mut(&(pid, bottom)) {
            Some(tail) => {
                let common = tail
                    .suffix
                    .iter()
                    .zip(loop_part.iter().rev())
                    .take_while(|(a, b)| a == b)
                    .count();
                let changed = common < tail.suffix.len();
                tail.suffix.truncate(common);
                changed
            }
            None if loops_known >= MAX_LOOPS => false,
            None => {
                let suffix = loop_part.iter().rev().copied().collect();
                self.tails.insert((pid, bottom), LoopTail { suffix });
                true
            }
        }
    }

    pub fn key(&self, pid: u32, chain: &ContextChain) -> TaskKey {
        let links = chain.links();
        let bottom = links[links.len() - 1];
        let Some(tail) = self.tails.get(&(pid, bottom)) else {
            return TaskKey::TailUnknown;
        };
        let ends_with_tail = tail.suffix.len() <= links.len()
            && tail
                .suffix
                .iter()
                .zip(links.iter().rev())
                .all(|(a, b)| a == b);
        match links.len().checked_sub(tail.suffix.len() + 1) {
            _ if !ends_with_tail => TaskKey::TailUnknown,
            Some(at) => TaskKey::Root(links[at]),
            None => TaskKey::LoopLevel,
        }
    }

    pub fn forget(&mut self, pid: u32) {
        self.tails.retain(|(p, _), _| *p != pid);
    }
}

const _: () = assert!(MAX_CONTEXT_DEPTH >= 2);

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(links: &[u64]) -> ContextChain {
        ContextChain::new(links).unwrap()
    }

    #[test]
    fn the_root_is_the_link_above_the_loop_tail_that_responses_show() {
        let mut tails = LoopTails::default();
        // Calls of handler 0x10 (aiohttp's per-call contexts 0x1, 0x2 below it), loop 0xb → 0xa.
        let first = chain(&[0x1, 0x10, 0xb, 0xa]);
        let second = chain(&[0x2, 0x10, 0xb, 0xa]);
        assert_eq!(
            tails.key(7, &first),
            TaskKey::TailUnknown,
            "no response seen yet"
        );
        // A response written by a middleware task one level above the loop.
        assert!(tails.learn_response(7, &chain(&[0x30, 0xb, 0xa])));
        assert_eq!(tails.key(7, &first), TaskKey::Root(0x10));
        assert_eq!(tails.key(7, &second), TaskKey::Root(0x10));
        assert_eq!(
            tails.key(7, &chain(&[0x3, 0x20, 0xb, 0xa])),
            TaskKey::Root(0x20)
        );
        assert_eq!(
            tails.key(7, &chain(&[0x20, 0xb, 0xa])),
            TaskKey::Root(0x20),
            "httpx: no per-call context"
        );
        assert_eq!(tails.key(7, &chain(&[0xb, 0xa])), TaskKey::LoopLevel);
        // A response written deeper shrinks nothing; one written shallower does.
        assert!(!tails.learn_response(7, &chain(&[0x5, 0x40, 0xb, 0xa])));
        assert!(tails.learn_response(7, &chain(&[0x6, 0xa])));
        assert_eq!(tails.key(7, &first), TaskKey::Root(0xb));
        // Another process, another loop, or a chain that does not end with the tail: no key.
        assert_eq!(tails.key(8, &first), TaskKey::TailUnknown);
        assert_eq!(
            tails.key(7, &chain(&[0x1, 0x10, 0xc])),
            TaskKey::TailUnknown
        );
        tails.forget(7);
        assert_eq!(tails.key(7, &first), TaskKey::TailUnknown);
    }
}
