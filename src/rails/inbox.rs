//! Notifications arriving on any queue pair of a rail connection.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use crate::connection::{Inbox, Looking, Note};
use crate::error::{Error, Result};

/// Notifications arriving on any queue pair of a [`RailConnection`](super::RailConnection).
#[derive(Debug)]
pub struct RailInbox {
    pub(super) inboxes: Vec<Inbox>,
    pub(super) timeout: Duration,
}

impl RailInbox {
    /// Waits until `n` notifications with `tag` have arrived, on whichever
    /// rails, up to the connections' operation timeout.
    ///
    /// # Errors
    /// As [`RailInbox::wait_timeout`].
    pub fn wait(&mut self, tag: u32, n: usize) -> Result<Vec<Note>> {
        self.wait_timeout(tag, n, self.timeout)
    }

    /// Waits up to `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`] (nothing taken); [`Error::PeerTransferFailed`];
    /// [`Error::ConnectionLost`] when every queue pair is lost.
    pub fn wait_timeout(&mut self, tag: u32, n: usize, timeout: Duration) -> Result<Vec<Note>> {
        let until = Instant::now() + timeout;
        loop {
            if let Some(notes) = self.try_take(tag, n)? {
                return Ok(notes);
            }
            if Instant::now() >= until {
                return Err(Error::Timeout { what: "notifications on a rail connection", after: timeout });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Takes `n` notifications with `tag` if they have arrived, on
    /// whichever rails.
    ///
    /// # Errors
    /// [`Error::PeerTransferFailed`]; [`Error::ConnectionLost`] when every
    /// queue pair is lost.
    pub fn try_take(&mut self, tag: u32, n: usize) -> Result<Option<Vec<Note>>> {
        let mut have = 0;
        let mut lost = None;
        for ib in &mut self.inboxes {
            // A lost queue pair still hands over what arrived before.
            if let Err(e) = ib.try_take(tag, usize::MAX) {
                match e {
                    Error::ConnectionLost { .. } => lost = Some(e),
                    other => return Err(other),
                }
            }
            have += ib.count(tag);
        }
        if have >= n {
            let mut notes = Vec::with_capacity(n);
            for ib in &mut self.inboxes {
                let k = ib.count(tag).min(n - notes.len());
                if k > 0 {
                    notes.extend(ib.try_take(tag, k)?.unwrap_or_default());
                }
            }
            return Ok(Some(notes));
        }
        match lost.filter(|_| self.inboxes.iter().all(Inbox::is_lost)) {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }

    /// [`wait`](Self::wait) as a future: it never blocks the thread (the
    /// first rail's engine has it look again every 200 us).
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_async(&mut self, tag: u32, n: usize) -> Looking<impl FnMut() -> Result<Option<Vec<Note>>> + '_> {
        let ctx = self.inboxes[0].context();
        Looking::new(ctx, self.timeout, "notifications on a rail connection", move || self.try_take(tag, n))
    }
}
