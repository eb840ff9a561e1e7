//! Prints the agent's user-space cost per request, one JSON line per workload (see
//! `gym_tracer::pipeline::cost`). `cargo xtask bench` runs it; alone:
//! `cargo run --release -p tracer-userspace --example pipeline_cost [requests [workload]]`
//! (one workload alone: `verify`, `cross-process`, `real-gym` or `stitch`; for callgrind).

use gym_tracer::pipeline::cost::{Cost, Workload, measure, measure_recording, stitch_ns_per_call};
use gym_tracer::pipeline::recording::Recording;

/// Four rollouts of the real nemo-gym servers, recorded by the agent
/// (`tests/support/real_gym/record.py`).
const REAL_GYM: &[u8] = include_bytes!("../testdata/real_gym_rollouts.rec");

const WORKLOADS: [&str; 4] = ["verify", "cross-process", "real-gym", "stitch"];

fn main() {
    let usage = || -> ! {
        eprintln!(
            "usage: pipeline_cost [requests, a positive number; default 200000] [one of {}]",
            WORKLOADS.join(", ")
        );
        std::process::exit(2);
    };
    let requests = match std::env::args().nth(1).map(|arg| arg.parse::<u64>()) {
        None => 200_000,
        Some(Ok(requests)) if requests > 0 => requests,
        Some(_) => usage(),
    };
    let only = std::env::args().nth(2);
    if only
        .as_deref()
        .is_some_and(|name| !WORKLOADS.contains(&name))
    {
        usage();
    }
    let runs = |name: &str| only.as_deref().is_none_or(|only| only == name);
    let real_gym = match Recording::parse(REAL_GYM) {
        Ok(recording) => recording,
        Err(error) => {
            eprintln!("testdata/real_gym_rollouts.rec: {error}");
            std::process::exit(1);
        }
    };
    // As many requests of the recording as of the made-up workloads (60 per replay).
    let rounds = requests.div_ceil(60);
    if runs("verify") {
        print_cost("verify", &measure(Workload::Verify, requests));
    }
    if runs("cross-process") {
        print_cost("cross-process", &measure(Workload::CrossProcess, requests));
    }
    if runs("real-gym") {
        print_cost("real-gym", &measure_recording(&real_gym, rounds));
    }
    if !runs("stitch") {
        return;
    }
    // The stitcher with many rollouts in flight in one process: the same work per call.
    for in_flight in [64, 1024, 4096, 16_384] {
        let rounds = (65_536 / in_flight).max(2);
        let ns = stitch_ns_per_call(in_flight, rounds);
        println!("{{\"stitch_in_flight\": {in_flight}, \"ns_per_call\": {ns:.1}}}");
    }
}

fn print_cost(name: &str, cost: &Cost) {
    println!(
        "{{\"workload\": \"{name}\", \"requests\": {}, \"spans\": {}, \"stitched\": {}, \
         \"pipeline_ns_per_request\": {:.1}, \"encode_ns_per_span\": {:.1}, \
         \"ns_per_span\": {:.1}}}",
        cost.requests,
        cost.spans,
        cost.stitched,
        cost.pipeline_ns_per_request,
        cost.encode_ns_per_span,
        cost.ns_per_span()
    );
}
