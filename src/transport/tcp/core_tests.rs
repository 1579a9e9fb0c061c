//! The core driven against itself: two connections' state machines joined
//! by two in-memory byte streams, with no socket and no thread. Each side
//! does what its threads do, one step at a time: the sender writes one
//! frame of what [`next`] chooses, the reader carries out one step of the
//! frame in front of it as [`Core::on_header`] and the steps after it say.
//! The tests pick the order of the steps, the cuts and the closes; the
//! rules (what lands where, what completes when, what breaks) are the
//! core's alone.

use std::collections::VecDeque;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::completion::Opcode;
use crate::memory::Access;
use crate::memory::keys::{KeyTable, Served};
use crate::transport::queue::Limits;

const DEPTH: u32 = 8;

/// What a side's core needs around it: the keys its peer may use.
struct TestEnv {
    keys: KeyTable,
    granted: Vec<u32>,
}

impl Signals for TestEnv {
    fn wake_waiters(&self) {}
    fn wake_sender(&self) {}
    fn wake_ring_waiters(&self) {}
    fn broken(&self) {}
}

impl Env for TestEnv {
    fn lookup(&self, key: u32) -> Option<Arc<KeyEntry>> {
        if self.granted.contains(&key) { self.keys.lookup(key) } else { None }
    }
}

/// One side: its core, its memory and its half of the stream.
struct Side {
    core: Core,
    env: TestEnv,
    /// The bytes this side wrote that the peer has not read yet.
    out: VecDeque<u8>,
    /// The message being written, frame by frame, and how far.
    writing: Option<(Out, Vec<OutFrame>, usize)>,
    /// How far the writer of the current message is.
    progress: Progress,
    /// The reader's next step inside a frame (`None`: a header is next).
    pending: Option<RxStep>,
    /// The reader stopped (the stream ended, or the connection broke).
    reader_done: bool,
    /// The sender hung up.
    hung_up: bool,
    /// A message waiting for a receive gets none (the receiver-not-ready
    /// budget passes) at the reader's next step.
    rnr_expired: bool,
    /// Bytes this side wrote to its stream, ever.
    written: u64,
    /// Bytes this side's reader took off the peer's stream, ever.
    consumed: u64,
    /// Where each message this side wrote whole ends on its stream, by work
    /// request id.
    ends: std::collections::HashMap<u64, u64>,
}

impl Side {
    fn new() -> Side {
        let limits = Limits { domain_id: 1, send_depth: DEPTH, recv_depth: DEPTH, max_message: 1 << 30, qp_num: 0 };
        Side {
            core: Core::new(limits, DEPTH as usize),
            env: TestEnv { keys: KeyTable::default(), granted: Vec::new() },
            out: VecDeque::new(),
            writing: None,
            progress: Progress::default(),
            pending: None,
            reader_done: false,
            hung_up: false,
            rnr_expired: false,
            written: 0,
            consumed: 0,
            ends: std::collections::HashMap::new(),
        }
    }

    /// Exposes `mem` to the peer with `access`.
    fn expose(&mut self, mem: &mut [u8], access: Access) -> Served {
        // SAFETY: every test keeps `mem` alive, and at a fixed address,
        // until after the served key is dropped (tests drop the sides first).
        let served = unsafe { self.env.keys.expose(mem.as_mut_ptr() as u64, mem.len() as u64, access, None) }.unwrap();
        self.env.granted.push(served.key());
        served
    }

    /// Posts one operation of messages (kind, source, length), if there is room.
    fn post(&mut self, opcode: Opcode, msgs: Vec<(OutKind, u64, u64)>) -> Option<OpId> {
        if !self.core.q.send_room(msgs.len() as u32).unwrap_or(false) {
            return None;
        }
        let bytes = msgs.iter().map(|m| m.2).sum();
        let mut msgs = msgs.into_iter();
        let count = msgs.len();
        Some(self.core.push(opcode, count, bytes, |_| msgs.next().expect("counted")))
    }

    fn post_recv(&mut self, buf: &mut [u8]) -> Option<OpId> {
        self.core.post_recv(buf.as_mut_ptr() as u64, buf.len() as u64, &self.env).ok()
    }

    fn is_broken(&self) -> bool {
        self.core.q.lost().is_some()
    }

    /// The sender's turn: writes one frame of the message in hand, or the
    /// next control frame, or hangs up. Whether it did anything.
    fn send_step(&mut self) -> bool {
        if self.hung_up {
            return false;
        }
        if let Some((o, frames, at)) = self.writing.as_mut() {
            let f = frames[*at];
            put(&mut self.out, &f.h, f.src, f.len);
            self.written += (HEADER + f.len) as u64;
            *at += 1;
            self.progress = Progress { handed: f.wire + (HEADER + f.len) as u64, in_call: false };
            if *at == frames.len() {
                self.ends.insert(o.wr_id, self.written);
                let (o, _, _) = self.writing.take().expect("in hand");
                self.core.end_write(&o, false, &self.env);
            }
            return true;
        }
        match next(&mut self.core) {
            Next::Wait => false,
            Next::HangUp => {
                self.core.sender_done = true;
                self.hung_up = true;
                true
            }
            Next::Write(Work::Ctl(c)) => {
                let before = self.out.len();
                match c {
                    Ctl::Ack { seq, status } => put(&mut self.out, &ack_header(seq, status), 0, 0),
                    Ctl::Bye => put(&mut self.out, &bye_header(), 0, 0),
                    Ctl::ReadResp { seq, entry, addr, len } => {
                        for f in read_response_frames(seq, addr, len) {
                            assert!(*entry.alive.read().unwrap(), "no test withdraws a region");
                            put(&mut self.out, &f.h, f.src, f.len);
                        }
                    }
                }
                self.written += (self.out.len() - before) as u64;
                self.core.writing = false;
                true
            }
            Next::Write(Work::Rest(..)) => unreachable!("no thread here sends directly"),
            Next::Write(Work::Out(o, _)) => {
                if !self.core.writing {
                    self.progress = self.core.start_write(&o);
                }
                let frames: Vec<OutFrame> = message_frames(&o).collect();
                self.writing = Some((o, frames, 0));
                self.send_step()
            }
        }
    }

    /// The reader's turn, on the bytes the peer wrote (`wire`): one step of
    /// the frame in front of it. Whether it did anything.
    fn read_step(&mut self, wire: &mut VecDeque<u8>) -> bool {
        if self.reader_done {
            return false;
        }
        let stepped = match self.pending.take() {
            None => {
                let Some(h) = take_header(wire) else { return false };
                self.consumed += HEADER as u64;
                h.and_then(|h| self.core.on_header(h, self.progress, &self.env))
            }
            Some(RxStep::Fill { addr, len, gate }) => {
                if wire.len() < len {
                    self.pending = Some(RxStep::Fill { addr, len, gate });
                    return false;
                }
                let bytes: Vec<u8> = wire.drain(..len).collect();
                self.consumed += len as u64;
                if gate.as_ref().is_none_or(|e| *e.alive.read().unwrap()) {
                    // SAFETY: the core checked `addr..addr + len` inside a posted
                    // receive, a read's destination or an exposed region: memory
                    // this test owns and keeps alive.
                    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, len) };
                }
                self.core.filled(&self.env)
            }
            Some(RxStep::Drop { len }) => {
                if wire.len() < len {
                    self.pending = Some(RxStep::Drop { len });
                    return false;
                }
                wire.drain(..len);
                self.consumed += len as u64;
                self.core.dropped(&self.env)
            }
            Some(RxStep::NextSegment) => {
                let Some(h) = take_header(wire) else {
                    self.pending = Some(RxStep::NextSegment);
                    return false;
                };
                self.consumed += HEADER as u64;
                match h {
                    Ok(h) => self.core.on_segment(h, &self.env),
                    Err(why) => Err(self.core.abort(why, &self.env)),
                }
            }
            Some(RxStep::NeedRecv) => {
                if self.core.recvs.is_empty() && !self.rnr_expired {
                    self.pending = Some(RxStep::NeedRecv);
                    return false;
                }
                let posted = !self.core.recvs.is_empty();
                self.core.on_receive(posted, &self.env)
            }
            Some(RxStep::MakeVisible { .. }) => self.core.visible(Ok(()), &self.env),
            Some(RxStep::Ack(seq)) => self.core.reply(Ctl::Ack { seq, status: 0 }, &self.env).map(|()| RxStep::Done),
            Some(RxStep::Done) => unreachable!("not kept"),
        };
        match stepped {
            Ok(RxStep::Done) => {}
            Ok(step) => self.pending = Some(step),
            Err(why) => {
                self.core.break_with(why, &self.env);
                self.stop_reading();
            }
        }
        true
    }

    /// The reader stops, as the receiver thread does at the end.
    fn stop_reading(&mut self) {
        if let Some(step) = self.pending.take() {
            if !matches!(step, RxStep::Done) {
                let why = self.core.abort("the stream ended".into(), &self.env);
                self.core.break_with(why, &self.env);
            }
        }
        self.reader_done = true;
        self.core.receiver_stopped(&self.env);
    }

    /// The stream failed under this side (both ways): a message being
    /// written fails, the reader stops, and the threads end.
    fn cut(&mut self) {
        if let Some((o, _, _)) = self.writing.take() {
            self.core.end_write(&o, true, &self.env);
        }
        self.core.break_with("the connection to the peer failed".into(), &self.env);
        if !self.reader_done {
            self.stop_reading();
        }
        self.hung_up = true;
    }

    /// This side closes: a goodbye after what is queued, then, once its
    /// threads are gone, whatever is left fails.
    fn close(&mut self) {
        if !self.is_broken() {
            self.core.control.push_back(Ctl::Bye);
            self.core.break_with("closed".into(), &self.env);
        }
    }

    fn finish_close(&mut self) {
        if let Some((o, _, _)) = self.writing.take() {
            self.core.end_write(&o, true, &self.env);
        }
        if !self.reader_done {
            self.stop_reading();
        }
        self.core.stopping = true;
        self.core.stopped("closed".into(), &self.env);
    }
}

/// Writes a frame: its header, then `len` bytes from `src`.
fn put(out: &mut VecDeque<u8>, h: &FrameHeader, src: u64, len: usize) {
    out.extend(h.encode());
    if len > 0 {
        // SAFETY: `src..src + len` is inside a buffer this test owns (a
        // posted message's source, an inline copy, an exposed region).
        let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
        out.extend(bytes);
    }
}

/// The next header off the stream, checked as the reading thread checks it
/// (`FrameHeader::parse`: known flags, a segment within its bound); `None`
/// while it is not all there.
fn take_header(wire: &mut VecDeque<u8>) -> Option<std::result::Result<FrameHeader, String>> {
    if wire.len() < HEADER {
        return None;
    }
    let mut b = [0u8; HEADER];
    for (i, x) in wire.drain(..HEADER).enumerate() {
        b[i] = x;
    }
    Some(FrameHeader::parse(&b))
}

/// Two sides and the order of their steps.
struct Pair {
    a: Side,
    b: Side,
}

impl Pair {
    fn new() -> Pair {
        Pair { a: Side::new(), b: Side::new() }
    }

    /// One step of one of the four actors (0, 1: a's and b's senders; 2,
    /// 3: a's and b's readers).
    fn step(&mut self, who: u8) -> bool {
        match who % 4 {
            0 => self.a.send_step(),
            1 => self.b.send_step(),
            2 => self.a.read_step(&mut self.b.out),
            _ => self.b.read_step(&mut self.a.out),
        }
    }

    /// Runs every actor until none can move.
    fn settle(&mut self) {
        let mut idle = 0;
        let mut who = 0u8;
        while idle < 4 {
            if self.step(who) {
                idle = 0
            } else {
                idle += 1
            }
            who = who.wrapping_add(1);
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn outcome(side: &mut Side, id: OpId) -> Option<std::result::Result<crate::completion::Completion, String>> {
    side.core.q.take(id).map(|o| o.map_err(|e| e.to_string()))
}

// ---- every operation kind, two cores, no sockets ----

#[test]
fn every_operation_kind_lands_and_completes_only_once_acknowledged() {
    let mut p = Pair::new();
    let mut target = vec![0u8; 3 << 20];
    let mut readable = pattern(4096, 9);
    let served = p.b.expose(&mut target, Access::REMOTE_WRITE);
    let served_r = p.b.expose(&mut readable, Access::REMOTE_READ);
    let (wkey, rkey) = (served.key(), served_r.key());
    let taddr = target.as_ptr() as u64;

    // A write of two and a half segments.
    let src = pattern(5 << 19, 1);
    let w =
        p.a.post(
            Opcode::Write,
            vec![(OutKind::Write { raddr: taddr, key: wkey, imm: None }, src.as_ptr() as u64, src.len() as u64)],
        )
        .unwrap();
    // Not done while its frames are on their way, nor once written whole.
    while p.a.send_step() {}
    assert!(outcome(&mut p.a, w).is_none(), "done before the peer read it");
    while p.b.read_step(&mut p.a.out) {}
    assert!(outcome(&mut p.a, w).is_none(), "done before the acknowledgement arrived");
    assert_eq!(&target[..src.len()], &src[..], "the write landed");
    p.settle();
    assert!(outcome(&mut p.a, w).unwrap().is_ok());

    // A send into a receive, a send with immediate, an inline send nobody
    // acknowledges, a write with immediate (its receive, its data).
    let mut r1 = vec![0u8; 64];
    let mut r2 = vec![0u8; 64];
    let mut r3 = vec![0u8; 16];
    let mut r4 = vec![0u8; 1];
    let ids: Vec<OpId> = [&mut r1, &mut r2, &mut r3, &mut r4].into_iter().map(|r| p.b.post_recv(r).unwrap()).collect();
    let m1 = pattern(64, 2);
    let m2 = pattern(40, 3);
    let s1 = p.a.post(Opcode::Send, vec![(OutKind::Send { imm: None }, m1.as_ptr() as u64, 64)]).unwrap();
    let s2 = p.a.post(Opcode::SendWithImm, vec![(OutKind::Send { imm: Some(77) }, m2.as_ptr() as u64, 40)]).unwrap();
    let s3 =
        p.a.post(Opcode::Send, vec![(OutKind::Inline { data: b"inline".to_vec(), imm: None, unacked: true }, 0, 6)])
            .unwrap();
    let wi =
        p.a.post(
            Opcode::WriteWithImm,
            vec![(OutKind::Write { raddr: taddr + 100, key: wkey, imm: Some(5) }, m2.as_ptr() as u64, 40)],
        )
        .unwrap();
    // A read of the readable region.
    let mut dst = vec![0u8; 4096];
    let rd =
        p.a.post(
            Opcode::Read,
            vec![(OutKind::ReadReq { raddr: readable.as_ptr() as u64, key: rkey }, dst.as_mut_ptr() as u64, 4096)],
        )
        .unwrap();
    p.settle();
    for id in [s1, s2, s3, wi, rd] {
        assert!(outcome(&mut p.a, id).unwrap().is_ok());
    }
    let got: Vec<_> = ids.iter().map(|&id| outcome(&mut p.b, id).unwrap().unwrap()).collect();
    assert_eq!((got[0].byte_len, got[0].imm), (64, None));
    assert_eq!((got[1].byte_len, got[1].imm), (40, Some(77)));
    assert_eq!(got[2].byte_len, 6);
    assert_eq!(got[3].imm, Some(5), "the write with immediate's receive");
    assert_eq!((&r1[..], &r2[..40], &r3[..6]), (&m1[..], &m2[..], &b"inline"[..]));
    assert_eq!(&target[100..140], &m2[..]);
    assert_eq!(dst, readable);
    assert!(!p.a.is_broken() && !p.b.is_broken());
    drop((served, served_r));
}

/// Counts its wakes.
struct Wakes(std::sync::atomic::AtomicUsize);

impl std::task::Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn an_awaited_look_at_peer_written_memory_is_woken_by_the_next_write_and_by_a_break() {
    let mut p = Pair::new();
    let mut target = vec![0u8; 4096];
    let served = p.b.expose(&mut target, Access::REMOTE_WRITE);
    let (key, taddr) = (served.key(), target.as_ptr() as u64);
    let wakes = Arc::new(Wakes(Default::default()));
    let waker = std::task::Waker::from(Arc::clone(&wakes));
    let woken = || wakes.0.load(std::sync::atomic::Ordering::Relaxed);
    let seen = p.b.core.landed;
    assert!(!p.b.core.landed_or_register(seen, &waker), "nothing landed: registered");
    assert!(!p.b.core.landed_or_register(seen, &waker), "registering again keeps one registration");
    let src = pattern(64, 1);
    let write = |p: &mut Pair| {
        let w = OutKind::Write { raddr: taddr, key, imm: None };
        p.a.post(Opcode::Write, vec![(w, src.as_ptr() as u64, 64)]).unwrap()
    };
    let w = write(&mut p);
    while p.a.send_step() {}
    assert_eq!(woken(), 0, "nothing read yet");
    p.settle();
    assert!(outcome(&mut p.a, w).unwrap().is_ok());
    assert_eq!(woken(), 1, "the landing woke the look, once");
    assert!(p.b.core.landed_or_register(seen, &waker), "a write landed since `seen`: look again");
    let seen = p.b.core.landed;
    assert!(!p.b.core.landed_or_register(seen, &waker));
    // A break wakes it too (the look then sees the connection lost), and
    // a look after it is never registered.
    p.b.core.break_with("cut".into(), &p.b.env);
    assert_eq!(woken(), 2, "the break woke the look");
    assert!(p.b.core.landed_or_register(seen, &waker), "lost: look again, never wait");
    assert_eq!(woken(), 2);
}

#[test]
fn a_chain_completes_once_as_a_whole_after_its_last_message() {
    let mut p = Pair::new();
    let mut target = vec![0u8; 4096];
    let served = p.b.expose(&mut target, Access::REMOTE_WRITE);
    let t = target.as_ptr() as u64;
    let src = pattern(4096, 4);
    let pieces: Vec<_> = (0..4u64)
        .map(|i| {
            (OutKind::Write { raddr: t + i * 1024, key: served.key(), imm: None }, src.as_ptr() as u64 + i * 1024, 1024)
        })
        .collect();
    let id = p.a.post(Opcode::Write, pieces).unwrap();
    // Only the last message asks for an acknowledgement.
    for _ in 0..3 {
        p.a.send_step();
        p.b.read_step(&mut p.a.out);
        p.b.send_step();
        p.a.read_step(&mut p.b.out);
        assert!(outcome(&mut p.a, id).is_none());
    }
    p.settle();
    assert!(outcome(&mut p.a, id).unwrap().is_ok());
    assert_eq!(target, src);
    drop(served);
}

// ---- refusals and breaks ----

#[test]
fn a_refused_request_fails_its_operation_breaks_both_sides_and_nothing_after_it_lands() {
    for case in ["bad key", "out of bounds", "no right", "too long", "no receive"] {
        let mut p = Pair::new();
        let mut target = vec![0u8; 4096];
        let served =
            p.b.expose(&mut target, if case == "no right" { Access::REMOTE_READ } else { Access::REMOTE_WRITE });
        let t = target.as_ptr() as u64;
        let src = pattern(2048, 5);
        let key = if case == "bad key" { served.key() ^ 0x55 } else { served.key() };
        let mut small = vec![0u8; 16];
        let bad = match case {
            "too long" => {
                p.b.post_recv(&mut small).unwrap();
                p.a.post(Opcode::Send, vec![(OutKind::Send { imm: None }, src.as_ptr() as u64, 2048)]).unwrap()
            }
            "no receive" => {
                p.b.rnr_expired = true;
                p.a.post(Opcode::Send, vec![(OutKind::Send { imm: None }, src.as_ptr() as u64, 2048)]).unwrap()
            }
            _ => {
                let at = if case == "out of bounds" { t + 3000 } else { t };
                p.a.post(Opcode::Write, vec![(OutKind::Write { raddr: at, key, imm: None }, src.as_ptr() as u64, 2048)])
                    .unwrap()
            }
        };
        // A good write right behind it: never carried out.
        let after =
            p.a.post(
                Opcode::Write,
                vec![(OutKind::Write { raddr: t, key: served.key(), imm: None }, src.as_ptr() as u64, 64)],
            )
            .unwrap();
        p.settle();
        assert!(p.a.is_broken() && p.b.is_broken(), "{case}: both sides broke");
        let e = outcome(&mut p.a, bad).unwrap().unwrap_err();
        assert!(!e.is_empty(), "{case}");
        assert!(outcome(&mut p.a, after).unwrap().is_err(), "{case}: the write behind it failed");
        assert!(target.iter().all(|&b| b == 0), "{case}: nothing landed");
        if case == "too long" {
            assert!(small.iter().all(|&b| b == 0), "the receive holds nothing");
        }
        p.a.finish_close();
        p.b.finish_close();
        drop(served);
    }
}

#[test]
fn once_this_side_broke_nothing_the_peer_sent_lands() {
    // b breaks by closing (its reader still runs): the write a's stream
    // already holds is not carried out, nor is anything after it.
    let mut p = Pair::new();
    let mut target = vec![0u8; 4096];
    let served = p.b.expose(&mut target, Access::REMOTE_WRITE);
    let src = pattern(4096, 8);
    let kind = OutKind::Write { raddr: target.as_ptr() as u64, key: served.key(), imm: None };
    let w = p.a.post(Opcode::Write, vec![(kind, src.as_ptr() as u64, 4096)]).unwrap();
    while p.a.send_step() {}
    p.b.close();
    p.settle();
    assert!(target.iter().all(|&b| b == 0), "a frame was carried out after the break");
    p.a.finish_close();
    p.b.finish_close();
    assert!(outcome(&mut p.a, w).unwrap().is_err());
    drop(served);
}

/// A scripted hostile peer's replies, written straight into the stream.
fn hostile(p: &mut Pair, frames: &[FrameHeader]) {
    for h in frames {
        put(&mut p.b.out, h, 0, 0);
    }
    while p.a.read_step(&mut p.b.out) {}
}

#[test]
fn replies_that_lie_break_the_connection_and_complete_nothing() {
    let src = pattern(256, 6);
    let mut target = vec![0u8; 256];
    let ack = |seq: u32, status: u32| ack_header(seq, status);
    for case in ["early", "duplicate", "out of order", "unknown", "read response for a write", "after the break"] {
        let mut p = Pair::new();
        let served = p.b.expose(&mut target, Access::REMOTE_WRITE);
        let w = |p: &mut Pair| {
            p.a.post(
                Opcode::Write,
                vec![(
                    OutKind::Write { raddr: target.as_ptr() as u64, key: served.key(), imm: None },
                    src.as_ptr() as u64,
                    256,
                )],
            )
            .unwrap()
        };
        let first = w(&mut p);
        let second = w(&mut p);
        match case {
            "early" => {
                // The acknowledgement of a message this side has not begun to write.
                hostile(&mut p, &[ack(1, 0)]);
            }
            "duplicate" => {
                while p.a.send_step() {}
                hostile(&mut p, &[ack(1, 0), ack(1, 0)]);
            }
            "out of order" => {
                while p.a.send_step() {}
                hostile(&mut p, &[ack(2, 0)]);
            }
            "unknown" => {
                while p.a.send_step() {}
                hostile(&mut p, &[ack(99, 0)]);
            }
            "read response for a write" => {
                while p.a.send_step() {}
                let h =
                    FrameHeader { op: FrameOp::ReadResp as u8, flags: FIRST | LAST, seq: 1, ..FrameHeader::default() };
                hostile(&mut p, &[h]);
            }
            _ => {
                // A refusal, then an acknowledgement after it: not carried out.
                while p.a.send_step() {}
                hostile(&mut p, &[ack(1, crate::completion::WcStatus::RemoteAccess.to_raw()), ack(2, 0)]);
            }
        }
        assert!(p.a.is_broken(), "{case}: broke");
        p.a.finish_close();
        for id in [first, second] {
            let o = outcome(&mut p.a, id).unwrap();
            if case == "duplicate" && id == first {
                assert!(o.is_ok(), "the first acknowledgement was true");
            } else {
                assert!(o.is_err(), "{case}: completed on a lie");
            }
        }
        drop(served);
    }
}

#[test]
fn frames_past_their_bounds_break_the_connection_and_land_nothing() {
    // A segment longer than a segment may be, unknown flag bits, a write
    // whose segments outgrow its announced total, a read response for no
    // read: each breaks a, and nothing lands in its region.
    let mut target = vec![0u8; 4096];
    let cases: [(&str, Vec<FrameHeader>); 4] = [
        (
            "a segment past its bound",
            vec![FrameHeader {
                op: FrameOp::Send as u8,
                flags: FIRST | LAST,
                len: (SEGMENT + 1) as u32,
                total: (SEGMENT + 1) as u32,
                ..FrameHeader::default()
            }],
        ),
        (
            "unknown flags",
            vec![FrameHeader { op: FrameOp::Send as u8, flags: FIRST | LAST | 0x40, ..FrameHeader::default() }],
        ),
        ("a message longer than announced", vec![]),
        (
            "a response for no read",
            vec![FrameHeader {
                op: FrameOp::ReadResp as u8,
                flags: FIRST | LAST,
                seq: 3,
                len: 8,
                ..FrameHeader::default()
            }],
        ),
    ];
    for (what, frames) in cases {
        target.fill(0);
        let mut p = Pair::new();
        let served = p.a.expose(&mut target, Access::REMOTE_WRITE);
        let mut recv = vec![0u8; 64];
        p.a.post_recv(&mut recv).unwrap();
        if frames.is_empty() {
            // A write announcing 8 bytes whose two segments carry 8 and 8.
            let base = FrameHeader {
                op: FrameOp::Write as u8,
                seq: 1,
                key: served.key(),
                addr: target.as_ptr() as u64,
                len: 8,
                total: 8,
                ..FrameHeader::default()
            };
            put(&mut p.b.out, &FrameHeader { flags: FIRST, ..base }, [1u8; 8].as_ptr() as u64, 8);
            put(&mut p.b.out, &FrameHeader { flags: LAST, addr: base.addr + 8, ..base }, [2u8; 8].as_ptr() as u64, 8);
        }
        for h in &frames {
            put(&mut p.b.out, h, [7u8; 16].as_ptr() as u64, (h.len as usize).min(16));
        }
        while p.a.read_step(&mut p.b.out) {}
        assert!(p.a.is_broken(), "{what}: broke");
        assert!(recv.iter().all(|&b| b == 0), "{what}: nothing landed in the receive");
        if what == "a message longer than announced" {
            assert_eq!(&target[..8], &[1u8; 8], "the announced bytes landed");
        }
        let past = if what == "a message longer than announced" { 8 } else { 0 };
        assert!(target[past..].iter().all(|&b| b == 0), "{what}: nothing past what was announced landed");
        drop(served);
    }
}

#[test]
fn a_peer_that_keeps_more_requests_waiting_than_its_depth_breaks_the_connection() {
    let mut p = Pair::new();
    let mut target = vec![0u8; 64];
    let served = p.a.expose(&mut target, Access::REMOTE_WRITE);
    // b's side writes frames by hand: each asks for an acknowledgement, and
    // b never reads what a sends back.
    for seq in 1..=DEPTH + 1 {
        let h = FrameHeader {
            op: FrameOp::Write as u8,
            flags: FIRST | LAST | ACK,
            seq,
            key: served.key(),
            addr: target.as_ptr() as u64,
            len: 1,
            total: 1,
            ..FrameHeader::default()
        };
        put(&mut p.b.out, &h, [7u8].as_ptr() as u64, 1);
    }
    while p.a.read_step(&mut p.b.out) {}
    assert!(p.a.is_broken());
    assert!(p.a.core.control.len() <= DEPTH as usize + 2, "replies owed stay bounded");
    drop(served);
}

// ---- random interleavings ----

/// What a run may do at each step.
#[derive(Clone, Debug)]
enum Act {
    /// One actor's step (see [`Pair::step`]).
    RxStep(u8),
    /// A posts a write of `len` bytes at `at` of b's writable region
    /// (`bad`: with a key b never granted).
    Write { len: usize, at: usize, bad: bool },
    /// A posts a send of `len` bytes; b posts a receive of `room` bytes.
    Send { len: usize, room: usize },
    /// A reads `len` bytes at `at` of b's read-only region.
    Read { len: usize, at: usize },
    /// The stream fails under both.
    Cut,
    /// A closes.
    Close,
    /// B closes.
    CloseB,
}

fn act() -> impl Strategy<Value = Act> {
    prop_oneof![
        10 => any::<u8>().prop_map(Act::RxStep),
        2 => (1usize..3 << 19, 0usize..1 << 20, prop::bool::weighted(0.1)).prop_map(|(len, at, bad)| Act::Write { len, at, bad }),
        2 => (0usize..5000, 0usize..6000).prop_map(|(len, room)| Act::Send { len, room }),
        1 => (1usize..70_000, 0usize..1 << 16).prop_map(|(len, at)| Act::Read { len, at }),
        1 => Just(Act::Cut),
        1 => Just(Act::Close),
        1 => Just(Act::CloseB),
    ]
}

/// One operation of a's, to judge its outcome by.
struct Op {
    id: OpId,
    kind: OpKind,
    /// Its outcome, once taken: whether it succeeded.
    ended: Option<bool>,
}

enum OpKind {
    Write { bad: bool },
    Send { data: Vec<u8> },
    Read { at: usize, dst: Box<[u8]> },
}

/// A run's bookkeeping, and the invariants checked after every step.
struct Trial {
    p: Pair,
    ops: Vec<Op>,
    recvs: VecDeque<(OpId, Box<[u8]>)>,
    /// What b's receives took, in order (length, bytes).
    taken: Vec<Vec<u8>>,
    /// b's writable region when b broke.
    frozen: Option<Vec<u8>>,
}

impl Trial {
    fn check(&mut self, region: &[u8], readable: &[u8]) -> std::result::Result<(), TestCaseError> {
        let p = &mut self.p;
        for op in &mut self.ops {
            if op.ended.is_some() {
                continue;
            }
            let Some(o) = outcome(&mut p.a, op.id) else { continue };
            if o.is_ok() {
                // Done only once the peer read the whole message.
                let end = p.a.ends.get(&op.id.wr_id(true)).copied();
                prop_assert!(end.is_some_and(|e| p.b.consumed >= e), "completed before the peer read it all");
                match &op.kind {
                    OpKind::Write { bad } => prop_assert!(!bad, "a write with a key never granted completed"),
                    OpKind::Send { .. } => {}
                    OpKind::Read { at, dst } => {
                        prop_assert!(
                            dst[..] == readable[*at..*at + dst.len()],
                            "a read completed before its data arrived"
                        )
                    }
                }
            }
            op.ended = Some(o.is_ok());
        }
        while let Some((id, _)) = self.recvs.front() {
            let Some(o) = outcome(&mut p.b, *id) else { break };
            let (_, buf) = self.recvs.pop_front().expect("looked at");
            if let Ok(c) = o {
                self.taken.push(buf[..c.byte_len as usize].to_vec());
            }
        }
        for s in [&p.a, &p.b] {
            prop_assert!(s.core.queue.len() <= DEPTH as usize, "the send queue past its depth");
            prop_assert!(s.core.control.len() <= s.core.peer_depth + 2, "replies owed past the peer's depth");
            prop_assert!(s.core.recvs.len() <= DEPTH as usize);
        }
        // A payload already being read when b broke may still land; no
        // more after it.
        if p.b.is_broken() && !matches!(p.b.pending, Some(RxStep::Fill { .. })) {
            match &self.frozen {
                None => self.frozen = Some(region.to_vec()),
                Some(f) => prop_assert!(f[..] == region[..], "b's memory changed after it broke"),
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Whatever the order of the steps, cuts and closes: no operation
    /// completes before the peer read all its bytes (a read, before its
    /// data arrived); once b broke, nothing more lands in its memory (but
    /// the one payload its reader was already reading); what
    /// each side holds stays within its bounds; every operation ends; and
    /// the sends that completed landed in b's receives, in order, whole.
    #[test]
    fn random_interleavings_keep_the_rules(acts in prop::collection::vec(act(), 1..120)) {
        const REGION: usize = 2 << 20;
        let mut region = vec![0u8; REGION].into_boxed_slice();
        let mut readable = pattern(1 << 17, 200).into_boxed_slice();
        let mut run = Trial { p: Pair::new(), ops: Vec::new(), recvs: VecDeque::new(), taken: Vec::new(), frozen: None };
        let base = region.as_ptr() as u64;
        let rbase = readable.as_ptr() as u64;
        let served = run.p.b.expose(&mut region, Access::REMOTE_WRITE);
        let served_r = run.p.b.expose(&mut readable, Access::REMOTE_READ);
        let (key, rkey) = (served.key(), served_r.key());
        let mut sources: Vec<Vec<u8>> = Vec::new();
        let mut seed = 0u8;
        for a in acts {
            let p = &mut run.p;
            match a {
                Act::RxStep(who) => { p.step(who); }
                Act::Write { len, at, bad } => {
                    let at = at.min(REGION - len);
                    seed = seed.wrapping_add(1);
                    let data = pattern(len, seed);
                    let k = if bad { key ^ 0x5a5a } else { key };
                    let kind = OutKind::Write { raddr: base + at as u64, key: k, imm: None };
                    if let Some(id) = p.a.post(Opcode::Write, vec![(kind, data.as_ptr() as u64, len as u64)]) {
                        run.ops.push(Op { id, kind: OpKind::Write { bad }, ended: None });
                        sources.push(data);
                    }
                }
                Act::Send { len, room } => {
                    seed = seed.wrapping_add(1);
                    let data = pattern(len, seed);
                    let mut buf = vec![0u8; room].into_boxed_slice();
                    if let Some(id) = p.b.post_recv(&mut buf) {
                        run.recvs.push_back((id, buf));
                    }
                    if let Some(id) = p.a.post(Opcode::Send, vec![(OutKind::Send { imm: None }, data.as_ptr() as u64, len as u64)]) {
                        run.ops.push(Op { id, kind: OpKind::Send { data: data.clone() }, ended: None });
                        sources.push(data);
                    }
                }
                Act::Read { len, at } => {
                    let at = at.min(readable.len() - len);
                    let mut dst = vec![0u8; len].into_boxed_slice();
                    let kind = OutKind::ReadReq { raddr: rbase + at as u64, key: rkey };
                    if let Some(id) = p.a.post(Opcode::Read, vec![(kind, dst.as_mut_ptr() as u64, len as u64)]) {
                        run.ops.push(Op { id, kind: OpKind::Read { at, dst }, ended: None });
                    }
                }
                Act::Cut => { p.a.cut(); p.b.cut(); }
                Act::Close => p.a.close(),
                Act::CloseB => p.b.close(),
            }
            run.check(&region, &readable)?;
        }
        // The end: every actor moves until none can (a message still
        // waiting for a receive gets none), a closes, and whatever is left
        // fails once both sides' threads are gone.
        run.p.b.rnr_expired = true;
        for phase in 0..2 {
            let mut idle = 0;
            let mut who = 0u8;
            while idle < 4 {
                if run.p.step(who) { idle = 0 } else { idle += 1 }
                who = who.wrapping_add(1);
                run.check(&region, &readable)?;
            }
            if phase == 0 {
                run.p.a.close();
            }
        }
        run.p.a.finish_close();
        run.p.b.finish_close();
        run.check(&region, &readable)?;
        for op in &run.ops {
            prop_assert!(op.ended.is_some(), "an operation never ended");
        }
        let sent: Vec<&Vec<u8>> = run.ops.iter().filter_map(|o| match (&o.kind, o.ended) {
            (OpKind::Send { data }, Some(true)) => Some(data),
            _ => None,
        }).collect();
        prop_assert!(run.taken.len() >= sent.len(), "a send completed that no receive took");
        for (data, got) in sent.iter().zip(&run.taken) {
            prop_assert!(got[..] == data[..], "a send landed elsewhere than in its receive, or not whole");
        }
        drop(run);
        drop((served, served_r, sources));
    }
}
