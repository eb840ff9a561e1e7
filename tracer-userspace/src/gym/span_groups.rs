//! Span groups: which kinds of span are emitted, selected by the same spec Gym reads from
//! `NEMO_GYM_OTEL_SPAN_GROUPS`, so one setting means the same in both.

use std::fmt;
use std::str::FromStr;

/// Gym's span groups, spelled as `GymSpanGroup` does (`nemo_gym/telemetry/span_groups.py:65-96`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpanGroup {
    Job,
    Server,
    HttpClient,
    Rollout,
    Verify,
    Agent,
    ModelCall,
    Sandbox,
}

impl SpanGroup {
    pub const ALL: [SpanGroup; 8] = [
        SpanGroup::Job,
        SpanGroup::Server,
        SpanGroup::HttpClient,
        SpanGroup::Rollout,
        SpanGroup::Verify,
        SpanGroup::Agent,
        SpanGroup::ModelCall,
        SpanGroup::Sandbox,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SpanGroup::Job => "job",
            SpanGroup::Server => "server",
            SpanGroup::HttpClient => "http_client",
            SpanGroup::Rollout => "rollout",
            SpanGroup::Verify => "verify",
            SpanGroup::Agent => "agent",
            SpanGroup::ModelCall => "model_call",
            SpanGroup::Sandbox => "sandbox",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|g| g.name() == name)
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

impl fmt::Display for SpanGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of span groups. `Default` is `per_rollout`, the tracer's default (one bounded
/// trace per rollout), not Gym's `default` preset.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpanGroups(u8);

impl SpanGroups {
    pub const EMPTY: SpanGroups = SpanGroups(0);
    /// `default`: job plus the cross-process spine (server, http_client, rollout).
    pub const DEFAULT_PRESET: SpanGroups = SpanGroups::of(&[
        SpanGroup::Job,
        SpanGroup::Server,
        SpanGroup::HttpClient,
        SpanGroup::Rollout,
    ]);
    /// `per_rollout`: the spine plus verify, agent, model_call; no `job`.
    pub const PER_ROLLOUT: SpanGroups = SpanGroups::of(&[
        SpanGroup::Server,
        SpanGroup::HttpClient,
        SpanGroup::Rollout,
        SpanGroup::Verify,
        SpanGroup::Agent,
        SpanGroup::ModelCall,
    ]);
    pub const ALL: SpanGroups = SpanGroups::of(&SpanGroup::ALL);

    /// The presets by name (`span_groups.py:103-109`; `all` is nemo-lens's wildcard).
    const PRESETS: [(&'static str, SpanGroups); 3] = [
        ("default", SpanGroups::DEFAULT_PRESET),
        ("per_rollout", SpanGroups::PER_ROLLOUT),
        ("all", SpanGroups::ALL),
    ];

    pub const fn of(groups: &[SpanGroup]) -> SpanGroups {
        let mut bits = 0;
        let mut i = 0;
        while i < groups.len() {
            bits |= 1 << groups[i] as u8;
            i += 1;
        }
        SpanGroups(bits)
    }

    pub fn contains(self, group: SpanGroup) -> bool {
        self.0 & group.bit() != 0
    }

    pub fn insert(&mut self, group: SpanGroup) {
        self.0 |= group.bit();
    }

    pub fn iter(self) -> impl Iterator<Item = SpanGroup> {
        SpanGroup::ALL
            .into_iter()
            .filter(move |g| self.contains(*g))
    }
}

impl Default for SpanGroups {
    fn default() -> Self {
        SpanGroups::PER_ROLLOUT
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown span group or preset `{0}`; valid: {valid}", valid = valid_names())]
pub struct UnknownSpanGroup(String);

/// Sorted, as nemo-lens lists them in its error.
fn valid_names() -> String {
    let mut names: Vec<&str> = SpanGroup::ALL.iter().map(|g| g.name()).collect();
    names.extend(SpanGroups::PRESETS.iter().map(|(name, _)| *name));
    names.sort_unstable();
    names.join(", ")
}

impl FromStr for SpanGroups {
    type Err = UnknownSpanGroup;

    /// nemo-lens 0.1.0's `SpanGroup.resolve` (`nemo/lens/groups.py:85-108`): split on
    /// commas, trim, lowercase, drop empty entries, union presets and names, refuse
    /// anything else. So an empty spec selects no group. (nemo-lens reads a blank
    /// environment variable as unset, `nemo/lens/config.py:111-115`; that is the
    /// caller's to do.) No namespaces or exclusions: 0.1.0 has neither.
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let mut groups = SpanGroups::EMPTY;
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let part = part.to_lowercase();
            if let Some((_, preset)) = Self::PRESETS.iter().find(|(name, _)| *name == part) {
                groups.0 |= preset.0;
            } else if let Some(group) = SpanGroup::from_name(&part) {
                groups.insert(group);
            } else {
                return Err(UnknownSpanGroup(part));
            }
        }
        Ok(groups)
    }
}

/// The groups as a comma list in declaration order, which parses back to the same set.
impl fmt::Display for SpanGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, group) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(group.name())?;
        }
        Ok(())
    }
}

impl fmt::Debug for SpanGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SpanGroups({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(spec: &str) -> SpanGroups {
        spec.parse().unwrap()
    }

    #[test]
    fn names_round_trip() {
        for group in SpanGroup::ALL {
            assert_eq!(SpanGroup::from_name(group.name()), Some(group));
            assert_eq!(parse(group.name()), SpanGroups::of(&[group]));
        }
        assert_eq!(SpanGroup::ModelCall.to_string(), "model_call");
        assert_eq!(SpanGroup::HttpClient.name(), "http_client");
    }

    #[test]
    fn presets() {
        assert_eq!(
            parse("default").to_string(),
            "job,server,http_client,rollout"
        );
        assert_eq!(
            parse("per_rollout").to_string(),
            "server,http_client,rollout,verify,agent,model_call"
        );
        assert_eq!(parse("all"), SpanGroups::ALL);
        assert_eq!(SpanGroups::default(), SpanGroups::PER_ROLLOUT);
        assert!(!SpanGroups::PER_ROLLOUT.contains(SpanGroup::Job));
        assert!(!SpanGroups::PER_ROLLOUT.contains(SpanGroup::Sandbox));
        assert!(SpanGroups::ALL.contains(SpanGroup::Sandbox));
    }

    #[test]
    fn lists_union_with_whitespace_and_case() {
        let groups = parse(" Default , SANDBOX,,verify ");
        assert_eq!(
            groups.to_string(),
            "job,server,http_client,rollout,verify,sandbox"
        );
        assert_eq!(parse("server,server"), SpanGroups::of(&[SpanGroup::Server]));
        assert_eq!(parse("per_rollout,job"), SpanGroups::ALL.without_sandbox());
    }

    #[test]
    fn empty_spec_selects_nothing() {
        for spec in ["", "  ", ",", " , ,"] {
            assert_eq!(parse(spec), SpanGroups::EMPTY, "{spec:?}");
        }
        assert_eq!(SpanGroups::EMPTY.to_string(), "");
    }

    #[test]
    fn display_parses_back() {
        for spec in ["default", "per_rollout", "all", "sandbox,job", ""] {
            let groups = parse(spec);
            assert_eq!(parse(&groups.to_string()), groups);
        }
    }

    #[test]
    fn unknown_names_are_refused_with_the_valid_ones() {
        for bad in [
            "nemo_gym.verify",
            "-verify",
            "per_step",
            "checkpoint",
            "verify;agent",
        ] {
            let err = bad.parse::<SpanGroups>().unwrap_err().to_string();
            assert!(err.contains(&format!("`{}`", bad.to_lowercase())), "{err}");
            assert!(err.contains("agent, all, default, http_client, job, model_call, per_rollout, rollout, sandbox, server, verify"), "{err}");
        }
    }

    impl SpanGroups {
        fn without_sandbox(self) -> SpanGroups {
            SpanGroups(self.0 & !SpanGroup::Sandbox.bit())
        }
    }
}
