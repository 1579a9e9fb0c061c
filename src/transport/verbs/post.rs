//! Posting on a verbs connection: planning items into requests, room in
//! the send queue, single and chained requests, inline and quiet sends,
//! covers for writes with immediate, receives.

use super::*;

impl VerbsConn {
    /// Splits the items into send-queue requests, checking each; returns
    /// the bytes they move.
    fn plan(
        &self,
        q: &QueueCore,
        items: &[WorkItem],
        scratch: &mut Vec<(SendOp, usize, bool)>,
        sges: &mut Vec<Sge>,
    ) -> Result<u64> {
        scratch.clear();
        sges.clear();
        let max_message = q.limits().max_message;
        let mut bytes = 0;
        for item in items {
            let len = q.check_item(item)?;
            bytes += len;
            let (addr, lkey) = item.local.as_ref().map_or((0, 0), |l| (l.addr, l.lkey));
            // Writes and reads longer than a message are split; the rest is
            // one message (`check_item` held them to the limit).
            let chunks = match item.op {
                RemoteOp::Write(_) | RemoteOp::Read(_) => len.div_ceil(max_message).max(1),
                RemoteOp::Send | RemoteOp::SendWithImm(_) | RemoteOp::WriteWithImm(..) => 1,
            };
            for c in 0..chunks {
                let off = c * max_message;
                let n = (len - off).min(max_message);
                let op = send_op(item.op, off);
                let inline = self.goes_inline(item.local.as_ref(), n, op);
                if n > 0 {
                    scratch.push((op, sges.len(), inline));
                    sges.push(Sge::new(addr + off, n as u32, lkey));
                } else {
                    scratch.push((op, usize::MAX, false));
                }
            }
        }
        Ok(bytes)
    }

    /// Waits until `n` send-queue requests fit (driving progress), up to `due`.
    #[inline(always)]
    fn send_room<'a>(&'a self, st: Locked<'a>, n: u32, due: &mut Deadline) -> Result<Locked<'a>> {
        if st.q.send_room(n)? {
            return Ok(st);
        }
        self.send_room_slow(st, n, due)
    }

    /// [`send_room`](Self::send_room) when the queue is full: waits for completions.
    #[inline(never)]
    fn send_room_slow<'a>(&'a self, mut st: Locked<'a>, n: u32, due: &mut Deadline) -> Result<Locked<'a>> {
        loop {
            if st.q.send_room(n)? {
                return Ok(st);
            }
            if st.q.quiet_waiting() > 0 && st.q.send_room(1)? {
                // Quiet sends hold credits that only a signaled request
                // brings back: post one, or the wait could be for nothing.
                self.post_flush(&mut st)?;
                continue;
            }
            if due.is_immediate() {
                // A try-post: one look at the completions, no waiting.
                self.progress(&mut st)?;
                return if st.q.send_room(n)? { Ok(st) } else { Err(st.q.send_full()) };
            }
            drop(st);
            let room = |s: &mut VerbsState| s.q.send_room(n).unwrap_or(true);
            if !self.wait_until(due, room)? {
                return Err(self.lock().q.send_full());
            }
            st = self.lock();
        }
    }

    /// Whether `n` bytes of `item`'s buffer go inline as request `op`.
    /// Inline data is copied by the CPU at post time (the provider memcpy's
    /// from the address): only host memory may go inline (GPU memory is never
    /// CPU-readable through its device address), and never a read's
    /// destination.
    fn goes_inline(&self, local: Option<&LocalParts>, n: u64, op: SendOp) -> bool {
        let cpu_readable = local.is_none_or(|l| l.path.is_none());
        cpu_readable && n > 0 && n <= u64::from(self.max_inline) && !op.writes_local()
    }

    /// One operation of one message (the common case): checked and posted
    /// as a single request built on the stack, with no plan. `None` when it
    /// must be split (a write or read longer than a message). With `quiet`,
    /// a send goes unsignaled unless the moderation says signal (see
    /// [`QueueCore::must_signal`]).
    fn post_single(&self, item: &WorkItem, due: &mut Deadline, quiet: bool) -> Option<PostedInline> {
        if let (Some(local), RemoteOp::Send | RemoteOp::SendWithImm(_)) = (&item.local, item.op) {
            return Some(self.post_one_send(local, item.op, due, quiet));
        }
        let refused = |e| Some(PostedInline::Tracked(Posted::refused(e)));
        let st = self.lock();
        let len = match st.q.check_item(item) {
            Ok(len) => len,
            Err(e) => return refused(e),
        };
        if len > st.q.limits().max_message {
            return None;
        }
        let (addr, lkey) = item.local.as_ref().map_or((0, 0), |l| (l.addr, l.lkey));
        let op = send_op(item.op, 0);
        let inline = self.goes_inline(item.local.as_ref(), len, op);
        Some(self.post_prepared(st, due, quiet, op, item.op.opcode(), Sge::new(addr, len as u32, lkey), inline))
    }

    /// [`post_single`](Self::post_single) for the commonest request: a
    /// send (with or without an immediate) of one registered buffer, with
    /// only the checks a send needs (the buffer's domain, one message).
    #[inline(always)]
    fn post_one_send(&self, local: &LocalParts, op: RemoteOp, due: &mut Deadline, quiet: bool) -> PostedInline {
        let len = local.len as u64;
        let st = self.lock();
        if !st.q.is_local(local) || len > st.q.limits().max_message {
            return PostedInline::Tracked(Posted::refused(Self::send_buffer_refused(&st.q, local, op)));
        }
        let (send, opcode) = match op {
            RemoteOp::SendWithImm(imm) => (SendOp::SendWithImm(imm), Opcode::SendWithImm),
            _ => (SendOp::Send, Opcode::Send),
        };
        let inline = self.goes_inline(Some(local), len, send);
        self.post_prepared(st, due, quiet, send, opcode, Sge::new(local.addr, len as u32, local.lkey), inline)
    }

    /// Why a send of `local` is refused: another domain's buffer, or longer
    /// than a message (the errors of [`QueueCore::check_item`]).
    #[cold]
    #[inline(never)]
    fn send_buffer_refused(q: &QueueCore, local: &LocalParts, op: RemoteOp) -> Error {
        match q.check_item(&WorkItem { local: Some(*local), op }) {
            Err(e) => e,
            Ok(len) => Error::MessageTooLarge { len, max: q.limits().max_message },
        }
    }

    /// Posts one checked request of at most one message: room in the send
    /// queue, quiet (unsignaled) if asked and the moderation allows, then
    /// the request itself, built in place. An empty `sge` posts none; an
    /// `inline` one is copied at post time (from a registered buffer or a
    /// caller's slice alike).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn post_prepared(
        &self,
        st: Locked<'_>,
        due: &mut Deadline,
        quiet: bool,
        op: SendOp,
        opcode: Opcode,
        sge: Sge,
        inline: bool,
    ) -> PostedInline {
        let mut st = match self.send_room(st, 1, due) {
            Ok(st) => st,
            Err(e) => return PostedInline::Tracked(Posted::refused(e)),
        };
        let len = sge.len();
        let (posted, wr_id, signaled) = if quiet && !st.q.must_signal() {
            let q = st.q.start_quiet(opcode, len, inline || len == 0);
            (PostedInline::Quiet(q), quiet_wr_id(q.seq), false)
        } else {
            let id = st.q.start_send(opcode, 1, u64::from(len));
            (PostedInline::Tracked(Posted::Ok(id)), id.wr_id(true), true)
        };
        let qp = st.qp.as_mut().expect("the queue pair lives as long as the connection");
        // SAFETY: as in `post_send`: an entry that does not go inline names
        // a checked range of a registered buffer of this domain, owned by the
        // caller's `Pending` (or, once that is dropped, by the table, or by
        // the queue core's quiet orphans) until this request completes or
        // the queue pair is destroyed. An inline entry (within the limit,
        // which `post_send_sge` checks) is copied during the call, from
        // memory the caller's borrow keeps valid until it returns.
        match unsafe { qp.post_send_sge(wr_id, op, (len > 0).then_some(sge), inline, signaled) } {
            Ok(()) => posted,
            Err(e) => Self::post_refused(&mut st, posted, e.error),
        }
    }

    /// Posts one operation that may go unsignaled (a send; see
    /// [`post_single`](Self::post_single)); one that must be split is
    /// posted tracked.
    pub(crate) fn post_send_quiet(&self, item: &WorkItem, mut due: Deadline) -> PostedInline {
        match self.post_single(item, &mut due, true) {
            Some(posted) => posted,
            None => PostedInline::Tracked(self.post_send(std::slice::from_ref(item), due)),
        }
    }

    /// [`post_send_quiet`](Self::post_send_quiet) for a send of one
    /// buffer, straight to the one path such a send takes. Not inlined: a
    /// persistent round that posts a receive keeps its own short frame.
    #[inline(never)]
    pub(crate) fn post_quiet_send(&self, local: &LocalParts, mut due: Deadline) -> PostedInline {
        self.post_one_send(local, RemoteOp::Send, &mut due, true)
    }

    pub(crate) fn post_send(&self, items: &[WorkItem], mut due: Deadline) -> Posted {
        if self.covers.get().is_some() && crate::transport::covers::any_imm_write(items) {
            return self.post_covered(items, due, None);
        }
        if let [item] = items {
            match self.post_single(item, &mut due, false) {
                Some(PostedInline::Tracked(posted)) => return posted,
                // Asked for a tracked request, it posts no quiet one.
                Some(PostedInline::Quiet(_)) => unreachable!("a tracked request was posted quiet"),
                None => {}
            }
        }
        self.post_chain(items, due, 0)
    }

    /// Covers this side's writes with immediate from now on (see
    /// [`super::covers`]). Set once, before the connection is handed out.
    pub(crate) fn cover_writes(&self, covers: Box<dyn crate::transport::covers::ImmCovers>) {
        if self.covers.set(covers).is_err() {
            tracing::warn!("a connection's covers were set twice: the first stays");
        }
    }

    /// Writes with immediate received successfully so far.
    pub(crate) fn imm_writes_seen(&self) -> u64 {
        self.lock().imm_writes
    }

    /// Counts the writes with immediate received from now on (this side
    /// asked the peer for covers). Set before the connection is handed out.
    pub(crate) fn count_imm_writes(&self) {
        self.lock().count_imm = true;
    }

    /// Posts `items` with each write with immediate behind its cover record
    /// (naming `whole`, when given, else its own range), all in one chain,
    /// made while the covers keep their order. The records' bytes are not
    /// counted in the operation's.
    #[cold]
    #[inline(never)]
    pub(crate) fn post_covered(
        &self,
        items: &[WorkItem],
        mut due: Deadline,
        whole: Option<crate::remote::RemoteSlice>,
    ) -> Posted {
        // Callers post a write with immediate (`post_send` looked; the
        // staged path's last piece is one).
        let Some(covers) = self.covers.get() else {
            return self.post_send(items, due);
        };
        let mut post = covers.begin();
        let mut chain = Vec::with_capacity(items.len() + 2);
        let mut records = 0u64;
        let broken = || self.broken();
        for item in items {
            if let RemoteOp::WriteWithImm(range, _) = item.op {
                let before = chain.len();
                if let Err(e) = post.place(whole.unwrap_or(range), &mut due, &broken, &mut chain) {
                    return Posted::refused(e);
                }
                records += chain[before..].iter().filter_map(|i| i.local.map(|l| l.len as u64)).sum::<u64>();
            }
            chain.push(*item);
        }
        let posted = self.post_chain(&chain, due, records);
        if matches!(posted, Posted::Ok(_) | Posted::Stuck(..)) {
            post.commit();
        }
        posted
    }

    /// Posts `items` as one chain of requests, signaled at its end; the
    /// operation moves their bytes less `uncounted` (cover records).
    fn post_chain(&self, items: &[WorkItem], mut due: Deadline, uncounted: u64) -> Posted {
        let Some(last) = items.last() else {
            return Posted::refused(Error::EmptyBatch);
        };
        let opcode = last.op.opcode();
        let mut st = self.lock();
        // Planned once, outside the wait for room: the plan depends only on
        // the items and the connection's fixed limits.
        let (mut scratch, mut sges) = (std::mem::take(&mut st.scratch), std::mem::take(&mut st.sges));
        let planned = self.plan(&st.q, items, &mut scratch, &mut sges);
        let n = u32::try_from(scratch.len()).unwrap_or(u32::MAX);
        let room = planned.and_then(|bytes| self.send_room(st, n, &mut due).map(|st| (st, bytes)));
        let (mut st, bytes) = match room {
            Ok(ok) => ok,
            Err(e) => {
                let mut st = self.lock();
                st.scratch = scratch;
                st.sges = sges;
                return Posted::refused(e);
            }
        };
        let id = st.q.start_send(opcode, n, bytes - uncounted);
        let outcome = {
            let count = scratch.len();
            let wrs = scratch.iter().enumerate().map(|(i, &(op, sge, inline))| {
                let list: &[Sge] = if sge == usize::MAX { &[] } else { &sges[sge..sge + 1] };
                let last = i + 1 == count;
                SendWr::new(id.wr_id(last), op, list).signaled(last).inline(inline)
            });
            let qp = st.qp.as_mut().expect("the queue pair lives as long as the connection");
            // SAFETY: every scatter/gather entry names a range of a registered
            // buffer (checked against its length by `LocalSlice::resolve`, with
            // its lkey, in this connection's domain) that the caller's
            // `Pending` owns until this operation's final request completes;
            // if the `Pending` is dropped first, the buffer moves into the
            // table as an orphan and is dropped only at that completion or
            // after the queue pair is destroyed.
            unsafe { qp.post_send(wrs) }
        };
        st.scratch = scratch;
        st.sges = sges;
        match outcome {
            Ok(()) => Posted::Ok(id),
            Err(e) if e.posted == 0 => {
                st.q.abort(id);
                Posted::refused(e.error)
            }
            Err(e) => {
                // Part of the chain is on the wire without a signaled request
                // behind it: break the connection so it flushes, and keep
                // the buffer until teardown.
                let reason = format!("posting failed part-way: {}", e.error);
                st.q.lose(|| reason.clone());
                if let Some(qp) = st.qp.as_mut() {
                    let _ = qp.set_error();
                }
                Posted::Stuck(id, Box::new(Error::ConnectionLost { reason }))
            }
        }
    }

    /// Posts `data` inline as a send. With `quiet`, the send goes
    /// unsignaled unless the moderation says signal (see
    /// [`QueueCore::must_signal`]); its outcome then follows from later
    /// requests' completions.
    #[inline(always)]
    pub(crate) fn post_inline(&self, data: &[u8], imm: Option<u32>, mut due: Deadline, quiet: bool) -> PostedInline {
        let refused = |e| PostedInline::Tracked(Posted::refused(e));
        if data.len() as u64 > u64::from(self.max_inline) {
            return refused(Error::MessageTooLarge { len: data.len() as u64, max: u64::from(self.max_inline) });
        }
        let (op, opcode) = match imm {
            Some(imm) => (SendOp::SendWithImm(imm), Opcode::SendWithImm),
            None => (SendOp::Send, Opcode::Send),
        };
        // lkey 0 is never used: inline data is copied at post time.
        let sge = Sge::new(data.as_ptr() as u64, data.len() as u32, 0);
        self.post_prepared(self.lock(), &mut due, quiet, op, opcode, sge, !data.is_empty())
    }

    /// Why a receive's buffer is refused: another domain's, or longer than
    /// a scatter entry holds.
    #[cold]
    #[inline(never)]
    fn recv_buffer_refused(q: &QueueCore, l: &LocalParts) -> Error {
        match q.check_local(l) {
            Err(e) => e,
            Ok(()) => Error::MessageTooLarge { len: l.len as u64, max: u64::from(u32::MAX) },
        }
    }

    /// The provider refused a single request (quiet or tracked): its
    /// credit and slot go back.
    #[cold]
    #[inline(never)]
    fn post_refused(st: &mut VerbsState, posted: PostedInline, error: Error) -> PostedInline {
        match posted {
            PostedInline::Quiet(q) => st.q.abort_quiet(q),
            PostedInline::Tracked(Posted::Ok(id)) => st.q.abort(id),
            PostedInline::Tracked(_) => {}
        }
        PostedInline::Tracked(Posted::refused(error))
    }

    /// Posts a signaled zero-length RDMA write whose completion says every
    /// request before it is done (the remote address and key of a
    /// zero-length transfer are not checked: nothing is accessed). Its
    /// handle goes to the table as an orphan.
    fn post_flush(&self, st: &mut VerbsState) -> Result<OpId> {
        let id = self.start_flush(st)?;
        drop(st.q.orphan(id, Box::new(())));
        Ok(id)
    }

    /// [`post_flush`](Self::post_flush), handing the operation to the caller.
    fn start_flush(&self, st: &mut VerbsState) -> Result<OpId> {
        let id = st.q.start_send(Opcode::Write, 1, 0);
        let wr = SendWr::new(id.wr_id(true), SendOp::Write { remote_addr: 0, rkey: 0 }, &[]);
        let qp = st.qp.as_mut().expect("the queue pair lives as long as the connection");
        // SAFETY: a zero-length write names no local memory.
        match unsafe { qp.post_send_one(&wr) } {
            Ok(()) => Ok(id),
            Err(e) => {
                st.q.abort(id);
                Err(e.error)
            }
        }
    }

    /// The outcome of quiet send `q`, polling once if it is not known yet.
    /// A poll that finds nothing posted since the last one has a signaled
    /// request follow `q` if none does: polling alone would never learn
    /// its outcome, and a caller posting more meanwhile needs no extra request.
    pub(crate) fn poll_quiet(&self, q: &QuietSend) -> Result<Option<OpOutcome>> {
        if let Some(done) = self.succeeded(q) {
            return Ok(Some(Ok(done)));
        }
        let mut st = self.lock();
        if let Some(outcome) = st.q.quiet_outcome(q) {
            return Ok(Some(outcome));
        }
        self.progress(&mut st)?;
        let outcome = st.q.quiet_outcome(q);
        if outcome.is_none()
            && !st.q.covered(q.seq)
            && st.q.idle_since_last_look()
            && matches!(st.q.send_room(1), Ok(true))
        {
            // A failed post breaks the connection, whose flush then reports `q`.
            let _ = self.post_flush(&mut st);
        }
        Ok(outcome)
    }

    /// Keeps the buffer of quiet send `q`, whose handle was dropped, until
    /// the device is done with it (dropped at once if it already is).
    pub(crate) fn orphan_quiet(&self, q: &QuietSend, buffer: Box<dyn std::any::Any + Send>) {
        let back = self.lock().q.orphan_quiet(q, buffer);
        drop(back);
    }

    /// The outcome of quiet send `q` if known, without polling.
    pub(crate) fn quiet_outcome(&self, q: &QuietSend) -> Option<OpOutcome> {
        if let Some(done) = self.succeeded(q) {
            return Some(Ok(done));
        }
        self.lock().q.quiet_outcome(q)
    }

    /// Quiet send `q`'s completion if a poll already found that it
    /// succeeded (the common case a lap of sends later), without the lock.
    #[inline(always)]
    pub(crate) fn succeeded(&self, q: &QuietSend) -> Option<Completion> {
        (q.seq < self.succeeded_below.load(Ordering::Acquire)).then(|| q.success(self.qp_num))
    }

    /// Makes sure a signaled request follows quiet send `q`, so its outcome
    /// becomes known: `Some` flush request, which the caller owns, when one
    /// was posted (always when `own`; else only when no signaled request
    /// came after it). `None` also when the connection is lost: the
    /// queue's flush then reports every request.
    pub(crate) fn cover(&self, q: &QuietSend, own: bool, due: &mut Deadline) -> Result<Option<OpId>> {
        let st = self.lock();
        if st.q.quiet_outcome(q).is_some() || (!own && st.q.covered(q.seq)) {
            return Ok(None);
        }
        let mut st = match self.send_room(st, 1, due) {
            Ok(st) => st,
            Err(Error::ConnectionLost { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        self.start_flush(&mut st).map(Some)
    }

    /// Drives progress until quiet send `q`'s outcome is known (a signaled
    /// request after it must be in flight: see [`cover`](Self::cover)).
    #[inline(never)]
    pub(crate) fn wait_quiet(&self, q: &QuietSend, due: &mut Deadline) -> Waited {
        match self.poll_quiet(q) {
            Ok(Some(outcome)) => waited(outcome),
            Ok(None) => self.wait_outcome(due, None, None, |st| st.q.quiet_outcome(q)),
            Err(e) => Err(WaitError::unfinished(e)),
        }
    }

    #[inline(always)]
    pub(crate) fn post_recv(&self, local: Option<LocalParts>) -> Posted {
        let mut st = self.lock();
        // A receive's scatter entry holds at most u32::MAX bytes.
        let fits = |l: &LocalParts| st.q.is_local(l) && l.len as u64 <= u64::from(u32::MAX);
        if let Some(l) = local.as_ref().filter(|l| !fits(l)) {
            return Posted::refused(Self::recv_buffer_refused(&st.q, l));
        }
        let id = match st.q.start_recv() {
            Ok(id) => id,
            Err(e) => return Posted::refused(e),
        };
        let sge = local.map(|l| Sge::new(l.addr, l.len.min(u32::MAX as usize) as u32, l.lkey));
        let list: &[Sge] = match &sge {
            Some(s) => std::slice::from_ref(s),
            None => &[],
        };
        let qp = st.qp.as_mut().expect("the queue pair lives as long as the connection");
        // SAFETY: the entry names a checked range of a registered buffer of this
        // domain, owned by the caller's `Pending` (or, once that is dropped, by the
        // table) until this receive completes or the queue pair is destroyed.
        let outcome = unsafe { qp.post_recv_one(&RecvWr::new(id.wr_id(true), list)) };
        match outcome {
            Ok(()) => Posted::Ok(id),
            Err(e) => {
                st.q.abort(id);
                Posted::refused(e.error)
            }
        }
    }
}
