//! The module against real interpreters: each prints, from inside, `_PyRuntime`'s address,
//! its main thread's native id, and the identities of the context it runs under and of a
//! ContextVar set in it; the module must find the same from outside, through the table's
//! context, HAMT, ContextVar and string offsets.
//!
//! pyenv provides 3.12.1 and 3.13.0 (shared libpython) and 3.11.7 (a version this build does
//! not know) on this machine kind and on CI. A missing interpreter fails the test, loudly,
//! unless `GYM_TRACER_ALLOW_MISSING_PYTHON=1` says this machine is known to lack it; then the
//! test prints which one it skipped.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use super::*;

/// Blocks inside `ctx.run` inside `outer.run`, so `PyThreadState.context` is `ctx` and its
/// `ctx_prev` is `outer` while we read; the one
/// variable set in it makes its HAMT a single bitmap node.
const SCRIPT: &str = r#"
import contextvars, ctypes, sys, threading
runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
var = contextvars.ContextVar("gym_tracer_probe")
def report():
    var.set("value")
    print(runtime, threading.get_native_id(), sys.hexversion, id(ctx), id(var), len(ctx),
          hash(var), id(outer), id(contextvars.Context), flush=True)
    sys.stdin.read()
outer, ctx = contextvars.Context(), contextvars.Context()
outer.run(ctx.run, report)
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
    context: u64,
    var: u64,
    vars_in_context: u64,
    var_hash: i64,
    outer_context: u64,
    context_type: u64,
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
    let fields: Vec<i64> = line
        .split_whitespace()
        .map(|f| f.parse().expect("numbers"))
        .collect();
    assert_eq!(fields.len(), 9, "got {line:?}");
    let as_u64 = |i: usize| u64::try_from(fields[i]).expect("an address or count");
    Running {
        child,
        runtime_address: as_u64(0),
        main_native_id: u32::try_from(fields[1]).expect("a tid"),
        hexversion: as_u64(2),
        context: as_u64(3),
        var: as_u64(4),
        vars_in_context: as_u64(5),
        var_hash: fields[6],
        outer_context: as_u64(7),
        context_type: as_u64(8),
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
    check_context(&runtime, &memory, states[0].address, &running);
    // What the kernel gets: PyContext_Type as the interpreter names it, and the one thread.
    assert_eq!(runtime.context_type, Some(running.context_type));
    let pid = running.child.id();
    let threads = runtime
        .kernel_threads(pid, &memory, &host_tids(pid))
        .expect("the kernel's entries");
    assert_eq!(threads.len(), 1);
    assert_eq!(threads[0].0, pid);
    assert_eq!(threads[0].1.thread_state, states[0].address);
    assert_eq!(
        memory.read_u64(running.context + u64::from(threads[0].1.object_type)),
        Ok(running.context_type),
        "a Context's ob_type"
    );
}

/// The table's context offsets, each against what the interpreter said from inside.
fn check_context(runtime: &PythonRuntime, memory: &ProcessMemory, state: u64, running: &Running) {
    let c = runtime.context;
    let context = memory
        .read_pointer(state + c.thread_context)
        .expect("a context");
    assert_eq!(context, running.context, "PyThreadState.context");
    let prev = memory.read_u64(context + c.context_prev);
    assert_eq!(prev, Ok(running.outer_context), "PyContext.ctx_prev");
    let hamt = memory
        .read_pointer(context + c.context_vars)
        .expect("a HAMT");
    assert_eq!(
        memory.read_u64(hamt + c.hamt_count),
        Ok(running.vars_in_context),
        "h_count"
    );
    assert_eq!(running.vars_in_context, 1);
    let node = memory
        .read_pointer(hamt + c.hamt_root)
        .expect("a root node");
    assert_eq!(
        memory.read_u64(node + c.bitmap_size),
        Ok(2),
        "bitmap node ob_size"
    );
    let bits = memory
        .read_bytes(node + c.bitmap_bits, 4)
        .expect("the bitmap");
    assert_eq!(
        u32::from_ne_bytes(bits.try_into().expect("4 bytes")).count_ones(),
        1
    );
    assert_eq!(
        memory.read_u64(node + c.bitmap_pairs),
        Ok(running.var),
        "first key"
    );
    let hash = memory.read_u64(running.var + c.var_hash).expect("var_hash");
    assert_eq!(
        hash.cast_signed(),
        running.var_hash,
        "PyContextVar.var_hash"
    );
    let name = memory
        .read_pointer(running.var + c.var_name)
        .expect("var_name");
    let len = memory
        .read_u64(name + c.ascii_length)
        .expect("the name's length");
    let bytes = memory.read_bytes(name + c.ascii_data, usize::try_from(len).expect("short"));
    assert_eq!(
        bytes.as_deref(),
        Ok(b"gym_tracer_probe".as_slice()),
        "var_name's bytes"
    );
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

#[test]
fn an_executable_without_python_is_read_once() {
    let mut not_python = NotPythonFiles::default();
    let pid = std::process::id();
    assert_eq!(
        inspect_remembering(pid, &mut not_python),
        Err(RuntimeOff::NotPython)
    );
    assert_eq!(
        not_python.0.len(),
        1,
        "this test binary's file is remembered"
    );
    assert_eq!(
        inspect_remembering(pid, &mut not_python),
        Err(RuntimeOff::NotPython)
    );
    assert_eq!(not_python.0.len(), 1);
}
