//! The verbs transport: one RC queue pair per connection, one completion
//! queue with a completion channel, and the handshake's TCP socket kept
//! open to notice a peer that closes or dies.

mod establish;
mod post;
mod wait;

pub(crate) use establish::Prepared;

use parking_lot::{Mutex, MutexGuard};
use std::hash::{BuildHasher, Hasher};
use std::net::TcpStream;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::bootstrap::{self, VerbsEndpoint};
use crate::completion::{Completion, Opcode};
use crate::deadline::{Deadline, polls_per_clock_read};
use crate::error::{Error, Result};
use crate::memory::domain::Nic;
use crate::memory::{Access, LocalParts};
use crate::ops::{OpId, OpOutcome, RawCompletion, WaitError, Waited, quiet_wr_id, waited};
use crate::options::{ConnectOptions, ConnectionInfo, Transport};
use crate::poll::{self, Bell};
use crate::transport::queue::{Limits, Posted, PostedInline, QueueCore, QuietSend, RemoteOp, Sleepers, WorkItem};
use crate::verbs::{
    self, CompletionChannel, CompletionQueue, LinkLayer, Mtu, PortAttr, QpCaps, QpState, QueuePair, QueuePairBuilder,
    RecvWr, RtrAttr, RtsAttr, SendOp, SendWr, Sge, WcOpcode, WorkCompletion,
};

/// The request for `op` at byte `off` of its remote range (a chunk of a
/// split write or read; sends and writes with immediate are one message).
fn send_op(op: RemoteOp, off: u64) -> SendOp {
    match op {
        RemoteOp::Send => SendOp::Send,
        RemoteOp::SendWithImm(imm) => SendOp::SendWithImm(imm),
        RemoteOp::Write(r) => SendOp::Write { remote_addr: r.addr() + off, rkey: r.rkey() },
        RemoteOp::WriteWithImm(r, imm) => SendOp::WriteWithImm { remote_addr: r.addr(), rkey: r.rkey(), imm },
        RemoteOp::Read(r) => SendOp::Read { remote_addr: r.addr() + off, rkey: r.rkey() },
    }
}

/// The connection broke: a work request failed (the queue pair is in the
/// error state).
#[cold]
#[inline(never)]
fn lose_after(q: &mut QueueCore, status: crate::completion::WcStatus) {
    q.lose(|| format!("the queue pair went to the error state after a work request failed with {status}"));
}

/// A polled completion as the queue core takes it.
#[inline]
fn raw_completion(wc: &WorkCompletion) -> RawCompletion {
    RawCompletion {
        wr_id: wc.wr_id,
        status: wc.status,
        byte_len: wc.byte_len,
        imm: wc.imm,
        qp_num: wc.qp_num,
        vendor_err: wc.vendor_err,
        by_write_imm: wc.opcode == WcOpcode::RecvRdmaWithImm,
    }
}

fn random_psn() -> u32 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos() ^ u128::from(std::process::id()));
    (h.finish() as u32) & 0x00ff_ffff
}

/// What one poll of the completion queue reads at most.
const POLL_BATCH: usize = CompletionQueue::POLL_EACH_MAX;

struct VerbsState {
    // Declared first: dropped (destroyed) before the table's orphaned buffers.
    qp: Option<QueuePair>,
    /// Operations, credits, the lost state.
    q: QueueCore,
    /// The peer closed or died at this instant; the queue pair is moved to
    /// the error state after a short grace, so completions already on their
    /// way are still reported.
    peer_gone: Option<Instant>,
    /// Threads asleep in a wait, woken by the bell when another thread
    /// changes the queue under them.
    sleepers: Sleepers,
    /// Whether writes with immediate received are counted (this side asked
    /// the peer for covers: [`super::covers`]), and how many were, in
    /// arrival order.
    count_imm: bool,
    imm_writes: u64,
    sges: Vec<Sge>,
    scratch: Vec<(SendOp, usize, bool)>,
}

/// One connection's verbs resources.
pub(crate) struct VerbsConn {
    state: Mutex<VerbsState>,
    cq: CompletionQueue,
    socket: TcpStream,
    max_inline: u32,
    spin: Duration,
    /// Polls of a busy wait between two clock reads (for this `spin`).
    polls_per_read: u32,
    /// Watched by the domain's progress engine.
    watched: std::sync::atomic::AtomicBool,
    /// The queue core's [`succeeded_mark`](QueueCore::succeeded_mark): a
    /// quiet send placed below it succeeded and the device is done with its
    /// buffer, which a look at this tells without the lock.
    succeeded_below: Arc<AtomicU64>,
    /// The queue pair's number, for those quiet sends' completions.
    qp_num: u32,
    /// Rung to wake the sleepers (made at the first sleep; `None` if no
    /// descriptor was left for it: then sleeps are cut short instead).
    bell: OnceLock<Option<Bell>>,
    /// Tells a tokio task watching this connection that it is closing.
    #[cfg(feature = "tokio")]
    closing: std::sync::Arc<tokio::sync::Notify>,
    /// What covers this side's writes with immediate, where the peer asked
    /// for covers ([`super::covers`]).
    covers: OnceLock<Box<dyn crate::transport::covers::ImmCovers>>,
}

const PEER_GRACE: Duration = Duration::from_millis(50);

/// How long a side that closes first keeps its queue pair up for the
/// peer's requests in flight to be acknowledged (see [`VerbsConn::close`]).
/// Far longer than an acknowledgement takes; the peer closing ends it sooner.
const LINGER: Duration = Duration::from_millis(5);
/// How often a spinning wait looks at the peer's socket.
const PEER_LOOK: Duration = Duration::from_millis(1);
/// The longest a wait sleeps at once without a bell to wake it.
const UNBELLED_SLEEP: Duration = Duration::from_millis(20);

/// The connection's state, locked. Unlocking it rings the bell when the
/// queue changed under threads asleep in a wait (see [`Sleepers`]): one
/// comparison when nobody sleeps.
struct Locked<'a> {
    st: MutexGuard<'a, VerbsState>,
    bell: &'a OnceLock<Option<Bell>>,
}

impl Deref for Locked<'_> {
    type Target = VerbsState;

    fn deref(&self) -> &VerbsState {
        &self.st
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut VerbsState {
        &mut self.st
    }
}

impl Drop for Locked<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        let st = &mut *self.st;
        if st.sleepers.must_ring(st.q.changes()) {
            // Still locked: a sleeper gets up (and may drain) only after this.
            if let Some(Some(bell)) = self.bell.get() {
                bell.ring();
            }
        }
    }
}

impl VerbsState {
    /// Moves the queue pair to the error state (once): everything
    /// outstanding completes, flushed.
    fn fail_qp(&mut self) {
        if let Some(qp) = self.qp.as_mut() {
            if qp.state() != QpState::Error {
                if let Err(e) = qp.set_error() {
                    tracing::warn!("moving the queue pair to the error state: {e}");
                }
            }
        }
    }

    /// When the grace after the peer left ends, if it has not yet.
    fn grace_end(&self) -> Option<Instant> {
        self.peer_gone.map(|at| at + PEER_GRACE)
    }
}

impl VerbsConn {
    #[inline(always)]
    fn lock(&self) -> Locked<'_> {
        // Not poisoned by a panic while held: a panic cannot leave the table
        // half-updated in a way that breaks memory safety; keep going.
        Locked { st: self.state.lock(), bell: &self.bell }
    }

    /// The bell, made on first use; `None` if it could not be.
    fn bell(&self) -> Option<&Bell> {
        self.bell
            .get_or_init(|| {
                Bell::new()
                    .inspect_err(|e| {
                        tracing::warn!("no eventfd for a waiting thread's bell ({e}): sleeps are cut short")
                    })
                    .ok()
            })
            .as_ref()
    }

    /// Polls the completion queue once and records what it finds.
    fn progress(&self, st: &mut VerbsState) -> Result<usize> {
        self.progress_for(st, None, &mut None)
    }

    /// [`progress`](Self::progress) for a waiter of `want`: its successful
    /// final completion, if this poll finds it, is put in `taken` (which
    /// must be `None`) rather than recorded to be taken (see
    /// [`QueueCore::complete_taking`]); the other completions are recorded
    /// as usual. How many it read.
    ///
    /// `taken` is the waiter's own: the completion is written once, where
    /// the waiter reads it, not returned and copied at each level on the
    /// way from a poll to the next post.
    #[inline(always)]
    fn progress_for(&self, st: &mut VerbsState, want: Option<OpId>, taken: &mut Option<Completion>) -> Result<usize> {
        let count_imm = st.count_imm;
        let mut imm = 0;
        let q = &mut st.q;
        let n = self.cq.poll_each(|wc| {
            let raw = raw_completion(&wc);
            if count_imm && raw.by_write_imm && wc.status.is_success() {
                imm += 1;
            }
            if let Some(id) = want.filter(|_| taken.is_none()) {
                if let Some(c) = q.complete_taking(&raw, id) {
                    *taken = Some(c);
                    return;
                }
            }
            if !wc.status.is_success() {
                lose_after(q, wc.status);
            }
            // The device is done with an orphan's memory: its final request completed.
            drop(q.complete(&raw));
        })?;
        if imm > 0 {
            st.imm_writes += imm;
        }
        self.check_grace(st);
        Ok(n)
    }

    fn check_grace(&self, st: &mut VerbsState) {
        if let Some(at) = st.peer_gone {
            if at.elapsed() >= PEER_GRACE {
                st.peer_gone = None;
                st.fail_qp();
            }
        }
    }

    /// Looks at the socket after poll(2) said it is readable: the peer said
    /// bye, closed, or died.
    fn check_peer(&self, st: &mut VerbsState) {
        if st.q.lost().is_some() {
            return;
        }
        let mut byte = [0u8; 1];
        let reason = match self.socket.peek(&mut byte) {
            Ok(0) => "the peer closed the connection (its process exited or dropped the connection)",
            Ok(_) => "the peer closed the connection (it said bye)",
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(_) => "the connection to the peer was reset",
        };
        tracing::info!("{reason}");
        st.q.lose(|| reason.to_owned());
        st.peer_gone = Some(Instant::now());
    }

    pub(crate) fn broken(&self) -> Option<String> {
        let mut st = self.lock();
        let _ = self.progress(&mut st);
        if st.q.lost().is_none() {
            self.check_peer(&mut st);
        }
        st.q.lost().map(str::to_owned)
    }

    pub(crate) fn stats(&self) -> (usize, usize) {
        let st = self.lock();
        st.q.stats()
    }

    /// Breaks this side off: says bye, then moves the queue pair to the
    /// error state so everything outstanding completes (flushed).
    pub(crate) fn shutdown(&self, reason: &str) {
        self.end(reason, false);
    }

    /// Closes this side (its handle was dropped): as
    /// [`shutdown`](Self::shutdown), but when this side closes first the
    /// queue pair stays up after the bye until the peer closes too, for at
    /// most [`LINGER`]. The device still acknowledges what the peer sent
    /// last: a peer waiting for its final send's completion learns that
    /// it arrived, rather than seeing it fail once the connection is gone.
    pub(crate) fn close(&self, reason: &str) {
        self.end(reason, true);
    }

    fn end(&self, reason: &str, linger: bool) {
        // A tokio task watching the completion channel lets go of it (a
        // permit is kept if it is not waiting right now).
        #[cfg(feature = "tokio")]
        self.closing.notify_one();
        let first = {
            let mut st = self.lock();
            let first = st.q.lost().is_none();
            if first {
                bootstrap::send_bye(&self.socket);
                st.q.lose(|| reason.to_owned());
            }
            first
        };
        if first && linger {
            // Unlocked: the peer's bye, its close (both make the socket
            // readable) or LINGER, whichever comes first. Best effort: a
            // failed or interrupted poll ends the linger early.
            let _ = crate::poll::readable([self.socket.as_fd()], LINGER);
        }
        self.lock().fail_qp();
    }
}

impl Drop for VerbsConn {
    fn drop(&mut self) {
        let cq = self.cq.clone();
        let st = self.state.get_mut();
        st.fail_qp();
        // Drain the flushes, briefly: after the queue pair is destroyed the
        // device touches none of its requests' memory anyway.
        let deadline = Instant::now() + Duration::from_secs(2);
        st.q.lose(|| "the connection was dropped".to_owned());
        // Quiet sends' orphans are not waited for: one that succeeded
        // reports nothing; they go with the rest once the queue pair is gone.
        while st.q.reported_in_flight() > 0 && Instant::now() < deadline {
            let q = &mut st.q;
            match cq.poll_each(|wc| drop(q.complete(&raw_completion(&wc)))) {
                Ok(0) => std::thread::sleep(Duration::from_micros(200)),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let orphans = st.q.take_orphans();
        match st.qp.take().map(QueuePair::destroy) {
            Some(Err(e)) => {
                tracing::error!(
                    "destroying the queue pair failed ({e}): leaking {} buffers so the device cannot reach freed memory",
                    orphans.len()
                );
                std::mem::forget(orphans);
            }
            _ => drop(orphans),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ConnectOptions, Connection, Domain, DomainConfig, TransportPolicy};
    use std::sync::Arc;

    /// What runs on a waiting thread between its last look at the queue
    /// and its sleep: where another thread's reaping can slip in.
    type Hook = Box<dyn FnOnce(&VerbsConn)>;

    thread_local! {
        pub(super) static BEFORE_SLEEP: std::cell::Cell<Option<Hook>> = const { std::cell::Cell::new(None) };
    }

    /// A connected pair on `GPU_RDMA_TEST_DEVICE` whose waits never spin.
    fn pair() -> (Connection, Connection, Domain) {
        let device = std::env::var("GPU_RDMA_TEST_DEVICE").expect("GPU_RDMA_TEST_DEVICE names the RDMA device");
        let d = Domain::with_config(&DomainConfig::default().device(device).transport(TransportPolicy::Verbs))
            .expect("open the test device");
        let o = ConnectOptions::default().spin(Duration::ZERO);
        let listener = d.listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let so = o.clone();
        let accepting = std::thread::spawn(move || listener.accept_timeout(&so, Duration::from_secs(30)));
        let c = d.connect(addr, &o).unwrap();
        let s = accepting.join().unwrap().unwrap();
        (s, c, d)
    }

    #[test]
    #[ignore = "needs an RDMA device: set GPU_RDMA_TEST_DEVICE (cargo xtask test runs it on rxe0)"]
    fn a_sleeper_whose_completion_another_thread_reaped_first_is_rung_awake() {
        let (s, c, d) = pair();
        let conn = Arc::clone(c.verbs_conn().expect("a verbs connection"));
        let s = Arc::new(s);
        // A receive the peer answers only once the wait below is about to sleep.
        let r = c.recv(d.alloc(64).unwrap());
        let before = conn.lock().q.changes();
        let peer = Arc::clone(&s);
        // The thief, between the wait's last look and its sleep: the peer
        // sends, and the engine's progress takes the channel's event and
        // reaps the receive's completion, as a second waiting thread or the
        // engine's thread would. Nothing completes after it.
        BEFORE_SLEEP.set(Some(Box::new(move |conn: &VerbsConn| {
            peer.send_inline(b"now", None).wait().unwrap();
            let until = Instant::now() + Duration::from_secs(10);
            while conn.lock().q.changes() == before {
                assert!(Instant::now() < until, "the receive never completed");
                conn.engine_progress(true, false);
            }
        })));
        // Without the bell, this wait would sleep to its deadline (and only
        // then find the completion): the event it sleeps on is gone, and
        // so is the completion. The deadline is far beyond anything the
        // wait needs; reaching it is the failure.
        let limit = Duration::from_secs(10);
        let until = Instant::now() + limit;
        let mut due = Deadline::after(limit, "the test's receive");
        let woken = conn.wait_until(&mut due, |st| st.q.changes() != before).unwrap();
        assert!(BEFORE_SLEEP.take().is_none(), "the wait never slept, so the thief never ran");
        assert!(woken && Instant::now() < until, "the wait slept through the completion another thread reaped");
        assert_eq!(r.into_buffer().map(|b| b[..3].to_vec()).ok(), Some(b"now".to_vec()));
    }
}
