//! The object loaded without `--inject-traceparent`: the tracing programs only (see
//! [`programs`]). It holds no sockhash, whose creation needs `CAP_NET_ADMIN`, which `run`
//! does not otherwise need.
#![no_std]
// `atomic_xadd`: the bpfel target has no atomic types; a relaxed add whose result is unused
// is the instruction every kernel's verifier takes (BPF_XADD).
#![feature(core_intrinsics)]
#![allow(internal_features)]
#![no_main]

mod lineage;
mod programs;
