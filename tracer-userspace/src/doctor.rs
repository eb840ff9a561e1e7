//! `gym-tracer doctor`: what this kernel and these privileges support, and which features
//! will be on or off.

use anyhow::Result;

use crate::cli::DoctorArgs;

pub fn run(_args: &DoctorArgs) -> Result<bool> {
    anyhow::bail!("doctor is not implemented yet")
}
