//! The receiving side of notifications: an [`Inbox`] takes them from the
//! connection's notification ring and counts what arrives by tag, so a waiter asks for
//! "N notifications with tag T" with no assumption about the order in which
//! notifications of different transfers arrive.

#![forbid(unsafe_code)]

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::notes::{Entry, InboxStats, Note};
use super::{ConnShared, Connection};
use crate::error::{Error, Result};
use crate::protocol::context::OpContext;
use crate::protocol::op;
use crate::transport::engine::AwaitClock;

/// Notifications arriving on one connection, counted by tag; see
/// [`Connection::inbox`].
///
/// Notifications land in the connection's notification ring, written by
/// the peer behind the data they cover, and take no receive: they wait
/// there from the moment the connection is made, whether or not an inbox
/// exists yet, and the connection's own receives take only the peer's
/// messages. An inbox takes them from the ring in order and gives the
/// peer its room back.
///
/// A notification is handed out only once the data its transfer wrote is
/// visible to CUDA work where it landed in GPU memory this side exposed:
/// copied in from the host mirror on the staged path, or flushed on a
/// direct path where the GPU needs it (a failure to do so hands the note
/// out as the transfer's failure).
///
/// Every inbox of a connection sees the same notifications: a note taken
/// through one is gone for all.
pub struct Inbox {
    shared: Arc<ConnShared>,
}

impl Connection {
    /// The connection's notifications. `slots` is checked (at least one)
    /// and otherwise unused: notifications wait in the connection's ring,
    /// sized when it was made ([`ConnectOptions::notify_ring`]), whether or
    /// not an inbox exists.
    ///
    /// [`ConnectOptions::notify_ring`]: crate::ConnectOptions::notify_ring
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero slots.
    pub fn inbox(&self, slots: usize) -> Result<Inbox> {
        if slots == 0 {
            return Err(Error::InvalidArgument("an inbox needs at least one receive slot".into()));
        }
        Ok(Inbox { shared: Arc::clone(&self.shared) })
    }
}

/// Another inbox of the same connection, as [`Connection::inbox`] gives:
/// it sees the same notifications, and a note taken through either is gone
/// for both.
impl Clone for Inbox {
    fn clone(&self) -> Self {
        Inbox { shared: Arc::clone(&self.shared) }
    }
}

impl Inbox {
    /// Takes in what has arrived, without blocking; how many notifications.
    ///
    /// # Errors
    /// Never for the connection's loss (that shows in the waits, after
    /// what arrived before it is taken).
    pub fn poll(&mut self) -> Result<usize> {
        // A ring the peer broke shuts the connection down: the waits say so.
        Ok(self.shared.take_notes().unwrap_or(0))
    }

    /// Takes `n` notifications with `tag` if they have arrived.
    ///
    /// # Errors
    /// [`Error::PeerTransferFailed`] when a transfer that was to notify
    /// `tag` failed at the peer (that failure is taken);
    /// [`Error::ConnectionLost`] when fewer than `n` arrived and no more can.
    pub fn try_take(&mut self, tag: u32, n: usize) -> Result<Option<Vec<Note>>> {
        self.poll()?;
        self.shared.notes.read_side().state.take_ready(tag, n)
    }

    /// Waits until `n` notifications with `tag` have arrived and takes
    /// them, up to the connection's operation timeout.
    ///
    /// # Errors
    /// As [`try_take`](Self::try_take); [`Error::Timeout`] (nothing is
    /// taken; wait again).
    pub fn wait(&mut self, tag: u32, n: usize) -> Result<Vec<Note>> {
        let timeout = self.shared.op_timeout;
        self.wait_timeout(tag, n, timeout)
    }

    /// Waits up to `timeout`. It looks at the ring again at once for the
    /// connection's spin window, then sleeps until the peer's next write
    /// lands where the transport sees writes land (TCP); where it does not
    /// (verbs: the device places them), it looks again after a pause
    /// growing from 20 us to 200 us while nothing comes.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_timeout(&mut self, tag: u32, n: usize, timeout: Duration) -> Result<Vec<Note>> {
        let shared = Arc::clone(&self.shared);
        let bound = op::Bound { total: Some(timeout), idle: timeout, spin: shared.spin, what: "notifications" };
        op::wait(
            &mut RingTake { transport: Some(&shared.transport), look: || self.try_take(tag, n) },
            &shared.transport,
            bound,
        )
    }

    /// [`wait`](Self::wait) as a future: it never blocks the thread. Over
    /// TCP it is woken when the peer's next write lands (the transport
    /// sees each land); over verbs, where the device places them unseen,
    /// the domain's engine has it look at the ring again every 200 us, and
    /// every millisecond once it has waited 10 ms.
    /// Until the notifications are there, or the connection's operation
    /// timeout.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_async(&mut self, tag: u32, n: usize) -> Looking<impl FnMut() -> Result<Option<Vec<Note>>> + '_> {
        let (ctx, timeout) = (Arc::clone(&self.shared.ctx), self.shared.op_timeout);
        let ring = Arc::clone(&self.shared);
        let mut looking = Looking::new(ctx, timeout, "notifications", move || self.try_take(tag, n));
        looking.ring = Some(ring);
        looking
    }

    /// Notifications with `tag` that arrived and are not taken (as of the
    /// last poll or wait).
    pub fn count(&self, tag: u32) -> usize {
        let side = self.shared.notes.read_side();
        side.state.by_tag.get(&tag).map_or(0, |q| q.iter().filter(|e| matches!(e, Entry::Done(_))).count())
    }

    /// Whether no more notifications can arrive (the connection is lost).
    pub(crate) fn is_lost(&self) -> bool {
        self.shared.notes.read_side().state.lost.is_some()
    }

    /// What the connection holds of its domain (whose engine times async
    /// waits).
    pub(crate) fn context(&self) -> Arc<OpContext> {
        Arc::clone(&self.shared.ctx)
    }

    /// What the inbox has seen.
    pub fn stats(&self) -> InboxStats {
        let side = self.shared.notes.read_side();
        let n = &side.state;
        InboxStats { queued: n.queued, queued_bytes: n.queued_bytes, ..n.stats }
    }
}

/// A wait that looks again on the domain's engine's timer until `look`
/// has its result or the timeout passes ([`Inbox::wait_async`],
/// [`RailInbox::wait_async`](crate::rails::RailInbox::wait_async)).
#[must_use = "a future does nothing unless awaited"]
pub struct Looking<F> {
    look: F,
    /// The connection whose notification ring `look` reads, whose
    /// transport wakes the look when the peer's writes land (None: looked
    /// at again on the engine's timer).
    ring: Option<Arc<ConnShared>>,
    ctx: Arc<OpContext>,
    timeout: Duration,
    clock: AwaitClock,
    what: &'static str,
}

impl<F> Looking<F> {
    pub(crate) fn new(ctx: Arc<OpContext>, timeout: Duration, what: &'static str, look: F) -> Self {
        Looking { look, ring: None, ctx, timeout, clock: AwaitClock::default(), what }
    }
}

impl<F> Drop for Looking<F> {
    fn drop(&mut self) {
        self.clock.stop(self.ctx.engine());
    }
}

impl<T, F: FnMut() -> Result<Option<T>> + Unpin> std::future::Future for Looking<F> {
    type Output = Result<T>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<T>> {
        let this = self.get_mut();
        let engine = this.ctx.engine();
        let bound = Some(this.timeout);
        let transport = this.ring.as_ref().map(|shared| &shared.transport);
        let mut take = RingTake { transport, look: &mut this.look };
        match transport {
            Some(t) => op::poll(&mut take, t, engine, &mut this.clock, cx.waker(), bound, this.what),
            None => op::poll(&mut take, &op::NoRequests, engine, &mut this.clock, cx.waker(), bound, this.what),
        }
    }
}

/// A look at a ring the peer writes: taken when `look` finds what it
/// wants, else waited for as [`op::Until::Ring`] says. The transport's count
/// of the peer's landed writes is read first, so a note that lands after
/// the look ends the sleep that follows it; without a transport (a rail
/// inbox's rings) or over verbs, nothing counts them.
struct RingTake<'a, F> {
    transport: Option<&'a crate::transport::ConnTransport>,
    look: F,
}

impl<T, F: FnMut() -> Result<Option<T>>> op::Operation for RingTake<'_, F> {
    type Output = T;

    fn step(&mut self, _: Option<&std::task::Waker>) -> op::Look<T> {
        let seen = self.transport.and_then(crate::transport::ConnTransport::landed);
        match (self.look)() {
            Ok(Some(v)) => op::Look::Done(Ok(v)),
            Err(e) => op::Look::Done(Err(e)),
            Ok(None) => op::Look::Wait(op::Until::Ring { seen }),
        }
    }
}

impl<F> fmt::Debug for Looking<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Looking").field("what", &self.what).field("timeout", &self.timeout).finish()
    }
}

impl fmt::Debug for Inbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox").field("stats", &self.stats()).finish()
    }
}
