//! Per-version layouts of the CPython structures the tracer reads from outside.
//!
//! Where `_Py_DebugOffsets` exists (3.13+) it is read from the process and must agree with
//! this table where both know a field; it does not know `PyThreadState.context` or any
//! contextvars/HAMT field, so those come only from here. 3.12 has no debug offsets: its walk
//! offsets come only from here.
//!
//! Sources: 3.12 and 3.13 entries are `offsetof` on the headers pyenv installed for 3.12.1
//! and 3.13.0 (`Include/internal/pycore_runtime.h`, `pycore_interp.h`, `pycore_context.h`,
//! `pycore_hamt.h`, `cpython/pystate.h`), and the tests run real interpreters of both. The
//! HAMT node layouts are private to `Python/hamt.c` (`PyObject_VAR_HEAD` then a 32-bit bitmap
//! or hash, pairs from +32; array nodes `PyObject_HEAD` then `a_array[32]`). The 3.14 entry
//! is transcribed from the 3.14 headers (`struct _ts` gained `eval_breaker`, `holds_gil`,
//! `_whence`, `state` and `delete_later`, `critical_section` but kept `context` at +208;
//! `_Py_DebugOffsets` gained `interpreter_state.threads_main`) and is UNTESTED: this machine
//! kind has no 3.14 interpreter. Its debug offsets are still checked against it on every
//! process, so a wrong entry refuses the process instead of misreading it.

/// A CPython version as `PY_VERSION_HEX` encodes it (`0x030D00F0` is 3.13.0 final).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PythonVersion {
    pub major: u8,
    pub minor: u8,
    pub micro: u8,
}

impl PythonVersion {
    pub fn from_hex(hex: u64) -> Self {
        let byte = |shift: u32| u8::try_from((hex >> shift) & 0xff).unwrap_or(u8::MAX);
        Self {
            major: byte(24),
            minor: byte(16),
            micro: byte(8),
        }
    }
}

impl std::fmt::Display for PythonVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.micro)
    }
}

/// The walk `_PyRuntime` → interpreters → thread states, as byte offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalkOffsets {
    /// `_PyRuntimeState.interpreters.head`.
    pub interpreters_head: u64,
    /// `PyInterpreterState.next`.
    pub interpreter_next: u64,
    /// `PyInterpreterState.threads.head` (the newest thread state first).
    pub threads_head: u64,
    /// `PyThreadState.next`.
    pub thread_next: u64,
    /// `PyThreadState.interp`: the back pointer every walked thread state must carry.
    pub thread_interp: u64,
    /// `PyThreadState.native_thread_id` (the kernel's TID, what tracepoints report).
    pub thread_native_id: u64,
}

/// What the kernel will need beyond the walk: the running context and its variables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextOffsets {
    /// `PyThreadState.context`: the contextvars `Context` the thread runs under right now.
    pub thread_context: u64,
    /// `PyContext.ctx_prev`, `PyContext.ctx_vars`.
    pub context_prev: u64,
    pub context_vars: u64,
    /// `PyHamtObject.h_root`, `h_count`.
    pub hamt_root: u64,
    pub hamt_count: u64,
    /// Bitmap node: `ob_size` (2 × entries), the 32-bit bitmap, the key/value pairs.
    pub bitmap_size: u64,
    pub bitmap_bits: u64,
    pub bitmap_pairs: u64,
    /// Array node: `a_array[32]`.
    pub array_children: u64,
    /// Collision node: the key/value pairs.
    pub collision_pairs: u64,
    /// `PyContextVar.var_name`, `var_hash`.
    pub var_name: u64,
    pub var_hash: u64,
    /// Compact ASCII string: `length`, first byte.
    pub ascii_length: u64,
    pub ascii_data: u64,
}

/// What the task-lineage probe reads of `_asyncio` (see `tracer-ebpf/src/lineage.rs`).
/// `asyncio_state` and `TaskObj` are private to `Modules/_asynciomodule.c`: their offsets are
/// read off the machine code of pyenv's 3.12.1 and 3.13.0 builds (`_asyncio__enter_task` loads
/// `md_state` at +32 and `current_tasks` at +48 of it; `_asyncio_Task_get_context` loads
/// `task_context` — which every probed process's own `_asyncio` is checked against, see
/// [`super::asyncio`]); `ht_module` and `cr_qualname` are `offsetof` on the installed headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncioOffsets {
    /// `TaskObj.task_context`.
    pub task_context: u64,
    /// `PyHeapTypeObject.ht_module`.
    pub type_module: u64,
    /// `PyModuleObject.md_state`.
    pub module_state: u64,
    /// `asyncio_state.current_tasks`.
    pub state_current_tasks: u64,
    /// `PyCoroObject.cr_qualname`.
    pub coroutine_qualname: u64,
}

/// Where the walk's fields sit inside `_Py_DebugOffsets` (itself versioned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DebugOffsetsLayout {
    pub free_threaded: u64,
    pub interpreters_head: u64,
    pub interpreter_next: u64,
    pub threads_head: u64,
    pub thread_next: u64,
    pub thread_interp: u64,
    pub thread_native_id: u64,
}

impl DebugOffsetsLayout {
    /// Bytes to read from the start of `_PyRuntime` to see every field above.
    pub fn read_len(&self) -> usize {
        let last = [
            self.free_threaded,
            self.interpreters_head,
            self.threads_head,
        ]
        .into_iter()
        .chain([self.thread_next, self.thread_interp, self.thread_native_id])
        .max()
        .unwrap_or(0);
        usize::try_from(last).map_or(usize::MAX, |l| l + 8)
    }
}

/// What the headers say about the walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderWalk {
    Full(WalkOffsets),
    /// Only `PyThreadState`'s fields (`next`, `interp`, `native_thread_id`): the runtime and
    /// interpreter structs' offsets come from the debug offsets alone.
    ThreadOnly {
        thread_next: u64,
        thread_interp: u64,
        thread_native_id: u64,
    },
}

impl HeaderWalk {
    /// Whether the debug offsets' walk says the same as the headers wherever they know.
    pub fn agrees_with(&self, debug: &WalkOffsets) -> bool {
        match *self {
            Self::Full(headers) => headers == *debug,
            Self::ThreadOnly {
                thread_next,
                thread_interp,
                thread_native_id,
            } => {
                (
                    debug.thread_next,
                    debug.thread_interp,
                    debug.thread_native_id,
                ) == (thread_next, thread_interp, thread_native_id)
            }
        }
    }
}

/// One minor version's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionLayout {
    pub minor: u8,
    pub walk: HeaderWalk,
    pub debug_offsets: Option<DebugOffsetsLayout>,
    pub context: ContextOffsets,
    /// `None`: task lineage is not known for this version (3.14 keeps the running task per
    /// thread and changed `_asyncio`'s state; untested here).
    pub asyncio: Option<AsyncioOffsets>,
}

/// The contextvars and HAMT layouts: unchanged from 3.12 to 3.14 in the default
/// (GIL) build.
const CONTEXT_312_TO_314: ContextOffsets = ContextOffsets {
    thread_context: 208,
    context_prev: 16,
    context_vars: 24,
    hamt_root: 16,
    hamt_count: 32,
    bitmap_size: 16,
    bitmap_bits: 24,
    bitmap_pairs: 32,
    array_children: 16,
    collision_pairs: 32,
    var_name: 16,
    var_hash: 56,
    ascii_length: 16,
    ascii_data: 40,
};

const LAYOUTS: [VersionLayout; 3] = [
    VersionLayout {
        minor: 12,
        walk: HeaderWalk::Full(WalkOffsets {
            interpreters_head: 40,
            interpreter_next: 0,
            threads_head: 72,
            thread_next: 8,
            thread_interp: 16,
            thread_native_id: 144,
        }),
        debug_offsets: None,
        context: CONTEXT_312_TO_314,
        asyncio: Some(AsyncioOffsets {
            task_context: 0x98,
            type_module: 888,
            module_state: 32,
            state_current_tasks: 48,
            coroutine_qualname: 32,
        }),
    },
    VersionLayout {
        minor: 13,
        walk: HeaderWalk::Full(WalkOffsets {
            interpreters_head: 632,
            interpreter_next: 7264,
            threads_head: 7344,
            thread_next: 8,
            thread_interp: 16,
            thread_native_id: 160,
        }),
        debug_offsets: Some(DebugOffsetsLayout {
            free_threaded: 16,
            interpreters_head: 40,
            interpreter_next: 64,
            threads_head: 72,
            thread_next: 168,
            thread_interp: 176,
            thread_native_id: 200,
        }),
        context: CONTEXT_312_TO_314,
        asyncio: Some(AsyncioOffsets {
            task_context: 0x88,
            type_module: 888,
            module_state: 32,
            state_current_tasks: 48,
            coroutine_qualname: 32,
        }),
    },
    VersionLayout {
        minor: 14,
        walk: HeaderWalk::ThreadOnly {
            thread_next: 8,
            thread_interp: 16,
            thread_native_id: 160,
        },
        debug_offsets: Some(DebugOffsetsLayout {
            free_threaded: 16,
            interpreters_head: 40,
            interpreter_next: 64,
            threads_head: 72,
            thread_next: 176,
            thread_interp: 184,
            thread_native_id: 208,
        }),
        context: CONTEXT_312_TO_314,
        asyncio: None,
    },
];

/// The layout of CPython 3.`minor`, if this build knows it.
pub fn layout_for(major: u8, minor: u8) -> Option<&'static VersionLayout> {
    if major != 3 {
        return None;
    }
    LAYOUTS.iter().find(|l| l.minor == minor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_from_py_version_hex() {
        let v = PythonVersion::from_hex(0x030D_00F0);
        assert_eq!((v.major, v.minor, v.micro), (3, 13, 0));
        assert_eq!(PythonVersion::from_hex(0x030C_01F0).to_string(), "3.12.1");
        assert!(PythonVersion::from_hex(0x030C_0100) < PythonVersion::from_hex(0x030D_0000));
    }

    #[test]
    fn known_minors_have_a_layout_and_others_none() {
        assert!(layout_for(3, 12).is_some_and(|l| l.debug_offsets.is_none() && matches!(l.walk, HeaderWalk::Full(_))));
        assert!(layout_for(3, 13).is_some_and(|l| l.debug_offsets.is_some()));
        assert!(layout_for(3, 14).is_some_and(|l| l.debug_offsets.is_some()));
        for (major, minor) in [(3, 11), (3, 15), (2, 7), (4, 13)] {
            assert_eq!(layout_for(major, minor), None, "{major}.{minor}");
        }
    }

    /// CAUSALITY.md's measured 3.13.0 offsets, taken independently of the header table.
    #[test]
    fn the_313_entry_matches_what_was_measured() {
        let l = layout_for(3, 13).expect("3.13 is known");
        assert_eq!(
            (l.context.thread_context, l.context.context_prev),
            (208, 16)
        );
        assert_eq!((l.context.context_vars, l.context.hamt_root), (24, 16));
        assert_eq!((l.context.var_name, l.context.var_hash), (16, 56));
        assert_eq!(l.debug_offsets.map(|d| d.read_len()), Some(208));
    }
}
