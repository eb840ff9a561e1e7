//! Gym semantics: what a Gym user reads, derived from raw HTTP. Route templates, rollout
//! ids, span groups and the `gym.*` span names, as `../shared/GYM_TELEMETRY.md` defines them.
//! Pure logic: no I/O, so every rule is unit-tested against what NeMo Gym 0.7.0 does.

// TODO(lead): remove once wired

pub mod rollout_id;
pub mod routes;
pub mod semantics;
pub mod span_groups;

use std::fmt;
use std::str::FromStr;

/// The three kinds of Gym server, spelled in Gym's config (`nemo.gym.server.type`) by the
/// top-level key under a server's name in `NEMO_GYM_CONFIG_DICT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ServerType {
    Agent,
    Model,
    Resources,
}

impl ServerType {
    pub const ALL: [ServerType; 3] = [ServerType::Agent, ServerType::Model, ServerType::Resources];

    pub fn config_key(self) -> &'static str {
        match self {
            ServerType::Agent => "responses_api_agents",
            ServerType::Model => "responses_api_models",
            ServerType::Resources => "resources_servers",
        }
    }

    /// The name `--server-type` also accepts, because the config keys are long to type.
    pub fn short_name(self) -> &'static str {
        match self {
            ServerType::Agent => "agent",
            ServerType::Model => "model",
            ServerType::Resources => "resources",
        }
    }

    /// Exact, as Gym's config spells it (`nemo_gym/global_config.py:177`). Gym 0.7.0 also
    /// has `environment_servers` (`nemo_gym/discovery.py:71`), which is none of these.
    pub fn from_config_key(key: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.config_key() == key)
    }
}

/// A server's kind as Gym's config spells it: one of the three the tracer has `gym.*` spans
/// for, or another (Gym 0.7.0's `environment_servers`), kept by name for the resource.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerKind {
    Known(ServerType),
    Other(String),
}

impl ServerKind {
    pub fn from_config_key(key: &str) -> Self {
        ServerType::from_config_key(key).map_or_else(|| Self::Other(key.to_string()), Self::Known)
    }

    pub fn config_key(&self) -> &str {
        match self {
            Self::Known(server_type) => server_type.config_key(),
            Self::Other(key) => key,
        }
    }

    pub fn known(&self) -> Option<ServerType> {
        match self {
            Self::Known(server_type) => Some(*server_type),
            Self::Other(_) => None,
        }
    }
}

impl fmt::Display for ServerType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.config_key())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown server type `{0}`: use one of responses_api_agents, responses_api_models, \
     resources_servers (or agent, model, resources)"
)]
pub struct UnknownServerType(String);

impl FromStr for ServerType {
    type Err = UnknownServerType;

    /// For people typing `--server-type`: the config key or the short name, any ASCII case.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        Self::ALL
            .into_iter()
            .find(|t| {
                text.eq_ignore_ascii_case(t.config_key())
                    || text.eq_ignore_ascii_case(t.short_name())
            })
            .ok_or_else(|| UnknownServerType(text.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_keys_round_trip() {
        for t in ServerType::ALL {
            assert_eq!(ServerType::from_config_key(t.config_key()), Some(t));
            assert_eq!(t.config_key().parse::<ServerType>(), Ok(t));
            assert_eq!(t.short_name().parse::<ServerType>(), Ok(t));
            assert_eq!(t.to_string(), t.config_key());
        }
    }

    #[test]
    fn config_key_lookup_is_exact() {
        assert_eq!(ServerType::from_config_key("agent"), None);
        assert_eq!(ServerType::from_config_key("Resources_Servers"), None);
        assert_eq!(ServerType::from_config_key(""), None);
    }

    #[test]
    fn parse_accepts_case_and_whitespace() {
        assert_eq!(" Model ".parse(), Ok(ServerType::Model));
        assert_eq!("RESOURCES_SERVERS".parse(), Ok(ServerType::Resources));
    }

    #[test]
    fn parse_error_lists_accepted_values() {
        let err = "agents".parse::<ServerType>().unwrap_err().to_string();
        assert!(err.contains("`agents`"), "{err}");
        for t in ServerType::ALL {
            assert!(
                err.contains(t.config_key()) && err.contains(t.short_name()),
                "{err}"
            );
        }
    }
}
