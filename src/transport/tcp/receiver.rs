//! The receiver thread (and a spinning waiter in its place): frames read
//! and carried out against the rules of a reliable connection.

use super::nap::NAP;
use super::*;

pub(super) const CLOSED: &str = "the peer closed the connection (its process exited or dropped the connection)";

/// The stream ended inside a frame.
const CLOSED_MID: &str = "the peer closed the connection";

/// How often a receiver thread with nothing to read looks whether the
/// connection broke while its socket stayed open (a break's other paths
/// shut the socket, which wakes it at once): an idle connection's only
/// wake-ups, 10 a second (at 10 ms, a hundred cost an idle process's
/// receiver threads about 1 ms of CPU a second each).
const IDLE_LOOK: Duration = Duration::from_millis(100);

/// A spinning waiter, counted while it lives.
pub(super) struct Spinning<'a>(&'a Inner);

impl<'a> Spinning<'a> {
    pub(super) fn new(inner: &'a Inner) -> Self {
        inner.spinners.fetch_add(1, Ordering::SeqCst);
        Spinning(inner)
    }
}

impl Drop for Spinning<'_> {
    fn drop(&mut self) {
        // The last to leave while the receiver thread naps sees that the nap
        // ends within NAP (paired with the thread's look at `spinners` after
        // it says it naps: one of the two sees the other).
        if self.0.spinners.fetch_sub(1, Ordering::SeqCst) == 1 && self.0.napping.load(Ordering::SeqCst) {
            if let Some(nap) = self.0.nap() {
                nap.push();
            }
        }
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

/// Carries out one frame whose header was read: does what the core says
/// ([`Core::on_header`] and the steps after it), reporting each step back.
pub(super) fn on_frame(
    inner: &Inner,
    h: &FrameHeader,
    src: &mut Source<'_>,
    scratch: &mut [u8],
    by: Reading,
) -> Handled {
    let progress = Progress::unpack(inner.tx.load(Ordering::Acquire));
    let mut st = inner.lock();
    let mut stepped = st.on_header(*h, progress, inner);
    loop {
        stepped = match stepped? {
            RxStep::Done => return Ok(()),
            RxStep::Reply(reply) => return inner.respond(st, reply, by),
            RxStep::Fill { addr, len, gate } => {
                drop(st);
                // SAFETY: the core checked `addr..addr + len`: inside a posted
                // receive's buffer (owned by its operation until the core
                // completes it), inside this side's read's destination (the
                // same), or inside an exposed region, whose memory stays valid
                // while its gate says alive (revocation waits for the gate).
                let got = unsafe { src.fill(addr as *mut u8, len, gate.as_deref().map(|e| &e.alive), scratch) };
                st = inner.lock();
                match got {
                    Ok(true) => st.filled(inner),
                    Ok(false) => Err(st.abort(CLOSED_MID.to_owned(), inner)),
                    Err(e) => Err(st.abort(io_err(e), inner)),
                }
            }
            RxStep::Drop { len } => {
                drop(st);
                let got = src.skip(len, scratch);
                st = inner.lock();
                match got {
                    Ok(true) => st.dropped(inner),
                    Ok(false) => Err(st.abort(CLOSED_MID.to_owned(), inner)),
                    Err(e) => Err(st.abort(io_err(e), inner)),
                }
            }
            RxStep::NextSegment => {
                drop(st);
                let next = src.next_header();
                st = inner.lock();
                match next {
                    Ok(next) => st.on_segment(next, inner),
                    Err(why) => Err(st.abort(why, inner)),
                }
            }
            RxStep::NeedRecv => match await_receive(inner, st) {
                Ok((mut s, posted)) => {
                    let stepped = s.on_receive(posted, inner);
                    st = s;
                    stepped
                }
                Err((mut s, why)) => {
                    let why = s.abort(why, inner);
                    st = s;
                    Err(why)
                }
            },
            RxStep::MakeVisible { key, addr, len } => {
                drop(st);
                let made = inner.make_visible(key, addr, len);
                st = inner.lock();
                st.visible(made, inner)
            }
        };
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
    /// calls and watches for the receiver-not-ready budget: returns whether
    /// it left one (the caller then rings the receiver thread). Never
    /// blocks. A writer takes the same turn ([`handoff`](super::handoff)).
    pub(super) fn read_ready(&self) -> bool {
        let Ok(mut reader) = self.reader.try_lock() else { return false };
        if !reader.ahead.is_empty() {
            // The receiver thread read the start of the next frame: it is its.
            return true;
        }
        let fd = self.fd;
        let (look, scratch) = reader.scratch.split_at_mut(LOOK);
        // A few frames a turn: a peer that keeps sending cannot hold a
        // waiter here past its deadline (the wait looks at it between turns).
        for _ in 0..WAITER_FRAMES {
            if self.dead.load(Ordering::Acquire) {
                return false;
            }
            // One look shows the header and, for a frame a waiter carries
            // out, the whole frame and whether more follows it: one system
            // call where a look at the header, then one at the queue's
            // length, and one more finding nothing after the frame took three.
            let seen = match recv_now(fd, look, true) {
                Ok(n) if n >= HEADER => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                // Part of a header, the end of the stream, an error: the
                // receiver thread's.
                _ => return true,
            };
            let mut head = [0u8; HEADER];
            head.copy_from_slice(&look[..HEADER]);
            let Ok(h) = FrameHeader::parse(&head) else { return true };
            let whole = h.flags & (FIRST | LAST) == FIRST | LAST;
            let (payload, needs_recv) = match FrameOp::from_raw(h.op) {
                Some(FrameOp::Ack | FrameOp::ReadReq) => (0, false),
                Some(FrameOp::ReadResp) => (h.len, false),
                Some(FrameOp::Send) if whole => (h.len, true),
                Some(FrameOp::Write) if whole => (h.len, h.flags & IMM != 0),
                _ => return true,
            };
            // A large frame is the receiver thread's: the copy dwarfs the
            // hand-over, and a waiter polling a stream of them would only
            // contend with it for the socket.
            if payload > MAX_INLINE || needs_recv && self.lock().recvs.is_empty() {
                return true;
            }
            let frame = HEADER + payload as usize;
            if seen < frame {
                return true;
            }
            // The frame, all there, read by this thread only: one call,
            // and its payload is carried out from here.
            if !matches!(recv_now(fd, &mut look[..frame], false), Ok(n) if n == frame) {
                // Cannot happen with the reader held; the receiver thread
                // would find the stream out of step, so break it here.
                let mut st = self.lock();
                self.break_with(&mut st, "the connection to the peer failed: a peeked frame went missing".into());
                return false;
            }
            let mut src = Source::Read(&look[HEADER..frame]);
            if let Err(why) = on_frame(self, &h, &mut src, scratch, Reading::Waiter) {
                // As the receiver thread would: it sees `dead` next and
                // fails what it owns.
                let mut st = self.lock();
                self.break_with(&mut st, why);
                return false;
            }
            if seen == frame {
                // Nothing followed it when this side looked; what arrives
                // since, the next turn finds.
                return false;
            }
        }
        false
    }
}

pub(super) fn receiver(inner: &Inner) {
    #[cfg(test)]
    // SAFETY: gettid(2) takes nothing and cannot fail.
    inner.receiver_tid.store(unsafe { libc::gettid() }, Ordering::SeqCst);
    let fd = inner.fd;
    let mut reader = inner.reader.lock().unwrap_or_else(|e| e.into_inner());
    let why = loop {
        if inner.dead.load(Ordering::Acquire) {
            // Broken (by this thread, the sender, a waiter, or this side
            // closing): nothing more from the peer is carried out.
            break inner.lock().q.lost().unwrap_or_default().to_owned();
        }
        let mut head = [0u8; HEADER];
        // What the last payload's read took of this header, then the rest.
        let had = reader.ahead.take_into(&mut head);
        let read = if had > 0 { Ok(had) } else { recv_now(fd, &mut head, false) };
        let got = match read {
            Ok(0) => break CLOSED.to_owned(),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let waited;
                (reader, waited) = idle(inner, reader);
                match waited {
                    Ok(()) => continue,
                    Err(e) => break format!("the connection to the peer failed: {e}"),
                }
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
        let Reader { scratch, ahead } = &mut *reader;
        if let Err(why) = on_frame(inner, &h, &mut Source::Socket(fd, ahead), scratch, Reading::Receiver) {
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

/// The receiver thread with nothing to read: waits, without the reader,
/// until something may be there for it, and takes the reader back (with
/// the error of a failed wait, if one failed).
fn idle<'a>(inner: &'a Inner, mut reader: MutexGuard<'a, Reader>) -> (MutexGuard<'a, Reader>, io::Result<()>) {
    loop {
        if inner.spinners.load(Ordering::SeqCst) > 0 {
            // Waiters spin and carry out what arrives: nap (without the
            // reader) until one leaves a frame to this thread, a thread goes
            // to sleep, or the last has gone. Its descriptors are made at
            // the first nap: a connection nobody spins on costs none.
            let nap = inner.made_nap();
            inner.napping.store(true, Ordering::SeqCst);
            if inner.spinners.load(Ordering::SeqCst) > 0 {
                drop(reader);
                match nap {
                    Some(nap) => {
                        while !nap.sleep()
                            && inner.spinners.load(Ordering::SeqCst) > 0
                            && !inner.dead.load(Ordering::Acquire)
                        {}
                    }
                    // Out of descriptors: a nap of NAP, not rung.
                    None => std::thread::sleep(NAP),
                }
                reader = inner.reader.lock().unwrap_or_else(|e| e.into_inner());
            }
            inner.napping.store(false, Ordering::SeqCst);
            return (reader, Ok(()));
        }
        if inner.writers.load(Ordering::SeqCst) > 0 {
            // A writer streams: what arrives is its to read, between its
            // calls (a `recv` here would wait for the socket's lock at each
            // of them).
            if let Some(nap) = inner.made_nap() {
                drop(reader);
                handoff::defer_to_writers(inner, nap);
                return (inner.reader.lock().unwrap_or_else(|e| e.into_inner()), Ok(()));
            }
        }
        // Nothing yet: wait for it without the reader, so that a spinning
        // waiter can take the next frame itself.
        drop(reader);
        let waited = wait_fd_for(inner.fd, libc::POLLIN, IDLE_LOOK.as_millis() as i32);
        reader = inner.reader.lock().unwrap_or_else(|e| e.into_inner());
        if waited.is_err() || inner.nap().is_none() || inner.writers.load(Ordering::SeqCst) == 0 {
            return (reader, waited);
        }
        // A writer began to stream meanwhile: what came is its.
    }
}

pub(super) fn io_err(e: io::Error) -> String {
    format!("the connection to the peer failed: {e}")
}

/// Where a frame's payload is read from.
pub(super) enum Source<'a> {
    /// The socket, as the payload arrives (the receiver thread), and where
    /// the start of the header after a payload goes when it came with it.
    Socket(RawFd, &'a mut Ahead),
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
            Source::Socket(fd, ahead) => unsafe { recv_into(*fd, ptr, len, gate, scratch, Some(&mut **ahead)) },
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

    /// Reads the payload's next `len` bytes and drops them (`Ok(false)` on
    /// EOF).
    pub(super) fn skip(&mut self, len: usize, scratch: &mut [u8]) -> io::Result<bool> {
        match self {
            Source::Socket(fd, ahead) => {
                // Only a header follows a payload: none is read ahead of one.
                debug_assert!(ahead.is_empty(), "payload dropped with a header read ahead");
                discard(*fd, len, scratch)
            }
            Source::Read(bytes) => {
                let Some(rest) = bytes.get(len..) else {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "a payload shorter than its header says"));
                };
                *bytes = rest;
                Ok(true)
            }
        }
    }

    /// Reads the header of a message's next segment.
    pub(super) fn next_header(&mut self) -> std::result::Result<FrameHeader, String> {
        let Source::Socket(fd, ahead) = self else {
            // A waiter carries out messages of one segment only.
            return Err("a garbled frame (a segment after the last): the stream is out of step".into());
        };
        let mut head = [0u8; HEADER];
        let had = ahead.take_into(&mut head);
        if had < HEADER && !recv_buf(*fd, &mut head[had..]).map_err(io_err)? {
            return Err(CLOSED_MID.into());
        }
        FrameHeader::parse(&head)
    }
}

/// Waits for a posted receive, up to the receiver-not-ready budget
/// (forever when it is "infinite"): the state, and whether one is there.
/// Meanwhile the socket is watched every [`WATCH`]: a peer that closed or
/// died ends the wait, as does this side closing.
#[allow(clippy::type_complexity)]
fn await_receive<'a>(
    inner: &'a Inner,
    mut st: MutexGuard<'a, Core>,
) -> std::result::Result<(MutexGuard<'a, Core>, bool), (MutexGuard<'a, Core>, String)> {
    let deadline = inner.rnr_budget.map(|b| Instant::now() + b);
    loop {
        if st.stopping || st.q.lost().is_some() {
            let why = st.q.lost().map_or_else(|| "the connection is closing".into(), str::to_owned);
            return Err((st, why));
        }
        if !st.recvs.is_empty() {
            return Ok((st, true));
        }
        let now = Instant::now();
        let slice = match deadline {
            Some(d) if now >= d => return Ok((st, false)),
            Some(d) => (d - now).min(WATCH),
            None => WATCH,
        };
        st = inner.sleep(st, slice);
        if st.recvs.is_empty() && inner.peer_gone() {
            return Err((st, "the peer closed the connection while its message waited for a receive".into()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::handoff::tests::exposing_pair;
    use super::*;

    /// The voluntary context switches so far of the receiver thread of
    /// `conn`.
    fn receiver_switches(conn: &crate::Connection) -> u64 {
        let tid = conn.tcp_conn().expect("a TCP connection").inner.receiver_tid.load(Ordering::SeqCst);
        let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).expect("the receiver thread");
        status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("its switches")
    }

    /// An idle connection's receiver thread wakes [`IDLE_LOOK`] apart (10
    /// times a second), not at every [`RECV_WAIT`] (a hundred).
    #[test]
    fn an_idle_connections_receiver_thread_sleeps_between_looks() {
        let (s, c, ..) = exposing_pair(64);
        std::thread::sleep(Duration::from_millis(50));
        let before = [receiver_switches(&s), receiver_switches(&c)];
        std::thread::sleep(Duration::from_secs(1));
        let woke = [receiver_switches(&s) - before[0], receiver_switches(&c) - before[1]];
        assert!(woke.iter().all(|&n| n <= 25), "idle receiver threads woke {woke:?} times in a second");
    }
}
