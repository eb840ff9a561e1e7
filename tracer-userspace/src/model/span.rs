//! A finished span as every exporter receives it.

use std::borrow::Cow;
use std::sync::Arc;

use super::ids::{SpanId, TraceId};
use super::service::ServiceIdentity;

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

#[derive(Clone, Debug, PartialEq)]
pub enum AttributeValue {
    /// Borrowed for the values spans share (methods, schemes, kinds): most of a span's
    /// attributes then cost no allocation.
    Str(Cow<'static, str>),
    Int(i64),
}

pub type Attributes = Vec<(&'static str, AttributeValue)>;

/// A finished span: it has an end time by construction.
#[derive(Clone, Debug)]
pub struct SpanRecord {
    pub service: Arc<ServiceIdentity>,
    /// Borrowed where spans share it (`gym.verify`, `HTTP POST`).
    pub name: Cow<'static, str>,
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
}
