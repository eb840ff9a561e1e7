//! What a finished exchange becomes: its Gym meaning (route, rollout id, `gym.*` span), its
//! spans and its metric recordings.

pub mod clock;
pub mod meaning;
pub mod metrics;
pub mod openinference;
pub mod outcome;
pub mod spans;
