//! The walk and the version checks on recorded memory.

use super::memory::recorded::RecordedMemory;
use super::*;

const RUNTIME: u64 = 0x7f00_0052_94c0;
const INTERP: u64 = 0x7f00_0060_0000;
const MAIN: u64 = 0x7f00_0070_0000;
const WORKER: u64 = 0x5600_0000_1000;
const CONTEXT_TYPE: u64 = 0x7f00_0055_0000;

fn runtime_313() -> PythonRuntime {
    testing::runtime_313(RUNTIME, CONTEXT_TYPE)
}

/// One interpreter with two thread states (worker newest, then main), as 3.13 lays them out.
fn memory_313(runtime: &PythonRuntime) -> RecordedMemory {
    let w = runtime.walk;
    let mut m = RecordedMemory::default();
    m.put_u64(RUNTIME + w.interpreters_head, INTERP);
    m.put_u64(INTERP + w.threads_head, WORKER);
    m.put_u64(INTERP + w.interpreter_next, 0);
    for (state, next, tid) in [(WORKER, MAIN, 4242), (MAIN, 0, 4200)] {
        m.put_u64(state + w.thread_next, next);
        m.put_u64(state + w.thread_interp, INTERP);
        m.put_u64(state + w.thread_native_id, tid);
    }
    m
}

#[test]
fn the_walk_lists_every_thread_state_newest_first() {
    let runtime = runtime_313();
    let states = runtime
        .thread_states(&memory_313(&runtime))
        .expect("a sound walk");
    let tids: Vec<u32> = states.iter().map(|s| s.native_thread_id).collect();
    assert_eq!(tids, [4242, 4200]);
    assert!(states.iter().all(|s| s.interpreter == INTERP));
}

#[test]
fn a_thread_state_not_pointing_back_ends_the_walk() {
    let runtime = runtime_313();
    let mut m = memory_313(&runtime);
    m.put_u64(MAIN + runtime.walk.thread_interp, INTERP + 8);
    assert_eq!(
        runtime.thread_states(&m),
        Err(RuntimeOff::LayoutMismatch(
            "thread state not linked to its interpreter"
        ))
    );
}

#[test]
fn a_cycle_of_thread_states_is_bounded() {
    let runtime = runtime_313();
    let mut m = memory_313(&runtime);
    m.put_u64(MAIN + runtime.walk.thread_next, WORKER);
    assert_eq!(
        runtime.thread_states(&m),
        Err(RuntimeOff::LayoutMismatch(
            "more thread states than the walk's bound"
        ))
    );
}

#[test]
fn no_interpreter_yet_is_a_null_not_a_read_at_zero() {
    let runtime = runtime_313();
    let mut m = RecordedMemory::default();
    m.put_u64(RUNTIME + runtime.walk.interpreters_head, 0);
    assert_eq!(
        runtime.thread_states(&m),
        Err(RuntimeOff::Read(ReadError::Null))
    );
}

#[test]
fn the_sources_of_the_version_must_agree() {
    let v = |minor, micro| PythonVersion {
        major: 3,
        minor,
        micro,
    };
    assert_eq!(
        agreed_version(Some((3, 13)), Some(v(13, 0)), Some(v(13, 0))),
        Ok(v(13, 0))
    );
    assert_eq!(
        agreed_version(Some((3, 12)), Some(v(12, 1)), None),
        Ok(v(12, 1))
    );
    assert_eq!(agreed_version(None, Some(v(13, 2)), None), Ok(v(13, 2)));
    assert_eq!(
        agreed_version(Some((3, 12)), None, None),
        Err(RuntimeOff::NoVersion)
    );
    for (soname, py, debug) in [
        (Some((3, 12)), Some(v(13, 0)), None),
        (Some((3, 13)), Some(v(13, 0)), Some(v(13, 1))),
        (Some((3, 13)), None, Some(v(14, 0))),
    ] {
        assert!(
            matches!(
                agreed_version(soname, py, debug),
                Err(RuntimeOff::VersionMismatch { .. })
            ),
            "{soname:?} {py:?} {debug:?}"
        );
    }
}

/// A recorded head of 3.13.0's `_Py_DebugOffsets` (the walk's fields only; the rest zero).
fn debug_offsets_313() -> Vec<u8> {
    let mut bytes = vec![0u8; 208];
    bytes[..8].copy_from_slice(DEBUG_COOKIE);
    for (at, value) in [(8, 0x030D_00F0u64), (40, 632), (64, 7264), (72, 7344)]
        .into_iter()
        .chain([(168, 8), (176, 16), (200, 160)])
    {
        bytes[at..at + 8].copy_from_slice(&value.to_ne_bytes());
    }
    bytes
}

#[test]
fn debug_offsets_are_read_and_checked_against_the_headers() {
    let layout = layout::layout_for(3, 13).expect("known");
    let mut m = RecordedMemory::default();
    m.put(RUNTIME, &debug_offsets_313());
    let (walk, source) = resolve_walk(layout, true, RUNTIME, &m).expect("agrees");
    assert_eq!(source, WalkSource::DebugOffsets);
    assert_eq!(
        (
            walk.interpreters_head,
            walk.threads_head,
            walk.thread_native_id
        ),
        (632, 7344, 160)
    );
    assert_eq!(
        resolve_walk(layout, false, RUNTIME, &m),
        Err(RuntimeOff::CookieMismatch)
    );

    let mut changed = debug_offsets_313();
    changed[200..208].copy_from_slice(&168u64.to_ne_bytes());
    m.put(RUNTIME, &changed);
    assert!(matches!(
        resolve_walk(layout, true, RUNTIME, &m),
        Err(RuntimeOff::LayoutMismatch(_))
    ));

    let mut free_threaded = debug_offsets_313();
    free_threaded[16] = 1;
    m.put(RUNTIME, &free_threaded);
    assert_eq!(
        resolve_walk(layout, true, RUNTIME, &m),
        Err(RuntimeOff::FreeThreaded)
    );
}

#[test]
fn the_312_walk_comes_from_the_table_alone() {
    let layout = layout::layout_for(3, 12).expect("known");
    let (walk, source) =
        resolve_walk(layout, false, RUNTIME, &RecordedMemory::default()).expect("no reads");
    assert_eq!(source, WalkSource::HeaderTable);
    assert_eq!(
        (
            walk.interpreters_head,
            walk.threads_head,
            walk.thread_native_id
        ),
        (40, 72, 144)
    );
}

#[test]
fn every_reason_has_its_own_counter_name() {
    let reasons = [
        RuntimeOff::NotPython,
        RuntimeOff::Unreadable(1),
        RuntimeOff::SeveralLibpythons,
        RuntimeOff::NoSymbols(PathBuf::new()),
        RuntimeOff::Elf {
            path: PathBuf::new(),
            problem: String::new(),
        },
        RuntimeOff::NotMapped,
        RuntimeOff::NoVersion,
        RuntimeOff::UnknownVersion(3, 14, 0),
        RuntimeOff::VersionMismatch {
            soname: None,
            py_version: None,
            debug: None,
        },
        RuntimeOff::CookieMismatch,
        RuntimeOff::FreeThreaded,
        RuntimeOff::LayoutMismatch(""),
        RuntimeOff::Read(ReadError::Null),
        RuntimeOff::MissingSymbol("PyContext_Type"),
    ];
    let mut names: Vec<&str> = reasons.iter().map(RuntimeOff::reason).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), reasons.len());
}

#[test]
fn each_named_thread_state_becomes_one_kernel_entry() {
    let runtime = runtime_313();
    let m = memory_313(&runtime);
    // The worker is in a PID namespace of its own (4242 inside, 9242 outside); the main
    // thread's id is the same in both.
    let host = std::collections::HashMap::from([(4242, 9242), (4200, 4200)]);
    let threads = runtime.kernel_threads(77, &m, &host).expect("a sound walk");
    let expected = |thread_state| tracer_abi::PythonThread {
        thread_state,
        context_type: CONTEXT_TYPE,
        thread_context: 208,
        context_prev: 16,
        object_type: 8,
        tgid: 77,
    };
    assert_eq!(threads, [(4200, expected(MAIN)), (9242, expected(WORKER))]);

    let without_type = PythonRuntime {
        context_type: None,
        ..runtime_313()
    };
    assert_eq!(
        without_type.kernel_threads(77, &m, &host),
        Err(RuntimeOff::MissingSymbol("PyContext_Type"))
    );
}
