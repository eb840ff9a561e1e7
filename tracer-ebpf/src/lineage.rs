//! Task lineage (`--task-lineage`): which inbound request's handler made the task that is
//! running, so that a call written by any task a handler spawned — `asyncio.gather` and
//! `TaskGroup` children, the tasks Starlette's and anyio's middleware run the app in, an LLM
//! judge called from `/verify` — names that request, at the moment it is written.
//!
//! CPython 3.12 and 3.13 keep no link from a task to the task that created it, so the
//! `task_created` uprobe on `_asyncio`'s `Task.__init__` (attached per probed process, like
//! the TLS probes) records one: the new task's lineage is its creator's, read from the
//! running task. A task created outside any task is a root of its own; a task whose coroutine
//! is the server's per-request coroutine (uvicorn's `RequestResponseCycle.run_asgi`) is a
//! request's root, born for the inbound request its thread last read. Each root gets a serial
//! that is never reused, so lineage survives the reuse of task and context addresses.
//!
//! The running task is the entry of `_asyncio`'s `current_tasks` (`{loop: task}`, one entry
//! per loop inside a task step) whose `task_context` is on the thread's contextvars chain: a
//! context is entered by one thread at a time, so the match is this thread's task and no
//! other's. A task alive now was created after every earlier task at its address, so its
//! entry in [`TASK_LINEAGE`] is its own — every creation writes one, even when it cannot
//! tell the lineage ([`LINEAGE_UNKNOWN`]).
//!
//! Cost: a uprobe hit per task created (the trap dominates: ~13 µs on a Firecracker VM), and
//! at each message-start write of a probed process a few more user reads than the context
//! chain's.

use aya_ebpf::{
    bindings::BPF_ANY,
    helpers::{bpf_get_smp_processor_id, bpf_probe_read_user},
    macros::{map, uprobe},
    maps::{HashMap, LruHashMap, PerCpuArray},
    programs::ProbeContext,
};
use tracer_abi::{
    AsyncioProcess, DEFAULT_MAX_TASKS, DICT_ENTRY_BYTES, DICT_ENTRY_VALUE, DICT_KEYS,
    DICT_KEYS_INDICES, DICT_KEYS_LOG2_INDEX_BYTES, DICT_KEYS_NENTRIES, LINEAGE_OTHER_ROOT,
    LINEAGE_REQUEST, LINEAGE_UNKNOWN, MAX_CONTEXT_DEPTH, MAX_CURRENT_TASKS_ENTRIES,
    MAX_TRACED_PIDS, PROBE_CREATOR_UNREADABLE, PROBE_CREATOR_UNSEEN, PROBE_INHERITED,
    PROBE_OTHER_ROOT, PROBE_OUTCOMES, PROBE_REQUEST_ROOT, PROBE_ROOT_WITHOUT_REQUEST,
    ROOT_NAME_BYTES, TaskKey, TaskLineage, WRITER_LINEAGE_OFF, WRITER_NO_TASK, WRITER_TASK,
    WRITER_TASK_UNSEEN, WRITER_UNREADABLE,
};

use crate::programs::{PENDING_CALLS, count_at, python_thread, read_context_chain, traced_tgid};

/// Probed processes, by tgid; written by user space at attach (and `current_tasks` by the
/// probe's first hit).
#[map]
pub(crate) static ASYNCIO_PROCESSES: HashMap<u32, AsyncioProcess> =
    HashMap::with_max_entries(MAX_TRACED_PIDS, 0);

/// Each task's lineage, by process and address. An LRU sized by user space
/// (`--max-tasks`): a task dies without telling anyone, so the oldest entries go first.
#[map]
static TASK_LINEAGE: LruHashMap<TaskKey, TaskLineage> =
    LruHashMap::with_max_entries(DEFAULT_MAX_TASKS, 0);

/// Per CPU: roots created on it; a root's serial is this count and the CPU's number.
#[map]
static ROOTS_CREATED: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// What each probe hit found (`PROBE_*`), per CPU.
#[map]
static LINEAGE_PROBES: PerCpuArray<u64> = PerCpuArray::with_max_entries(PROBE_OUTCOMES, 0);

/// Bits of a root serial that hold the CPU it was created on.
const CPU_BITS: u32 = 12;

/// What the thread is running, seen from `current_tasks`.
enum Running {
    Task(u64),
    /// No task of the thread's loop is in a step: the loop itself, or a thread without one.
    NoTask,
    Unreadable,
}

#[inline(always)]
fn user_u64(address: u64) -> Option<u64> {
    // SAFETY: the helper checks the address and fails cleanly on a bad one.
    unsafe { bpf_probe_read_user(address as *const u64).ok() }
}

/// The `current_tasks` dict of the process, found from a task's type the first time
/// (`Py_TYPE(task)->ht_module->md_state->current_tasks`, as `_asyncio` itself finds its
/// state), checked to be a dict, and kept.
#[inline(always)]
fn current_tasks(process: *mut AsyncioProcess, task: u64) -> Option<u64> {
    // SAFETY: a map value; the probe is its only kernel-side writer and a stale read only
    // repeats the lookup. Fields are read one by one: the verifier counts every byte a
    // program keeps on its stack.
    unsafe {
        let known = (*process).current_tasks;
        if known != 0 {
            return Some(known);
        }
        let kind = user_u64(task + 8)?;
        let module = user_u64(kind + u64::from((*process).type_module))?;
        let state = user_u64(module + u64::from((*process).module_state))?;
        let dict = user_u64(state + u64::from((*process).state_current_tasks))?;
        if dict == 0 || user_u64(dict + 8)? != (*process).dict_type {
            return None;
        }
        (*process).current_tasks = dict;
        Some(dict)
    }
}

/// The task of `current_tasks` whose context is one of `chain`'s first `links`.
#[inline(always)]
fn running_task(
    task_context: u32,
    dict: u64,
    chain: &[u64; MAX_CONTEXT_DEPTH],
    links: usize,
) -> Running {
    let Some(keys) = user_u64(dict + DICT_KEYS) else {
        return Running::Unreadable;
    };
    // SAFETY: user memory read through the helper.
    let Ok(index_bytes_log2) =
        (unsafe { bpf_probe_read_user((keys + DICT_KEYS_LOG2_INDEX_BYTES) as *const u8) })
    else {
        return Running::Unreadable;
    };
    let Some(entries) = user_u64(keys + DICT_KEYS_NENTRIES) else {
        return Running::Unreadable;
    };
    if entries > u64::from(MAX_CURRENT_TASKS_ENTRIES) || index_bytes_log2 > 32 {
        return Running::Unreadable;
    }
    let first = keys + DICT_KEYS_INDICES + (1u64 << index_bytes_log2);
    for index in 0..MAX_CURRENT_TASKS_ENTRIES as u64 {
        if index >= entries {
            break;
        }
        let Some(task) = user_u64(first + index * DICT_ENTRY_BYTES + DICT_ENTRY_VALUE) else {
            return Running::Unreadable;
        };
        if task == 0 {
            continue; // a deleted entry
        }
        let Some(context) = user_u64(task + u64::from(task_context)) else {
            continue;
        };
        for link in 0..MAX_CONTEXT_DEPTH {
            if link >= links {
                break;
            }
            if context != 0 && chain[link] == context {
                return Running::Task(task);
            }
        }
    }
    Running::NoTask
}

/// The running task of the calling thread, if `chain` (its first `links` contexts) was read.
/// `created` is a task whose type leads to `current_tasks` when it is not known yet.
#[inline(always)]
fn running(
    process: *mut AsyncioProcess,
    created: Option<u64>,
    chain: &[u64; MAX_CONTEXT_DEPTH],
    links: usize,
) -> Running {
    if links == 0 {
        return Running::Unreadable;
    }
    // SAFETY: a map value, read field by field.
    let (known, task_context) = unsafe { ((*process).current_tasks, (*process).task_context) };
    let dict = match (known, created) {
        (0, Some(task)) => match current_tasks(process, task) {
            Some(dict) => dict,
            None => return Running::Unreadable,
        },
        (0, None) => return Running::Unreadable,
        (dict, _) => dict,
    };
    running_task(task_context, dict, chain, links)
}

/// What a write of process `tgid` learns of its writer's lineage: `WRITER_*`, and the
/// running task and its recorded lineage written into `task` and `lineage` (left as they are
/// otherwise). `chain` holds the `links` contexts read for the write's
/// [`tracer_abi::TaskContextEvent`].
#[inline(always)]
pub(crate) fn writer_lineage(
    tgid: u32,
    chain: &[u64; MAX_CONTEXT_DEPTH],
    links: usize,
    task: &mut u64,
    lineage: &mut TaskLineage,
) -> u32 {
    let Some(process) = ASYNCIO_PROCESSES.get_ptr_mut(&tgid) else {
        return WRITER_LINEAGE_OFF;
    };
    match running(process, None, chain, links) {
        Running::Task(running) => {
            *task = running;
            let key = TaskKey {
                tgid,
                _pad: 0,
                task: running,
            };
            // SAFETY: the value is copied out.
            match unsafe { TASK_LINEAGE.get(&key) } {
                Some(found) => {
                    *lineage = *found;
                    WRITER_TASK
                }
                None => WRITER_TASK_UNSEEN,
            }
        }
        Running::NoTask => WRITER_NO_TASK,
        Running::Unreadable => WRITER_UNREADABLE,
    }
}

/// Whether the task's coroutine (the first of `Task.__init__`'s positional arguments) is
/// the server's per-request coroutine, by its qualified name.
#[inline(always)]
fn is_request_root(layout: &AsyncioProcess, args: u64) -> bool {
    // (`layout` is the probe's own copy: the probe runs as a program of its own, with its own
    // stack.)
    if layout.root_name_len == 0 || layout.root_name_len as usize > ROOT_NAME_BYTES {
        return false;
    }
    // A tuple: `ob_size` at 16, the items from 24.
    match user_u64(args + 16) {
        Some(size) if size >= 1 => {}
        _ => return false,
    }
    let Some(coroutine) = user_u64(args + 24) else {
        return false;
    };
    if user_u64(coroutine + 8) != Some(layout.coroutine_type) {
        return false;
    }
    let Some(name) = user_u64(coroutine + u64::from(layout.coroutine_qualname)) else {
        return false;
    };
    if user_u64(name + u64::from(layout.ascii_length)) != Some(u64::from(layout.root_name_len)) {
        return false;
    }
    // SAFETY: user memory read through the helper.
    let Ok(bytes) = (unsafe {
        bpf_probe_read_user((name + u64::from(layout.ascii_data)) as *const [u8; ROOT_NAME_BYTES])
    }) else {
        return false;
    };
    let mut same = true;
    for index in 0..ROOT_NAME_BYTES {
        if index < layout.root_name_len as usize && bytes[index] != layout.root_name[index] {
            same = false;
        }
    }
    same
}

/// A serial no other root of this agent's life has.
#[inline(always)]
fn next_root_serial() -> u64 {
    // SAFETY: a helper with no arguments.
    let cpu = u64::from(unsafe { bpf_get_smp_processor_id() });
    let Some(count) = ROOTS_CREATED.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: a per-CPU value; a program runs to its end on one CPU.
    let serial = unsafe {
        *count += 1;
        *count
    };
    (serial << CPU_BITS) | (cpu & ((1 << CPU_BITS) - 1))
}

/// `_asyncio`'s `Task.__init__(self, args, kwargs)` (the argument-clinic wrapper the type's
/// `tp_init` points at; the implementation is inlined into it): records the new task's
/// lineage before its first step, which for an eager task runs inside this very call.
#[uprobe]
pub fn task_created(ctx: ProbeContext) -> u32 {
    let Some((pid_tgid, tgid)) = traced_tgid() else {
        return 0;
    };
    let Some(process) = ASYNCIO_PROCESSES.get_ptr_mut(&tgid) else {
        return 0;
    };
    let task: u64 = ctx.arg(0).unwrap_or(0);
    let args: u64 = ctx.arg(1).unwrap_or(0);
    if task == 0 {
        return 0;
    }
    // SAFETY: a map value copied out.
    let layout = unsafe { *process };
    let mut chain = [0u64; MAX_CONTEXT_DEPTH];
    let links = match python_thread(pid_tgid) {
        Some(thread) => read_context_chain(&thread, &mut chain).0,
        None => 0,
    };
    let running = running(process, Some(task), &chain, links);
    let lineage = if is_request_root(&layout, args) {
        request_root(pid_tgid, matches!(running, Running::NoTask))
    } else {
        match running {
            Running::Task(creator) => {
                let key = TaskKey {
                    tgid,
                    _pad: 0,
                    task: creator,
                };
                // SAFETY: the value is copied out.
                match unsafe { TASK_LINEAGE.get(&key) }.copied() {
                    Some(lineage) => {
                        count_at(&LINEAGE_PROBES, PROBE_INHERITED);
                        lineage
                    }
                    None => {
                        count_at(&LINEAGE_PROBES, PROBE_CREATOR_UNSEEN);
                        unknown()
                    }
                }
            }
            Running::NoTask => {
                count_at(&LINEAGE_PROBES, PROBE_OTHER_ROOT);
                TaskLineage {
                    origin: next_root_serial(),
                    kind: LINEAGE_OTHER_ROOT,
                    ..TaskLineage::default()
                }
            }
            Running::Unreadable => {
                count_at(&LINEAGE_PROBES, PROBE_CREATOR_UNREADABLE);
                unknown()
            }
        }
    };
    let key = TaskKey {
        tgid,
        _pad: 0,
        task,
    };
    let _ = TASK_LINEAGE.insert(&key, &lineage, BPF_ANY as u64);
    0
}

fn unknown() -> TaskLineage {
    TaskLineage {
        kind: LINEAGE_UNKNOWN,
        ..TaskLineage::default()
    }
}

/// A request root's lineage: born for the inbound request the thread last read, when it is
/// created outside any task (uvicorn creates it while parsing that read's bytes); created
/// inside a task (a pipelined request started when the one before it is answered), its
/// request is not known here.
#[inline(always)]
fn request_root(pid_tgid: u64, outside_tasks: bool) -> TaskLineage {
    let mut lineage = TaskLineage {
        origin: next_root_serial(),
        kind: LINEAGE_REQUEST,
        ..TaskLineage::default()
    };
    // SAFETY: the value is copied out.
    let last = unsafe { PENDING_CALLS.get(&pid_tgid) }.map(|calls| calls.last_read);
    match last {
        Some(read) if outside_tasks && read.conn_id != 0 => {
            lineage.birth_conn_id = read.conn_id;
            lineage.birth_fd = read.fd;
            lineage.birth_responses = read.responses;
            count_at(&LINEAGE_PROBES, PROBE_REQUEST_ROOT);
        }
        _ => count_at(&LINEAGE_PROBES, PROBE_ROOT_WITHOUT_REQUEST),
    }
    lineage
}
