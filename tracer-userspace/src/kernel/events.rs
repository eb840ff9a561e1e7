//! Typed views of the ring-buffer records (the ABI structs in `tracer-abi`).
//!
//! Decoding is the only place that reads raw kernel bytes; it checks every length first,
//! because a record is data from the kernel, not a promise.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use thiserror::Error;
use tracer_abi::{
    AF_INET, AF_INET6, ConnOpenEvent, DATA_SEQ_KNOWN, DIRECTION_READ, DIRECTION_WRITE,
    DataEventHeader, EventHeader, EventKind, LINEAGE_OTHER_ROOT, LINEAGE_REQUEST, LINEAGE_UNKNOWN,
    ProcessExecEvent, ProcessForkEvent, ROLE_CLIENT, ROLE_SERVER, TAIL_BYTES, TaskContextEvent,
    TaskLineage, TlsDataHeader, WRITER_LINEAGE_OFF, WRITER_NO_TASK, WRITER_TASK,
    WRITER_TASK_UNSEEN, WRITER_UNREADABLE,
};

use crate::model::context::{ContextChain, Lineage, OriginId, WriterTask};
use crate::model::exchange::InboundSocket;
use crate::model::exchange::Role;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Read,
    Write,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnOpen {
    pub pid: u32,
    pub fd: i32,
    pub conn_id: u64,
    pub timestamp_ns: u64,
    pub role: Role,
    pub local: Option<SocketAddr>,
    pub peer: Option<SocketAddr>,
}

/// One read or write; `captured` borrows from the ring buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataTransfer<'a> {
    pub pid: u32,
    pub tid: u32,
    pub fd: i32,
    pub conn_id: u64,
    pub timestamp_ns: u64,
    pub direction: Direction,
    pub captured: &'a [u8],
    pub total_len: u64,
    pub tail: &'a [u8],
    /// The TCP sequence number of the transfer's first byte (see
    /// [`tracer_abi::DataEventHeader::seq`]), when the kernel could read it.
    pub seq: Option<u32>,
}

/// Plaintext passed to or returned by OpenSSL in a traced process (see
/// [`tracer_abi::TlsDataHeader`]): not yet tied to a connection, only to its `SSL*`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsTransfer<'a> {
    pub pid: u32,
    pub tid: u32,
    /// The `SSL*`: an address in `pid`, stable for the life of one TLS connection.
    pub ssl: u64,
    /// When the call was entered.
    pub start_ns: u64,
    /// When the call returned.
    pub timestamp_ns: u64,
    pub direction: Direction,
    pub captured: &'a [u8],
    pub total_len: u64,
    pub tail: &'a [u8],
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelEvent<'a> {
    Open(ConnOpen),
    Data(DataTransfer<'a>),
    Close {
        pid: u32,
        fd: i32,
        conn_id: u64,
        timestamp_ns: u64,
    },
    ProcessExit {
        pid: u32,
        timestamp_ns: u64,
    },
    /// The process replaced its program; it stays traced.
    ProcessExec {
        pid: u32,
        timestamp_ns: u64,
        /// The new program's task name, as the kernel read it at the exec (NUL-padded).
        comm: [u8; 16],
    },
    /// `child` is already in the kernel's PID filter; it may be a thread, not a process.
    ProcessFork {
        parent: u32,
        child: u32,
    },
    /// The Python task context under which the next write on this socket starts a message
    /// (`fd` -1 and `conn_id` the `SSL*`: the next TLS write of that `SSL*`).
    TaskContext(TaskContext),
    /// The Python task context under which `pid` forked `child`; its [`KernelEvent::ProcessFork`]
    /// follows.
    SpawnContext {
        pid: u32,
        child: u32,
        writer: WriterTask,
    },
    TlsData(TlsTransfer<'a>),
}

/// See [`tracer_abi::TaskContextEvent`]. `chain` is `None` when the kernel could not read
/// even the thread's current context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskContext {
    pub pid: u32,
    pub tid: u32,
    pub fd: i32,
    pub conn_id: u64,
    pub timestamp_ns: u64,
    pub writer: WriterTask,
}

/// The chain and lineage of a [`TaskContextEvent`].
fn writer_task(bytes: &[u8]) -> Result<WriterTask, DecodeError> {
    let event: TaskContextEvent = read_struct(bytes)?;
    let depth = usize::try_from(event.depth).unwrap_or(usize::MAX);
    let links = event
        .chain
        .get(..depth)
        .ok_or(DecodeError::BadField("depth"))?;
    Ok(WriterTask {
        chain: ContextChain::new(links),
        lineage: lineage(event.writer, &event.lineage)?,
    })
}

/// The writer's lineage, as the kernel's `WRITER_*` and `LINEAGE_*` say.
fn lineage(writer: u32, recorded: &TaskLineage) -> Result<Option<Lineage>, DecodeError> {
    Ok(Some(match writer {
        WRITER_LINEAGE_OFF => return Ok(None),
        WRITER_NO_TASK => Lineage::NoTask,
        WRITER_TASK_UNSEEN => Lineage::Unseen,
        WRITER_UNREADABLE => Lineage::Unreadable,
        WRITER_TASK => match recorded.kind {
            LINEAGE_REQUEST => Lineage::Request {
                origin: OriginId(recorded.origin),
                request: (recorded.birth_conn_id != 0).then_some(InboundSocket {
                    fd: recorded.birth_fd,
                    conn_id: recorded.birth_conn_id,
                    requests_before: recorded.birth_responses,
                }),
            },
            LINEAGE_OTHER_ROOT => Lineage::Background,
            LINEAGE_UNKNOWN => Lineage::Unknown,
            _ => return Err(DecodeError::BadField("lineage kind")),
        },
        _ => return Err(DecodeError::BadField("writer")),
    }))
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record of {0} bytes is shorter than its header")]
    Short(usize),
    #[error("unknown record kind {0}")]
    UnknownKind(u8),
    #[error("record field out of range: {0}")]
    BadField(&'static str),
}

fn read_struct<T: Copy>(bytes: &[u8]) -> Result<T, DecodeError> {
    if bytes.len() < size_of::<T>() {
        return Err(DecodeError::Short(bytes.len()));
    }
    // SAFETY: length checked; T is a #[repr(C)] plain-old-data ABI struct, read unaligned.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

fn address(family: u16, raw: [u8; 16], port: u16) -> Option<SocketAddr> {
    let ip = match family {
        AF_INET => IpAddr::V4(Ipv4Addr::new(raw[0], raw[1], raw[2], raw[3])),
        AF_INET6 => {
            let v6 = Ipv6Addr::from(raw);
            // Dual-stack sockets report IPv4 peers as ::ffff:a.b.c.d.
            v6.to_ipv4_mapped()
                .map(IpAddr::V4)
                .unwrap_or(IpAddr::V6(v6))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The direction, captured head and tail of a data record's payload, each length checked.
fn payload_parts<'a>(
    data: &DataEventHeader,
    payload: &'a [u8],
) -> Result<(Direction, &'a [u8], &'a [u8]), DecodeError> {
    let captured_len = data.captured_len as usize;
    if captured_len > payload.len() || captured_len as u64 > data.total_len {
        return Err(DecodeError::BadField("captured_len"));
    }
    // The tail follows the head in the payload.
    let tail_len = usize::from(data.tail_len);
    if tail_len > TAIL_BYTES || captured_len + tail_len > payload.len() {
        return Err(DecodeError::BadField("tail_len"));
    }
    let direction = match data.direction {
        DIRECTION_READ => Direction::Read,
        DIRECTION_WRITE => Direction::Write,
        _ => return Err(DecodeError::BadField("direction")),
    };
    Ok((
        direction,
        &payload[..captured_len],
        &payload[captured_len..captured_len + tail_len],
    ))
}

pub fn decode(bytes: &[u8]) -> Result<KernelEvent<'_>, DecodeError> {
    let header: EventHeader = read_struct(bytes)?;
    let kind = EventKind::from_u8(header.kind).ok_or(DecodeError::UnknownKind(header.kind))?;
    Ok(match kind {
        EventKind::ConnOpen => {
            let open: ConnOpenEvent = read_struct(bytes)?;
            let role = match open.role {
                ROLE_SERVER => Role::Server,
                ROLE_CLIENT => Role::Client,
                _ => return Err(DecodeError::BadField("role")),
            };
            KernelEvent::Open(ConnOpen {
                pid: header.tgid,
                fd: header.fd,
                conn_id: header.conn_id,
                timestamp_ns: header.timestamp_ns,
                role,
                local: address(open.family, open.local_addr, open.local_port),
                peer: address(open.family, open.peer_addr, open.peer_port),
            })
        }
        EventKind::Data => {
            let data: DataEventHeader = read_struct(bytes)?;
            let (direction, captured, tail) =
                payload_parts(&data, &bytes[size_of::<DataEventHeader>()..])?;
            KernelEvent::Data(DataTransfer {
                pid: header.tgid,
                tid: header.tid,
                fd: header.fd,
                conn_id: header.conn_id,
                timestamp_ns: header.timestamp_ns,
                direction,
                captured,
                total_len: data.total_len,
                tail,
                seq: (data.flags & DATA_SEQ_KNOWN != 0).then_some(data.seq),
            })
        }
        EventKind::TlsData => {
            let tls: TlsDataHeader = read_struct(bytes)?;
            let (direction, captured, tail) =
                payload_parts(&tls.data, &bytes[size_of::<TlsDataHeader>()..])?;
            if tls.start_ns > header.timestamp_ns {
                return Err(DecodeError::BadField("start_ns"));
            }
            KernelEvent::TlsData(TlsTransfer {
                pid: header.tgid,
                tid: header.tid,
                ssl: header.conn_id,
                start_ns: tls.start_ns,
                timestamp_ns: header.timestamp_ns,
                direction,
                captured,
                total_len: tls.data.total_len,
                tail,
            })
        }
        EventKind::ConnClose => KernelEvent::Close {
            pid: header.tgid,
            fd: header.fd,
            conn_id: header.conn_id,
            timestamp_ns: header.timestamp_ns,
        },
        EventKind::ProcessExit => KernelEvent::ProcessExit {
            pid: header.tgid,
            timestamp_ns: header.timestamp_ns,
        },
        EventKind::ProcessExec => {
            let exec: ProcessExecEvent = read_struct(bytes)?;
            KernelEvent::ProcessExec {
                pid: header.tgid,
                timestamp_ns: header.timestamp_ns,
                comm: exec.comm,
            }
        }
        EventKind::TaskContext => KernelEvent::TaskContext(TaskContext {
            pid: header.tgid,
            tid: header.tid,
            fd: header.fd,
            conn_id: header.conn_id,
            timestamp_ns: header.timestamp_ns,
            writer: writer_task(bytes)?,
        }),
        EventKind::SpawnContext => KernelEvent::SpawnContext {
            pid: header.tgid,
            child: u32::try_from(header.conn_id).map_err(|_| DecodeError::BadField("child"))?,
            writer: writer_task(bytes)?,
        },
        EventKind::ProcessFork => {
            let fork: ProcessForkEvent = read_struct(bytes)?;
            KernelEvent::ProcessFork {
                parent: header.tgid,
                child: fork.child_pid,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn as_bytes<T>(value: &T) -> Vec<u8> {
        // SAFETY: test-only view of a plain-old-data struct.
        unsafe {
            std::slice::from_raw_parts(std::ptr::from_ref(value).cast::<u8>(), size_of::<T>())
        }
        .to_vec()
    }

    #[test]
    fn decodes_a_data_record_with_payload_and_tail() {
        let mut header = DataEventHeader::default();
        header.header.kind = EventKind::Data as u8;
        header.header.tgid = 42;
        header.direction = DIRECTION_WRITE;
        header.captured_len = 3;
        header.total_len = 100;
        header.tail_len = 5;
        let mut bytes = as_bytes(&header);
        bytes.extend_from_slice(b"abc0\r\n\r\n");
        let KernelEvent::Data(data) = decode(&bytes).unwrap() else {
            panic!()
        };
        assert_eq!(data.captured, b"abc");
        assert_eq!(data.tail, b"0\r\n\r\n");
        assert_eq!(data.direction, Direction::Write);
        assert_eq!(
            data.seq, None,
            "no sequence number unless the kernel says it read one"
        );
        header.seq = 0xffff_fff0;
        header.flags = DATA_SEQ_KNOWN;
        let mut bytes = as_bytes(&header);
        bytes.extend_from_slice(b"abc0\r\n\r\n");
        let KernelEvent::Data(data) = decode(&bytes).unwrap() else {
            panic!()
        };
        assert_eq!(data.seq, Some(0xffff_fff0));
    }

    #[test]
    fn rejects_inconsistent_records() {
        assert_eq!(decode(&[1, 2]), Err(DecodeError::Short(2)));
        let mut header = DataEventHeader::default();
        header.header.kind = EventKind::Data as u8;
        header.direction = DIRECTION_READ;
        header.captured_len = 50; // more than the record carries
        header.total_len = 50;
        assert_eq!(
            decode(&as_bytes(&header)),
            Err(DecodeError::BadField("captured_len"))
        );
        let mut bad = as_bytes(&header);
        bad[0] = 99;
        assert_eq!(decode(&bad), Err(DecodeError::UnknownKind(99)));

        // A tail that the payload does not hold, or longer than the kernel ever sends.
        header.captured_len = 3;
        header.tail_len = 5;
        let mut short = as_bytes(&header);
        short.extend_from_slice(b"abc0\r\n");
        assert_eq!(decode(&short), Err(DecodeError::BadField("tail_len")));
        header.tail_len = (TAIL_BYTES + 1) as u16;
        header.total_len = 1000;
        let mut long = as_bytes(&header);
        long.extend_from_slice(&[b'x'; 3 + TAIL_BYTES + 1]);
        assert_eq!(decode(&long), Err(DecodeError::BadField("tail_len")));
    }

    #[test]
    fn decodes_a_tls_record_by_its_ssl_pointer_and_checks_its_times() {
        let mut header = TlsDataHeader::default();
        header.data.header.kind = EventKind::TlsData as u8;
        header.data.header.tgid = 42;
        header.data.header.fd = -1;
        header.data.header.conn_id = 0x5555_0000_1230;
        header.data.header.timestamp_ns = 2_000;
        header.start_ns = 1_500;
        header.data.direction = DIRECTION_READ;
        header.data.captured_len = 4;
        header.data.total_len = 4;
        let mut bytes = as_bytes(&header);
        bytes.extend_from_slice(b"HTTP");
        let KernelEvent::TlsData(tls) = decode(&bytes).unwrap() else {
            panic!()
        };
        assert_eq!(
            (tls.ssl, tls.start_ns, tls.timestamp_ns),
            (0x5555_0000_1230, 1_500, 2_000)
        );
        assert_eq!(tls.captured, b"HTTP");
        // A call that returned before it was entered is no record to trust.
        header.start_ns = 3_000;
        let mut bytes = as_bytes(&header);
        bytes.extend_from_slice(b"HTTP");
        assert_eq!(decode(&bytes), Err(DecodeError::BadField("start_ns")));
    }

    #[test]
    fn a_full_length_tail_follows_a_full_head() {
        let mut header = DataEventHeader::default();
        header.header.kind = EventKind::Data as u8;
        header.direction = DIRECTION_WRITE;
        header.captured_len = 4096;
        header.total_len = 11_100;
        header.tail_len = TAIL_BYTES as u16;
        let mut bytes = as_bytes(&header);
        bytes.extend(std::iter::repeat_n(b'h', 4096));
        let tail: Vec<u8> = (0..TAIL_BYTES).map(|i| i as u8).collect();
        bytes.extend_from_slice(&tail);
        let KernelEvent::Data(data) = decode(&bytes).unwrap() else {
            panic!()
        };
        assert_eq!(data.captured.len(), 4096);
        assert_eq!(data.tail, tail.as_slice());
    }

    #[test]
    fn decodes_task_context_chains() {
        let mut event = TaskContextEvent::default();
        event.header.kind = EventKind::TaskContext as u8;
        event.header.tgid = 7;
        event.header.tid = 8;
        event.header.fd = 9;
        event.header.conn_id = 10;
        event.depth = 3;
        event.chain[..3].copy_from_slice(&[0x30, 0x20, 0x10]);
        let KernelEvent::TaskContext(context) = decode(&as_bytes(&event)).unwrap() else {
            panic!()
        };
        assert_eq!(
            (context.pid, context.tid, context.fd, context.conn_id),
            (7, 8, 9, 10)
        );
        assert_eq!(context.writer.chain.unwrap().links(), &[0x30, 0x20, 0x10]);
        assert_eq!(context.writer.lineage, None, "a process without the probe");
        event.depth = 0;
        let KernelEvent::TaskContext(context) = decode(&as_bytes(&event)).unwrap() else {
            panic!()
        };
        assert_eq!(context.writer.chain, None);
        event.depth = 9;
        assert_eq!(
            decode(&as_bytes(&event)),
            Err(DecodeError::BadField("depth"))
        );
        assert!(matches!(
            decode(&as_bytes(&event)[..40]),
            Err(DecodeError::Short(40))
        ));
    }

    #[test]
    fn decodes_the_writers_lineage() {
        let mut event = TaskContextEvent::default();
        event.header.kind = EventKind::TaskContext as u8;
        event.writer = WRITER_TASK;
        event.lineage = TaskLineage {
            origin: 0x5001,
            birth_conn_id: 77,
            birth_fd: 12,
            birth_responses: 3,
            kind: LINEAGE_REQUEST,
            _pad: 0,
        };
        let lineage = |event: &TaskContextEvent| match decode(&as_bytes(event)) {
            Ok(KernelEvent::TaskContext(context)) => Ok(context.writer.lineage),
            Ok(other) => panic!("{other:?}"),
            Err(error) => Err(error),
        };
        assert_eq!(
            lineage(&event),
            Ok(Some(Lineage::Request {
                origin: OriginId(0x5001),
                request: Some(InboundSocket {
                    fd: 12,
                    conn_id: 77,
                    requests_before: 3
                })
            }))
        );
        event.lineage.birth_conn_id = 0;
        assert_eq!(
            lineage(&event),
            Ok(Some(Lineage::Request {
                origin: OriginId(0x5001),
                request: None
            }))
        );
        event.lineage.kind = LINEAGE_OTHER_ROOT;
        assert_eq!(lineage(&event), Ok(Some(Lineage::Background)));
        event.lineage.kind = LINEAGE_UNKNOWN;
        assert_eq!(lineage(&event), Ok(Some(Lineage::Unknown)));
        event.lineage.kind = 9;
        assert_eq!(lineage(&event), Err(DecodeError::BadField("lineage kind")));
        for (writer, expected) in [
            (WRITER_LINEAGE_OFF, None),
            (WRITER_NO_TASK, Some(Lineage::NoTask)),
            (WRITER_TASK_UNSEEN, Some(Lineage::Unseen)),
            (WRITER_UNREADABLE, Some(Lineage::Unreadable)),
        ] {
            event.writer = writer;
            assert_eq!(lineage(&event), Ok(expected));
        }
        event.writer = 42;
        assert_eq!(lineage(&event), Err(DecodeError::BadField("writer")));
    }

    #[test]
    fn decodes_ipv4_mapped_addresses_as_ipv4() {
        let mut open = ConnOpenEvent::default();
        open.header.kind = EventKind::ConnOpen as u8;
        open.role = ROLE_SERVER;
        open.family = AF_INET6;
        open.peer_addr = Ipv4Addr::new(127, 0, 0, 1).to_ipv6_mapped().octets();
        open.peer_port = 5000;
        let KernelEvent::Open(open) = decode(&as_bytes(&open)).unwrap() else {
            panic!()
        };
        assert_eq!(open.peer, Some("127.0.0.1:5000".parse().unwrap()));
    }
}
