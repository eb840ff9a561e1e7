//! Rebuilds HTTP/1.x exchanges from captured reads and writes: the per-connection table
//! (which socket, which role, which requests in flight) and the HTTP head parser.

pub mod connections;
pub mod http;
pub mod tls;
