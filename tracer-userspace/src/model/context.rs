//! The running asyncio task's contextvars `Context` chain, as the kernel read it from a traced
//! CPython process at the first write of a message: `PyThreadState.context`, then each
//! `PyContext.ctx_prev`, innermost first. The addresses are compared, never dereferenced:
//! they identify which task wrote, and only while the request they belong to is in flight
//! (a freed context's address is reused by later requests).

pub use tracer_abi::MAX_CONTEXT_DEPTH;

use super::exchange::InboundSocket;

/// A root task's serial, as the kernel's task-creation probe gave it: unique for the
/// agent's life, whatever addresses the task and its context had.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OriginId(pub u64);

/// Which inbound request made the task that wrote a message, as the kernel's task lineage
/// says (`--task-lineage`, `tracer-ebpf/src/lineage.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lineage {
    /// The task descends from `origin`, the root task the server created for an inbound
    /// request: the one at `request` (its connection and place on it), when the kernel saw
    /// that request being read as the root was created; else only a response written by a
    /// task of the same origin tells which.
    Request {
        origin: OriginId,
        request: Option<InboundSocket>,
    },
    /// It descends from a task created outside any task that is no request's root (a
    /// timer's, a background loop's): no inbound request caused it.
    Background,
    /// An ancestor's lineage is not known: created before the probe, or forgotten.
    Unknown,
    /// The task itself has no recorded lineage (created before the probe, or forgotten).
    Unseen,
    /// The write ran outside any task.
    NoTask,
    /// The running task could not be read.
    Unreadable,
}

/// What the kernel read about the task that wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriterTask {
    /// Its contextvars chain, `None` when not even the thread's current context was read.
    pub chain: Option<ContextChain>,
    /// `None` in a process whose task creations are not probed.
    pub lineage: Option<Lineage>,
}

/// At most [`MAX_CONTEXT_DEPTH`] non-null context addresses, innermost first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ContextChain {
    links: [u64; MAX_CONTEXT_DEPTH],
    len: u8,
}

impl ContextChain {
    /// `None` for an empty chain, one longer than [`MAX_CONTEXT_DEPTH`], or one with a null
    /// link (the kernel stops at NULL, so a null inside is a corrupt record).
    pub fn new(links: &[u64]) -> Option<Self> {
        if links.is_empty() || links.len() > MAX_CONTEXT_DEPTH || links.contains(&0) {
            return None;
        }
        let mut chain = Self {
            links: [0; MAX_CONTEXT_DEPTH],
            len: links.len() as u8,
        };
        chain.links[..links.len()].copy_from_slice(links);
        Some(chain)
    }

    /// Innermost first; never empty.
    pub fn links(&self) -> &[u64] {
        &self.links[..usize::from(self.len)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_empty_long_and_null_chains() {
        assert!(ContextChain::new(&[]).is_none());
        assert!(ContextChain::new(&[1; MAX_CONTEXT_DEPTH + 1]).is_none());
        assert!(ContextChain::new(&[1, 0, 2]).is_none());
        assert_eq!(ContextChain::new(&[3, 2, 1]).unwrap().links(), &[3, 2, 1]);
    }
}
