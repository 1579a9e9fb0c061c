//! The receiving side of notifications: an [`Inbox`] keeps receives posted
//! on a connection and counts what arrives by tag, so a waiter asks for
//! "N notifications with tag T" with no assumption about the order in which
//! notifications of different transfers arrive.

#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{ConnShared, Connection, Pending};
use crate::error::{Error, Result};
use crate::memory::parts_of;
use crate::protocol::notify::{self, NotifyStatus};
use crate::{HostMemory, Region};

/// One notification: its tag and payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    /// The tag the sender gave it.
    pub tag: u32,
    /// Its payload (empty if none was sent).
    pub payload: Bytes,
}

/// What an inbox has seen ([`Inbox::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxStats {
    /// Notifications received (including failure notifications).
    pub received: u64,
    /// Messages that were not notifications, dropped.
    pub malformed: u64,
    /// Notifications received and not yet taken.
    pub queued: usize,
    /// What the notifications not yet taken are charged (see
    /// [`MAX_QUEUED_BYTES`]).
    pub queued_bytes: usize,
    /// Notifications dropped because [`MAX_QUEUED_NOTES`] or
    /// [`MAX_QUEUED_BYTES`] were already waiting to be taken (a peer sending
    /// tags nobody waits for).
    pub overflowed: u64,
}

/// Notifications an inbox keeps untaken at most; past that, new ones are
/// dropped and counted ([`InboxStats::overflowed`]).
pub const MAX_QUEUED_NOTES: usize = 65_536;

/// Bytes of notifications an inbox keeps untaken at most: each one is
/// charged its payload (kept as the bytes that arrived, a failure's reason
/// too: at most [`MAX_NOTIFY_PAYLOAD`](crate::MAX_NOTIFY_PAYLOAD)) and
/// [`NOTE_OVERHEAD`]. Past that, new ones are dropped and counted, so a
/// peer cannot grow this side's memory past this bound per inbox, whatever
/// it sends (plus the inbox's receive slots, about 4 KiB each).
pub const MAX_QUEUED_BYTES: usize = 64 << 20;

/// What each notification waiting in an inbox is charged beyond its
/// payload: its entry, its tag's queue and its share of the table of tags,
/// with the allocator's overhead (measured: about 270 bytes with every note
/// under a tag of its own, the worst case; `tests/hostile_peers.rs`).
pub const NOTE_OVERHEAD: usize = 384;

/// One notification not yet taken: its payload, or a failure's reason, as
/// the bytes that arrived (turned into text only when taken).
#[derive(Debug)]
enum Entry {
    Done(Bytes),
    Failed(Bytes),
}

impl Entry {
    fn cost(&self) -> usize {
        let (Entry::Done(b) | Entry::Failed(b)) = self;
        NOTE_OVERHEAD + b.len()
    }
}

/// Notifications arriving on one connection, counted by tag; see
/// [`Connection::inbox`].
///
/// A notification is handed out only once the data its transfer wrote is
/// visible to CUDA work where it landed in GPU memory this side exposed:
/// copied in from the host mirror on the staged path, or flushed on a
/// direct path where the GPU needs it (a failure to do so hands the note
/// out as the transfer's failure).
///
/// It owns the connection's receive side: every message the peer sends
/// lands here. Do not post receives of your own on a connection with an
/// inbox (they would take notifications in turn).
pub struct Inbox {
    shared: Arc<ConnShared>,
    /// Posted receives, in the order they complete.
    slots: VecDeque<Pending<Region<HostMemory>>>,
    /// Per tag, what arrived and is not taken: a payload, or a failure's reason.
    by_tag: HashMap<u32, VecDeque<Entry>>,
    /// Entries in `by_tag`.
    queued: usize,
    /// What they are charged ([`Entry::cost`]).
    queued_bytes: usize,
    /// Why no more will arrive.
    lost: Option<String>,
    stats: InboxStats,
}

impl Connection {
    /// Starts receiving notifications on this connection: posts `slots`
    /// receives of [`MAX_NOTIFY_PAYLOAD`](crate::MAX_NOTIFY_PAYLOAD) bytes
    /// and more (reposting each as it is used), at most the receive queue's
    /// depth. More slots let more notifications arrive between two polls
    /// (a sender whose notification finds no receive retries, within its
    /// receiver-not-ready budget).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero slots; registration errors.
    pub fn inbox(&self, slots: usize) -> Result<Inbox> {
        if slots == 0 {
            return Err(Error::InvalidArgument("an inbox needs at least one receive slot".into()));
        }
        let slots = slots.min(self.shared.info.recv_queue_depth.max(1) as usize);
        let mut inbox = Inbox {
            shared: Arc::clone(&self.shared),
            slots: VecDeque::with_capacity(slots),
            by_tag: HashMap::new(),
            queued: 0,
            queued_bytes: 0,
            lost: None,
            stats: InboxStats::default(),
        };
        for _ in 0..slots {
            let region = self.shared.domain.alloc(notify::MAX_MESSAGE)?;
            inbox.post(region)?;
        }
        Ok(inbox)
    }
}

impl Inbox {
    fn post(&mut self, region: Region<HostMemory>) -> Result<()> {
        let parts = parts_of(&region);
        let posted = self.shared.transport.post_recv(Some(parts));
        let mut pending = Pending::posted(&self.shared, region, posted);
        if pending.is_done() {
            // Refused at once: say why.
            return pending.wait().map(|_| ());
        }
        self.slots.push_back(pending);
        Ok(())
    }

    /// Files one received message.
    fn file(&mut self, imm: Option<u32>, msg: &[u8]) {
        let Some(tag) = imm else {
            self.stats.malformed += 1;
            tracing::warn!("a message without an immediate reached a notification inbox: dropped");
            return;
        };
        match notify::decode(msg) {
            Ok(d)
                if self.queued >= MAX_QUEUED_NOTES
                    || self.queued_bytes + NOTE_OVERHEAD + d.payload.len() > MAX_QUEUED_BYTES =>
            {
                self.stats.overflowed += 1;
                tracing::warn!(
                    "{} notifications ({} bytes) wait to be taken: dropped one with tag {tag}",
                    self.queued,
                    self.queued_bytes
                );
            }
            Ok(d) => {
                self.stats.received += 1;
                let entry = match (d.status, self.make_visible(&d.cover)) {
                    (NotifyStatus::Done, Ok(())) => Entry::Done(Bytes::copy_from_slice(d.payload)),
                    (NotifyStatus::Done, Err(e)) => {
                        Entry::Failed(Bytes::from(format!("the transfer's data could not be made visible here: {e}")))
                    }
                    (NotifyStatus::Failed, _) => Entry::Failed(Bytes::copy_from_slice(d.payload)),
                };
                self.queued += 1;
                self.queued_bytes += entry.cost();
                self.by_tag.entry(tag).or_default().push_back(entry);
            }
            Err(notify::Malformed(why)) => {
                self.stats.malformed += 1;
                tracing::warn!("a message that is not a notification reached an inbox ({why}): dropped");
            }
        }
    }

    /// Makes the ranges a notification names visible to CUDA work where
    /// they are GPU memory of this side (copied in from the staged mirror,
    /// or flushed): the note is handed out only after that.
    fn make_visible(&self, cover: &notify::Cover) -> Result<()> {
        #[cfg(feature = "cuda")]
        for &(addr, len) in &cover.ranges {
            self.shared.domain.mem().visible.make_visible(cover.key, addr, len)?;
        }
        #[cfg(not(feature = "cuda"))]
        let _ = cover;
        Ok(())
    }

    /// Takes in what has arrived, without blocking; how many messages.
    ///
    /// # Errors
    /// Never for the connection's loss (that shows in the waits, after
    /// what arrived before it is taken); [`Error::Verbs`] if polling fails.
    pub fn poll(&mut self) -> Result<usize> {
        let mut n = 0;
        while let Some(front) = self.slots.front_mut() {
            match front.poll() {
                Ok(None) => break,
                Ok(Some(c)) => {
                    let slot = self.slots.pop_front().expect("the front slot");
                    let region = slot.into_buffer().unwrap_or_else(|_| unreachable!("a finished receive"));
                    let len = (c.byte_len as usize).min(region.len());
                    self.file(c.imm, &region.as_slice()[..len]);
                    n += 1;
                    if self.lost.is_none() {
                        if let Err(e) = self.post(region) {
                            self.lose(&e);
                        }
                    }
                }
                Err(e) => {
                    self.slots.pop_front();
                    self.lose(&e);
                }
            }
        }
        Ok(n)
    }

    fn lose(&mut self, e: &Error) {
        if self.lost.is_none() {
            self.lost = Some(match e {
                Error::ConnectionLost { reason } => reason.clone(),
                other => format!("a notification receive failed: {other}"),
            });
        }
    }

    /// Takes `n` notifications with `tag` if they have arrived.
    ///
    /// # Errors
    /// [`Error::PeerTransferFailed`] when a transfer that was to notify
    /// `tag` failed at the peer (that failure is taken);
    /// [`Error::ConnectionLost`] when fewer than `n` arrived and no more can.
    pub fn try_take(&mut self, tag: u32, n: usize) -> Result<Option<Vec<Note>>> {
        self.poll()?;
        self.take_ready(tag, n)
    }

    fn take_ready(&mut self, tag: u32, n: usize) -> Result<Option<Vec<Note>>> {
        if let Some(queue) = self.by_tag.get_mut(&tag) {
            let failed = queue.iter().position(|e| matches!(e, Entry::Failed(_)));
            let taken: Vec<Entry> = match failed {
                Some(at) => queue.remove(at).into_iter().collect(),
                None if queue.len() >= n => queue.drain(..n).collect(),
                None => Vec::new(),
            };
            if queue.is_empty() {
                self.by_tag.remove(&tag);
            }
            if !taken.is_empty() || n == 0 {
                self.queued -= taken.len();
                self.queued_bytes -= taken.iter().map(Entry::cost).sum::<usize>();
                if let [Entry::Failed(reason)] = taken.as_slice() {
                    // Text only now, for the one reason handed out.
                    let reason = String::from_utf8_lossy(reason).into_owned();
                    return Err(Error::PeerTransferFailed { tag, reason });
                }
                let notes = taken.into_iter().map(|e| {
                    let (Entry::Done(payload) | Entry::Failed(payload)) = e;
                    Note { tag, payload }
                });
                return Ok(Some(notes.collect()));
            }
        } else if n == 0 {
            return Ok(Some(Vec::new()));
        }
        match &self.lost {
            Some(reason) => Err(Error::ConnectionLost { reason: reason.clone() }),
            None => Ok(None),
        }
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

    /// Waits up to `timeout`.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_timeout(&mut self, tag: u32, n: usize, timeout: Duration) -> Result<Vec<Note>> {
        let until = Instant::now() + timeout;
        loop {
            if let Some(notes) = self.try_take(tag, n)? {
                return Ok(notes);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout { what: "notifications", after: timeout });
            }
            // Sleep on the oldest receive: every message completes it first.
            match self.slots.front_mut() {
                Some(front) => match front.wait_timeout(left.min(Duration::from_millis(100))) {
                    Ok(_) | Err(Error::Timeout { .. }) => {}
                    // Reported (and the slot dropped) by the next poll.
                    Err(e) => self.lose(&e),
                },
                None => return Err(Error::ConnectionLost { reason: self.lost.clone().unwrap_or_default() }),
            }
        }
    }

    /// Notifications with `tag` that arrived and are not taken (as of the
    /// last poll or wait).
    pub fn count(&self, tag: u32) -> usize {
        self.by_tag.get(&tag).map_or(0, |q| q.iter().filter(|e| matches!(e, Entry::Done(_))).count())
    }

    /// Whether no more notifications can arrive (the connection is lost).
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_some()
    }

    /// What the inbox has seen.
    pub fn stats(&self) -> InboxStats {
        InboxStats { queued: self.queued, queued_bytes: self.queued_bytes, ..self.stats }
    }
}

impl fmt::Debug for Inbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("slots", &self.slots.len())
            .field("stats", &self.stats)
            .field("lost", &self.lost)
            .finish()
    }
}
