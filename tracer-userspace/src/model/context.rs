//! The running asyncio task's contextvars `Context` chain, as the kernel read it from a traced
//! CPython process at the first write of a message: `PyThreadState.context`, then each
//! `PyContext.ctx_prev`, innermost first. The addresses are compared, never dereferenced:
//! they identify which task wrote, and only while the request they belong to is in flight
//! (a freed context's address is reused by later requests).

pub use tracer_abi::MAX_CONTEXT_DEPTH;

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
