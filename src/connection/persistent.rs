//! A receive or a send posted again and again into or from the same range
//! of one buffer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use super::{Connection, Pending, Stage};
use crate::completion::Completion;
use crate::error::{Error, Result};
use crate::memory::{LocalBuffer, LocalParts, LocalSlice};
use crate::transport::PostedInline;

/// A receive into, or a send from, one range of one buffer, posted again
/// after each round, as perftest reposts its prebuilt requests and as MPI's
/// persistent requests start one request again and again.
///
/// [`Connection::recv_persistent`] and [`Connection::send_persistent`] post
/// the first round; once a round finished, [`repost`](Self::repost) posts
/// the next on the same range. The range is checked once, and each round
/// reuses this handle: no new [`Pending`] is built and dropped per message,
/// which is most of what a small operation costs on a fast device.
/// Everything else is as for [`Connection::recv`] and
/// [`Connection::send_unsignaled`]: the buffer stays with the connection
/// while a round is in flight, also when this value is dropped, and errors
/// come from the wait.
///
/// ```no_run
/// # fn f(conn: &gpu_rdma::Connection, buf: gpu_rdma::Region) -> gpu_rdma::Result<()> {
/// let mut rx = conn.recv_persistent(buf.slice(..64));
/// for _ in 0..1000 {
///     let c = rx.wait()?;
///     let message = &rx.buffer().expect("finished: the device is done with it")[..c.byte_len as usize];
///     // ... use the message ...
///     # let _ = message;
///     rx.repost()?;
/// }
/// # Ok(()) }
/// ```
#[must_use = "an operation's outcome and buffer come back through its handle"]
pub struct Persistent<B: Send + 'static> {
    /// This round's operation.
    pending: Pending<B>,
    /// The range, to post a round of the full kind again
    /// ([`Connection::recv`], [`Connection::send_unsignaled`]) when
    /// `direct` is `None`.
    range: LocalSlice<()>,
    /// The range resolved and checked once, when each round posts it
    /// straight to the transport; `None` for a range that did not resolve
    /// (each round reports why) and for GPU memory (each round takes the GPU
    /// path of the full kind).
    direct: Option<LocalParts>,
    /// What each round posts.
    op: Repeated,
}

/// A receive posted again and again: see [`Persistent`].
pub type PersistentRecv<B> = Persistent<B>;

/// A send posted again and again: see [`Persistent`].
pub type PersistentSend<B> = Persistent<B>;

/// What a [`Persistent`] posts each round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Repeated {
    Recv,
    /// As [`Connection::send_unsignaled`].
    Send,
}

impl Connection {
    /// Posts a receive into `local` whose handle can post the next one
    /// into the same range once it finished: see [`Persistent`].
    ///
    /// # Errors
    /// As [`recv`](Self::recv): reported by the handle's wait.
    pub fn recv_persistent<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>) -> PersistentRecv<B> {
        self.persistent(local.into(), Repeated::Recv)
    }

    /// Posts a send of `local` whose handle can post the next one from the
    /// same range once it finished: see [`Persistent`]. Each round is sent
    /// as [`send_unsignaled`](Self::send_unsignaled) sends: no completion
    /// of its own on verbs, its outcome learned from a later signaled
    /// request. A ring of these, each waited for and reposted a lap later,
    /// keeps a stream of sends from building and dropping a handle each.
    ///
    /// # Errors
    /// As [`send_unsignaled`](Self::send_unsignaled): reported by the handle's wait.
    pub fn send_persistent<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>) -> PersistentSend<B> {
        self.persistent(local.into(), Repeated::Send)
    }

    fn persistent<B: LocalBuffer>(&self, local: LocalSlice<B>, op: Repeated) -> Persistent<B> {
        let direct = local.resolve().ok().filter(|parts| {
            // GPU memory, and a range with fences of its own, take the
            // full path each round.
            #[cfg(feature = "cuda")]
            return parts.path.is_none() && !local.has_own_fences();
            #[cfg(not(feature = "cuda"))]
            {
                let _ = parts;
                true
            }
        });
        let (range, buf) = local.rebind(());
        // A handle with no round yet, then its first round as every later one.
        let pending = Pending::with(&self.shared, buf, Stage::Failed(None));
        let mut p = Persistent { pending, range, direct, op };
        p.post();
        p
    }
}

impl<B: LocalBuffer> Persistent<B> {
    /// Posts the next round on the same range, once the last one finished
    /// (its outcome, if not taken by a wait or poll, is dropped).
    ///
    /// # Errors
    /// [`Error::StillInFlight`] while the last round is in flight: nothing
    /// is posted, and that round is unchanged. A round that cannot be
    /// posted (the connection is lost, the queue is full) fails as
    /// [`Connection::recv`] or [`Connection::send_unsignaled`] does: its
    /// wait reports why.
    #[inline(always)]
    pub fn repost(&mut self) -> Result<()> {
        // Most rounds were waited for already: no look at the queue then.
        if !self.pending.is_done() && !self.pending.finished() {
            return Err(Error::StillInFlight);
        }
        self.post();
        Ok(())
    }

    /// Posts this handle's next round (none is in flight).
    fn post(&mut self) {
        let Some(parts) = self.direct else { return self.post_slow() };
        let shared = &self.pending.shared;
        let gate = match self.op {
            Repeated::Send => &shared.gate,
            Repeated::Recv => &shared.recv_gate,
        };
        if !gate.is_open() {
            // Behind an operation still handing over its requests, or a
            // receive kept for its fences.
            return self.post_slow();
        }
        let posted = match self.op {
            Repeated::Recv => PostedInline::Tracked(shared.transport.post_recv(Some(parts))),
            Repeated::Send => shared.transport.post_quiet_send(&parts, shared.deadline()),
        };
        self.pending.restart(posted);
    }

    /// [`post`](Self::post) by the full path of [`Connection::recv`] or
    /// [`Connection::send_unsignaled`].
    #[cold]
    #[inline(never)]
    fn post_slow(&mut self) {
        let shared = std::sync::Arc::clone(&self.pending.shared);
        let buf = self.pending.buf.take().expect("the buffer is present until taken");
        let (local, ()) = self.range.clone().rebind(buf);
        // The old round is finished and holds no buffer: dropping it is free.
        self.pending = match self.op {
            Repeated::Recv => shared.recv(local),
            Repeated::Send => shared.send_unsignaled(local),
        };
    }

    /// Waits for this round, up to the connection's operation timeout.
    ///
    /// # Errors
    /// As [`Pending::wait`].
    pub fn wait(&mut self) -> Result<Completion> {
        self.pending.wait()
    }

    /// Waits up to `timeout` for this round.
    ///
    /// # Errors
    /// As [`Pending::wait_timeout`].
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Completion> {
        self.pending.wait_timeout(timeout)
    }

    /// Checks once, without blocking: `Some` when this round finished.
    ///
    /// # Errors
    /// As [`Pending::poll`].
    pub fn poll(&mut self) -> Result<Option<Completion>> {
        self.pending.poll()
    }

    /// Whether this round finished, as far as this value knows (as
    /// [`Pending::is_done`]).
    pub fn is_done(&self) -> bool {
        self.pending.is_done()
    }

    /// The buffer, while no round is in flight (the last one finished and
    /// none was posted since): what the last message received wrote is
    /// there, and what the next send sends may be written there. `None`
    /// while the device may touch it.
    pub fn buffer(&self) -> Option<&B> {
        if self.pending.is_done() { self.pending.buf.as_ref() } else { None }
    }

    /// The buffer to change, while no round is in flight: the next send's
    /// message is written here before [`repost`](Self::repost). `None`
    /// while the device may touch it.
    pub fn buffer_mut(&mut self) -> Option<&mut B> {
        if self.pending.is_done() { self.pending.buf.as_mut() } else { None }
    }

    /// The buffer back, once the device is done with it; else `self`.
    ///
    /// # Errors
    /// `Err(self)` while a round is in flight.
    pub fn into_buffer(self) -> std::result::Result<B, Box<Self>> {
        let Persistent { pending, range, direct, op } = self;
        pending.into_buffer().map_err(|pending| Box::new(Persistent { pending: *pending, range, direct, op }))
    }
}

impl<B: LocalBuffer + Unpin> Future for Persistent<B> {
    type Output = Result<Completion>;

    /// Awaits this round, as a [`Pending`] is awaited. Await it by `&mut`
    /// to keep the handle for the next round.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.get_mut().pending).poll(cx)
    }
}

impl<B: Send + 'static> fmt::Debug for Persistent<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Persistent")
            .field("op", &self.op)
            .field("round", &self.pending)
            .field("direct", &self.direct.is_some())
            .finish()
    }
}
