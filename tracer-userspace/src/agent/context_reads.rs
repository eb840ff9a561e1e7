//! Which traced processes the kernel reads asyncio task contexts in (issue #13 step 1b): each
//! attached process's CPython runtime is recognised from outside, and each of its thread
//! states handed to the kernel's `PYTHON_THREADS` map; a periodic rescan follows threads that
//! start and end. An interpreter the tracer does not know is off for that process, said once.

use std::collections::{HashMap, HashSet};

use anyhow::Result;
use tracer_abi::PythonThread;

use crate::kernel::loader::LoadedProbes;
use crate::processes::python::{self, NotPythonFiles, ProcessMemory, PythonRuntime, RuntimeOff};

/// How often thread states are re-read.
pub const RESCAN_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);
/// Inspections of a process before its runtime is declared off: one just after an exec or a
/// spawn may see an interpreter that is not initialised yet.
const ATTEMPTS: u32 = 3;

/// The kernel's thread map, as this module uses it (a trait so the logic can be tested
/// without a kernel).
pub trait ThreadMap {
    fn insert(&mut self, tid: u32, thread: PythonThread) -> Result<()>;
    fn remove(&mut self, tid: u32);
}

impl ThreadMap for LoadedProbes {
    fn insert(&mut self, tid: u32, thread: PythonThread) -> Result<()> {
        self.register_python_thread(tid, thread)
    }

    fn remove(&mut self, tid: u32) {
        self.unregister_python_thread(tid);
    }
}

/// What the agent counts about context reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ContextReadCounters {
    /// Processes whose context reads were turned on.
    pub runtimes_read: u64,
    /// CPython processes whose runtime the tracer could not use (any reason; the log line
    /// and `doctor --pid` name it).
    pub runtimes_off: u64,
    /// Traced processes that are not CPython.
    pub not_python: u64,
    /// Thread entries handed to the kernel (a thread seen again is not counted again).
    pub threads_registered: u64,
    /// Thread entries the kernel refused (its map full).
    pub threads_not_registered: u64,
}

enum State {
    On {
        runtime: Box<PythonRuntime>,
        /// Host tids this agent registered, with the entry it gave.
        threads: HashMap<u32, PythonThread>,
    },
    /// Not decided yet: inspected `attempts` times, each failing.
    Trying {
        attempts: u32,
    },
    Off,
}

#[derive(Default)]
pub struct ContextReads {
    processes: HashMap<u32, State>,
    /// `--no-task-contexts`: no process is inspected, no thread registered.
    disabled: bool,
    not_python: NotPythonFiles,
    pub counters: ContextReadCounters,
}

/// The kernel's entries for one process, read now.
type Found = Result<(PythonRuntime, Vec<(u32, PythonThread)>), RuntimeOff>;

fn inspect_now(pid: u32, not_python: &mut NotPythonFiles) -> Found {
    let runtime = python::inspect_remembering(pid, not_python)?;
    let threads = rescan_now(pid, &runtime)?;
    Ok((runtime, threads))
}

fn rescan_now(pid: u32, runtime: &PythonRuntime) -> Result<Vec<(u32, PythonThread)>, RuntimeOff> {
    let memory = ProcessMemory::new(pid).ok_or(RuntimeOff::Unreadable(pid))?;
    runtime.kernel_threads(pid, &memory, &python::host_tids(pid))
}

/// Reasons that another look will not change.
fn is_final(why: &RuntimeOff) -> bool {
    !matches!(
        why,
        RuntimeOff::NotMapped
            | RuntimeOff::Read(_)
            | RuntimeOff::LayoutMismatch(_)
            | RuntimeOff::NotPython
    )
}

/// What the context reads know of a process's runtime, for the task-lineage probe.
#[derive(Clone, Copy, Debug)]
pub enum RuntimeView<'a> {
    On(&'a PythonRuntime),
    /// Not decided yet (or the process is not known).
    Deciding,
    /// Off (said in its own log line), or context reads are off altogether.
    Off,
}

impl ContextReads {
    /// What is known of `pid`'s runtime.
    pub fn runtime(&self, pid: u32) -> RuntimeView<'_> {
        match self.processes.get(&pid) {
            _ if self.disabled => RuntimeView::Off,
            Some(State::On { runtime, .. }) => RuntimeView::On(runtime),
            Some(State::Off) => RuntimeView::Off,
            Some(State::Trying { .. }) | None => RuntimeView::Deciding,
        }
    }

    /// Whether context reads are on for `pid`.
    #[cfg(test)]
    fn is_on(&self, pid: u32) -> bool {
        matches!(self.processes.get(&pid), Some(State::On { .. }))
    }

    /// Context reads for no process (`--no-task-contexts`).
    pub fn disabled() -> Self {
        Self {
            disabled: true,
            ..Self::default()
        }
    }

    /// A process was attached (named, discovered or adopted): look at its runtime now.
    pub fn attach(&mut self, pid: u32, map: &mut impl ThreadMap) {
        if self.disabled || self.processes.contains_key(&pid) {
            return;
        }
        self.processes.insert(pid, State::Trying { attempts: 0 });
        let found = inspect_now(pid, &mut self.not_python);
        self.apply_inspection(pid, found, map);
    }

    /// Every `RESCAN_INTERVAL`: processes not decided yet are inspected again, and the
    /// thread states of those that are on re-read. `traced` is every traced pid, so that
    /// adopted children are picked up here.
    pub fn rescan(&mut self, traced: impl IntoIterator<Item = u32>, map: &mut impl ThreadMap) {
        if self.disabled {
            return;
        }
        for pid in traced {
            match self.processes.get(&pid) {
                None => self.attach(pid, map),
                Some(State::Trying { .. }) => {
                    let found = inspect_now(pid, &mut self.not_python);
                    self.apply_inspection(pid, found, map);
                }
                Some(State::On { runtime, .. }) => {
                    let found = rescan_now(pid, runtime);
                    self.apply_rescan(pid, found, map);
                }
                Some(State::Off) => {}
            }
        }
    }

    /// The process exited, exec'd or is no longer traced: its entries go (an exec'd process
    /// is inspected afresh at the next rescan).
    pub fn forget(&mut self, pid: u32, map: &mut impl ThreadMap) {
        if let Some(State::On { threads, .. }) = self.processes.remove(&pid) {
            for tid in threads.into_keys() {
                map.remove(tid);
            }
        }
    }

    fn apply_inspection(&mut self, pid: u32, found: Found, map: &mut impl ThreadMap) {
        let attempts = match self.processes.get(&pid) {
            Some(State::Trying { attempts }) => attempts + 1,
            _ => return,
        };
        match found {
            Ok((runtime, threads)) => {
                tracing::info!(
                    pid,
                    "pid {pid}: CPython {} recognised; reading the running task's context at \
                     each message it writes ({} thread(s))",
                    runtime.version,
                    threads.len()
                );
                self.counters.runtimes_read += 1;
                self.processes.insert(
                    pid,
                    State::On {
                        runtime: Box::new(runtime),
                        threads: HashMap::new(),
                    },
                );
                self.apply_rescan(pid, Ok(threads), map);
            }
            Err(why) if attempts < ATTEMPTS && !is_final(&why) => {
                tracing::debug!(pid, "pid {pid}: Python runtime not read yet: {why}");
                self.processes.insert(pid, State::Trying { attempts });
            }
            Err(RuntimeOff::NotPython) => {
                self.counters.not_python += 1;
                self.processes.insert(pid, State::Off);
            }
            Err(why) => {
                tracing::info!(
                    pid,
                    "pid {pid}: task context reads are off ({}): {why}",
                    why.reason()
                );
                self.counters.runtimes_off += 1;
                self.processes.insert(pid, State::Off);
            }
        }
    }

    /// Makes the kernel's entries for `pid` those of `found`. A failed rescan keeps the
    /// entries it had: each one is still checked by the kernel at every read, and threads
    /// that end remove their own.
    fn apply_rescan(
        &mut self,
        pid: u32,
        found: Result<Vec<(u32, PythonThread)>, RuntimeOff>,
        map: &mut impl ThreadMap,
    ) {
        let Some(State::On { threads, .. }) = self.processes.get_mut(&pid) else {
            return;
        };
        let found = match found {
            Ok(found) => found,
            Err(why) => {
                tracing::debug!(pid, "pid {pid}: rescanning thread states failed: {why}");
                return;
            }
        };
        let live: HashSet<u32> = found.iter().map(|(tid, _)| *tid).collect();
        threads.retain(|tid, _| {
            let keep = live.contains(tid);
            if !keep {
                map.remove(*tid);
            }
            keep
        });
        for (tid, thread) in found {
            if threads.get(&tid) == Some(&thread) {
                continue;
            }
            match map.insert(tid, thread) {
                Ok(()) => {
                    threads.insert(tid, thread);
                    self.counters.threads_registered += 1;
                }
                Err(error) => {
                    self.counters.threads_not_registered += 1;
                    tracing::debug!(pid, "pid {pid}: thread {tid}: {error:#}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct FakeMap {
        entries: HashMap<u32, PythonThread>,
        capacity: usize,
    }

    impl ThreadMap for FakeMap {
        fn insert(&mut self, tid: u32, thread: PythonThread) -> Result<()> {
            if self.entries.len() >= self.capacity && !self.entries.contains_key(&tid) {
                anyhow::bail!("full");
            }
            self.entries.insert(tid, thread);
            Ok(())
        }
        fn remove(&mut self, tid: u32) {
            self.entries.remove(&tid);
        }
    }

    fn runtime() -> PythonRuntime {
        python::testing::runtime_313(0x1000, 0x5000)
    }

    fn thread(pid: u32, state: u64) -> PythonThread {
        PythonThread {
            thread_state: state,
            context_type: 0x5000,
            thread_context: 208,
            context_prev: 16,
            object_type: 8,
            tgid: pid,
        }
    }

    fn trying(reads: &mut ContextReads, pid: u32) {
        reads.processes.insert(pid, State::Trying { attempts: 0 });
    }

    #[test]
    fn threads_follow_rescans_and_leave_with_their_process() {
        let mut map = FakeMap {
            capacity: 16,
            ..FakeMap::default()
        };
        let mut reads = ContextReads::default();
        trying(&mut reads, 10);
        let first = vec![(10, thread(10, 0xa0)), (11, thread(10, 0xb0))];
        reads.apply_inspection(10, Ok((runtime(), first)), &mut map);
        assert!(reads.is_on(10));
        assert_eq!(map.entries.len(), 2);
        assert_eq!(reads.counters.runtimes_read, 1);
        assert_eq!(reads.counters.threads_registered, 2);

        // Thread 11 ended, 12 started, 10 is unchanged (not registered again).
        reads.apply_rescan(
            10,
            Ok(vec![(10, thread(10, 0xa0)), (12, thread(10, 0xc0))]),
            &mut map,
        );
        let mut tids: Vec<u32> = map.entries.keys().copied().collect();
        tids.sort_unstable();
        assert_eq!(tids, [10, 12]);
        assert_eq!(reads.counters.threads_registered, 3);

        // A failed rescan keeps what the kernel has.
        reads.apply_rescan(10, Err(RuntimeOff::LayoutMismatch("x")), &mut map);
        assert_eq!(map.entries.len(), 2);

        reads.forget(10, &mut map);
        assert!(map.entries.is_empty());
        assert!(!reads.is_on(10));
    }

    #[test]
    fn disabled_reads_inspect_and_register_nothing() {
        let mut map = FakeMap::default();
        let mut reads = ContextReads::disabled();
        // The agent's own pid: a real CPython-free process that attach would inspect.
        reads.attach(std::process::id(), &mut map);
        reads.rescan([std::process::id()], &mut map);
        assert!(reads.processes.is_empty() && map.entries.is_empty());
        assert_eq!(reads.counters, ContextReadCounters::default());
    }

    #[test]
    fn a_full_kernel_map_is_counted_and_retried() {
        let mut map = FakeMap {
            capacity: 1,
            ..FakeMap::default()
        };
        let mut reads = ContextReads::default();
        trying(&mut reads, 10);
        let both = vec![(10, thread(10, 0xa0)), (11, thread(10, 0xb0))];
        reads.apply_inspection(10, Ok((runtime(), both.clone())), &mut map);
        assert_eq!(reads.counters.threads_not_registered, 1);
        map.capacity = 2;
        reads.apply_rescan(10, Ok(both), &mut map);
        assert_eq!(map.entries.len(), 2);
        assert_eq!(reads.counters.threads_registered, 2);
    }

    #[test]
    fn unknown_interpreters_are_off_at_once_and_transient_failures_retried() {
        let mut map = FakeMap::default();
        let mut reads = ContextReads::default();
        trying(&mut reads, 20);
        reads.apply_inspection(20, Err(RuntimeOff::UnknownVersion(3, 11, 7)), &mut map);
        assert!(matches!(reads.processes.get(&20), Some(State::Off)));
        assert_eq!(reads.counters.runtimes_off, 1);

        trying(&mut reads, 21);
        for attempt in 1..ATTEMPTS {
            reads.apply_inspection(
                21,
                Err(RuntimeOff::LayoutMismatch("no thread state")),
                &mut map,
            );
            assert!(
                matches!(reads.processes.get(&21), Some(State::Trying { attempts }) if *attempts == attempt)
            );
        }
        reads.apply_inspection(
            21,
            Err(RuntimeOff::LayoutMismatch("no thread state")),
            &mut map,
        );
        assert!(matches!(reads.processes.get(&21), Some(State::Off)));
        assert_eq!(reads.counters.runtimes_off, 2);

        trying(&mut reads, 22);
        for _ in 0..ATTEMPTS {
            reads.apply_inspection(22, Err(RuntimeOff::NotPython), &mut map);
        }
        assert_eq!(
            (reads.counters.not_python, reads.counters.runtimes_off),
            (1, 2)
        );
        assert!(map.entries.is_empty());
    }
}
