//! CPython in a traced process, seen from outside: which interpreter it runs, where its
//! runtime state is, and the offsets a reader of that state needs (issue #13, step 1).
//!
//! Nothing here stops or writes to the process: `/proc/PID/maps`, the interpreter's ELF file
//! and bounded `process_vm_readv` reads. Every answer is checked twice before it is believed
//! (soname against `Py_Version` against the debug offsets' version; the debug offsets against
//! the header table; every walked thread state's back pointer to its interpreter), and any
//! disagreement is a typed [`RuntimeOff`] reason: an interpreter this build does not know is
//! turned off for that process, never misread.

pub mod asyncio;
mod elf;
mod layout;
mod maps;
mod memory;
#[cfg(test)]
mod real_interpreters;
mod threads;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

pub use layout::{ContextOffsets, PythonVersion, WalkOffsets};
pub use memory::{Memory, ProcessMemory, ReadError};
pub use threads::host_tids;

use layout::{DebugOffsetsLayout, VersionLayout};
use maps::{Interpreter, MapsProblem};

/// `_Py_DebugOffsets.cookie`, the first bytes of `_PyRuntime` in 3.13 and later.
const DEBUG_COOKIE: &[u8; 8] = b"xdebugpy";
/// Walks stop here: a process with more is refused rather than half-read.
pub const MAX_INTERPRETERS: usize = 64;
pub const MAX_THREADS: usize = 4096;
/// An interpreter's ELF file larger than this is not read (libpython is ~30 MiB).
const MAX_ELF_BYTES: u64 = 1 << 30;

/// How the interpreter is linked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Linkage {
    /// `libpython3.X.so` mapped into the process.
    Shared,
    /// The executable carries the runtime itself.
    Static,
}

/// Where the walk's offsets were taken from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WalkSource {
    /// `_Py_DebugOffsets` in the process, confirmed by the header table.
    DebugOffsets,
    /// The header table alone (3.12 has no debug offsets).
    HeaderTable,
}

/// A CPython runtime found in a process, with what reading it needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PythonRuntime {
    pub version: PythonVersion,
    pub linkage: Linkage,
    /// The file that holds `_PyRuntime` (libpython, or the executable when static).
    pub library: PathBuf,
    /// `_PyRuntime`'s address in the process.
    pub runtime_address: u64,
    pub walk: WalkOffsets,
    pub walk_source: WalkSource,
    pub context: ContextOffsets,
    /// `PyContext_Type`'s address in the process, checked by its `tp_name`; `None` when the
    /// interpreter's file does not export it (then the kernel cannot check what it reads,
    /// and reads no context).
    pub context_type: Option<u64>,
    /// `PyDict_Type` and `PyCoro_Type` in the process, each checked by its `tp_name`: the
    /// task-lineage probe's checks (`None`: not exported, or not what its name says).
    pub dict_type: Option<u64>,
    pub coroutine_type: Option<u64>,
    /// What the task-lineage probe reads of `_asyncio`, when this version's is known.
    pub asyncio: Option<layout::AsyncioOffsets>,
}

/// One thread state found by the walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadState {
    pub address: u64,
    pub interpreter: u64,
    /// The kernel's TID of the thread that created the state.
    pub native_thread_id: u32,
}

/// Why a process's Python runtime is not used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RuntimeOff {
    #[error("not a CPython process: no libpython mapped and no _PyRuntime in the executable")]
    NotPython,
    #[error("process {0} is gone or /proc/{0} is unreadable: run the agent as root")]
    Unreadable(u32),
    #[error("two different libpython libraries are mapped: not a layout to guess at")]
    SeveralLibpythons,
    #[error("{0} has no _PyRuntime symbol (stripped?): install the interpreter's unstripped build")]
    NoSymbols(PathBuf),
    #[error("{path}: {problem}")]
    Elf { path: PathBuf, problem: String },
    #[error("_PyRuntime's address is in no mapping of the library: the process may be exiting")]
    NotMapped,
    #[error("no version found: no Py_Version symbol and no debug offsets (CPython before 3.11?)")]
    NoVersion,
    #[error("CPython {0}.{1}.{2} is not known to this build: supported are 3.12, 3.13, 3.14")]
    UnknownVersion(u8, u8, u8),
    #[error(
        "versions disagree (soname {soname:?}, Py_Version {py_version:?}, debug offsets {debug:?})"
    )]
    VersionMismatch {
        soname: Option<(u8, u8)>,
        py_version: Option<PythonVersion>,
        debug: Option<PythonVersion>,
    },
    #[error("_PyRuntime does not start with the xdebugpy cookie its version must have")]
    CookieMismatch,
    #[error("a free-threaded (no-GIL) build: its layouts are not in this build's table")]
    FreeThreaded,
    #[error("the runtime's layout disagrees with the table for its version: {0}")]
    LayoutMismatch(&'static str),
    #[error("reading the runtime failed: {0}")]
    Read(#[from] ReadError),
    #[error("the interpreter does not export {0}: its task contexts cannot be checked")]
    MissingSymbol(&'static str),
}

impl RuntimeOff {
    /// The reason's name on the counter of processes whose runtime is off.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotPython => "not_python",
            Self::Unreadable(_) => "unreadable",
            Self::SeveralLibpythons => "several_libpythons",
            Self::NoSymbols(_) => "no_symbols",
            Self::Elf { .. } => "elf",
            Self::NotMapped => "not_mapped",
            Self::NoVersion => "no_version",
            Self::UnknownVersion(..) => "unknown_version",
            Self::VersionMismatch { .. } => "version_mismatch",
            Self::CookieMismatch => "cookie_mismatch",
            Self::FreeThreaded => "free_threaded",
            Self::LayoutMismatch(_) => "layout_mismatch",
            Self::Read(_) => "read_failed",
            Self::MissingSymbol(_) => "missing_symbol",
        }
    }
}

/// Executables already found to hold no CPython runtime, by file identity. Telling a static
/// executable from a static Python means reading its whole ELF file, and a CLI agent's
/// helpers run the same few programs hundreds of times per rollout (the Codex CLI's binary is
/// ~300 MB): each file is read once. A file's identity includes its size and modification
/// time, so a file rewritten in place is read again.
#[derive(Debug, Default)]
pub struct NotPythonFiles(HashSet<FileIdentity>);

/// Device, inode, size, modification time (seconds, nanoseconds).
type FileIdentity = (u64, u64, u64, i64, i64);

/// Past this many distinct executables the set starts over (a cache: forgetting costs a read).
const MAX_NOT_PYTHON_FILES: usize = 4096;

impl NotPythonFiles {
    fn identity(path: &Path) -> Option<FileIdentity> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some((m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
    }

    fn remember(&mut self, file: FileIdentity) {
        if self.0.len() >= MAX_NOT_PYTHON_FILES {
            self.0.clear();
        }
        self.0.insert(file);
    }
}

/// Finds and checks the CPython runtime of process `pid`.
pub fn inspect(pid: u32) -> Result<PythonRuntime, RuntimeOff> {
    inspect_remembering(pid, &mut NotPythonFiles::default())
}

/// [`inspect`], skipping (and adding to `not_python`) executables known to hold no runtime.
pub fn inspect_remembering(
    pid: u32,
    not_python: &mut NotPythonFiles,
) -> Result<PythonRuntime, RuntimeOff> {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let maps =
        std::fs::read_to_string(proc.join("maps")).map_err(|_| RuntimeOff::Unreadable(pid))?;
    let exe = std::fs::read_link(proc.join("exe")).ok();
    let interpreter = maps::find_interpreter(&maps, exe.as_deref()).map_err(|p| match p {
        MapsProblem::SeveralLibpythons => RuntimeOff::SeveralLibpythons,
        MapsProblem::NoExecutable => RuntimeOff::NotPython,
    })?;
    // Through the process's root, so a containerised process's own files are read.
    let in_root = |path: &Path| {
        proc.join("root")
            .join(path.strip_prefix("/").unwrap_or(path))
    };
    // Only an executable can be no Python at all: a mapped libpython without the runtime
    // symbol is a stripped library, reported as such.
    let executable = match &interpreter {
        Interpreter::Executable { path, .. } => NotPythonFiles::identity(&in_root(path)),
        Interpreter::Shared { .. } => None,
    };
    if executable.is_some_and(|file| not_python.0.contains(&file)) {
        return Err(RuntimeOff::NotPython);
    }
    let memory = ProcessMemory::new(pid).ok_or(RuntimeOff::Unreadable(pid))?;
    let read_elf = |path: &Path| -> Result<Vec<u8>, RuntimeOff> {
        let in_root = in_root(path);
        let too_big = std::fs::metadata(&in_root).map_or(true, |m| m.len() > MAX_ELF_BYTES);
        let bytes = if too_big {
            None
        } else {
            std::fs::read(&in_root).ok()
        };
        bytes.ok_or_else(|| RuntimeOff::Elf {
            path: path.to_path_buf(),
            problem: format!("unreadable or over {MAX_ELF_BYTES} bytes"),
        })
    };
    let found = inspect_interpreter(&interpreter, read_elf, &memory);
    if let (Err(RuntimeOff::NotPython), Some(file)) = (&found, executable) {
        not_python.remember(file);
    }
    found
}

/// The checks of [`inspect`], on any source of files and memory.
fn inspect_interpreter(
    interpreter: &Interpreter,
    read_elf: impl Fn(&Path) -> Result<Vec<u8>, RuntimeOff>,
    memory: &impl Memory,
) -> Result<PythonRuntime, RuntimeOff> {
    let (path, mappings, soname, linkage) = match interpreter {
        Interpreter::Shared {
            path,
            soname_version,
            mappings,
        } => (path, mappings, Some(*soname_version), Linkage::Shared),
        Interpreter::Executable { path, mappings } => (path, mappings, None, Linkage::Static),
    };
    let bytes = read_elf(path)?;
    let symbols = elf::read_symbols(&bytes).map_err(|problem| match (problem, linkage) {
        (elf::ElfProblem::NoRuntimeSymbol, Linkage::Static) => RuntimeOff::NotPython,
        (elf::ElfProblem::NoRuntimeSymbol, Linkage::Shared) => RuntimeOff::NoSymbols(path.clone()),
        (problem, _) => RuntimeOff::Elf {
            path: path.clone(),
            problem: problem.to_string(),
        },
    })?;
    let address_of = |link: u64| {
        symbols
            .runtime_address_of(link, mappings)
            .ok_or(RuntimeOff::NotMapped)
    };
    let runtime_address = address_of(symbols.runtime.address)?;
    let py_version = match symbols.version {
        Some(symbol) => Some(PythonVersion::from_hex(
            memory.read_u64(address_of(symbol.address)?)?,
        )),
        None => None,
    };
    let head = memory.read_bytes(runtime_address, 16)?;
    let debug_version = (head.get(..8) == Some(DEBUG_COOKIE.as_slice()))
        .then(|| {
            head.get(8..16)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_ne_bytes)
        })
        .flatten()
        .map(PythonVersion::from_hex);
    let version = agreed_version(soname, py_version, debug_version)?;
    let layout = layout::layout_for(version.major, version.minor).ok_or(
        RuntimeOff::UnknownVersion(version.major, version.minor, version.micro),
    )?;
    let (walk, walk_source) =
        resolve_walk(layout, debug_version.is_some(), runtime_address, memory)?;
    if walk.interpreters_head.saturating_add(8) > symbols.runtime.size {
        return Err(RuntimeOff::LayoutMismatch(
            "interpreters head outside _PyRuntime",
        ));
    }
    let context_type = match symbols.context_type {
        Some(symbol) => Some(threads::checked_context_type(
            address_of(symbol.address)?,
            memory,
        )?),
        None => None,
    };
    // Only task lineage needs these: one that cannot be checked turns lineage off, not the
    // context reads.
    let checked_type = |symbol: Option<elf::Symbol>, name: &[u8]| {
        let address = address_of(symbol?.address).ok()?;
        threads::checked_type(address, name, memory).ok()
    };
    let runtime = PythonRuntime {
        version,
        linkage,
        library: path.clone(),
        runtime_address,
        walk,
        walk_source,
        context: layout.context,
        context_type,
        dict_type: checked_type(symbols.dict_type, b"dict\0"),
        coroutine_type: checked_type(symbols.coroutine_type, b"coroutine\0"),
        asyncio: layout.asyncio,
    };
    // A walk that fails now would fail in the kernel too: refuse the process up front.
    if runtime.thread_states(memory)?.is_empty() {
        return Err(RuntimeOff::LayoutMismatch("no thread state"));
    }
    Ok(runtime)
}

/// The version every source names, or the disagreement.
fn agreed_version(
    soname: Option<(u8, u8)>,
    py_version: Option<PythonVersion>,
    debug: Option<PythonVersion>,
) -> Result<PythonVersion, RuntimeOff> {
    let mismatch = || RuntimeOff::VersionMismatch {
        soname,
        py_version,
        debug,
    };
    let version = debug.or(py_version).ok_or(RuntimeOff::NoVersion)?;
    if py_version.is_some_and(|v| v != version) {
        return Err(mismatch());
    }
    if soname.is_some_and(|s| s != (version.major, version.minor)) {
        return Err(mismatch());
    }
    Ok(version)
}

/// The walk's offsets: from the debug offsets where the version has them (and they must agree
/// with the headers), else from the header table.
fn resolve_walk(
    layout: &VersionLayout,
    has_cookie: bool,
    runtime_address: u64,
    memory: &impl Memory,
) -> Result<(WalkOffsets, WalkSource), RuntimeOff> {
    let Some(debug_layout) = layout.debug_offsets else {
        return match layout.walk {
            layout::HeaderWalk::Full(walk) => Ok((walk, WalkSource::HeaderTable)),
            layout::HeaderWalk::ThreadOnly { .. } => Err(RuntimeOff::LayoutMismatch(
                "no debug offsets and no full header walk",
            )),
        };
    };
    if !has_cookie {
        return Err(RuntimeOff::CookieMismatch);
    }
    let walk = read_debug_walk(&debug_layout, runtime_address, memory)?;
    if !layout.walk.agrees_with(&walk) {
        return Err(RuntimeOff::LayoutMismatch(
            "debug offsets differ from the header table",
        ));
    }
    Ok((walk, WalkSource::DebugOffsets))
}

fn read_debug_walk(
    at: &DebugOffsetsLayout,
    runtime_address: u64,
    memory: &impl Memory,
) -> Result<WalkOffsets, RuntimeOff> {
    let bytes = memory.read_bytes(runtime_address, at.read_len())?;
    let field = |offset: u64| -> Result<u64, RuntimeOff> {
        let start = usize::try_from(offset).map_err(|_| RuntimeOff::LayoutMismatch("offset"))?;
        bytes
            .get(start..start + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_ne_bytes)
            .ok_or(RuntimeOff::LayoutMismatch(
                "debug offsets shorter than their layout",
            ))
    };
    if field(at.free_threaded)? != 0 {
        return Err(RuntimeOff::FreeThreaded);
    }
    Ok(WalkOffsets {
        interpreters_head: field(at.interpreters_head)?,
        interpreter_next: field(at.interpreter_next)?,
        threads_head: field(at.threads_head)?,
        thread_next: field(at.thread_next)?,
        thread_interp: field(at.thread_interp)?,
        thread_native_id: field(at.thread_native_id)?,
    })
}

impl PythonRuntime {
    /// Every thread state of every interpreter, newest first per interpreter. Bounded by
    /// [`MAX_INTERPRETERS`] and [`MAX_THREADS`]; a thread state whose `interp` does not point
    /// back at its interpreter means the layout or the read is wrong, and ends the walk with
    /// an error rather than a guess.
    pub fn thread_states(&self, memory: &impl Memory) -> Result<Vec<ThreadState>, RuntimeOff> {
        let w = &self.walk;
        let mut states = Vec::new();
        let mut interpreter =
            memory.read_pointer(at(self.runtime_address, w.interpreters_head)?)?;
        for _ in 0..MAX_INTERPRETERS {
            let mut state = memory.read_u64(at(interpreter, w.threads_head)?)?;
            while state != 0 {
                if states.len() == MAX_THREADS {
                    return Err(RuntimeOff::LayoutMismatch(
                        "more thread states than the walk's bound",
                    ));
                }
                if memory.read_u64(at(state, w.thread_interp)?)? != interpreter {
                    return Err(RuntimeOff::LayoutMismatch(
                        "thread state not linked to its interpreter",
                    ));
                }
                let native = memory.read_u64(at(state, w.thread_native_id)?)?;
                let native_thread_id = u32::try_from(native)
                    .map_err(|_| RuntimeOff::LayoutMismatch("native thread id over 32 bits"))?;
                states.push(ThreadState {
                    address: state,
                    interpreter,
                    native_thread_id,
                });
                state = memory.read_u64(at(state, w.thread_next)?)?;
            }
            interpreter = memory.read_u64(at(interpreter, w.interpreter_next)?)?;
            if interpreter == 0 {
                return Ok(states);
            }
        }
        Err(RuntimeOff::LayoutMismatch(
            "more interpreters than the walk's bound",
        ))
    }
}

/// A field's address; an overflow is a corrupt pointer, refused like any failed read.
fn at(base: u64, offset: u64) -> Result<u64, ReadError> {
    base.checked_add(offset).ok_or(ReadError::Overflow(base))
}

#[cfg(test)]
mod tests;

/// A recognised runtime for tests elsewhere (the agent's context reads).
#[cfg(test)]
pub mod testing {
    use super::*;

    /// CPython 3.13.0 with its header layout, `_PyRuntime` at `runtime_address`.
    pub fn runtime_313(runtime_address: u64, context_type: u64) -> PythonRuntime {
        let layout = layout::layout_for(3, 13).expect("known");
        let layout::HeaderWalk::Full(walk) = layout.walk else {
            panic!("3.13 has a full walk")
        };
        PythonRuntime {
            version: PythonVersion {
                major: 3,
                minor: 13,
                micro: 0,
            },
            linkage: Linkage::Shared,
            library: PathBuf::from("/lib/libpython3.13.so.1.0"),
            runtime_address,
            walk,
            walk_source: WalkSource::DebugOffsets,
            context: layout.context,
            context_type: Some(context_type),
            dict_type: None,
            coroutine_type: None,
            asyncio: layout.asyncio,
        }
    }
}
