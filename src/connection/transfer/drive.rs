//! A transfer list's engine: posting its chains and its notification in
//! its turn, taking their outcomes, failing, waiting, and the engine's turns.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use super::{ConnShared, Connection};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::memory::{LocalBuffer, LocalParts, LocalSlice, RemoteSlice};
use crate::protocol::list::{self, Cursor, ListPlan, Piece};
use crate::protocol::notify::{self, NotifyStatus};
use crate::protocol::op::{self, Bound, Look, Operation, Until};
use crate::transport::engine::LOOK_AGAIN;
use crate::transport::{Posted, RemoteOp, WorkItem};

use super::*;

impl<B: LocalBuffer> List<B> {
    pub(super) fn start(
        conn: &Connection,
        local: LocalSlice<B>,
        remote: RemoteSlice,
        pieces: impl IntoIterator<Item = Piece>,
        direction: Direction,
        note: Option<NoteOut>,
    ) -> Self {
        let shared = &conn.shared;
        let info = &shared.info;
        let depth = info.send_queue_depth.max(1) as usize;
        let mut t = List {
            shared: Arc::clone(shared),
            buf: None,
            local: LocalParts { addr: 0, len: 0, lkey: 0, domain: 0, path: None },
            remote,
            direction,
            plan: ListPlan::default(),
            next: Cursor::default(),
            // Several chains fit the queue at once, so one completes while
            // the next are on the wire.
            chain: (depth / 4).clamp(1, 64),
            in_flight: VecDeque::new(),
            items: Vec::new(),
            error: None,
            failed: false,
            reported: false,
            done: Transferred::default(),
            moves: 0,
            bytes: 0,
            after: None,
            note,
            clock: Default::default(),
            driver: None,
            awaiter: None,
            caller_left: None,
            handoff_at: None,
            #[cfg(feature = "cuda")]
            staged: None,
            turn: None,
            #[cfg(feature = "cuda")]
            ready: None,
        };
        if let Some(len) = t.note.as_ref().and_then(|n| n.too_long) {
            // A caller's bug: nothing moves (the peer hears of the failure).
            t.buf = Some(local.into_inner());
            t.fail(Error::NotifyPayloadTooLarge { len: len as u64, max: notify::MAX_NOTIFY_PAYLOAD as u64 });
            return t;
        }
        let parts = match local.resolve() {
            Ok(p) => p,
            Err(e) => {
                t.buf = Some(local.into_inner());
                t.fail(e);
                return t;
            }
        };
        t.local = parts;
        // One request per planned piece: at most a message, and what one
        // scatter entry holds.
        let max_piece = info.max_message_size.min(u64::from(u32::MAX));
        match list::plan(pieces, parts.len as u64, remote.len(), max_piece) {
            Ok(plan) => {
                t.bytes = plan.bytes;
                if let Some(note) = t.note.as_mut() {
                    // The notification names what the list writes, for the
                    // peer to make visible before it hands the note out.
                    let base = remote.addr();
                    let cover = notify::Cover::of(remote.rkey(), plan.remote_ranges().map(|(o, l)| (base + o, l)));
                    notify::encode(NotifyStatus::Done, &cover, &note.payload, &mut note.msg);
                    note.payload = Vec::new();
                }
                t.plan = plan;
            }
            Err(e) => t.fail(e),
        }
        #[cfg(feature = "cuda")]
        if !t.failed {
            if let Err(e) = t.prepare_gpu(&local, parts) {
                t.fail(e);
            }
        }
        t.buf = Some(local.into_inner());
        t.items.reserve(t.chain.min(t.plan.requests()));
        if !t.failed {
            t.turn = Some(t.shared.gate.hold(None));
        }
        t.pump();
        t
    }
}

impl<B: Send + 'static> List<B> {
    /// Posts what the send queue takes now, without waiting: at most a
    /// queue's worth, so a poll stays short even where the device finishes
    /// requests as fast as they are posted.
    pub(super) fn pump(&mut self) {
        #[cfg(feature = "cuda")]
        if self.staged.is_some() {
            self.pump_staged();
            return;
        }
        let depth = self.shared.info.send_queue_depth.max(1) as usize;
        for _ in 0..depth.div_ceil(self.chain) {
            if !self.post_chain(Deadline::immediate("room in the send queue")) {
                break;
            }
        }
        if !self.failed && self.plan.done(&self.next) {
            self.post_note(Deadline::immediate("room in the send queue"));
        }
        self.release_turn_if_done();
    }

    /// Whether the list's requests may go to the transport now: everything
    /// posted before it on the connection has handed over its last request,
    /// and the GPU work its data waits for is done (looked at, not waited
    /// on: while it runs, the list is looked at again later).
    pub(super) fn my_turn(&mut self) -> bool {
        #[cfg(feature = "cuda")]
        if let Some(ready) = self.ready.as_mut() {
            match ready() {
                Ok(false) => return false,
                Ok(true) => self.ready = None,
                Err(e) => {
                    self.ready = None;
                    self.fail(e);
                    return false;
                }
            }
        }
        self.turn.is_none_or(|t| self.shared.gate.is_first(t))
    }

    /// Lets the operations posted after the list go, once it handed over
    /// its last request (or never will).
    pub(super) fn release_turn_if_done(&mut self) {
        let note_out = self.note.as_ref().is_none_or(|n| n.sent);
        #[cfg(feature = "cuda")]
        let pieces_out = self.staged.as_ref().is_none_or(|st| st.active.iter().all(|p| p.all_posted()));
        #[cfg(not(feature = "cuda"))]
        let pieces_out = true;
        if self.failed || (self.plan.done(&self.next) && pieces_out && note_out) {
            self.release_turn();
        }
    }

    pub(super) fn release_turn(&mut self) {
        if let Some(t) = self.turn.take() {
            self.shared.gate.release(t, Some(&self.shared.transport));
        }
    }

    /// Staged pieces still in progress.
    pub(super) fn staged_active(&self) -> usize {
        #[cfg(feature = "cuda")]
        return self.staged.as_ref().map_or(0, |s| s.active.len());
        #[cfg(not(feature = "cuda"))]
        0
    }

    /// Posts the notification, up to `due`. Whether it is out (or there
    /// is none to send).
    pub(super) fn post_note(&mut self, due: Deadline) -> bool {
        if !self.my_turn() {
            return false;
        }
        let immediate = due.is_immediate();
        let Some(note) = self.note.as_mut().filter(|n| !n.sent) else {
            return true;
        };
        match Self::send_note(&self.shared, note, due) {
            Posted::Ok(id) => {
                note.sent = true;
                note.id = Some(id);
                self.in_flight.push_back(id);
                true
            }
            // The peer has not taken enough of its notes yet: wait for room
            // for up to the operation timeout, looked at again later.
            Posted::Refused(e) if super::super::notes::ring_full(&e) => {
                if note.ring_wait.is_none() {
                    // A move: the wait for room is bounded from here, by the
                    // list itself (failing it, naming the ring).
                    self.moves += 1;
                }
                let since = *note.ring_wait.get_or_insert_with(Instant::now);
                let timeout = self.shared.op_timeout;
                if since.elapsed() >= timeout {
                    self.fail(Error::Timeout { what: super::super::notes::RING_ROOM, after: timeout });
                }
                false
            }
            Posted::Refused(e) if immediate && matches!(*e, Error::QueueFull { .. }) => false,
            Posted::Refused(e) => {
                self.fail(*e);
                false
            }
            Posted::Stuck(id, e) => {
                note.sent = true;
                note.id = Some(id);
                self.in_flight.push_back(id);
                self.fail(*e);
                false
            }
        }
    }

    /// Writes `note`'s message into the peer's notification ring, from a
    /// registered buffer of the connection's pool (kept in `note` until it
    /// completes), once the ring has room.
    pub(super) fn send_note(shared: &ConnShared, note: &mut NoteOut, due: Deadline) -> Posted {
        let region = match note.region.take() {
            Some(r) => Ok(r),
            None => {
                let pooled = shared.note_pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
                pooled.map_or_else(|| shared.ctx.alloc(super::super::notes::OUT_BUFFER), Ok)
            }
        };
        let mut region = match region {
            Ok(r) => r,
            Err(e) => return Posted::refused(e),
        };
        let posted = shared.notes.post(&shared.transport, note.tag, &note.msg, &mut region, due);
        note.region = Some(region);
        posted
    }

    /// Posts the next chain, waiting for room up to `due`. Whether one was
    /// posted (a full queue, with `due` immediate, is not an error).
    pub(super) fn post_chain(&mut self, due: Deadline) -> bool {
        if self.failed || self.plan.done(&self.next) || !self.my_turn() {
            return false;
        }
        // Taken for good only once posted.
        let mut next = self.next;
        self.items.clear();
        while self.items.len() < self.chain {
            let Some(p) = self.plan.next(&mut next) else { break };
            let local = LocalParts { addr: self.local.addr + p.local, len: p.len as usize, ..self.local };
            let remote = self.remote.sub(p.remote, p.len);
            let op = match self.direction {
                Direction::Write => RemoteOp::Write(remote),
                Direction::Read => RemoteOp::Read(remote),
            };
            self.items.push(WorkItem { local: Some(local), op });
        }
        let immediate = due.is_immediate();
        match self.shared.transport.post_send(&self.items, due) {
            Posted::Ok(id) => {
                self.in_flight.push_back(id);
                self.moves += 1;
                self.done.posts += 1;
                self.done.requests += self.items.len();
                self.next = next;
                true
            }
            Posted::Refused(e) if immediate && matches!(*e, Error::QueueFull { .. }) => false,
            Posted::Refused(e) => {
                self.fail(*e);
                false
            }
            Posted::Stuck(id, e) => {
                self.in_flight.push_back(id);
                self.fail(*e);
                false
            }
        }
    }

    /// Records the first error; nothing more is posted. A notification
    /// not yet sent becomes a failure notification, sent at once (best
    /// effort: on a broken connection the peer learns of it anyway).
    pub(super) fn fail(&mut self, e: Error) {
        if self.failed {
            return;
        }
        self.failed = true;
        // A move: what is in flight now only ends.
        self.moves += 1;
        if let Some(note) = self.note.as_mut().filter(|n| !n.sent) {
            notify::encode(NotifyStatus::Failed, &notify::Cover::default(), e.to_string().as_bytes(), &mut note.msg);
            note.sent = true;
            // Never waits (this may be the engine's thread): with no room
            // in the send queue or the peer's ring, the peer's wait ends at
            // its own timeout instead.
            match Self::send_note(&self.shared, note, Deadline::immediate("room in the send queue")) {
                Posted::Ok(id) | Posted::Stuck(id, _) => {
                    note.id = Some(id);
                    self.in_flight.push_back(id);
                }
                Posted::Refused(why) => {
                    tracing::warn!("a failed list's notification (tag {}) could not go out: {why}", note.tag);
                }
            }
        }
        self.error = Some(e);
        // Nothing more of it goes out: what was posted after it may.
        self.release_turn();
    }

    /// Records a chain's outcome.
    pub(super) fn record(&mut self, outcome: crate::ops::OpOutcome) {
        let id = self.in_flight.pop_front();
        self.moves += 1;
        if let Some(note) = self.note.as_mut().filter(|n| n.id.is_some() && n.id == id) {
            if let Some(region) = note.region.take() {
                let mut pool = self.shared.note_pool.lock().unwrap_or_else(|e| e.into_inner());
                if pool.len() < NOTE_POOL {
                    pool.push(region);
                }
            }
        }
        if let Err(e) = outcome {
            self.fail(*e);
        }
    }

    /// Takes the outcomes of chains already finished, oldest first, polling once.
    pub(super) fn reap(&mut self) {
        while let Some(&id) = self.in_flight.front() {
            match self.shared.transport.poll_take(id) {
                Ok(Some(outcome)) => self.record(outcome),
                Ok(None) => return,
                Err(e) => {
                    self.fail(e);
                    return;
                }
            }
        }
    }

    /// Whether nothing is in flight and nothing more will be posted.
    pub(super) fn settled(&self) -> bool {
        let note_out = self.note.as_ref().is_none_or(|n| n.sent);
        self.in_flight.is_empty()
            && self.staged_active() == 0
            && (self.failed || (self.plan.done(&self.next) && note_out))
    }

    /// The outcome of a settled transfer (an error is handed out once).
    pub(super) fn outcome(&mut self) -> Result<Transferred> {
        if let Some(e) = self.error.take() {
            self.reported = true;
            return Err(e);
        }
        if self.reported {
            return Err(Error::AlreadyReported);
        }
        if let Some(after) = self.after.take() {
            if let Err(e) = after() {
                self.failed = true;
                self.reported = true;
                return Err(e);
            }
        }
        Ok(Transferred { bytes: self.bytes, ..self.done })
    }

    /// [`Transfer::wait`]: bounded by the operation timeout without progress.
    pub(super) fn wait(&mut self) -> Result<Transferred> {
        let shared = Arc::clone(&self.shared);
        op::wait(self, &shared.transport, self.bound(None))
    }

    /// [`Transfer::wait_timeout`]: and by `timeout` in all.
    pub(super) fn wait_timeout(&mut self, timeout: Duration) -> Result<Transferred> {
        let shared = Arc::clone(&self.shared);
        op::wait(self, &shared.transport, self.bound(Some(timeout)))
    }

    fn bound(&self, total: Option<Duration>) -> Bound {
        Bound { total, idle: self.shared.op_timeout, spin: self.shared.spin, what: WHAT }
    }

    /// Posts what fits, then waits once for what it waits on (bounded as
    /// [`wait_timeout`](Self::wait_timeout) with `total`): `Some` once all
    /// of it is done. For a caller that keeps several lists going on one
    /// thread.
    pub(crate) fn wait_step(&mut self, total: Option<Duration>) -> Result<Option<Transferred>> {
        let shared = Arc::clone(&self.shared);
        op::wait_once(self, &shared.transport, self.bound(total))
    }

    /// [`Transfer::poll`].
    pub(super) fn poll(&mut self) -> Result<Option<Transferred>> {
        match self.step(None) {
            Look::Done(outcome) => outcome.map(Some),
            Look::Wait(_) => Ok(None),
        }
    }

    /// The buffer of a settled list.
    pub(super) fn take_buffer(&mut self) -> Option<B> {
        if self.settled() { self.buf.take() } else { None }
    }

    /// Waits, then hands out what moved and the buffer.
    pub(super) fn finish(&mut self) -> std::result::Result<(Transferred, B), Failed<B>> {
        match self.wait() {
            Ok(done) => Ok((done, self.buf.take().expect("the buffer is present until taken"))),
            Err(error) => {
                let buffer = if self.settled() { self.buf.take() } else { None };
                Err(Failed { error, buffer })
            }
        }
    }

    /// Leaves the engine a way back: its waker on the oldest post in flight
    /// (taking outcomes that are already in), or a short timer while staged
    /// copies run or the queue is full of other operations. Wakes an
    /// awaiting future once the list is settled.
    pub(super) fn arm(&mut self) {
        let Some(driver) = self.driver.clone() else { return };
        let shared = Arc::clone(&self.shared);
        let engine = shared.ctx.engine();
        // Where the device finishes requests as fast as they are posted
        // (soft-RoCE), taking outcomes and posting more could go on for the
        // whole list: after a queue's worth, the engine takes over.
        let mut turns = self.shared.info.send_queue_depth.max(1) as usize / self.chain + 1;
        loop {
            if self.settled() {
                if let Some(w) = self.awaiter.take() {
                    w.wake();
                }
                return;
            }
            let front = if self.staged_active() > 0 { None } else { self.in_flight.front().copied() };
            let Some(id) = front.filter(|_| turns > 0) else {
                engine.timer(Instant::now() + LOOK_AGAIN, driver);
                return;
            };
            turns -= 1;
            match shared.transport.poll_register(id, &driver, engine) {
                Ok(Some(outcome)) => {
                    self.record(outcome);
                    self.pump();
                    self.reap();
                }
                Ok(None) => return,
                Err(e) => {
                    self.fail(e);
                    // The same request cannot be asked again: let the engine look later.
                    engine.timer(Instant::now() + LOOK_AGAIN, driver);
                    return;
                }
            }
        }
    }

    /// A caller's wait or poll ended: settled, the awaiter is told; in
    /// flight, the engine takes the list over [`HANDOFF`] after the
    /// caller's last call, unless the caller is back by then (an awaited
    /// list is the engine's at once).
    pub(super) fn arm_behind_caller(&mut self) {
        if self.settled() || self.awaiter.is_some() {
            self.arm();
            return;
        }
        let now = Instant::now();
        self.caller_left = Some(now);
        self.handoff_after(now + HANDOFF);
    }

    /// The engine's timer for the hand-over, at `at`, unless one is set.
    fn handoff_after(&mut self, at: Instant) {
        let Some(driver) = self.driver.clone() else { return };
        if self.handoff_at.is_none() {
            self.handoff_at = Some(at);
            self.shared.ctx.engine().timer(at, driver);
        }
    }

    /// The engine's turn: post what fits, take what finished, arm again,
    /// and tell an awaiting future. Within [`HANDOFF`] of a caller's last
    /// call, the caller keeps the list: the turn only sets the hand-over.
    pub(super) fn drive(&mut self) {
        let now = Instant::now();
        if self.handoff_at.is_some_and(|at| now >= at) {
            self.handoff_at = None;
        }
        if let Some(left) = self.caller_left {
            if now < left + HANDOFF && self.awaiter.is_none() {
                self.handoff_after(left + HANDOFF);
                return;
            }
            self.caller_left = None;
        }
        self.pump();
        self.reap();
        self.arm();
        if let Some(w) = &self.awaiter {
            w.wake_by_ref();
        }
    }
}

impl<B: Send + 'static> List<B> {
    /// One look for a waiter with `waker` (see [`op::poll`]); if
    /// `bounded`, ready with [`Error::Timeout`] once the operation timeout
    /// passed without progress (still in flight).
    pub(super) fn poll_waker(&mut self, waker: &Waker, bounded: bool) -> Poll<Result<Transferred>> {
        let shared = Arc::clone(&self.shared);
        let mut clock = std::mem::take(&mut self.clock);
        let bound = bounded.then_some(shared.op_timeout);
        let engine = shared.ctx.engine();
        let polled = op::poll(self, &shared.transport, engine, &mut clock, waker, bound, "a transfer list to complete");
        self.clock = clock;
        polled
    }
}

impl<B: Send + 'static> Operation for List<B> {
    type Output = Transferred;

    /// Posts what fits and takes what finished. Awaited, the engine's
    /// waker goes on the oldest post and the awaiting future is woken
    /// whenever the engine moved the list; waited on, the wait sleeps on
    /// the oldest post, or looks again soon while staged pieces copy.
    fn step(&mut self, waker: Option<&Waker>) -> Look<Transferred> {
        self.pump();
        self.reap();
        if let Some(w) = waker {
            match &self.awaiter {
                Some(a) if a.will_wake(w) => {}
                _ => self.awaiter = Some(w.clone()),
            }
            // Awaited: the engine's from now on.
            self.caller_left = None;
            self.arm();
        }
        if self.settled() {
            self.awaiter = None;
            return Look::Done(self.outcome());
        }
        if waker.is_some() {
            return Look::Wait(Until::Woken);
        }
        #[cfg(feature = "cuda")]
        if let Some(st) = self.staged.as_ref().filter(|st| !st.active.is_empty()) {
            if st.progress.elapsed() > self.shared.op_timeout {
                return Look::Done(Err(Error::Timeout { what: WHAT, after: self.shared.op_timeout }));
            }
            let copying = st.active.iter().any(crate::protocol::staged::ListPiece::copying);
            return Look::Wait(match st.active.iter().find_map(crate::protocol::staged::ListPiece::waiting_on) {
                Some(id) => Until::Request { id, briefly: Some(copying) },
                None => Until::Soon { copying },
            });
        }
        match self.in_flight.front() {
            Some(&id) => Look::Wait(Until::Request { id, briefly: None }),
            // Nothing of ours in flight, and the queue full of other
            // operations: looked at again for room.
            None => Look::Wait(Until::Soon { copying: false }),
        }
    }

    fn moved(&self) -> u64 {
        self.moves
    }
}

impl<B: Send + 'static> List<B> {
    /// What a dropped handle does: nothing more is posted; staged pieces'
    /// copies are waited for (the GPU buffer may go then) and their slots
    /// still on the network stay with the connection; the buffer is freed
    /// now, or, while posts are in flight, held by them and freed by the
    /// last one done. Once is enough: a second call finds nothing to do.
    pub(super) fn let_go(&mut self) {
        self.failed = true;
        self.release_turn();
        self.clock.stop(self.shared.ctx.engine());
        let note = self.note.as_mut().and_then(|n| n.region.take());
        #[cfg(feature = "cuda")]
        let copying = self.staged.as_ref().is_some_and(|st| !st.active.is_empty());
        #[cfg(not(feature = "cuda"))]
        let copying = false;
        if self.in_flight.is_empty() && !copying {
            drop((self.buf.take(), note));
            return;
        }
        // Several posts and copies may still read or write the buffer: each
        // holds a share of it, and the last one done drops it.
        let holder = Arc::new(Mutex::new((self.buf.take(), note)));
        #[cfg(feature = "cuda")]
        if let Some(st) = self.staged.as_mut() {
            for mut p in st.active.drain(..) {
                p.abandon(&self.shared.transport, Some(Box::new(Arc::clone(&holder))));
            }
            // Released from the engine once the copies are done.
            self.shared.drive_soon();
        }
        for id in self.in_flight.drain(..) {
            self.shared.transport.orphan(id, Box::new(Arc::clone(&holder)));
        }
    }
}

impl<B: Send + 'static> Drop for List<B> {
    fn drop(&mut self) {
        self.let_go();
    }
}

impl<B: Send + 'static> fmt::Debug for List<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("direction", &self.direction)
            .field("requests", &self.plan.requests())
            .field("posted", &self.next.taken)
            .field("in_flight", &self.in_flight.len())
            .field("failed", &self.failed)
            .finish()
    }
}
