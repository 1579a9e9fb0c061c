//! The order of a connection's operations, with no I/O of its own: on one
//! connection, sends, writes (with or without immediate), reads, transfer
//! lists and their notifications take effect at the peer in the order they
//! were posted, whatever memory they use and whatever path it takes.
//!
//! The transport keeps the requests it is handed in order (a reliable
//! connection's send queue, the TCP stream). What can break the order is
//! an operation whose requests cannot all be handed over at once: a staged
//! GPU operation, whose chunks follow their copies out of the GPU, or a
//! transfer list longer than the send queue. Such an operation holds the
//! connection's [`Gate`] from the moment it is posted until its last
//! request is handed to the transport; every operation posted meanwhile
//! waits behind it, in posting order: another holder takes its turn after
//! it, a plain post is kept here ([`Deferred`]) and handed over by
//! whoever opens the gate to it. While the gate is open nothing is kept
//! and a post goes straight to the transport: one atomic load.
//!
//! Receives are a queue of their own, with a gate of their own (a second
//! [`Gate`]): a receive into host memory whose GPU consumers still run is
//! kept there until they are done, and the receives posted after it wait
//! behind it, so each message lands in the receive posted for it. As on RC, the
//! data of a read may still be on its way back when a later operation
//! takes effect.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;
use std::time::Instant;

use crate::deadline::Deadline;
use crate::error::Error;
use crate::transport::{ConnTransport, Posted, PostedInline, WorkItem};

/// A post kept for its turn: what to hand the transport.
#[derive(Debug)]
pub(crate) enum What {
    /// Work requests, as one operation (their buffers stay with the
    /// caller's handle, which cancels this before letting them go).
    Send(Vec<WorkItem>),
    /// An inline send: the bytes are copied here.
    Inline { data: Vec<u8>, imm: Option<u32> },
    /// An inline send nobody waits for: its outcome is left to the
    /// connection once posted.
    Untracked { data: Vec<u8>, imm: Option<u32> },
    /// A receive, kept at the receive queue's own gate (its buffer stays
    /// with the caller's handle, which cancels this before letting it go).
    Recv(Option<crate::memory::LocalParts>),
}

/// Where a kept post's outcome lands.
#[derive(Default)]
pub(crate) struct Deferred {
    state: Mutex<PostState>,
    /// Kept at a receive queue's gate (not the send queue's).
    receive: bool,
}

#[derive(Default)]
enum PostState {
    /// Still kept; wake this when it is posted.
    #[default]
    Kept,
    KeptWaking(Waker),
    /// Handed to the transport (taken by its handle once).
    Posted(Option<Posted>),
    /// Its handle went away first: it was never posted.
    Cancelled,
}

impl Deferred {
    fn lock(&self) -> MutexGuard<'_, PostState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The post's outcome, once it was handed to the transport (taken: a
    /// second call gets `None`).
    pub(crate) fn take(&self) -> Option<Posted> {
        match &mut *self.lock() {
            PostState::Posted(p) => p.take(),
            _ => None,
        }
    }

    /// Whether it is still kept (not posted, not cancelled).
    /// Whether it was kept at a receive queue's gate.
    pub(crate) fn is_receive(&self) -> bool {
        self.receive
    }

    pub(crate) fn is_kept(&self) -> bool {
        matches!(*self.lock(), PostState::Kept | PostState::KeptWaking(_))
    }

    /// Wakes `waker` once it is posted (at once if it was).
    pub(crate) fn wake_when_posted(&self, waker: &Waker) {
        let mut st = self.lock();
        match &mut *st {
            PostState::Kept => *st = PostState::KeptWaking(waker.clone()),
            PostState::KeptWaking(w) if !w.will_wake(waker) => *w = waker.clone(),
            PostState::KeptWaking(_) => {}
            PostState::Posted(_) | PostState::Cancelled => waker.wake_by_ref(),
        }
    }

    fn posted(&self, p: Posted) {
        let before = std::mem::replace(&mut *self.lock(), PostState::Posted(Some(p)));
        if let PostState::KeptWaking(w) = before {
            w.wake();
        }
    }
}

/// Whether a kept post may go now: its data is ready (the fences of the
/// GPU work producing it are done), or why it never will (that work
/// failed).
pub(crate) type DataReady = Box<dyn FnMut() -> Result<bool, Error> + Send>;

enum InLine {
    /// An operation that hands its requests over itself, over time, and
    /// may do so only while it is first; woken when it becomes first.
    Held { ticket: u64, waker: Option<Waker> },
    /// A post kept for its turn (and, with `ready`, for its data).
    Kept { what: What, due: Instant, out: Arc<Deferred>, ready: Option<DataReady> },
}

#[derive(Default)]
struct Queue {
    next: u64,
    entries: VecDeque<InLine>,
}

/// What hands a kept post to the transport (the transport itself; a
/// recorder in tests).
pub(crate) trait Hand {
    /// Hands `what` over without waiting for room: its outcome (`None` for
    /// an untracked send that was handed over: nobody asks).
    fn hand(&self, what: &What) -> Option<Posted>;
}

impl Hand for ConnTransport {
    fn hand(&self, what: &What) -> Option<Posted> {
        post(self, what)
    }
}

/// A connection's gate (see the module documentation).
#[derive(Default)]
pub(crate) struct Gate {
    /// Entries in the queue: while zero, posts go straight to the transport.
    waiting: AtomicUsize,
    q: Mutex<Queue>,
}

/// An operation's place at the gate ([`Gate::hold`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place(u64);

impl Gate {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether nothing is held or kept: a post may go straight to the
    /// transport. (A post racing with a hold made on another thread has no
    /// order with it to keep.)
    #[inline(always)]
    pub(crate) fn is_open(&self) -> bool {
        self.waiting.load(Ordering::Acquire) == 0
    }

    /// Takes a place for an operation that hands its requests over itself:
    /// it may hand them over while [`is_first`](Self::is_first), and
    /// [`release`](Self::release)s its place once its last request is
    /// handed over (or never will be). `waker` is woken when it becomes
    /// first behind another.
    pub(crate) fn hold(&self, waker: Option<Waker>) -> Place {
        let mut q = self.lock();
        let ticket = q.next;
        q.next += 1;
        q.entries.push_back(InLine::Held { ticket, waker });
        self.waiting.fetch_add(1, Ordering::AcqRel);
        Place(ticket)
    }

    /// Whether `t` is first: every operation posted before it has handed
    /// over its last request.
    pub(crate) fn is_first(&self, t: Place) -> bool {
        matches!(self.lock().entries.front(), Some(InLine::Held { ticket, .. }) if *ticket == t.0)
    }

    /// Replaces the waker of holder `t`.
    pub(crate) fn set_waker(&self, t: Place, waker: &Waker) {
        for e in &mut self.lock().entries {
            if let InLine::Held { ticket, waker: w } = e {
                if *ticket == t.0 {
                    if !w.as_ref().is_some_and(|w| w.will_wake(waker)) {
                        *w = Some(waker.clone());
                    }
                    return;
                }
            }
        }
    }

    /// Holder `t` handed over its last request, or never will: the posts
    /// kept behind it go to the transport (with `transport`; else the next
    /// pump posts them), up to the next holder, which is woken.
    pub(crate) fn release<H: Hand + ?Sized>(&self, t: Place, transport: Option<&H>) {
        let mut q = self.lock();
        let Some(at) = q.entries.iter().position(|e| matches!(e, InLine::Held { ticket, .. } if *ticket == t.0)) else {
            return;
        };
        q.entries.remove(at);
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        if at != 0 {
            return;
        }
        match transport {
            Some(transport) => self.pump_locked(&mut q, transport),
            None => {
                if let Some(InLine::Held { waker: Some(w), .. }) = q.entries.front_mut() {
                    w.wake_by_ref();
                }
            }
        }
    }

    /// Keeps a post for its turn; `None` when nothing is in front of it
    /// any more (post it now).
    pub(crate) fn keep(&self, what: What, due: Instant) -> Result<Arc<Deferred>, What> {
        let mut q = self.lock();
        if q.entries.is_empty() {
            return Err(what);
        }
        let out = Arc::new(Deferred { receive: matches!(what, What::Recv(_)), ..Deferred::default() });
        q.entries.push_back(InLine::Kept { what, due, out: Arc::clone(&out), ready: None });
        self.waiting.fetch_add(1, Ordering::AcqRel);
        Ok(out)
    }

    /// Keeps a post until its turn and until `ready` says its data is:
    /// what is posted after it waits behind it, so the order holds while
    /// nobody blocks (a GPU producer's fence is looked at, never waited on).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn keep_until(&self, what: What, due: Instant, ready: DataReady) -> Arc<Deferred> {
        let mut q = self.lock();
        let out = Arc::new(Deferred { receive: matches!(what, What::Recv(_)), ..Deferred::default() });
        q.entries.push_back(InLine::Kept { what, due, out: Arc::clone(&out), ready: Some(ready) });
        self.waiting.fetch_add(1, Ordering::AcqRel);
        out
    }

    /// Hands the kept posts that are first to the transport (none is
    /// left behind a full send queue past its post timeout: it fails).
    pub(crate) fn pump<H: Hand + ?Sized>(&self, transport: &H) {
        if self.is_open() {
            return;
        }
        let mut q = self.lock();
        self.pump_locked(&mut q, transport);
    }

    fn pump_locked<H: Hand + ?Sized>(&self, q: &mut Queue, transport: &H) {
        loop {
            match q.entries.front_mut() {
                Some(InLine::Kept { what, due, out, ready }) => {
                    let posted = match ready.as_mut().map(|r| r()) {
                        // Its data is not ready: a later pump looks again.
                        Some(Ok(false)) => return,
                        Some(Err(e)) => Some(Posted::Refused(Box::new(e))),
                        Some(Ok(true)) | None => transport.hand(what),
                    };
                    if let Some(Posted::Refused(e)) = &posted {
                        if matches!(**e, Error::QueueFull { .. }) && Instant::now() < *due {
                            // Room comes with completions: a later pump posts it.
                            return;
                        }
                    }
                    let out = Arc::clone(out);
                    q.entries.pop_front();
                    self.waiting.fetch_sub(1, Ordering::AcqRel);
                    if let Some(posted) = posted {
                        out.posted(posted);
                    } else {
                        *out.lock() = PostState::Posted(None);
                    }
                }
                Some(InLine::Held { waker, .. }) => {
                    if let Some(w) = waker.take() {
                        w.wake();
                    }
                    return;
                }
                None => return,
            }
        }
    }

    /// The handle of kept post `out` goes away: if it is still kept it is
    /// never posted (its buffer is free: `None`); else the outcome of its
    /// post, for the handle to leave with the connection.
    pub(crate) fn cancel<H: Hand + ?Sized>(&self, out: &Arc<Deferred>, transport: &H) -> Option<Posted> {
        let mut q = self.lock();
        let at = q.entries.iter().position(|e| matches!(e, InLine::Kept { out: o, .. } if Arc::ptr_eq(o, out)));
        let Some(at) = at else {
            drop(q);
            return out.take();
        };
        q.entries.remove(at);
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        *out.lock() = PostState::Cancelled;
        if at == 0 {
            // What was behind it may go now.
            self.pump_locked(&mut q, transport);
        }
        None
    }
}

/// Hands a kept post to the transport, without waiting for room: its
/// outcome (`None` for an untracked send that was handed over: nobody
/// asks).
fn post(transport: &ConnTransport, what: &What) -> Option<Posted> {
    let now = Deadline::immediate("room in the send queue");
    match what {
        What::Send(items) => Some(transport.post_send(items, now)),
        What::Inline { data, imm } => Some(transport.post_inline(data, *imm, now)),
        What::Recv(parts) => Some(transport.post_recv(*parts)),
        What::Untracked { data, imm } => match transport.post_inline_quiet(data, *imm, now, true) {
            PostedInline::Quiet(_) => None,
            // Nobody waits: the connection keeps its slot until it completes.
            PostedInline::Tracked(Posted::Ok(id) | Posted::Stuck(id, _)) => {
                transport.orphan(id, Box::new(()));
                None
            }
            PostedInline::Tracked(refused @ Posted::Refused(_)) => Some(refused),
        },
    }
}

impl std::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deferred").field("kept", &self.is_kept()).finish()
    }
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate").field("waiting", &self.waiting.load(Ordering::Relaxed)).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::OpId;
    use std::sync::atomic::AtomicU32;
    use std::task::Wake;

    /// Records what was handed over, in order; refuses with a full queue
    /// while `full`.
    #[derive(Default)]
    struct Recorder {
        handed: Mutex<Vec<u8>>,
        full: std::sync::atomic::AtomicBool,
    }

    impl Hand for Recorder {
        fn hand(&self, what: &What) -> Option<Posted> {
            if self.full.load(Ordering::Acquire) {
                return Some(Posted::Refused(Box::new(Error::QueueFull { queue: "send", depth: 1 })));
            }
            let tag = match what {
                What::Inline { data, .. } | What::Untracked { data, .. } => data[0],
                What::Send(_) => 0,
                What::Recv(parts) => parts.map_or(0, |p| p.len as u8),
            };
            self.handed.lock().unwrap().push(tag);
            Some(Posted::Ok(OpId::for_tests(u32::from(tag))))
        }
    }

    fn inline(tag: u8) -> What {
        What::Inline { data: vec![tag], imm: None }
    }

    fn later() -> Instant {
        Instant::now() + std::time::Duration::from_secs(60)
    }

    #[derive(Default)]
    struct Count(AtomicU32);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::AcqRel);
        }
    }

    #[test]
    fn an_open_gate_keeps_nothing() {
        let g = Gate::default();
        assert!(g.is_open());
        assert!(g.keep(inline(1), later()).is_err(), "nothing in front: post it now");
        assert!(g.is_open());
    }

    #[test]
    fn posts_behind_holders_go_in_posting_order_and_the_next_holder_is_woken() {
        let (g, r) = (Gate::default(), Recorder::default());
        let a = g.hold(None);
        assert!(g.is_first(a));
        let p1 = g.keep(inline(1), later()).unwrap();
        let woken = Arc::new(Count::default());
        let b = g.hold(Some(Waker::from(Arc::clone(&woken))));
        let p2 = g.keep(inline(2), later()).unwrap();
        assert!(!g.is_open() && !g.is_first(b));
        g.pump(&r);
        assert!(r.handed.lock().unwrap().is_empty(), "nothing goes while a holder is in front");
        // A holder behind another letting go opens nothing.
        g.release(b, Some(&r));
        assert!(r.handed.lock().unwrap().is_empty());
        let b = g.hold(Some(Waker::from(Arc::clone(&woken))));
        g.release(a, Some(&r));
        assert_eq!(*r.handed.lock().unwrap(), vec![1, 2], "the posts kept behind the first holder");
        assert!(matches!(p1.take(), Some(Posted::Ok(_))) && matches!(p2.take(), Some(Posted::Ok(_))));
        assert!(p1.take().is_none(), "an outcome is taken once");
        assert!(g.is_first(b));
        assert_eq!(woken.0.load(Ordering::Acquire), 1, "the next holder was woken when it became first");
        let p3 = g.keep(inline(3), later()).unwrap();
        g.release(b, None::<&Recorder>);
        assert!(p3.is_kept(), "released without a transport: the next pump posts it");
        g.pump(&r);
        assert_eq!(*r.handed.lock().unwrap(), vec![1, 2, 3]);
        assert!(g.is_open());
    }

    #[test]
    fn a_kept_post_cancelled_is_never_handed_over_and_one_handed_over_reports_its_outcome() {
        let (g, r) = (Gate::default(), Recorder::default());
        let a = g.hold(None);
        let p1 = g.keep(inline(1), later()).unwrap();
        let p2 = g.keep(inline(2), later()).unwrap();
        assert!(g.cancel(&p1, &r).is_none(), "still kept: never posted");
        assert!(!p1.is_kept());
        g.release(a, Some(&r));
        assert_eq!(*r.handed.lock().unwrap(), vec![2]);
        assert!(matches!(g.cancel(&p2, &r), Some(Posted::Ok(_))), "posted: its outcome, to leave with the connection");
        // Cancelling the first kept post lets the one behind it go.
        let a = g.hold(None);
        let p4 = g.keep(inline(4), later()).unwrap();
        r.full.store(true, Ordering::Release);
        g.release(a, Some(&r));
        assert!(p4.is_kept(), "a full queue: kept for a later pump");
        let p5 = g.keep(inline(5), later()).unwrap();
        r.full.store(false, Ordering::Release);
        assert!(g.cancel(&p4, &r).is_none());
        assert_eq!(*r.handed.lock().unwrap(), vec![2, 5]);
        assert!(matches!(p5.take(), Some(Posted::Ok(_))));
    }

    #[test]
    fn a_full_queue_fails_a_kept_post_only_past_its_post_timeout() {
        let (g, r) = (Gate::default(), Recorder::default());
        let a = g.hold(None);
        let soon = g.keep(inline(1), Instant::now()).unwrap();
        let behind = g.keep(inline(2), later()).unwrap();
        r.full.store(true, Ordering::Release);
        g.release(a, Some(&r));
        assert!(matches!(soon.take(), Some(Posted::Refused(e)) if matches!(*e, Error::QueueFull { .. })));
        assert!(behind.is_kept(), "within its post timeout: still kept");
        r.full.store(false, Ordering::Release);
        g.pump(&r);
        assert_eq!(*r.handed.lock().unwrap(), vec![2]);
    }

    #[test]
    fn a_post_kept_for_its_data_holds_what_follows_and_fails_with_its_producer() {
        let (g, r) = (Gate::default(), Recorder::default());
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let d = Arc::clone(&done);
        let p1 = g.keep_until(inline(1), later(), Box::new(move || Ok(d.load(Ordering::Acquire))));
        assert!(!g.is_open(), "kept even with nothing in front: its data is not ready");
        let p2 = g.keep(inline(2), later()).unwrap();
        g.pump(&r);
        assert!(r.handed.lock().unwrap().is_empty(), "neither goes before the first's data is ready");
        done.store(true, Ordering::Release);
        g.pump(&r);
        assert_eq!(*r.handed.lock().unwrap(), vec![1, 2]);
        assert!(matches!(p1.take(), Some(Posted::Ok(_))) && matches!(p2.take(), Some(Posted::Ok(_))));
        // A producer that failed: the post fails with its error, what follows goes.
        let p3 = g.keep_until(inline(3), later(), Box::new(|| Err(Error::InvalidArgument("the kernel failed".into()))));
        let p4 = g.keep(inline(4), later()).unwrap();
        g.pump(&r);
        assert!(matches!(p3.take(), Some(Posted::Refused(e)) if e.to_string().contains("kernel failed")));
        assert!(matches!(p4.take(), Some(Posted::Ok(_))));
        assert_eq!(*r.handed.lock().unwrap(), vec![1, 2, 4]);
    }

    #[test]
    fn a_kept_post_wakes_its_waiter_when_handed_over() {
        let (g, r) = (Gate::default(), Recorder::default());
        let a = g.hold(None);
        let p = g.keep(inline(1), later()).unwrap();
        let woken = Arc::new(Count::default());
        p.wake_when_posted(&Waker::from(Arc::clone(&woken)));
        assert_eq!(woken.0.load(Ordering::Acquire), 0);
        g.release(a, Some(&r));
        assert_eq!(woken.0.load(Ordering::Acquire), 1);
        p.wake_when_posted(&Waker::from(Arc::clone(&woken)));
        assert_eq!(woken.0.load(Ordering::Acquire), 2, "already posted: woken at once");
    }

    #[test]
    fn a_receive_kept_for_its_fences_holds_the_receives_behind_it_in_order() {
        let gate = Gate::default();
        let t = Recorder::default();
        let recv =
            |len: usize| What::Recv(Some(crate::memory::LocalParts { addr: 0, len, lkey: 0, domain: 0, path: None }));
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let fence = Arc::clone(&done);
        let first = gate.keep_until(recv(1), later(), Box::new(move || Ok(fence.load(Ordering::Acquire))));
        assert!(first.is_receive() && !gate.is_open());
        // Posted after it: kept behind it.
        let second = gate.keep(recv(2), later()).expect("kept behind the fenced receive");
        gate.pump(&t);
        assert!(t.handed.lock().unwrap().is_empty(), "nothing goes before the fence is done");
        done.store(true, Ordering::Release);
        gate.pump(&t);
        assert_eq!(*t.handed.lock().unwrap(), [1, 2], "in posting order");
        assert!(gate.is_open() && first.take().is_some() && second.take().is_some());
        // A kept receive dropped before its turn is never handed over.
        let never = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let fence = Arc::clone(&never);
        let third = gate.keep_until(recv(3), later(), Box::new(move || Ok(fence.load(Ordering::Acquire))));
        let fourth = gate.keep(recv(4), later()).expect("kept behind");
        assert!(gate.cancel(&third, &t).is_none(), "cancelled while kept: its buffer is free");
        assert_eq!(*t.handed.lock().unwrap(), [1, 2, 4], "what was behind it went");
        assert!(fourth.take().is_some());
    }
}
