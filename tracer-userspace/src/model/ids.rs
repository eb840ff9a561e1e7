//! Trace and span ids, and the W3C `traceparent` header that carries them.

use rand::Rng;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SpanId(pub [u8; 8]);

impl TraceId {
    pub fn random() -> Self {
        loop {
            let id: [u8; 16] = rand::rng().random();
            if id != [0; 16] {
                return Self(id);
            }
        }
    }
}

impl SpanId {
    pub fn random() -> Self {
        loop {
            let id: [u8; 8] = rand::rng().random();
            if id != [0; 8] {
                return Self(id);
            }
        }
    }
}

/// A W3C `traceparent` header: `00-<trace-id>-<parent-id>-<flags>`.
pub fn parse_traceparent(value: &str) -> Option<(TraceId, SpanId)> {
    let mut parts = value.trim().split('-');
    let version = parts.next()?;
    let trace = parts.next()?;
    let parent = parts.next()?;
    let flags = parts.next()?;
    let mut version_byte = [0u8; 1];
    decode_hex(version, &mut version_byte)?;
    if version.len() != 2
        || version == "ff"
        || trace.len() != 32
        || parent.len() != 16
        || flags.len() != 2
    {
        return None;
    }
    let mut trace_id = [0u8; 16];
    let mut span_id = [0u8; 8];
    decode_hex(trace, &mut trace_id)?;
    decode_hex(parent, &mut span_id)?;
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some((TraceId(trace_id), SpanId(span_id)))
}

fn decode_hex(text: &str, out: &mut [u8]) -> Option<()> {
    let bytes = text.as_bytes();
    if bytes.len() != out.len() * 2 {
        return None;
    }
    for (i, byte) in out.iter_mut().enumerate() {
        let high = (bytes[2 * i] as char).to_digit(16)?;
        let low = (bytes[2 * i + 1] as char).to_digit(16)?;
        *byte = (high * 16 + low) as u8;
    }
    Some(())
}
