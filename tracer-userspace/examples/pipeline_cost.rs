//! Prints the agent's user-space cost per request, one JSON line per workload (see
//! `gym_tracer::pipeline::cost`). `cargo xtask bench` runs it; alone:
//! `cargo run --release -p tracer-userspace --example pipeline_cost [requests]`.

use gym_tracer::pipeline::cost::{Workload, measure, stitch_ns_per_call};

fn main() {
    let requests = match std::env::args().nth(1).map(|arg| arg.parse::<u64>()) {
        None => 200_000,
        Some(Ok(requests)) if requests > 0 => requests,
        Some(_) => {
            eprintln!("usage: pipeline_cost [requests, a positive number; default 200000]");
            std::process::exit(2);
        }
    };
    for (name, workload) in [
        ("verify", Workload::Verify),
        ("cross-process", Workload::CrossProcess),
    ] {
        let cost = measure(workload, requests);
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
    // The stitcher with many rollouts in flight in one process: the same work per call.
    for in_flight in [64, 1024, 4096, 16_384] {
        let rounds = (65_536 / in_flight).max(2);
        let ns = stitch_ns_per_call(in_flight, rounds);
        println!("{{\"stitch_in_flight\": {in_flight}, \"ns_per_call\": {ns:.1}}}");
    }
}
