//! The interpreter's ELF file: where `_PyRuntime` and `Py_Version` sit, and how the file's
//! addresses map onto the process's.

use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol};

use super::maps::Mapping;

/// A symbol's link-time address and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Symbol {
    pub address: u64,
    pub size: u64,
}

/// What the interpreter's file says about its runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterpreterSymbols {
    /// `_PyRuntime`, the one global all runtime state hangs from.
    pub runtime: Symbol,
    /// `Py_Version` (3.11+): the build's `PY_VERSION_HEX`, read from memory to cross-check the
    /// soname.
    pub version: Option<Symbol>,
    /// `PyContext_Type` (public C API data): the type every contextvars `Context` object
    /// points at, which the kernel's context walk checks each link against.
    pub context_type: Option<Symbol>,
    /// `PyDict_Type` and `PyCoro_Type`: what the task-lineage probe checks `current_tasks`
    /// and a new task's coroutine against.
    pub dict_type: Option<Symbol>,
    pub coroutine_type: Option<Symbol>,
    /// The file's loadable segments as (link address, file offset, file size): with a
    /// mapping's file offset they give the load bias.
    segments: Vec<(u64, u64, u64)>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ElfProblem {
    #[error("not an ELF file this build can parse: {0}")]
    Unparsable(String),
    #[error("no _PyRuntime symbol")]
    NoRuntimeSymbol,
    #[error("_PyRuntime is not the start of the .PyRuntime section")]
    SectionMismatch,
}

/// Reads the symbols from the dynamic table first (shared libpython exports them; it survives
/// `strip`), then the full table (a static interpreter that was not stripped).
pub fn read_symbols(data: &[u8]) -> Result<InterpreterSymbols, ElfProblem> {
    let file = object::File::parse(data).map_err(|e| ElfProblem::Unparsable(e.to_string()))?;
    let find = |name: &str| {
        file.dynamic_symbols()
            .chain(file.symbols())
            .find(|s| s.is_definition() && s.name() == Ok(name))
            .map(|s| Symbol {
                address: s.address(),
                size: s.size(),
            })
    };
    let runtime = find("_PyRuntime").ok_or(ElfProblem::NoRuntimeSymbol)?;
    // Where the section exists (3.12 and later put `_PyRuntime` in its own `.PyRuntime`
    // section so debuggers find it without symbols), it must agree with the symbol.
    if file
        .section_by_name(".PyRuntime")
        .is_some_and(|section| section.address() != runtime.address)
    {
        return Err(ElfProblem::SectionMismatch);
    }
    let segments = file
        .segments()
        .map(|s| {
            let (offset, size) = s.file_range();
            (s.address(), offset, size)
        })
        .collect();
    Ok(InterpreterSymbols {
        runtime,
        version: find("Py_Version"),
        context_type: find("PyContext_Type"),
        dict_type: find("PyDict_Type"),
        coroutine_type: find("PyCoro_Type"),
        segments,
    })
}

impl InterpreterSymbols {
    /// The address in the process of a link-time address in this file: the mapping that holds
    /// the address's file bytes, shifted by that mapping's bias. `None` when no mapping holds
    /// it (then nothing is read).
    pub fn runtime_address_of(&self, link_address: u64, mappings: &[Mapping]) -> Option<u64> {
        // Only file-backed bytes: `_PyRuntime` is initialised data, never in a zero-filled
        // tail (.bss) that no file offset names.
        let &(seg_address, seg_offset, _) = self
            .segments
            .iter()
            .find(|(a, _, size)| link_address >= *a && link_address - *a < *size)?;
        let file_offset = seg_offset.checked_add(link_address - seg_address)?;
        mappings.iter().find_map(|m| {
            let within = file_offset.checked_sub(m.file_offset)?;
            (within < m.end - m.start).then(|| m.start + within)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn symbols(segments: Vec<(u64, u64, u64)>) -> InterpreterSymbols {
        InterpreterSymbols {
            runtime: Symbol {
                address: 0,
                size: 0,
            },
            version: None,
            context_type: None,
            dict_type: None,
            coroutine_type: None,
            segments,
        }
    }

    fn mapping(start: u64, end: u64, file_offset: u64) -> Mapping {
        Mapping {
            start,
            end,
            file_offset,
            path: PathBuf::from("/lib/libpython3.13.so.1.0"),
        }
    }

    #[test]
    fn the_bias_comes_from_the_mapping_of_the_address_file_bytes() {
        // The layout of pyenv's libpython3.13.so.1.0: `.PyRuntime` at 0x5294c0, file offset
        // 0x5284c0, in the RW segment that starts a page below.
        let elf = symbols(vec![(0, 0, 0x853c8), (0x528000, 0x527000, 0x60000)]);
        let maps = [
            mapping(0x7f00_0000_0000, 0x7f00_0008_6000, 0),
            mapping(0x7f00_0052_8000, 0x7f00_0058_8000, 0x527000),
        ];
        assert_eq!(
            elf.runtime_address_of(0x5294c0, &maps),
            Some(0x7f00_0052_94c0)
        );
        assert_eq!(elf.runtime_address_of(0x100, &maps), Some(0x7f00_0000_0100));
        assert_eq!(
            elf.runtime_address_of(0x9000_0000, &maps),
            None,
            "in no segment"
        );
        assert_eq!(
            elf.runtime_address_of(0x5294c0, &maps[..1]),
            None,
            "segment not mapped"
        );
    }

    #[test]
    fn garbage_is_not_an_interpreter() {
        assert!(matches!(
            read_symbols(b"not an elf"),
            Err(ElfProblem::Unparsable(_))
        ));
    }

    #[test]
    fn an_elf_without_python_has_no_runtime_symbol() {
        let me = std::fs::read("/proc/self/exe").expect("our own executable");
        assert_eq!(read_symbols(&me), Err(ElfProblem::NoRuntimeSymbol));
    }
}
