//! Trace and span ids, and the W3C `traceparent` header that carries them.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::cell::RefCell;

thread_local! {
    /// Ids need to be unique and unpredictable enough not to collide across agents, not to be
    /// secret: a small generator seeded from the OS per thread. The thread RNG (ChaCha) was 3 %
    /// of the agent's CPU at one trace id and one span id per request.
    static ID_RNG: RefCell<SmallRng> = RefCell::new(SmallRng::from_os_rng());
}

/// Random bytes for an id, never all zero (an invalid id).
fn random_id<const N: usize>() -> [u8; N] {
    ID_RNG.with_borrow_mut(|rng| {
        loop {
            let id: [u8; N] = rng.random();
            if id != [0; N] {
                return id;
            }
        }
    })
}

/// Lower-case hex, as OTLP/JSON and W3C `traceparent` write ids.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        text.push(DIGITS[(byte >> 4) as usize] as char);
        text.push(DIGITS[(byte & 0xf) as usize] as char);
    }
    text
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SpanId(pub [u8; 8]);

impl TraceId {
    pub fn random() -> Self {
        Self(random_id())
    }
}

impl SpanId {
    /// The id of the CLIENT span of the request whose first byte has TCP sequence number
    /// `seq` ([`tracer_abi::tcp_request_span_id`]): the caller's agent gives its span this id
    /// and the callee's agent, on any host and sharing nothing, names it as the SERVER span's
    /// parent. Only the sequence number goes in, not the addresses, which NAT and Service
    /// addresses change between the ends.
    pub fn of_tcp_request(seq: u32) -> Self {
        Self(tracer_abi::tcp_request_span_id(seq).to_be_bytes())
    }

    pub fn random() -> Self {
        Self(random_id())
    }
}

/// The first `N` bytes of SHA-256(`domain` ‖ `value`), never all zero (an invalid id): the
/// ids that agents sharing nothing must compute alike.
pub fn derived_id<const N: usize>(domain: &[u8], value: &[u8]) -> [u8; N] {
    use sha2::{Digest, Sha256};
    let digest = Sha256::new()
        .chain_update(domain)
        .chain_update(value)
        .finalize();
    let mut id = [0u8; N];
    id.copy_from_slice(&digest[..N]);
    if id == [0; N] {
        id[N - 1] = 1;
    }
    id
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The ids other tools (and other versions of this one) must compute the same way:
    /// SplitMix64's finalizer of (0x67747271 << 32 | seq), big-endian. The vectors were
    /// computed apart from this code (Python: `z = (0x67747271 << 32) | seq; z = ((z ^ (z >>
    /// 30)) * 0xbf58476d1ce4e5b9) % 2**64; z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) % 2**64;
    /// z ^ (z >> 31)`).
    const VECTORS: [(u32, &str); 4] = [
        (0, "9a196ab7dcf845d8"),
        (1, "e66a7be098b5a643"),
        (0x8000_0000, "6ef3bd6b586e4cdb"),
        (u32::MAX, "f92427a4b745cab0"),
    ];

    #[test]
    fn a_requests_span_id_is_a_function_of_its_sequence_number_only() {
        for (seq, hex) in VECTORS {
            let id = SpanId::of_tcp_request(seq);
            let got: String = id.0.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(got, hex, "seq {seq}");
        }
        assert_ne!(SpanId::of_tcp_request(7), SpanId::of_tcp_request(8));
    }
}
