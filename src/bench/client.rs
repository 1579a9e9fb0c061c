//! The client's loops: bandwidth and latency at one size, the whole run,
//! and its ends of the parameter check and of the test.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::completion::Completion;
use crate::connection::{Connection, Pending, Persistent, PersistentRecv, Transfer};
use crate::error::{Error, Result};
use crate::memory::{LocalBuffer, LocalSlice, RemoteRegion, RemoteSlice};
use crate::protocol::list::Piece;

use super::params::{DONE, LocalMode, Params, Test};
use super::report::{BwRow, LatRow, MIB, Row, peak_rate};

/// Sends of a ping-pong whose completions nobody waits for on the timed
/// path (perftest does not wait for them either): the oldest is waited for
/// once more than [`Trailing::MAX`] are outstanding, the rest at the end.
/// The sends go unsignaled ([`Connection::send_unsignaled`]), and at least
/// every 64th request is signaled, so by then the oldest is known done and
/// the wait takes no polling. A failure still surfaces, from here or as the
/// connection's error on the next receive. Inline sends need none of this:
/// see [`LastInline`].
pub(super) struct Trailing<B: Send + 'static> {
    q: VecDeque<Pending<B>>,
}

impl<B: Send + 'static> Trailing<B> {
    const MAX: usize = 128;

    pub(super) fn new() -> Self {
        Trailing { q: VecDeque::with_capacity(Self::MAX + 1) }
    }

    pub(super) fn push(&mut self, p: Pending<B>, timeout: Duration) -> Result<()> {
        self.q.push_back(p);
        if self.q.len() > Self::MAX {
            if let Some(mut oldest) = self.q.pop_front() {
                oldest.wait_timeout(timeout)?;
            }
        }
        Ok(())
    }

    pub(super) fn drain(&mut self, timeout: Duration) -> Result<()> {
        while let Some(mut p) = self.q.pop_front() {
            p.wait_timeout(timeout)?;
        }
        Ok(())
    }
}

/// The sends of a ping-pong too long to go inline, from one range: a ring
/// of [`Persistent`] sends, each reposted a lap later, as perftest reposts
/// its prebuilt send (it does not wait for its sends either). No handle is
/// built or dropped per message. The sends go unsignaled, and at least
/// every 64th request is signaled, so a lap later a slot's send is known
/// done and making it ready takes no polling. A failure still surfaces,
/// from that wait or as the connection's error on the next receive.
pub(super) struct SendRing<B: Send + 'static> {
    /// Each slot's send and its length.
    slots: Vec<(Persistent<B>, usize)>,
    /// The slot the next send uses.
    next: usize,
}

impl<B: LocalBuffer> SendRing<B> {
    const LAP: usize = 128;

    pub(super) fn new() -> Self {
        SendRing { slots: Vec::with_capacity(Self::LAP), next: 0 }
    }

    /// Sends `len` bytes, `local(len)`, from the next slot: the slot's
    /// send again (made ready by [`ready_next`](Self::ready_next)), or a
    /// new persistent send while the ring fills and when the length changed.
    pub(super) fn send(
        &mut self,
        conn: &Connection,
        len: usize,
        local: impl FnOnce(usize) -> LocalSlice<B>,
    ) -> Result<()> {
        match self.slots.get_mut(self.next) {
            Some((slot, n)) if *n == len => slot.repost()?,
            // Finished (made ready): nothing of it is in flight to keep.
            Some(slot) => *slot = (conn.send_persistent(local(len)), len),
            None => self.slots.push((conn.send_persistent(local(len)), len)),
        }
        self.next = (self.next + 1) % Self::LAP;
        Ok(())
    }

    /// Waits until the slot the next send uses has finished its last round
    /// (off the timed path).
    pub(super) fn ready_next(&mut self, timeout: Duration) -> Result<()> {
        match self.slots.get_mut(self.next) {
            Some((slot, _)) if !slot.is_done() => slot.wait_timeout(timeout).map(drop),
            _ => Ok(()),
        }
    }

    /// Waits for every send still in flight.
    pub(super) fn drain(&mut self, timeout: Duration) -> Result<()> {
        self.slots.iter_mut().filter(|(s, _)| !s.is_done()).try_for_each(|(s, _)| s.wait_timeout(timeout).map(drop))
    }
}

/// Inline sends of a ping-pong, not tracked one by one (perftest does not
/// track its sends either): each handle is dropped when the next send is
/// posted, which costs next to nothing and loses nothing. The connection
/// still learns each send's outcome from a later signaled request, and a
/// send that fails breaks the (reliable) connection, which the next
/// receive reports. The last send is waited for at the end.
pub(super) struct LastInline(Option<Pending<()>>);

impl LastInline {
    pub(super) fn new() -> Self {
        LastInline(None)
    }

    pub(super) fn replace(&mut self, p: Pending<()>) {
        drop(self.0.replace(p));
    }

    pub(super) fn finish(&mut self, timeout: Duration) -> Result<()> {
        match self.0.take() {
            Some(mut p) => p.wait_timeout(timeout).map(drop),
            None => Ok(()),
        }
    }
}

enum InFlight<B: Send + 'static> {
    One(Pending<B>),
    Chain(Pending<Vec<B>>),
}

impl<B: Send + 'static> InFlight<B> {
    fn wait(&mut self, timeout: Duration) -> Result<Completion> {
        match self {
            InFlight::One(p) => p.wait_timeout(timeout),
            InFlight::Chain(p) => p.wait_timeout(timeout),
        }
    }
}

#[derive(Clone, Copy)]
enum BwOp {
    Write(RemoteSlice),
    Read(RemoteSlice),
    Send,
}

fn post_one<B: LocalBuffer + Clone>(conn: &Connection, op: BwOp, local: &B, size: usize) -> Pending<B> {
    let l = local.clone().slice(..size);
    match op {
        BwOp::Write(r) => conn.write(l, &r),
        BwOp::Read(r) => conn.read(l, &r),
        BwOp::Send => conn.send(l),
    }
}

fn post_chain<B: LocalBuffer + Clone>(conn: &Connection, op: BwOp, local: &B, size: usize, n: u64) -> Pending<Vec<B>> {
    let mut b = conn.batch();
    for _ in 0..n {
        let l = local.clone().slice(..size);
        b = match op {
            BwOp::Write(r) => b.write(l, &r),
            BwOp::Read(r) => b.read(l, &r),
            BwOp::Send => b.send(l),
        };
    }
    b.post()
}

/// Timestamps for the timed loops that cost next to nothing to take: the
/// time-stamp counter on x86-64 (as perftest uses), converted with its rate
/// measured against the system clock over the same run; elsewhere,
/// nanoseconds of [`Instant`]. (On machines without a usable TSC clock
/// source, such as emulated ones, every `Instant::now` is a system call and
/// a timer read that would land inside the measurement.)
pub(super) struct Stopwatch {
    start: Instant,
    start_ticks: u64,
}

impl Stopwatch {
    fn start() -> Stopwatch {
        let start = Instant::now();
        let mut w = Stopwatch { start, start_ticks: 0 };
        w.start_ticks = w.ticks();
        w
    }

    #[inline]
    fn ticks(&self) -> u64 {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: RDTSC exists on every x86-64 processor and has no
            // preconditions.
            unsafe { core::arch::x86_64::_rdtsc() }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self.start.elapsed().as_nanos() as u64
        }
    }

    /// Seconds per tick, from the run so far.
    fn seconds_per_tick(&self) -> f64 {
        let secs = self.start.elapsed().as_secs_f64();
        let ticks = self.ticks().wrapping_sub(self.start_ticks);
        if ticks == 0 { 0.0 } else { secs / ticks as f64 }
    }
}

/// The client's side of a bandwidth test at one size: `iters` operations
/// of `size` bytes from the start of `local` (and of the remote region),
/// at most `tx_depth` in flight, in signalled chains of `cq_mod`.
///
/// # Errors
/// The first failed operation's error; [`Error::Timeout`] when one takes
/// longer than `timeout`.
#[allow(clippy::too_many_arguments)]
pub fn bandwidth<B: LocalBuffer + Clone>(
    conn: &Connection,
    test: Test,
    local: &B,
    mode: LocalMode,
    remote: Option<&RemoteRegion>,
    size: usize,
    params: &Params,
    timeout: Duration,
) -> Result<BwRow> {
    let target = || match remote {
        Some(r) => r.slice(0..size as u64),
        None => Err(Error::InvalidArgument(format!("{test} needs the server's region"))),
    };
    let op = match test {
        Test::ListBw => return list_bandwidth(conn, local, &target()?, size, params, timeout),
        Test::WriteBw => BwOp::Write(target()?),
        Test::ReadBw => BwOp::Read(target()?),
        Test::SendBw => BwOp::Send,
        other => return Err(Error::InvalidArgument(format!("{other} is not a bandwidth test"))),
    };
    let iters = u64::from(params.iters);
    let depth = u64::from(params.tx_depth.min(conn.info().send_queue_depth)).max(1);
    let chain = if mode.batch { u64::from(params.cq_mod).clamp(1, depth) } else { 1 };
    let mut inflight: VecDeque<(InFlight<B>, u64)> = VecDeque::with_capacity((depth / chain + 1) as usize);
    let mut stamps: Vec<(u64, u64)> = Vec::with_capacity((iters / chain + 2) as usize);
    let (mut posted, mut completed, mut outstanding) = (0u64, 0u64, 0u64);
    let clock = Stopwatch::start();
    while completed < iters {
        while posted < iters && outstanding + chain.min(iters - posted) <= depth {
            let n = chain.min(iters - posted);
            let p = if mode.batch {
                InFlight::Chain(post_chain(conn, op, local, size, n))
            } else {
                InFlight::One(post_one(conn, op, local, size))
            };
            inflight.push_back((p, n));
            posted += n;
            outstanding += n;
        }
        let Some((mut p, n)) = inflight.pop_front() else { break };
        p.wait(timeout)?;
        completed += n;
        outstanding -= n;
        stamps.push((completed, clock.ticks()));
    }
    // Completions are seen in bursts after a wait: a window of several
    // queue depths keeps a burst from passing for a peak.
    Ok(bw_row(&clock, &stamps, size, iters, 4 * depth))
}

/// A bandwidth row from completion stamps (operations done, clock ticks);
/// the peak over windows of at least `window` operations.
fn bw_row(clock: &Stopwatch, stamps: &[(u64, u64)], size: usize, iters: u64, window: u64) -> BwRow {
    let per_tick = clock.seconds_per_tick();
    let stamps: Vec<(u64, f64)> =
        stamps.iter().map(|&(n, t)| (n, t.wrapping_sub(clock.start_ticks) as f64 * per_tick)).collect();
    let secs = stamps.last().map_or(0.0, |s| s.1).max(1e-9);
    BwRow {
        bytes: size,
        iterations: iters,
        bw_peak_mib_s: peak_rate(&stamps, size, (iters / 10).max(window).min(iters)) / MIB,
        bw_average_mib_s: (iters as f64 * size as f64) / secs / MIB,
        msg_rate_mpps: iters as f64 / secs / 1e6,
    }
}

/// Writes of `size` bytes in transfer lists of `params.list` pieces, two
/// lists in flight (so one is posting while the other drains), all polled
/// in turn as perftest busy-polls. Each piece writes the same range: not
/// adjacent to the next, so every piece is one request on the wire.
fn list_bandwidth<B: LocalBuffer + Clone>(
    conn: &Connection,
    local: &B,
    target: &RemoteSlice,
    size: usize,
    params: &Params,
    _timeout: Duration,
) -> Result<BwRow> {
    let iters = u64::from(params.iters);
    let per = u64::from(params.list).clamp(1, iters.max(1));
    let mut inflight: VecDeque<(Transfer<B>, u64)> = VecDeque::with_capacity(2);
    let mut stamps: Vec<(u64, u64)> = Vec::with_capacity((iters / per + 2) as usize);
    let (mut posted, mut completed) = (0u64, 0u64);
    let clock = Stopwatch::start();
    while completed < iters {
        while inflight.len() < 2 && posted < iters {
            let n = per.min(iters - posted);
            let pieces = (0..n).map(|_| Piece::new(0, 0, size as u64));
            inflight.push_back((conn.write_list(local.clone(), target, pieces), n));
            posted += n;
        }
        // The list behind posts what fits; the front one waits for one of
        // its posts (the operation timeout bounds it).
        for (t, _) in inflight.iter_mut().skip(1) {
            if let Some(Err(e)) = t.poll().transpose() {
                return Err(e);
            }
        }
        let Some((front, n)) = inflight.front_mut() else { break };
        if front.wait_step(None)?.is_some() {
            completed += *n;
            inflight.pop_front();
            stamps.push((completed, clock.ticks()));
        }
    }
    Ok(bw_row(&clock, &stamps, size, iters, 2 * per))
}

/// Where a ping-pong's second direction goes in a buffer of `len` bytes
/// whose first `size` bytes the first direction uses: the second half's
/// start, as perftest lays out its sends and receives, when both fit
/// apart; else the last `size` bytes (overlapping the first when the
/// buffer is shorter than both).
pub(super) fn second_half(len: usize, size: usize) -> usize {
    if size <= len / 2 { len / 2 } else { len.saturating_sub(size) }
}

/// The client's side of a latency test at one size. A ping-pong sends
/// from the start of `local` and receives into its second half
/// (`second_half`), as perftest keeps its sends and receives in two
/// halves of its buffer: with `local` at least twice `size`, no send reads
/// what a receive just wrote (in soft-RoCE, where the CPU moves the bytes,
/// that costs a transfer of the written cache lines between CPUs on every
/// message).
///
/// # Errors
/// The first failed operation's error, or a timeout.
#[allow(clippy::too_many_arguments)]
pub fn latency<B: LocalBuffer + Clone>(
    conn: &Connection,
    test: Test,
    local: &B,
    mode: LocalMode,
    remote: Option<&RemoteRegion>,
    size: usize,
    params: &Params,
    timeout: Duration,
) -> Result<LatRow> {
    let iters = params.iters as usize;
    // Ticks per sample, converted once the run is over.
    let mut ticks: Vec<u64> = Vec::with_capacity(iters);
    let clock = Stopwatch::start();
    // Ping-pongs report one way, half the round trip, as perftest does.
    let halve = test != Test::ReadLat;
    let inline = mode.inline && size <= conn.info().max_inline as usize;
    let zeros = vec![0u8; if inline { size } else { 0 }];
    let mut sent = Trailing::new();
    let mut ring = SendRing::new();
    match test {
        Test::SendLat => {
            let mut pings = Pings { conn, local, size, inline, zeros: &zeros, sends: &mut ring };
            match ring_slots(local, size) {
                Some(at) => ping_into_ring(&mut pings, at, iters, timeout, &clock, &mut ticks)?,
                None => ping_into_persistent(&mut pings, iters, timeout, &clock, &mut ticks)?,
            }
        }
        Test::WriteLat => {
            let rs = remote
                .ok_or_else(|| Error::InvalidArgument("write-lat needs the server's region".into()))?
                .slice(0..size as u64)?;
            for _ in 0..iters {
                let mut rx = conn.recv_imm();
                let t0 = clock.ticks();
                let tx = conn.write_with_imm(local.clone().slice(..size), &rs, size as u32);
                rx.wait_timeout(timeout)?;
                ticks.push(clock.ticks().wrapping_sub(t0));
                sent.push(tx, timeout)?;
            }
        }
        Test::ReadLat => {
            let rs = remote
                .ok_or_else(|| Error::InvalidArgument("read-lat needs the server's region".into()))?
                .slice(0..size as u64)?;
            for _ in 0..iters {
                let t0 = clock.ticks();
                conn.read(local.clone().slice(..size), &rs).wait_timeout(timeout)?;
                ticks.push(clock.ticks().wrapping_sub(t0));
            }
        }
        other => return Err(Error::InvalidArgument(format!("{other} is not a latency test"))),
    }
    sent.drain(timeout)?;
    ring.drain(timeout)?;
    let us = clock.seconds_per_tick() * 1e6 / if halve { 2.0 } else { 1.0 };
    Ok(LatRow::from_ticks(size, &mut ticks, us))
}

/// A ping-pong's sends: inline, or from a ring of persistent sends.
struct Pings<'a, B: LocalBuffer + Clone> {
    conn: &'a Connection,
    local: &'a B,
    size: usize,
    inline: bool,
    zeros: &'a [u8],
    sends: &'a mut SendRing<B>,
}

impl<B: LocalBuffer + Clone> Pings<'_, B> {
    #[inline]
    fn send(&mut self) -> Result<()> {
        if self.inline {
            // The reply says it arrived: nothing to track.
            self.conn.send_inline_untracked(self.zeros, None)
        } else {
            let local = self.local;
            self.sends.send(self.conn, self.size, |n| local.clone().slice(..n))
        }
    }

    /// Bookkeeping after the sample, as perftest keeps its own off the
    /// timed path.
    fn after_sample(&mut self, timeout: Duration) -> Result<()> {
        if self.inline { Ok(()) } else { self.sends.ready_next(timeout) }
    }
}

/// Where a ping-pong's two receive slots of `size` bytes start, at the
/// end of `local` and apart from the sends (its start): for a
/// [`RecvRing`](crate::RecvRing), in host memory. `None` for GPU memory
/// (whose ping-pong keeps one loop on every path) and a buffer too short
/// for three messages.
pub(super) fn ring_slots<B: LocalBuffer + Clone>(local: &B, size: usize) -> Option<usize> {
    let host = local.parts().path.is_none();
    let at = local.buffer_len().checked_sub(size.checked_mul(2)?)?;
    (host && size > 0 && at >= size).then_some(at)
}

/// A send-lat loop receiving into a ring of two slots from `at`. Each
/// reply's slot is retired, and posted again after the next send, for the
/// reply after that, while a reply is on the way: as the loop with
/// persistent receives posts it, off the path from a reply to the next
/// send. After the last reply no receive is left to swallow the next
/// size's first reply.
fn ping_into_ring<B: LocalBuffer + Clone>(
    pings: &mut Pings<'_, B>,
    at: usize,
    iters: usize,
    timeout: Duration,
    clock: &Stopwatch,
    ticks: &mut Vec<u64>,
) -> Result<()> {
    let mut rx = pings.conn.recv_ring(pings.local.clone().slice(at..), pings.size, iters.min(2));
    for i in 0..iters {
        let t0 = clock.ticks();
        pings.send()?;
        if i + 1 < iters {
            rx.post_idle();
        }
        rx.next_timeout(timeout)?.retire();
        ticks.push(clock.ticks().wrapping_sub(t0));
        pings.after_sample(timeout)?;
    }
    Ok(())
}

/// A send-lat loop receiving into two persistent receives on one range,
/// used in turn: iteration *i* waits on slot *i* % 2 while the next
/// receive sits in the other, each reposted into its range as perftest
/// reposts its prebuilt one. Into the buffer's second half, apart from the
/// sends (its start). For GPU memory, and a buffer too short for a ring's
/// two slots apart from the sends.
fn ping_into_persistent<B: LocalBuffer + Clone>(
    pings: &mut Pings<'_, B>,
    iters: usize,
    timeout: Duration,
    clock: &Stopwatch,
    ticks: &mut Vec<u64>,
) -> Result<()> {
    // The next receive is posted while the reply is on the way: off the
    // path from a reply to the next send. Only as many receives as
    // replies: a spare one would swallow the next size's first reply.
    let at = second_half(pings.local.buffer_len(), pings.size);
    let (conn, local, size) = (pings.conn, pings.local, pings.size);
    let receive = || conn.recv_persistent(local.clone().slice(at..at + size));
    let mut rx: [Option<PersistentRecv<B>>; 2] = [(iters > 0).then(receive), None];
    for i in 0..iters {
        let t0 = clock.ticks();
        pings.send()?;
        if i + 1 < iters {
            match &mut rx[(i + 1) % 2] {
                Some(next) => next.repost()?,
                slot @ None => *slot = Some(receive()),
            }
        }
        if let Some(r) = &mut rx[i % 2] {
            r.wait_timeout(timeout)?;
        }
        ticks.push(clock.ticks().wrapping_sub(t0));
        pings.after_sample(timeout)?;
    }
    Ok(())
}

/// The client: sends `params`, runs every size, tells the server it is
/// done, and returns the rows. `remote` is the server's advertised region
/// (for write and read tests); `local` holds at least the largest size
/// (twice that keeps a ping-pong's sends and receives apart, three times
/// its sends and a receive ring's two slots: [`latency`]).
///
/// # Errors
/// A refused or mismatched handshake, a failed operation, a timeout.
pub fn run_client<B: LocalBuffer + Clone>(
    conn: &Connection,
    params: &Params,
    local: &B,
    mode: LocalMode,
    remote: Option<&RemoteRegion>,
    timeout: Duration,
    mut on_row: impl FnMut(&Row),
) -> Result<Vec<Row>> {
    params.validate()?;
    if local.buffer_len() < params.max_size() {
        return Err(Error::InvalidArgument(format!(
            "the local buffer has {} bytes, the largest size is {}",
            local.buffer_len(),
            params.max_size()
        )));
    }
    if let Some(r) = remote {
        if r.len < params.max_size() as u64 {
            return Err(Error::InvalidArgument(format!(
                "the server's buffer has {} bytes, the largest size here is {}: give both sides the same -s/-a",
                r.len,
                params.max_size()
            )));
        }
    }
    agree(conn, params, timeout)?;
    let mut rows = Vec::with_capacity(params.sizes.len());
    for &size in &params.sizes {
        let row = if params.test.is_bw() {
            Row::Bw(bandwidth(conn, params.test, local, mode, remote, size, params, timeout)?)
        } else {
            Row::Lat(latency(conn, params.test, local, mode, remote, size, params, timeout)?)
        };
        on_row(&row);
        rows.push(row);
    }
    finish(conn, timeout)?;
    Ok(rows)
}

/// The client's half of the parameter check: returns once a [`run_server`](super::run_server)
/// with the same `params` is serving (then the client's operations may
/// start; [`finish`] ends the test).
///
/// # Errors
/// [`Error::InvalidArgument`] when the server runs with other parameters;
/// a failed operation or a timeout.
pub fn agree(conn: &Connection, params: &Params, timeout: Duration) -> Result<()> {
    // The parameters' digest goes as an immediate; the server answers with
    // DONE when they match its own, anything else when they do not.
    let mut verdict = conn.recv_imm();
    conn.send_inline(&[], Some(params.digest())).wait_timeout(timeout)?;
    let answer = verdict.wait_timeout(timeout)?;
    if answer.imm != Some(DONE) {
        return Err(Error::InvalidArgument(
            "the server runs another test, other sizes or another iteration count: give both sides the same flags"
                .into(),
        ));
    }
    Ok(())
}

/// Tells a [`serve`](super::serve)ing peer that the test is over, and returns once it
/// is: the server answers with the number of receives it still has posted
/// and this side fills them, so that the connection carries nothing of the
/// test into whatever runs on it next.
///
/// # Errors
/// A failed send or a timeout.
pub fn finish(conn: &Connection, timeout: Duration) -> Result<()> {
    let mut answer = conn.recv_imm();
    conn.send_inline(&[], Some(DONE)).wait_timeout(timeout)?;
    let left = answer.wait_timeout(timeout)?.imm.unwrap_or(0);
    let mut fill = LastInline::new();
    for _ in 0..left {
        fill.replace(conn.send_inline(&[], None));
    }
    fill.finish(timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stopwatch_agrees_with_the_system_clock() {
        let w = Stopwatch::start();
        let t0 = w.ticks();
        std::thread::sleep(Duration::from_millis(30));
        let secs = w.ticks().wrapping_sub(t0) as f64 * w.seconds_per_tick();
        assert!((0.025..0.5).contains(&secs), "{secs}");
    }

    #[test]
    fn the_second_half_stays_in_the_buffer_and_apart_when_both_fit() {
        for len in (0..=40).chain([4096, 8192, 8193]) {
            for size in 0..=len {
                let at = second_half(len, size);
                assert!(at + size <= len, "len {len} size {size}: {at} runs past the end");
                if 2 * size <= len {
                    assert!(at >= size, "len {len} size {size}: {at} overlaps the first {size} bytes");
                    assert_eq!(at, len / 2, "len {len} size {size}");
                }
            }
        }
        // A buffer of twice the largest message: the halves perftest uses.
        assert_eq!(second_half(8192, 1024), 4096);
        assert_eq!(second_half(8192, 4096), 4096);
    }

    #[test]
    fn a_rings_two_slots_sit_at_the_end_apart_from_the_sends_or_not_at_all() {
        let tcp = crate::DomainConfig::default().transport(crate::TransportPolicy::Tcp);
        let d = crate::Domain::with_config(&tcp).unwrap();
        // The bench's buffer: three times the largest message.
        let bench = d.alloc(3 * 4096).unwrap().share();
        assert_eq!(ring_slots(&bench, 4096), Some(4096));
        assert_eq!(ring_slots(&bench, 2), Some(3 * 4096 - 4));
        assert_eq!(ring_slots(&bench, 4097), None, "the slots would reach into the sends");
        assert_eq!(ring_slots(&bench, 0), None, "a ring has no empty slots");
        assert_eq!(ring_slots(&bench, usize::MAX), None);
        // Twice the largest: the persistent receives' loop at that size.
        let halves = d.alloc(8192).unwrap().share();
        assert_eq!(ring_slots(&halves, 4096), None);
        assert_eq!(ring_slots(&halves, 2730), Some(8192 - 2 * 2730));
    }
}
