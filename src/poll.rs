//! Waiting on file descriptors with `ppoll(2)`, and a [`Bell`] to wake a
//! thread waiting so, behind a safe interface (a leaf: the listener, the
//! progress engine and the transports use it).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// Waits until one of `fds` is readable (or hung up, or in error), at most
/// `timeout` ([`wait_fds`]: to the microsecond, not rounded up to a
/// millisecond as `poll(2)` would). Returns which
/// are; none on a timeout or an interrupted wait.
///
/// # Errors
/// [`io::Error`] from `poll(2)`, other than an interruption.
pub(crate) fn readable<const N: usize>(fds: [BorrowedFd<'_>; N], timeout: Duration) -> io::Result<[bool; N]> {
    readable_of(fds.map(Some), timeout)
}

/// [`readable`] over the descriptors that are there: a `None` is never
/// readable (poll(2) passes over a negative descriptor).
///
/// # Errors
/// [`io::Error`] from `poll(2)`, other than an interruption.
pub(crate) fn readable_of<const N: usize>(
    fds: [Option<BorrowedFd<'_>>; N],
    timeout: Duration,
) -> io::Result<[bool; N]> {
    let mut p = fds.map(|fd| libc::pollfd { fd: fd.map_or(-1, |fd| fd.as_raw_fd()), events: libc::POLLIN, revents: 0 });
    // Each descriptor is borrowed, so open for the duration of the call, or -1.
    if let Err(e) = wait_fds(&mut p, timeout) {
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(p.map(|x| x.revents != 0))
}

/// `ppoll(2)` on `fds` for at most `timeout`, given to the nanosecond:
/// `poll(2)` takes whole milliseconds, so a wait of 20 us slept 1 ms (a
/// staged GPU operation's next look, awaited, came a millisecond late).
/// A negative descriptor is passed over; one closed meanwhile is reported
/// as `POLLNVAL`, never dereferenced.
///
/// # Errors
/// [`io::Error`] from `ppoll(2)` (an interruption included).
pub(crate) fn wait_fds(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<usize> {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
    };
    // SAFETY: `fds` is a live, exclusively borrowed slice of pollfds, its
    // length passed with it; `ts` lives across the call; a null signal mask
    // leaves the thread's mask as it is (ppoll is then poll with a finer
    // timeout).
    let n = unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// An eventfd(2) one thread rings to wake others asleep in [`readable`] on
/// it. It stays readable from the first ring until [`drain`](Self::drain):
/// a ring before the sleeper reaches poll(2) is not lost.
#[derive(Debug)]
pub(crate) struct Bell(OwnedFd);

impl Bell {
    /// A bell nobody has rung.
    ///
    /// # Errors
    /// [`io::Error`] from eventfd(2) (out of descriptors).
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: eventfd(2) with constant flags; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        Ok(Bell(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Makes the bell readable (until drained). Best effort: the only
    /// failure, a counter at its maximum, leaves it readable anyway.
    pub(crate) fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writes the 8 bytes of a live u64 to the eventfd this value
        // owns; the descriptor is non-blocking, so the call returns at once.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    /// Takes back every ring so far: not readable until the next.
    pub(crate) fn drain(&self) {
        read_counter(self.0.as_fd());
    }
}

impl AsFd for Bell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// A one-shot timerfd(2) alarm that a thread sleeps on in [`readable`]: it
/// goes off once, after the time it was last [set](Self::set) to, and stays
/// readable until [drained](Self::drain). Setting it again while it is
/// pending moves it, sooner or later, without waking anyone.
#[derive(Debug)]
pub(crate) struct Alarm(OwnedFd);

impl Alarm {
    /// An alarm that is not set.
    ///
    /// # Errors
    /// [`io::Error`] from timerfd_create(2) (out of descriptors).
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: timerfd_create(2) with constant arguments; the result is checked.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        Ok(Alarm(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Makes it go off `after` from now (at the next tick when `after` is
    /// zero), in place of any time it was set to.
    pub(crate) fn set(&self, after: Duration) {
        // A zero it_value would disarm it instead.
        let after = after.max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
            it_value: libc::timespec {
                tv_sec: libc::time_t::try_from(after.as_secs()).unwrap_or(libc::time_t::MAX),
                tv_nsec: libc::c_long::from(after.subsec_nanos()),
            },
        };
        // SAFETY: the timerfd this value owns, a live itimerspec, and a null
        // pointer for the old value (not asked for). It fails only on a bad
        // descriptor or value, neither of which this can pass.
        let _ = unsafe { libc::timerfd_settime(self.0.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
    }

    /// Takes back its going off: not readable until it goes off again.
    pub(crate) fn drain(&self) {
        read_counter(self.0.as_fd());
    }
}

/// Reads (and so resets) the 8-byte counter of a non-blocking eventfd or
/// timerfd; nothing when it is zero (EAGAIN).
fn read_counter(fd: BorrowedFd<'_>) {
    let mut count: u64 = 0;
    // SAFETY: reads at most 8 bytes into a live u64 from a descriptor the
    // caller borrows for the call; both kinds are non-blocking, so the call
    // returns at once.
    let _ = unsafe { libc::read(fd.as_raw_fd(), (&raw mut count).cast(), 8) };
}

impl AsFd for Alarm {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_alarm_goes_off_once_at_the_last_time_it_was_set_to() {
        let alarm = Alarm::new().unwrap();
        let short = Duration::from_millis(20);
        assert_eq!(readable([alarm.as_fd()], short).unwrap(), [false], "not set: never goes off");
        alarm.set(Duration::from_secs(60));
        alarm.set(Duration::from_millis(1));
        let started = std::time::Instant::now();
        assert_eq!(readable([alarm.as_fd()], LONG).unwrap(), [true], "moved sooner: goes off then");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(readable([alarm.as_fd()], short).unwrap(), [true], "readable until drained");
        alarm.drain();
        assert_eq!(readable([alarm.as_fd()], short).unwrap(), [false], "one-shot: drained, it stays quiet");
        alarm.set(Duration::from_millis(1));
        alarm.set(Duration::from_secs(60));
        assert_eq!(
            readable([alarm.as_fd()], Duration::from_millis(200)).unwrap(),
            [false],
            "moved later: not at the first time"
        );
        alarm.set(Duration::ZERO);
        assert_eq!(readable([alarm.as_fd()], LONG).unwrap(), [true], "zero: at once");
    }

    /// Long enough never to end a wait that a ring should end.
    const LONG: Duration = Duration::from_secs(10);

    #[test]
    fn a_ring_before_the_wait_is_kept_until_drained() {
        let bell = Bell::new().unwrap();
        let quiet = Duration::from_millis(5);
        assert_eq!(readable([bell.as_fd()], quiet).unwrap(), [false], "not rung yet");
        // Rung before anyone waits: the wait still ends at once, however
        // many times it is asked, until the bell is drained.
        bell.ring();
        bell.ring();
        assert_eq!(readable([bell.as_fd()], LONG).unwrap(), [true]);
        assert_eq!(readable([bell.as_fd()], LONG).unwrap(), [true]);
        bell.drain();
        assert_eq!(readable([bell.as_fd()], quiet).unwrap(), [false], "one drain takes both rings");
        bell.drain();
        assert_eq!(readable([bell.as_fd()], quiet).unwrap(), [false], "draining a quiet bell is harmless");
    }

    #[test]
    fn a_ring_wakes_a_thread_already_waiting() {
        let bell = std::sync::Arc::new(Bell::new().unwrap());
        let waiter = {
            let bell = std::sync::Arc::clone(&bell);
            std::thread::spawn(move || readable([bell.as_fd()], LONG).unwrap())
        };
        // Whether the waiter is in poll(2) yet or not, the ring ends its wait.
        std::thread::sleep(Duration::from_millis(20));
        bell.ring();
        assert_eq!(waiter.join().unwrap(), [true]);
    }
}
