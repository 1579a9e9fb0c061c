//! The sender thread: this side's messages and the replies the receiver
//! asks for, written straight from registered memory.

use super::*;

pub(super) fn sender(inner: &Inner) {
    let fd = inner.fd;
    loop {
        let work = {
            let mut st = inner.lock();
            loop {
                match next(&mut st) {
                    Next::Wait => st = inner.work.wait(st).unwrap_or_else(|e| e.into_inner()),
                    Next::HangUp => {
                        st.sender_done = true;
                        inner.wake(&st);
                        drop(st);
                        inner.hang_up();
                        return;
                    }
                    Next::Write(work) => {
                        match &work {
                            // Shutdown may be waiting for the control queue to drain.
                            Work::Ctl(_) if st.q.lost().is_some() => inner.wake(&st),
                            Work::Out(o, _) if !st.writing => inner.start_write(&mut st, o),
                            _ => {}
                        }
                        break work;
                    }
                }
            }
        };
        let outcome = match work {
            Work::Rest(h, sent) => {
                // SAFETY: no payload.
                let r = unsafe { send_frame(fd, &h, std::ptr::null(), 0, None, sent, false, None) }.map(drop);
                inner.lock().writing = false;
                r
            }
            Work::Ctl(c) => {
                let r = match c {
                    Ctl::Ack { seq, status } => send_header(
                        fd,
                        &FrameHeader { op: FrameOp::Ack as u8, seq, total: status, ..FrameHeader::default() },
                    ),
                    Ctl::Bye => {
                        let _ = send_header(fd, &FrameHeader { op: FrameOp::Bye as u8, ..FrameHeader::default() });
                        Ok(())
                    }
                    Ctl::ReadResp { seq, entry, addr, len } => send_read_response(fd, seq, &entry, addr, len),
                };
                inner.lock().writing = false;
                r
            }
            Work::Out(mut o, more) => {
                let r = send_message(fd, &o, more, &inner.tx);
                inner.recycle(&mut o);
                inner.end_write(&mut inner.lock(), &o, r.is_err());
                r
            }
        };
        if let Err(e) = outcome {
            let mut st = inner.lock();
            inner.break_with(&mut st, format!("sending to the peer failed: {e}"));
            // Keep serving the control queue until stopped (the frames fail fast).
        }
    }
}

/// One attempt, without blocking, to write an inline message's whole frame
/// (header and data); how many bytes of it the socket took.
pub(super) fn try_send_inline(fd: RawFd, o: &Out, tx: &AtomicU64) -> io::Result<usize> {
    let OutKind::Inline { data, imm, .. } = &o.kind else {
        return Ok(0);
    };
    let flags = FIRST | LAST | if imm.is_some() { IMM } else { 0 } | if wants_ack(o) { ACK } else { 0 };
    let h = FrameHeader {
        op: FrameOp::Send as u8,
        flags,
        seq: o.seq,
        key: 0,
        imm: imm.unwrap_or(0),
        addr: 0,
        len: data.len() as u32,
        total: data.len() as u32,
    };
    let head = h.encode();
    let mut iov = [
        libc::iovec { iov_base: head.as_ptr() as *mut libc::c_void, iov_len: HEADER },
        libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() },
    ];
    // SAFETY: a zeroed msghdr is valid; the iovecs and what they point to
    // (the header on this stack, the message's own copy) outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    report(Some((tx, 0)), 0, true);
    let r = sent_without_waiting(|| {
        // SAFETY: valid socket, message and buffers; MSG_NOSIGNAL instead of SIGPIPE.
        unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) }
    });
    report(Some((tx, 0)), *r.as_ref().unwrap_or(&0), false);
    r
}

/// Writes message `o` (from `o.skip` bytes on), reporting its progress
/// through `tx`.
pub(super) fn send_message(fd: RawFd, o: &Out, more: bool, tx: &AtomicU64) -> io::Result<()> {
    let (op, key, raddr, imm) = match &o.kind {
        OutKind::Send { imm } | OutKind::Inline { imm, .. } => (FrameOp::Send, 0, 0, *imm),
        OutKind::Write { raddr, key, imm } => (FrameOp::Write, *key, *raddr, *imm),
        OutKind::ReadReq { raddr, key } => (FrameOp::ReadReq, *key, *raddr, None),
    };
    let payload: Option<(*const u8, u64)> = match &o.kind {
        OutKind::Inline { data, .. } => Some((data.as_ptr(), data.len() as u64)),
        OutKind::ReadReq { .. } => None,
        _ => Some((o.addr as *const u8, o.len)),
    };
    let total = u32::try_from(o.len).unwrap_or(u32::MAX);
    let imm_flag = if imm.is_some() { IMM } else { 0 } | if wants_ack(o) { ACK } else { 0 };
    let Some((ptr, len)) = payload else {
        let h = FrameHeader { op: op as u8, flags: FIRST | LAST, seq: o.seq, key, imm: 0, addr: raddr, len: 0, total };
        // SAFETY: no payload.
        return unsafe { send_frame(fd, &h, std::ptr::null(), 0, None, o.skip, more, Some((tx, 0))) }.map(drop);
    };
    let mut off = 0u64;
    // The message's bytes on the wire before this frame.
    let mut wire = 0u64;
    loop {
        let n = (len - off).min(SEGMENT as u64);
        let mut flags = imm_flag;
        if off == 0 {
            flags |= FIRST;
        }
        if off + n >= len {
            flags |= LAST;
        }
        let h = FrameHeader {
            op: op as u8,
            flags,
            seq: o.seq,
            key,
            imm: imm.unwrap_or(0),
            addr: raddr + off,
            len: n as u32,
            total,
        };
        let last = off + n >= len;
        // SAFETY: the message's source is a registered buffer owned by its
        // operation until this thread reports the operation complete, or an
        // inline copy owned by `o`.
        unsafe {
            send_frame(
                fd,
                &h,
                ptr.add(off as usize),
                n as usize,
                None,
                if off == 0 { o.skip } else { 0 },
                more || !last,
                Some((tx, wire)),
            )?
        };
        off += n;
        wire += HEADER as u64 + n;
        if off >= len {
            return Ok(());
        }
    }
}

pub(super) fn send_read_response(fd: RawFd, seq: u32, entry: &KeyEntry, addr: u64, len: u64) -> io::Result<()> {
    let mut off = 0u64;
    loop {
        let n = (len - off).min(SEGMENT as u64);
        let last = off + n >= len;
        let h = FrameHeader {
            op: FrameOp::ReadResp as u8,
            flags: if last { LAST } else { 0 } | if off == 0 { FIRST } else { 0 },
            seq,
            addr: off,
            len: n as u32,
            ..FrameHeader::default()
        };
        // SAFETY: the range was checked against the exposure, whose memory stays
        // valid while its gate says alive (revocation waits for the gate).
        let whole =
            unsafe { send_frame(fd, &h, (addr + off) as *const u8, n as usize, Some(&entry.alive), 0, false, None)? };
        if !whole {
            // Revoked mid-way: the frame is cut, the stream cannot be resynchronized.
            return Err(io::Error::other("an exposed region was withdrawn during a read"));
        }
        off += n;
        if last {
            return Ok(());
        }
    }
}
