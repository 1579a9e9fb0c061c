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
use crate::protocol::context::OpContext;
use crate::protocol::mailbox::{
    self, ALIGN, CREDITS_IN, CREDITS_OUT, HEADER, MAX_RECORD, RingMemory, RingReader, RingWriter,
};
use crate::protocol::notify::{self, NotifyStatus};
use crate::transport::covers::{CoverPost, ImmCovers};
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
                    // Taken by the drain before filing (see `NoteRings::drain`).
                    (NotifyStatus::Cover, _) => return,
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

/// One pause of a post waiting for room in the peer's ring (the peer
/// returns credits as it takes what it holds), or why it waits no more:
/// the connection broke, `due` is immediate (a try-post), or it passed.
fn wait_for_room(due: &mut Deadline, spins: &mut u32, broken: &dyn Fn() -> Option<String>) -> Result<()> {
    if let Some(reason) = broken() {
        return Err(Error::ConnectionLost { reason });
    }
    if due.is_immediate() {
        return Err(Error::QueueFull { queue: RING_QUEUE, depth: 0 });
    }
    due.at_from(std::time::Instant::now());
    if due.remaining().is_none() {
        return Err(due.for_(RING_ROOM).expired());
    }
    *spins += 1;
    look_again(*spins < 64);
    Ok(())
}

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
    /// Bytes taken before credits go back: the peer always keeps room for
    /// the largest notification (a pad and a record) once this side has
    /// taken what it wrote, and one small write returns many records.
    lazy: u64,
    /// Scratch for one record's notification.
    msg: Vec<u8>,
    pub state: Notes,
    /// The peer's covers of its writes with immediate (where this side
    /// asked for them), taken from the ring and not yet made visible.
    covers: CoversIn,
}

/// The covers this side takes from its ring: each names what one of the
/// peer's writes with immediate wrote, in the order they were posted. One
/// is made visible once that write's receive completion was polled (its
/// ordinal at most the count of such completions), not before: its record
/// lands before its data.
struct CoversIn {
    /// Whether this side asked for covers.
    expected: bool,
    /// Taken, not yet made visible: ordinal and cover.
    queue: VecDeque<(u64, notify::Cover)>,
    /// The last ordinal taken.
    last: u64,
    /// How many may wait at most: one per receive that can be posted, and
    /// one whose write waits for a receive (more is a peer that lies).
    bound: usize,
}

/// What this side writes into the peer's ring: notifications, and covers
/// of its writes with immediate where the peer asked for them.
struct WriteSide {
    ring: RingWriter,
    covers: Option<CoversOut>,
}

/// Where covers go out from: a registered buffer of `slots` slots, each a
/// pad header and a cover record; the slot of the cover with ordinal `k` is
/// `k % slots`. With as many slots as the send queue has requests, a slot is
/// written again only once the request that read it has left the queue:
/// between the two covers stand at least `slots` more covers and their
/// writes, more than the queue holds.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
struct CoversOut {
    buf: Region<HostMemory>,
    slots: u64,
    /// Covers posted so far (the last ordinal).
    posted: u64,
    /// Scratch for one cover's message.
    msg: Vec<u8>,
}

/// Bytes of one cover slot: a pad header, then the record at [`ALIGN`].
const COVER_SLOT: usize = 2 * ALIGN;

const _: () = assert!(mailbox::record_size(notify::HEADER + 16 + notify::COVER_PAYLOAD) <= ALIGN);

/// Both rings of one connection.
pub(crate) struct NoteRings {
    mine: PeerWritten,
    peer: RemoteRegion,
    /// This side asked the peer to cover its writes with immediate.
    covers_in: bool,
    writer: Mutex<WriteSide>,
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
    /// the handshake announced it (checked there). `covers_in`: this side
    /// asked the peer to cover its writes with immediate, of which at most
    /// `recv_depth` take receives at once.
    pub(crate) fn new(mine: Exposed<HostMemory>, peer: RemoteRegion, covers_in: bool, recv_depth: u32) -> Self {
        let mine_cap = mine.len() - HEADER;
        let peer_cap = peer.len as usize - HEADER;
        NoteRings {
            mine: PeerWritten::new(mine),
            peer,
            covers_in,
            writer: Mutex::new(WriteSide { ring: RingWriter::new(peer_cap), covers: None }),
            read: Mutex::new(ReadSide {
                reader: RingReader::new(mine_cap),
                returned: 0,
                lazy: (mine_cap / 2).min(mine_cap.saturating_sub(2 * MAX_RECORD)) as u64,
                msg: Vec::new(),
                state: Notes::default(),
                covers: CoversIn {
                    expected: covers_in,
                    queue: VecDeque::new(),
                    last: 0,
                    bound: recv_depth as usize * 2 + 16,
                },
            }),
        }
    }

    /// Whether this side asked the peer to cover its writes with immediate.
    pub(crate) fn covers_expected(&self) -> bool {
        self.covers_in
    }

    /// Covers this side's writes with immediate from now on (the peer
    /// asked for it), from `slots` slots of a buffer registered in `ctx`
    /// (the send queue's depth).
    pub(crate) fn cover_out(&self, ctx: &OpContext, slots: u32) -> Result<()> {
        let slots = slots.max(1);
        let mut buf = ctx.alloc(slots as usize * COVER_SLOT)?;
        // The connection's, not the user's: not in the domain's stats.
        buf.count_as_internal();
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        w.covers = Some(CoversOut { buf, slots: u64::from(slots), posted: 0, msg: Vec::new() });
        Ok(())
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
            let mut guard = self.writer.lock().unwrap_or_else(|e| e.into_inner());
            let w = &mut guard.ring;
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
            drop(guard);
            if let Err(e) = wait_for_room(&mut due, &mut spins, &|| transport.broken()) {
                return Posted::refused(e);
            }
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

    /// Takes every record that has landed: files its notification
    /// ([`Notes::file`], with `make_visible`), or keeps a cover; then makes
    /// the covers of the writes with immediate received so far visible and
    /// gives the peer its credits back. How many notifications.
    ///
    /// # Errors
    /// Why nothing more can be trusted on this connection: the peer broke
    /// the ring's format, or sent covers no writer sends, or a write with
    /// immediate could not be made visible.
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
                Ok(Some(tag)) => match notify::decode(&side.msg) {
                    Ok(d) if d.status == NotifyStatus::Cover => {
                        if let Err(why) = side.covers.take(&d, &mut side.state.stats) {
                            break Err(why);
                        }
                    }
                    _ => {
                        side.state.file(tag, &side.msg, &mut make_visible);
                        n += 1;
                    }
                },
                Ok(None) => break Ok(n),
                Err(mailbox::Broken(why)) => break Err(format!("the peer broke the notification ring: {why}")),
            }
        };
        let result =
            result.and_then(|n| side.covers.make_visible(transport.imm_writes_seen(), make_visible).map(|()| n));
        self.give_credits(transport, side);
        result
    }

    /// Tells the peer how much of this side's ring it may use again: one
    /// small write of the count taken, from this side's ring header, once
    /// [`ReadSide::lazy`] bytes were taken since the last. A full send queue
    /// leaves it for the next drain.
    fn give_credits(&self, transport: &ConnTransport, side: &mut ReadSide) {
        let taken = side.reader.taken();
        if taken - side.returned < side.lazy.max(1) {
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

impl CoversIn {
    /// Keeps the cover `d` (decoded from the ring), in order.
    fn take(&mut self, d: &notify::Decoded<'_>, stats: &mut InboxStats) -> std::result::Result<(), String> {
        let ordinal = notify::cover_ordinal(d);
        match ordinal {
            _ if !self.expected => {
                stats.malformed += 1;
                tracing::warn!("a cover of a write with immediate, which this side did not ask for: dropped");
                Ok(())
            }
            Some(k) if k == self.last + 1 && self.queue.len() < self.bound => {
                self.queue.push_back((k, d.cover.clone()));
                self.last = k;
                Ok(())
            }
            Some(k) if k == self.last + 1 => Err(format!(
                "the peer sent {} covers of writes with immediate not received yet; at most {} can be",
                self.queue.len() + 1,
                self.bound
            )),
            Some(k) => Err(format!("the peer sent cover {k} of a write with immediate after cover {}", self.last)),
            None => Err("the peer sent a cover of a write with immediate without its ordinal".to_owned()),
        }
    }

    /// Makes the covers of the first `seen` writes with immediate visible.
    fn make_visible(
        &mut self,
        seen: u64,
        mut make_visible: impl FnMut(&notify::Cover) -> Result<()>,
    ) -> std::result::Result<(), String> {
        while self.queue.front().is_some_and(|&(k, _)| k <= seen) {
            let Some((_, cover)) = self.queue.pop_front() else { break };
            make_visible(&cover).map_err(|e| format!("a write with immediate could not be made visible here: {e}"))?;
        }
        Ok(())
    }
}

/// The connection's side of [`ImmCovers`]: the records go into the peer's
/// ring, from this side's cover slots, placed under the ring writer's lock
/// (which also orders the notifications).
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
pub(crate) struct RingCovers(pub(crate) std::sync::Arc<NoteRings>);

impl ImmCovers for RingCovers {
    fn begin(&self) -> Box<dyn CoverPost + '_> {
        let w = self.0.writer.lock().unwrap_or_else(|e| e.into_inner());
        let ring = w.ring.clone();
        Box::new(CoverBatch { rings: &self.0, w, ring, placed: 0 })
    }
}

/// The covers of one post, placed on a copy of the ring writer until the
/// post went out.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
struct CoverBatch<'a> {
    rings: &'a NoteRings,
    w: MutexGuard<'a, WriteSide>,
    ring: RingWriter,
    placed: u64,
}

impl CoverPost for CoverBatch<'_> {
    fn place(
        &mut self,
        range: crate::remote::RemoteSlice,
        due: &mut Deadline,
        broken: &dyn Fn() -> Option<String>,
        out: &mut Vec<WorkItem>,
    ) -> Result<()> {
        let Some(c) = self.w.covers.as_mut() else {
            return Err(Error::InvalidArgument("covers asked of a connection without cover slots".into()));
        };
        let ordinal = c.posted + self.placed + 1;
        notify::encode_cover(ordinal, range.rkey(), range.addr(), range.len(), &mut c.msg);
        let mut spins = 0u32;
        let p = loop {
            if let Some(p) = self.ring.place(c.msg.len(), self.rings.mine.load(CREDITS_IN)) {
                break p;
            }
            wait_for_room(due, &mut spins, broken)?;
        };
        let base = (ordinal % c.slots) as usize * COVER_SLOT;
        let whole = parts_of(&c.buf);
        let slot = &mut c.buf.as_mut_slice()[base..base + COVER_SLOT];
        if let Some((at, seq)) = p.pad {
            let len = mailbox::encode_pad(seq, slot);
            out.push(self.rings.write_item(&whole, base, len, at));
        }
        let len = mailbox::encode(p.seq, 0, &c.msg, &mut slot[ALIGN..]);
        out.push(self.rings.write_item(&whole, base + ALIGN, len, p.at));
        self.ring.commit(&p);
        self.placed += 1;
        Ok(())
    }

    fn commit(&mut self) {
        self.w.ring = self.ring.clone();
        if let Some(c) = self.w.covers.as_mut() {
            c.posted += self.placed;
        }
        self.placed = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn covers(expected: bool) -> CoversIn {
        CoversIn { expected, queue: VecDeque::new(), last: 0, bound: 4 }
    }

    fn cover_msg(ordinal: u64, addr: u64) -> Vec<u8> {
        let mut msg = Vec::new();
        notify::encode_cover(ordinal, 7, addr, 64, &mut msg);
        msg
    }

    /// Takes the cover record `msg` as the drain does.
    fn take(c: &mut CoversIn, msg: &[u8], stats: &mut InboxStats) -> std::result::Result<(), String> {
        c.take(&notify::decode(msg).expect("a cover decodes"), stats)
    }

    #[test]
    fn a_cover_is_made_visible_only_once_its_write_was_received() {
        let mut c = covers(true);
        let mut stats = InboxStats::default();
        for k in 1..=3 {
            take(&mut c, &cover_msg(k, k * 100), &mut stats).unwrap();
        }
        let mut seen = Vec::new();
        // One write received: only its cover; the later ones landed ahead of their data.
        c.make_visible(1, |cv| {
            seen.push(cv.ranges[0].0);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, [100]);
        c.make_visible(3, |cv| {
            seen.push(cv.ranges[0].0);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, [100, 200, 300], "in order, each once");
        c.make_visible(9, |_| panic!("nothing is left")).unwrap();
        // A copy that fails says so (the connection then breaks).
        take(&mut c, &cover_msg(4, 400), &mut stats).unwrap();
        let err = c.make_visible(4, |_| Err(Error::InvalidArgument("no GPU".into()))).unwrap_err();
        assert!(err.contains("could not be made visible") && err.contains("no GPU"), "{err}");
    }

    #[test]
    fn a_peer_that_lies_about_covers_is_refused_and_one_nobody_asked_for_is_dropped() {
        let mut stats = InboxStats::default();
        // Not asked for: counted, dropped, nothing kept.
        let mut c = covers(false);
        take(&mut c, &cover_msg(1, 0), &mut stats).unwrap();
        assert_eq!((stats.malformed, c.queue.len()), (1, 0));
        // Out of order, repeated, or without an ordinal: refused.
        let mut c = covers(true);
        assert!(take(&mut c, &cover_msg(2, 0), &mut stats).unwrap_err().contains("cover 2"));
        take(&mut c, &cover_msg(1, 0), &mut stats).unwrap();
        assert!(take(&mut c, &cover_msg(1, 0), &mut stats).is_err(), "a repeat");
        let mut no_ordinal = Vec::new();
        notify::encode(NotifyStatus::Cover, &notify::Cover { key: 7, ranges: vec![(0, 64)] }, b"x", &mut no_ordinal);
        assert!(take(&mut c, &no_ordinal, &mut stats).unwrap_err().contains("ordinal"));
        // More than can be in flight: refused, the memory stays bounded.
        for k in 2..=4 {
            take(&mut c, &cover_msg(k, 0), &mut stats).unwrap();
        }
        let err = take(&mut c, &cover_msg(5, 0), &mut stats).unwrap_err();
        assert!(err.contains("at most 4"), "{err}");
        assert_eq!(c.queue.len(), 4);
    }
}
