//! A completed rollout as the insight stage hands it on: the phases its time is split into
//! (as `gym.rollout.phase.*_ms` name them), and what the metrics record of it.

use std::sync::Arc;

use super::service::ServiceIdentity;
use super::span::Text;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Inside a model server's SERVER span and its subtree (its upstream call included).
    Model,
    /// Inside a resources server's spans other than `/verify`'s.
    Tool,
    /// Inside a resources server's `/verify` subtree.
    Verify,
    /// On a call to a traced server before the server read it, and after it answered until
    /// the caller read the answer: a saturated event loop or a full socket buffer.
    Queue,
    /// On a call to a peer nobody traces (a model server's upstream is model time).
    External,
    /// Everything else: the agent servers' own time.
    Agent,
}

/// One value per phase, indexed in [`Phase::ALL`]'s order.
pub type PerPhase<T> = [T; Phase::COUNT];

impl Phase {
    /// How many phases there are: every per-phase array is this long.
    pub const COUNT: usize = 6;

    pub const ALL: PerPhase<Phase> = [
        Phase::Model,
        Phase::Tool,
        Phase::Verify,
        Phase::Queue,
        Phase::External,
        Phase::Agent,
    ];

    /// The value of `gym.rollout.phase` on `gym.rollout.phase.duration`.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Model => "model",
            Phase::Tool => "tool",
            Phase::Verify => "verify",
            Phase::Queue => "queue",
            Phase::External => "external",
            Phase::Agent => "agent",
        }
    }

    /// The `gym.rollout` span attribute that carries it, in milliseconds.
    pub fn attribute(self) -> &'static str {
        match self {
            Phase::Model => "gym.rollout.phase.model_ms",
            Phase::Tool => "gym.rollout.phase.tool_ms",
            Phase::Verify => "gym.rollout.phase.verify_ms",
            Phase::Queue => "gym.rollout.phase.queue_ms",
            Phase::External => "gym.rollout.phase.external_ms",
            Phase::Agent => "gym.rollout.phase.agent_ms",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Nanoseconds per phase.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PhaseNs(PerPhase<u64>);

impl PhaseNs {
    pub fn add(&mut self, phase: Phase, ns: u64) {
        self.0[phase.index()] += ns;
    }

    pub fn get(&self, phase: Phase) -> u64 {
        self.0[phase.index()]
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// Whole milliseconds per phase that sum to the total's rounded milliseconds (largest
    /// remainders round up), so the attributes add up to the span's duration.
    pub fn whole_ms(&self) -> PerPhase<(Phase, u64)> {
        const MS: u64 = 1_000_000;
        let total_ms = (self.total() + MS / 2) / MS;
        let mut ms = self.0.map(|ns| ns / MS);
        let mut short = total_ms.saturating_sub(ms.iter().sum());
        let mut by_remainder: PerPhase<usize> = std::array::from_fn(|i| i);
        by_remainder.sort_by_key(|&i| std::cmp::Reverse(self.0[i] % MS));
        for i in by_remainder {
            if short == 0 {
                break;
            }
            ms[i] += 1;
            short -= 1;
        }
        Phase::ALL.map(|phase| (phase, ms[phase.index()]))
    }
}

/// One finished rollout, for the metrics and the live view.
#[derive(Clone, Debug)]
pub struct RolloutSummary {
    pub agent: Arc<ServiceIdentity>,
    pub duration_ns: u64,
    pub phases: PhaseNs,
    pub straggler: bool,
    /// Per call to a traced server in the rollout: the server, its route, and how long the
    /// request waited between the client's first write and the server's first read.
    pub queue_delays: Vec<(Arc<ServiceIdentity>, Option<Text>, u64)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_milliseconds_add_up_to_the_rounded_total() {
        let mut phases = PhaseNs::default();
        for (phase, ns) in [
            (Phase::Model, 1_600_000),
            (Phase::Tool, 1_600_000),
            (Phase::Queue, 1_600_000),
            (Phase::Agent, 200_000),
        ] {
            phases.add(phase, ns);
        }
        // 5.0 ms in all: 1.6 + 1.6 + 1.6 + 0.2; each 1.6 alone would round to 2 (6 ms).
        let ms = phases.whole_ms();
        assert_eq!(ms.iter().map(|(_, ms)| ms).sum::<u64>(), 5);
        assert_eq!(
            ms,
            [
                (Phase::Model, 2),
                (Phase::Tool, 2),
                (Phase::Verify, 0),
                (Phase::Queue, 1),
                (Phase::External, 0),
                (Phase::Agent, 0),
            ]
        );
    }
}
