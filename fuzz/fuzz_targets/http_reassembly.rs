//! Arbitrary sequences of kernel events (opens, reads and writes captured in part, closes,
//! exits, forks, garbage records) through the agent's decode → connection table → HTTP
//! reassembly → stitching → span building path. The input format and the invariants checked
//! are in `gym_tracer::pipeline::replay`; `cargo xtask fuzz` runs this.
#![no_main]

libfuzzer_sys::fuzz_target!(|script: &[u8]| {
    gym_tracer::pipeline::replay::replay(script);
});
