//! What the kernel needs to read each CPython thread's running context (issue #13 step 1b):
//! one [`PythonThread`] per thread state, keyed by the thread's id as the kernel reports it.
//!
//! A thread state is handed to the kernel only when nothing about it is a guess: its native
//! id names exactly one thread state (two states on one thread — subinterpreters, a
//! `PyGILState` pair — leave which one runs unknown) and one live thread of the process, seen
//! from the agent's PID namespace.

use std::collections::HashMap;
use std::path::Path;

use tracer_abi::PythonThread;

use super::{Memory, PythonRuntime, ReadError, RuntimeOff, ThreadState};

/// `PyObject.ob_type` in the default (GIL) build. Free-threaded builds, whose object header
/// differs, are refused by `inspect` (their debug offsets say so, their soname ends in `t`).
pub const OBJECT_TYPE_OFFSET: u32 = 8;
/// `PyTypeObject.tp_name`, after `ob_refcnt`, `ob_type` and `ob_size`.
const TYPE_NAME_OFFSET: u64 = 24;
/// `PyContext_Type.tp_name` in 3.12 to 3.14 (`Python/context.c`), with its NUL.
const CONTEXT_TYPE_NAME: &[u8] = b"_contextvars.Context\0";

/// `address` if the type object there is named `_contextvars.Context`: proof that the
/// symbol's address was mapped with the right bias before the kernel compares with it.
pub(super) fn checked_context_type(address: u64, memory: &impl Memory) -> Result<u64, RuntimeOff> {
    checked_type(address, CONTEXT_TYPE_NAME, memory).map_err(|error| match error {
        RuntimeOff::LayoutMismatch(_) => {
            RuntimeOff::LayoutMismatch("PyContext_Type is not named _contextvars.Context")
        }
        other => other,
    })
}

/// `address` if the type object there is named `name` (with its NUL).
pub(super) fn checked_type(
    address: u64,
    name: &[u8],
    memory: &impl Memory,
) -> Result<u64, RuntimeOff> {
    let name_field = address
        .checked_add(TYPE_NAME_OFFSET)
        .ok_or(ReadError::Overflow(address))?;
    let found = memory.read_pointer(name_field)?;
    if memory.read_bytes(found, name.len())? != name {
        return Err(RuntimeOff::LayoutMismatch(
            "a type object is not named as its symbol says",
        ));
    }
    Ok(address)
}

impl PythonRuntime {
    /// The kernel's entries for process `pid`'s thread states, keyed by host thread id.
    /// `host_tids` maps the ids the process sees (`native_thread_id`) to the kernel's (see
    /// [`host_tids`]). Threads that cannot be named exactly are left out.
    pub fn kernel_threads(
        &self,
        pid: u32,
        memory: &impl Memory,
        host_tids: &HashMap<u32, u32>,
    ) -> Result<Vec<(u32, PythonThread)>, RuntimeOff> {
        let context_type = self
            .context_type
            .ok_or(RuntimeOff::MissingSymbol("PyContext_Type"))?;
        let offset = |value: u64| {
            u32::try_from(value).map_err(|_| RuntimeOff::LayoutMismatch("offset over 32 bits"))
        };
        let thread_context = offset(self.context.thread_context)?;
        let context_prev = offset(self.context.context_prev)?;
        // The kernel reads `ob_type` and `ctx_prev` together, once per link.
        if context_prev != OBJECT_TYPE_OFFSET + 8 {
            return Err(RuntimeOff::LayoutMismatch(
                "ctx_prev does not follow ob_type: the kernel's one read per link cannot serve",
            ));
        }
        let states = self.thread_states(memory)?;
        Ok(unambiguous_threads(&states, host_tids)
            .into_iter()
            .map(|(tid, thread_state)| {
                let thread = PythonThread {
                    thread_state,
                    context_type,
                    thread_context,
                    context_prev,
                    object_type: OBJECT_TYPE_OFFSET,
                    tgid: pid,
                };
                (tid, thread)
            })
            .collect())
    }
}

/// (host tid, thread state address) for every native id that exactly one thread state and
/// one live thread carry.
fn unambiguous_threads(states: &[ThreadState], host_tids: &HashMap<u32, u32>) -> Vec<(u32, u64)> {
    let mut by_native: HashMap<u32, Vec<u64>> = HashMap::new();
    for state in states {
        by_native
            .entry(state.native_thread_id)
            .or_default()
            .push(state.address);
    }
    let mut threads: Vec<(u32, u64)> = by_native
        .into_iter()
        .filter(|(native, addresses)| *native != 0 && addresses.len() == 1)
        .filter_map(|(native, addresses)| Some((*host_tids.get(&native)?, addresses[0])))
        .collect();
    threads.sort_unstable();
    threads
}

/// The threads of process `pid`: the id each one has in the process's own PID namespace (what
/// CPython records as `native_thread_id`) → its id in ours (what the kernel reports to the
/// agent). Empty if the process is gone.
pub fn host_tids(pid: u32) -> HashMap<u32, u32> {
    let task = Path::new("/proc").join(pid.to_string()).join("task");
    let Ok(entries) = std::fs::read_dir(task) else {
        return HashMap::new();
    };
    parse_host_tids(entries.filter_map(|entry| {
        let entry = entry.ok()?;
        let tid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
        Some((tid, status))
    }))
}

/// [`host_tids`] from (tid, `/proc/PID/task/TID/status`) pairs: the last `NSpid` field is the
/// innermost namespace's id; without the line (kernels before 4.1) the namespaces are
/// assumed to be one.
pub fn parse_host_tids(threads: impl IntoIterator<Item = (u32, String)>) -> HashMap<u32, u32> {
    threads
        .into_iter()
        .filter_map(|(tid, status)| {
            let inner = match status.lines().find_map(|line| line.strip_prefix("NSpid:")) {
                Some(ids) => ids.split_ascii_whitespace().last()?.parse().ok()?,
                None => tid,
            };
            Some((inner, tid))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::memory::recorded::RecordedMemory;
    use super::*;

    const NAME: u64 = 0x7f00_0010_0000;
    const TYPE: u64 = 0x7f00_0055_0000;

    #[test]
    fn the_context_type_must_be_named_context() {
        let mut m = RecordedMemory::default();
        m.put_u64(TYPE + TYPE_NAME_OFFSET, NAME);
        m.put(NAME, CONTEXT_TYPE_NAME);
        assert_eq!(checked_context_type(TYPE, &m), Ok(TYPE));
        m.put(NAME, b"_contextvars.ContextVar\0");
        assert!(matches!(
            checked_context_type(TYPE, &m),
            Err(RuntimeOff::LayoutMismatch(_))
        ));
        m.put_u64(TYPE + TYPE_NAME_OFFSET, 0);
        assert_eq!(
            checked_context_type(TYPE, &m),
            Err(RuntimeOff::Read(ReadError::Null))
        );
    }

    fn state(address: u64, native_thread_id: u32) -> ThreadState {
        ThreadState {
            address,
            interpreter: 0x1000,
            native_thread_id,
        }
    }

    #[test]
    fn only_threads_named_exactly_once_are_kept() {
        let states = [
            state(0xa0, 100),
            state(0xb0, 101),
            state(0xc0, 102), // two states on one thread: which runs is unknown
            state(0xc8, 102),
            state(0xd0, 0),   // not started yet
            state(0xe0, 103), // no such live thread
        ];
        let host: HashMap<u32, u32> = [(100, 5100), (101, 5101), (102, 5102), (0, 5000)].into();
        assert_eq!(
            unambiguous_threads(&states, &host),
            [(5100, 0xa0), (5101, 0xb0)]
        );
    }

    #[test]
    fn namespaced_thread_ids_map_to_ours() {
        let statuses = [
            (4200, "Name:\tpython\nNSpid:\t4200\t1\n".to_string()),
            (4201, "Name:\tpython\nNSpid:\t4201\t7\n".to_string()),
            (4300, "Name:\told kernel\n".to_string()),
            (4400, "NSpid:\tgarbage\n".to_string()),
        ];
        let map = parse_host_tids(statuses);
        assert_eq!(map, [(1, 4200), (7, 4201), (4300, 4300)].into());
        let mine = host_tids(std::process::id());
        assert_eq!(mine.get(&std::process::id()), Some(&std::process::id()));
    }
}
