//! TLS plaintext joins the connection it travels on.
//!
//! The uprobes on OpenSSL report plaintext by `SSL*`; the syscall tracepoints report the
//! ciphertext by socket. An `SSL*` is tied to one connection for its life, so the tie is
//! learned once, from evidence, and kept until the connection closes:
//!
//! - **Blocking sockets** (`ssl.SSLSocket`, `requests`): OpenSSL itself reads or writes the
//!   socket inside `SSL_read`/`SSL_write`. A ciphertext transfer of the same thread, in the
//!   same direction, between the call's entry and return, is on the call's connection.
//! - **Memory BIOs** (asyncio's `SSLProtocol`, so aiohttp, uvloop and uvicorn): `SSL_write`
//!   encrypts into a buffer and the transport sends it afterwards, on the same thread, as a
//!   socket write whose length is exactly that of the TLS records the calls made. A
//!   ciphertext write is matched with the thread's unmatched `SSL_write`s of one `SSL*` whose
//!   record lengths add up to it, for one of the AEAD record overheads; when two `SSL*`s could
//!   account for it, nothing is decided (counted) and the next write decides.
//!
//! Reads of a memory-BIO `SSL*` carry no such evidence (the ciphertext is read before the
//! call, maybe much before), so they wait for the `SSL*`'s first write to decide: a client
//! writes first, a server answers the request it read. Until its connection is known, what an
//! `SSL*` reported is held, bounded in records, bytes and time; what is given up is counted.

use std::collections::VecDeque;

use foldhash::HashMap;

use crate::kernel::events::{DataTransfer, Direction, TaskContext, TlsTransfer};
use crate::model::counters::counters;
use crate::model::exchange::SocketId;

counters! {
    /// How TLS plaintext found (or did not find) its connection.
    pub struct TlsCounters {
        /// Plaintext records (TLS reads and writes) the OpenSSL uprobes reported.
        traced tls_records,
        /// TLS sessions tied to their connection by a transfer inside the call. Blocking sockets
        /// (`requests`, `ssl.SSLSocket`); not a loss.
        note tls_sessions_by_syscall,
        /// TLS sessions tied to their connection by the lengths of their records. asyncio's TLS
        /// (uvloop, aiohttp, uvicorn), which sends after the call; not a loss.
        note tls_sessions_by_record_length,
        /// Ciphertext writes two TLS sessions could have made: left to a later write. Not a loss
        /// while `tls_records_unmatched` stays 0.
        note tls_matches_ambiguous,
        /// Plaintext records given up before their connection was known. Held over 2 s, past 256
        /// records or 1 MiB for one session, past 4,096 sessions waiting, or still held at exit;
        /// their requests are not traced.
        lost tls_records_unmatched,
    }
}

/// Largest TLS record plaintext (RFC 8446 §5.1): a write longer than it makes several records.
const MAX_RECORD_PLAINTEXT: u64 = 16 * 1024;

/// Bytes a record adds to its plaintext, for the ciphers OpenSSL negotiates by default:
/// TLS 1.3 AEAD (5 header + 1 content type + 16 tag), TLS 1.2 AES-GCM (5 + 8 explicit nonce +
/// 16 tag), TLS 1.2 ChaCha20-Poly1305 (5 + 16).
const RECORD_OVERHEADS: [u64; 3] = [22, 29, 21];

/// Bytes the end of a TLS 1.3 client handshake may add to the first ciphertext write after
/// it, when the transport sends both at once (uvloop does): the Finished record (5 header +
/// 4 handshake header + 32 or 48 verify data + 1 content type + 16 tag), with or without the
/// 6-byte ChangeCipherSpec that OpenSSL sends for middlebox compatibility.
const HANDSHAKE_TAILS: [u64; 4] = [58, 64, 74, 80];

/// How long plaintext waits for its connection to be known.
const HOLD_NS: u64 = 2_000_000_000;
/// Records and bytes one `SSL*` may have held.
const MAX_HELD_RECORDS: usize = 256;
const MAX_HELD_BYTES: usize = 1 << 20;
/// `SSL*`s with held records at once; past it new ones are not held.
const MAX_UNTIED_SESSIONS: usize = 4096;
/// Unmatched `SSL_write`s and recent ciphertext transfers kept per thread.
const MAX_THREAD_HISTORY: usize = 16;

/// One TLS session: an `SSL*` in one process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct SessionKey {
    pid: u32,
    ssl: u64,
}

/// A connection of the table: its socket and the `conn_id` that tells it from an older
/// connection on the same fd.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnectionKey {
    pub id: SocketId,
    pub conn_id: u64,
}

/// A plaintext record as held, or released to the connection table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedTransfer {
    pub tid: u32,
    pub timestamp_ns: u64,
    pub direction: Direction,
    /// The captured head, then the tail.
    pub bytes: Vec<u8>,
    pub captured_len: usize,
    pub total_len: u64,
}

impl OwnedTransfer {
    fn of(transfer: &TlsTransfer<'_>) -> Self {
        let mut bytes = Vec::with_capacity(transfer.captured.len() + transfer.tail.len());
        bytes.extend_from_slice(transfer.captured);
        bytes.extend_from_slice(transfer.tail);
        Self {
            tid: transfer.tid,
            timestamp_ns: transfer.timestamp_ns,
            direction: transfer.direction,
            bytes,
            captured_len: transfer.captured.len(),
            total_len: transfer.total_len,
        }
    }

    /// As the table takes it: a transfer on `connection`.
    pub fn on(&self, pid: u32, connection: ConnectionKey) -> DataTransfer<'_> {
        DataTransfer {
            pid,
            tid: self.tid,
            fd: connection.id.fd,
            conn_id: connection.conn_id,
            timestamp_ns: self.timestamp_ns,
            direction: self.direction,
            captured: &self.bytes[..self.captured_len],
            total_len: self.total_len,
            tail: &self.bytes[self.captured_len..],
            // Plaintext has no place in the TCP byte stream.
            seq: None,
        }
    }
}

/// What an `SSL*` reported, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsRecord {
    Context(TaskContext),
    Data(OwnedTransfer),
}

/// Records released to a connection now that it is known, in the order they were reported.
#[derive(Debug, PartialEq, Eq)]
pub struct Released {
    pub pid: u32,
    pub connection: ConnectionKey,
    pub records: Vec<TlsRecord>,
}

#[derive(Debug)]
struct Held {
    first_ns: u64,
    records: Vec<TlsRecord>,
    bytes: usize,
    /// It began with a read: maybe a request to a server of this process, not yet seen.
    begins_with_read: bool,
}

/// An `SSL_write` not yet matched with the ciphertext that carried it.
#[derive(Clone, Copy, Debug)]
struct SslWrite {
    session: SessionKey,
    plaintext: u64,
    end_ns: u64,
}

/// A ciphertext transfer on a TLS connection.
#[derive(Clone, Copy, Debug)]
struct Ciphertext {
    pid: u32,
    connection: ConnectionKey,
    direction: Direction,
    timestamp_ns: u64,
}

#[derive(Debug, Default)]
struct ThreadTraffic {
    writes: VecDeque<SslWrite>,
    recent: VecDeque<Ciphertext>,
}

/// The ties between `SSL*`s and connections, and what waits for one.
#[derive(Debug, Default)]
pub struct TlsSessions {
    pub counters: TlsCounters,
    tied: HashMap<SessionKey, ConnectionKey>,
    /// The sessions tied to each connection, to untie them when it closes.
    by_connection: HashMap<SocketId, (u64, Vec<u64>)>,
    held: HashMap<SessionKey, Held>,
    /// Sessions with held records, oldest first (entries of sessions tied since are skipped).
    held_order: VecDeque<(u64, SessionKey)>,
    threads: HashMap<u32, ThreadTraffic>,
    /// Per process, the held sessions that began with a read.
    held_reads: HashMap<u32, usize>,
}

impl TlsSessions {
    /// Whether `pid` may have an inbound request the table has not seen: a session holds
    /// what it read, waiting for its connection (a TLS server's request, until its response).
    pub fn hides_inbound(&self, pid: u32) -> bool {
        self.held_reads.get(&pid).is_some_and(|count| *count > 0)
    }

    /// Takes `session`'s held records out, keeping [`Self::held_reads`] right.
    fn take_held(&mut self, session: SessionKey) -> Option<Held> {
        let held = self.held.remove(&session)?;
        if held.begins_with_read
            && let Some(count) = self.held_reads.get_mut(&session.pid)
        {
            *count -= 1;
            if *count == 0 {
                self.held_reads.remove(&session.pid);
            }
        }
        Some(held)
    }

    /// The connection of a TLS plaintext record, if known; otherwise the record is held (and
    /// may tie its session at once: then what it released is in `released`).
    pub fn plaintext(
        &mut self,
        transfer: &TlsTransfer<'_>,
        released: &mut Vec<Released>,
    ) -> Option<ConnectionKey> {
        self.counters.tls_records += 1;
        self.expire(transfer.timestamp_ns);
        let session = SessionKey {
            pid: transfer.pid,
            ssl: transfer.ssl,
        };
        let inside = self.inside_call(transfer);
        if transfer.direction == Direction::Write && inside.is_none() {
            // A memory BIO's write: its ciphertext is sent after it returns.
            let thread = self.threads.entry(transfer.tid).or_default();
            push_bounded(
                &mut thread.writes,
                SslWrite {
                    session,
                    plaintext: transfer.total_len,
                    end_ns: transfer.timestamp_ns,
                },
            );
        }
        if let Some(connection) = self.tied.get(&session) {
            return Some(*connection);
        }
        self.hold(session, TlsRecord::Data(OwnedTransfer::of(transfer)));
        if let Some(connection) = inside {
            self.counters.tls_sessions_by_syscall += 1;
            self.tie(session, connection, released);
        }
        None
    }

    /// The connection of a task context read for a TLS write (`fd` -1, `conn_id` the `SSL*`),
    /// if known; otherwise it is held with the session's records.
    pub fn context(&mut self, context: &TaskContext) -> Option<ConnectionKey> {
        let session = SessionKey {
            pid: context.pid,
            ssl: context.conn_id,
        };
        if let Some(connection) = self.tied.get(&session) {
            return Some(*connection);
        }
        self.hold(session, TlsRecord::Context(*context));
        None
    }

    /// A transfer on a connection the table knows to be TLS: evidence for the sessions of its
    /// thread.
    pub fn ciphertext(&mut self, transfer: &DataTransfer<'_>, released: &mut Vec<Released>) {
        let connection = ConnectionKey {
            id: SocketId {
                pid: transfer.pid,
                fd: transfer.fd,
            },
            conn_id: transfer.conn_id,
        };
        let thread = self.threads.entry(transfer.tid).or_default();
        push_bounded(
            &mut thread.recent,
            Ciphertext {
                pid: transfer.pid,
                connection,
                direction: transfer.direction,
                timestamp_ns: transfer.timestamp_ns,
            },
        );
        if transfer.direction == Direction::Write
            && let Some(session) = self.match_record_lengths(transfer, connection)
            && !self.tied.contains_key(&session)
        {
            self.counters.tls_sessions_by_record_length += 1;
            self.tie(session, connection, released);
        }
    }

    /// A connection closed: its sessions are untied (an `SSL*` address may be reused).
    pub fn closed(&mut self, id: SocketId, conn_id: u64) {
        if let Some((tied_conn, sessions)) = self.by_connection.remove(&id) {
            if tied_conn != conn_id {
                self.by_connection.insert(id, (tied_conn, sessions));
                return;
            }
            for ssl in sessions {
                self.tied.remove(&SessionKey { pid: id.pid, ssl });
            }
        }
    }

    /// A process is gone or replaced its program (its `SSL*`s mean nothing now): everything of
    /// it is dropped (held records counted).
    pub fn process_gone(&mut self, pid: u32) {
        self.tied.retain(|key, _| key.pid != pid);
        self.by_connection.retain(|id, _| id.pid != pid);
        let counters = &mut self.counters;
        self.held.retain(|key, held| {
            let keep = key.pid != pid;
            if !keep {
                counters.tls_records_unmatched += held.records.len() as u64;
            }
            keep
        });
        self.held_reads.remove(&pid);
        for thread in self.threads.values_mut() {
            thread.writes.retain(|write| write.session.pid != pid);
            thread.recent.retain(|cipher| cipher.pid != pid);
        }
        self.threads
            .retain(|_, thread| !thread.writes.is_empty() || !thread.recent.is_empty());
    }

    /// Shutdown: what is still held never found its connection.
    pub fn give_up_held(&mut self) {
        let held: usize = self.held.drain().map(|(_, held)| held.records.len()).sum();
        self.counters.tls_records_unmatched += held as u64;
        self.held_order.clear();
        self.held_reads.clear();
    }

    /// The one connection of the thread's ciphertext transfers in `transfer`'s direction
    /// made between the call's entry and return: OpenSSL on a blocking socket.
    fn inside_call(&self, transfer: &TlsTransfer<'_>) -> Option<ConnectionKey> {
        let thread = self.threads.get(&transfer.tid)?;
        let mut inside = thread.recent.iter().filter(|cipher| {
            cipher.pid == transfer.pid
                && cipher.direction == transfer.direction
                && (transfer.start_ns..=transfer.timestamp_ns).contains(&cipher.timestamp_ns)
        });
        let first = inside.next()?.connection;
        inside
            .all(|cipher| cipher.connection == first)
            .then_some(first)
    }

    /// The session whose unmatched writes on this thread account for this ciphertext write
    /// exactly; its matched writes are consumed. Sessions tied to another connection are no
    /// candidates: a coincidence of lengths never moves a tie.
    fn match_record_lengths(
        &mut self,
        transfer: &DataTransfer<'_>,
        connection: ConnectionKey,
    ) -> Option<SessionKey> {
        let thread = self.threads.get_mut(&transfer.tid)?;
        thread.writes.retain(|write| {
            write.session.pid == transfer.pid && write.end_ns <= transfer.timestamp_ns
        });
        let mut sessions: Vec<SessionKey> = Vec::new();
        for write in &thread.writes {
            if !sessions.contains(&write.session) {
                sessions.push(write.session);
            }
        }
        let tied_here = |session: &SessionKey| match self.tied.get(session) {
            None => true,
            Some(tied) => *tied == connection,
        };
        let fits = |session: &SessionKey| {
            let first = !self.tied.contains_key(session);
            matched_writes(&thread.writes, *session, transfer.total_len, first).is_some()
        };
        let here: Vec<SessionKey> = sessions
            .iter()
            .filter(|s| tied_here(s) && fits(s))
            .copied()
            .collect();
        let chosen = match here.as_slice() {
            [one] => *one,
            [] => return None,
            _ => {
                self.counters.tls_matches_ambiguous += 1;
                return None;
            }
        };
        let first = !self.tied.contains_key(&chosen);
        let count = matched_writes(&thread.writes, chosen, transfer.total_len, first)?;
        let mut left = count;
        thread.writes.retain(|write| {
            if left > 0 && write.session == chosen {
                left -= 1;
                false
            } else {
                true
            }
        });
        Some(chosen)
    }

    fn hold(&mut self, session: SessionKey, record: TlsRecord) {
        let size = match &record {
            TlsRecord::Data(data) => data.bytes.len(),
            TlsRecord::Context(_) => size_of::<TaskContext>(),
        };
        let first_ns = match &record {
            TlsRecord::Data(data) => data.timestamp_ns,
            TlsRecord::Context(context) => context.timestamp_ns,
        };
        if !self.held.contains_key(&session) {
            if self.held.len() >= MAX_UNTIED_SESSIONS {
                self.counters.tls_records_unmatched += 1;
                return;
            }
            self.held_order.push_back((first_ns, session));
        }
        let begins_with_read =
            matches!(&record, TlsRecord::Data(data) if data.direction == Direction::Read);
        if !self.held.contains_key(&session) && begins_with_read {
            *self.held_reads.entry(session.pid).or_default() += 1;
        }
        let held = self.held.entry(session).or_insert(Held {
            first_ns,
            records: Vec::new(),
            bytes: 0,
            begins_with_read,
        });
        if held.records.len() >= MAX_HELD_RECORDS || held.bytes + size > MAX_HELD_BYTES {
            self.counters.tls_records_unmatched += 1;
            return;
        }
        held.bytes += size;
        held.records.push(record);
    }

    /// Gives up records held longer than [`HOLD_NS`].
    fn expire(&mut self, now_ns: u64) {
        while let Some(&(first_ns, session)) = self.held_order.front() {
            if now_ns.saturating_sub(first_ns) < HOLD_NS {
                break;
            }
            self.held_order.pop_front();
            if self
                .held
                .get(&session)
                .is_some_and(|held| held.first_ns == first_ns)
                && let Some(held) = self.take_held(session)
            {
                self.counters.tls_records_unmatched += held.records.len() as u64;
            }
        }
    }

    fn tie(
        &mut self,
        session: SessionKey,
        connection: ConnectionKey,
        released: &mut Vec<Released>,
    ) {
        self.tied.insert(session, connection);
        let entry = self
            .by_connection
            .entry(connection.id)
            .or_insert((connection.conn_id, Vec::new()));
        if entry.0 != connection.conn_id {
            *entry = (connection.conn_id, Vec::new());
        }
        if !entry.1.contains(&session.ssl) {
            entry.1.push(session.ssl);
        }
        if let Some(held) = self.take_held(session) {
            released.push(Released {
                pid: session.pid,
                connection,
                records: held.records,
            });
        }
    }
}

/// A run of consecutive writes of `session` (in `writes`) whose records make exactly
/// `ciphertext` bytes for one record overhead — plus, for a session's `first` match, the end
/// of its handshake: how many of the session's writes that run ends at (the ones before it
/// went out earlier, unmatched, and are given up with it).
fn matched_writes(
    writes: &VecDeque<SslWrite>,
    session: SessionKey,
    ciphertext: u64,
    first: bool,
) -> Option<usize> {
    let sizes: Vec<u64> = writes
        .iter()
        .filter(|write| write.session == session)
        .map(|write| write.plaintext)
        .collect();
    let extras: &[u64] = if first { &HANDSHAKE_TAILS } else { &[] };
    for start in 0..sizes.len() {
        for overhead in RECORD_OVERHEADS {
            let mut total = 0;
            for (end, size) in sizes.iter().enumerate().skip(start) {
                total += record_bytes(*size, overhead);
                if total == ciphertext || extras.iter().any(|extra| total + extra == ciphertext) {
                    return Some(end + 1);
                }
                if total > ciphertext {
                    break;
                }
            }
        }
    }
    None
}

/// Bytes on the wire for one `SSL_write` of `plaintext` bytes.
fn record_bytes(plaintext: u64, overhead: u64) -> u64 {
    plaintext + plaintext.div_ceil(MAX_RECORD_PLAINTEXT) * overhead
}

fn push_bounded<T>(queue: &mut VecDeque<T>, item: T) {
    if queue.len() >= MAX_THREAD_HISTORY {
        queue.pop_front();
    }
    queue.push_back(item);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::context::WriterTask;

    const PID: u32 = 7;
    const TID: u32 = 70;
    const SSL_A: u64 = 0xa000;
    const SSL_B: u64 = 0xb000;

    fn connection(fd: i32) -> ConnectionKey {
        ConnectionKey {
            id: SocketId { pid: PID, fd },
            conn_id: 100 + fd as u64,
        }
    }

    fn plain(
        ssl: u64,
        direction: Direction,
        bytes: &'static [u8],
        window: (u64, u64),
    ) -> TlsTransfer<'static> {
        TlsTransfer {
            pid: PID,
            tid: TID,
            ssl,
            start_ns: window.0,
            timestamp_ns: window.1,
            direction,
            captured: bytes,
            total_len: bytes.len() as u64,
            tail: &[],
        }
    }

    fn cipher(fd: i32, direction: Direction, total_len: u64, at: u64) -> DataTransfer<'static> {
        let key = connection(fd);
        DataTransfer {
            pid: PID,
            tid: TID,
            fd,
            conn_id: key.conn_id,
            timestamp_ns: at,
            direction,
            captured: &[],
            total_len,
            tail: &[],
            seq: None,
        }
    }

    const REQUEST: &[u8] = b"POST /v1/responses HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}";

    /// What was released, as (connection fd, record kinds and lengths).
    fn released_summary(released: &[Released]) -> Vec<(i32, Vec<u64>)> {
        released
            .iter()
            .map(|r| {
                let records = r
                    .records
                    .iter()
                    .map(|record| match record {
                        TlsRecord::Data(data) => data.total_len,
                        TlsRecord::Context(_) => 0,
                    })
                    .collect();
                (r.connection.id.fd, records)
            })
            .collect()
    }

    #[test]
    fn a_memory_bio_write_is_tied_by_the_length_of_its_records() {
        let mut sessions = TlsSessions::default();
        let mut released = Vec::new();
        // asyncio: SSL_write returns, then the transport sends the records.
        assert_eq!(
            sessions.plaintext(
                &plain(SSL_A, Direction::Write, REQUEST, (10, 11)),
                &mut released
            ),
            None
        );
        // Another connection's ciphertext of another length on the same thread decides nothing.
        sessions.ciphertext(&cipher(4, Direction::Write, 999, 12), &mut released);
        assert!(released.is_empty());
        let records = REQUEST.len() as u64 + 22; // TLS 1.3
        sessions.ciphertext(&cipher(5, Direction::Write, records, 13), &mut released);
        assert_eq!(
            released_summary(&released),
            [(5, vec![REQUEST.len() as u64])]
        );
        assert_eq!(sessions.counters.tls_sessions_by_record_length, 1);
        // Tied from now on, reads included.
        released.clear();
        let response = plain(SSL_A, Direction::Read, b"HTTP/1.1 200 OK\r\n\r\n", (20, 21));
        assert_eq!(
            sessions.plaintext(&response, &mut released),
            Some(connection(5))
        );
        assert!(released.is_empty());
    }

    #[test]
    fn the_end_of_the_handshake_sent_with_the_first_records_still_ties() {
        // uvloop sends the client's ChangeCipherSpec and Finished (6 + 74 bytes with
        // SHA-384) in the same write as the first request's records.
        let mut sessions = TlsSessions::default();
        let mut released = Vec::new();
        sessions.plaintext(
            &plain(SSL_A, Direction::Write, REQUEST, (10, 11)),
            &mut released,
        );
        let first = REQUEST.len() as u64 + 22 + 80;
        sessions.ciphertext(&cipher(5, Direction::Write, first, 12), &mut released);
        assert_eq!(
            released_summary(&released),
            [(5, vec![REQUEST.len() as u64])]
        );
    }

    #[test]
    fn a_write_left_unmatched_does_not_block_the_next() {
        let mut sessions = TlsSessions::default();
        let mut released = Vec::new();
        sessions.plaintext(
            &plain(SSL_A, Direction::Write, REQUEST, (10, 11)),
            &mut released,
        );
        // Its records went out with something the tracer cannot account for.
        sessions.ciphertext(&cipher(5, Direction::Write, 5000, 12), &mut released);
        assert!(released.is_empty());
        let second: &[u8] = b"POST /v1/responses HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello";
        sessions.plaintext(
            &plain(SSL_A, Direction::Write, second, (20, 21)),
            &mut released,
        );
        sessions.ciphertext(
            &cipher(5, Direction::Write, second.len() as u64 + 22, 22),
            &mut released,
        );
        // Both of the session's writes are released, in order.
        assert_eq!(
            released_summary(&released),
            [(5, vec![REQUEST.len() as u64, second.len() as u64])]
        );
    }

    #[test]
    fn two_sessions_that_could_each_explain_a_write_decide_nothing() {
        let mut sessions = TlsSessions::default();
        let mut released = Vec::new();
        sessions.plaintext(
            &plain(SSL_A, Direction::Write, REQUEST, (10, 11)),
            &mut released,
        );
        sessions.plaintext(
            &plain(SSL_B, Direction::Write, REQUEST, (12, 13)),
            &mut released,
        );
        let records = REQUEST.len() as u64 + 22;
        sessions.ciphertext(&cipher(5, Direction::Write, records, 14), &mut released);
        assert!(released.is_empty());
        assert_eq!(sessions.counters.tls_matches_ambiguous, 1);
        // Records are given up when held too long, and counted.
        sessions.plaintext(
            &plain(SSL_B, Direction::Read, b"x", (HOLD_NS + 20, HOLD_NS + 21)),
            &mut released,
        );
        assert_eq!(sessions.counters.tls_records_unmatched, 2);
        sessions.give_up_held();
        assert_eq!(sessions.counters.tls_records_unmatched, 3);
    }

    #[test]
    fn a_server_sessions_held_request_hides_an_inbound_request_until_tied() {
        let mut sessions = TlsSessions::default();
        let mut released = Vec::new();
        // A TLS server reads a request it cannot tie yet.
        sessions.plaintext(
            &plain(SSL_A, Direction::Read, REQUEST, (10, 11)),
            &mut released,
        );
        assert!(sessions.hides_inbound(PID));
        // A client's write held for an instant hides nothing.
        sessions.plaintext(
            &plain(SSL_B, Direction::Write, REQUEST, (12, 13)),
            &mut released,
        );
        // The response ties the server's session: nothing is hidden any more.
        let response: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        sessions.plaintext(
            &plain(SSL_A, Direction::Write, response, (14, 15)),
            &mut released,
        );
        sessions.ciphertext(
            &cipher(5, Direction::Write, response.len() as u64 + 22, 16),
            &mut released,
        );
        assert_eq!(
            released_summary(&released),
            [(5, vec![REQUEST.len() as u64, response.len() as u64])]
        );
        assert!(!sessions.hides_inbound(PID));
        // One that is given up stops hiding too.
        sessions.plaintext(
            &plain(0xc000, Direction::Read, REQUEST, (20, 21)),
            &mut released,
        );
        assert!(sessions.hides_inbound(PID));
        sessions.give_up_held();
        assert!(!sessions.hides_inbound(PID));
    }

    #[test]
    fn a_blocking_socket_is_tied_by_the_transfer_inside_the_call() {
        let mut sessions = TlsSessions::default();
        let mut released = Vec::new();
        // OpenSSL writes the socket itself, between the call's entry (10) and return (20).
        sessions.ciphertext(&cipher(6, Direction::Write, 1234, 15), &mut released);
        assert_eq!(
            sessions.plaintext(
                &plain(SSL_A, Direction::Write, REQUEST, (10, 20)),
                &mut released
            ),
            None
        );
        assert_eq!(
            released_summary(&released),
            [(6, vec![REQUEST.len() as u64])]
        );
        assert_eq!(sessions.counters.tls_sessions_by_syscall, 1);
    }

    #[test]
    fn a_context_waits_with_its_write_and_a_close_unties() {
        let mut sessions = TlsSessions::default();
        let mut released = Vec::new();
        let context = TaskContext {
            pid: PID,
            tid: TID,
            fd: -1,
            conn_id: SSL_A,
            timestamp_ns: 9,
            writer: WriterTask {
                chain: None,
                lineage: None,
            },
        };
        assert_eq!(sessions.context(&context), None);
        sessions.plaintext(
            &plain(SSL_A, Direction::Write, REQUEST, (10, 11)),
            &mut released,
        );
        sessions.ciphertext(
            &cipher(5, Direction::Write, REQUEST.len() as u64 + 22, 12),
            &mut released,
        );
        assert_eq!(
            released_summary(&released),
            [(5, vec![0, REQUEST.len() as u64])]
        );
        assert_eq!(sessions.context(&context), Some(connection(5)));
        // The connection closes; the SSL* address may come back for another connection.
        sessions.closed(connection(5).id, connection(5).conn_id);
        assert_eq!(sessions.context(&context), None);
    }
}
