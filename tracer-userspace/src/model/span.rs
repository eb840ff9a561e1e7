//! A finished span as every exporter receives it.

use std::borrow::Cow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use super::ids::{SpanId, TraceId};
use super::service::ServiceIdentity;
use crate::gym::ServerType;
use crate::gym::rollout_id::RolloutId;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Server,
    Client,
    Internal,
}

impl SpanKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SpanKind::Server => "SERVER",
            SpanKind::Client => "CLIENT",
            SpanKind::Internal => "INTERNAL",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanStatus {
    Unset,
    Error,
}

impl SpanStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            SpanStatus::Unset => "UNSET",
            SpanStatus::Error => "ERROR",
        }
    }
}

/// A span's name or attribute text, held so that most of a span costs no allocation: the
/// values every span shares (methods, schemes, `gym.verify`) are static, the values many
/// spans repeat (a route, a server's name, a rollout id) are one shared allocation.
#[derive(Clone)]
pub enum Text {
    Static(&'static str),
    Shared(Arc<str>),
    Owned(String),
}

impl Text {
    pub fn as_str(&self) -> &str {
        match self {
            Text::Static(text) => text,
            Text::Shared(text) => text,
            Text::Owned(text) => text,
        }
    }
}

impl Deref for Text {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for Text {
    fn eq(&self, other: &Text) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Text {}

impl PartialEq<&str> for Text {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for Text {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other
    }
}

impl fmt::Debug for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&'static str> for Text {
    fn from(text: &'static str) -> Text {
        Text::Static(text)
    }
}

impl From<String> for Text {
    fn from(text: String) -> Text {
        Text::Owned(text)
    }
}

impl From<Arc<str>> for Text {
    fn from(text: Arc<str>) -> Text {
        Text::Shared(text)
    }
}

impl From<&Arc<str>> for Text {
    fn from(text: &Arc<str>) -> Text {
        Text::Shared(text.clone())
    }
}

impl From<Cow<'static, str>> for Text {
    fn from(text: Cow<'static, str>) -> Text {
        match text {
            Cow::Borrowed(text) => Text::Static(text),
            Cow::Owned(text) => Text::Owned(text),
        }
    }
}

impl From<Text> for Cow<'static, str> {
    fn from(text: Text) -> Cow<'static, str> {
        match text {
            Text::Static(text) => Cow::Borrowed(text),
            Text::Shared(text) => Cow::Owned(text.as_ref().to_owned()),
            Text::Owned(text) => Cow::Owned(text),
        }
    }
}

impl From<&Text> for opentelemetry::StringValue {
    fn from(text: &Text) -> opentelemetry::StringValue {
        match text {
            Text::Static(text) => (*text).into(),
            Text::Shared(text) => text.clone().into(),
            Text::Owned(text) => text.clone().into(),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum AttributeValue {
    Str(Text),
    Int(i64),
    Bool(bool),
    /// A measure in seconds, as the semantic conventions give durations.
    Double(f64),
}

impl fmt::Display for AttributeValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttributeValue::Str(text) => f.write_str(text),
            AttributeValue::Int(number) => write!(f, "{number}"),
            AttributeValue::Bool(value) => write!(f, "{value}"),
            AttributeValue::Double(value) => write!(f, "{value}"),
        }
    }
}

pub type Attributes = Vec<(&'static str, AttributeValue)>;

/// What the pipeline knew of a span when it built it, typed, beside what it exports: the
/// stages after the stitcher (insight, the batch report) read these instead of parsing them
/// back out of the attributes. Each is also an attribute, named in its doc; a span the
/// pipeline did not build from a request (a TLS connection's, a test's) has none.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpanFacts {
    /// The Gym server type of the span's process (`nemo.gym.server.type`, when it is one
    /// of the three).
    pub server_type: Option<ServerType>,
    /// SERVER: the route template (`http.route`).
    pub route: Option<Arc<str>>,
    /// `/verify`'s SERVER span or its `gym.verify` span.
    pub verify: bool,
    /// CLIENT: the callee is a traced Gym server (`peer.service`).
    pub peer_traced: bool,
    /// `gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`.
    pub input_tokens: Option<i64>,
    pub output_tokens: Option<i64>,
    /// `http.response.status_code`.
    pub status_code: Option<u16>,
    /// `nemo.gym.rollout.id`, as the span was built or as the stitcher learned it.
    pub rollout_id: Option<RolloutId>,
}

/// A finished span: it has an end time by construction.
#[derive(Clone, Debug)]
pub struct SpanRecord {
    pub service: Arc<ServiceIdentity>,
    pub name: Text,
    pub kind: SpanKind,
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub parent_span_id: Option<SpanId>,
    /// The parent came from an inbound `traceparent` header (another process's span).
    pub parent_is_remote: bool,
    pub start_unix_ns: u64,
    pub end_unix_ns: u64,
    pub attributes: Attributes,
    pub status: SpanStatus,
    pub facts: SpanFacts,
}

impl SpanRecord {
    /// A span with no attributes, parent or trace id yet, timed 1..2 ns: what unit tests and
    /// the cost measurement hand the stitcher.
    pub fn bare(
        service: Arc<ServiceIdentity>,
        name: &str,
        kind: SpanKind,
        span_id: SpanId,
    ) -> Self {
        Self {
            service,
            name: name.to_owned().into(),
            kind,
            trace_id: TraceId([0; 16]),
            span_id,
            parent_span_id: None,
            parent_is_remote: false,
            start_unix_ns: 1,
            end_unix_ns: 2,
            attributes: Vec::new(),
            status: SpanStatus::Unset,
            facts: SpanFacts::default(),
        }
    }
}
