//! The sender thread: this side's messages and the replies the receiver
//! asks for, written straight from registered memory.

use super::handoff::Writing;
use super::*;

pub(super) fn sender(inner: &Inner) {
    let fd = inner.fd;
    // While it has work: the receiver thread leaves what arrives to it
    // (see `handoff`).
    let mut streaming: Option<Writing<'_>> = None;
    loop {
        let work = {
            let mut st = inner.lock();
            loop {
                match next(&mut st) {
                    Next::Wait | Next::HangUp if streaming.is_some() => {
                        // The stream ends (its last turn, without the lock),
                        // then a look again: the turn may have queued a reply.
                        drop(st);
                        streaming = None;
                        st = inner.lock();
                    }
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
                        streaming.get_or_insert_with(|| Writing::new(inner));
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
                let r = unsafe { send_frame(fd, &h, std::ptr::null(), 0, None, sent, false, None, inner) }.map(drop);
                inner.lock().writing = false;
                r
            }
            Work::Ctl(c) => {
                let r = match c {
                    Ctl::Ack { seq, status } => send_header(fd, &ack_header(seq, status), inner),
                    Ctl::Bye => {
                        let _ = send_header(fd, &bye_header(), inner);
                        Ok(())
                    }
                    Ctl::ReadResp(r) => send_read_response(fd, &r, inner),
                };
                inner.lock().writing = false;
                r
            }
            Work::Out(mut o, more) => {
                let r = send_message(fd, &o, more, &inner.tx, inner);
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
        inner.writer_turn();
    }
}

impl Inner {
    /// Sends the peer `reply` (an acknowledgement, a read's response). The
    /// thread that carried out the request writes it itself while nobody
    /// else writes to the socket, with the lock released, when it is a
    /// spinning waiter (no hand-over on the latency path) or when the sender
    /// thread sleeps (waking it costs more than the write: a read's
    /// response waited 30 us for it here). One attempt that never blocks (a
    /// reader never waits on a peer that does not read); what the socket
    /// does not take, the sender thread sends. Otherwise the sender thread,
    /// awake, sends it while the receiver reads on.
    pub(super) fn respond(&self, mut st: MutexGuard<'_, Core>, reply: Ctl, by: Reading) -> Handled {
        let socket_free = st.socket_idle() && st.queue.is_empty() && st.q.lost().is_none();
        if !socket_free || by == Reading::Receiver && !st.sender_asleep {
            return self.reply(&mut st, reply);
        }
        st.writing = true;
        drop(st);
        // What the socket did not take: the rest of an acknowledgement's
        // header, or the reply itself (a response from where it stopped).
        // Nothing went out on an error: the sender sends it, or meets the
        // error and breaks the connection.
        let mut header_rest = None;
        let rest = match reply {
            Ctl::Ack { seq, status } => {
                let h = ack_header(seq, status);
                match send_now(self.fd, &h.encode()) {
                    Ok(HEADER) => None,
                    Ok(n) if n > 0 => {
                        header_rest = Some((h, n));
                        None
                    }
                    _ => Some(reply),
                }
            }
            Ctl::ReadResp(mut r) => match try_send_read_response(self.fd, &r) {
                Ok(n) if n == r.wire() => None,
                Ok(n) => {
                    r.sent = n;
                    Some(Ctl::ReadResp(r))
                }
                Err(_) => Some(Ctl::ReadResp(r)),
            },
            Ctl::Bye => Some(reply),
        };
        let mut st = self.lock();
        st.writing = false;
        if let Some(part) = header_rest {
            st.ctl_rest = Some(part);
        }
        if let Some(rest) = rest {
            // Before anything queued meanwhile (a bye goes last).
            st.control.push_front(rest);
        }
        self.sender_on(&st);
        Ok(())
    }

    /// Wakes the sender thread if it has work (it may wait for the socket
    /// to be free).
    pub(super) fn sender_on(&self, st: &Core) {
        if st.has_work() {
            self.work.notify_one();
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
/// through `tx`; `room` waits when the socket is full.
pub(super) fn send_message(fd: RawFd, o: &Out, more: bool, tx: &AtomicU64, room: &dyn Room) -> io::Result<()> {
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
                room,
            )?
        };
    }
    Ok(())
}

impl ReadResponse {
    /// Its frames the socket does not have whole, each with the bytes of
    /// it the socket has.
    fn unsent(&self) -> impl Iterator<Item = (OutFrame, usize)> + '_ {
        read_response_frames(self.seq, self.addr, self.len)
            .filter(|f| self.sent < f.wire + (HEADER + f.len) as u64)
            .map(|f| (f, self.sent.saturating_sub(f.wire) as usize))
    }

    /// All its bytes on the wire.
    pub(super) fn wire(&self) -> u64 {
        wire_len(self.len)
    }
}

/// Writes the rest of a response to the peer's read (from `r.sent` on);
/// `room` waits when the socket is full.
pub(super) fn send_read_response(fd: RawFd, r: &ReadResponse, room: &dyn Room) -> io::Result<()> {
    for (f, already) in r.unsent() {
        // SAFETY: the range was checked against the exposure, whose memory stays
        // valid while its gate says alive (revocation waits for the gate).
        let whole = unsafe {
            send_frame(fd, &f.h, f.src as *const u8, f.len, Some(&r.entry.alive), already, false, None, room)?
        };
        if !whole {
            // Revoked mid-way: the frame is cut, the stream cannot be resynchronized.
            return Err(io::Error::other("an exposed region was withdrawn during a read"));
        }
    }
    Ok(())
}

/// One attempt, without blocking, at the rest of a response to the peer's
/// read (one frame at most): how many of its bytes the socket has in all.
/// A withdrawn region writes nothing (the sender thread then finds it
/// withdrawn).
pub(super) fn try_send_read_response(fd: RawFd, r: &ReadResponse) -> io::Result<u64> {
    let Some((f, already)) = r.unsent().next() else { return Ok(r.sent) };
    let head = f.h.encode();
    let alive = r.entry.alive.read().unwrap_or_else(|e| e.into_inner());
    if !*alive {
        return Ok(r.sent);
    }
    let more = !f.is_last();
    let n = sent_without_waiting(|| {
        // SAFETY: the range was checked against the exposure when the read
        // was carried out, and its memory stays valid while the gate, held
        // for the call, says alive (revocation waits for the gate).
        unsafe { sendmsg_frame(fd, &head, f.src as *const u8, f.len, already, frame_flags(more)) }
    })?;
    Ok(r.sent + n as u64)
}
