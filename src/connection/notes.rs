//! A connection's notifications: its two rings ([`crate::protocol::mailbox`]),
//! this side's, which the peer writes and an [`Inbox`](super::Inbox) reads,
//! and the peer's, which this side's notifications are written into; and
//! what this side keeps of the notifications it took, by tag, within its
//! bounds.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

use bytes::Bytes;

use crate::deadline::{Deadline, look_again};
use crate::error::{Error, Result};
use crate::memory::peer_written::PeerWritten;
use crate::memory::{Exposed, HostMemory, LocalParts, RemoteRegion, parts_of};
use crate::protocol::mailbox::{
    self, ALIGN, CREDITS_IN, CREDITS_OUT, HEADER, MAX_RECORD, RingMemory, RingReader, RingWriter,
};
use crate::protocol::notify::{self, NotifyStatus};
use crate::transport::{ConnTransport, Posted, RemoteOp, WorkItem};
use crate::{Domain, Region};

/// The bytes a registered buffer needs to post any notification from.
pub(crate) const OUT_BUFFER: usize = ALIGN + MAX_RECORD;

/// One notification: its tag and payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    /// The tag the sender gave it.
    pub tag: u32,
    /// Its payload (empty if none was sent).
    pub payload: Bytes,
}

/// What an inbox has seen ([`Inbox::stats`](super::Inbox::stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxStats {
    /// Notifications received (including failure notifications).
    pub received: u64,
    /// Records in the ring that were not notifications, dropped.
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
/// it sends (plus the connection's notification ring,
/// [`ConnectOptions::notify_ring`](crate::ConnectOptions::notify_ring)).
pub const MAX_QUEUED_BYTES: usize = 64 << 20;

/// What each notification waiting in an inbox is charged beyond its
/// payload: its entry, its tag's queue and its share of the table of tags,
/// with the allocator's overhead (measured: about 270 bytes with every note
/// under a tag of its own, the worst case; `tests/hostile_peers.rs`).
pub const NOTE_OVERHEAD: usize = 384;

/// One notification not yet taken: its payload, or a failure's reason, as
/// the bytes that arrived (turned into text only when taken).
#[derive(Debug)]
pub(crate) enum Entry {
    Done(Bytes),
    Failed(Bytes),
}

impl Entry {
    fn cost(&self) -> usize {
        let (Entry::Done(b) | Entry::Failed(b)) = self;
        NOTE_OVERHEAD + b.len()
    }
}

/// What this side keeps of the notifications taken from its ring: per
/// tag, what arrived and is not taken, a payload or a failure's reason.
#[derive(Default)]
pub(crate) struct Notes {
    pub(crate) by_tag: HashMap<u32, VecDeque<Entry>>,
    /// Entries in `by_tag`.
    pub(crate) queued: usize,
    /// What they are charged ([`Entry::cost`]).
    pub(crate) queued_bytes: usize,
    /// Why no more will arrive.
    pub(crate) lost: Option<String>,
    pub(crate) stats: InboxStats,
}

impl Notes {
    /// Files one notification taken from the ring.
    pub(crate) fn file(&mut self, tag: u32, msg: &[u8], make_visible: impl FnOnce(&notify::Cover) -> Result<()>) {
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
                let entry = match (d.status, make_visible(&d.cover)) {
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
                tracing::warn!("a notification record that is not a notification ({why}): dropped");
            }
        }
    }

    pub(crate) fn lose(&mut self, reason: String) {
        if self.lost.is_none() {
            self.lost = Some(reason);
        }
    }

    pub(crate) fn take_ready(&mut self, tag: u32, n: usize) -> Result<Option<Vec<Note>>> {
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
}

/// What a notification waits for when the peer's ring is full.
pub(crate) const RING_ROOM: &str =
    "room in the peer's notification ring (it is not taking its notifications: has it an Inbox?)";

/// The send queue a post refused for the ring's room names.
const RING_QUEUE: &str = "peer's notification ring";

/// Whether `e` refused a notification for room in the peer's ring.
pub(crate) fn ring_full(e: &Error) -> bool {
    matches!(e, Error::QueueFull { queue: RING_QUEUE, .. } | Error::Timeout { what: RING_ROOM, .. })
}

/// This side's ring, as the protocol reads it.
struct Ring<'a>(&'a PeerWritten);

impl RingMemory for Ring<'_> {
    fn load(&self, off: usize) -> u64 {
        self.0.load(HEADER + off)
    }
    fn copy_out(&self, off: usize, out: &mut [u8]) {
        self.0.copy_out(HEADER + off, out);
    }
    fn zero(&self, off: usize, len: usize) {
        self.0.zero(HEADER + off, len);
    }
}

/// What reads this side's ring: the protocol's reader, the credits last
/// sent back, and the notes taken.
pub(crate) struct ReadSide {
    reader: RingReader,
    returned: u64,
    /// Scratch for one record's notification.
    msg: Vec<u8>,
    pub state: Notes,
}

/// Both rings of one connection.
pub(crate) struct NoteRings {
    mine: PeerWritten,
    peer: RemoteRegion,
    writer: Mutex<RingWriter>,
    read: Mutex<ReadSide>,
}

impl NoteRings {
    /// Makes this side's ring of `cap` bytes, exposed for the peer to write
    /// under [`mailbox::RING_TAG`]; the peer's ring is set once known.
    pub(crate) fn make(domain: &Domain, cap: usize) -> Result<Exposed<HostMemory>> {
        if !mailbox::valid_cap(cap) {
            return Err(Error::InvalidArgument(format!(
                "a notification ring of {cap} bytes: it takes {} to {} bytes, a multiple of {ALIGN}",
                mailbox::MIN_RING,
                mailbox::MAX_RING
            )));
        }
        let region = domain.alloc(HEADER + cap)?;
        let mut ring = domain.expose(region, crate::Access::REMOTE_WRITE, mailbox::RING_TAG).map_err(|e| e.error)?;
        // The connection's, not the user's: not in the domain's stats.
        ring.count_as_internal();
        Ok(ring)
    }

    /// Both rings: `mine` (from [`make`](Self::make)) and the peer's, as
    /// the handshake announced it (checked there).
    pub(crate) fn new(mine: Exposed<HostMemory>, peer: RemoteRegion) -> Self {
        let mine_cap = mine.len() - HEADER;
        let peer_cap = peer.len as usize - HEADER;
        NoteRings {
            mine: PeerWritten::new(mine),
            peer,
            writer: Mutex::new(RingWriter::new(peer_cap)),
            read: Mutex::new(ReadSide {
                reader: RingReader::new(mine_cap),
                returned: 0,
                msg: Vec::new(),
                state: Notes::default(),
            }),
        }
    }

    /// Posts `msg` as a notification with `tag` into the peer's ring, from
    /// `buf` (registered, at least [`OUT_BUFFER`] bytes, kept by the caller
    /// until the post completes), once the peer's credits leave room.
    ///
    /// A post refused for room in the send queue or the ring with `due`
    /// immediate is [`Error::QueueFull`]: not an error, try again. Waiting
    /// for the ring's room ends at `due` with [`Error::Timeout`].
    pub(crate) fn post(
        &self,
        transport: &ConnTransport,
        tag: u32,
        msg: &[u8],
        buf: &mut Region<HostMemory>,
        mut due: Deadline,
    ) -> Posted {
        let mut spins = 0u32;
        loop {
            let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(p) = w.place(msg.len(), self.mine.load(CREDITS_IN)) {
                let whole = parts_of(&*buf);
                let out = buf.as_mut_slice();
                let mut items =
                    [WorkItem { local: None, op: RemoteOp::Send }, WorkItem { local: None, op: RemoteOp::Send }];
                let mut n = 0;
                if let Some((at, seq)) = p.pad {
                    let len = mailbox::encode_pad(seq, out);
                    items[n] = self.write_item(&whole, 0, len, at);
                    n += 1;
                }
                let len = mailbox::encode(p.seq, tag, msg, &mut out[ALIGN..]);
                items[n] = self.write_item(&whole, ALIGN, len, p.at);
                n += 1;
                let posted = transport.post_send(&items[..n], due);
                if matches!(posted, Posted::Ok(_) | Posted::Stuck(..)) {
                    w.commit(&p);
                }
                return posted;
            }
            drop(w);
            if let Some(broken) = transport.broken() {
                return Posted::refused(Error::ConnectionLost { reason: broken });
            }
            if due.is_immediate() {
                return Posted::refused(Error::QueueFull { queue: RING_QUEUE, depth: 0 });
            }
            due.at_from(std::time::Instant::now());
            if due.remaining().is_none() {
                return Posted::refused(due.for_(RING_ROOM).expired());
            }
            spins += 1;
            look_again(spins < 64);
        }
    }

    fn write_item(&self, whole: &LocalParts, off: usize, len: usize, at: usize) -> WorkItem {
        let local = LocalParts { addr: whole.addr + off as u64, len, ..*whole };
        WorkItem { local: Some(local), op: RemoteOp::Write(self.peer.whole().sub((HEADER + at) as u64, len as u64)) }
    }

    /// The read side, locked.
    pub(crate) fn read_side(&self) -> MutexGuard<'_, ReadSide> {
        self.read.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes every record that has landed and files its notification
    /// ([`Notes::file`], with `make_visible`), then gives the peer its
    /// credits back; how many.
    ///
    /// # Errors
    /// The ring's format was broken by the peer: nothing more can be read.
    pub(crate) fn drain(
        &self,
        transport: &ConnTransport,
        side: &mut ReadSide,
        mut make_visible: impl FnMut(&notify::Cover) -> Result<()>,
    ) -> std::result::Result<usize, String> {
        let mut n = 0;
        let ring = Ring(&self.mine);
        let result = loop {
            match side.reader.next(&ring, &mut side.msg) {
                Ok(Some(tag)) => {
                    side.state.file(tag, &side.msg, &mut make_visible);
                    n += 1;
                }
                Ok(None) => break Ok(n),
                Err(mailbox::Broken(why)) => break Err(why),
            }
        };
        self.give_credits(transport, side);
        result
    }

    /// Tells the peer how much of this side's ring it may use again: one
    /// small write of the count taken, from this side's ring header. A full
    /// send queue leaves it for the next drain.
    fn give_credits(&self, transport: &ConnTransport, side: &mut ReadSide) {
        let taken = side.reader.taken();
        if taken == side.returned {
            return;
        }
        self.mine.store(CREDITS_OUT, taken);
        let ring = parts_of(self.mine.region());
        let local = LocalParts { addr: ring.addr + CREDITS_OUT as u64, len: 8, ..ring };
        let item = WorkItem { local: Some(local), op: RemoteOp::Write(self.peer.whole().sub(CREDITS_IN as u64, 8)) };
        match transport.post_send(&[item], Deadline::immediate("room in the send queue")) {
            Posted::Ok(id) | Posted::Stuck(id, _) => {
                // The ring stays registered until the write is done.
                transport.orphan(id, Box::new(self.mine.region().clone()));
                side.returned = taken;
            }
            Posted::Refused(_) => {}
        }
    }
}
