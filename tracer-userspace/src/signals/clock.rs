//! Kernel timestamps (`bpf_ktime_get_ns`, CLOCK_MONOTONIC) to wall-clock time.

/// The offset between CLOCK_REALTIME and CLOCK_MONOTONIC, measured once at start.
#[derive(Clone, Copy, Debug)]
pub struct WallClock {
    realtime_minus_monotonic_ns: i128,
}

fn now_ns(clock: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128
}

impl WallClock {
    /// Samples both clocks a few times and keeps the pair read closest together, so the
    /// offset is off by at most the fastest sampling interval (well under a microsecond).
    pub fn measure() -> Self {
        let mut best = (i128::MAX, 0i128);
        for _ in 0..8 {
            let before = now_ns(libc::CLOCK_MONOTONIC);
            let real = now_ns(libc::CLOCK_REALTIME);
            let after = now_ns(libc::CLOCK_MONOTONIC);
            let spread = after - before;
            if spread < best.0 {
                best = (spread, real - (before + spread / 2));
            }
        }
        Self {
            realtime_minus_monotonic_ns: best.1,
        }
    }

    /// The offset a recording carries, so that its spans keep their own times.
    pub fn offset_ns(self) -> i128 {
        self.realtime_minus_monotonic_ns
    }

    pub fn from_offset_ns(realtime_minus_monotonic_ns: i128) -> Self {
        Self {
            realtime_minus_monotonic_ns,
        }
    }

    pub fn to_unix_ns(self, monotonic_ns: u64) -> u64 {
        (monotonic_ns as i128 + self.realtime_minus_monotonic_ns).max(0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_now_to_now() {
        let clock = WallClock::measure();
        let mono = now_ns(libc::CLOCK_MONOTONIC) as u64;
        let real = now_ns(libc::CLOCK_REALTIME) as u64;
        let mapped = clock.to_unix_ns(mono);
        assert!(mapped.abs_diff(real) < 5_000_000, "{mapped} vs {real}");
    }
}
