//! Waiting on a verbs connection: busy polls within the spin window, then
//! sleeps on the completion channel and the peer's socket; polls, takes and
//! wakers for the progress engine.

use super::*;

impl VerbsConn {
    /// Waits, driving progress, until `ready` holds or the deadline passes.
    pub(super) fn wait_until(
        &self,
        due: &mut Deadline,
        mut ready: impl FnMut(&mut VerbsState) -> bool,
    ) -> Result<bool> {
        let seen;
        // Most waits end at the first poll.
        {
            let mut st = self.lock();
            self.progress(&mut st)?;
            if ready(&mut st) {
                return Ok(true);
            }
            seen = st.q.changes();
        }
        self.wait_until_spin(due, seen, ready)
    }

    /// [`wait_until`](Self::wait_until)'s spin in a frame of its own, out
    /// of the posts and waits that inline `wait_until`.
    #[inline(never)]
    fn wait_until_spin(
        &self,
        due: &mut Deadline,
        seen: u64,
        ready: impl FnMut(&mut VerbsState) -> bool,
    ) -> Result<bool> {
        self.wait_until_slow(due, None, &mut None, Some(seen), ready)
    }

    /// [`wait_until`](Self::wait_until) past its first poll: spinning, then
    /// sleeping on the completion channel, the peer's socket and the bell
    /// (rung when another thread changed the queue: reaped a completion,
    /// and perhaps took the channel's event with it, after this one looked).
    /// A sleep lasts until one of those or the deadline.
    ///
    /// With `want`, a poll that finds that operation's successful final
    /// completion puts it in `taken` and ends the wait (`Ok(true)`), as
    /// [`progress_for`](Self::progress_for) hands it over.
    ///
    /// `seen`: the queue's change count when the caller, under the lock,
    /// polled and found `ready` false; the spin starts after that poll, and
    /// `ready` is asked again only once the queue changed since. `None`
    /// polls and asks at once.
    ///
    /// Inlined into the one frame that waits ([`wait_take_slow`](Self::wait_take_slow),
    /// [`wait_until_spin`](Self::wait_until_spin), [`wait_quiet`](Self::wait_quiet)):
    /// a found completion comes back through one return fewer.
    #[inline]
    fn wait_until_slow(
        &self,
        due: &mut Deadline,
        want: Option<OpId>,
        taken: &mut Option<Completion>,
        seen: Option<u64>,
        mut ready: impl FnMut(&mut VerbsState) -> bool,
    ) -> Result<bool> {
        // Both fixed at the first clock read, not before: a wait that ends
        // within `polls_per_read` polls never reads the clock.
        let mut spin_until: Option<Instant> = None;
        let mut peer_look: Option<Instant> = None;
        let polls_per_read = self.polls_per_read;
        let mut polls_to_read = polls_per_read;
        // `ready` is asked again only when the queue changed since it last
        // said no: an empty poll costs the poll alone.
        let mut seen = seen;
        // A caller that passed `seen` polled just before this: the spin's
        // first step starts after that poll, not with another.
        let mut polled = seen.is_some();
        loop {
            let grace_end = {
                let mut st = self.lock();
                if !std::mem::replace(&mut polled, false) {
                    self.progress_for(&mut st, want, taken)?;
                    if taken.is_some() {
                        return Ok(true);
                    }
                }
                let changes = Some(st.q.changes());
                if seen != changes {
                    if ready(&mut st) {
                        return Ok(true);
                    }
                    seen = changes;
                }
                st.grace_end()
            };
            // Reading the clock is not free everywhere (a system call and an
            // emulated timer read on machines without a usable TSC): while
            // spinning, look at it only every `polls_per_read` polls. No
            // PAUSE hint between polls, as perftest and UCX poll: the poll
            // is the spin, and an emulated CPU (QEMU's TCG) leaves its
            // translated code at every PAUSE to let another CPU run, which
            // costs the wait microseconds.
            //
            // Once the peer has left, nothing but the flushes at the end of
            // its grace can still complete: sleep until then, not spin.
            if !self.spin.is_zero() && grace_end.is_none() {
                polls_to_read -= 1;
                if polls_to_read != 0 {
                    continue;
                }
                polls_to_read = polls_per_read;
            }
            let now = Instant::now();
            let deadline = due.at_from(now);
            if now >= deadline {
                return Ok(false);
            }
            if grace_end.is_none() && now < *spin_until.get_or_insert(now + self.spin) {
                // A long spin still notices a peer that closed or died (a
                // sleeping wait watches its socket): its requests would
                // otherwise never be answered.
                if now >= *peer_look.get_or_insert(now + PEER_LOOK) {
                    peer_look = Some(now + PEER_LOOK);
                    self.check_peer(&mut self.lock());
                }
                continue;
            }
            self.cq.req_notify(false)?;
            let (watch_peer, asleep) = {
                let mut st = self.lock();
                // Polled empty after arming: a completion already queued
                // raises no event.
                loop {
                    let n = self.progress_for(&mut st, want, taken)?;
                    if taken.is_some() {
                        return Ok(true);
                    }
                    if ready(&mut st) {
                        return Ok(true);
                    }
                    if n < POLL_BATCH {
                        break;
                    }
                }
                let changes = st.q.changes();
                let asleep = self.bell().map(|bell| (bell, st.sleepers.lie_down(changes)));
                (st.q.lost().is_none(), asleep)
            };
            // Woken at the grace's end at the latest, to flush the queue pair.
            let wake = grace_end.map_or(deadline, |g| g.min(deadline));
            let mut slice = wake.saturating_duration_since(Instant::now());
            if asleep.is_none() {
                // Nothing would wake this thread when another reaps its
                // completion: look again soon.
                slice = slice.min(UNBELLED_SLEEP);
            }
            #[cfg(test)]
            if let Some(hook) = tests::BEFORE_SLEEP.take() {
                hook(self);
            }
            let chan = self.cq.channel().map(AsFd::as_fd);
            let socket = watch_peer.then(|| self.socket.as_fd());
            let slept = poll::readable_of([chan, socket, asleep.map(|(bell, _)| bell.as_fd())], slice);
            if matches!(slept, Ok([true, _, _])) {
                self.cq.try_take_event();
            }
            // Up again (also when poll(2) failed), and the peer looked at,
            // under one lock.
            let peer = matches!(slept, Ok([_, true, _]));
            if asleep.is_some() || peer {
                let mut st = self.lock();
                if let Some((bell, ticket)) = asleep {
                    if st.sleepers.get_up(ticket) {
                        bell.drain();
                    }
                }
                if peer {
                    self.check_peer(&mut st);
                }
            }
            slept.map_err(|source| Error::Verbs { op: "poll(completion channel)", source })?;
        }
    }

    pub(crate) fn wait_done(&self, id: OpId, due: &mut Deadline) -> Result<()> {
        if self.lock().q.is_done(id) || self.wait_until(due, |st| st.q.is_done(id))? {
            Ok(())
        } else {
            Err(due.expired())
        }
    }

    /// Drives progress until `id` is done, then takes its outcome (one
    /// lock for the check and the take). [`WaitError::Unfinished`] when the
    /// deadline passed first (the operation is still in flight) or polling
    /// failed.
    #[inline(always)]
    pub(crate) fn wait_take(&self, id: OpId, due: &mut Deadline) -> Waited {
        let seen;
        {
            // Taken already reaped, or reaped by one poll: one lock either way.
            let mut st = self.lock();
            if let Some(outcome) = st.q.take(id) {
                return waited(outcome);
            }
            // Its success, found by this poll, comes straight back.
            let mut taken = None;
            if let Err(e) = self.progress_for(&mut st, Some(id), &mut taken) {
                return Err(WaitError::unfinished(e));
            }
            if let Some(c) = taken {
                return Ok(c);
            }
            if let Some(outcome) = st.q.take(id) {
                return waited(outcome);
            }
            seen = st.q.changes();
        }
        self.wait_take_slow(id, due, seen)
    }

    /// [`wait_take`](Self::wait_take) past its first poll, which found
    /// nothing to take with the queue at change count `seen`.
    #[inline(never)]
    fn wait_take_slow(&self, id: OpId, due: &mut Deadline, seen: u64) -> Waited {
        self.wait_outcome(due, Some(id), Some(seen), |st| st.q.take(id))
    }

    /// Waits, driving progress, until `outcome` gives one (it is asked
    /// after every poll), or the deadline passes ([`WaitError::Unfinished`]).
    /// With `want` (the operation `outcome` takes), its success comes
    /// straight from the poll that finds it. `seen`: as for
    /// [`wait_until_slow`](Self::wait_until_slow).
    #[inline(always)]
    pub(super) fn wait_outcome(
        &self,
        due: &mut Deadline,
        want: Option<OpId>,
        seen: Option<u64>,
        mut outcome: impl FnMut(&mut VerbsState) -> Option<OpOutcome>,
    ) -> Waited {
        let mut found = None;
        let mut taken = None;
        match self.wait_until_slow(due, want, &mut taken, seen, |st| {
            found = outcome(st);
            found.is_some()
        }) {
            Ok(_) => match taken {
                Some(c) => Ok(c),
                None => found.map_or_else(|| Err(WaitError::unfinished(due.expired())), waited),
            },
            Err(e) => Err(WaitError::unfinished(e)),
        }
    }

    /// Polls once (unless `id` was already reaped) and takes its outcome if
    /// it is done.
    pub(crate) fn poll_take(&self, id: OpId) -> Result<Option<OpOutcome>> {
        let mut st = self.lock();
        if let Some(outcome) = st.q.take(id) {
            return Ok(Some(outcome));
        }
        self.progress(&mut st)?;
        Ok(st.q.take(id))
    }

    /// Takes `id`'s outcome if it is done (polling once), else registers
    /// `waker` for its completion. The caller has the engine watch this
    /// connection, so the completion is seen without anyone waiting.
    pub(crate) fn poll_register(&self, id: OpId, waker: &std::task::Waker) -> Result<Option<OpOutcome>> {
        let mut st = self.lock();
        if let Some(outcome) = st.q.take(id) {
            return Ok(Some(outcome));
        }
        self.progress(&mut st)?;
        Ok(st.q.take_or_register(id, waker))
    }

    /// [`QueueCore::done_or_register`](super::queue::QueueCore::done_or_register),
    /// after reaping what the completion queue holds.
    pub(crate) fn done_or_register(&self, id: OpId, waker: &std::task::Waker) -> Result<bool> {
        let mut st = self.lock();
        if st.q.is_done(id) {
            return Ok(true);
        }
        self.progress(&mut st)?;
        Ok(st.q.done_or_register(id, waker))
    }

    /// What a tokio task watching this connection waits on to let go.
    #[cfg(feature = "tokio")]
    pub(crate) fn closing(&self) -> std::sync::Arc<tokio::sync::Notify> {
        std::sync::Arc::clone(&self.closing)
    }

    /// Marks this connection watched by the engine; whether it was not yet.
    pub(crate) fn mark_watched(&self) -> bool {
        use std::sync::atomic::Ordering;
        // A load first: every registration asks, and all but the first find it set.
        !self.watched.load(Ordering::Acquire) && !self.watched.swap(true, Ordering::AcqRel)
    }

    /// The completion channel's descriptor.
    pub(crate) fn channel_fd(&self) -> Option<std::os::fd::RawFd> {
        self.cq.channel().map(verbs::CompletionChannel::fd)
    }

    /// The peer's socket's descriptor.
    pub(crate) fn socket_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.socket.as_raw_fd()
    }

    /// The engine saw the channel (`event`) or the socket (`peer`) readable,
    /// or sweeps: takes the event, re-arms the queue, polls it empty (which
    /// wakes the operations that finished) and looks at the peer.
    pub(crate) fn engine_progress(&self, event: bool, peer: bool) {
        if event {
            // Every event there is: a watcher woken by an edge sees no
            // second edge for events already queued.
            while self.cq.try_take_event() {}
        }
        if let Err(e) = self.cq.req_notify(false) {
            tracing::warn!("arming the completion queue: {e}");
        }
        let mut st = self.lock();
        while let Ok(POLL_BATCH) = self.progress(&mut st) {}
        if peer {
            self.check_peer(&mut st);
        }
    }

    pub(crate) fn poll_done(&self, id: OpId) -> Result<bool> {
        let mut st = self.lock();
        // Often already reaped while waiting for something else: then the
        // completion queue need not be polled again.
        if st.q.is_done(id) {
            return Ok(true);
        }
        self.progress(&mut st)?;
        Ok(st.q.is_done(id))
    }

    pub(crate) fn progress_now(&self) -> Result<usize> {
        let mut st = self.lock();
        self.progress(&mut st)
    }

    pub(crate) fn take(&self, id: OpId) -> Option<OpOutcome> {
        self.lock().q.take(id)
    }

    pub(crate) fn orphan(&self, id: OpId, buffer: Box<dyn std::any::Any + Send>) {
        let released = self.lock().q.orphan(id, buffer);
        // Dropped outside the lock: deregistering can take a while.
        drop(released);
    }
}
