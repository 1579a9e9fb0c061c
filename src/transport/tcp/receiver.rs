//! The receiver thread (and a spinning waiter in its place): frames read
//! and carried out against the rules of a reliable connection.

use super::*;

pub(super) const CLOSED: &str = "the peer closed the connection (its process exited or dropped the connection)";

/// The longest the receiver thread naps while waiters spin.
pub(super) const NAP: Duration = Duration::from_millis(1);

/// A spinning waiter, counted while it lives.
pub(super) struct Spinning<'a>(&'a Inner);

impl<'a> Spinning<'a> {
    pub(super) fn new(inner: &'a Inner) -> Self {
        inner.spinners.fetch_add(1, Ordering::AcqRel);
        Spinning(inner)
    }
}

impl Drop for Spinning<'_> {
    fn drop(&mut self) {
        self.0.spinners.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The most frames a spinning waiter carries out before it looks at its
/// own condition and deadline again.
pub(super) const WAITER_FRAMES: usize = 16;

/// How much of the stream a spinning waiter looks at in one call: a
/// header, the largest payload it carries out, and one byte to tell
/// whether anything follows.
pub(super) const LOOK: usize = HEADER + MAX_INLINE as usize + 1;
// The look lands in the reader's scratch buffer.
const _: () = assert!(LOOK <= STEP);

/// Carries out one frame whose header was read.
pub(super) fn on_frame(
    inner: &Inner,
    h: &FrameHeader,
    src: &mut Source<'_>,
    scratch: &mut [u8],
    by: Reading,
) -> Handled {
    match FrameOp::from_raw(h.op) {
        Some(FrameOp::Send | FrameOp::Write) if h.flags & FIRST == 0 => {
            Err(format!("a garbled frame (operation {} without its first segment): the stream is out of step", h.op))
        }
        Some(FrameOp::Send) => on_message(inner, h, None, src, scratch, by),
        Some(FrameOp::Write) => on_write(inner, h, src, scratch, by),
        Some(FrameOp::ReadReq) => on_read_request(inner, h),
        Some(FrameOp::ReadResp) => on_read_response(inner, h, src, scratch),
        Some(FrameOp::Ack) => on_ack(inner, h),
        Some(FrameOp::Bye) => Err("the peer closed the connection (it said bye)".to_owned()),
        None => Err(format!("a garbled frame (operation {}): the stream is out of step", h.op)),
    }
}

impl Inner {
    /// A spinning waiter's turn at the socket: if no other thread reads it,
    /// carries out the small frames (at most [`MAX_INLINE`] bytes of
    /// payload) that are there whole and need nothing to wait for (no
    /// receive to wait for, no further segment), then returns. Anything
    /// else (a large or partial frame, a send with no receive posted, a
    /// message of several segments, the end of the stream, a garbled
    /// header) is left to the receiver thread, which reads with blocking
    /// calls and watches for the receiver-not-ready budget. Never blocks.
    pub(super) fn read_ready(&self) {
        let Ok(mut reader) = self.reader.try_lock() else { return };
        let fd = self.fd;
        let (look, scratch) = reader.scratch.split_at_mut(LOOK);
        // A few frames a turn: a peer that keeps sending cannot hold a
        // waiter here past its deadline (the wait looks at it between turns).
        for _ in 0..WAITER_FRAMES {
            if self.dead.load(Ordering::Acquire) {
                return;
            }
            // One look shows the header and, for a frame a waiter carries
            // out, the whole frame and whether more follows it: one system
            // call where a look at the header, then one at the queue's
            // length, and one more finding nothing after the frame took three.
            let seen = match recv_now(fd, look, true) {
                Ok(n) if n >= HEADER => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                // Part of a header, the end of the stream, an error: the
                // receiver thread's.
                _ => return self.end_nap(),
            };
            let mut head = [0u8; HEADER];
            head.copy_from_slice(&look[..HEADER]);
            let Ok(h) = FrameHeader::parse(&head) else { return self.end_nap() };
            let whole = h.flags & (FIRST | LAST) == FIRST | LAST;
            let (payload, needs_recv) = match FrameOp::from_raw(h.op) {
                Some(FrameOp::Ack | FrameOp::ReadReq) => (0, false),
                Some(FrameOp::ReadResp) => (h.len, false),
                Some(FrameOp::Send) if whole => (h.len, true),
                Some(FrameOp::Write) if whole => (h.len, h.flags & IMM != 0),
                _ => return self.end_nap(),
            };
            // A large frame is the receiver thread's: the copy dwarfs the
            // hand-over, and a waiter polling a stream of them would only
            // contend with it for the socket.
            if payload > MAX_INLINE || needs_recv && self.lock().recvs.is_empty() {
                return self.end_nap();
            }
            let frame = HEADER + payload as usize;
            if seen < frame {
                return self.end_nap();
            }
            // The frame, all there, read by this thread only: one call,
            // and its payload is carried out from here.
            if !matches!(recv_now(fd, &mut look[..frame], false), Ok(n) if n == frame) {
                // Cannot happen with the reader held; the receiver thread
                // would find the stream out of step, so break it here.
                let mut st = self.lock();
                self.break_with(&mut st, "the connection to the peer failed: a peeked frame went missing".into());
                return;
            }
            let mut src = Source::Read(&look[HEADER..frame]);
            if let Err(why) = on_frame(self, &h, &mut src, scratch, Reading::Waiter) {
                // As the receiver thread would: it sees `dead` next and
                // fails what it owns.
                let mut st = self.lock();
                self.break_with(&mut st, why);
                return;
            }
            if seen == frame {
                // Nothing followed it when this side looked; what arrives
                // since, the next turn finds.
                return;
            }
        }
    }
}

pub(super) fn receiver(inner: &Inner) {
    let fd = inner.fd;
    let mut reader = inner.reader.lock().unwrap_or_else(|e| e.into_inner());
    let why = loop {
        if inner.dead.load(Ordering::Acquire) {
            // Broken (by this thread, the sender, a waiter, or this side
            // closing): nothing more from the peer is carried out.
            break inner.lock().q.lost().unwrap_or_default().to_owned();
        }
        let mut head = [0u8; HEADER];
        let got = match recv_now(fd, &mut head, false) {
            Ok(0) => break CLOSED.to_owned(),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if inner.spinners.load(Ordering::Acquire) > 0 {
                    // Waiters spin and carry out what arrives: nap until one
                    // leaves a frame to this thread or a thread goes to
                    // sleep, or for a millisecond (the last spinner may have
                    // gone meanwhile).
                    inner.napping.store(true, Ordering::Release);
                    reader = inner.rx_wake.wait_timeout(reader, NAP).unwrap_or_else(|e| e.into_inner()).0;
                    inner.napping.store(false, Ordering::Release);
                    continue;
                }
                // Nothing yet: wait for it without the reader, so that a
                // spinning waiter can take the next frame itself.
                drop(reader);
                let waited = wait_fd_for(fd, libc::POLLIN, RECV_WAIT.as_millis() as i32);
                reader = inner.reader.lock().unwrap_or_else(|e| e.into_inner());
                if let Err(e) = waited {
                    break format!("the connection to the peer failed: {e}");
                }
                continue;
            }
            Err(e) => break format!("the connection to the peer failed: {e}"),
        };
        if got < HEADER {
            match recv_buf(fd, &mut head[got..]) {
                Ok(true) => {}
                Ok(false) => break CLOSED.to_owned(),
                Err(e) => break format!("the connection to the peer failed: {e}"),
            }
        }
        let h = match FrameHeader::parse(&head) {
            Ok(h) => h,
            Err(why) => break why,
        };
        if let Err(why) = on_frame(inner, &h, &mut Source::Socket(fd), &mut reader.scratch, Reading::Receiver) {
            break why;
        }
    };
    // Still the reader: broken before anyone else may read, so no waiter
    // lands a frame from here on (each looks at `dead` first).
    let mut st = inner.lock();
    inner.break_with(&mut st, why);
    // This thread owns receives and reads: fail them.
    st.receiver_stopped(inner);
    drop(st);
    drop(reader);
    let mut st = inner.lock();
    // The sender delivers the replies already queued (a refusal), then hangs
    // up. A peer that does not read gets LINGER for that, then the socket is
    // shut under the sender, which ends it: a broken connection holds no
    // thread.
    let until = Instant::now() + LINGER;
    while !st.sender_done {
        let now = Instant::now();
        if now >= until {
            break;
        }
        st = inner.sleep(st, until - now);
    }
    drop(st);
    inner.hang_up();
}

pub(super) fn io_err(e: io::Error) -> String {
    format!("the connection to the peer failed: {e}")
}

/// Where a frame's payload is read from.
pub(super) enum Source<'a> {
    /// The socket, as the payload arrives (the receiver thread).
    Socket(RawFd),
    /// What a spinning waiter read with the header: the payload of a
    /// frame of one segment, whole.
    Read(&'a [u8]),
}

impl Source<'_> {
    /// Fills `ptr..ptr+len` with the payload's next `len` bytes, as
    /// [`recv_into`] does (`gate` as there; `Ok(false)` on EOF).
    ///
    /// # Safety
    /// As [`recv_into`]: while `gate` returns true, `ptr..ptr + len` must
    /// be valid for writes and not referenced by Rust code.
    pub(super) unsafe fn fill(
        &mut self,
        ptr: *mut u8,
        len: usize,
        gate: Option<&RwLock<bool>>,
        scratch: &mut [u8],
    ) -> io::Result<bool> {
        match self {
            // SAFETY: the caller's promise, passed on.
            Source::Socket(fd) => unsafe { recv_into(*fd, ptr, len, gate, scratch) },
            Source::Read(bytes) => {
                let Some((now, rest)) = bytes.split_at_checked(len) else {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "a payload shorter than its header says"));
                };
                let guard = gate.map(|g| g.read().unwrap_or_else(|e| e.into_inner()));
                if guard.as_ref().is_none_or(|alive| **alive) {
                    // SAFETY: `ptr..ptr + len` is writable and unreferenced while
                    // the gate holds (the caller's promise); `now` is `len` bytes
                    // of this side's scratch buffer, which no region overlaps.
                    unsafe { std::ptr::copy_nonoverlapping(now.as_ptr(), ptr, len) };
                }
                // Revoked: the bytes are dropped, as `recv_into` drops them.
                *bytes = rest;
                Ok(true)
            }
        }
    }

    /// Reads the rest of the message the header `h` starts, dropping it.
    pub(super) fn drain(&mut self, h: &FrameHeader, scratch: &mut [u8]) -> Handled {
        let mut cur = *h;
        loop {
            match self {
                Source::Socket(fd) => {
                    if !discard(*fd, cur.len as usize, scratch).map_err(io_err)? {
                        return Err("the peer closed the connection".into());
                    }
                }
                Source::Read(bytes) => *bytes = bytes.get(cur.len as usize..).unwrap_or_default(),
            }
            if cur.flags & LAST != 0 {
                return Ok(());
            }
            cur = self.next_segment(h)?;
        }
    }

    /// Reads the header of the next segment of the message `first` started.
    pub(super) fn next_segment(&mut self, first: &FrameHeader) -> std::result::Result<FrameHeader, String> {
        let Source::Socket(fd) = self else {
            // A waiter carries out messages of one segment only.
            return Err("a garbled frame (a segment after the last): the stream is out of step".into());
        };
        let mut head = [0u8; HEADER];
        if !recv_buf(*fd, &mut head).map_err(io_err)? {
            return Err("the peer closed the connection".into());
        }
        let next = FrameHeader::parse(&head)?;
        next.continues(first)?;
        Ok(next)
    }
}

/// Fails the connection after a request the peer made was refused: the
/// peer gets `status` (the last reply it gets), this side breaks too, as a
/// responder in the error state does, and the receiver stops: nothing the
/// peer sent after the refused request is carried out.
pub(super) fn refuse(inner: &Inner, seq: u32, status: WcStatus, why: String) -> Handled {
    inner.lock().refuse(seq, status, why, inner)
}

/// Takes the next posted receive, waiting up to the receiver-not-ready
/// budget (forever when it is "infinite"). Meanwhile the socket is watched
/// every [`WATCH`]: a peer that closed or died ends the wait, as does this
/// side closing.
pub(super) fn next_recv(inner: &Inner) -> std::result::Result<Option<Recv>, String> {
    let deadline = inner.rnr_budget.map(|b| Instant::now() + b);
    let mut st = inner.lock();
    loop {
        if st.stopping || st.q.lost().is_some() {
            return Err(st.q.lost().map_or_else(|| "the connection is closing".into(), str::to_owned));
        }
        if let Some(r) = st.recvs.pop_front() {
            return Ok(Some(r));
        }
        let now = Instant::now();
        let slice = match deadline {
            Some(d) if now >= d => return Ok(None),
            Some(d) => (d - now).min(WATCH),
            None => WATCH,
        };
        st = inner.sleep(st, slice);
        if st.recvs.is_empty() && inner.peer_gone() {
            return Err("the peer closed the connection while its message waited for a receive".into());
        }
    }
}

/// A send (or the receive a write with immediate consumes): lands in the
/// next posted receive. `written` is the byte count of a write with
/// immediate whose data already went to its target.
pub(super) fn on_message(
    inner: &Inner,
    h: &FrameHeader,
    written: Option<u32>,
    src: &mut Source<'_>,
    scratch: &mut [u8],
    by: Reading,
) -> Handled {
    let total = u64::from(written.unwrap_or(h.total));
    let taken = next_recv(inner)?.map(|r| {
        let len = r.len;
        (r, len)
    });
    let recv = match responder::message(total, taken, written.is_some()) {
        responder::Message::Land(recv) => recv,
        responder::Message::TooLong(recv, r) => {
            // Failed first (the bytes go to scratch, not to it), so that a
            // stream that breaks while draining cannot leave it pending.
            let mut st = inner.lock();
            inner.complete(&mut st, &RawCompletion { byte_len: h.total, ..raw(recv.wr_id, WcStatus::LocalLength) });
            drop(st);
            src.drain(h, scratch)?;
            return refuse(inner, h.seq, r.status, r.why);
        }
        responder::Message::NoReceive(r) => {
            if written.is_none() {
                src.drain(h, scratch)?;
            }
            return refuse(inner, h.seq, r.status, r.why);
        }
    };
    if written.is_none() {
        let mut cur = *h;
        let mut off = 0u64;
        loop {
            let n = u64::from(cur.len);
            if let Err(why) = responder::segment_fits(off, n, recv.len) {
                let mut st = inner.lock();
                inner.complete(&mut st, &raw(recv.wr_id, WcStatus::LocalLength));
                return Err(why);
            }
            // SAFETY: inside the receive's buffer (checked), which its operation owns
            // until this thread completes it.
            let ok = unsafe { src.fill((recv.addr + off) as *mut u8, n as usize, None, scratch) };
            if let Err(why) = ok
                .map_err(io_err)
                .and_then(|ok| ok.then_some(()).ok_or_else(|| "the peer closed the connection".into()))
            {
                // The receive was taken off the queue: this thread fails it.
                let mut st = inner.lock();
                inner.complete(&mut st, &raw(recv.wr_id, WcStatus::WrFlush));
                return Err(why);
            }
            off += n;
            if cur.flags & LAST != 0 {
                break;
            }
            match src.next_segment(h) {
                Ok(next) => cur = next,
                Err(why) => {
                    // The receive was taken off the queue: this thread fails it.
                    let mut st = inner.lock();
                    inner.complete(&mut st, &raw(recv.wr_id, WcStatus::WrFlush));
                    return Err(why);
                }
            }
        }
        if let Err(why) = responder::whole(total, off) {
            // Its last segment came early: the receive would report bytes
            // that never arrived.
            let mut st = inner.lock();
            inner.complete(&mut st, &raw(recv.wr_id, WcStatus::WrFlush));
            return Err(why);
        }
    }
    let mut st = inner.lock();
    let c = RawCompletion {
        byte_len: total as u32,
        imm: (h.flags & IMM != 0).then_some(h.imm),
        by_write_imm: written.is_some(),
        ..raw(recv.wr_id, WcStatus::Success)
    };
    inner.complete(&mut st, &c);
    if h.flags & ACK == 0 {
        return Ok(());
    }
    inner.acknowledge(st, h.seq, by)
}

pub(super) fn on_write(
    inner: &Inner,
    h: &FrameHeader,
    src: &mut Source<'_>,
    scratch: &mut [u8],
    by: Reading,
) -> Handled {
    let total = u64::from(h.total);
    let entry = match responder::write(inner.lookup(h.key), h.key, h.addr, total) {
        Ok(entry) => entry,
        Err(r) => {
            src.drain(h, scratch)?;
            return refuse(inner, h.seq, r.status, r.why);
        }
    };
    let mut cur = *h;
    let mut off = 0u64;
    loop {
        let n = u64::from(cur.len);
        if let Err(r) = responder::write_segment(&entry, cur.addr, n) {
            src.drain(&cur, scratch)?;
            return refuse(inner, h.seq, r.status, r.why);
        }
        // SAFETY: inside the exposed region (checked); its memory stays valid while
        // the gate says alive, and revocation waits for the gate.
        let ok = unsafe { src.fill(cur.addr as *mut u8, n as usize, Some(&entry.alive), scratch) };
        if !ok.map_err(io_err)? {
            return Err("the peer closed the connection".into());
        }
        off += n;
        if cur.flags & LAST != 0 {
            break;
        }
        cur = src.next_segment(h)?;
    }
    // A write with immediate would report bytes that never arrived.
    responder::whole(total, off)?;
    if !*entry.alive.read().unwrap_or_else(|e| e.into_inner()) {
        let r = responder::withdrawn_during_write();
        return refuse(inner, h.seq, r.status, r.why);
    }
    if h.flags & IMM != 0 {
        // The immediate announces the data: in GPU memory (copied from the
        // staging mirror, the only memory this transport writes), it must be
        // visible to CUDA work before the receive completes. A GPU that
        // cannot take it breaks the connection, loudly.
        #[cfg(feature = "cuda")]
        if let Err(e) = inner.visible.make_visible(h.key, h.addr, total) {
            return Err(format!("the data of a write with immediate could not be made visible in GPU memory: {e}"));
        }
        return on_message(inner, h, Some(h.total), src, scratch, by);
    }
    if h.flags & ACK == 0 {
        return Ok(());
    }
    inner.acknowledge(inner.lock(), h.seq, by)
}

pub(super) fn on_read_request(inner: &Inner, h: &FrameHeader) -> Handled {
    let total = u64::from(h.total);
    match responder::read(inner.lookup(h.key), h.key, h.addr, total) {
        Ok(entry) => {
            let mut st = inner.lock();
            inner.reply(&mut st, Ctl::ReadResp { seq: h.seq, entry, addr: h.addr, len: total })
        }
        Err(r) => refuse(inner, h.seq, r.status, r.why),
    }
}

pub(super) fn on_read_response(inner: &Inner, h: &FrameHeader, src: &mut Source<'_>, scratch: &mut [u8]) -> Handled {
    let n = u64::from(h.len);
    // It must answer the oldest request waiting for a reply, a read that
    // reached the peer whole, and land next in order inside its buffer
    // (the peer sends a read's response in order, from its start).
    let segment = {
        let mut st = inner.lock();
        let progress = Progress::unpack(inner.tx.load(Ordering::Acquire));
        st.replies.on_read_segment(h.seq, h.addr, n, progress)
    };
    let seg = match segment {
        Ok(seg) => seg,
        Err(why) => {
            src.drain(h, scratch)?;
            return Err(why);
        }
    };
    // SAFETY: inside the read's destination (checked), owned by its operation
    // until this thread, the reader, lets go of the read (`read_done`, or
    // `take_reads` when it stops): nobody else completes the operation.
    let ok = unsafe { src.fill((seg.addr + h.addr) as *mut u8, n as usize, None, scratch) };
    if !ok.map_err(io_err)? {
        return Err("the peer closed the connection".into());
    }
    if h.flags & LAST != 0 {
        let mut st = inner.lock();
        let whole = st.replies.read_done().is_some_and(|(_, whole)| whole);
        if !whole {
            // Part of the read's buffer would hold what was there before.
            inner.complete(&mut st, &raw(seg.wr_id, WcStatus::BadResponse));
            return Err(format!("a read response of {} bytes for a read of {}", h.addr + n, seg.len));
        }
        inner.complete(&mut st, &raw(seg.wr_id, WcStatus::Success));
    }
    Ok(())
}

/// An acknowledgement: [`Core::on_ack`].
pub(super) fn on_ack(inner: &Inner, h: &FrameHeader) -> Handled {
    let mut st = inner.lock();
    let progress = Progress::unpack(inner.tx.load(Ordering::Acquire));
    st.on_ack(h.seq, WcStatus::from_raw(h.total), progress, inner)
}
