//! Finding Gym server processes on the host (placeholder).
