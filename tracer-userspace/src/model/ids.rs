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
    let mut text = Vec::with_capacity(bytes.len() * 2);
    hex_into(&mut text, bytes);
    String::from_utf8(text).expect("hex digits are ASCII")
}

/// [`hex`] appended to `out` (a JSON line being written).
pub fn hex_into(out: &mut Vec<u8>, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for byte in bytes {
        out.extend_from_slice(&[DIGITS[(byte >> 4) as usize], DIGITS[(byte & 0xf) as usize]]);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SpanId(pub [u8; 8]);

impl TraceId {
    pub fn random() -> Self {
        Self(random_id())
    }

    /// The trace this host's kernel gave the inbound request `request` (its number on its
    /// connection) on the connection `conn_id` of process `pid`, when it carried none and the
    /// agent injects (see [`tracer_abi::minted_trace`]).
    pub fn minted(key: MintKey, pid: u32, conn_id: u64, request: u32) -> Self {
        Self(tracer_abi::minted_trace(key.0, pid, conn_id, request))
    }
}

/// The agent's secret for the traces its kernel mints: random per run, so that two runs' or
/// two hosts' minted traces are as independent as random ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MintKey(pub [u64; 2]);

impl MintKey {
    pub fn random() -> Self {
        let bytes: [u8; 16] = random_id();
        let half = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        Self([half(0), half(8)])
    }
}

impl SpanId {
    /// The id of the CLIENT span of the request in `trace` whose first byte has TCP sequence
    /// number `seq` ([`tracer_abi::call_span_id`]): what the caller's agent exports for a
    /// call another agent must name (one to another host, or one whose `traceparent` the
    /// kernel may have written), and what the callee's agent names as the SERVER span's
    /// parent. Every other span's id is [`SpanId::random`].
    pub fn of_call(trace: TraceId, seq: u32) -> Self {
        Self(tracer_abi::call_span_id(&trace.0, seq).to_be_bytes())
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

    /// The ids other tools (and other versions of this one) must compute the same way. The
    /// vectors were computed apart from this code (Python: `f(z) = z ^ z >> 30, * 0xbf58476d1ce4e5b9,
    /// ^ >> 27, * 0x94d049bb133111eb, ^ >> 31` mod 2^64; `id = f(f(hi ^ (0x67747232 << 32 | seq)) ^ lo)`
    /// with `hi`, `lo` the trace's halves, big-endian).
    const VECTORS: [(&str, u32, &str); 4] = [
        ("0af7651916cd43dd8448eb211c80319c", 0, "6d290f487535cc2d"),
        ("0af7651916cd43dd8448eb211c80319c", 1, "470bce4efdc155a4"),
        (
            "0af7651916cd43dd8448eb211c80319c",
            u32::MAX,
            "e02a88c310b7082f",
        ),
        ("00000000000000000000000000000001", 5000, "8840c260ce1cae16"),
    ];

    fn trace(text: &str) -> TraceId {
        let mut bytes = [0u8; 16];
        decode_hex(text, &mut bytes).expect("hex");
        TraceId(bytes)
    }

    /// The kernel computes the same (tracer_abi is its code too); the vectors were computed
    /// apart from this code (Python, `f` as above: `hi = f(f(k0 ^ conn) ^ (tgid << 32 |
    /// request))`, `lo = f(k1 ^ hi ^ conn)`, big-endian).
    #[test]
    fn a_minted_trace_is_a_function_of_the_key_the_process_the_connection_and_the_request() {
        let key = MintKey([0x5eed, 0xc0ffee]);
        let conn = 1_796_619_903_780_161_529;
        let minted = |request| hex(&TraceId::minted(key, 4242, conn, request).0);
        assert_eq!(minted(0), "195790994d21836031c5c97cbec1d9c8");
        assert_eq!(minted(1), "8fc80a5f9c4b3fdc50ea0c0c745b4a90");
        // The one input that gives all zeros, an invalid trace, gets ...01 instead.
        assert_eq!(
            hex(&TraceId::minted(MintKey([0, 0]), 0, 0, 0).0),
            "00000000000000000000000000000001"
        );
        // Distinct requests never share one: a grid of processes, connections, ordinals.
        let mut seen = std::collections::HashSet::new();
        for pid in 1..40 {
            for conn in [1, 2, conn, conn + 1, u64::MAX] {
                for request in 0..40 {
                    assert!(seen.insert(TraceId::minted(key, pid, conn, request)));
                }
            }
        }
        assert_ne!(
            TraceId::minted(key, 1, 1, 0),
            TraceId::minted(MintKey([0x5eed, 0xc0fffe]), 1, 1, 0),
            "another key, another trace"
        );
    }

    #[test]
    fn a_calls_span_id_is_a_function_of_its_trace_and_sequence_number() {
        for (trace_hex, seq, want) in VECTORS {
            assert_eq!(
                hex(&SpanId::of_call(trace(trace_hex), seq).0),
                want,
                "{trace_hex} {seq}"
            );
        }
    }

    /// Two requests with one sequence number (two connections whose numbers met, the
    /// collision #45 saw) get two ids when they are in two traces; in one trace, one number
    /// is one request, and the stitcher catches the rest before export.
    #[test]
    fn equal_sequence_numbers_in_two_traces_give_two_ids() {
        let (a, b) = (trace(VECTORS[0].0), trace(VECTORS[3].0));
        for seq in [0, 7, 0x8000_0000, u32::MAX] {
            assert_ne!(
                SpanId::of_call(a, seq),
                SpanId::of_call(b, seq),
                "seq {seq}"
            );
        }
        assert_ne!(SpanId::of_call(a, 7), SpanId::of_call(a, 8));
    }
}
