//! What this side waits for from its peer, with no I/O: the replies to its
//! requests, and who may complete each operation.
//!
//! The peer carries requests out in stream order and answers them in that
//! order: an acknowledgement for a message that asks for one, a response
//! for a read, an error acknowledgement for a request it refuses (after
//! which it stops). So every reply answers the oldest request still
//! waiting for one, and only a request that reached the peer whole can be
//! answered. A reply may still arrive while the request's last bytes are
//! being handed to the socket (the peer can answer before the writer
//! returns from its last call): such an acknowledgement is held for the
//! writer, which completes the operation once it no longer touches the
//! buffer. Anything else is a lie that breaks the connection: a reply
//! while bytes of the request were never handed to the socket, a second
//! reply, a reply out of order, a reply to a request never sent.
//!
//! Who completes what (an operation completes when no code of the
//! transport can touch its buffer again):
//! - a request being written: its writer only ([`Replies::finish`]);
//! - a message sent whole that waits for its acknowledgement: the reader
//!   of the acknowledgement, or a break ([`Replies::take_sent_messages`]);
//!   no transport code touches its buffer any more;
//! - a read sent whole: the reader only, which fills the read's buffer
//!   from the socket, on its response or when it stops
//!   ([`Replies::take_reads`]).

#![forbid(unsafe_code)]

use std::collections::VecDeque;

use crate::ops::op_of;

/// Where the writer of the current message is: the bytes of it (headers
/// included) handed to the socket, and whether it is inside a call that
/// may hand more.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Progress {
    pub handed: u64,
    pub in_call: bool,
}

impl Progress {
    const IN_CALL: u64 = 1 << 63;

    /// One word, for an atomic the writer stores without a lock.
    pub fn pack(self) -> u64 {
        self.handed & !Self::IN_CALL | if self.in_call { Self::IN_CALL } else { 0 }
    }

    pub fn unpack(word: u64) -> Progress {
        Progress { handed: word & !Self::IN_CALL, in_call: word & Self::IN_CALL != 0 }
    }
}

/// What a request waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reply {
    /// Nothing unless it is refused: an earlier request of a chain, or an
    /// untracked inline send.
    None,
    /// An acknowledgement.
    Ack,
    /// A response of `len` bytes, to land at `addr`.
    Read { addr: u64, len: u64 },
}

/// A request, as its writer starts it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Request {
    pub seq: u32,
    /// The sequence number of the first request of its operation.
    pub first: u32,
    pub wr_id: u64,
    pub reply: Reply,
    /// Its bytes on the wire, headers included.
    pub wire: u64,
}

#[derive(Debug)]
struct Awaited {
    seq: u32,
    first: u32,
    wr_id: u64,
    /// For a read: its buffer, and where the response's next segment starts.
    read: Option<(u64, u64, u64)>,
    /// Its writer has not finished with it.
    writing: bool,
}

/// What an acknowledgement means.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum OnAck {
    /// The request was sent whole: complete `wr_id` with success.
    Complete(u64),
    /// The request's writer may still be in its last call: the writer
    /// completes it ([`Replies::finish`]).
    Deferred,
    /// The peer refused a request of the operation whose final request id
    /// is given (`None`: its final request is not sent yet; the caller
    /// looks in its queue). The caller records the failure and breaks the
    /// connection.
    Refused(Option<u64>),
    /// The peer broke the protocol: the connection breaks, for this reason.
    Violation(String),
}

/// Where a segment of a read's response lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Segment {
    pub wr_id: u64,
    /// The read's buffer.
    pub addr: u64,
    pub len: u64,
}

/// The replies this side waits for, in request order (see the module docs).
#[derive(Debug)]
pub(super) struct Replies {
    waiting: VecDeque<Awaited>,
    /// The message being written: its sequence number and wire bytes.
    current: Option<(u32, u64)>,
    /// An acknowledgement of the message being written, held for its writer.
    deferred: Option<(u32, u64)>,
    /// The newest request a writer started.
    last_started: Option<u32>,
    /// Final requests failed while a read of their operation was the
    /// reader's: the reader completes them when it lets go of its reads.
    parked: Vec<u64>,
    /// The reader stopped and let go of its reads: no response lands any
    /// more, so a read whose writer finishes later is the writer's to fail.
    reads_closed: bool,
    /// The most bytes one call of the writer hands to the socket.
    max_call: u64,
}

/// Whether `seq` lies in `first..=last`, sequence numbers wrapping.
fn within(first: u32, last: u32, seq: u32) -> bool {
    seq.wrapping_sub(first) <= last.wrapping_sub(first)
}

impl Replies {
    pub fn new(capacity: usize, max_call: u64) -> Replies {
        Replies {
            waiting: VecDeque::with_capacity(capacity),
            current: None,
            deferred: None,
            last_started: None,
            parked: Vec::new(),
            reads_closed: false,
            max_call,
        }
    }

    /// A writer starts `r` (or goes on with it: a message another thread
    /// began is not started twice).
    pub fn start(&mut self, r: &Request) {
        self.current = Some((r.seq, r.wire));
        self.last_started = Some(r.seq);
        let read = match r.reply {
            Reply::None => return,
            Reply::Ack => None,
            Reply::Read { addr, len } => Some((addr, len, 0)),
        };
        self.waiting.push_back(Awaited { seq: r.seq, first: r.first, wr_id: r.wr_id, read, writing: true });
    }

    /// The writer of `seq` is done with it (`ok`: every byte was handed to
    /// the socket). Returns what the writer must complete now: an
    /// acknowledgement held for it (success, or a flush if the write
    /// failed after all), or, for a write that failed, the request itself.
    pub fn finish(&mut self, seq: u32, ok: bool) -> Option<(u64, bool)> {
        if self.current.is_some_and(|(s, _)| s == seq) {
            self.current = None;
        }
        if let Some((s, wr_id)) = self.deferred {
            if s == seq {
                self.deferred = None;
                return Some((wr_id, ok));
            }
        }
        let at = self.waiting.iter().rposition(|a| a.seq == seq && a.writing)?;
        // A read sent whole after the reader stopped would wait for a
        // response nobody reads: failed with its write.
        let orphan_read = self.reads_closed && self.waiting[at].read.is_some();
        if ok && !orphan_read {
            self.waiting[at].writing = false;
            return None;
        }
        self.waiting.remove(at).map(|a| (a.wr_id, false))
    }

    /// Whether `seq` is a request a writer started.
    fn started(&self, seq: u32) -> bool {
        self.last_started.is_some_and(|last| last.wrapping_sub(seq) < 1 << 31)
    }

    /// Why a reply to a request still being written came too early, if
    /// it did: bytes of the request that were never handed to the socket
    /// cannot have reached the peer.
    fn early(&self, seq: u32, p: Progress) -> Option<String> {
        let (_, wire) = self.current.filter(|(s, _)| *s == seq)?;
        let reach = p.handed.saturating_add(if p.in_call { self.max_call } else { 0 });
        (reach < wire).then(|| {
            format!(
                "the peer answered request {seq} when {} of its {wire} bytes had been sent: \
                 it answered before the request reached it whole",
                p.handed
            )
        })
    }

    /// Why a reply to `seq` does not answer the oldest request waiting.
    fn out_of_order(&self, seq: u32) -> String {
        match self.waiting.front() {
            Some(front) if self.waiting.iter().any(|a| a.seq == seq) => format!(
                "a reply to request {seq} while request {} waits for its reply: the peer answers out of order",
                front.seq
            ),
            _ => format!("a reply to request {seq}, for which no reply is due: a duplicate, or a request never sent"),
        }
    }

    /// An acknowledgement of `seq` with status `ok` (success) or not,
    /// while the current writer is at `progress`.
    pub fn on_ack(&mut self, seq: u32, success: bool, progress: Progress) -> OnAck {
        if !success {
            if !self.started(seq) {
                return OnAck::Violation(format!("the peer refused request {seq}, which was never sent"));
            }
            let chain = self.waiting.iter().find(|a| within(a.first, a.seq, seq)).map(|a| a.wr_id);
            return OnAck::Refused(chain);
        }
        let Some(front) = self.waiting.front() else {
            return OnAck::Violation(self.out_of_order(seq));
        };
        if front.seq != seq {
            return OnAck::Violation(self.out_of_order(seq));
        }
        if front.read.is_some() {
            return OnAck::Violation("the peer acknowledged a read without sending its data".into());
        }
        if front.writing {
            if let Some(why) = self.early(seq, progress) {
                return OnAck::Violation(why);
            }
            let Some(front) = self.waiting.pop_front() else { unreachable!("the front was just read") };
            self.deferred = Some((front.seq, front.wr_id));
            return OnAck::Deferred;
        }
        let Some(front) = self.waiting.pop_front() else { unreachable!("the front was just read") };
        OnAck::Complete(front.wr_id)
    }

    /// A segment of the response to read `seq`: `n` bytes at offset `off`
    /// of the read's buffer. Checks that it answers the oldest request
    /// waiting, a read sent whole (taking it from its writer, who may
    /// still be in its last call, which no longer touches the buffer), and
    /// that it lands in order inside the buffer. The reader then owns the
    /// read until [`read_done`](Self::read_done) or
    /// [`take_reads`](Self::take_reads).
    pub fn on_read_segment(&mut self, seq: u32, off: u64, n: u64, progress: Progress) -> Result<Segment, String> {
        let Some(front) = self.waiting.front() else {
            return Err(self.out_of_order(seq));
        };
        if front.seq != seq {
            return Err(self.out_of_order(seq));
        }
        let Some((addr, len, next)) = front.read else {
            return Err(format!("a read response to request {seq}, which is not a read"));
        };
        if front.writing {
            if let Some(why) = self.early(seq, progress) {
                return Err(why);
            }
        }
        if off.checked_add(n).is_none_or(|e| e > len) {
            return Err("a read response past its read's buffer".into());
        }
        if off != next {
            return Err(format!("a read response out of order (bytes from {off} where {next} were due)"));
        }
        let wr_id = front.wr_id;
        if let Some(front) = self.waiting.front_mut() {
            front.writing = false;
            front.read = Some((addr, len, off + n));
        }
        Ok(Segment { wr_id, addr, len })
    }

    /// The response to the oldest read ended: takes the read off the
    /// waiting list. Its id, and whether the response filled its buffer.
    pub fn read_done(&mut self) -> Option<(u64, bool)> {
        let front = self.waiting.pop_front()?;
        let (_, len, next) = front.read?;
        Some((front.wr_id, next == len))
    }

    /// Messages sent whole that wait for an acknowledgement: a break fails
    /// them (no transport code touches their buffers). Requests being
    /// written stay their writer's; reads stay the reader's.
    pub fn take_sent_messages(&mut self) -> Vec<u64> {
        let mut out = Vec::new();
        self.waiting.retain(|a| {
            let theirs = a.writing || a.read.is_some();
            if !theirs {
                out.push(a.wr_id);
            }
            theirs
        });
        out
    }

    /// Whether a read of operation `op` (its id without the final bit) is
    /// the reader's: sent whole, its response may be landing.
    pub fn reader_holds(&self, op: u64) -> bool {
        self.waiting.iter().any(|a| a.read.is_some() && !a.writing && op_of(a.wr_id) == op)
    }

    /// Holds failed final request `wr_id` for the reader (see [`parked`](Self::take_reads)).
    pub fn park(&mut self, wr_id: u64) {
        self.parked.push(wr_id);
    }

    /// Reads sent whole, then the final requests parked behind them: the
    /// reader fails them when it stops (no response can land any more),
    /// in that order.
    pub fn take_reads(&mut self) -> Vec<u64> {
        self.reads_closed = true;
        let mut out = Vec::new();
        self.waiting.retain(|a| {
            let take = !a.writing && a.read.is_some();
            if take {
                out.push(a.wr_id);
            }
            !take
        });
        out.append(&mut self.parked);
        out
    }

    /// Everything left, once no thread can touch any buffer (both of the
    /// connection's threads have ended).
    pub fn take_all(&mut self) -> Vec<u64> {
        let mut out: Vec<u64> = self.waiting.drain(..).map(|a| a.wr_id).collect();
        out.extend(self.deferred.take().map(|(_, w)| w));
        out.append(&mut self.parked);
        self.current = None;
        out
    }

    /// The final request id of the waiting operation whose requests
    /// include `seq`.
    #[cfg(test)]
    fn chain_of(&self, seq: u32) -> Option<u64> {
        self.waiting.iter().find(|a| within(a.first, a.seq, seq)).map(|a| a.wr_id)
    }
}

#[cfg(test)]
mod tests {
    //! A scripted peer against the rules: every way of answering early,
    //! twice, out of order or for nothing.

    use super::*;

    const CALL: u64 = 32 + 1024;

    /// A writer and its progress, as the transport's threads drive them.
    struct Side {
        r: Replies,
        p: Progress,
    }

    impl Side {
        fn new() -> Side {
            Side { r: Replies::new(4, CALL), p: Progress::default() }
        }

        fn start(&mut self, seq: u32, first: u32, reply: Reply, wire: u64) {
            self.r.start(&Request { seq, first, wr_id: 100 + u64::from(seq), reply, wire });
            self.p = Progress::default();
        }

        /// The writer hands everything and returns from its last call.
        fn sent(&mut self, seq: u32, wire: u64) -> Option<(u64, bool)> {
            self.p = Progress { handed: wire, in_call: false };
            self.r.finish(seq, true)
        }

        fn ack(&mut self, seq: u32) -> OnAck {
            self.r.on_ack(seq, true, self.p)
        }
    }

    fn violation(a: OnAck, named: &str) {
        match a {
            OnAck::Violation(why) => assert!(why.contains(named), "{why}"),
            other => panic!("not a violation: {other:?}"),
        }
    }

    #[test]
    fn an_acknowledgement_after_the_last_byte_completes_in_order() {
        let mut s = Side::new();
        s.start(1, 1, Reply::Ack, 100);
        assert_eq!(s.sent(1, 100), None);
        s.start(2, 2, Reply::Ack, 100);
        assert_eq!(s.sent(2, 100), None);
        assert_eq!(s.ack(1), OnAck::Complete(101));
        assert_eq!(s.ack(2), OnAck::Complete(102));
    }

    #[test]
    fn an_acknowledgement_before_the_bytes_were_handed_breaks_and_leaves_the_request_to_its_writer() {
        // 32 MiB in calls of at most CALL bytes; the peer answers after the first.
        let wire = 32 << 20;
        for handed in [0, CALL, wire / 2, wire - CALL - 1] {
            for in_call in [false, true] {
                let mut s = Side::new();
                s.start(1, 1, Reply::Ack, wire);
                s.p = Progress { handed, in_call };
                let reach = handed + if in_call { CALL } else { 0 };
                let got = s.ack(1);
                if reach < wire {
                    violation(got, "before the request reached it whole");
                    // Nobody but the writer completes it: a break leaves it alone...
                    assert!(s.r.take_sent_messages().is_empty());
                    // ...and the writer, failing, gets it back to fail.
                    assert_eq!(s.r.finish(1, false), Some((101, false)));
                } else {
                    assert_eq!(got, OnAck::Deferred, "{handed} {in_call}");
                }
            }
        }
    }

    #[test]
    fn an_acknowledgement_during_the_last_call_is_held_for_the_writer() {
        let mut s = Side::new();
        s.start(1, 1, Reply::Ack, 3000);
        s.p = Progress { handed: 2500, in_call: true };
        assert_eq!(s.ack(1), OnAck::Deferred);
        // A break meanwhile does not touch it.
        assert!(s.r.take_sent_messages().is_empty());
        assert!(s.r.take_reads().is_empty());
        // The writer completes it, with success if its write went whole.
        assert_eq!(s.sent(1, 3000), Some((101, true)));
        // It is answered: a second acknowledgement is a lie.
        violation(s.ack(1), "no reply is due");
        let mut s = Side::new();
        s.start(1, 1, Reply::Ack, 3000);
        s.p = Progress { handed: 2500, in_call: true };
        assert_eq!(s.ack(1), OnAck::Deferred);
        assert_eq!(s.r.finish(1, false), Some((101, false)), "the write failed after all: a flush");
    }

    #[test]
    fn a_second_acknowledgement_or_one_for_nothing_breaks() {
        let mut s = Side::new();
        violation(s.ack(1), "no reply is due");
        s.start(1, 1, Reply::Ack, 64);
        s.sent(1, 64);
        assert_eq!(s.ack(1), OnAck::Complete(101));
        violation(s.ack(1), "a duplicate");
        violation(s.ack(7), "no reply is due");
        violation(s.ack(0), "no reply is due");
    }

    #[test]
    fn an_acknowledgement_out_of_order_or_for_a_request_not_yet_sent_breaks() {
        let mut s = Side::new();
        s.start(1, 1, Reply::Ack, 64);
        s.sent(1, 64);
        s.start(2, 2, Reply::Ack, 64);
        s.sent(2, 64);
        violation(s.ack(2), "out of order");
        // An acknowledgement for a request still queued (never started).
        violation(s.ack(3), "no reply is due");
        // The final request of a chain whose earlier request is being written.
        let mut s = Side::new();
        s.start(5, 5, Reply::None, 64);
        violation(s.ack(6), "no reply is due");
        // Requests that ask for no reply are never acknowledged.
        let mut s = Side::new();
        s.start(1, 1, Reply::None, 64);
        s.sent(1, 64);
        violation(s.ack(1), "no reply is due");
    }

    #[test]
    fn a_read_is_answered_by_its_data_in_order_never_by_an_acknowledgement() {
        let mut s = Side::new();
        s.start(1, 1, Reply::Read { addr: 0x1000, len: 100 }, 32);
        violation(s.ack(1), "without sending its data");
        // A response before the request was handed at all.
        assert!(s.r.on_read_segment(1, 0, 10, Progress { handed: 0, in_call: false }).is_err());
        // In the request's last call: taken from the writer, whose finish then leaves it.
        let seg = s.r.on_read_segment(1, 0, 60, Progress { handed: 0, in_call: true }).unwrap();
        assert_eq!(seg, Segment { wr_id: 101, addr: 0x1000, len: 100 });
        assert_eq!(s.r.finish(1, false), None, "the reader owns the read now");
        assert!(s.r.on_read_segment(1, 70, 10, s.p).unwrap_err().contains("out of order"));
        assert!(s.r.on_read_segment(1, 60, 41, s.p).unwrap_err().contains("past"));
        s.r.on_read_segment(1, 60, 40, s.p).unwrap();
        assert_eq!(s.r.read_done(), Some((101, true)));
        assert!(s.r.on_read_segment(1, 0, 1, s.p).unwrap_err().contains("no reply is due"));
        // A response for a write.
        s.start(2, 2, Reply::Ack, 64);
        s.sent(2, 64);
        assert!(s.r.on_read_segment(2, 0, 1, s.p).unwrap_err().contains("not a read"));
    }

    #[test]
    fn a_short_response_is_reported_and_a_break_leaves_reads_to_the_reader() {
        let mut s = Side::new();
        s.start(1, 1, Reply::Read { addr: 0, len: 100 }, 32);
        s.sent(1, 32);
        s.start(2, 2, Reply::Ack, 64);
        s.sent(2, 64);
        s.r.on_read_segment(1, 0, 50, s.p).unwrap();
        assert_eq!(s.r.take_sent_messages(), vec![102], "the sent write fails at a break");
        assert_eq!(s.r.take_reads(), vec![101], "the read is failed by its reader");
        let mut s = Side::new();
        s.start(1, 1, Reply::Read { addr: 0, len: 100 }, 32);
        s.sent(1, 32);
        s.r.on_read_segment(1, 0, 50, s.p).unwrap();
        assert_eq!(s.r.read_done(), Some((101, false)), "half the buffer would keep old bytes");
    }

    #[test]
    fn a_refusal_names_its_chain_and_must_follow_the_request() {
        let mut s = Side::new();
        // A chain 3..=5: 3 and 4 ask for nothing, 5 for an acknowledgement.
        s.start(3, 3, Reply::None, 64);
        s.sent(3, 64);
        assert_eq!(s.r.on_ack(3, false, s.p), OnAck::Refused(None), "its final request is not sent yet");
        s.start(4, 3, Reply::None, 64);
        s.sent(4, 64);
        s.start(5, 3, Reply::Ack, 64);
        assert_eq!(s.r.on_ack(4, false, s.p), OnAck::Refused(Some(105)));
        assert_eq!(s.r.chain_of(3), Some(105));
        violation(s.r.on_ack(6, false, s.p), "never sent");
        // Wrapping sequence numbers.
        let mut s = Side::new();
        s.start(u32::MAX, u32::MAX, Reply::None, 64);
        s.start(1, u32::MAX, Reply::Ack, 64);
        assert_eq!(s.r.on_ack(u32::MAX, false, s.p), OnAck::Refused(Some(101)));
        violation(s.r.on_ack(2, false, s.p), "never sent");
    }

    #[test]
    fn a_failed_final_request_waits_for_the_reader_of_its_operation() {
        // One operation of two reads into one buffer: the first sent and
        // its response landing, the final one still queued at a break.
        const FINAL: u64 = 1 << 63;
        let op = 0x0000_0007_0000_0003u64;
        let mut r = Replies::new(4, CALL);
        r.start(&Request { seq: 1, first: 1, wr_id: op, reply: Reply::Read { addr: 0, len: 64 }, wire: 32 });
        assert!(!r.reader_holds(op), "its writer's while it is written");
        assert_eq!(r.finish(1, true), None);
        assert!(r.reader_holds(op), "sent whole: its response may land at any moment");
        r.on_read_segment(1, 0, 16, Progress::default()).unwrap();
        assert!(r.reader_holds(op));
        assert!(!r.reader_holds(op + 1), "another operation");
        // The break fails the queued final request: parked, not completed.
        r.park(op | FINAL);
        assert!(r.take_sent_messages().is_empty());
        // The reader lets go: its read first, then the final request.
        assert_eq!(r.take_reads(), vec![op, op | FINAL]);
        assert!(r.take_all().is_empty());
    }

    #[test]
    fn a_read_still_being_written_when_the_reader_stops_is_failed_by_its_writer() {
        let mut r = Replies::new(4, CALL);
        r.start(&Request { seq: 1, first: 1, wr_id: 101, reply: Reply::Read { addr: 0, len: 64 }, wire: 32 });
        // The reader stops first (the connection broke): nothing of it yet.
        assert!(r.take_reads().is_empty(), "still its writer's");
        // Its writer finishes, whole: nobody will read a response, so it fails it.
        assert_eq!(r.finish(1, true), Some((101, false)));
        assert!(r.take_all().is_empty());
    }

    #[test]
    fn progress_packs_into_one_word() {
        for p in [
            Progress { handed: 0, in_call: false },
            Progress { handed: 12345, in_call: true },
            Progress { handed: (1 << 40) + 7, in_call: false },
        ] {
            assert_eq!(Progress::unpack(p.pack()), p);
        }
    }

    /// One event of a script: this side's writer, or the peer's replies.
    #[derive(Clone, Debug)]
    enum RxStep {
        /// A new request of `wire` bytes, wanting reply kind `reply`.
        Start { wire: u64, reply: u8 },
        /// One write call of at most `call` bytes of the current request.
        Write { call: u64 },
        /// An acknowledgement for the request `back` before the latest.
        Ack { back: u32, in_call: bool },
        /// A read response segment for the request `back` before the latest.
        ReadSegment { back: u32 },
        /// The connection breaks: what was sent and is not answered fails.
        Break,
    }

    fn step() -> impl proptest::strategy::Strategy<Value = RxStep> {
        use proptest::prelude::*;
        prop_oneof![
            (32u64..5032, 0u8..3).prop_map(|(wire, reply)| RxStep::Start { wire, reply }),
            (0..=CALL).prop_map(|call| RxStep::Write { call }),
            (0u32..4, any::<bool>()).prop_map(|(back, in_call)| RxStep::Ack { back, in_call }),
            (0u32..3).prop_map(|back| RxStep::ReadSegment { back }),
            Just(RxStep::Break),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Random interleavings of this side's writes and the peer's replies,
        /// shrunk to the shortest that breaks a rule: nothing completes
        /// twice, nothing completes while its writer is inside the request,
        /// and every operation waiting for a reply ends: once the writer is done and the
        /// connection's threads have ended, what was neither completed nor
        /// failed is handed back (`take_all`), so no operation hangs.
        #[test]
        fn every_operation_ends_once_and_never_while_it_is_written(
            script in proptest::collection::vec(step(), 0..60)
        ) {
            let mut r = Replies::new(4, CALL);
            let mut ended = std::collections::HashSet::new();
            let mut started = Vec::new();
            let mut seq = 0u32;
            // (seq, wire, handed) of the request being written.
            let mut writing: Option<(u32, u64, u64)> = None;
            // A message's payload is the caller's buffer, which its writer
            // reads until the last call returns: it must not be handed
            // back meanwhile. A read's request is a header of this side's
            // own; its response lands in the read's buffer, which the
            // writer never touches, so a read may end during the call
            // that sends its request (`writing` is then `None` here).
            let mut end = |w: u64, writing: Option<(u32, u64, u64)>| {
                proptest::prop_assert!(writing.is_none_or(|(ws, ..)| u64::from(ws) != w), "{} ended while written", w);
                proptest::prop_assert!(ended.insert(w), "{} ended twice", w);
                Ok(())
            };
            for s in script {
                match s {
                    RxStep::Start { wire, reply } if writing.is_none() => {
                        seq += 1;
                        let reply = match reply {
                            0 => Reply::None,
                            1 => Reply::Ack,
                            _ => Reply::Read { addr: 0, len: 64 },
                        };
                        if reply != Reply::None {
                            // An operation the ledger answers for (a request
                            // wanting no reply is done once written, by its writer).
                            started.push(u64::from(seq));
                        }
                        r.start(&Request { seq, first: seq, wr_id: u64::from(seq), reply, wire });
                        writing = Some((seq, wire, 0));
                    }
                    RxStep::Start { .. } => {}
                    RxStep::Write { call } => {
                        if let Some((s, wire, handed)) = writing.as_mut() {
                            *handed = (*handed + call).min(*wire);
                            if *handed == *wire {
                                let s = *s;
                                writing = None;
                                if let Some((w, _)) = r.finish(s, true) {
                                    end(w, writing)?;
                                }
                            }
                        }
                    }
                    RxStep::Ack { back, in_call } => {
                        let p = writing.map_or(Progress::default(), |(_, _, h)| Progress { handed: h, in_call });
                        if let OnAck::Complete(w) = r.on_ack(seq.wrapping_sub(back), true, p) {
                            end(w, writing)?;
                        }
                    }
                    RxStep::ReadSegment { back } => {
                        let p = writing.map_or(Progress::default(), |(_, _, h)| Progress { handed: h, in_call: true });
                        if r.on_read_segment(seq.wrapping_sub(back), 0, 64, p).is_ok() {
                            if let Some((w, _)) = r.read_done() {
                                end(w, None)?;
                            }
                        }
                    }
                    RxStep::Break => {
                        for w in r.take_sent_messages() {
                            end(w, writing)?;
                        }
                    }
                }
            }
            // The writer stops (its call failed), then both threads end.
            if let Some((s, ..)) = writing.take() {
                if let Some((w, _)) = r.finish(s, false) {
                    end(w, None)?;
                }
            }
            for w in r.take_all() {
                end(w, None)?;
            }
            let mut all: Vec<u64> = ended.into_iter().collect();
            all.sort_unstable();
            proptest::prop_assert_eq!(all, started, "every operation ended once");
        }
    }
}
