//! The messages that flow between the pipeline's stages: ids, the HTTP exchange reassembly
//! hands on, the span record every exporter receives, a traced process's identity, the
//! attribute keys of the semantic conventions, and the counters every stage keeps. Every
//! stage imports this leaf; it imports nothing of theirs (only Gym's value types from `gym`).

pub mod attributes;
pub mod context;
pub mod evidence;
pub mod counters;
pub mod exchange;
pub mod genai;
pub mod ids;
pub mod rollout;
pub mod service;
pub mod span;
