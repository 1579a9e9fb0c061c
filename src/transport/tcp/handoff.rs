//! While a thread writes a stream to the socket, the receiver thread leaves
//! the frames it sees arrive to that writer, which reads them between its
//! calls.
//!
//! Reading and writing one TCP socket take the same lock in the kernel: a
//! `recv` that meets a `sendmsg` in progress sleeps until that call ends,
//! and is woken by it, and the writer's next call usually takes the lock
//! back before the woken reader runs. Sending a stream of 64 KiB writes,
//! the receiver thread reading their acknowledgements slept about eight
//! times per `recv` this way (28,000 context switches a second), each wake
//! paid for by the writer. So while a writer streams (holds [`Writing`]),
//! the receiver thread only watches the socket (poll(2) takes no lock):
//! when something arrives it says so ([`Inner::handed`]) and waits; the
//! writer, between two calls, reads what is there as a spinning waiter
//! does ([`Inner::read_ready`]) and rings it. A frame a writer does not
//! carry out (a large one, a partial one, the end of the stream) goes back
//! to the receiver thread, as does anything nobody took within [`NAP`].

use std::os::fd::BorrowedFd;

use super::nap::{NAP, Nap};
use super::*;

/// A thread writing a stream, counted while it lives: between its calls it
/// takes [`Inner::writer_turn`]; when it ends, it takes one more.
pub(super) struct Writing<'a>(&'a Inner);

impl<'a> Writing<'a> {
    pub(super) fn new(inner: &'a Inner) -> Self {
        inner.writers.fetch_add(1, Ordering::SeqCst);
        Writing(inner)
    }
}

impl Drop for Writing<'_> {
    /// Paired with the receiver thread's look at `writers` after it hands
    /// the socket over: either it sees no writer and reads itself, or this
    /// sees the hand-over and reads.
    fn drop(&mut self) {
        self.0.writers.fetch_sub(1, Ordering::SeqCst);
        self.0.writer_turn();
    }
}

impl Inner {
    /// A writer's turn, between two of its calls (never holding the
    /// connection's lock): if the receiver thread handed the socket over,
    /// carries out what arrived, then rings the receiver thread (which
    /// waits for this), saying whether a frame was left to it.
    pub(super) fn writer_turn(&self) {
        if !self.handed.load(Ordering::Relaxed) || !self.handed.swap(false, Ordering::SeqCst) {
            return;
        }
        let left = self.read_ready();
        if left {
            self.left_to_receiver.store(true, Ordering::SeqCst);
        }
        #[cfg(test)]
        self.turns[usize::from(left)].fetch_add(1, Ordering::Relaxed);
        if let Some(nap) = self.nap() {
            nap.ring();
        }
    }
}

impl Room for Inner {
    /// The sender thread, which writes inside [`Writing`], waits for room
    /// outside it: no turn is due while it waits, so the receiver thread
    /// reads for itself meanwhile (the writer holds no lock in the kernel
    /// then).
    fn wait(&self, fd: RawFd) -> io::Result<()> {
        self.writers.fetch_sub(1, Ordering::SeqCst);
        self.writer_turn();
        let r = wait_fd(fd, libc::POLLOUT);
        self.writers.fetch_add(1, Ordering::SeqCst);
        r
    }
}

/// The receiver thread, with nothing to read and a writer streaming,
/// watches the socket without reading it and hands what arrives to the
/// writer (see the module's docs). Returns when it should read itself: no
/// writer streams any more, a waiter spins (the receiver thread then naps
/// as usual), a writer left it a frame, nobody took a hand-over within
/// [`NAP`], or the connection broke. The caller holds no reader.
pub(super) fn defer_to_writers(inner: &Inner, nap: &Nap) {
    // SAFETY: `inner.fd` is the connection's socket, open until the
    // `TcpConn` owning it is dropped, which joins this thread first.
    let socket = unsafe { BorrowedFd::borrow_raw(inner.fd) };
    // Rung by the writer's turn, a waiter that left a frame, a break (not
    // by a thread going to sleep: the socket is watched).
    inner.deferring.store(true, Ordering::SeqCst);
    loop {
        if inner.dead.load(Ordering::Acquire)
            || inner.writers.load(Ordering::SeqCst) == 0
            || inner.spinners.load(Ordering::SeqCst) > 0
            || inner.left_to_receiver.swap(false, Ordering::SeqCst)
        {
            break;
        }
        if !nap.watch(socket, RECV_WAIT) {
            continue;
        }
        inner.handed.store(true, Ordering::SeqCst);
        if inner.writers.load(Ordering::SeqCst) == 0 {
            // The writer ended meanwhile: whichever of the two takes the
            // hand-over back reads.
            if inner.handed.swap(false, Ordering::SeqCst) {
                break;
            }
            continue;
        }
        nap.wait_rung(NAP);
        if inner.handed.swap(false, Ordering::SeqCst) {
            // Nobody took it in time (a writer blocked in its call, or rung
            // for another reason): read it here.
            break;
        }
    }
    inner.deferring.store(false, Ordering::SeqCst);
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A connected TCP pair on one domain, each side advertising a region of
    /// `len` bytes (tag 1) that the other may write and read: (server, client, domain,
    /// the server's region, the client's region). Waits never spin, so the
    /// receiver threads never nap for a spinning waiter.
    pub(in crate::transport::tcp) fn exposing_pair(
        len: usize,
    ) -> (crate::Connection, crate::Connection, crate::Domain, crate::Exposed, crate::Exposed) {
        use crate::{Access, ConnectOptions, Domain, DomainConfig, TransportPolicy};
        let d = Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).unwrap();
        let rights = Access::REMOTE_WRITE | Access::REMOTE_READ;
        let expose = |d: &Domain| d.expose(d.alloc(len).unwrap(), rights, 1).unwrap();
        let (on_server, on_client) = (expose(&d), expose(&d));
        let o = ConnectOptions::default().op_timeout(Duration::from_secs(60)).spin(Duration::ZERO);
        let listener = d.listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let so = o.clone().advertise(&on_server);
        let accepting = std::thread::spawn(move || listener.accept_timeout(&so, Duration::from_secs(30)));
        let c = d.connect(addr, &o.advertise(&on_client)).unwrap();
        let s = accepting.join().unwrap().unwrap();
        (s, c, d, on_server, on_client)
    }

    /// Hand-overs the writers of `conn` took: (all, those that left a frame
    /// to the receiver thread).
    fn turns(conn: &crate::Connection) -> (u64, u64) {
        let t = &conn.tcp_conn().expect("a TCP connection").inner.turns;
        let left = t[1].load(Ordering::Relaxed);
        (t[0].load(Ordering::Relaxed) + left, left)
    }

    /// Takes writer's turns on `inner` until `done` says so (at most 10 s).
    fn turn_until(inner: &Inner, what: &str, mut done: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !done() {
            inner.writer_turn();
            assert!(Instant::now() < until, "{what} never happened");
            std::thread::yield_now();
        }
    }

    /// While a writer streams (here the test, holding [`Writing`] and taking
    /// turns between its calls), the receiver thread only watches the socket:
    /// a small frame that arrives (the peer's send) is handed to the writer,
    /// whose turn carries it out and acknowledges it. (The receiver thread
    /// takes a hand-over back after [`NAP`], so a round may go without one.)
    #[test]
    fn a_small_frame_arriving_while_a_writer_streams_is_carried_out_by_its_turn() {
        let (s, c, d, ..) = exposing_pair(64);
        let inner = &c.tcp_conn().expect("a TCP connection").inner;
        for round in 1..=50u8 {
            let mut rx = c.recv(d.alloc(64).unwrap());
            let writing = Writing::new(inner);
            let mut sent = s.send_inline(&[round; 5], None);
            turn_until(inner, "the send's landing", || rx.poll().unwrap().is_some());
            drop(writing);
            sent.wait().unwrap();
            let (taken, left) = turns(&c);
            assert_eq!(left, 0, "a send of 5 bytes to a posted receive is the turn's to carry out");
            if taken > 0 {
                return;
            }
        }
        panic!("in 50 rounds, the receiver thread never handed a frame to the writer");
    }

    /// A large frame (the peer's 64 KiB write) handed to a writer goes back to
    /// the receiver thread, which reads it whole.
    #[test]
    fn a_large_frame_handed_to_a_writer_goes_back_to_the_receiver_thread_and_lands_whole() {
        const LEN: usize = 64 << 10;
        let (s, c, d, _on_server, on_client) = exposing_pair(LEN);
        let inner = &c.tcp_conn().expect("a TCP connection").inner;
        let remote = s.remote_region(1).expect("the client's region");
        for round in 1..=50u8 {
            let data = vec![round; LEN];
            let mut src = d.alloc(LEN).unwrap();
            src.copy_from_slice(&data);
            let writing = Writing::new(inner);
            let mut write = s.write(src, &remote.slice(0..LEN as u64).unwrap());
            turn_until(inner, "the write's acknowledgement", || write.poll().unwrap().is_some());
            drop(writing);
            let mut landed = vec![0u8; LEN];
            on_client.read_at(0, &mut landed).unwrap();
            assert!(landed == data, "round {round}: the write landed whole");
            if turns(&c).1 > 0 {
                return;
            }
        }
        panic!("in 50 rounds, no writer's turn left a large frame to the receiver thread");
    }

    /// Writes `pieces` pieces of `piece` bytes, all from `data` to the start
    /// of the peer's region (tag 1), as one transfer list; the bytes moved.
    fn stream_writes(conn: &crate::Connection, d: &crate::Domain, data: &[u8], pieces: u64) -> u64 {
        let remote = conn.remote_region(1).expect("the peer's region");
        let mut src = d.alloc(data.len()).unwrap();
        src.copy_from_slice(data);
        let len = data.len() as u64;
        let list = (0..pieces).map(|_| crate::Piece::new(0, 0, len));
        let (done, _) = conn.write_list(src, &remote.slice(0..len).unwrap(), list).finish().unwrap();
        done.bytes
    }

    /// Both sides stream writes at once, each receiving large frames while it
    /// writes (so the hand-overs its writers take go back to its receiver
    /// thread): both streams complete, and land whole.
    #[test]
    fn both_sides_streaming_writes_at_once_complete_and_land_whole() {
        const PIECE: usize = 64 << 10;
        let (s, c, d, on_server, on_client) = exposing_pair(PIECE);
        let to_server: Vec<u8> = (0..PIECE).map(|i| (i % 251) as u8).collect();
        let to_client: Vec<u8> = (0..PIECE).map(|i| (i % 241) as u8 ^ 0x5a).collect();
        for round in 1..=4 {
            std::thread::scope(|sc| {
                let back = sc.spawn(|| stream_writes(&s, &d, &to_client, 256));
                assert_eq!(stream_writes(&c, &d, &to_server, 256), 256 * PIECE as u64, "round {round}");
                assert_eq!(back.join().unwrap(), 256 * PIECE as u64, "round {round}");
            });
        }
        let mut landed = vec![0u8; PIECE];
        on_server.read_at(0, &mut landed).unwrap();
        assert!(landed == to_server, "the client's writes landed whole");
        on_client.read_at(0, &mut landed).unwrap();
        assert!(landed == to_client, "the server's writes landed whole");
    }

    /// The peer reads this side's region while this side streams writes to
    /// it: the read requests arrive while a writer streams (its turns carry
    /// them out and start the responses), and every read returns what the
    /// region holds.
    #[test]
    fn reads_of_a_side_that_streams_writes_return_its_bytes() {
        const PIECE: usize = 64 << 10;
        let (s, c, d, _on_server, on_client) = exposing_pair(PIECE);
        let held: Vec<u8> = (0..PIECE).map(|i| (i % 239) as u8).collect();
        on_client.write_at(0, &held).unwrap();
        let data = vec![7u8; PIECE];
        let remote = s.remote_region(1).expect("the client's region");
        std::thread::scope(|sc| {
            let streaming = sc.spawn(|| {
                for _ in 0..4 {
                    assert_eq!(stream_writes(&c, &d, &data, 256), 256 * PIECE as u64);
                }
            });
            let mut reads = 0;
            while !streaming.is_finished() || reads < 8 {
                let (_, back) =
                    s.read(d.alloc(PIECE).unwrap(), &remote.slice(0..PIECE as u64).unwrap()).finish().unwrap();
                assert!(back[..] == held[..], "read {reads} returned the region's bytes");
                reads += 1;
            }
            streaming.join().unwrap();
        });
    }
}
