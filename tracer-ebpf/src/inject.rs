//! The object loaded with `--inject-traceparent`: the tracing programs ([`programs`]) and
//! the two that insert the header ([`injection`]), with the sockhash they share.
#![no_std]
// `atomic_xadd`: the bpfel target has no atomic types; a relaxed add whose result is unused
// is the instruction every kernel's verifier takes (BPF_XADD).
#![feature(core_intrinsics)]
#![allow(internal_features)]
#![no_main]

#[path = "lineage.rs"]
mod lineage;

#[path = "programs.rs"]
mod programs;

#[path = "injection.rs"]
mod injection;
