//! A transfer list on staged GPU memory: its pieces go through pinned host
//! slots, copied on the GPU in the list's turn and gathered where small.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::memory::{LocalBuffer, LocalParts, LocalSlice};
use crate::transport::RemoteOp;

use super::*;

impl<B: LocalBuffer> List<B> {
    /// GPU memory: only a direct path (the NIC reaches the memory) is
    /// listed; the producer's fence is waited for before anything is
    /// posted, and a read flushes before it reports success.
    #[cfg(feature = "cuda")]
    pub(super) fn prepare_gpu(&mut self, local: &LocalSlice<B>, parts: LocalParts) -> Result<()> {
        use crate::protocol::{Route, route};
        if parts.path.is_none() {
            // Host memory: only fences the list was given itself
            // (`LocalSlice::after`), looked at before the first post.
            if local.has_own_fences() {
                self.ready = super::super::fences_pending(local.fences());
            }
            return Ok(());
        }
        let Some(cuda) = local.buffer().cuda() else {
            return Err(Error::InvalidArgument("GPU path without a GPU buffer".into()));
        };
        // The producers' fences (outgoing) or the consumers' (incoming), once
        // for the whole list, before any byte moves: on the GPU before each
        // staged piece's copies, looked at before a direct post.
        if route(&parts, self.shared.transport.is_tcp()) == Route::Staged {
            let width = self.shared.staging.1.max(1);
            // Its pieces take effect in the list's turn (taken once planned).
            self.staged = Some(StagedPieces {
                device: cuda.device().clone(),
                active: Vec::new(),
                width,
                progress: Instant::now(),
                fences: local.fences(),
            });
            return Ok(());
        }
        self.ready = super::super::fences_pending(local.fences());
        if self.direction == Direction::Read {
            let device = cuda.device().clone();
            self.after = Some(Box::new(move || device.flush_remote_writes()));
        }
        Ok(())
    }
}

impl<B: Send + 'static> List<B> {
    /// Staged GPU memory: moves the pipelines along, takes the finished
    /// ones, starts more; the notification once every piece is done.
    #[cfg(feature = "cuda")]
    pub(super) fn pump_staged(&mut self) {
        use crate::protocol::staged::{Gather, GatherPiece, ListPiece, Pipeline};
        let Some(mut st) = self.staged.take() else { return };
        // Pieces start in the list's turn at the connection's gate.
        let turn = self.my_turn();
        let shared = Arc::clone(&self.shared);
        let t = &shared.transport;
        let mut error = None;
        let mut i = 0;
        while i < st.active.len() {
            let p = &mut st.active[i];
            if let Err(e) = p.advance(t) {
                // A CUDA failure: what is on the network stays with the connection.
                p.abandon(t, None);
                st.active.swap_remove(i);
                error.get_or_insert(e);
                continue;
            }
            if p.finished() {
                if let Err(e) = p.outcome() {
                    error.get_or_insert(e);
                }
                st.active.swap_remove(i);
                st.progress = Instant::now();
                self.moves += 1;
                continue;
            }
            i += 1;
        }
        let (chunk, depth) = self.shared.staging;
        // Small pieces go in groups: one slot, one copy event and one post
        // (a chain) per group, rather than a pipeline each.
        let small = (chunk / 4).max(4096) as u64;
        let max_group = (self.shared.info.send_queue_depth as usize).clamp(1, 64);
        while turn && error.is_none() && !self.failed && st.active.len() < st.width {
            let mut peek = self.next;
            let Some(p) = self.plan.next(&mut peek) else { break };
            if let (true, Some(turn)) = (p.len <= small && max_group > 1, self.turn) {
                let mut group = Vec::new();
                let mut total = 0u64;
                loop {
                    let mut peek = self.next;
                    match self.plan.next(&mut peek) {
                        Some(q) if q.len <= small && total + q.len <= chunk as u64 && group.len() < max_group => {
                            total += q.len;
                            group.push(GatherPiece {
                                gpu: self.local.addr + q.local,
                                len: q.len as usize,
                                remote: self.remote.sub(q.remote, q.len),
                            });
                            self.next = peek;
                        }
                        _ => break,
                    }
                }
                let write = self.direction == Direction::Write;
                let home = self.shared.ctx.staging();
                let timeout = self.shared.op_timeout;
                let count = group.len();
                let made = Gather::new(
                    write,
                    home,
                    &st.device,
                    group,
                    chunk,
                    st.fences.clone(),
                    &self.shared.gate,
                    turn,
                    timeout,
                );
                match made {
                    Ok(g) => {
                        let mut piece = ListPiece::Many(g);
                        match piece.advance(t) {
                            Ok(()) => st.active.push(piece),
                            Err(e) => {
                                piece.abandon(t, None);
                                error = Some(e);
                            }
                        }
                    }
                    Err(e) => error = Some(e),
                }
                self.done.posts += 1;
                self.done.requests += count;
                st.progress = Instant::now();
                self.moves += 1;
                continue;
            }
            self.next = peek;
            let parts = LocalParts { addr: self.local.addr + p.local, len: p.len as usize, ..self.local };
            let remote = self.remote.sub(p.remote, p.len);
            let op = match self.direction {
                Direction::Write => RemoteOp::Write(remote),
                Direction::Read => RemoteOp::Read(remote),
            };
            let home = self.shared.ctx.staging();
            let made = Pipeline::new(Some(op), home, &st.device, parts, chunk, depth, self.shared.op_timeout);
            match made.map(|mut p| {
                p.after(st.fences.clone());
                match self.turn {
                    Some(turn) => p.in_turn_of(&self.shared.gate, turn),
                    None => p,
                }
            }) {
                Ok(mut pipeline) => {
                    let started = pipeline.advance(t);
                    match started {
                        Ok(()) => st.active.push(ListPiece::One(pipeline)),
                        Err(e) => {
                            pipeline.abandon(t, None);
                            error = Some(e);
                        }
                    }
                }
                Err(e) => error = Some(e),
            }
            self.done.posts += 1;
            self.done.requests += 1;
            st.progress = Instant::now();
            self.moves += 1;
        }
        let idle = st.active.is_empty();
        self.staged = Some(st);
        if let Some(e) = error {
            self.fail(e);
        }
        // After every piece has landed: the pipelines post their writes over
        // time, so the notification waits for all of them to finish.
        if !self.failed && self.plan.done(&self.next) && idle {
            self.post_note(Deadline::immediate("room in the send queue"));
        }
        self.release_turn_if_done();
    }
}
