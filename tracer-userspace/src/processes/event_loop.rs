//! How busy a traced server's event loop is: the share of an interval its main thread (where
//! uvicorn runs the asyncio loop) was on a CPU, from `/proc/<pid>/task/<pid>/stat`. No
//! probe: one small read per traced process per interval.

use foldhash::{HashMap, HashMapExt};
use std::path::PathBuf;
use std::time::Instant;

/// The last reading of each process's main thread.
pub struct LoopSampler {
    proc_root: PathBuf,
    ticks_per_second: f64,
    last: HashMap<u32, (u64, Instant)>,
}

impl LoopSampler {
    pub fn new(proc_root: PathBuf) -> Self {
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        Self {
            proc_root,
            ticks_per_second: if ticks > 0 { ticks as f64 } else { 100.0 },
            last: HashMap::new(),
        }
    }

    /// The share (0–1) of the time since the last call that `pid`'s main thread ran; `None`
    /// at the first call, or when its stat cannot be read (the process is gone).
    pub fn sample(&mut self, pid: u32, now: Instant) -> Option<f64> {
        let path = self.proc_root.join(format!("{pid}/task/{pid}/stat"));
        let Some(ticks) = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| cpu_ticks(&s))
        else {
            self.last.remove(&pid);
            return None;
        };
        let previous = self.last.insert(pid, (ticks, now));
        let (before, then) = previous?;
        let seconds = now.saturating_duration_since(then).as_secs_f64();
        if seconds <= 0.0 {
            return None;
        }
        let busy = ticks.saturating_sub(before) as f64 / self.ticks_per_second;
        Some((busy / seconds).clamp(0.0, 1.0))
    }

    /// Forgets processes that are no longer traced.
    pub fn retain(&mut self, traced: impl Fn(u32) -> bool) {
        self.last.retain(|&pid, _| traced(pid));
    }
}

/// utime + stime (fields 14 and 15) of a `stat` line. The command name (field 2) is in
/// parentheses and may hold spaces or parentheses itself: fields are counted after the last
/// `)`.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_counted_after_the_command_name() {
        let stat = "4242 (uvi corn) (x)) R 1 4242 4242 0 -1 4194304 5000 0 0 0 \
                    731 269 0 0 20 0 3 0 123456 0 0";
        assert_eq!(cpu_ticks(stat), Some(1000));
        assert_eq!(cpu_ticks("4242 (truncated"), None);
    }
}
