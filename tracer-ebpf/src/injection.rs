//! `--inject-traceparent`: a cgroup `sock_ops` program that puts traced processes' TCP client
//! sockets in a sockhash, and an `sk_msg` program on that sockhash that inserts the line a
//! write's `sys_enter` armed ([`programs::arm_injection`](crate::programs)).

use core::ptr;

use aya_ebpf::{
    bindings::{
        BPF_ANY, BPF_NOEXIST, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_TCP_CONNECT_CB,
        sk_action,
    },
    helpers::{
        bpf_get_current_pid_tgid,
        generated::{bpf_get_socket_cookie, bpf_msg_pull_data},
    },
    macros::{map, sk_msg, sock_ops},
    maps::{LruHashMap, SockHash},
    programs::{SkMsgContext, SockOpsContext},
};
use tracer_abi::{
    ArmedInjection, INJECT_FAILED, INJECT_SOCKETS_FULL, INJECT_WRITTEN, MAX_PENDING_CALLS,
    TRACEPARENT_LINE,
};

use crate::programs::{INJECT_ARMED, INJECTIONS, count_at, traced_tgid};

/// Sockets a traced process is connecting, by socket cookie, until they are established.
#[map]
static CONNECTING: LruHashMap<u64, u8> = LruHashMap::with_max_entries(MAX_PENDING_CALLS, 0);

/// Traced processes' client sockets: the `sk_msg` program runs on their sends.
#[map]
static INJECT_SOCKETS: SockHash<u64> = SockHash::with_max_entries(65536, 0);

/// Puts a traced process's TCP client sockets in [`INJECT_SOCKETS`]: noted at connect (the
/// only callback that runs in the process), added once established (a map takes only
/// established sockets).
#[sock_ops]
pub fn inject_sockets(ctx: SockOpsContext) -> u32 {
    let op = ctx.op();
    if op == BPF_SOCK_OPS_TCP_CONNECT_CB {
        if traced_tgid().is_some() {
            // SAFETY: the helper takes the program's context.
            let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
            let _ = CONNECTING.insert(&cookie, &1, BPF_ANY as u64);
        }
    } else if op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB {
        // SAFETY: the helper takes the program's context.
        let mut cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
        // SAFETY: only tested for presence.
        if unsafe { CONNECTING.get(&cookie) }.is_some() {
            let _ = CONNECTING.remove(&cookie);
            // SAFETY: the program's own context.
            let ops = unsafe { &mut *ctx.ops };
            if INJECT_SOCKETS
                .update(&mut cookie, ops, BPF_NOEXIST as u64)
                .is_err()
            {
                count_at(&INJECTIONS, INJECT_SOCKETS_FULL);
            }
        }
    }
    1
}

/// Inserts the line armed for this thread after the request line of the message it armed.
#[sk_msg]
pub fn inject_traceparent(ctx: SkMsgContext) -> u32 {
    let tid = bpf_get_current_pid_tgid() as u32;
    // SAFETY: the value is copied out.
    let Some(armed) = (unsafe { INJECT_ARMED.get(&tid) }).copied() else {
        return sk_action::SK_PASS;
    };
    let _ = INJECT_ARMED.remove(&tid);
    let outcome = if insert_line(&ctx, &armed) {
        INJECT_WRITTEN
    } else {
        INJECT_FAILED
    };
    count_at(&INJECTIONS, outcome);
    sk_action::SK_PASS
}

#[inline(always)]
fn insert_line(ctx: &SkMsgContext, armed: &ArmedInjection) -> bool {
    let at = armed.insert_at;
    if at < 8 || at > ctx.size() {
        return false;
    }
    // SAFETY: the helper takes the program's context.
    if unsafe { bpf_msg_pull_data(ctx.msg, 0, 8, 0) } != 0 {
        return false;
    }
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + 8 > end {
        return false;
    }
    // SAFETY: the 8 bytes are inside [data, data_end), as just checked.
    if unsafe { ptr::read_unaligned(data as *const u64) } != armed.first_bytes {
        return false;
    }
    if ctx.push_data(at, TRACEPARENT_LINE as u32, 0).is_err() {
        return false;
    }
    // SAFETY: the helper takes the program's context.
    let pulled = unsafe { bpf_msg_pull_data(ctx.msg, at, at + TRACEPARENT_LINE as u32, 0) };
    let (data, end) = (ctx.data(), ctx.data_end());
    if pulled != 0 || data + TRACEPARENT_LINE > end {
        // Never send the inserted bytes unwritten.
        let _ = ctx.pop_data(at, TRACEPARENT_LINE as u32, 0);
        return false;
    }
    for (index, byte) in armed.line.iter().enumerate() {
        // SAFETY: inside [data, data_end), as just checked.
        unsafe { *((data + index) as *mut u8) = *byte };
    }
    true
}
