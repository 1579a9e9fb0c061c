//! One deadline type for every wait in the crate: the handshake's reads and
//! writes, posting into a full queue, waiting for an operation. It names
//! what is awaited, for the timeout error.
//!
//! A deadline made for the hot path ([`Deadline::lazy`]) reads the clock
//! only when first asked, so a wait that is over within a few polls never
//! reads it. (Reading the clock is a system call and an emulated timer read
//! on machines without a usable TSC, such as many virtual machines.)

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use crate::error::Error;

#[cfg(feature = "verbs")]
pub(crate) use busy::polls_per_clock_read;

/// How often a busy wait (a verbs connection's) looks at the clock.
#[cfg(feature = "verbs")]
mod busy {
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    /// Polls between two clock reads of a busy wait where reading the clock is
    /// cheap (a vDSO read of the TSC: some tens of nanoseconds).
    const POLLS_PER_FAST_READ: u32 = 64;
    /// What such a read costs.
    const FAST_READ: Duration = Duration::from_nanos(25);
    /// At most this many polls between reads, however slow the clock.
    const MAX_POLLS_PER_READ: u32 = 16_384;

    /// A spin window at least this long is a caller's choice of latency
    /// over CPU time (the bench spins for its whole timeout).
    const LONG_SPIN: Duration = Duration::from_millis(1);

    /// How many polls of a completion queue a busy wait with spin window
    /// `spin` lets pass between two looks at the clock (for its deadline,
    /// its spin window and its peer).
    ///
    /// 64 where reading the clock is cheap, and for a short spin window
    /// (under 1 ms, such as the default 50 us), whatever the clock costs: such
    /// a window spares the CPU, and ends on time. A long window reads a slow
    /// clock proportionally less often, so that reading it takes the same
    /// small share of the spin. On a virtual machine whose kernel found no
    /// usable TSC (QEMU without KVM, for one), every read is a system call
    /// and an emulated timer read of about a microsecond (717 ns in the
    /// soft-RoCE guest), and reading it every 64 polls cost each one-way
    /// message of a ping-pong there about 2 us (8%), where perftest reads no
    /// clock at all while it waits. The cost is measured once per process.
    /// The price: there, a long spin notices its deadline or its end up to
    /// that many polls late (about a millisecond).
    pub(crate) fn polls_per_clock_read(spin: Duration) -> u32 {
        static POLLS: OnceLock<u32> = OnceLock::new();
        if spin < LONG_SPIN {
            return POLLS_PER_FAST_READ;
        }
        *POLLS.get_or_init(|| {
            let cost = clock_read_cost();
            let polls = polls_for_read_cost(cost);
            tracing::debug!("reading the clock costs {cost:?}: long busy waits read it every {polls} polls");
            polls
        })
    }

    /// What one `Instant::now` costs here: the cheapest of a few runs of
    /// back-to-back reads (a run that was preempted is not the clock's cost).
    fn clock_read_cost() -> Duration {
        const READS: u32 = 8;
        (0..4)
            .map(|_| {
                let start = Instant::now();
                let mut last = start;
                for _ in 0..READS {
                    last = std::hint::black_box(Instant::now());
                }
                last.duration_since(start) / READS
            })
            .min()
            .unwrap_or(FAST_READ)
    }

    /// [`polls_per_clock_read`] for a clock read that costs `cost`.
    fn polls_for_read_cost(cost: Duration) -> u32 {
        let times_fast = (cost.as_nanos() / FAST_READ.as_nanos()).max(1);
        u32::try_from(u128::from(POLLS_PER_FAST_READ) * times_fast)
            .map_or(MAX_POLLS_PER_READ, |n| n.min(MAX_POLLS_PER_READ))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_slow_clock_is_read_less_often_while_spinning() {
            assert_eq!(polls_for_read_cost(Duration::ZERO), 64, "never fewer than 64 polls between reads");
            assert_eq!(polls_for_read_cost(Duration::from_nanos(30)), 64, "a vDSO TSC read");
            assert_eq!(polls_for_read_cost(Duration::from_nanos(1_200)), 64 * 48, "a system call and an HPET read");
            assert_eq!(polls_for_read_cost(Duration::from_secs(1)), MAX_POLLS_PER_READ, "bounded");
            assert_eq!(polls_for_read_cost(Duration::MAX), MAX_POLLS_PER_READ, "no overflow");
            let here = polls_per_clock_read(Duration::from_secs(60));
            assert!((64..=MAX_POLLS_PER_READ).contains(&here), "{here}");
            assert_eq!(polls_per_clock_read(LONG_SPIN), here, "measured once");
            assert_eq!(polls_per_clock_read(Duration::from_micros(50)), 64, "a short window ends on time");
            assert_eq!(polls_per_clock_read(Duration::ZERO), 64);
        }
    }
}

/// A point in time to stop waiting at, and what the wait was for.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    total: Duration,
    /// Fixed at construction, or when the clock is first read.
    at: Option<Instant>,
    what: &'static str,
}

/// Far enough to mean "never", without overflowing an `Instant`.
const FOREVER: Duration = Duration::from_secs(86_400 * 365);

fn add(now: Instant, d: Duration) -> Instant {
    now.checked_add(d).unwrap_or(now + FOREVER)
}

impl Deadline {
    /// `total` from now, awaiting `what`.
    pub fn after(total: Duration, what: &'static str) -> Self {
        Deadline { total, at: Some(add(Instant::now(), total)), what }
    }

    /// `total` from when the clock is first read, awaiting `what`.
    pub(crate) fn lazy(total: Duration, what: &'static str) -> Self {
        Deadline { total, at: None, what }
    }

    /// No wait at all: a post that would have to wait for room is refused
    /// at once ([`Error::QueueFull`]).
    pub(crate) fn immediate(what: &'static str) -> Self {
        Deadline { total: Duration::ZERO, at: None, what }
    }

    /// Whether this deadline allows no wait at all.
    pub(crate) fn is_immediate(&self) -> bool {
        self.total.is_zero()
    }

    /// The same instant, awaiting something else.
    pub fn for_(self, what: &'static str) -> Self {
        Deadline { what, ..self }
    }

    /// The instant, fixing it from `now` if it is not fixed yet.
    pub(crate) fn at_from(&mut self, now: Instant) -> Instant {
        *self.at.get_or_insert_with(|| add(now, self.total))
    }

    /// The time left; `None` once it has passed (a lazy deadline not yet
    /// fixed has all of it left).
    pub(crate) fn remaining(&self) -> Option<Duration> {
        match self.at {
            Some(at) => at.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()),
            None => Some(self.total).filter(|d| !d.is_zero()),
        }
    }

    /// The error for a wait that ran past it.
    pub(crate) fn expired(&self) -> Error {
        Error::Timeout { what: self.what, after: self.total }
    }
}

/// The pause of a wait between two looks at something that wakes nobody
/// when it changes: a staged operation's copies (a copy between the GPU
/// and staging ends unsignalled: no descriptor to sleep on), or a
/// notification ring the peer writes. While `spinning` (a copy in flight,
/// within the connection's [`spin`](crate::ConnectOptions::spin) window)
/// the CPU is only yielded and the caller looks again at once: a 4 KiB copy ends
/// about 8 us after it is queued on an H200, and the shortest sleep costs
/// the timer's slack, 50 us or more (such sleeps were half of a staged
/// 4 KiB message's latency there, 84 us against 42). Else a short sleep.
pub(crate) fn look_again(spinning: bool) {
    if spinning {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lazy_deadline_starts_at_the_first_clock_read() {
        let mut d = Deadline::lazy(Duration::from_millis(50), "x");
        assert_eq!(d.remaining(), Some(Duration::from_millis(50)), "not started");
        std::thread::sleep(Duration::from_millis(60));
        let now = Instant::now();
        assert_eq!(d.at_from(now), now + Duration::from_millis(50), "fixed at the first read, not at construction");
        assert_eq!(d.at_from(now + Duration::from_secs(1)), now + Duration::from_millis(50), "and stays");
        let e = Deadline::after(Duration::ZERO, "the peer's hello");
        assert!(e.remaining().is_none());
        assert!(matches!(e.expired(), Error::Timeout { what: "the peer's hello", .. }));
        assert!(matches!(e.for_("ready").expired(), Error::Timeout { what: "ready", .. }));
        let mut far = Deadline::lazy(Duration::MAX, "forever");
        assert!(far.at_from(now) > now + Duration::from_secs(86_400), "no overflow");
    }
}
