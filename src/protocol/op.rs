//! The one driver of an operation in flight. An [`Operation`] moves itself
//! along without blocking and says what would wake a waiter ([`Until`]);
//! [`wait`] blocks on that, with one spin and nap policy, and [`poll`]
//! registers an awaiting waker for it (a completion through the engine, or
//! the engine's timer through an [`AwaitClock`]). Transfer lists, single
//! operations on their slow paths (kept at the gate, staged, or behind
//! staged ones), receive rings' awaits and notification waits are handles
//! over it: each says how it moves, none how it waits.

#![forbid(unsafe_code)]

use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use crate::deadline::{Deadline, look_again};
use crate::error::{Error, Result};
use crate::ops::OpId;
use crate::transport::ConnTransport;
use crate::transport::engine::{AwaitClock, Engine, LOOK_AGAIN, LOOK_AGAIN_COPYING, NotYet};

/// What one look at an operation found.
#[derive(Debug)]
pub(crate) enum Look<T> {
    /// It ended: its outcome.
    Done(Result<T>),
    /// Not yet; what would wake a waiter.
    Wait(Until),
}

/// What wakes the waiter of an operation that has not ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Until {
    /// A request of the connection's transport finishing. With `briefly`
    /// (a copy in flight, `Some(true)`, or other work of the connection to
    /// move, `Some(false)`), a blocking waiter sleeps on it only a slice
    /// ([`staged_slice`]) before it looks again.
    Request { id: OpId, briefly: Option<bool> },
    /// Nothing that wakes anyone: a copy between the GPU and staging in
    /// flight, a turn at the gate, a ring the peer writes, room in a queue.
    /// Looked at again soon; with `copying` (a copy about to end, a ring
    /// about to be written) at once within the spin window of a blocking
    /// wait, and sooner by an awaited one.
    Soon { copying: bool },
    /// The operation has the awaiting waker woken itself (the engine
    /// drives it); a blocking waiter looks again in a moment.
    Woken,
    /// Memory the peer writes (a notification ring), looked at when the
    /// transport had counted `seen` of the peer's writes landing (None:
    /// it does not see them land). A blocking waiter looks again at once
    /// within the spin window, then sleeps until the next write lands;
    /// where none is seen, a pause growing from 20 us to 200 us while
    /// nothing comes. An awaited one is woken when the next write lands
    /// (the engine's timer looks again after [`RING_SLEEP`] in any case);
    /// where none is seen, it looks again on the engine's timer (see
    /// `awaited_ring_pause`).
    Ring { seen: Option<u64> },
}

/// An operation in flight, as the driver sees it.
pub(crate) trait Operation {
    type Output;

    /// Moves the operation along without blocking (posts what fits, takes
    /// outcomes, advances copies) and looks at it once. `waker` is an
    /// awaited look's, which the operation may register itself
    /// ([`Until::Woken`]).
    fn step(&mut self, waker: Option<&Waker>) -> Look<Self::Output>;

    /// How far it has moved: a count that grows whenever it makes
    /// progress. A wait bounded by time without progress counts from the
    /// last change.
    fn moved(&self) -> u64 {
        0
    }
}

/// How long a blocking wait waits: in all (`total`), and without progress
/// (`idle`: the connection's operation timeout); within `spin` of the
/// last progress it looks again at once while a copy is in flight.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bound {
    pub total: Option<Duration>,
    pub idle: Duration,
    pub spin: Duration,
    pub what: &'static str,
}

/// How long a wait sleeps on the network before it looks at the work that
/// wakes nobody again: briefly while a copy is in flight (no completion
/// will wake it when the copy ends), else up to a millisecond.
pub(crate) fn staged_slice(copying: bool) -> Duration {
    if copying { Duration::from_micros(20) } else { Duration::from_millis(1) }
}

/// Where the requests an operation waits on are: a blocking wait sleeps on
/// one, an awaited look registers its waker on one.
pub(crate) trait Requests {
    /// Sleeps until request `id` finished or `due` passed.
    fn sleep_on(&self, id: OpId, due: &mut Deadline) -> Result<()>;
    /// Whether request `id` finished; else `waker` is woken when it does.
    fn done_or_register(&self, id: OpId, waker: &Waker, engine: &Engine) -> Result<bool>;
    /// Sleeps until a write of the peer's lands after the first `seen`,
    /// or `d` passes (see [`Until::Ring`]).
    fn wait_landed(&self, seen: u64, d: Duration) {
        let _ = seen;
        std::thread::sleep(d);
    }
    /// Whether a write of the peer's landed after the first `seen`
    /// (`Some(true)`), else `waker` is registered to be woken when one
    /// does (`Some(false)`); None where nothing sees writes land.
    fn landed_or_register(&self, seen: u64, waker: &Waker) -> Option<bool> {
        let _ = (seen, waker);
        None
    }
}

impl Requests for ConnTransport {
    fn sleep_on(&self, id: OpId, due: &mut Deadline) -> Result<()> {
        self.wait(id, due)
    }

    fn done_or_register(&self, id: OpId, waker: &Waker, engine: &Engine) -> Result<bool> {
        ConnTransport::done_or_register(self, id, waker, engine)
    }

    fn wait_landed(&self, seen: u64, d: Duration) {
        ConnTransport::wait_landed(self, seen, d);
    }

    fn landed_or_register(&self, seen: u64, waker: &Waker) -> Option<bool> {
        ConnTransport::landed_or_register(self, seen, waker)
    }
}

/// For operations that never wait on a request of their own (a ring the
/// peer writes, a transfer the engine drives).
pub(crate) struct NoRequests;

impl Requests for NoRequests {
    fn sleep_on(&self, _: OpId, _: &mut Deadline) -> Result<()> {
        Err(Error::InvalidArgument("an operation without requests named one".into()))
    }

    fn done_or_register(&self, _: OpId, _: &Waker, _: &Engine) -> Result<bool> {
        Err(Error::InvalidArgument("an operation without requests named one".into()))
    }
}

/// Waits for `op`, sleeping on `transport`'s requests, within `bound`.
///
/// # Errors
/// The operation's; [`Error::Timeout`] naming `bound.what` once the bound
/// passed (the operation is still in flight, and may be waited for again).
pub(crate) fn wait<O: Operation>(op: &mut O, transport: &impl Requests, bound: Bound) -> Result<O::Output> {
    let start = Instant::now();
    let mut last = (op.moved(), start);
    loop {
        let until = match op.step(None) {
            Look::Done(outcome) => return outcome,
            Look::Wait(until) => until,
        };
        let now = Instant::now();
        let moved = op.moved();
        if moved != last.0 {
            last = (moved, now);
        }
        let idle_end = last.1 + bound.idle;
        let deadline = bound.total.map_or(idle_end, |t| idle_end.min(start + t));
        if now >= deadline {
            let after = match bound.total {
                Some(t) if start + t <= idle_end => t,
                _ => bound.idle,
            };
            return Err(Error::Timeout { what: bound.what, after });
        }
        nap(transport, until, deadline - now, now - last.1, bound.spin, bound.what);
    }
}

/// How long a blocking waiter on a ring the peer writes sleeps at most
/// before it looks again, where the transport wakes it when a write lands
/// (a wake lost to a race costs this much).
const RING_SLEEP: Duration = Duration::from_millis(50);

/// The pause between looks at a ring whose writes nobody sees land, after
/// `idle` without one: 20 us, growing to 200 us (the engine's timer's, for
/// an awaited look) as the wait grows long.
fn ring_pause(idle: Duration) -> Duration {
    (idle / 16).clamp(Duration::from_micros(20), Duration::from_micros(200))
}

/// The pause between an awaited wait's looks at a ring whose writes
/// nobody sees land (verbs): the engine's [`LOOK_AGAIN`] for the first
/// [`AWAITED_RING_BUSY`] of the wait, then a millisecond. Each look wakes
/// the awaiting task, which for Python is an event loop taking the GIL: a
/// look every 200 us kept an idle loop busy 5,000 times a second.
fn awaited_ring_pause(idle: Duration) -> Duration {
    if idle < AWAITED_RING_BUSY { LOOK_AGAIN } else { Duration::from_millis(1) }
}

/// How long an awaited look at a ring whose landings the transport counts
/// (TCP) waits for its wake before it looks anyway. Each look wakes the
/// awaiting task: at 50 ms, an idle awaited inbox cost a Python process
/// 1.4-2.5 ms of CPU per 300 ms more than awaiting nothing.
const AWAITED_RING_SAFEGUARD: Duration = Duration::from_secs(1);

/// How long an awaited wait on a ring looks at it every [`LOOK_AGAIN`].
const AWAITED_RING_BUSY: Duration = Duration::from_millis(10);

/// One pause of a blocking wait on what `until` names, at most `left`,
/// `idle` since the wait last moved: within `spin` of it (on a copy about
/// to end, a ring) the CPU is only yielded; a request is slept on (a slice
/// of it where other work must move meanwhile); a ring until the peer's
/// next write lands; else a moment. Whether it slept on a request for all
/// of `left` without it finishing.
fn nap(
    transport: &impl Requests,
    until: Until,
    left: Duration,
    idle: Duration,
    spin: Duration,
    what: &'static str,
) -> bool {
    let spinning = idle < spin;
    match until {
        Until::Request { briefly: Some(true), .. } | Until::Soon { copying: true } | Until::Ring { .. } if spinning => {
            look_again(true);
        }
        Until::Ring { seen: Some(seen) } => transport.wait_landed(seen, left.min(RING_SLEEP)),
        Until::Ring { seen: None } => std::thread::sleep(ring_pause(idle).min(left)),
        Until::Request { id, briefly } => {
            let slice = briefly.map_or(left, |copying| staged_slice(copying).min(left));
            match transport.sleep_on(id, &mut Deadline::lazy(slice, what)) {
                // Done, or a slice over: the next look takes it.
                Ok(()) => {}
                Err(Error::Timeout { .. }) => return briefly.is_none(),
                // Failed or lost: the next look reports it; never a busy loop.
                Err(_) => look_again(false),
            }
        }
        Until::Soon { .. } | Until::Woken => look_again(false),
    }
    false
}

/// One step of a wait, for a caller that keeps several operations going on
/// one thread: a look, and if `op` has not ended, one sleep on what it waits
/// for (a request at most until `bound`'s end) and a second look. `Some`
/// once it ended.
///
/// # Errors
/// As [`wait`].
pub(crate) fn wait_once<O: Operation>(
    op: &mut O,
    transport: &impl Requests,
    bound: Bound,
) -> Result<Option<O::Output>> {
    let until = match op.step(None) {
        Look::Done(outcome) => return outcome.map(Some),
        Look::Wait(until) => until,
    };
    let limit = bound.total.map_or(bound.idle, |t| t.min(bound.idle));
    // Yields only on a copy about to end: a request is slept on.
    let spin = if matches!(until, Until::Soon { copying: true }) { Duration::MAX } else { Duration::ZERO };
    if nap(transport, until, limit, Duration::ZERO, spin, bound.what) {
        return Err(Error::Timeout { what: bound.what, after: limit });
    }
    match op.step(None) {
        Look::Done(outcome) => outcome.map(Some),
        Look::Wait(_) => Ok(None),
    }
}

/// One awaited look at `op`: its outcome, or `waker` registered where it
/// will be woken, with `clock` bounding the await by `bound` without
/// progress (none: unbounded).
///
/// # Errors
/// As [`wait`], the timeout through `clock`.
pub(crate) fn poll<O: Operation>(
    op: &mut O,
    transport: &impl Requests,
    engine: &Engine,
    clock: &mut AwaitClock,
    waker: &Waker,
    bound: Option<Duration>,
    what: &'static str,
) -> Poll<Result<O::Output>> {
    let before = op.moved();
    let why = match op.step(Some(waker)) {
        Look::Done(outcome) => {
            clock.stop(engine);
            return Poll::Ready(outcome);
        }
        Look::Wait(Until::Request { id, briefly }) => match transport.done_or_register(id, waker, engine) {
            Ok(false) if briefly.is_none() => NotYet::Told,
            Ok(false) => NotYet::LookAgain(if briefly == Some(true) { LOOK_AGAIN_COPYING } else { LOOK_AGAIN }),
            // Finished meanwhile, or failed: looked at again at once.
            Ok(true) | Err(_) => {
                waker.wake_by_ref();
                NotYet::Told
            }
        },
        Look::Wait(Until::Soon { copying }) => NotYet::LookAgain(if copying { LOOK_AGAIN_COPYING } else { LOOK_AGAIN }),
        // Woken when the peer's next write lands (the transport registers
        // the waker under the lock it counts landings with, and wakes it on
        // a break too); the timer looks again only as a safeguard.
        Look::Wait(Until::Ring { seen }) => match seen.and_then(|seen| transport.landed_or_register(seen, waker)) {
            Some(false) => NotYet::LookAgain(AWAITED_RING_SAFEGUARD),
            Some(true) => {
                waker.wake_by_ref();
                NotYet::Told
            }
            None => NotYet::LookAgain(awaited_ring_pause(clock.idle())),
        },
        Look::Wait(Until::Woken) => NotYet::Told,
    };
    if op.moved() != before {
        clock.restart(engine);
    }
    match clock.not_yet(engine, waker, why, bound, what) {
        Err(e) => Poll::Ready(Err(e)),
        Ok(()) => Poll::Pending,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An operation that ends after `left` looks, moving every `every`-th.
    struct Counting {
        left: u32,
        looks: u64,
        every: u64,
    }

    impl Operation for Counting {
        type Output = u64;
        fn step(&mut self, _: Option<&Waker>) -> Look<u64> {
            self.looks += 1;
            if self.left == 0 {
                return Look::Done(Ok(self.looks));
            }
            self.left -= 1;
            Look::Wait(Until::Soon { copying: false })
        }
        fn moved(&self) -> u64 {
            self.looks / self.every
        }
    }

    #[test]
    fn a_wait_ends_with_the_outcome_or_at_its_bound_counting_from_the_last_progress() {
        let t = NoRequests;
        let bound = |total, idle| Bound { total, idle, spin: Duration::ZERO, what: "x" };
        let mut op = Counting { left: 5, looks: 0, every: 1 };
        assert_eq!(wait(&mut op, &t, bound(None, Duration::from_secs(5))).unwrap(), 6);
        // No progress: the idle bound ends it.
        let mut stuck = Counting { left: u32::MAX, looks: 0, every: u64::MAX };
        let t0 = Instant::now();
        let e = wait(&mut stuck, &t, bound(None, Duration::from_millis(30))).unwrap_err();
        assert!(matches!(e, Error::Timeout { after, .. } if after == Duration::from_millis(30)), "{e}");
        assert!(t0.elapsed() >= Duration::from_millis(30));
        // Progress on every look: only the total ends it.
        let mut busy = Counting { left: u32::MAX, looks: 0, every: 1 };
        let e = wait(&mut busy, &t, bound(Some(Duration::from_millis(40)), Duration::from_millis(10))).unwrap_err();
        assert!(matches!(e, Error::Timeout { after, .. } if after == Duration::from_millis(40)), "{e}");
    }
}
