use super::nap::*;
use super::receiver::*;
use super::sender::*;
use super::*;

/// A blocking writer's wait for room in poll(2), and nothing else.
struct Poll;

impl Room for Poll {
    fn wait(&self, fd: RawFd) -> io::Result<()> {
        wait_fd(fd, libc::POLLOUT)
    }
}

/// An inline message's frame, as the peer must read it.
fn inline_out(seq: u32, data: &[u8]) -> (Out, Vec<u8>) {
    let o = Out {
        seq,
        wr_id: 1,
        kind: OutKind::Inline { data: data.to_vec(), imm: Some(7), unacked: false },
        addr: 0,
        len: data.len() as u64,
        skip: 0,
        first: seq,
    };
    let h = FrameHeader {
        op: FrameOp::Send as u8,
        flags: FIRST | LAST | IMM,
        seq,
        key: 0,
        imm: 7,
        addr: 0,
        len: data.len() as u32,
        total: data.len() as u32,
    };
    let mut frame = h.encode().to_vec();
    frame.extend_from_slice(data);
    (o, frame)
}

fn read_exactly(r: &mut std::os::unix::net::UnixStream, n: usize) -> Vec<u8> {
    use std::io::Read;
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf).unwrap();
    buf
}

/// Every size around the one below which a frame is copied whole into one
/// buffer, resumed after every kind of prefix.
#[test]
fn a_frame_resumed_after_any_prefix_reaches_the_peer_whole() {
    let (mut rx, tx) = std::os::unix::net::UnixStream::pair().unwrap();
    for size in [0, 1, 200, SMALL_FRAME, SMALL_FRAME + 1, 4000] {
        let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        resumed_after_any_prefix(&mut rx, &tx, &data);
    }
}

fn resumed_after_any_prefix(rx: &mut std::os::unix::net::UnixStream, tx: &std::os::unix::net::UnixStream, data: &[u8]) {
    let (mut o, frame) = inline_out(9, data);
    let mut skips = vec![0, 1, HEADER - 1, HEADER, frame.len()];
    skips.extend([HEADER + 1, HEADER + data.len() / 2].into_iter().filter(|&s| s < frame.len()));
    for skip in skips {
        o.skip = skip;
        // The prefix goes out as a posting thread would have sent it.
        {
            use std::io::Write;
            (&*tx).write_all(&frame[..skip]).unwrap();
        }
        let progress = AtomicU64::new(0);
        send_message(tx.as_raw_fd(), &o, false, &progress, &Poll).unwrap();
        assert_eq!(read_exactly(rx, frame.len()), frame, "{} bytes resumed after {skip}", data.len());
        // The writer said where it was: all of it handed, out of its call.
        let whole = Progress { handed: frame.len() as u64, in_call: false };
        assert_eq!(Progress::unpack(progress.load(Ordering::Acquire)), whole);
        assert_eq!(o.wire_len(), frame.len() as u64);
    }
}

/// Makes `s` take a few KiB at a time.
fn small_send_buffer(s: &std::os::unix::net::UnixStream) {
    let small: libc::c_int = 4096;
    // SAFETY: a valid socket and a c_int option value of the right size.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&small as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
}

/// A write of `data` (memory the caller keeps alive) as one message, and
/// its frame as the peer must read it.
fn write_out(seq: u32, data: &[u8]) -> (Out, Vec<u8>) {
    let o = Out {
        seq,
        wr_id: 1,
        kind: OutKind::Write { raddr: 0x1000, key: 5, imm: None },
        addr: data.as_ptr() as u64,
        len: data.len() as u64,
        skip: 0,
        first: seq,
    };
    let h = message_frames(&o).next().expect("one frame").h;
    assert_eq!((h.op, h.key, h.addr, h.len), (FrameOp::Write as u8, 5, 0x1000, data.len() as u32));
    let mut frame = h.encode().to_vec();
    frame.extend_from_slice(data);
    (o, frame)
}

/// A posting thread's direct attempts at a write of one frame into a
/// socket that takes a little at a time: each attempt goes on from where
/// the last stopped (inside the header, then inside the payload), and the
/// peer reads the frame whole.
#[test]
fn direct_attempts_at_a_write_go_on_from_where_the_socket_stopped() {
    let (mut rx, tx) = std::os::unix::net::UnixStream::pair().unwrap();
    small_send_buffer(&tx);
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let (mut o, frame) = write_out(3, &data);
    let reader = std::thread::spawn(move || read_exactly(&mut rx, frame.len()) == frame);
    let progress = AtomicU64::new(0);
    let mut attempts = 0;
    loop {
        let n = try_send_single(tx.as_raw_fd(), &o, false, &progress).unwrap();
        assert!(n >= o.skip, "never backwards");
        assert_eq!(Progress::unpack(progress.load(Ordering::Acquire)), Progress { handed: n as u64, in_call: false });
        o.skip = n;
        attempts += 1;
        if n == HEADER + data.len() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(attempts > 1, "the socket took the frame in pieces");
    assert!(reader.join().unwrap(), "the peer read the frame whole");
}

/// Small frames (sent from one buffer) and larger ones (header and
/// payload apart) alike.
#[test]
fn a_direct_send_into_a_full_socket_is_finished_by_the_writer_and_stays_whole() {
    for size in [SMALL_FRAME / 2, SMALL_FRAME, 1000] {
        direct_send_into_a_full_socket(size);
    }
}

fn direct_send_into_a_full_socket(size: usize) {
    let (mut rx, tx) = std::os::unix::net::UnixStream::pair().unwrap();
    small_send_buffer(&tx);
    // Fill the socket until a direct attempt cannot send a whole frame.
    let data = vec![0xabu8; size];
    let mut frames = Vec::new();
    let partial = loop {
        let (mut o, frame) = inline_out(frames.len() as u32 + 1, &data);
        let progress = AtomicU64::new(0);
        let n = try_send_single(tx.as_raw_fd(), &o, false, &progress).unwrap();
        assert_eq!(Progress::unpack(progress.load(Ordering::Acquire)), Progress { handed: n as u64, in_call: false });
        frames.push(frame);
        if n < HEADER + data.len() {
            o.skip = n;
            break o;
        }
        assert!(frames.len() < 10_000, "the socket never filled");
    };
    // The sender thread's part: the rest, blocking until the peer reads.
    let writer = std::thread::spawn(move || {
        send_message(tx.as_raw_fd(), &partial, false, &AtomicU64::new(0), &Poll).map(|()| tx)
    });
    for (i, frame) in frames.iter().enumerate() {
        assert_eq!(&read_exactly(&mut rx, frame.len()), frame, "frame {i} of {}", frames.len());
    }
    drop(writer.join().unwrap().unwrap());
}

#[test]
fn a_direct_acknowledgement_into_a_full_socket_is_finished_by_the_sender_and_stays_whole() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (mut rx, _) = listener.accept().unwrap();
    // Acknowledgements sent directly until the socket takes one only in
    // part, or not at all (as a reader's attempt meets a peer that does
    // not read).
    let mut sent = Vec::new();
    let (rest, already) = loop {
        let seq = sent.len() as u32 + 1;
        let h = FrameHeader { op: FrameOp::Ack as u8, seq, ..FrameHeader::default() };
        let n = send_now(tx.as_raw_fd(), &h.encode()).unwrap();
        sent.push(h);
        if n < HEADER {
            break (h, n);
        }
        assert!(sent.len() < 1_000_000, "the socket never filled");
    };
    // The sender thread's part: the rest of that frame (all of it when
    // none went), blocking until the peer reads.
    let writer = std::thread::spawn(move || {
        // SAFETY: no payload.
        unsafe { send_frame(tx.as_raw_fd(), &rest, std::ptr::null(), 0, None, already, false, None, &Poll) }.map(|_| tx)
    });
    for (i, h) in sent.iter().enumerate() {
        let got: [u8; HEADER] = read_tcp(&mut rx, HEADER).try_into().unwrap();
        assert_eq!(FrameHeader::parse(&got).unwrap(), *h, "acknowledgement {i} of {}", sent.len());
    }
    drop(writer.join().unwrap().unwrap());
}

/// A read's response written directly by the thread that carried out the
/// request (one attempt, never blocking) into a socket that takes a little
/// at a time, then finished by the sender thread from where the attempt
/// stopped: the peer reads every frame of it whole and in order, and a
/// response the attempt finished needs nothing more.
#[test]
fn a_direct_read_response_is_finished_by_the_sender_from_where_it_stopped() {
    use crate::memory::Access;
    let (mut rx, tx) = std::os::unix::net::UnixStream::pair().unwrap();
    small_send_buffer(&tx);
    // Three frames: two whole segments and a part.
    let mut mem: Vec<u8> = (0..2 * SEGMENT + 5_000).map(|i| (i % 253) as u8).collect();
    let keys = KeyTable::default();
    // SAFETY: `mem` outlives the exposure (dropped at the end of the test).
    let served = unsafe { keys.expose(mem.as_mut_ptr() as u64, mem.len() as u64, Access::REMOTE_READ, None) }.unwrap();
    let entry = keys.lookup(served.key()).unwrap();
    let (addr, len) = (mem.as_ptr() as u64, mem.len() as u64);
    let response = |seq, len, sent| ReadResponse { seq, entry: Arc::clone(&entry), addr, len, sent };
    let mut expected = Vec::new();
    for f in read_response_frames(4, addr, len) {
        expected.extend_from_slice(&f.h.encode());
        expected.extend_from_slice(&mem[(f.src - addr) as usize..][..f.len]);
    }
    assert_eq!(response(4, len, 0).wire(), expected.len() as u64);
    let sent = try_send_read_response(tx.as_raw_fd(), &response(4, len, 0)).unwrap();
    assert!(sent > 0 && sent < expected.len() as u64, "the attempt wrote part: {sent}");
    let total = expected.len();
    let reader = std::thread::spawn(move || read_exactly(&mut rx, total) == expected);
    send_read_response(tx.as_raw_fd(), &response(4, len, sent), &Poll).unwrap();
    assert!(reader.join().unwrap(), "the peer read the response whole, in order");
    // A response the attempt wrote whole is done: nothing more goes out.
    let small = 100;
    let (mut rx2, tx2) = std::os::unix::net::UnixStream::pair().unwrap();
    let n = try_send_read_response(tx2.as_raw_fd(), &response(5, small, 0)).unwrap();
    assert_eq!(n, response(5, small, 0).wire());
    send_read_response(tx2.as_raw_fd(), &response(5, small, n), &Poll).unwrap();
    drop(tx2);
    let mut all = Vec::new();
    std::io::Read::read_to_end(&mut rx2, &mut all).unwrap();
    assert_eq!(all.len() as u64, n, "the sender wrote nothing more");
    // A withdrawn region: the attempt writes nothing.
    drop(served);
    let (_rx3, tx3) = std::os::unix::net::UnixStream::pair().unwrap();
    assert_eq!(try_send_read_response(tx3.as_raw_fd(), &response(6, small, 0)).unwrap(), 0);
    drop(mem);
}

fn read_tcp(r: &mut TcpStream, n: usize) -> Vec<u8> {
    use std::io::Read;
    let mut v = vec![0u8; n];
    r.read_exact(&mut v).unwrap();
    v
}

#[test]
fn a_payload_read_with_its_header_is_carried_out_as_the_socket_would_carry_it() {
    let bytes = [1u8, 2, 3, 4, 5, 6, 7];
    let mut scratch = [0u8; 8];
    let mut src = Source::Read(&bytes);
    let mut out = [0u8; 4];
    // SAFETY: `out` is this test's, 4 bytes, referenced by nothing during the call.
    assert!(unsafe { src.fill(out.as_mut_ptr(), 4, None, &mut scratch) }.unwrap());
    assert_eq!(out, [1, 2, 3, 4]);
    // A withdrawn target: its bytes are dropped, not written.
    let gone = RwLock::new(false);
    let mut two = [9u8; 2];
    // SAFETY: as above; the closed gate keeps it unwritten anyway.
    assert!(unsafe { src.fill(two.as_mut_ptr(), 2, Some(&gone), &mut scratch) }.unwrap());
    assert_eq!(two, [9, 9]);
    // Never past the frame: asking for more than is left is an error.
    // SAFETY: as above.
    assert!(unsafe { src.fill(two.as_mut_ptr(), 2, None, &mut scratch) }.is_err());
    assert_eq!(two, [9, 9]);
    // A payload is skipped within what was read; there is no next segment.
    let mut src = Source::Read(&bytes[..3]);
    assert!(src.skip(3, &mut scratch).unwrap());
    assert!(matches!(src, Source::Read(rest) if rest.is_empty()));
    assert!(Source::Read(&bytes).skip(8, &mut scratch).is_err());
    assert!(Source::Read(&bytes).next_header().is_err());
}

#[test]
fn headers_round_trip() {
    let h = FrameHeader {
        op: 2,
        flags: FIRST | LAST | IMM,
        seq: 7,
        key: 0xdead,
        imm: 42,
        addr: 0x7f00_1234_5678,
        len: 4096,
        total: 9000,
    };
    assert_eq!(FrameHeader::decode(&h.encode()), h);
}

#[test]
fn a_million_hostile_headers_parse_or_are_refused_without_panicking() {
    // The end-to-end test (tests/hostile.rs) sends hostile streams through
    // a socket; this one covers the header checks a million times.
    let mut x = 0x5eed_0005_u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let first = FrameHeader { op: 1, flags: FIRST, seq: 1, len: 10, total: 20, ..FrameHeader::default() };
    let (mut ok, mut refused, mut continuing) = (0, 0, 0);
    for i in 0..1_000_000 {
        let mut b = [0u8; HEADER];
        for chunk in b.chunks_mut(8) {
            chunk.copy_from_slice(&next().to_le_bytes());
        }
        if i % 2 == 0 {
            // Plausible: a known operation, few flags, a segment-sized length.
            b[0] %= 8;
            b[1] &= 0x1f;
            b[4..8].copy_from_slice(&(next() as u32 % 3).to_le_bytes());
            b[24..28].copy_from_slice(&(next() as u32 % (2 * SEGMENT as u32)).to_le_bytes());
        }
        match FrameHeader::parse(&b) {
            Ok(h) => {
                ok += 1;
                assert!(h.len as usize <= SEGMENT && h.flags & !(FIRST | LAST | IMM | ACK) == 0, "{h:?}");
                assert_eq!(FrameHeader::decode(&h.encode()), h);
                continuing += usize::from(h.continues(&first).is_ok());
            }
            Err(why) => {
                refused += 1;
                assert!(why.contains("garbled"), "{why}");
            }
        }
    }
    assert!(ok > 100_000 && refused > 100_000 && continuing > 0, "{ok} {refused} {continuing}");
}

#[test]
fn rnr_timer_codes_follow_the_encoding() {
    assert_eq!(rnr_timer(1), Duration::from_micros(10));
    assert_eq!(rnr_timer(12), Duration::from_micros(640));
    assert_eq!(rnr_timer(31), Duration::from_micros(491_520));
    assert_eq!(rnr_timer(0), Duration::from_micros(655_360));
}

/// A connection's state with no socket and no threads, for the rules that
/// read it alone.
fn bare_state() -> Core {
    Core::new(Limits { domain_id: 1, send_depth: 8, recv_depth: 8, max_message: 1 << 20, qp_num: 0 }, 8)
}

fn out(seq: u32) -> Out {
    inline_out(seq, b"x").0
}

/// What [`next`] chose, in short: `rest`, `resume N`, `ack N`, `out N
/// (more)`, `wait`, `hang up`.
fn chose(st: &mut Core) -> String {
    match next(st) {
        Next::Wait => "wait".into(),
        Next::HangUp => "hang up".into(),
        Next::Write(Work::Rest(..)) => "rest".into(),
        Next::Write(Work::Ctl(Ctl::Ack { seq, .. })) => format!("ack {seq}"),
        Next::Write(Work::Ctl(_)) => "ctl".into(),
        Next::Write(Work::Out(o, more)) if st.writing => format!("resume {}{}", o.seq, if more { " more" } else { "" }),
        Next::Write(Work::Out(o, more)) => format!("out {}{}", o.seq, if more { " more" } else { "" }),
    }
}

#[test]
fn the_sender_writes_what_was_begun_then_replies_then_messages_one_writer_at_a_time() {
    let mut st = bare_state();
    assert_eq!(chose(&mut st), "wait", "nothing queued");
    st.queue.extend([out(1), out(2)]);
    st.control.push_back(Ctl::Ack { seq: 9, status: 0 });
    st.resume = Some(out(7));
    st.ctl_rest = Some((FrameHeader::default(), 3));
    st.writing = true;
    assert_eq!(chose(&mut st), "wait", "another thread writes");
    st.writing = false;
    // The rest of a control frame, then the rest of a message, each marked written.
    assert_eq!(chose(&mut st), "rest");
    assert!(st.writing);
    assert_eq!(chose(&mut st), "wait", "one writer at a time");
    st.writing = false;
    assert_eq!(chose(&mut st), "resume 7");
    st.writing = false;
    // Replies before this side's own messages.
    assert_eq!(chose(&mut st), "ack 9");
    st.writing = false;
    // Messages in order, saying whether more follow; started by the caller.
    assert_eq!(chose(&mut st), "out 1 more");
    assert!(!st.writing, "a queued message is started by the caller (start_write)");
    assert_eq!(chose(&mut st), "out 2");
    assert_eq!(chose(&mut st), "wait");
}

#[test]
fn a_broken_sender_delivers_its_replies_before_it_hangs_up_and_sends_no_message() {
    let mut st = bare_state();
    st.queue.push_back(out(1));
    st.control.extend([Ctl::Ack { seq: 3, status: 1 }, Ctl::Bye]);
    st.q.lose(|| "refused".into());
    assert_eq!(chose(&mut st), "ack 3", "the refusal goes out");
    st.writing = false;
    assert_eq!(chose(&mut st), "ctl");
    st.writing = false;
    assert_eq!(chose(&mut st), "hang up", "then the end; the queued message is never written");
    assert_eq!(st.queue.len(), 1);
    // Closing does the same.
    let mut st = bare_state();
    st.queue.push_back(out(1));
    st.stopping = true;
    assert_eq!(chose(&mut st), "hang up");
}

#[test]
fn the_end_of_a_payload_takes_the_start_of_the_next_header_with_it() {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let (mut w, r) = std::os::unix::net::UnixStream::pair().unwrap();
    let next = FrameHeader { op: FrameOp::Ack as u8, seq: 9, ..FrameHeader::default() }.encode();
    // A payload of 100 bytes, then 20 bytes of the next header.
    let payload: Vec<u8> = (0..100u8).collect();
    w.write_all(&payload).unwrap();
    w.write_all(&next[..20]).unwrap();
    let mut ahead = Ahead::default();
    let mut dst = [0u8; 100];
    let mut scratch = [0u8; 16];
    // SAFETY: `dst` is this test's, 100 bytes, referenced by nothing during the call.
    let whole = unsafe { recv_into(r.as_raw_fd(), dst.as_mut_ptr(), 100, None, &mut scratch, Some(&mut ahead)) };
    assert!(whole.unwrap());
    assert_eq!(&dst[..], &payload[..], "the payload, and no more, in its place");
    assert!(!ahead.is_empty());
    // The header's rest comes later; together they are the next header.
    w.write_all(&next[20..]).unwrap();
    let mut head = [0u8; HEADER];
    let had = ahead.take_into(&mut head);
    assert_eq!(had, 20);
    assert!(recv_buf(r.as_raw_fd(), &mut head[had..]).unwrap());
    assert_eq!(FrameHeader::decode(&head).seq, 9);
    assert!(ahead.is_empty());
}

/// The receiver thread's nap ends when rung, and by its alarm once the last
/// spinning waiter has left: long before the safeguard's [`NAP_MAX`].
#[test]
fn a_nap_ends_when_rung_or_soon_after_the_last_spinner_left() {
    let nap = Nap::new().unwrap();
    nap.ring();
    assert!(nap.sleep(), "rung before the nap began: it ends at once");
    for _ in 0..3 {
        let began = Instant::now();
        nap.push();
        assert!(!nap.sleep(), "the alarm, not a ring");
        assert!(began.elapsed() < NAP_MAX, "ended by the alarm, not the safeguard: {:?}", began.elapsed());
    }
    // Rung after the last spinner left: the ring wins over the alarm.
    nap.push();
    nap.ring();
    assert!(nap.sleep());
    // A ring is taken once.
    let began = Instant::now();
    nap.push();
    assert!(!nap.sleep());
    assert!(began.elapsed() < NAP_MAX);
}
