//! Gym semantics: what a Gym user reads, derived from raw HTTP. Route templates, rollout
//! ids, span groups and the `gym.*` span names, as `../shared/GYM_TELEMETRY.md` defines them.
