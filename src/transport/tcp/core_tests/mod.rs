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
                    Ctl::ReadResp(ReadResponse { seq, entry, addr, len, sent }) => {
                        assert_eq!(sent, 0, "the cores' harness writes replies whole");
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
            Some(RxStep::Reply(ctl)) => self.core.reply(ctl, &self.env).map(|()| RxStep::Done),
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

mod props;
mod rules;
