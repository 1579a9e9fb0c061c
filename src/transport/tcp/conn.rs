//! The connection's operations: post, poll, wait, establish, shut down.

use super::handoff::Writing;
use super::receiver::*;
use super::sender::*;
use super::*;

/// How long a closing side waits, at most, for the frame it is landing to
/// be acknowledged, and then for its bye to go out.
const LINGER: Duration = Duration::from_millis(200);

/// Whether the posting thread may send `o` itself: a message of one frame
/// (sends and writes up to a segment, inline sends, read requests, which
/// carry no payload).
fn direct(o: &Out) -> bool {
    match o.kind {
        OutKind::ReadReq { .. } => true,
        OutKind::Inline { .. } | OutKind::Send { .. } | OutKind::Write { .. } => o.len <= SEGMENT as u64,
    }
}

impl TcpConn {
    /// Lets the peer use the region under `key` through this connection.
    pub(crate) fn grant(&self, key: u32) {
        let mut granted = self.inner.granted.write().unwrap_or_else(|e| e.into_inner());
        if !granted.contains(&key) {
            granted.push(key);
        }
    }

    pub(crate) fn establish(
        mem: &crate::memory::MemoryDomain,
        stream: TcpStream,
        theirs: &TcpEndpoint,
        opts: &ConnectOptions,
        deadline: Deadline,
        reason: String,
    ) -> Result<(TcpConn, ConnectionInfo)> {
        bootstrap::exchange_ready(&stream, deadline)?;
        stream.set_read_timeout(Some(RECV_WAIT))?;
        stream.set_write_timeout(None)?;
        stream.set_nonblocking(false)?;
        // Socket buffers stay with the kernel's autotuning: a fixed SO_RCVBUF
        // turns it off and is capped by net.core.rmem_max (208 KiB by default).
        let peer_addr = stream.peer_addr().ok();
        let max_message = u64::from(MAX_MESSAGE.min(theirs.max_message));
        let limits = Limits {
            domain_id: mem.id(),
            send_depth: send_depth(opts),
            recv_depth: opts.recv_queue_depth.max(1),
            max_message,
            qp_num: 0,
        };
        let peer_depth = theirs.send_depth.clamp(1, MAX_TCP_QUEUE_DEPTH) as usize;
        let inner = Arc::new(Inner {
            state: Mutex::new(Core::new(limits, peer_depth)),
            reader: Mutex::new(Reader { scratch: vec![0u8; STEP], ahead: Ahead::default() }),
            spinners: AtomicUsize::new(0),
            napping: AtomicBool::new(false),
            writers: AtomicUsize::new(0),
            deferring: AtomicBool::new(false),
            handed: AtomicBool::new(false),
            left_to_receiver: AtomicBool::new(false),
            #[cfg(test)]
            turns: Default::default(),
            #[cfg(test)]
            receiver_tid: Default::default(),
            nap: OnceLock::new(),
            work: Condvar::new(),
            events: Condvar::new(),
            ring: Condvar::new(),
            fd: stream.as_raw_fd(),
            tx: AtomicU64::new(0),
            dead: AtomicBool::new(false),
            keys: mem.keys.clone(),
            #[cfg(feature = "cuda")]
            visible: mem.visible.clone(),
            granted: RwLock::new(opts.advertise.iter().map(|r| r.rkey).collect()),
            limits,
            peer_depth,
            // A few buffers up front: the sender may still hold the last one
            // when the next inline send is posted (its acknowledgement can
            // beat the sender back to the pool). The pool grows only to the
            // concurrency actually used, then stays.
            inline_pool: Mutex::new((0..INLINE_POOL).map(|_| Vec::with_capacity(MAX_INLINE as usize)).collect()),
            spin: opts.spin,
            // The peer's retry count, this side's timer, as on verbs.
            rnr_budget: (theirs.rnr_retry < 7)
                .then(|| rnr_timer(opts.min_rnr_timer) * (u32::from(theirs.rnr_retry) + 1)),
        });
        let sender = {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new().name("gpu-rdma-tcp-tx".into()).spawn(move || sender(&inner))?
        };
        let receiver = {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new().name("gpu-rdma-tcp-rx".into()).spawn(move || receiver(&inner))?
        };
        let info = ConnectionInfo {
            peer_name: Vec::new(),
            transport: Transport::Tcp,
            transport_reason: reason,
            peer_addr,
            local_qp_num: 0,
            remote_qp_num: 0,
            mtu: SEGMENT as u32,
            max_message_size: max_message,
            max_inline: MAX_INLINE,
            send_queue_depth: limits.send_depth,
            recv_queue_depth: limits.recv_depth,
            reads_in_flight: limits.send_depth,
            memory_bound: Some(memory_bound(inner.peer_depth as u32, limits.send_depth, limits.recv_depth)),
        };
        Ok((TcpConn { inner, stream, threads: Mutex::new(vec![sender, receiver]) }, info))
    }

    /// Checks a local buffer: in this connection's domain, and not GPU
    /// memory (which goes over TCP through the staging pipeline).
    fn check_local(q: &QueueCore, l: &LocalParts) -> Result<()> {
        q.check_local(l)?;
        if l.path.is_some() {
            return Err(Error::InvalidArgument("GPU memory goes over TCP through the staging pipeline".into()));
        }
        Ok(())
    }

    /// Checks a work item as verbs would; returns its byte count.
    fn check_item(q: &QueueCore, item: &WorkItem) -> Result<u64> {
        if let Some(l) = &item.local {
            Self::check_local(q, l)?;
        }
        q.check_item(item)
    }

    /// The message a checked work item becomes: its kind, source address and length.
    fn message(item: &WorkItem) -> (OutKind, u64, u64) {
        let (addr, len) = item.local.as_ref().map_or((0, 0), |l| (l.addr, l.len as u64));
        let kind = match item.op {
            RemoteOp::Send => OutKind::Send { imm: None },
            RemoteOp::SendWithImm(imm) => OutKind::Send { imm: Some(imm) },
            RemoteOp::Write(r) => OutKind::Write { raddr: r.addr(), key: r.rkey(), imm: None },
            RemoteOp::WriteWithImm(r, imm) => OutKind::Write { raddr: r.addr(), key: r.rkey(), imm: Some(imm) },
            RemoteOp::Read(r) => OutKind::ReadReq { raddr: r.addr(), key: r.rkey() },
        };
        (kind, addr, len)
    }

    /// Queues `count` messages (`next(i)` makes the i-th) as one operation,
    /// waiting for send-queue room up to `due`. Allocates nothing once the
    /// queues have grown to their steady size.
    fn enqueue(
        &self,
        opcode: Opcode,
        count: usize,
        bytes: u64,
        mut due: Deadline,
        mut next: impl FnMut(usize) -> (OutKind, u64, u64),
    ) -> Posted {
        let n = count as u32;
        let mut st = self.inner.lock();
        loop {
            match st.q.send_room(n) {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => return Posted::refused(e),
            }
            let now = Instant::now();
            let deadline = due.at_from(now);
            if now >= deadline {
                return Posted::refused(st.q.send_full());
            }
            st = self.inner.sleep(st, deadline - now);
        }
        let id = st.push(opcode, count, bytes, &mut next);
        // Not on the engine's thread, which serves every connection: its
        // posts are sent by the connection's sender thread.
        if st.socket_idle() && st.queue.len() == count && direct(&st.queue[0]) && !crate::transport::engine::on_engine()
        {
            return self.send_direct(st, id);
        }
        self.inner.work.notify_one();
        Posted::Ok(id)
    }

    /// Sends the messages just posted from the posting thread while the
    /// socket is free, as a plain socket's writer does: no hand-off to the
    /// sender thread, whose wake-up costs more than a frame's send on the
    /// latency path and a context switch on every burst of a stream. Never
    /// blocks: once the socket takes less than a whole frame, or the next
    /// message is not of one frame, the sender thread goes on with the
    /// rest, that frame first.
    fn send_direct<'a>(&'a self, mut st: MutexGuard<'a, Core>, id: OpId) -> Posted {
        // While it writes: the receiver thread leaves what arrives to it
        // (see `handoff`).
        let mut streaming = None;
        while st.socket_idle() && st.queue.front().is_some_and(direct) {
            let Some(mut o) = st.queue.pop_front() else { break };
            let more = !st.queue.is_empty();
            self.inner.start_write(&mut st, &o);
            drop(st);
            streaming.get_or_insert_with(|| Writing::new(&self.inner));
            let written = try_send_single(self.inner.fd, &o, more, &self.inner.tx);
            st = self.inner.lock();
            let whole = o.wire_len() as usize;
            match written {
                Ok(n) if n < whole && st.q.lost().is_none() => {
                    // Still being written (`sending` stays): the sender
                    // thread goes on with it before anything else.
                    st.writing = false;
                    o.skip = n;
                    st.resume = Some(o);
                    break;
                }
                r => {
                    let whole_sent = matches!(r, Ok(n) if n == whole);
                    self.inner.end_write(&mut st, &o, !whole_sent);
                    let failed = r.is_err();
                    if let Err(e) = r {
                        self.inner.break_with(&mut st, format!("sending to the peer failed: {e}"));
                    }
                    // Its inline copy back to the pool (its own lock, never
                    // held while taking the connection's).
                    self.inner.recycle(&mut o);
                    if failed {
                        break;
                    }
                }
            }
            if self.inner.handed.load(Ordering::Relaxed) {
                drop(st);
                self.inner.writer_turn();
                st = self.inner.lock();
            }
        }
        self.inner.sender_on(&st);
        drop(st);
        // The stream's last turn, without the lock.
        drop(streaming);
        Posted::Ok(id)
    }

    pub(crate) fn post_send(&self, items: &[WorkItem], due: Deadline) -> Posted {
        let Some(last) = items.last() else {
            return Posted::refused(Error::EmptyBatch);
        };
        let mut bytes = 0;
        {
            let st = self.inner.lock();
            for item in items {
                match Self::check_item(&st.q, item) {
                    Ok(len) => bytes += len,
                    Err(e) => return Posted::refused(e),
                }
            }
        }
        self.enqueue(last.op.opcode(), items.len(), bytes, due, |i| Self::message(&items[i]))
    }

    /// Posts an inline send. `unacked` (an untracked send, whose outcome
    /// nobody waits for) asks the peer for no acknowledgement: the send is
    /// done once the socket has its frame, as UCX's TCP transport completes
    /// a send, and a ping-pong's ping costs no acknowledgement frame each
    /// way. Delivery is still confirmed in order: the peer carries out frames
    /// in stream order, so the acknowledgement of any later operation covers
    /// it, and a refusal (no receive posted in time) breaks the connection.
    pub(crate) fn post_inline(&self, data: &[u8], imm: Option<u32>, due: Deadline, unacked: bool) -> Posted {
        if data.len() as u64 > u64::from(MAX_INLINE) {
            return Posted::refused(Error::MessageTooLarge { len: data.len() as u64, max: u64::from(MAX_INLINE) });
        }
        let opcode = if imm.is_some() { Opcode::SendWithImm } else { Opcode::Send };
        // The copy goes into a buffer from the connection's pool (returned by
        // the sender once sent), so inline sends allocate nothing in steady state.
        let mut copy = self.inner.inline_pool.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
        copy.clear();
        copy.extend_from_slice(data);
        let mut copy = Some(copy);
        self.enqueue(opcode, 1, data.len() as u64, due, |_| {
            (OutKind::Inline { data: copy.take().unwrap_or_default(), imm, unacked }, 0, data.len() as u64)
        })
    }

    pub(crate) fn post_recv(&self, local: Option<LocalParts>) -> Posted {
        let mut st = self.inner.lock();
        let (addr, len) = match &local {
            Some(l) => {
                if let Err(e) = Self::check_local(&st.q, l) {
                    return Posted::refused(e);
                }
                (l.addr, l.len as u64)
            }
            None => (0, 0),
        };
        match st.post_recv(addr, len, &*self.inner) {
            Ok(id) => Posted::Ok(id),
            Err(e) => Posted::refused(e),
        }
    }

    /// Takes `id`'s outcome if it is done, else registers `waker`: the
    /// connection's threads wake it when they complete the operation.
    pub(crate) fn poll_register(&self, id: OpId, waker: &std::task::Waker) -> Result<Option<OpOutcome>> {
        Ok(self.inner.lock().q.take_or_register(id, waker))
    }

    /// [`QueueCore::done_or_register`](super::queue::QueueCore::done_or_register).
    pub(crate) fn done_or_register(&self, id: OpId, waker: &std::task::Waker) -> Result<bool> {
        Ok(self.inner.lock().q.done_or_register(id, waker))
    }

    pub(crate) fn wait_done(&self, id: OpId, due: &mut Deadline) -> Result<()> {
        self.wait_for(due, false, |st| st.q.is_done(id).then_some(()))
    }

    /// Waits until `id` is done, then takes its outcome.
    /// [`WaitError::Unfinished`] when the deadline passed first (the
    /// operation is still in flight).
    pub(crate) fn wait_take(&self, id: OpId, due: &mut Deadline) -> Waited {
        match self.wait_for(due, true, |st| st.q.take(id)) {
            Ok(outcome) => waited(outcome),
            Err(e) => Err(WaitError::unfinished(e)),
        }
    }

    /// Waits until `ready` gives a value, up to `due`. With `spin`, looks
    /// again for the connection's spin time first, yielding the CPU (to this
    /// side's receiver thread, among others), before sleeping: a reply often
    /// lands within microseconds, and waking from a condition variable costs
    /// more than that.
    fn wait_for<T>(&self, due: &mut Deadline, spin: bool, mut ready: impl FnMut(&mut Core) -> Option<T>) -> Result<T> {
        let mut st = self.inner.lock();
        if let Some(v) = ready(&mut st) {
            return Ok(v);
        }
        if spin && !self.inner.spin.is_zero() {
            drop(st);
            let _spinning = Spinning::new(&self.inner);
            let now = Instant::now();
            let until = due.at_from(now).min(now + self.inner.spin);
            loop {
                // What arrived is carried out here when the receiver thread
                // is not at it: no wake-up and hand-over per message.
                if self.inner.read_ready() {
                    self.inner.rouse();
                }
                let mut s = self.inner.lock();
                if let Some(v) = ready(&mut s) {
                    return Ok(v);
                }
                if Instant::now() >= until {
                    st = s;
                    break;
                }
                drop(s);
                std::thread::yield_now();
            }
        }
        loop {
            let now = Instant::now();
            let deadline = due.at_from(now);
            if now >= deadline {
                return Err(due.expired());
            }
            st = self.inner.sleep(st, deadline - now);
            if let Some(v) = ready(&mut st) {
                return Ok(v);
            }
        }
    }

    /// How many of the peer's writes have landed so far.
    pub(crate) fn landed(&self) -> u64 {
        self.inner.lock().landed
    }

    /// Sleeps until a write of the peer's lands after the first `seen`,
    /// the connection is lost, or `d` passes.
    pub(crate) fn wait_landed(&self, seen: u64, d: Duration) {
        let until = Instant::now() + d;
        let mut st = self.inner.lock();
        while st.landed == seen && st.q.lost().is_none() {
            let now = Instant::now();
            if now >= until {
                return;
            }
            st = self.inner.sleep_on_ring(st, until - now);
        }
    }

    /// Whether a write of the peer's landed after the first `seen`, or the
    /// connection is lost; else `waker` is woken when either happens.
    pub(crate) fn landed_or_register(&self, seen: u64, waker: &std::task::Waker) -> bool {
        self.inner.lock().landed_or_register(seen, waker)
    }

    /// Takes `id`'s outcome if it is done.
    pub(crate) fn poll_take(&self, id: OpId) -> Result<Option<OpOutcome>> {
        Ok(self.inner.lock().q.take(id))
    }

    pub(crate) fn poll_done(&self, id: OpId) -> Result<bool> {
        Ok(self.inner.lock().q.is_done(id))
    }

    pub(crate) fn take(&self, id: OpId) -> Option<OpOutcome> {
        self.inner.lock().q.take(id)
    }

    pub(crate) fn orphan(&self, id: OpId, buffer: Box<dyn std::any::Any + Send>) {
        let released = self.inner.lock().q.orphan(id, buffer);
        drop(released);
    }

    pub(crate) fn progress_now(&self) -> Result<usize> {
        // The transport's threads make progress by themselves.
        Ok(0)
    }

    pub(crate) fn broken(&self) -> Option<String> {
        self.inner.lock().q.lost().map(str::to_owned)
    }

    pub(crate) fn stats(&self) -> (usize, usize) {
        let st = self.inner.lock();
        st.q.stats()
    }

    /// [`shutdown`](Self::shutdown): the bye already follows the
    /// acknowledgements of everything this side received.
    pub(crate) fn close(&self, reason: &str) {
        self.shutdown(reason);
    }

    /// Closes this side: once a frame landing now is acknowledged, says bye, stops both threads (waiting for them), and
    /// fails what is left. After this no thread touches any buffer.
    pub(crate) fn shutdown(&self, reason: &str) {
        {
            let mut st = self.inner.lock();
            // A message or write landing now may have been seen already (the
            // caller may close because it saw it): its acknowledgement goes
            // before the bye, as an RC responder acknowledges what it placed.
            let t0 = Instant::now();
            while st.landing() && st.q.lost().is_none() && t0.elapsed() < LINGER {
                st = self.inner.sleep(st, Duration::from_millis(1));
            }
            if st.q.lost().is_none() {
                // After what is queued: acknowledgements of messages this side
                // already completed must reach the peer first, as on RC.
                st.control.push_back(Ctl::Bye);
                let r = reason.to_owned();
                self.inner.break_with(&mut st, r);
            }
            self.inner.work.notify_all();
            // Give the sender a moment to say bye before the socket closes.
            let t0 = Instant::now();
            while !st.control.is_empty() && !st.sender_done && t0.elapsed() < LINGER {
                st = self.inner.sleep(st, Duration::from_millis(10));
            }
            st.stopping = true;
            self.inner.work.notify_all();
            self.inner.wake(&st);
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let threads: Vec<JoinHandle<()>> = self.threads.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect();
        for t in threads {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        // Both threads are gone: fail whatever they left.
        self.inner.lock().stopped(reason.to_owned(), &*self.inner);
    }
}

impl Drop for TcpConn {
    fn drop(&mut self) {
        self.shutdown("the connection was dropped");
        // Nothing touches buffers any more: release every orphan.
        let orphans = self.inner.lock().q.take_orphans();
        drop(orphans);
    }
}
