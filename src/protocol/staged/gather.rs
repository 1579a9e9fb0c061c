//! Small pieces of a staged transfer list, gathered: the pieces of one
//! group share one slot, their copies one event and their network requests
//! one post (a chain), where a pipeline per piece would take a slot, an
//! event and a post each.
//!
//! - write: copy every piece GPU -> its place in the slot (on the group's
//!   own stream, after the list's fences), then post one chain of writes,
//!   each from its place in the slot to its remote range;
//! - read: post one chain of reads into the slot, then copy every piece
//!   slot -> GPU, after the list's fences.
//!
//! A group goes to the network only in its list's turn at the connection's
//! gate, as the list's other pieces do.

use std::sync::Arc;

use crate::cuda::{CudaDevice, CudaEvent, CudaStream, copy_dtoh_async, copy_htod_async};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::memory::RemoteSlice;
use crate::memory::staging::{CopyEvent, Retired, Slot, Stager};
use crate::ops::OpId;
use crate::protocol::order::{Gate, Place};
use crate::transport::{ConnTransport, Posted, RemoteOp, WorkItem};

/// One piece of a group: its GPU address, its place in the slot, its
/// length and where it goes (or comes from) at the peer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GatherPiece {
    pub gpu: u64,
    pub len: usize,
    pub remote: RemoteSlice,
}

enum GroupState {
    /// Waiting for the list's turn.
    Idle,
    /// Copying every piece out of the GPU.
    CopyOut(CopyEvent),
    /// The chain on the network.
    Net(OpId),
    /// Copying every piece into the GPU.
    CopyIn(CopyEvent),
    Done,
}

/// A group of small pieces in flight (see the module documentation).
pub(crate) struct Gather {
    stager: Arc<Stager>,
    domain_id: u64,
    write: bool,
    pieces: Vec<GatherPiece>,
    len: usize,
    chunk: usize,
    slot: Option<Slot>,
    stream: Option<CudaStream>,
    fences: Vec<Arc<CudaEvent>>,
    gate: Arc<Gate>,
    turn: Place,
    state: GroupState,
    error: Option<Error>,
    post_timeout: std::time::Duration,
}

impl Gather {
    /// A group of `pieces` of one list, moved in the list's `turn`, its
    /// copies after `fences`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        write: bool,
        home: &super::StagingHome,
        device: &CudaDevice,
        pieces: Vec<GatherPiece>,
        chunk: usize,
        fences: Vec<Arc<CudaEvent>>,
        gate: &Arc<Gate>,
        turn: Place,
        post_timeout: std::time::Duration,
    ) -> Result<Gather> {
        let stager = Stager::for_device(home, device)?;
        let stream = Some(stager.stream()?);
        let len = pieces.iter().map(|p| p.len).sum();
        Ok(Gather {
            stager,
            domain_id: home.domain_id,
            write,
            pieces,
            len,
            chunk,
            slot: None,
            stream,
            fences,
            gate: Arc::clone(gate),
            turn,
            state: GroupState::Idle,
            error: None,
            post_timeout,
        })
    }

    /// Its stream, with the fences queued ahead of its first copy.
    fn copy_stream(&mut self) -> Result<&CudaStream> {
        let stream =
            self.stream.as_ref().ok_or_else(|| Error::InvalidArgument("a gathered copy with no stream".into()))?;
        for f in self.fences.drain(..) {
            stream.wait_event(&f)?;
        }
        Ok(stream)
    }

    /// Copies every piece between the GPU and its place in the slot (out
    /// of the GPU for a write), and records their end.
    fn copy_all(&mut self, out: bool) -> Result<CopyEvent> {
        let base = self.slot.as_ref().map_or(0, Slot::addr);
        let stager = Arc::clone(&self.stager);
        let pieces = std::mem::take(&mut self.pieces);
        let copied = (|| {
            let stream = self.copy_stream()?;
            let mut at = 0usize;
            for p in &pieces {
                let host = base + at as u64;
                if out {
                    // SAFETY: `host..host + len` lies in the slot this group owns
                    // (sized for all its pieces), `gpu..gpu + len` inside the list's
                    // buffer, owned by the list; both stay until the copy's event is
                    // done (a group given up retires them with it).
                    unsafe { copy_dtoh_async(host as *mut u8, p.gpu, p.len, stream) }?;
                } else {
                    // SAFETY: as above, the other way round.
                    unsafe { copy_htod_async(p.gpu, host as *const u8, p.len, stream) }?;
                }
                at += p.len;
            }
            stager.record(stream)
        })();
        self.pieces = pieces;
        copied
    }

    /// Posts the chain: each piece's request between its place in the slot
    /// and its remote range.
    fn post(&mut self, t: &ConnTransport) -> Result<OpId> {
        let slot = self.slot.as_ref().ok_or_else(|| Error::InvalidArgument("a gathered post with no slot".into()))?;
        let mut at = 0usize;
        let items: Vec<WorkItem> = self
            .pieces
            .iter()
            .map(|p| {
                let mut local = slot.parts(p.len, self.domain_id);
                local.addr += at as u64;
                at += p.len;
                let op = if self.write { RemoteOp::Write(p.remote) } else { RemoteOp::Read(p.remote) };
                WorkItem { local: Some(local), op }
            })
            .collect();
        match t.post_send(&items, Deadline::lazy(self.post_timeout, "room in the send queue")) {
            Posted::Ok(id) => Ok(id),
            Posted::Refused(e) => Err(*e),
            Posted::Stuck(id, e) => {
                // Part of it may still reach the slot: the connection keeps it.
                if let Some(slot) = self.slot.take() {
                    t.orphan(id, Box::new(slot));
                }
                Err(*e)
            }
        }
    }

    /// Moves it along without blocking.
    pub(crate) fn advance(&mut self, t: &ConnTransport) -> Result<()> {
        if self.error.is_some() {
            return Ok(());
        }
        let step = self.step(t);
        if let Err(e) = step {
            self.state = GroupState::Done;
            self.error = Some(e);
        }
        Ok(())
    }

    fn step(&mut self, t: &ConnTransport) -> Result<()> {
        loop {
            match &self.state {
                GroupState::Idle => {
                    if !self.gate.is_first(self.turn) {
                        return Ok(());
                    }
                    self.slot = Some(self.stager.take(self.len, self.chunk)?);
                    if self.write {
                        self.state = GroupState::CopyOut(self.copy_all(true)?);
                    } else {
                        self.state = GroupState::Net(self.post(t)?);
                    }
                }
                GroupState::CopyOut(ev) => {
                    if !ev.is_done()? {
                        return Ok(());
                    }
                    self.state = GroupState::Net(self.post(t)?);
                }
                GroupState::Net(id) => {
                    let id = *id;
                    if !t.poll(id)? {
                        return Ok(());
                    }
                    match t.take(id) {
                        None => return Ok(()),
                        Some(Err(e)) => return Err(*e),
                        Some(Ok(_)) if self.write => {
                            self.slot = None;
                            self.state = GroupState::Done;
                        }
                        Some(Ok(_)) => self.state = GroupState::CopyIn(self.copy_all(false)?),
                    }
                }
                GroupState::CopyIn(ev) => {
                    if !ev.is_done()? {
                        return Ok(());
                    }
                    self.slot = None;
                    self.state = GroupState::Done;
                }
                GroupState::Done => return Ok(()),
            }
        }
    }

    /// Whether nothing of it is left in flight.
    pub(crate) fn finished(&self) -> bool {
        matches!(self.state, GroupState::Done)
    }

    /// Whether every request it makes was handed to the transport (or none
    /// will be: it failed).
    pub(crate) fn all_posted(&self) -> bool {
        self.error.is_some() || matches!(self.state, GroupState::Net(_) | GroupState::CopyIn(_) | GroupState::Done)
    }

    /// Whether a copy is in flight (no completion signals its end).
    pub(crate) fn copying(&self) -> bool {
        matches!(self.state, GroupState::CopyOut(_) | GroupState::CopyIn(_))
    }

    /// The chain on the network, to sleep on.
    pub(crate) fn waiting_on(&self) -> Option<OpId> {
        match self.state {
            GroupState::Net(id) => Some(id),
            _ => None,
        }
    }

    /// Its error, once finished.
    pub(crate) fn outcome(&mut self) -> Result<()> {
        self.error.take().map_or(Ok(()), Err)
    }

    /// Given up: as [`Pipeline::abandon`](super::Pipeline::abandon), a
    /// chain on the network keeps the slot with the connection; copies in
    /// flight are retired with `keep` (or waited for on its own stream
    /// without it).
    pub(crate) fn abandon(&mut self, t: &ConnTransport, keep: Option<Box<dyn std::any::Any + Send>>) {
        let state = std::mem::replace(&mut self.state, GroupState::Done);
        let stream = self.stream.take();
        match state {
            GroupState::Net(id) => {
                if let Some(slot) = self.slot.take() {
                    t.orphan(id, Box::new(slot));
                }
                stream.into_iter().for_each(|s| self.stager.give_back(s));
            }
            GroupState::CopyOut(ev) | GroupState::CopyIn(ev) => {
                if keep.is_none() {
                    if let Some(s) = &stream {
                        if let Err(e) = s.synchronize() {
                            tracing::error!("waiting for a failed gathered group's copies: {e}");
                        }
                    }
                }
                let slots = self.slot.take().into_iter().collect();
                self.stager.retire(Retired { events: vec![ev], slots, stream, _keep: keep });
            }
            GroupState::Idle | GroupState::Done => stream.into_iter().for_each(|s| self.stager.give_back(s)),
        }
    }
}

impl Drop for Gather {
    fn drop(&mut self) {
        if let Some(stream) = self.stream.take() {
            match std::mem::replace(&mut self.state, GroupState::Done) {
                // Dropped with copies in flight: retired rather than waited for.
                GroupState::CopyOut(ev) | GroupState::CopyIn(ev) => {
                    let slots = self.slot.take().into_iter().collect();
                    self.stager.retire(Retired { events: vec![ev], slots, stream: Some(stream), _keep: None });
                }
                _ => self.stager.give_back(stream),
            }
        }
    }
}
