//! Which processes are traced and who they are: discovery of Gym servers from /proc, the
//! route tables harvested from their `/openapi.json`, their exported identity, and the table
//! of traced processes (forks inherit their parent's).

pub mod discovery;
pub mod event_loop;
pub mod harvest;
pub mod identity;
pub mod python;
pub mod tls_library;
mod table;

pub use table::{ProcessTable, TracedProcess, log_lifecycle};
