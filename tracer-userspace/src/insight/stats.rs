//! A bounded window of recent durations: the medians and percentiles the insight stage
//! judges stragglers and reports saturation by.

use std::collections::VecDeque;

/// The most recent values a window keeps: its memory bound (the median of the last 1,024
/// rollouts moves with the batch, as the stragglers it judges do).
pub const WINDOW: usize = 1024;

#[derive(Clone, Debug, Default)]
pub struct Window {
    recent: VecDeque<u64>,
    /// Every value pushed, the forgotten ones included.
    count: u64,
    max: u64,
}

impl Window {
    pub fn push(&mut self, value: u64) {
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(value);
        self.count += 1;
        self.max = self.max.max(value);
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// The largest value ever pushed.
    pub fn max(&self) -> Option<u64> {
        (self.count > 0).then_some(self.max)
    }

    pub fn median(&self) -> Option<u64> {
        self.quantile(0.5)
    }

    /// The `q` quantile of the recent values (nearest rank).
    pub fn quantile(&self, q: f64) -> Option<u64> {
        if self.recent.is_empty() {
            return None;
        }
        let mut values: Vec<u64> = self.recent.iter().copied().collect();
        let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1;
        Some(*values.select_nth_unstable(rank).1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank_over_the_recent_values() {
        let mut window = Window::default();
        assert_eq!(window.median(), None);
        for value in [5, 1, 4, 2, 3] {
            window.push(value);
        }
        assert_eq!(window.median(), Some(3));
        assert_eq!(window.quantile(0.9), Some(5));
        for _ in 0..WINDOW {
            window.push(10);
        }
        // The first five are forgotten by the quantiles, not by the count or the max.
        assert_eq!(window.median(), Some(10));
        assert_eq!(window.count(), WINDOW as u64 + 5);
        assert_eq!(window.max(), Some(10));
    }
}
