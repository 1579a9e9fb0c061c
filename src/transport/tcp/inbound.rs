//! The inbound half of the core: the peer's frames carried out against the
//! rules of a reliable connection, with no I/O. The thread reading the
//! stream hands each header in ([`Core::on_header`]) and does what the
//! [`RxStep`] it gets back says: read payload into memory, drop payload,
//! read the next segment's header, wait for a receive, make a written
//! range visible to CUDA work, acknowledge. It reports each back, and
//! decides nothing itself: which memory a byte may land in, when an
//! operation completes, what a refusal fails and what breaks the
//! connection are all decided here.
//!
//! A method that returns an error has ended the frame: the receive it was
//! filling (if any) has failed, and the caller breaks the connection with
//! the reason. An I/O failure is reported through [`Core::abort`], which
//! does the same.

use std::sync::Arc;

use super::core::{AfterDrain, Core, Ctl, ReadResponse, Recv, Rx, Signals, raw};
use super::frame::{ACK, FIRST, FrameHeader, FrameOp, IMM, LAST};
use super::replies::Progress;
use super::responder;
use crate::completion::WcStatus;
use crate::memory::keys::KeyEntry;
use crate::ops::RawCompletion;

/// What the core needs of the connection's surroundings to carry frames out.
pub(super) trait Env: Signals {
    /// The exposed region under `key`, if this connection's peer may use it.
    fn lookup(&self, key: u32) -> Option<Arc<KeyEntry>>;
}

/// What the thread reading the stream does next for the frame at hand.
#[derive(Debug)]
pub(super) enum RxStep {
    /// Read the next `len` bytes of payload into `addr..addr + len` (with
    /// `gate`, only while the exposure is alive: once it is revoked the
    /// bytes are read and dropped), then [`Core::filled`].
    Fill { addr: u64, len: usize, gate: Option<Arc<KeyEntry>> },
    /// Read the next `len` bytes of payload and drop them, then
    /// [`Core::dropped`].
    Drop { len: usize },
    /// Read the header of the message's next segment, then
    /// [`Core::on_segment`].
    NextSegment,
    /// The message needs a posted receive: wait for one (up to the
    /// receiver-not-ready budget), then [`Core::on_receive`].
    NeedRecv,
    /// Make `len` bytes written at `addr` under `key` visible to CUDA work
    /// (a write with immediate into GPU memory), then [`Core::visible`].
    MakeVisible { key: u32, addr: u64, len: u64 },
    /// Send the peer this reply, an acknowledgement or a read's response
    /// (the frame is carried out): [`Core::reply`] queues it for the
    /// sender thread, or the thread that carried the frame out writes it
    /// itself.
    Reply(Ctl),
    /// The frame is carried out.
    Done,
}

pub(super) type Stepped = std::result::Result<RxStep, String>;

impl Core {
    /// Carries out a frame whose header `h` was read (`progress`: how far
    /// this side's writer is, for a reply that may come early).
    pub(super) fn on_header(&mut self, h: FrameHeader, progress: Progress, env: &impl Env) -> Stepped {
        if let Some(stopped) = self.carried_out_no_more(env) {
            return stopped;
        }
        if !matches!(self.rx, Rx::Idle) {
            return self.ended(Err("a frame began inside another (the reader lost its place)".into()));
        }
        let stepped = match FrameOp::from_raw(h.op) {
            Some(FrameOp::Send | FrameOp::Write) if h.flags & FIRST == 0 => Err(format!(
                "a garbled frame (operation {} without its first segment): the stream is out of step",
                h.op
            )),
            Some(FrameOp::Send) => self.message(h, None, env),
            Some(FrameOp::Write) => self.write(h, env),
            Some(FrameOp::ReadReq) => self.read_request(h, env),
            Some(FrameOp::ReadResp) => self.read_response(h, progress),
            Some(FrameOp::Ack) => self.on_ack(h.seq, WcStatus::from_raw(h.total), progress, env).map(|()| RxStep::Done),
            Some(FrameOp::Bye) => Err("the peer closed the connection (it said bye)".to_owned()),
            None => Err(format!("a garbled frame (operation {}): the stream is out of step", h.op)),
        };
        self.ended(stepped)
    }

    /// The payload of the last [`RxStep::Fill`] is in memory. (Once the
    /// connection broke, the frame goes no further: what the peer sent is
    /// carried out no more, segment by segment.)
    pub(super) fn filled(&mut self, env: &impl Env) -> Stepped {
        if let Some(stopped) = self.carried_out_no_more(env) {
            return stopped;
        }
        let stepped = match &mut self.rx {
            Rx::Message { cur, off, .. } => {
                *off += u64::from(cur.len);
                if cur.flags & LAST == 0 { Ok(RxStep::NextSegment) } else { self.message_landed(env) }
            }
            Rx::Write { cur, off, .. } => {
                *off += u64::from(cur.len);
                if cur.flags & LAST == 0 { Ok(RxStep::NextSegment) } else { self.write_landed(env) }
            }
            Rx::ReadResp { h, .. } if h.flags & LAST == 0 => {
                self.rx = Rx::Idle;
                Ok(RxStep::Done)
            }
            Rx::ReadResp { .. } => self.read_landed(env),
            _ => Err(self.abort_owned("payload landed outside a frame", env)),
        };
        self.ended(stepped)
    }

    /// The payload of the last [`RxStep::Drop`] was read and dropped.
    pub(super) fn dropped(&mut self, env: &impl Env) -> Stepped {
        let stepped = match std::mem::take(&mut self.rx) {
            Rx::Draining { first, cur, then } if cur.flags & LAST == 0 => {
                self.rx = Rx::Draining { first, cur, then };
                Ok(RxStep::NextSegment)
            }
            Rx::Draining { then: AfterDrain::Refuse(seq, r), .. } => {
                self.refuse(seq, r.status, r.why, env).map(|()| RxStep::Done)
            }
            Rx::Draining { then: AfterDrain::Fail(why), .. } => Err(why),
            other => {
                self.rx = other;
                Err(self.abort_owned("payload dropped outside a frame", env))
            }
        };
        self.ended(stepped)
    }

    /// The header of the current message's next segment was read.
    pub(super) fn on_segment(&mut self, h: FrameHeader, env: &impl Env) -> Stepped {
        if let Some(stopped) = self.carried_out_no_more(env) {
            return stopped;
        }
        let first = match &self.rx {
            Rx::Message { first, .. } | Rx::Write { first, .. } | Rx::Draining { first, .. } => *first,
            _ => {
                let why = self.abort_owned("a segment outside a message", env);
                return self.ended(Err(why));
            }
        };
        if let Err(why) = h.continues(&first) {
            let why = self.abort(why, env);
            return self.ended(Err(why));
        }
        let stepped = match &mut self.rx {
            Rx::Message { cur, .. } => {
                *cur = h;
                self.message_segment(env)
            }
            Rx::Write { cur, .. } => {
                *cur = h;
                self.write_segment()
            }
            Rx::Draining { cur, .. } => {
                *cur = h;
                Ok(RxStep::Drop { len: h.len as usize })
            }
            _ => unreachable!("looked at above"),
        };
        self.ended(stepped)
    }

    /// The wait for a receive ended: `posted`, one is in `recvs`; else the
    /// receiver-not-ready budget passed without one.
    pub(super) fn on_receive(&mut self, posted: bool, env: &impl Env) -> Stepped {
        let Rx::WaitingRecv { h, written } = std::mem::take(&mut self.rx) else {
            let why = self.abort_owned("no message waits for a receive", env);
            return self.ended(Err(why));
        };
        if self.stopping || self.q.lost().is_some() {
            let why = self.q.lost().map_or_else(|| "the connection is closing".into(), str::to_owned);
            return self.ended(Err(why));
        }
        let recv = if posted { self.recvs.pop_front() } else { None };
        if posted && recv.is_none() {
            self.rx = Rx::WaitingRecv { h, written };
            return Ok(RxStep::NeedRecv);
        }
        let stepped = self.land(h, written, recv, env);
        self.ended(stepped)
    }

    /// The range of a write with immediate was made visible (or could not
    /// be: the connection breaks, loudly).
    pub(super) fn visible(&mut self, made: std::result::Result<(), String>, env: &impl Env) -> Stepped {
        let Rx::Visible { h } = std::mem::take(&mut self.rx) else {
            let why = self.abort_owned("no write waits to be made visible", env);
            return self.ended(Err(why));
        };
        let stepped = match made {
            Ok(()) => self.message(h, Some(h.total), env),
            Err(e) => Err(format!("the data of a write with immediate could not be made visible in GPU memory: {e}")),
        };
        self.ended(stepped)
    }

    /// The frame cannot go on (`why`: the stream failed or ended, or its
    /// next header was garbled): a receive it was filling fails. The
    /// connection breaks with the reason this returns.
    pub(super) fn abort(&mut self, why: String, sig: &impl Signals) -> String {
        if let Rx::Message { recv, .. } = std::mem::take(&mut self.rx) {
            // The receive was taken off the queue: this side fails it.
            self.complete(&raw(recv.wr_id, WcStatus::WrFlush), sig);
        }
        why
    }

    /// Once the connection broke (a refusal either way, a lost peer, this
    /// side closing), nothing more from the peer is carried out: the frame
    /// in progress ends (a receive it was filling fails) with the reason.
    fn carried_out_no_more(&mut self, sig: &impl Signals) -> Option<Stepped> {
        let why = self.q.lost()?.to_owned();
        let why = self.abort(why, sig);
        Some(self.ended(Err(why)))
    }

    fn abort_owned(&mut self, why: &str, sig: &impl Signals) -> String {
        self.abort(format!("{why} (the reader lost its place)"), sig)
    }

    /// Every error ends the frame.
    fn ended(&mut self, stepped: Stepped) -> Stepped {
        if stepped.is_err() {
            self.rx = Rx::Idle;
        }
        stepped
    }

    /// A send, or the receive a write with immediate consumes (`written`:
    /// its byte count; its data already landed): lands in the next posted
    /// receive, or waits for one.
    fn message(&mut self, h: FrameHeader, written: Option<u32>, env: &impl Env) -> Stepped {
        match self.recvs.pop_front() {
            Some(recv) => self.land(h, written, Some(recv), env),
            None => {
                self.rx = Rx::WaitingRecv { h, written };
                Ok(RxStep::NeedRecv)
            }
        }
    }

    fn land(&mut self, h: FrameHeader, written: Option<u32>, recv: Option<Recv>, env: &impl Env) -> Stepped {
        let total = u64::from(written.unwrap_or(h.total));
        let taken = recv.map(|r| {
            let len = r.len;
            (r, len)
        });
        match responder::message(total, taken, written.is_some()) {
            responder::Message::Land(recv) if written.is_some() => self.delivered(h, recv, total, true, env),
            responder::Message::Land(recv) => {
                self.rx = Rx::Message { first: h, cur: h, recv, off: 0, total };
                self.message_segment(env)
            }
            responder::Message::TooLong(recv, r) => {
                // Failed first (the bytes go nowhere), so that a stream that
                // breaks while draining cannot leave it pending.
                let c = RawCompletion { byte_len: h.total, ..raw(recv.wr_id, WcStatus::LocalLength) };
                self.complete(&c, env);
                self.drain(h, AfterDrain::Refuse(h.seq, r))
            }
            responder::Message::NoReceive(r) if written.is_none() => self.drain(h, AfterDrain::Refuse(h.seq, r)),
            responder::Message::NoReceive(r) => self.refuse(h.seq, r.status, r.why, env).map(|()| RxStep::Done),
        }
    }

    /// The current segment of a message landing in a receive: where its
    /// bytes go, if they fit.
    fn message_segment(&mut self, env: &impl Env) -> Stepped {
        let Rx::Message { cur, recv, off, total, .. } = &self.rx else { unreachable!("a message lands") };
        let n = u64::from(cur.len);
        // Within the receive, and within what the message announced.
        if let Err(why) = responder::segment_fits(*off, n, recv.len.min(*total)) {
            let wr_id = recv.wr_id;
            self.rx = Rx::Idle;
            self.complete(&raw(wr_id, WcStatus::LocalLength), env);
            return Err(why);
        }
        Ok(RxStep::Fill { addr: recv.addr + *off, len: n as usize, gate: None })
    }

    fn message_landed(&mut self, env: &impl Env) -> Stepped {
        let Rx::Message { first, recv, off, total, .. } = std::mem::take(&mut self.rx) else {
            unreachable!("a message landed")
        };
        if let Err(why) = responder::whole(total, off) {
            // Its last segment came early: the receive would report bytes
            // that never arrived.
            self.complete(&raw(recv.wr_id, WcStatus::WrFlush), env);
            return Err(why);
        }
        self.delivered(first, recv, total, false, env)
    }

    /// `recv` holds the message `h` began (`total` bytes): it completes,
    /// and the peer is acknowledged if it asked.
    fn delivered(&mut self, h: FrameHeader, recv: Recv, total: u64, by_write: bool, env: &impl Env) -> Stepped {
        let c = RawCompletion {
            byte_len: total as u32,
            imm: (h.flags & IMM != 0).then_some(h.imm),
            by_write_imm: by_write,
            ..raw(recv.wr_id, WcStatus::Success)
        };
        self.complete(&c, env);
        self.rx = Rx::Idle;
        Ok(if h.flags & ACK != 0 { RxStep::Reply(Ctl::Ack { seq: h.seq, status: 0 }) } else { RxStep::Done })
    }

    fn write(&mut self, h: FrameHeader, env: &impl Env) -> Stepped {
        match responder::write(env.lookup(h.key), h.key, h.addr, u64::from(h.total)) {
            Ok(entry) => {
                self.rx = Rx::Write { first: h, cur: h, entry, off: 0 };
                self.write_segment()
            }
            Err(r) => self.drain(h, AfterDrain::Refuse(h.seq, r)),
        }
    }

    /// The current segment of a write: where its bytes go, if the region
    /// takes them.
    fn write_segment(&mut self) -> Stepped {
        let Rx::Write { first, cur, entry, off } = &self.rx else { unreachable!("a write lands") };
        let n = u64::from(cur.len);
        // No byte past what the write announced lands.
        if let Err(why) = responder::segment_fits(*off, n, u64::from(first.total)) {
            self.rx = Rx::Idle;
            return Err(why);
        }
        if let Err(r) = responder::write_segment(entry, cur.addr, n) {
            let (first, cur) = (*first, *cur);
            self.rx = Rx::Draining { first, cur, then: AfterDrain::Refuse(first.seq, r) };
            return Ok(RxStep::Drop { len: cur.len as usize });
        }
        Ok(RxStep::Fill { addr: cur.addr, len: n as usize, gate: Some(Arc::clone(entry)) })
    }

    fn write_landed(&mut self, env: &impl Env) -> Stepped {
        let Rx::Write { first: h, entry, off, .. } = std::mem::take(&mut self.rx) else {
            unreachable!("a write landed")
        };
        let total = u64::from(h.total);
        // A write with immediate would report bytes that never arrived.
        responder::whole(total, off)?;
        if !*entry.alive.read().unwrap_or_else(|e| e.into_inner()) {
            let r = responder::withdrawn_during_write();
            return self.refuse(h.seq, r.status, r.why, env).map(|()| RxStep::Done);
        }
        self.count_landing(env);
        if h.flags & IMM != 0 {
            // The immediate announces the data: in GPU memory it must be
            // visible to CUDA work before the receive completes.
            self.rx = Rx::Visible { h };
            return Ok(RxStep::MakeVisible { key: h.key, addr: h.addr, len: total });
        }
        Ok(if h.flags & ACK != 0 { RxStep::Reply(Ctl::Ack { seq: h.seq, status: 0 }) } else { RxStep::Done })
    }

    fn read_request(&mut self, h: FrameHeader, env: &impl Env) -> Stepped {
        let total = u64::from(h.total);
        match responder::read(env.lookup(h.key), h.key, h.addr, total) {
            Ok(entry) => {
                let response = ReadResponse { seq: h.seq, entry, addr: h.addr, len: total, sent: 0 };
                Ok(RxStep::Reply(Ctl::ReadResp(response)))
            }
            Err(r) => self.refuse(h.seq, r.status, r.why, env).map(|()| RxStep::Done),
        }
    }

    /// A segment of a read response: it must answer the oldest request
    /// waiting for a reply, a read that reached the peer whole, and land
    /// next in order inside its buffer (the peer sends a read's response
    /// in order, from its start).
    fn read_response(&mut self, h: FrameHeader, progress: Progress) -> Stepped {
        let n = u64::from(h.len);
        match self.replies.on_read_segment(h.seq, h.addr, n, progress) {
            Ok(seg) => {
                // Inside the read's destination (checked), owned by its operation
                // until this side lets go of the read (`read_done`, or `take_reads`
                // when the receiver stops): nobody else completes the operation.
                let addr = seg.addr + h.addr;
                self.rx = Rx::ReadResp { h, seg };
                Ok(RxStep::Fill { addr, len: n as usize, gate: None })
            }
            Err(why) => self.drain(h, AfterDrain::Fail(why)),
        }
    }

    fn read_landed(&mut self, env: &impl Env) -> Stepped {
        let Rx::ReadResp { h, seg } = std::mem::take(&mut self.rx) else { unreachable!("a read response landed") };
        let whole = self.replies.read_done().is_some_and(|(_, whole)| whole);
        if !whole {
            // Part of the read's buffer would hold what was there before.
            self.complete(&raw(seg.wr_id, WcStatus::BadResponse), env);
            return Err(format!("a read response of {} bytes for a read of {}", h.addr + u64::from(h.len), seg.len));
        }
        self.complete(&raw(seg.wr_id, WcStatus::Success), env);
        Ok(RxStep::Done)
    }

    /// Drops the rest of the message `h` began, from its current segment,
    /// then ends as `then` says.
    fn drain(&mut self, h: FrameHeader, then: AfterDrain) -> Stepped {
        self.rx = Rx::Draining { first: h, cur: h, then };
        Ok(RxStep::Drop { len: h.len as usize })
    }
}
