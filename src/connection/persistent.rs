//! A receive posted again and again into the same range of one buffer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use super::{Connection, Pending, Stage};
use crate::completion::Completion;
use crate::error::{Error, Result};
use crate::memory::{LocalBuffer, LocalParts, LocalSlice};

/// A receive into one range of one buffer that is posted again after each
/// message, as perftest reposts one prebuilt receive and as MPI's
/// persistent requests start one request again and again.
///
/// [`Connection::recv_persistent`] posts the first receive; once a receive
/// finished, [`repost`](Self::repost) posts the next into the same range.
/// The range is checked once, and each round reuses this handle: no new
/// [`Pending`] is built and dropped per message, which is most of what a
/// receive costs on a fast device. Everything else is as for
/// [`Connection::recv`]: the buffer stays with the connection while a
/// receive is in flight, also when this value is dropped, and errors come
/// from the wait.
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
#[must_use = "a receive's outcome and buffer come back through its handle"]
pub struct PersistentRecv<B: Send + 'static> {
    /// This round's receive.
    pending: Pending<B>,
    /// The range, to post a receive of the full kind again
    /// ([`Connection::recv`]) when `direct` is `None`.
    range: LocalSlice<()>,
    /// The range resolved and checked once, when each round posts it
    /// straight to the transport; `None` for a range that did not resolve
    /// (each round reports why) and for GPU memory (each round takes the GPU
    /// path of [`Connection::recv`]).
    direct: Option<LocalParts>,
}

impl Connection {
    /// Posts a receive into `local` whose handle can post the next one
    /// into the same range once it finished: see [`PersistentRecv`].
    ///
    /// # Errors
    /// As [`recv`](Self::recv): reported by the handle's wait.
    pub fn recv_persistent<B: LocalBuffer>(&self, local: impl Into<LocalSlice<B>>) -> PersistentRecv<B> {
        let local = local.into();
        let direct = local.resolve().ok().filter(|parts| {
            #[cfg(feature = "cuda")]
            return parts.path.is_none();
            #[cfg(not(feature = "cuda"))]
            {
                let _ = parts;
                true
            }
        });
        let (range, buf) = local.rebind(());
        // A handle with no round yet, then its first round as every later one.
        let pending = Pending::with(&self.shared, buf, Stage::Failed(None));
        let mut rx = PersistentRecv { pending, range, direct };
        rx.post();
        rx
    }
}

impl<B: LocalBuffer> PersistentRecv<B> {
    /// Posts the next receive into the same range, once the last one
    /// finished (its outcome, if not taken by a wait or poll, is dropped).
    ///
    /// # Errors
    /// [`Error::StillInFlight`] while the last receive is in flight: nothing
    /// is posted, and that receive is unchanged. A receive that cannot be
    /// posted (the connection is lost, every receive credit is in use)
    /// fails as [`Connection::recv`] does: its wait reports why.
    pub fn repost(&mut self) -> Result<()> {
        if !self.pending.finished() {
            return Err(Error::StillInFlight);
        }
        self.post();
        Ok(())
    }

    /// Posts this handle's next round (none is in flight).
    fn post(&mut self) {
        match self.direct {
            Some(parts) => {
                let posted = self.pending.shared.transport.post_recv(Some(parts));
                self.pending.restart(posted);
            }
            None => self.post_slow(),
        }
    }

    /// [`post`](Self::post) by the full path of [`Connection::recv`].
    #[cold]
    #[inline(never)]
    fn post_slow(&mut self) {
        let shared = std::sync::Arc::clone(&self.pending.shared);
        let buf = self.pending.buf.take().expect("the buffer is present until taken");
        let (local, ()) = self.range.clone().rebind(buf);
        // The old round is finished and holds no buffer: dropping it is free.
        self.pending = shared.recv(local);
    }

    /// Waits for this round's receive, up to the connection's operation timeout.
    ///
    /// # Errors
    /// As [`Pending::wait`].
    pub fn wait(&mut self) -> Result<Completion> {
        self.pending.wait()
    }

    /// Waits up to `timeout` for this round's receive.
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

    /// The buffer, while no receive is in flight (the last one finished
    /// and none was posted since): what the last message wrote is there.
    /// `None` while the device may write it.
    pub fn buffer(&self) -> Option<&B> {
        if self.pending.is_done() { self.pending.buf.as_ref() } else { None }
    }

    /// The buffer back, once the device is done with it; else `self`.
    ///
    /// # Errors
    /// `Err(self)` while a receive is in flight.
    pub fn into_buffer(self) -> std::result::Result<B, Box<Self>> {
        let PersistentRecv { pending, range, direct } = self;
        pending.into_buffer().map_err(|pending| Box::new(PersistentRecv { pending: *pending, range, direct }))
    }
}

impl<B: LocalBuffer + Unpin> Future for PersistentRecv<B> {
    type Output = Result<Completion>;

    /// Awaits this round's receive, as a [`Pending`] is awaited. Await it
    /// by `&mut` to keep the handle for the next round.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.get_mut().pending).poll(cx)
    }
}

impl<B: Send + 'static> fmt::Debug for PersistentRecv<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PersistentRecv").field("round", &self.pending).field("direct", &self.direct.is_some()).finish()
    }
}
