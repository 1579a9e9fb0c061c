//! The receiver thread's nap while waiters spin and read the socket
//! themselves (see [`Nap`]).

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::poll::{Alarm, Bell};

/// The longest the socket goes unwatched after the last spinning waiter
/// left while the receiver thread napped.
pub(super) const NAP: Duration = Duration::from_millis(1);

/// The longest one nap lasts without its alarm (a safeguard only: the
/// alarm ends a nap once nobody spins).
pub(super) const NAP_MAX: Duration = Duration::from_millis(100);

/// The receiver thread's nap while waiters spin and read the socket
/// themselves. It ends when a thread rings it (a waiter left it a frame, a
/// thread goes to sleep and needs the socket watched, the connection
/// broke), or at the latest [`NAP`] after the last spinning waiter left.
/// Waiters that keep coming back (a ping-pong) only move its alarm, at most
/// one system call every half [`NAP`], and wake nobody: a nap that ended
/// every [`NAP`] to look took a CPU from them a thousand times a second,
/// which on a machine whose CPUs they all hold moved a 64 B ping-pong's
/// median from run to run by a sixth.
pub(super) struct Nap {
    /// Goes off [`NAP`] after the last spinning waiter left.
    alarm: Alarm,
    /// Rung to end the nap now (an eventfd: a timer set to go off at once
    /// took about 20 us more to wake the thread here, which a 4 KiB
    /// ping-pong, whose frames the receiver thread reads, paid every way).
    bell: Bell,
    base: Instant,
    /// When the alarm goes off, in nanoseconds after `base`.
    armed_until: AtomicU64,
    /// The bell was rung in this nap (it is rung once a nap: a waiter
    /// rings at every look while a frame it leaves to the receiver thread
    /// waits).
    rung: AtomicBool,
}

impl Nap {
    pub(super) fn new() -> io::Result<Nap> {
        Ok(Nap {
            alarm: Alarm::new()?,
            bell: Bell::new()?,
            base: Instant::now(),
            armed_until: AtomicU64::new(0),
            rung: AtomicBool::new(false),
        })
    }

    fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The last spinning waiter left: the nap ends within [`NAP`]. The
    /// alarm is moved only when it would go off sooner than half that.
    pub(super) fn push(&self) {
        let (now, nap) = (self.now(), NAP.as_nanos() as u64);
        if self.armed_until.load(Ordering::SeqCst) >= now + nap / 2 {
            return;
        }
        self.armed_until.store(now + nap, Ordering::SeqCst);
        self.alarm.set(NAP);
    }

    /// Ends the nap now.
    pub(super) fn ring(&self) {
        if !self.rung.swap(true, Ordering::SeqCst) {
            self.bell.ring();
        }
    }

    /// Sleeps until rung or `fd` is readable (or `timeout` passed):
    /// whether `fd` is (the receiver thread watching the socket while a
    /// writer reads it, see [`handoff`](super::handoff)). Takes back a ring.
    pub(super) fn watch(&self, fd: BorrowedFd<'_>, timeout: Duration) -> bool {
        let [_, readable] = crate::poll::readable([self.bell.as_fd(), fd], timeout).unwrap_or([false, false]);
        self.take_ring();
        readable
    }

    /// Sleeps until rung (or `timeout` passed), whatever the alarm says.
    pub(super) fn wait_rung(&self, timeout: Duration) {
        let _ = crate::poll::readable([self.bell.as_fd()], timeout);
        self.take_ring();
    }

    /// Takes back the ring of this nap, if any: whether it was rung.
    fn take_ring(&self) -> bool {
        self.bell.drain();
        self.rung.swap(false, Ordering::SeqCst)
    }

    /// Sleeps until rung or the alarm goes off (or [`NAP_MAX`]): whether it
    /// was rung.
    pub(super) fn sleep(&self) -> bool {
        let [_, went_off] =
            crate::poll::readable([self.bell.as_fd(), self.alarm.as_fd()], NAP_MAX).unwrap_or([false, false]);
        if went_off {
            self.alarm.drain();
        }
        self.take_ring()
    }
}
