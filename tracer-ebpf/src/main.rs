//! The object loaded without `--inject-traceparent`: the tracing programs only (see
//! [`programs`]). It holds no sockhash, whose creation needs `CAP_NET_ADMIN`, which `run`
//! does not otherwise need.
#![no_std]
#![no_main]

mod programs;
