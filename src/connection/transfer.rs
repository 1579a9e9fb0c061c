//! The transfer engine: one handle for a list of pieces between one local
//! buffer and one remote range, of any length. The list is planned whole
//! ([`plan`](crate::protocol::list::plan): checked, coalesced, split), then
//! posted in chains of requests with only the last of each signaled, as
//! many chains in flight as the send queue holds, more posted whenever the
//! handle is waited on or polled.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{ConnShared, Connection};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::memory::{LocalBuffer, LocalParts, LocalSlice, RemoteSlice};
use crate::ops::OpId;
use crate::protocol::list::{self, Piece};
use crate::transport::{Posted, RemoteOp, WorkItem};

/// What a transfer list does with its pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    Write,
    Read,
}

/// What a finished transfer moved ([`Transfer::wait`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Transferred {
    /// Bytes moved.
    pub bytes: u64,
    /// Requests on the wire, after adjacent pieces were merged and long
    /// ones split.
    pub requests: usize,
    /// Posts (chains of requests, one signaled completion each).
    pub posts: usize,
}

/// A transfer list in flight: see [`Connection::write_list`].
///
/// It posts more of the list whenever it is waited on or polled. Dropping
/// it before it is done is safe: what is not posted yet is never posted,
/// and the buffer stays with the connection until the device is done with
/// everything that was.
#[must_use = "a transfer list moves along only while its Transfer is waited on or polled"]
pub struct Transfer<B: Send + 'static> {
    shared: Arc<ConnShared>,
    buf: Option<B>,
    local: LocalParts,
    remote: RemoteSlice,
    direction: Direction,
    pieces: Vec<Piece>,
    /// The next piece to post.
    next: usize,
    /// Requests per post.
    chain: usize,
    /// Posted chains (and the notification), oldest first.
    in_flight: VecDeque<OpId>,
    /// Reused for each post.
    items: Vec<WorkItem>,
    /// The first error, until handed out.
    error: Option<Error>,
    /// An error was seen: nothing more is posted.
    failed: bool,
    /// The error was handed out.
    reported: bool,
    done: Transferred,
    bytes: u64,
    /// Runs once everything succeeded (a GPU read's flush).
    after: Option<Box<dyn FnOnce() -> Result<()> + Send>>,
}

/// What a wait on a transfer is for, in its timeout error.
const WHAT: &str = "a transfer list to complete";

impl Connection {
    /// Writes a list of pieces of `local` into `remote`: piece `p` moves
    /// `p.len` bytes from offset `p.local` of `local` to offset `p.remote`
    /// of `remote`. Any number of pieces: adjacent ones (contiguous on both
    /// sides) are merged, ones longer than a message are split, and the
    /// list is posted as fast as the send queue takes it. One handle for
    /// all of it; the buffer comes back when all of it is done.
    ///
    /// The whole list is checked before anything is posted: a piece
    /// outside either range fails the transfer with
    /// [`Error::OutOfBounds`] and moves nothing.
    pub fn write_list<B: LocalBuffer>(
        &self,
        local: impl Into<LocalSlice<B>>,
        remote: &RemoteSlice,
        pieces: impl IntoIterator<Item = Piece>,
    ) -> Transfer<B> {
        Transfer::start(self, local.into(), *remote, pieces, Direction::Write)
    }

    /// Reads a list of pieces of `remote` into `local`: as
    /// [`write_list`](Self::write_list), the other way.
    pub fn read_list<B: LocalBuffer>(
        &self,
        local: impl Into<LocalSlice<B>>,
        remote: &RemoteSlice,
        pieces: impl IntoIterator<Item = Piece>,
    ) -> Transfer<B> {
        Transfer::start(self, local.into(), *remote, pieces, Direction::Read)
    }
}

impl<B: LocalBuffer> Transfer<B> {
    fn start(
        conn: &Connection,
        local: LocalSlice<B>,
        remote: RemoteSlice,
        pieces: impl IntoIterator<Item = Piece>,
        direction: Direction,
    ) -> Self {
        let shared = &conn.shared;
        let info = &shared.info;
        let depth = info.send_queue_depth.max(1) as usize;
        let mut t = Transfer {
            shared: Arc::clone(shared),
            buf: None,
            local: LocalParts { addr: 0, len: 0, lkey: 0, domain: 0, path: None },
            remote,
            direction,
            pieces: Vec::new(),
            next: 0,
            // Several chains fit the queue at once, so one completes while
            // the next are on the wire.
            chain: (depth / 4).clamp(1, 64),
            in_flight: VecDeque::new(),
            items: Vec::new(),
            error: None,
            failed: false,
            reported: false,
            done: Transferred::default(),
            bytes: 0,
            after: None,
        };
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
                t.pieces = plan.pieces;
                t.bytes = plan.bytes;
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
        t.items.reserve(t.chain.min(t.pieces.len()));
        t.pump();
        t
    }

    /// GPU memory: only a direct path (the NIC reaches the memory) is
    /// listed; the producer's fence is waited for before anything is
    /// posted, and a read flushes before it reports success.
    #[cfg(feature = "cuda")]
    fn prepare_gpu(&mut self, local: &LocalSlice<B>, parts: LocalParts) -> Result<()> {
        use crate::protocol::{Route, route};
        if parts.path.is_none() {
            return Ok(());
        }
        let Some(cuda) = local.buffer().cuda() else {
            return Err(Error::InvalidArgument("GPU path without a GPU buffer".into()));
        };
        if route(&parts, self.shared.transport.is_tcp()) == Route::Staged {
            return Err(Error::InvalidArgument(
                "transfer lists on staged GPU memory are not supported yet: post each piece with write or read".into(),
            ));
        }
        cuda.wait_ready()?;
        if self.direction == Direction::Read {
            let device = cuda.device().clone();
            self.after = Some(Box::new(move || device.flush_remote_writes()));
        }
        Ok(())
    }
}

impl<B: Send + 'static> Transfer<B> {
    /// Posts what the send queue takes now, without waiting: at most a
    /// queue's worth, so a poll stays short even where the device finishes
    /// requests as fast as they are posted.
    fn pump(&mut self) {
        let depth = self.shared.info.send_queue_depth.max(1) as usize;
        for _ in 0..depth.div_ceil(self.chain) {
            if !self.post_chain(Deadline::immediate("room in the send queue")) {
                break;
            }
        }
    }

    /// Posts the next chain, waiting for room up to `due`. Whether one was
    /// posted (a full queue, with `due` immediate, is not an error).
    fn post_chain(&mut self, due: Deadline) -> bool {
        if self.failed || self.next == self.pieces.len() {
            return false;
        }
        let end = (self.next + self.chain).min(self.pieces.len());
        self.items.clear();
        for p in &self.pieces[self.next..end] {
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
                self.done.posts += 1;
                self.done.requests += end - self.next;
                self.next = end;
                true
            }
            Posted::Refused(Error::QueueFull { .. }) if immediate => false,
            Posted::Refused(e) => {
                self.fail(e);
                false
            }
            Posted::Stuck(id, e) => {
                self.in_flight.push_back(id);
                self.fail(e);
                false
            }
        }
    }

    fn fail(&mut self, e: Error) {
        if !self.failed {
            self.failed = true;
            self.error = Some(e);
        }
    }

    /// Records a chain's outcome.
    fn record(&mut self, outcome: Result<crate::Completion>) {
        self.in_flight.pop_front();
        if let Err(e) = outcome {
            self.fail(e);
        }
    }

    /// Takes the outcomes of chains already finished, oldest first, polling once.
    fn reap(&mut self) {
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
    fn settled(&self) -> bool {
        self.in_flight.is_empty() && (self.failed || self.next == self.pieces.len())
    }

    /// The outcome of a settled transfer (an error is handed out once).
    fn outcome(&mut self) -> Result<Transferred> {
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

    /// Waits until all of the list has landed (or failed), posting the rest
    /// as room frees up. Bounded by the connection's operation timeout
    /// without progress: each wait for the oldest post in flight is.
    ///
    /// # Errors
    /// The first error: [`Error::OutOfBounds`] (nothing was posted),
    /// an operation's [`Error::Completion`], [`Error::ConnectionLost`]; once
    /// an error is seen nothing more is posted, and the wait returns only
    /// when what was posted is done. [`Error::Timeout`] when no post
    /// finished within the operation timeout: still in flight, and may be
    /// waited on again.
    pub fn wait(&mut self) -> Result<Transferred> {
        self.wait_inner(None)
    }

    /// Waits up to `timeout` in all.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Transferred> {
        self.wait_inner(Some(timeout))
    }

    fn wait_inner(&mut self, total: Option<Duration>) -> Result<Transferred> {
        let started = total.map(|t| (Instant::now(), t));
        loop {
            self.pump();
            self.reap();
            if self.settled() {
                return self.outcome();
            }
            let slice = match started {
                Some((at, t)) => {
                    let left = t.saturating_sub(at.elapsed());
                    if left.is_zero() {
                        return Err(Error::Timeout { what: WHAT, after: t });
                    }
                    left.min(self.shared.op_timeout)
                }
                None => self.shared.op_timeout,
            };
            let Some(&id) = self.in_flight.front() else {
                // Nothing of ours in flight, and the queue full of other
                // operations: wait for room, as any post does.
                self.post_chain(Deadline::lazy(slice, "room in the send queue"));
                continue;
            };
            let mut due = Deadline::lazy(slice, WHAT);
            match self.shared.transport.wait_take(id, &mut due) {
                Ok(outcome) => self.record(outcome),
                Err(e @ Error::Timeout { .. }) => return Err(e),
                Err(e) => self.fail(e),
            }
        }
    }

    /// Posts what fits and takes what finished, without blocking: `Some`
    /// once all of the list is done.
    ///
    /// # Errors
    /// As [`wait`](Self::wait), without the timeout.
    pub fn poll(&mut self) -> Result<Option<Transferred>> {
        self.pump();
        self.reap();
        if self.settled() { self.outcome().map(Some) } else { Ok(None) }
    }

    /// Whether all of it is done (as far as the last wait or poll saw).
    pub fn is_done(&self) -> bool {
        self.settled()
    }

    /// Bytes the list moves (after checking; 0 if it was refused).
    pub fn len(&self) -> u64 {
        self.bytes
    }

    /// Whether the list moves no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Waits, then returns what moved and the buffer, which comes back on
    /// error too.
    ///
    /// # Errors
    /// [`TransferFailed`], with the error and the buffer (`None` only when a
    /// timeout left the list in flight: the buffer then stays with the
    /// connection until the device is done). It converts into [`Error`],
    /// so `?` works in a function returning [`crate::Result`].
    pub fn finish(mut self) -> std::result::Result<(Transferred, B), TransferFailed<B>> {
        match self.wait() {
            Ok(done) => Ok((done, self.buf.take().expect("the buffer is present until taken"))),
            Err(error) => {
                let buffer = if self.settled() { self.buf.take() } else { None };
                Err(TransferFailed { error, buffer })
            }
        }
    }
}

/// A transfer list failed: the error, and the buffer back
/// ([`Transfer::finish`]).
pub struct TransferFailed<B> {
    /// What went wrong.
    pub error: Error,
    /// The buffer; `None` when it is still with the connection (a timeout
    /// with requests in flight).
    pub buffer: Option<B>,
}

impl<B> fmt::Debug for TransferFailed<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferFailed")
            .field("error", &self.error)
            .field("buffer", &self.buffer.as_ref().map(|_| "returned"))
            .finish()
    }
}

impl<B> fmt::Display for TransferFailed<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the transfer list failed: {}", self.error)
    }
}

impl<B> std::error::Error for TransferFailed<B> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<B> From<TransferFailed<B>> for Error {
    fn from(f: TransferFailed<B>) -> Error {
        f.error
    }
}

impl<B: Send + 'static> Drop for Transfer<B> {
    fn drop(&mut self) {
        if self.in_flight.is_empty() {
            return;
        }
        // Several posts may still read or write the buffer: each holds a
        // share of it, and the last one done drops it.
        let holder = Arc::new(Mutex::new(self.buf.take()));
        for id in self.in_flight.drain(..) {
            self.shared.transport.orphan(id, Box::new(Arc::clone(&holder)));
        }
    }
}

impl<B: Send + 'static> fmt::Debug for Transfer<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("direction", &self.direction)
            .field("requests", &self.pieces.len())
            .field("posted", &self.next)
            .field("in_flight", &self.in_flight.len())
            .field("failed", &self.failed)
            .finish()
    }
}
