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
                    Next::Wait => {
                        // Asleep, a reply costs a wake-up (tens of
                        // microseconds on a virtual machine): whoever carries
                        // out the peer's request writes it instead.
                        st.sender_asleep = true;
                        st = inner.work.wait(st).unwrap_or_else(|e| e.into_inner());
                        st.sender_asleep = false;
                    }
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
                    Ctl::Ack { seq, status } => send_header(fd, &ack_header(seq, status)),
                    Ctl::Bye => {
                        let _ = send_header(fd, &bye_header());
                        Ok(())
                    }
                    Ctl::ReadResp { seq, entry, addr, len, sent } => {
                        send_read_response(fd, seq, &entry, addr, len, sent)
                    }
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

/// One attempt, without blocking, to write the rest of a message of one
/// frame (from `o.skip` bytes on; `more`: more frames follow at once); how
/// many bytes of the frame the socket has in all. Reports its progress
/// through `tx` as [`send_message`] does.
pub(super) fn try_send_single(fd: RawFd, o: &Out, more: bool, tx: &AtomicU64) -> io::Result<usize> {
    let Some(f) = message_frames(o).next() else { return Ok(0) };
    let head = f.h.encode();
    let flags = frame_flags(more);
    report(Some((tx, 0)), o.skip, true);
    let r = sent_without_waiting(|| {
        // SAFETY: the message's source is a registered buffer owned by its
        // operation until the operation is reported complete (which waits
        // for this writer's end), or the message's own inline copy; the
        // frame's range is inside it (checked when it was posted).
        unsafe { sendmsg_frame(fd, &head, f.src as *const u8, f.len, o.skip, flags) }
    });
    let total = o.skip + *r.as_ref().unwrap_or(&0);
    report(Some((tx, 0)), total, false);
    r.map(|_| total)
}

/// Writes message `o` (from `o.skip` bytes on), reporting its progress
/// through `tx`.
pub(super) fn send_message(fd: RawFd, o: &Out, more: bool, tx: &AtomicU64) -> io::Result<()> {
    for f in message_frames(o) {
        // SAFETY: the message's source is a registered buffer owned by its
        // operation until this thread reports the operation complete, or an
        // inline copy owned by `o`; the frame's range is inside it (`o.len`
        // bytes, checked when it was posted). A read request has no payload.
        unsafe {
            send_frame(
                fd,
                &f.h,
                f.src as *const u8,
                f.len,
                None,
                if f.is_first() { o.skip } else { 0 },
                more || !f.is_last(),
                Some((tx, f.wire)),
            )?
        };
    }
    Ok(())
}

/// Writes the response to the peer's read `seq` from its `sent`th byte on
/// (what a direct attempt wrote, see [`Inner::respond`]).
pub(super) fn send_read_response(
    fd: RawFd,
    seq: u32,
    entry: &KeyEntry,
    addr: u64,
    len: u64,
    sent: u64,
) -> io::Result<()> {
    for f in read_response_frames(seq, addr, len) {
        if sent >= f.wire + (HEADER + f.len) as u64 {
            continue;
        }
        let already = sent.saturating_sub(f.wire) as usize;
        // SAFETY: the range was checked against the exposure, whose memory stays
        // valid while its gate says alive (revocation waits for the gate).
        let whole =
            unsafe { send_frame(fd, &f.h, f.src as *const u8, f.len, Some(&entry.alive), already, false, None)? };
        if !whole {
            // Revoked mid-way: the frame is cut, the stream cannot be resynchronized.
            return Err(io::Error::other("an exposed region was withdrawn during a read"));
        }
    }
    Ok(())
}

/// The bytes on the wire of a response to a read of `len` bytes.
pub(super) fn read_response_wire(len: u64) -> u64 {
    read_response_frames(0, 0, len).last().map_or(0, |f| f.wire + (HEADER + f.len) as u64)
}

/// One attempt, without blocking, to write the response to the peer's
/// read `seq` from its `sent`th byte on (one frame at most): how many of
/// its bytes the socket has in all. A withdrawn region writes nothing (the
/// sender thread then finds it withdrawn).
pub(super) fn try_send_read_response(
    fd: RawFd,
    seq: u32,
    entry: &KeyEntry,
    addr: u64,
    len: u64,
    sent: u64,
) -> io::Result<u64> {
    let Some(f) = read_response_frames(seq, addr, len).find(|f| sent < f.wire + (HEADER + f.len) as u64) else {
        return Ok(sent);
    };
    let head = f.h.encode();
    let alive = entry.alive.read().unwrap_or_else(|e| e.into_inner());
    if !*alive {
        return Ok(sent);
    }
    let more = !f.is_last();
    let n = sent_without_waiting(|| {
        // SAFETY: the range was checked against the exposure when the read
        // was carried out, and its memory stays valid while the gate, held
        // for the call, says alive (revocation waits for the gate).
        unsafe { sendmsg_frame(fd, &head, f.src as *const u8, f.len, (sent - f.wire) as usize, frame_flags(more)) }
    })?;
    Ok(sent + n as u64)
}
