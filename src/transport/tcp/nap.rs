//! The receiver thread's nap while waiters spin and read the socket
//! themselves (see [`Nap`]).

use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::poll::Alarm;

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
    alarm: Alarm,
    base: Instant,
    /// When the alarm goes off, in nanoseconds after `base`; 0 when it is
    /// not known to be set.
    armed_until: AtomicU64,
    rung: AtomicBool,
}

impl Nap {
    pub(super) fn new() -> io::Result<Nap> {
        Ok(Nap {
            alarm: Alarm::new()?,
            base: Instant::now(),
            armed_until: AtomicU64::new(0),
            rung: AtomicBool::new(false),
        })
    }

    fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The last spinning waiter left: the nap ends within [`NAP`].
    pub(super) fn push(&self) {
        if self.rung.load(Ordering::SeqCst) {
            return;
        }
        let (now, nap) = (self.now(), NAP.as_nanos() as u64);
        if self.armed_until.load(Ordering::SeqCst) >= now + nap / 2 {
            return;
        }
        self.armed_until.store(now + nap, Ordering::SeqCst);
        self.alarm.set(NAP);
        // A ring between the look above and the set: it goes off now.
        if self.rung.load(Ordering::SeqCst) {
            self.alarm.set(Duration::ZERO);
        }
    }

    /// Ends the nap now.
    pub(super) fn ring(&self) {
        self.rung.store(true, Ordering::SeqCst);
        self.alarm.set(Duration::ZERO);
    }

    /// Sleeps until the alarm goes off (or [`NAP_MAX`]): whether the nap was
    /// rung. The alarm is then known not to be set.
    pub(super) fn sleep(&self) -> bool {
        let _ = crate::poll::readable([self.alarm.as_fd()], NAP_MAX);
        self.alarm.drain();
        self.armed_until.store(0, Ordering::SeqCst);
        self.rung.swap(false, Ordering::SeqCst)
    }
}
