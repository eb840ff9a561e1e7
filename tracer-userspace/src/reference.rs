//! The README's reference sections, generated from the code so they cannot drift.

pub fn markdown() -> String {
    let mut out = String::from("### Options\n\n");
    out.push_str(&crate::config::options_reference());
    out
}
