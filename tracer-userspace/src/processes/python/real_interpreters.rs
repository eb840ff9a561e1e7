//! The module against real interpreters: each prints, from inside, `_PyRuntime`'s address
//! and its main thread's native id; the module must find the same from outside.
//!
//! pyenv provides 3.12.1 and 3.13.0 (shared libpython) and 3.11.7 (a version this build does
//! not know) on this machine kind and on CI. A missing interpreter fails the test, loudly,
//! unless `GYM_TRACER_ALLOW_MISSING_PYTHON=1` says this machine is known to lack it; then the
//! test prints which one it skipped.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use super::*;

const SCRIPT: &str = r#"
import ctypes, sys, threading
runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
print(runtime, threading.get_native_id(), sys.hexversion, flush=True)
sys.stdin.read()
"#;

fn interpreter(version: &str) -> Option<PathBuf> {
    let root =
        std::env::var_os("PYENV_ROOT").map_or_else(|| PathBuf::from("/root/.pyenv"), PathBuf::from);
    let python = root.join("versions").join(version).join("bin/python3");
    if python.exists() {
        return Some(python);
    }
    let allowed = std::env::var("GYM_TRACER_ALLOW_MISSING_PYTHON").is_ok_and(|v| v == "1");
    assert!(
        allowed,
        "CPython {version} is missing at {}: install it (pyenv install {version}) or set GYM_TRACER_ALLOW_MISSING_PYTHON=1",
        python.display()
    );
    eprintln!(
        "SKIPPED: CPython {version} is not installed at {}",
        python.display()
    );
    None
}

/// A running interpreter and what it printed about itself; killed when dropped.
struct Running {
    child: Child,
    runtime_address: u64,
    main_native_id: u32,
    hexversion: u64,
}

impl Drop for Running {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(python: &Path) -> Running {
    let mut child = Command::new(python)
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the interpreter starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped"))
        .read_line(&mut line)
        .expect("it prints");
    let fields: Vec<u64> = line
        .split_whitespace()
        .map(|f| f.parse().expect("numbers"))
        .collect();
    let [runtime_address, main_native_id, hexversion] = fields[..] else {
        panic!("got {line:?}")
    };
    child.stdin.as_mut().expect("piped").flush().expect("open");
    Running {
        child,
        runtime_address,
        main_native_id: u32::try_from(main_native_id).expect("a tid"),
        hexversion,
    }
}

fn check_known(version: &str, expected_source: WalkSource) {
    let Some(python) = interpreter(version) else {
        return;
    };
    let running = start(&python);
    let runtime = inspect(running.child.id()).expect("a known interpreter is recognised");
    eprintln!(
        "CPython {version}: _PyRuntime at {:#x} (inside: {:#x}), walk from {:?}",
        runtime.runtime_address, running.runtime_address, runtime.walk_source
    );
    assert_eq!(runtime.version, PythonVersion::from_hex(running.hexversion));
    assert_eq!(runtime.version.to_string(), version);
    assert_eq!(runtime.linkage, Linkage::Shared);
    assert_eq!(runtime.runtime_address, running.runtime_address);
    assert_eq!(runtime.walk_source, expected_source);
    let memory = ProcessMemory::new(running.child.id()).expect("a pid");
    let states = runtime.thread_states(&memory).expect("the walk succeeds");
    let tids: Vec<u32> = states.iter().map(|s| s.native_thread_id).collect();
    assert_eq!(
        tids,
        [running.main_native_id],
        "one thread, the main one, read from outside"
    );
    // The main thread's pid is its tid: a second, independent check of what was read.
    assert_eq!(running.main_native_id, running.child.id());
}

#[test]
fn cpython_3_12_is_read_from_the_header_table() {
    check_known("3.12.1", WalkSource::HeaderTable);
}

#[test]
fn cpython_3_13_is_read_from_its_debug_offsets() {
    check_known("3.13.0", WalkSource::DebugOffsets);
}

#[test]
fn an_interpreter_this_build_does_not_know_is_reported_not_misread() {
    let Some(python) = interpreter("3.11.7") else {
        return;
    };
    let running = start(&python);
    assert_eq!(
        inspect(running.child.id()),
        Err(RuntimeOff::UnknownVersion(3, 11, 7))
    );
}

#[test]
fn a_process_without_python_is_not_python() {
    assert_eq!(inspect(std::process::id()), Err(RuntimeOff::NotPython));
}
