//! Notifications arriving on any queue pair of a rail connection.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use crate::connection::{Inbox, Note};
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
                return Ok(notes);
            }
            if let Some(e) = lost.filter(|_| self.inboxes.iter().all(Inbox::is_lost)) {
                return Err(e);
            }
            if Instant::now() >= until {
                return Err(Error::Timeout { what: "notifications on a rail connection", after: timeout });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}
