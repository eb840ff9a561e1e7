//! The object loaded with `--inject-traceparent`: the tracing programs ([`programs`]) and
//! the two that insert the header ([`injection`]), with the sockhash they share.
#![no_std]
#![no_main]

#[path = "programs.rs"]
mod programs;

#[path = "injection.rs"]
mod injection;
