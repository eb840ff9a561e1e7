//! Where task creation is probed in a CPython process, and what the kernel's task-lineage
//! probe needs to know about it (`tracer-ebpf/src/lineage.rs`): the file that holds
//! `_asyncio` (its extension module, or the interpreter when built in), and the layout of
//! what the probe reads, checked against the process's own machine code before it is used.

use std::path::{Path, PathBuf};

use object::{Object, ObjectSection, ObjectSymbol};
use tracer_abi::{AsyncioProcess, ROOT_NAME_BYTES};

use super::maps::parse_line;
use super::{PythonRuntime, PythonVersion};

/// `_asyncio`'s `Task.__init__`: the argument-clinic wrapper `tp_init` points at, a local
/// symbol of the module (its implementation is inlined into it in 3.12 and 3.13).
pub const TASK_INIT_SYMBOL: &str = "_asyncio_Task___init__";
/// `Task.get_context()`: one load of `task_context` and a return, whose displacement is
/// compared with the table.
const TASK_GET_CONTEXT_SYMBOL: &str = "_asyncio_Task_get_context";
/// The coroutine uvicorn runs each inbound request in (`uvicorn/protocols/http/*_impl.py`,
/// both HTTP implementations): the task created for it is the request's root.
pub const REQUEST_ROOT_QUALNAME: &str = "RequestResponseCycle.run_asgi";

/// Where and how to probe one process's task creations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AsyncioSite {
    /// The file as the process names it (for messages).
    pub path: PathBuf,
    /// Whether `_asyncio` is built into the interpreter rather than its own module.
    pub built_in: bool,
    pub layout: AsyncioProcess,
}

/// Why task lineage is off for a process.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum LineageOff {
    #[error("asyncio is not imported yet (no _asyncio module mapped)")]
    NotImported,
    #[error("CPython {0}: task lineage knows the task layout of CPython 3.12 and 3.13 only")]
    UnknownVersion(PythonVersion),
    #[error(
        "{0} has no {TASK_INIT_SYMBOL} symbol (stripped?): use an interpreter built with its \
         symbols (pyenv's and python.org's keep them)"
    )]
    NoTaskInit(PathBuf),
    #[error(
        "{path}: Task.task_context is at {found:#x} in its machine code, not at {table:#x} as \
         this build's table for CPython {version} says: not a layout to guess at"
    )]
    LayoutMismatch {
        path: PathBuf,
        version: PythonVersion,
        found: u64,
        table: u64,
    },
    #[error("{path}: {TASK_GET_CONTEXT_SYMBOL} is missing or not a single load: {problem}")]
    Unconfirmed {
        path: PathBuf,
        problem: &'static str,
    },
    #[error("the interpreter does not export {0}, or it is not what its name says")]
    MissingType(&'static str),
    #[error("{path}: {problem}")]
    Elf { path: PathBuf, problem: String },
    #[error("the kernel refused the probe: {0}")]
    Attach(String),
    #[error("its Python runtime is not read (the log line on its task contexts says why)")]
    RuntimeNotRead,
}

impl LineageOff {
    /// The reason's name on the counter of processes whose lineage is off.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotImported => "not_imported",
            Self::UnknownVersion(_) => "unknown_version",
            Self::NoTaskInit(_) => "no_symbols",
            Self::LayoutMismatch { .. } => "layout_mismatch",
            Self::Unconfirmed { .. } => "layout_unconfirmed",
            Self::MissingType(_) => "missing_type",
            Self::Elf { .. } => "elf",
            Self::Attach(_) => "attach_failed",
            Self::RuntimeNotRead => "runtime_not_read",
        }
    }

    /// Whether another look later may find something else.
    pub fn is_final(&self) -> bool {
        !matches!(self, Self::NotImported)
    }
}

/// The `_asyncio` extension module a process has mapped, if any.
fn mapped_asyncio_module(maps: &str) -> Option<PathBuf> {
    maps.lines().filter_map(parse_line).find_map(|mapping| {
        let name = mapping.path.file_name()?.to_str()?;
        (name.starts_with("_asyncio.") && name.ends_with(".so")).then_some(mapping.path)
    })
}

/// Finds where process `pid` creates its asyncio tasks and what the probe must know there.
/// `read_file` reads a file as the process names it (through its root).
pub fn asyncio_site(
    maps: &str,
    runtime: &PythonRuntime,
    read_file: impl Fn(&Path) -> Option<Vec<u8>>,
) -> Result<AsyncioSite, LineageOff> {
    let offsets = runtime
        .asyncio
        .ok_or(LineageOff::UnknownVersion(runtime.version))?;
    let dict_type = runtime
        .dict_type
        .ok_or(LineageOff::MissingType("PyDict_Type"))?;
    let coroutine_type = runtime
        .coroutine_type
        .ok_or(LineageOff::MissingType("PyCoro_Type"))?;
    let (path, built_in) = match mapped_asyncio_module(maps) {
        Some(path) => (path, false),
        None => (runtime.library.clone(), true),
    };
    let bytes = read_file(&path).ok_or_else(|| LineageOff::Elf {
        path: path.clone(),
        problem: "unreadable".to_string(),
    })?;
    let task_context = match task_context_in(&bytes, &path) {
        // Not built in, and no module mapped yet: asyncio has not been imported.
        Err(LineageOff::NoTaskInit(_)) if built_in => return Err(LineageOff::NotImported),
        other => other?,
    };
    if task_context != offsets.task_context {
        return Err(LineageOff::LayoutMismatch {
            path,
            version: runtime.version,
            found: task_context,
            table: offsets.task_context,
        });
    }
    let narrow = |value: u64| u32::try_from(value).unwrap_or(u32::MAX);
    let mut root_name = [0u8; ROOT_NAME_BYTES];
    root_name[..REQUEST_ROOT_QUALNAME.len()].copy_from_slice(REQUEST_ROOT_QUALNAME.as_bytes());
    let layout = AsyncioProcess {
        current_tasks: 0,
        dict_type,
        coroutine_type,
        task_context: narrow(offsets.task_context),
        type_module: narrow(offsets.type_module),
        module_state: narrow(offsets.module_state),
        state_current_tasks: narrow(offsets.state_current_tasks),
        coroutine_qualname: narrow(offsets.coroutine_qualname),
        ascii_length: narrow(runtime.context.ascii_length),
        ascii_data: narrow(runtime.context.ascii_data),
        root_name_len: narrow(REQUEST_ROOT_QUALNAME.len() as u64),
        root_name,
    };
    Ok(AsyncioSite {
        path,
        built_in,
        layout,
    })
}

const _: () = assert!(REQUEST_ROOT_QUALNAME.len() <= ROOT_NAME_BYTES);

/// `TaskObj.task_context` as the file's own `Task.get_context()` loads it, after checking the
/// file defines `Task.__init__`: its first instruction is `mov disp(%rdi), %reg` (REX.W 8B
/// with a displacement off `%rdi`, the first argument).
fn task_context_in(elf: &[u8], path: &Path) -> Result<u64, LineageOff> {
    let file = object::File::parse(elf).map_err(|error| LineageOff::Elf {
        path: path.to_path_buf(),
        problem: error.to_string(),
    })?;
    let find = |name: &str| {
        file.symbols()
            .chain(file.dynamic_symbols())
            .find(|symbol| symbol.is_definition() && symbol.name() == Ok(name))
    };
    if find(TASK_INIT_SYMBOL).is_none() {
        return Err(LineageOff::NoTaskInit(path.to_path_buf()));
    }
    let unconfirmed = |problem| LineageOff::Unconfirmed {
        path: path.to_path_buf(),
        problem,
    };
    let getter = find(TASK_GET_CONTEXT_SYMBOL).ok_or_else(|| unconfirmed("no symbol"))?;
    let section = getter
        .section_index()
        .and_then(|index| file.section_by_index(index).ok())
        .ok_or_else(|| unconfirmed("no section"))?;
    let data = section
        .data()
        .map_err(|_| unconfirmed("unreadable section"))?;
    let start = getter
        .address()
        .checked_sub(section.address())
        .and_then(|at| usize::try_from(at).ok())
        .ok_or_else(|| unconfirmed("outside its section"))?;
    let code = data
        .get(start..start.saturating_add(7))
        .ok_or_else(|| unconfirmed("outside its section"))?;
    load_displacement(code).ok_or_else(|| unconfirmed("not a load off the first argument"))
}

/// The displacement of `mov disp(%rdi), %r64` at the start of `code`.
fn load_displacement(code: &[u8]) -> Option<u64> {
    let [rex, 0x8b, modrm, rest @ ..] = code else {
        return None;
    };
    // REX.W, maybe REX.R (a destination register r8-r15); no index or base extension.
    if rex & 0xfb != 0x48 || modrm & 0x07 != 0x07 {
        return None;
    }
    match modrm >> 6 {
        0b01 => rest
            .first()
            .and_then(|disp| u64::try_from(i8::from_le_bytes([*disp])).ok()),
        0b10 => {
            let disp = i32::from_le_bytes(rest.get(..4)?.try_into().ok()?);
            u64::try_from(disp).ok()
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_task_context_load_is_read_off_the_getter() {
        // pyenv's 3.13.0 and 3.12.1: `mov 0x88(%rdi),%rdx`, `mov 0x98(%rdi),%rdx`.
        assert_eq!(
            load_displacement(&[0x48, 0x8b, 0x97, 0x88, 0, 0, 0]),
            Some(0x88)
        );
        assert_eq!(
            load_displacement(&[0x48, 0x8b, 0x97, 0x98, 0, 0, 0]),
            Some(0x98)
        );
        // The short form, another destination, r8-r15.
        assert_eq!(load_displacement(&[0x48, 0x8b, 0x47, 0x40]), Some(0x40));
        assert_eq!(
            load_displacement(&[0x4c, 0x8b, 0x87, 0x10, 1, 0, 0]),
            Some(0x110)
        );
        // Off another register, a store, a negative displacement, no displacement.
        assert_eq!(load_displacement(&[0x48, 0x8b, 0x96, 0x88, 0, 0, 0]), None);
        assert_eq!(load_displacement(&[0x48, 0x89, 0x97, 0x88, 0, 0, 0]), None);
        assert_eq!(
            load_displacement(&[0x48, 0x8b, 0x97, 0xf8, 0xff, 0xff, 0xff]),
            None
        );
        assert_eq!(load_displacement(&[0x48, 0x8b, 0x17]), None);
        assert_eq!(load_displacement(&[0x48]), None);
    }

    #[test]
    fn the_asyncio_module_is_found_among_the_mappings() {
        let maps = "\
7f0000000000-7f0000001000 r--p 00000000 fd:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000002000-7f0000003000 r-xp 00001000 fd:01 2 /root/.pyenv/versions/3.13.0/lib/python3.13/lib-dynload/_asyncio.cpython-313-x86_64-linux-gnu.so
";
        assert_eq!(
            mapped_asyncio_module(maps),
            Some(PathBuf::from(
                "/root/.pyenv/versions/3.13.0/lib/python3.13/lib-dynload/_asyncio.cpython-313-x86_64-linux-gnu.so"
            ))
        );
        assert_eq!(
            mapped_asyncio_module(maps.lines().next().unwrap_or_default()),
            None
        );
    }
}
