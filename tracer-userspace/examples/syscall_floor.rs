//! Attaches the floor programs (`gym_tracer::floor`) until its standard input closes, draining
//! their ring every 10 ms; prints `ready` once attached and, at the end, one JSON line with
//! the records captured and lost. `cargo xtask bench` runs it beside `bench/syscall_tax.c`;
//! alone, as root:
//! `cargo run --release -p tracer-userspace --example syscall_floor -- capture <pid>`.

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use gym_tracer::floor::{FloorMode, FloorProbes};

const USAGE: &str = "usage: syscall_floor empty | syscall_floor capture <pid>";

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["empty"] => FloorMode::Empty,
        ["capture", pid] => FloorMode::Capture {
            pid: pid.parse().map_err(|_| anyhow::anyhow!("{USAGE}"))?,
        },
        _ => anyhow::bail!("{USAGE}"),
    };
    let mut probes = FloorProbes::attach(mode)?;
    let done = Arc::new(AtomicBool::new(false));
    let stdin_closed = Arc::clone(&done);
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        stdin_closed.store(true, Ordering::Relaxed);
    });
    println!("ready");
    std::io::stdout().flush()?;
    let (mut records, mut bytes) = (0u64, 0u64);
    loop {
        let finished = done.load(Ordering::Relaxed);
        let drained = probes.drain();
        records += drained.records;
        bytes += drained.bytes;
        if finished {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    println!(
        "{{\"records\": {records}, \"bytes\": {bytes}, \"lost\": {}}}",
        probes.lost()?
    );
    Ok(())
}
