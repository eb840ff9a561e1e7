//! Bounded reads of another process's memory. Everything read is untrusted: the process may
//! be changing it while we read, or it may not be CPython at all.

use thiserror::Error;

/// The longest single read: the largest thing read whole is the head of `_Py_DebugOffsets`
/// (a few hundred bytes); anything longer asked for is a bug or a corrupt length.
pub const MAX_READ_BYTES: usize = 4096;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ReadError {
    #[error("refused to follow a NULL pointer")]
    Null,
    #[error("refused a read of {0} bytes (more than {MAX_READ_BYTES})")]
    TooLong(usize),
    #[error("address {0:#x} + length overflows")]
    Overflow(u64),
    #[error("reading {len} bytes at {address:#x}: errno {errno}")]
    Failed {
        address: u64,
        len: usize,
        errno: i32,
    },
    #[error("short read at {address:#x}: {got} of {len} bytes")]
    Short {
        address: u64,
        len: usize,
        got: usize,
    },
}

/// A source of another process's bytes. A trait so the walks above it can be tested on
/// recorded memory.
pub trait Memory {
    /// Fills `buf` from `address`, whole or not at all.
    fn read_exact(&self, address: u64, buf: &mut [u8]) -> Result<(), ReadError>;

    fn read_u64(&self, address: u64) -> Result<u64, ReadError> {
        let mut b = [0u8; 8];
        self.read_exact(address, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    /// A pointer field: NULL is an error here so no walk ever dereferences it.
    fn read_pointer(&self, address: u64) -> Result<u64, ReadError> {
        match self.read_u64(address)? {
            0 => Err(ReadError::Null),
            p => Ok(p),
        }
    }

    fn read_bytes(&self, address: u64, len: usize) -> Result<Vec<u8>, ReadError> {
        let mut buf = vec![0u8; checked_len(address, len)?];
        self.read_exact(address, &mut buf)?;
        Ok(buf)
    }
}

/// Every read's checks, before any syscall: non-NULL, capped, no wrap-around.
pub fn checked_len(address: u64, len: usize) -> Result<usize, ReadError> {
    if address == 0 {
        return Err(ReadError::Null);
    }
    if len > MAX_READ_BYTES {
        return Err(ReadError::TooLong(len));
    }
    address
        .checked_add(len as u64)
        .ok_or(ReadError::Overflow(address))?;
    Ok(len)
}

/// A live process read with `process_vm_readv`: no ptrace stop, nothing written, the same
/// permission as ptrace-read (root or the same user under Yama scope 0/1 as parent).
pub struct ProcessMemory {
    pid: libc::pid_t,
}

impl ProcessMemory {
    pub fn new(pid: u32) -> Option<Self> {
        libc::pid_t::try_from(pid).ok().map(|pid| Self { pid })
    }
}

impl Memory for ProcessMemory {
    fn read_exact(&self, address: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        let len = checked_len(address, buf.len())?;
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: len,
        };
        let remote = libc::iovec {
            iov_base: address as *mut libc::c_void,
            iov_len: len,
        };
        // SAFETY: `local` describes `buf`, which is valid for `len` writable bytes for the
        // whole call; `remote` is only an address in the other process, which the kernel
        // checks (EFAULT) and never dereferences in ours.
        let got = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
        match usize::try_from(got) {
            Err(_) => Err(ReadError::Failed {
                address,
                len,
                errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
            }),
            Ok(got) if got != len => Err(ReadError::Short { address, len, got }),
            Ok(_) => Ok(()),
        }
    }
}

#[cfg(test)]
pub mod recorded {
    //! Memory made of recorded regions, for tests of the walks.
    use super::*;
    use std::collections::BTreeMap;

    #[derive(Default)]
    pub struct RecordedMemory {
        regions: BTreeMap<u64, Vec<u8>>,
    }

    impl RecordedMemory {
        pub fn put(&mut self, address: u64, bytes: &[u8]) {
            self.regions.insert(address, bytes.to_vec());
        }
        pub fn put_u64(&mut self, address: u64, value: u64) {
            self.put(address, &value.to_ne_bytes());
        }
    }

    impl Memory for RecordedMemory {
        fn read_exact(&self, address: u64, buf: &mut [u8]) -> Result<(), ReadError> {
            let len = checked_len(address, buf.len())?;
            let found = self
                .regions
                .range(..=address)
                .next_back()
                .and_then(|(&start, bytes)| {
                    let from = usize::try_from(address - start).ok()?;
                    bytes.get(from..from.checked_add(len)?)
                });
            match found {
                Some(bytes) => {
                    buf.copy_from_slice(bytes);
                    Ok(())
                }
                None => Err(ReadError::Short {
                    address,
                    len,
                    got: 0,
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::recorded::RecordedMemory;
    use super::*;

    #[test]
    fn reads_are_checked_before_any_syscall() {
        assert_eq!(checked_len(0, 8), Err(ReadError::Null));
        assert_eq!(
            checked_len(0x1000, MAX_READ_BYTES + 1),
            Err(ReadError::TooLong(4097))
        );
        assert_eq!(
            checked_len(u64::MAX - 3, 8),
            Err(ReadError::Overflow(u64::MAX - 3))
        );
        assert_eq!(checked_len(0x1000, MAX_READ_BYTES), Ok(MAX_READ_BYTES));
    }

    #[test]
    fn a_null_pointer_field_stops_the_walk() {
        let mut m = RecordedMemory::default();
        m.put_u64(0x1000, 0);
        m.put_u64(0x1008, 0x2000);
        assert_eq!(m.read_pointer(0x1000), Err(ReadError::Null));
        assert_eq!(m.read_pointer(0x1008), Ok(0x2000));
        assert!(
            matches!(m.read_u64(0x1004), Err(ReadError::Short { .. })),
            "past the region"
        );
    }

    #[test]
    fn an_unmapped_address_of_a_live_process_fails_without_harm() {
        let me = ProcessMemory::new(std::process::id()).expect("our pid fits");
        let mut buf = [0u8; 8];
        assert!(matches!(
            me.read_exact(0x10, &mut buf),
            Err(ReadError::Failed { .. })
        ));
        let value: u64 = 0x1122_3344_5566_7788;
        let at = std::ptr::from_ref(&value) as u64;
        assert_eq!(me.read_u64(at), Ok(value));
        assert_eq!(
            me.read_bytes(at, MAX_READ_BYTES + 1),
            Err(ReadError::TooLong(4097))
        );
    }
}
