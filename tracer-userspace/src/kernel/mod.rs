//! The kernel stage: loads the eBPF programs (PID filter, syscall and sched tracepoints),
//! reads the kernel layouts they need (BTF offsets), and decodes the ring buffer's records.
//! Only this stage and the runtime readers touch the kernel.

pub mod btf;
pub mod events;
pub mod floor;
pub mod injection;
pub mod loader;
pub mod tracepoint_format;
