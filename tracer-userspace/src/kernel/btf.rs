//! Kernel struct field offsets from BTF (`/sys/kernel/btf/vmlinux`).
//!
//! Rust eBPF has no CO-RE field relocations and aya's `Btf` does not expose member offsets, so
//! this reads the BTF type section directly: enough of it to find a struct by name and a
//! member by name, descending into anonymous unions and structs as C does.

use std::collections::HashMap;

use anyhow::{Context, Result, bail};
use tracer_abi::KernelOffsets;

const BTF_MAGIC: u16 = 0xeb9f;

const KIND_INT: u32 = 1;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;

#[derive(Clone, Debug)]
struct Member {
    name_off: u32,
    type_id: u32,
    bit_offset: u32,
}

#[derive(Clone, Debug)]
struct Type {
    name_off: u32,
    kind: u32,
    /// Referenced type for typedef/const/volatile/...
    type_ref: u32,
    members: Vec<Member>,
}

pub struct Btf {
    types: Vec<Type>,
    strings: Vec<u8>,
    structs_by_name: HashMap<String, u32>,
}

fn u16_at(data: &[u8], at: usize) -> Result<u16> {
    Ok(u16::from_le_bytes(
        data.get(at..at + 2).context("BTF truncated")?.try_into()?,
    ))
}

fn u32_at(data: &[u8], at: usize) -> Result<u32> {
    Ok(u32::from_le_bytes(
        data.get(at..at + 4).context("BTF truncated")?.try_into()?,
    ))
}

impl Btf {
    pub fn parse(data: &[u8]) -> Result<Self> {
        if u16_at(data, 0)? != BTF_MAGIC {
            bail!("not BTF data (bad magic); only little-endian hosts are supported");
        }
        let header_len = u32_at(data, 4)? as usize;
        let type_off = u32_at(data, 8)? as usize;
        let type_len = u32_at(data, 12)? as usize;
        let str_off = u32_at(data, 16)? as usize;
        let str_len = u32_at(data, 20)? as usize;
        let type_section = data
            .get(header_len + type_off..header_len + type_off + type_len)
            .context("BTF type section out of bounds")?;
        let strings = data
            .get(header_len + str_off..header_len + str_off + str_len)
            .context("BTF string section out of bounds")?
            .to_vec();

        // Type id 0 is `void`.
        let mut types = vec![Type {
            name_off: 0,
            kind: 0,
            type_ref: 0,
            members: Vec::new(),
        }];
        let mut at = 0;
        while at < type_section.len() {
            let name_off = u32_at(type_section, at)?;
            let info = u32_at(type_section, at + 4)?;
            let size_or_type = u32_at(type_section, at + 8)?;
            at += 12;
            let vlen = (info & 0xffff) as usize;
            let kind = (info >> 24) & 0x1f;
            let kind_flag = info >> 31 == 1;
            let mut members = Vec::new();
            match kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => at += 4,
                KIND_ARRAY => at += 12,
                KIND_STRUCT | KIND_UNION => {
                    for _ in 0..vlen {
                        let offset = u32_at(type_section, at + 8)?;
                        members.push(Member {
                            name_off: u32_at(type_section, at)?,
                            type_id: u32_at(type_section, at + 4)?,
                            bit_offset: if kind_flag {
                                offset & 0x00ff_ffff
                            } else {
                                offset
                            },
                        });
                        at += 12;
                    }
                }
                KIND_ENUM | KIND_FUNC_PROTO => at += 8 * vlen,
                KIND_DATASEC | KIND_ENUM64 => at += 12 * vlen,
                _ => {}
            }
            types.push(Type {
                name_off,
                kind,
                type_ref: size_or_type,
                members,
            });
        }

        let mut btf = Btf {
            types,
            strings,
            structs_by_name: HashMap::new(),
        };
        for (id, ty) in btf.types.iter().enumerate() {
            if ty.kind == KIND_STRUCT && ty.name_off != 0 {
                let name = btf.name(ty.name_off).to_string();
                btf.structs_by_name.entry(name).or_insert(id as u32);
            }
        }
        Ok(btf)
    }

    fn name(&self, offset: u32) -> &str {
        let start = offset as usize;
        let Some(rest) = self.strings.get(start..) else {
            return "";
        };
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).unwrap_or("")
    }

    fn resolve(&self, mut id: u32) -> u32 {
        for _ in 0..32 {
            match self.types.get(id as usize).map(|t| t.kind) {
                Some(KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG) => {
                    id = self.types[id as usize].type_ref;
                }
                _ => break,
            }
        }
        id
    }

    /// Bit offset of `member` inside the type `id`, looking through anonymous members.
    fn find_member(&self, id: u32, member: &str, depth: u32) -> Option<u32> {
        if depth > 8 {
            return None;
        }
        let ty = self.types.get(self.resolve(id) as usize)?;
        for m in &ty.members {
            if m.name_off != 0 && self.name(m.name_off) == member {
                return Some(m.bit_offset);
            }
        }
        for m in &ty.members {
            if m.name_off == 0
                && let Some(inner) = self.find_member(m.type_id, member, depth + 1)
            {
                return Some(m.bit_offset + inner);
            }
        }
        None
    }

    /// Byte offset of `structure.member`.
    pub fn member_offset(&self, structure: &str, member: &str) -> Result<u32> {
        let id = *self
            .structs_by_name
            .get(structure)
            .with_context(|| format!("struct {structure} not found in kernel BTF"))?;
        let bits = self
            .find_member(id, member, 0)
            .with_context(|| format!("field {structure}.{member} not found in kernel BTF"))?;
        if bits % 8 != 0 {
            bail!("field {structure}.{member} is a bitfield");
        }
        Ok(bits / 8)
    }

    /// Every offset the eBPF programs need to read a socket's addresses.
    pub fn kernel_offsets(&self) -> Result<KernelOffsets> {
        let sk_common = self.member_offset("sock", "__sk_common")?;
        let common = |field: &str| -> Result<u32> {
            Ok(sk_common + self.member_offset("sock_common", field)?)
        };
        Ok(KernelOffsets {
            valid: 1,
            task_files: self.member_offset("task_struct", "files")?,
            files_fdt: self.member_offset("files_struct", "fdt")?,
            fdtable_fd: self.member_offset("fdtable", "fd")?,
            file_private_data: self.member_offset("file", "private_data")?,
            socket_type: self.member_offset("socket", "type")?,
            socket_sk: self.member_offset("socket", "sk")?,
            sock_family: common("skc_family")?,
            sock_daddr: common("skc_daddr")?,
            sock_rcv_saddr: common("skc_rcv_saddr")?,
            sock_dport: common("skc_dport")?,
            sock_num: common("skc_num")?,
            sock_v6_daddr: common("skc_v6_daddr")?,
            sock_v6_rcv_saddr: common("skc_v6_rcv_saddr")?,
            socket_file: self.member_offset("socket", "file")?,
            ..self.sequence_offsets().unwrap_or_default()
        })
    }

    /// The offsets of TCP sequence numbers, `seq_valid` set; an error names the field this
    /// kernel lacks (the addresses do not need them, so they are looked up apart).
    pub fn sequence_offsets(&self) -> Result<KernelOffsets> {
        Ok(KernelOffsets {
            seq_valid: 1,
            sock_protocol: self.member_offset("sock", "sk_protocol")?,
            tcp_write_seq: self.member_offset("tcp_sock", "write_seq")?,
            tcp_copied_seq: self.member_offset("tcp_sock", "copied_seq")?,
            ..KernelOffsets::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a tiny BTF blob: `struct outer { int a; union { int b; struct { int c; }; }; }`.
    fn sample() -> Vec<u8> {
        let strings = b"\0int\0outer\0a\0b\0c\0".to_vec();
        let (int, outer, a, b, c) = (1u32, 5u32, 11u32, 13u32, 15u32);
        let mut types = Vec::new();
        let mut push = |words: &[u32]| {
            for w in words {
                types.extend_from_slice(&w.to_le_bytes());
            }
        };
        // 1: int (size 4)
        push(&[int, KIND_INT << 24, 4, 32]);
        // 2: anonymous struct { int c; }
        push(&[0, (KIND_STRUCT << 24) | 1, 4, c, 1, 0]);
        // 3: anonymous union { int b; struct {...}; }
        push(&[0, (KIND_UNION << 24) | 2, 4, b, 1, 0, 0, 2, 0]);
        // 4: struct outer { int a; union ...; } with the union at byte 8
        push(&[outer, (KIND_STRUCT << 24) | 2, 12, a, 1, 0, 0, 3, 64]);
        let mut blob = Vec::new();
        blob.extend_from_slice(&BTF_MAGIC.to_le_bytes());
        blob.extend_from_slice(&[1, 0]);
        for w in [
            24u32,
            0,
            types.len() as u32,
            types.len() as u32,
            strings.len() as u32,
        ] {
            blob.extend_from_slice(&w.to_le_bytes());
        }
        blob.extend_from_slice(&types);
        blob.extend_from_slice(&strings);
        blob
    }

    #[test]
    fn finds_members_through_anonymous_unions() {
        let btf = Btf::parse(&sample()).unwrap();
        assert_eq!(btf.member_offset("outer", "a").unwrap(), 0);
        assert_eq!(btf.member_offset("outer", "b").unwrap(), 8);
        assert_eq!(btf.member_offset("outer", "c").unwrap(), 8);
        assert!(btf.member_offset("outer", "missing").is_err());
        assert!(btf.member_offset("nothere", "a").is_err());
    }

    /// The machines the project's kernel-facing tests run on have BTF, so a missing
    /// `/sys/kernel/btf/vmlinux` is a failure here, not a skip: a test that passed without
    /// BTF would say nothing about this kernel's offsets.
    #[test]
    fn reads_this_kernels_socket_offsets() {
        let data = std::fs::read("/sys/kernel/btf/vmlinux").unwrap_or_else(|error| {
            panic!(
                "/sys/kernel/btf/vmlinux unreadable ({error}): run this test on a kernel built \
                 with CONFIG_DEBUG_INFO_BTF=y (the synthetic test above covers the parser alone)"
            )
        });
        let offsets = Btf::parse(&data).unwrap().kernel_offsets().unwrap();
        assert_eq!(offsets.valid, 1);
        // sock_common starts with the address pair, then the port pair.
        assert_eq!(offsets.sock_daddr, 0);
        assert_eq!(offsets.sock_rcv_saddr, 4);
        assert_eq!(offsets.sock_dport, 12);
        assert_eq!(offsets.sock_num, 14);
        // tcp_sock begins with inet_connection_sock, which begins with inet_sock, which
        // begins with sock: one pointer reads all three, the sequence numbers well past sock.
        assert_eq!(offsets.seq_valid, 1);
        let sock_size = offsets.sock_protocol + 2;
        assert!(offsets.tcp_write_seq > sock_size && offsets.tcp_copied_seq > sock_size);
    }
}
