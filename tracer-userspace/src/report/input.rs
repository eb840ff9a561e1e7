//! What a batch report is made from: the spans and the event-loop points of one or more
//! JSON-lines outputs of the agent (`--output json`, one file per host), or the spans the
//! running agent itself exported (`run --report`). Only what the page needs is kept of each
//! span: about 300 bytes with the index that finds its duplicates.
//!
//! Lines that are not the agent's are counted by reason, the first few named by file and
//! line, and skipped; a span seen twice (two hosts' files that overlap, one file given twice)
//! is kept once.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::io::BufRead;
use std::path::Path;

use anyhow::{Context as _, Result};
use foldhash::{HashMap, HashSet};
use serde::Deserialize;

use crate::gym::ServerType;
use crate::model::attributes as attr;
use crate::model::rollout::{PerPhase, Phase};
use crate::model::service::ServiceIdentity;
use crate::model::span::{AttributeValue, SpanKind, SpanRecord, SpanStatus};

/// Spans kept at most (about 300 MB); past it spans are counted, not kept.
pub const MAX_SPANS: usize = 1 << 20;
/// Skipped lines named by file and line on the page and in the output, at most.
const EXAMPLES_KEPT: usize = 8;

/// A server as the spans' resources name it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Server {
    /// `service.name` (Gym: `<group>/<server name>`).
    pub name: String,
    pub server_type: Option<ServerType>,
}

impl Server {
    /// As its resource names it (the same key as a JSON line's `resource`).
    pub fn of(service: &ServiceIdentity) -> Server {
        let text = |key: &str| match service.attributes.get(key) {
            Some(AttributeValue::Str(value)) => Some(value.as_str()),
            _ => None,
        };
        Server {
            name: text(attr::SERVICE_NAME).unwrap_or("?").to_owned(),
            server_type: text(attr::GYM_SERVER_TYPE).and_then(server_type),
        }
    }
}

/// What a `gym.rollout` span carries of the insight stage's work.
#[derive(Clone, Debug, Default)]
pub struct RolloutFacts {
    /// Milliseconds per phase, in [`Phase::ALL`] order; `None` from an agent without them.
    pub phases_ms: Option<PerPhase<u64>>,
    pub model_calls: Option<i64>,
    pub tool_calls: Option<i64>,
    pub straggler: bool,
}

#[derive(Clone, Debug)]
pub struct ReportSpan {
    pub trace_id: u128,
    pub span_id: u64,
    pub parent: Option<u64>,
    pub name: Box<str>,
    pub kind: SpanKind,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Index into [`Input::servers`].
    pub server: u32,
    pub error: bool,
    pub status_code: Option<u16>,
    /// SERVER: `http.route`; CLIENT: the path of `url.full`.
    pub route: Option<Box<str>>,
    pub rollout_id: Option<Box<str>>,
    /// CLIENT: `peer.service` names a traced server.
    pub peer_traced: bool,
    pub input_tokens: Option<i64>,
    pub output_tokens: Option<i64>,
    /// Only on `gym.rollout` spans.
    pub rollout: Option<Box<RolloutFacts>>,
}

impl ReportSpan {
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }

    pub fn is_rollout(&self) -> bool {
        self.rollout.is_some()
    }
}

/// One event-loop utilization point (`gym.server.loop.utilization`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoopPoint {
    pub server: u32,
    pub time_ns: u64,
    /// 0..=1.
    pub share: f64,
}

/// Why a line was skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SkipReason {
    /// Not JSON at all (a log line, a truncated last line).
    NotJson,
    /// JSON, but neither a span nor a metric point of the agent's.
    NotTheAgents,
    /// A span or metric point with a field missing or of the wrong type.
    BadField,
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SkipReason::NotJson => "not JSON",
            SkipReason::NotTheAgents => "not a span or metric point of gym-tracer's",
            SkipReason::BadField => "a span or metric point with a bad field",
        })
    }
}

/// What was left out of the input, and why.
#[derive(Clone, Debug, Default)]
pub struct Skipped {
    pub by_reason: BTreeMap<SkipReason, u64>,
    /// `file:line: reason (detail)` of the first few.
    pub examples: Vec<String>,
    /// Spans given more than once (counted once).
    pub duplicate_spans: u64,
    /// Spans past [`MAX_SPANS`].
    pub spans_over_bound: u64,
}

impl Skipped {
    pub fn lines(&self) -> u64 {
        self.by_reason.values().sum()
    }

    fn line(&mut self, source: &str, line: usize, reason: SkipReason, detail: &str) {
        *self.by_reason.entry(reason).or_default() += 1;
        if self.examples.len() < EXAMPLES_KEPT {
            let detail: String = detail.chars().take(120).collect();
            self.examples
                .push(format!("{source}:{line}: {reason} ({detail})"));
        }
    }
}

/// Everything read, from every source.
#[derive(Debug, Default)]
pub struct Input {
    pub spans: Vec<ReportSpan>,
    pub servers: Vec<Server>,
    pub loop_points: Vec<LoopPoint>,
    pub skipped: Skipped,
    /// The files read (or `gym-tracer run`), with their line counts.
    pub sources: Vec<(String, u64)>,
    server_index: HashMap<Server, u32>,
    seen: HashSet<(u128, u64)>,
}

impl Input {
    /// Reads each of `paths` in turn. A file that cannot be opened or read is an error that
    /// names it; a line that is not the agent's is counted and skipped.
    pub fn read_files(paths: &[impl AsRef<Path>]) -> Result<Input> {
        let mut input = Input::default();
        for path in paths {
            let path = path.as_ref();
            let file = std::fs::File::open(path)
                .with_context(|| format!("cannot open {}", path.display()))?;
            input
                .read(
                    std::io::BufReader::with_capacity(1 << 20, file),
                    &path.display().to_string(),
                )
                .with_context(|| format!("cannot read {}", path.display()))?;
        }
        Ok(input)
    }

    /// Reads JSON lines from `reader`, named `source` in what is reported.
    pub fn read(&mut self, mut reader: impl BufRead, source: &str) -> std::io::Result<()> {
        let mut line = Vec::new();
        let mut number = 0;
        loop {
            line.clear();
            if reader.read_until(b'\n', &mut line)? == 0 {
                break;
            }
            number += 1;
            let text = line.trim_ascii();
            if text.is_empty() {
                continue;
            }
            if let Err((reason, detail)) = self.line(text) {
                self.skipped.line(source, number, reason, &detail);
            }
        }
        self.sources.push((source.to_owned(), number as u64));
        Ok(())
    }

    fn line(&mut self, text: &[u8]) -> Result<(), (SkipReason, String)> {
        let raw: RawLine<'_> = serde_json::from_slice(text).map_err(|error| {
            // A well-formed line with a field of the wrong type is the agent's, damaged;
            // anything else is not JSON.
            let reason = match serde_json::from_slice::<serde::de::IgnoredAny>(text) {
                Ok(_) => SkipReason::BadField,
                Err(_) => SkipReason::NotJson,
            };
            (reason, error.to_string())
        })?;
        match (raw.span_id.as_deref(), raw.metric.as_deref()) {
            (Some(span_id), None) => self.span(&raw, span_id),
            (None, Some(metric)) => {
                if metric == "gym.server.loop.utilization" {
                    self.loop_point(&raw)?;
                }
                Ok(())
            }
            _ => Err((
                SkipReason::NotTheAgents,
                "neither `span_id` nor `metric`".to_owned(),
            )),
        }
    }

    fn span(&mut self, raw: &RawLine<'_>, span_id: &str) -> Result<(), (SkipReason, String)> {
        let bad = |field: &str| {
            (
                SkipReason::BadField,
                format!("`{field}` missing or not valid"),
            )
        };
        let span_id = hex_u64(span_id).ok_or_else(|| bad("span_id"))?;
        let trace_id = raw
            .trace_id
            .as_deref()
            .and_then(hex_u128)
            .ok_or_else(|| bad("trace_id"))?;
        let parent = match raw.parent_span_id.as_deref() {
            None | Some("") => None,
            Some(parent) => Some(hex_u64(parent).ok_or_else(|| bad("parent_span_id"))?),
        };
        let kind = match raw.kind.as_deref() {
            Some("SERVER") => SpanKind::Server,
            Some("CLIENT") => SpanKind::Client,
            Some("INTERNAL") => SpanKind::Internal,
            _ => return Err(bad("kind")),
        };
        let (Some(name), Some(start_ns), Some(end_ns)) = (
            raw.name.as_deref(),
            raw.start_time_unix_nano,
            raw.end_time_unix_nano,
        ) else {
            return Err(bad("name, start_time_unix_nano or end_time_unix_nano"));
        };
        let a = raw.attributes.as_ref();
        let server = self.server_of(raw.resource.as_ref());
        let is_rollout = name == "gym.rollout";
        let span = ReportSpan {
            trace_id,
            span_id,
            parent,
            name: name.into(),
            kind,
            start_ns,
            end_ns: end_ns.max(start_ns),
            server,
            error: raw.status.as_deref() == Some("ERROR"),
            status_code: a.and_then(|a| a.status_code),
            route: match kind {
                SpanKind::Client => a.and_then(|a| a.url_full.as_deref()).and_then(url_path),
                _ => a.and_then(|a| a.route.as_deref()).map(Into::into),
            },
            rollout_id: a.and_then(|a| a.rollout_id.as_deref()).map(Into::into),
            peer_traced: a.is_some_and(|a| a.peer_service.is_some()),
            input_tokens: a.and_then(|a| a.input_tokens),
            output_tokens: a.and_then(|a| a.output_tokens),
            rollout: is_rollout.then(|| Box::new(a.map(RawAttributes::facts).unwrap_or_default())),
        };
        self.push(span);
        Ok(())
    }

    fn loop_point(&mut self, raw: &RawLine<'_>) -> Result<(), (SkipReason, String)> {
        let (Some(time_ns), Some(share)) = (raw.time_unix_nano, raw.value) else {
            return Err((
                SkipReason::BadField,
                "a loop-utilization point without `time_unix_nano` or `value`".to_owned(),
            ));
        };
        let server = self.server_of(raw.resource.as_ref());
        self.loop_points.push(LoopPoint {
            server,
            time_ns,
            share,
        });
        Ok(())
    }

    /// A span the running agent exported (`run --report`).
    pub fn add_record(&mut self, record: &SpanRecord) {
        let server = self.intern(Server::of(&record.service));
        let text = |key: &str| {
            record.attributes.iter().find_map(|(k, v)| match v {
                AttributeValue::Str(s) if *k == key => Some(Box::<str>::from(s.as_str())),
                _ => None,
            })
        };
        let int = |key: &str| {
            record.attributes.iter().find_map(|(k, v)| match v {
                AttributeValue::Int(n) if *k == key => Some(*n),
                _ => None,
            })
        };
        let is_rollout = record.name == "gym.rollout";
        let facts = &record.facts;
        let rollout_facts = || {
            let phases: Option<Vec<u64>> = Phase::ALL
                .iter()
                .map(|phase| int(phase.attribute()).and_then(|ms| u64::try_from(ms).ok()))
                .collect();
            Box::new(RolloutFacts {
                phases_ms: phases.and_then(|p| p.try_into().ok()),
                model_calls: int(attr::GYM_ROLLOUT_MODEL_CALLS),
                tool_calls: int(attr::GYM_ROLLOUT_TOOL_CALLS),
                straggler: record.attributes.iter().any(|(k, v)| {
                    *k == attr::GYM_ROLLOUT_STRAGGLER && matches!(v, AttributeValue::Bool(true))
                }),
            })
        };
        self.push(ReportSpan {
            trace_id: u128::from_be_bytes(record.trace_id.0),
            span_id: u64::from_be_bytes(record.span_id.0),
            parent: record.parent_span_id.map(|p| u64::from_be_bytes(p.0)),
            name: record.name.as_str().into(),
            kind: record.kind,
            start_ns: record.start_unix_ns,
            end_ns: record.end_unix_ns.max(record.start_unix_ns),
            server,
            error: record.status == SpanStatus::Error,
            status_code: facts.status_code,
            route: match record.kind {
                SpanKind::Client => text(attr::URL_FULL).as_deref().and_then(url_path),
                _ => facts.route.as_deref().map(Box::from),
            },
            rollout_id: facts.rollout_id.as_ref().map(|id| id.as_str().into()),
            peer_traced: facts.peer_traced,
            input_tokens: facts.input_tokens,
            output_tokens: facts.output_tokens,
            rollout: is_rollout.then(rollout_facts),
        });
    }

    /// An event-loop sample the running agent took of `server`.
    pub fn add_loop_point(&mut self, server: Server, time_ns: u64, share: f64) {
        let server = self.intern(server);
        self.loop_points.push(LoopPoint {
            server,
            time_ns,
            share,
        });
    }

    fn push(&mut self, span: ReportSpan) {
        if !self.seen.insert((span.trace_id, span.span_id)) {
            self.skipped.duplicate_spans += 1;
        } else if self.spans.len() >= MAX_SPANS {
            self.skipped.spans_over_bound += 1;
        } else {
            self.spans.push(span);
        }
    }

    fn server_of(&mut self, resource: Option<&RawResource<'_>>) -> u32 {
        let name = resource
            .and_then(|r| r.service_name.as_deref())
            .unwrap_or("?");
        let server_type = resource
            .and_then(|r| r.server_type.as_deref())
            .and_then(server_type);
        self.intern(Server {
            name: name.to_owned(),
            server_type,
        })
    }

    fn intern(&mut self, server: Server) -> u32 {
        if let Some(&index) = self.server_index.get(&server) {
            return index;
        }
        let index = self.servers.len() as u32;
        self.servers.push(server.clone());
        self.server_index.insert(server, index);
        index
    }
}

fn server_type(config_key: &str) -> Option<ServerType> {
    ServerType::ALL
        .into_iter()
        .find(|t| t.config_key() == config_key)
}

/// The path of an absolute URL, without query or fragment.
fn url_path(url: &str) -> Option<Box<str>> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let path = &rest[rest.find('/')?..];
    let end = path.find(['?', '#']).unwrap_or(path.len());
    Some(path[..end].into())
}

fn hex_u64(text: &str) -> Option<u64> {
    (text.len() == 16).then(|| u64::from_str_radix(text, 16).ok())?
}

fn hex_u128(text: &str) -> Option<u128> {
    (text.len() == 32).then(|| u128::from_str_radix(text, 16).ok())?
}

/// A line of the agent's output, span or metric point: only the fields the report reads
/// (the others are skipped unparsed).
#[derive(Deserialize)]
struct RawLine<'a> {
    #[serde(borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    trace_id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    span_id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    parent_span_id: Option<Cow<'a, str>>,
    start_time_unix_nano: Option<u64>,
    end_time_unix_nano: Option<u64>,
    #[serde(borrow)]
    attributes: Option<RawAttributes<'a>>,
    #[serde(borrow)]
    resource: Option<RawResource<'a>>,
    #[serde(borrow)]
    status: Option<Cow<'a, str>>,
    #[serde(borrow)]
    metric: Option<Cow<'a, str>>,
    value: Option<f64>,
    time_unix_nano: Option<u64>,
}

#[derive(Deserialize)]
struct RawAttributes<'a> {
    #[serde(rename = "http.response.status_code")]
    status_code: Option<u16>,
    #[serde(rename = "http.route", borrow)]
    route: Option<Cow<'a, str>>,
    #[serde(rename = "nemo.gym.rollout.id", borrow)]
    rollout_id: Option<Cow<'a, str>>,
    #[serde(rename = "url.full", borrow)]
    url_full: Option<Cow<'a, str>>,
    #[serde(rename = "peer.service", borrow)]
    peer_service: Option<Cow<'a, str>>,
    #[serde(rename = "gen_ai.usage.input_tokens")]
    input_tokens: Option<i64>,
    #[serde(rename = "gen_ai.usage.output_tokens")]
    output_tokens: Option<i64>,
    #[serde(rename = "gym.rollout.phase.model_ms")]
    model_ms: Option<u64>,
    #[serde(rename = "gym.rollout.phase.tool_ms")]
    tool_ms: Option<u64>,
    #[serde(rename = "gym.rollout.phase.verify_ms")]
    verify_ms: Option<u64>,
    #[serde(rename = "gym.rollout.phase.queue_ms")]
    queue_ms: Option<u64>,
    #[serde(rename = "gym.rollout.phase.external_ms")]
    external_ms: Option<u64>,
    #[serde(rename = "gym.rollout.phase.agent_ms")]
    agent_ms: Option<u64>,
    #[serde(rename = "gym.rollout.model_calls")]
    model_calls: Option<i64>,
    #[serde(rename = "gym.rollout.tool_calls")]
    tool_calls: Option<i64>,
    #[serde(rename = "gym.rollout.straggler")]
    straggler: Option<bool>,
}

impl RawAttributes<'_> {
    /// In [`Phase::ALL`] order.
    fn facts(&self) -> RolloutFacts {
        let phases = [
            self.model_ms,
            self.tool_ms,
            self.verify_ms,
            self.queue_ms,
            self.external_ms,
            self.agent_ms,
        ];
        RolloutFacts {
            phases_ms: phases
                .iter()
                .all(Option::is_some)
                .then(|| phases.map(Option::unwrap_or_default)),
            model_calls: self.model_calls,
            tool_calls: self.tool_calls,
            straggler: self.straggler == Some(true),
        }
    }
}

#[derive(Deserialize)]
struct RawResource<'a> {
    #[serde(rename = "service.name", borrow)]
    service_name: Option<Cow<'a, str>>,
    #[serde(rename = "nemo.gym.server.type", borrow)]
    server_type: Option<Cow<'a, str>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPAN: &str = r#"{"name":"gym.rollout","kind":"INTERNAL","trace_id":"f22363e35bcbbc3a963ae08070f5aded","span_id":"b0839b046da5acab","parent_span_id":"ccba4c6c705527c5","start_time_unix_nano":100,"end_time_unix_nano":300,"attributes":{"nemo.gym.rollout.id":"0-9","gym.rollout.phase.model_ms":1,"gym.rollout.phase.tool_ms":2,"gym.rollout.phase.verify_ms":3,"gym.rollout.phase.queue_ms":4,"gym.rollout.phase.external_ms":0,"gym.rollout.phase.agent_ms":5,"gym.rollout.straggler":true,"gen_ai.usage.input_tokens":7},"resource":{"service.name":"nemo/agent","nemo.gym.server.type":"responses_api_agents"},"status":"UNSET"}"#;

    #[test]
    fn a_calls_route_is_its_urls_path() {
        assert_eq!(
            url_path("http://127.0.0.1:8/v1/responses?k=1").as_deref(),
            Some("/v1/responses")
        );
        assert_eq!(url_path("https://h/run#x").as_deref(), Some("/run"));
        assert_eq!(url_path("http://h"), None);
    }

    #[test]
    fn spans_and_loop_points_are_read_and_foreign_lines_counted_by_reason() {
        let text = format!(
            "{SPAN}\n\n{{\"metric\":\"gym.server.loop.utilization\",\"type\":\"gauge\",\"value\":0.5,\"time_unix_nano\":9,\"resource\":{{\"service.name\":\"nemo/agent\",\"nemo.gym.server.type\":\"responses_api_agents\"}}}}\n\
             2026-12-05 INFO started\n{{\"level\":\"info\"}}\n{{\"span_id\":\"zz\"}}\n{SPAN}\n{{\"name\":\"x\",\"span_id\":\"0102030405060708\",\"trace_id\":\"00\""
        );
        let mut input = Input::default();
        input.read(text.as_bytes(), "a.jsonl").unwrap();
        assert_eq!(input.spans.len(), 1);
        assert_eq!(input.skipped.duplicate_spans, 1);
        let span = &input.spans[0];
        assert_eq!(span.rollout_id.as_deref(), Some("0-9"));
        let facts = span.rollout.as_ref().unwrap();
        assert_eq!(facts.phases_ms, Some([1, 2, 3, 4, 0, 5]));
        assert!(facts.straggler);
        assert_eq!(span.input_tokens, Some(7));
        assert_eq!(
            input.servers[span.server as usize].server_type,
            Some(ServerType::Agent)
        );
        assert_eq!(input.loop_points.len(), 1);
        assert_eq!(input.loop_points[0].server, span.server);
        let reasons: Vec<_> = input
            .skipped
            .by_reason
            .iter()
            .map(|(r, n)| (*r, *n))
            .collect();
        assert_eq!(
            reasons,
            [
                (SkipReason::NotJson, 2),
                (SkipReason::NotTheAgents, 1),
                (SkipReason::BadField, 1)
            ]
        );
        assert!(
            input.skipped.examples[0].starts_with("a.jsonl:4: not JSON"),
            "{:?}",
            input.skipped.examples
        );
        assert_eq!(input.sources, [("a.jsonl".to_owned(), 8)]);
    }
}
