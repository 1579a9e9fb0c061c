//! A transfer cut into stripes over every queue pair, moved off a rail that fails.

#![forbid(unsafe_code)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use crate::access::Access;
use crate::completion::Failure;
use crate::connection::{Direction, Transfer, Transferred};
use crate::error::{Error, Result};
use crate::memory::alias::Alias;
use crate::memory::{LocalBuffer, Memory, Shared};
use crate::protocol::list::Piece;

use super::*;

/// What a finished striped transfer moved ([`Striped::wait`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Moved {
    /// Bytes moved.
    pub bytes: u64,
    /// Stripes it was cut into.
    pub stripes: usize,
    /// Queue pairs' lists posted again on another rail after theirs failed.
    pub moved_again: usize,
}

/// The stripes one queue pair carries.
pub(super) struct Lane<M: Memory> {
    pub(super) pieces: Vec<Piece>,
    pub(super) link: usize,
    /// In flight; `None` once landed.
    pub(super) transfer: Option<Transfer<Shared<Alias<M>>>>,
}

/// A striped transfer in flight; see [`RailConnection::write`].
pub struct Striped<M: Memory> {
    pub(super) shared: Arc<RailShared>,
    pub(super) local: RailRegion<M>,
    pub(super) remote: RailDescriptor,
    pub(super) span: Span,
    pub(super) direction: Direction,
    pub(super) lanes: Vec<Lane<M>>,
    pub(super) note: Option<(u32, Vec<u8>)>,
    /// Refused before anything was posted.
    pub(super) refused: Option<Error>,
    pub(super) moved: Moved,
    pub(super) turn: usize,
    pub(super) finished: bool,
    /// Lists of queue pairs that failed by timeout, until they are flushed.
    pub(super) draining: Vec<Transfer<Shared<Alias<M>>>>,
    /// The notification's list, on its queue pair, once everything landed.
    pub(super) note_out: Option<(usize, Transfer<Shared<Alias<M>>>)>,
    /// Queue pairs the notification failed on.
    pub(super) note_tries: usize,
}

impl<M: Memory> std::fmt::Debug for Striped<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Striped").field("span", &self.span).field("lanes", &self.lanes.len()).finish()
    }
}

impl<M: Memory> Striped<M> {
    pub(super) fn start(
        conn: &RailConnection,
        local: &RailRegion<M>,
        remote: &RailDescriptor,
        span: Span,
        direction: Direction,
        note: Option<(u32, Vec<u8>)>,
    ) -> Self {
        let shared = Arc::clone(&conn.shared);
        let mut s = Striped {
            local: local.clone(),
            remote: remote.clone(),
            span,
            direction,
            lanes: Vec::new(),
            note,
            refused: None,
            moved: Moved::default(),
            turn: 0,
            finished: false,
            draining: Vec::new(),
            note_out: None,
            note_tries: 0,
            shared,
        };
        if let Err(e) = s.plan() {
            s.refused = Some(e);
        }
        s
    }

    /// Checks the ranges, cuts the stripes and posts one list per queue pair.
    pub(super) fn plan(&mut self) -> Result<()> {
        if let Some((_, payload)) = &self.note {
            if payload.len() > crate::MAX_NOTIFY_PAYLOAD {
                let (len, max) = (payload.len() as u64, crate::MAX_NOTIFY_PAYLOAD as u64);
                return Err(Error::NotifyPayloadTooLarge { len, max });
            }
        }
        let n = self.shared.rails.len();
        if self.local.rails.len() != n || self.remote.rails.len() != n {
            return Err(Error::RailMismatch {
                detail: format!(
                    "the connection has {n} rails, the local region {}, the remote one {}",
                    self.local.rails.len(),
                    self.remote.rails.len()
                ),
            });
        }
        let Span { local_offset, remote_offset, len } = self.span;
        let check = |side: &'static str, offset: u64, region_len: u64| {
            if offset.checked_add(len).is_none_or(|end| end > region_len) {
                return Err(Error::OutOfBounds { side, offset, len, region_len });
            }
            Ok(())
        };
        check("local", local_offset, self.local.len() as u64)?;
        check("remote", remote_offset, self.remote.len())?;
        let needed = match self.direction {
            Direction::Write => Access::REMOTE_WRITE,
            Direction::Read => Access::REMOTE_READ,
        };
        let granted = self.remote.rails[0].access();
        if !granted.contains(needed) {
            return Err(Error::AccessDenied { granted, needed });
        }
        let links: Vec<usize> = (0..self.shared.links.len()).filter(|&i| self.shared.links[i].alive()).collect();
        if links.is_empty() {
            return Err(Error::NoRailLeft { failures: self.shared.failures() });
        }
        let stripe = self.shared.stripe;
        let mut lanes: Vec<Lane<M>> =
            links.iter().map(|&link| Lane { pieces: Vec::new(), link, transfer: None }).collect();
        let mut at = 0;
        let mut k = 0;
        while at < len {
            let n = stripe.min(len - at);
            let lane = &mut lanes[k % links.len()];
            lane.pieces.push(Piece::new(at, at, n));
            at += n;
            k += 1;
        }
        self.moved.stripes = k;
        lanes.retain(|l| !l.pieces.is_empty());
        for lane in &mut lanes {
            lane.transfer = Some(self.post(lane.link, &lane.pieces)?);
        }
        self.lanes = lanes;
        Ok(())
    }

    /// Posts `pieces` (offsets relative to the transfer) on `link`.
    pub(super) fn post(&self, link: usize, pieces: &[Piece]) -> Result<Transfer<Shared<Alias<M>>>> {
        let l = &self.shared.links[link];
        let Span { local_offset, remote_offset, len } = self.span;
        let slice = self.local.rails[l.rail].clone().slice(local_offset as usize..(local_offset + len) as usize);
        let remote = self.remote.rails[l.rail].slice(remote_offset..remote_offset + len)?;
        let pieces = pieces.iter().copied();
        Ok(match self.direction {
            Direction::Write => l.conn.write_list(slice, &remote, pieces),
            Direction::Read => l.conn.read_list(slice, &remote, pieces),
        })
    }

    /// Waits until every stripe has landed (and the notification, if any,
    /// is sent), moving the stripes of a failed rail to the others.
    ///
    /// The stripes move without it (the domains' engines keep each queue
    /// pair's list going); what needs the wait, or an await (a striped
    /// transfer is a future, driven by the same steps), is what comes after
    /// a completion: moving a failed rail's stripes, and the notification,
    /// which is posted once everything landed. Each queue pair's list is
    /// bounded by the connection's operation timeout without progress:
    /// past it, that queue pair counts as failed, and what it still had in
    /// flight is flushed before the transfer completes.
    ///
    /// # Errors
    /// What refused the transfer before anything moved
    /// ([`Error::OutOfBounds`], [`Error::AccessDenied`],
    /// [`Error::RailMismatch`]); an operation's error that is not the
    /// rail's fault (a remote access error, say); [`Error::NoRailLeft`]
    /// when every rail failed. Once it returned an error, it returns
    /// [`Error::AlreadyReported`].
    pub fn wait(&mut self) -> Result<Moved> {
        block_on(self)
    }

    /// One look at every queue pair's list (polled with `cx`'s waker when
    /// awaited, else without): takes what landed, moves a failed rail's
    /// stripes, then sends the notification. Ready with the outcome.
    fn step(&mut self, mut cx: Option<&mut Context<'_>>) -> Poll<Result<Moved>> {
        if let Some(e) = self.refused.take() {
            return Poll::Ready(Err(e));
        }
        let shared = Arc::clone(&self.shared);
        let mut pending = false;
        let mut i = 0;
        while i < self.lanes.len() {
            let link = self.lanes[i].link;
            let Some(t) = self.lanes[i].transfer.as_mut() else {
                i += 1;
                continue;
            };
            match look(t, cx.as_deref_mut()) {
                Poll::Pending => {
                    pending = true;
                    i += 1;
                }
                Poll::Ready(Ok(done)) => {
                    self.lanes[i].transfer = None;
                    shared.rails[shared.links[link].rail].bytes.fetch_add(done.bytes, Ordering::AcqRel);
                    self.moved.bytes += done.bytes;
                    i += 1;
                }
                Poll::Ready(Err(e)) if rail_fault(&e) => {
                    shared.fail(link, &e.to_string());
                    if let Some(old) = self.lanes[i].transfer.take().filter(|_| matches!(e, Error::Timeout { .. })) {
                        // Shut now: what it had in flight is flushed; the
                        // transfer ends only after that.
                        self.draining.push(old);
                    }
                    self.turn += 1;
                    let Some(next) = shared.pick(self.turn) else {
                        return Poll::Ready(Err(Error::NoRailLeft { failures: shared.failures() }));
                    };
                    let transfer = match self.post(next, &self.lanes[i].pieces) {
                        Ok(t) => t,
                        Err(e) => return Poll::Ready(Err(e)),
                    };
                    let lane = &mut self.lanes[i];
                    lane.link = next;
                    lane.transfer = Some(transfer);
                    self.moved.moved_again += 1;
                    // Looked at again at the same index.
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            }
        }
        // Lists of failed queue pairs, until their flush is seen (any outcome).
        self.draining.retain_mut(|t| look(t, cx.as_deref_mut()).is_pending());
        if pending || !self.draining.is_empty() {
            return Poll::Pending;
        }
        self.step_note(cx)
    }

    /// Sends the notification on the first queue pair that takes it.
    fn step_note(&mut self, mut cx: Option<&mut Context<'_>>) -> Poll<Result<Moved>> {
        let shared = Arc::clone(&self.shared);
        loop {
            if let Some((link, t)) = self.note_out.as_mut() {
                match look(t, cx.as_deref_mut()) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(_)) => {
                        self.note_out = None;
                        self.note = None;
                    }
                    Poll::Ready(Err(e)) if rail_fault(&e) => {
                        shared.fail(*link, &e.to_string());
                        self.note_out = None;
                        self.note_tries += 1;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                }
            }
            let Some((tag, payload)) = self.note.as_ref() else {
                return Poll::Ready(Ok(self.moved));
            };
            self.turn += 1;
            let link = shared.pick(self.turn).filter(|_| self.note_tries < shared.links.len());
            let Some(link) = link else {
                return Poll::Ready(Err(Error::NoRailLeft { failures: shared.failures() }));
            };
            let l = &shared.links[link];
            let local = self.local.rails[l.rail].clone().slice(0..0);
            let remote = match self.remote.rails[l.rail].slice(0..0) {
                Ok(r) => r,
                Err(e) => return Poll::Ready(Err(e)),
            };
            self.note_out = Some((link, l.conn.write_list_notify(local, &remote, [], *tag, payload)));
        }
    }

    /// Bytes the transfer moves.
    pub fn len(&self) -> u64 {
        self.span.len
    }

    /// Whether it moves nothing.
    pub fn is_empty(&self) -> bool {
        self.span.len == 0
    }
}

/// Whether an error is the rail's (its queue pair is unusable), so that
/// the stripes it had are moved to another, rather than the transfer's own
/// (bad keys, bad ranges), which another rail would hit as well.
pub(super) fn rail_fault(e: &Error) -> bool {
    match e {
        Error::ConnectionLost { .. } | Error::Timeout { .. } => true,
        Error::Completion(c) => {
            matches!(
                c.failure(),
                Failure::PeerUnreachable | Failure::Flushed | Failure::ReceiverNotReady | Failure::Other
            )
        }
        _ => false,
    }
}

impl<M: Memory> Future for Striped<M> {
    type Output = Result<Moved>;

    /// Awaiting a striped transfer is waiting on it ([`Striped::wait`]),
    /// woken by the domains' engines as its lists move.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Moved>> {
        let this = self.get_mut();
        if this.finished {
            return Poll::Ready(Err(Error::AlreadyReported));
        }
        let out = this.step(Some(cx));
        if out.is_ready() {
            this.finished = true;
        }
        out
    }
}

/// One look at a list: through its future with `cx`, else without a waker.
fn look<B: Send + Unpin + 'static>(t: &mut Transfer<B>, cx: Option<&mut Context<'_>>) -> Poll<Result<Transferred>> {
    match cx {
        Some(cx) => Pin::new(t).poll(cx),
        None => match t.poll() {
            Ok(Some(done)) => Poll::Ready(Ok(done)),
            Ok(None) => Poll::Pending,
            Err(e) => Poll::Ready(Err(e)),
        },
    }
}

/// Runs a future on this thread until it is ready, parked while the
/// engines have nothing for it (every list it waits on wakes it, at the
/// latest at its operation timeout).
fn block_on<F: Future + Unpin>(f: &mut F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(out) = Pin::new(&mut *f).poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}
