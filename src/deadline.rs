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
