//! The measurement loops behind `gpu-rdma bench`, in perftest's terms, on
//! any [`Connection`]: bandwidth by write, read and send with many requests
//! in flight, and latency by ping-pong (send, write with immediate) or by
//! one read at a time. The criterion benches use them too.
//!
//! Both ends run the same [`Params`] (as with perftest, both sides are given
//! the same flags); the client sends its [`Params`] first and the server
//! refuses a mismatch with [`Error::InvalidArgument`] on both sides instead
//! of measuring something else.
//!
//! How the loops stay out of the way:
//! - bandwidth: up to `tx_depth` requests in flight, posted in chains of
//!   `cq_mod` with only the last signalled (one completion per chain, one
//!   doorbell per chain); staged GPU buffers, which cannot be chained, go
//!   one by one;
//! - latency: the connection's busy-poll window ([`ConnectOptions::spin`](crate::ConnectOptions))
//!   covers the round trip, small host-memory sends go inline;
//! - nothing on the timed path allocates in proportion to the iterations:
//!   timestamps go into vectors sized up front.
//!
//! Units as perftest prints them: MB/sec is MiB/s (2^20 bytes), latency in
//! microseconds, one-way for the ping-pong tests (half the round trip) and
//! the whole operation for reads.

use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::completion::Completion;
use crate::connection::{Connection, Pending};
use crate::error::{Error, Result};
use crate::memory::{Access, Exposed, HostMemory, LocalBuffer, RemoteRegion, RemoteSlice};

/// A perftest test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Test {
    /// Bandwidth by RDMA write (`ib_write_bw`).
    WriteBw,
    /// Bandwidth by RDMA read (`ib_read_bw`).
    ReadBw,
    /// Bandwidth by send/receive (`ib_send_bw`).
    SendBw,
    /// Latency by write with immediate, ping-pong (`ib_write_lat` polls
    /// memory instead, which GPU memory does not allow).
    WriteLat,
    /// Latency of one read at a time (`ib_read_lat`).
    ReadLat,
    /// Latency by send/receive, ping-pong (`ib_send_lat`).
    SendLat,
}

impl Test {
    /// Every test.
    pub const ALL: [Test; 6] =
        [Test::WriteBw, Test::ReadBw, Test::SendBw, Test::WriteLat, Test::ReadLat, Test::SendLat];

    /// `write-bw`, ...
    pub fn name(self) -> &'static str {
        match self {
            Test::WriteBw => "write-bw",
            Test::ReadBw => "read-bw",
            Test::SendBw => "send-bw",
            Test::WriteLat => "write-lat",
            Test::ReadLat => "read-lat",
            Test::SendLat => "send-lat",
        }
    }

    /// The perftest program that measures the same thing.
    pub fn perftest(self) -> &'static str {
        match self {
            Test::WriteBw => "ib_write_bw",
            Test::ReadBw => "ib_read_bw",
            Test::SendBw => "ib_send_bw",
            Test::WriteLat => "ib_write_lat",
            Test::ReadLat => "ib_read_lat",
            Test::SendLat => "ib_send_lat",
        }
    }

    /// Whether it measures bandwidth (else latency).
    pub fn is_bw(self) -> bool {
        matches!(self, Test::WriteBw | Test::ReadBw | Test::SendBw)
    }

    /// The rights the server's region is exposed with.
    pub fn server_access(self) -> Access {
        match self {
            Test::WriteBw | Test::WriteLat => Access::REMOTE_WRITE,
            Test::ReadBw | Test::ReadLat => Access::REMOTE_READ,
            Test::SendBw | Test::SendLat => Access::empty(),
        }
    }

    /// The rights the client's region is exposed with (the server writes
    /// back in the write ping-pong).
    pub fn client_access(self) -> Access {
        if self == Test::WriteLat { Access::REMOTE_WRITE } else { Access::empty() }
    }

    /// perftest's default iteration count.
    pub fn default_iters(self) -> u32 {
        if self.is_bw() { 5000 } else { 1000 }
    }

    fn code(self) -> u8 {
        Test::ALL.iter().position(|t| *t == self).unwrap_or(0) as u8
    }
}

impl FromStr for Test {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Test::ALL.into_iter().find(|t| t.name() == s || t.perftest() == s).ok_or_else(|| {
            Error::InvalidArgument(format!("test `{s}`: expected one of {}", Test::ALL.map(Test::name).join(", ")))
        })
    }
}

impl fmt::Display for Test {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// perftest's `-a`: every power of two from 2 bytes to 8 MiB.
pub fn all_sizes() -> Vec<usize> {
    (1..=23).map(|k| 1usize << k).collect()
}

/// What both ends run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Params {
    /// The test.
    pub test: Test,
    /// Message sizes, in order (one, or [`all_sizes`]).
    pub sizes: Vec<usize>,
    /// Iterations per size.
    pub iters: u32,
    /// Requests in flight at most (bandwidth tests).
    pub tx_depth: u32,
    /// Requests per signalled chain (bandwidth tests).
    pub cq_mod: u32,
}

const PARAMS_LEN: usize = 24;
const PARAMS_MAGIC: u32 = 0x4742_4e31; // "GBN1"
/// The immediate that ends a test.
const DONE: u32 = u32::MAX;

impl Params {
    /// The largest size.
    pub fn max_size(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(0)
    }

    /// Checks the values a run depends on.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the bad value.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.sizes.is_empty() || self.sizes.contains(&0) {
            return bad("sizes must be at least 1 byte".into());
        }
        if self.iters < 5 {
            return bad(format!("{} iterations: at least 5, as perftest", self.iters));
        }
        if self.tx_depth == 0 || self.cq_mod == 0 {
            return bad("tx depth and CQ moderation must be at least 1".into());
        }
        if self.max_size() > u32::MAX as usize - 1 {
            return bad("sizes must be below 4 GiB".into());
        }
        Ok(())
    }

    /// What the client sends first (as an immediate), enough to tell a
    /// mismatch: a checksum of the test, the sizes and the iterations.
    fn digest(&self) -> u32 {
        // Never DONE, which the server's answer uses.
        crc32fast::hash(&self.encode()).min(DONE - 1)
    }

    fn encode(&self) -> [u8; PARAMS_LEN] {
        let all = self.sizes == all_sizes();
        let mut b = [0u8; PARAMS_LEN];
        b[0..4].copy_from_slice(&PARAMS_MAGIC.to_le_bytes());
        b[4] = self.test.code();
        b[5] = u8::from(all);
        b[8..12].copy_from_slice(&(self.sizes.len() as u32).to_le_bytes());
        b[12..16].copy_from_slice(&(self.max_size() as u32).to_le_bytes());
        b[16..20].copy_from_slice(&self.iters.to_le_bytes());
        b[20..24].copy_from_slice(&(self.sizes.iter().map(|s| *s as u32).fold(0u32, u32::wrapping_add)).to_le_bytes());
        b
    }
}

/// One bandwidth result, perftest's columns.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BwRow {
    /// Message size.
    pub bytes: usize,
    /// Messages.
    pub iterations: u64,
    /// The best rate over any stretch of a tenth of the run (at least four
    /// send-queue depths), MiB/s.
    pub bw_peak_mib_s: f64,
    /// All bytes over all the time, MiB/s.
    pub bw_average_mib_s: f64,
    /// Millions of messages per second.
    pub msg_rate_mpps: f64,
}

impl BwRow {
    /// perftest's header line.
    pub const HEADER: &'static str = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";
}

impl fmt::Display for BwRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            " {:<10} {:<10}       {:>10.2}         {:>10.2}           {:.6}",
            self.bytes, self.iterations, self.bw_peak_mib_s, self.bw_average_mib_s, self.msg_rate_mpps
        )
    }
}

/// One latency result, perftest's columns, in microseconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LatRow {
    /// Message size.
    pub bytes: usize,
    /// Samples.
    pub iterations: u64,
    /// Fastest.
    pub t_min: f64,
    /// Slowest.
    pub t_max: f64,
    /// Median.
    pub t_typical: f64,
    /// Mean.
    pub t_avg: f64,
    /// Standard deviation.
    pub t_stdev: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p99_9: f64,
}

impl LatRow {
    /// perftest's header line.
    pub const HEADER: &'static str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]";

    /// The statistics of `samples` (microseconds; reordered).
    pub fn from_samples(bytes: usize, samples: &mut [f64]) -> LatRow {
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let at = |q: f64| {
            if n == 0 {
                return 0.0;
            }
            let i = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
            samples[i]
        };
        let avg = if n == 0 { 0.0 } else { samples.iter().sum::<f64>() / n as f64 };
        let var = if n < 2 { 0.0 } else { samples.iter().map(|s| (s - avg) * (s - avg)).sum::<f64>() / (n - 1) as f64 };
        LatRow {
            bytes,
            iterations: n as u64,
            t_min: samples.first().copied().unwrap_or(0.0),
            t_max: samples.last().copied().unwrap_or(0.0),
            t_typical: at(0.5),
            t_avg: avg,
            t_stdev: var.sqrt(),
            p99: at(0.99),
            p99_9: at(0.999),
        }
    }
}

impl fmt::Display for LatRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            " {:<7} {:<10}   {:>8.2}       {:>8.2}     {:>8.2}           {:>8.2}        {:>8.2}         {:>8.2}               {:>8.2}",
            self.bytes,
            self.iterations,
            self.t_min,
            self.t_max,
            self.t_typical,
            self.t_avg,
            self.t_stdev,
            self.p99,
            self.p99_9
        )
    }
}

/// A result row of either kind.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Row {
    /// From a bandwidth test.
    Bw(BwRow),
    /// From a latency test.
    Lat(LatRow),
}

impl fmt::Display for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Row::Bw(r) => r.fmt(f),
            Row::Lat(r) => r.fmt(f),
        }
    }
}

/// How the local buffer may be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalMode {
    /// Chains of requests allowed (not for staged GPU memory).
    pub batch: bool,
    /// Small sends may be copied inline (host memory only).
    pub inline: bool,
}

impl LocalMode {
    /// Host memory: chains and inline sends.
    pub const HOST: LocalMode = LocalMode { batch: true, inline: true };
}

/// Where the server's memory is, for the write ping-pong: a write with
/// immediate into GPU memory is complete once it is visible on the GPU.
pub trait Landing: LocalBuffer + Clone {
    /// A receive for the peer's next write with immediate into `self`.
    fn await_write(&self, conn: &Connection) -> Pending<()>;
}

impl Landing for Exposed<HostMemory> {
    fn await_write(&self, conn: &Connection) -> Pending<()> {
        conn.recv_imm()
    }
}

#[cfg(feature = "cuda")]
impl Landing for Exposed<crate::cuda::CudaBuffer> {
    fn await_write(&self, conn: &Connection) -> Pending<()> {
        conn.recv_write(self)
    }
}

/// A shared region is never a write target here: a plain receive.
impl<M: crate::memory::Memory> Landing for crate::memory::Shared<M> {
    fn await_write(&self, conn: &Connection) -> Pending<()> {
        conn.recv_imm()
    }
}

/// Sends of a ping-pong whose completions nobody waits for on the timed
/// path (perftest does not wait for them either): polled when cheap, waited
/// for only when too many are outstanding, and at the end. A failure still
/// surfaces, from here or as the connection's error on the next receive.
struct Trailing<B: Send + 'static> {
    q: VecDeque<Pending<B>>,
}

impl<B: Send + 'static> Trailing<B> {
    const MAX: usize = 16;

    fn new() -> Self {
        Trailing { q: VecDeque::with_capacity(Self::MAX + 1) }
    }

    fn push(&mut self, p: Pending<B>, timeout: Duration) -> Result<()> {
        self.q.push_back(p);
        loop {
            let len = self.q.len();
            let Some(front) = self.q.front_mut() else { return Ok(()) };
            if front.poll()?.is_none() {
                if len <= Self::MAX {
                    return Ok(());
                }
                front.wait_timeout(timeout)?;
            }
            self.q.pop_front();
        }
    }

    fn drain(&mut self, timeout: Duration) -> Result<()> {
        while let Some(mut p) = self.q.pop_front() {
            p.wait_timeout(timeout)?;
        }
        Ok(())
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
struct Stopwatch {
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

/// The best rate over any stretch of at least `window` completed
/// operations, from `(completed, seconds since the start)` stamps
/// (perftest's peak is its best short stretch too). The average when the
/// run is shorter than a window.
fn peak_rate(stamps: &[(u64, f64)], size: usize, window: u64) -> f64 {
    let point = |i: usize| if i == 0 { (0, 0.0) } else { stamps[i - 1] };
    let mut best = 0.0f64;
    let mut j = 0;
    for k in 1..=stamps.len() {
        let (done, t) = point(k);
        // The latest start that still leaves a whole window.
        while j + 1 < k && done - point(j + 1).0 >= window {
            j += 1;
        }
        let (from, t0) = point(j);
        let secs = t - t0;
        if done - from >= window && secs > 0.0 {
            best = best.max((done - from) as f64 * size as f64 / secs);
        }
    }
    if best == 0.0 {
        if let Some(&(done, secs)) = stamps.last() {
            if secs > 0.0 {
                best = done as f64 * size as f64 / secs;
            }
        }
    }
    best
}

const MIB: f64 = (1u64 << 20) as f64;

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
    let per_tick = clock.seconds_per_tick();
    let stamps: Vec<(u64, f64)> =
        stamps.iter().map(|&(n, t)| (n, t.wrapping_sub(clock.start_ticks) as f64 * per_tick)).collect();
    let secs = stamps.last().map_or(0.0, |s| s.1).max(1e-9);
    Ok(BwRow {
        bytes: size,
        iterations: iters,
        // Completions are seen in bursts after a wait: a window of several
        // queue depths keeps a burst from passing for a peak.
        bw_peak_mib_s: peak_rate(&stamps, size, (iters / 10).max(4 * depth).min(iters)) / MIB,
        bw_average_mib_s: (iters as f64 * size as f64) / secs / MIB,
        msg_rate_mpps: iters as f64 / secs / 1e6,
    })
}

/// The client's side of a latency test at one size.
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
    let (mut sent_inline, mut sent) = (Trailing::new(), Trailing::new());
    match test {
        Test::SendLat => {
            // The next receive is posted, and the previous send looked at,
            // while the reply is on the way: off the path from a reply to the
            // next send. Only as many receives as replies: a spare one would
            // swallow the next size's first reply.
            let (mut last_inline, mut last) = (None, None);
            let mut rx = (iters > 0).then(|| conn.recv(local.clone().slice(..size)));
            for i in 0..iters {
                let t0 = clock.ticks();
                if inline {
                    let tx = conn.send_inline(&zeros, None);
                    if let Some(p) = last_inline.replace(tx) {
                        sent_inline.push(p, timeout)?;
                    }
                } else {
                    let tx = conn.send(local.clone().slice(..size));
                    if let Some(p) = last.replace(tx) {
                        sent.push(p, timeout)?;
                    }
                }
                let next = (i + 1 < iters).then(|| conn.recv(local.clone().slice(..size)));
                if let Some(mut r) = std::mem::replace(&mut rx, next) {
                    r.wait_timeout(timeout)?;
                }
                ticks.push(clock.ticks().wrapping_sub(t0));
            }
            if let Some(p) = last_inline {
                sent_inline.push(p, timeout)?;
            }
            if let Some(p) = last {
                sent.push(p, timeout)?;
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
    sent_inline.drain(timeout)?;
    sent.drain(timeout)?;
    let us = clock.seconds_per_tick() * 1e6 / if halve { 2.0 } else { 1.0 };
    let mut samples: Vec<f64> = ticks.iter().map(|&t| t as f64 * us).collect();
    Ok(LatRow::from_samples(size, &mut samples))
}

/// The client: sends `params`, runs every size, tells the server it is
/// done, and returns the rows. `remote` is the server's advertised region
/// (for write and read tests); `local` holds at least the largest size.
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

/// The client's half of the parameter check: returns once a [`run_server`]
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

/// The server: checks the client's parameters against `params`, then
/// serves the test until the client says it is done. `local` is the
/// server's exposed region (or receive buffer, for the send tests);
/// `client` the client's advertised region (the write ping-pong writes
/// back into it). `timeout` bounds each wait for the client.
///
/// # Errors
/// A parameter mismatch (also reported to the client), a failed operation,
/// a timeout, a lost connection.
pub fn run_server<B: Landing>(
    conn: &Connection,
    params: &Params,
    local: &B,
    mode: LocalMode,
    client: Option<&RemoteRegion>,
    timeout: Duration,
) -> Result<()> {
    params.validate()?;
    let max = params.max_size();
    if local.buffer_len() < max {
        return Err(Error::InvalidArgument(format!(
            "the local buffer has {} bytes, the largest size is {max}",
            local.buffer_len()
        )));
    }
    let first = conn.recv_imm().wait_timeout(timeout)?;
    let agree = first.imm == Some(params.digest());
    // What the test receives is posted before the verdict goes out, so the
    // client's first message finds it.
    let verdict = |conn: &Connection| -> Result<()> {
        conn.send_inline(&[], Some(if agree { DONE } else { 0 })).wait_timeout(timeout)?;
        if agree {
            Ok(())
        } else {
            Err(Error::InvalidArgument(
                "the client runs another test, other sizes or another iteration count: give both sides the same flags"
                    .into(),
            ))
        }
    };
    serve(conn, params.test, local, mode, client, timeout, verdict)
}

/// The server's side of `test` without the parameter exchange: posts what
/// the test receives, calls `ready`, then serves until the client's
/// [`finish`]. `local` must hold the largest message.
///
/// # Errors
/// What `ready` returns, a failed operation, a timeout, a lost connection.
pub fn serve<B: Landing>(
    conn: &Connection,
    test: Test,
    local: &B,
    mode: LocalMode,
    client: Option<&RemoteRegion>,
    timeout: Duration,
    ready: impl FnOnce(&Connection) -> Result<()>,
) -> Result<()> {
    let whole = local.buffer_len();
    match test {
        Test::WriteBw | Test::ReadBw | Test::ReadLat => {
            // Passive: the client's operations need nothing from this side.
            let done = conn.recv_imm();
            ready(conn)?;
            wait_done(done, timeout)?;
            end_of_test::<B>(conn, VecDeque::new(), timeout)
        }
        Test::SendBw => {
            let depth = conn.info().recv_queue_depth.clamp(1, 512) as usize;
            let mut posted: VecDeque<Pending<B>> =
                (0..depth).map(|_| conn.recv(local.clone().slice(..whole))).collect();
            ready(conn)?;
            loop {
                let Some(mut p) = posted.pop_front() else { unreachable!("receives are always posted") };
                let c = p.wait_timeout(timeout)?;
                if c.imm == Some(DONE) {
                    // The receives still posted would swallow what this
                    // connection receives next: the client fills them.
                    return end_of_test(conn, posted, timeout);
                }
                posted.push_back(conn.recv(local.clone().slice(..whole)));
            }
        }
        Test::SendLat => {
            let zeros = vec![0u8; conn.info().max_inline as usize];
            let (mut sent_inline, mut sent) = (Trailing::new(), Trailing::new());
            // Two receives posted, so that the reply goes out first and the
            // receive is replenished after it, off the path from a message to
            // its reply.
            let mut posted: VecDeque<Pending<B>> = (0..2).map(|_| conn.recv(local.clone().slice(..whole))).collect();
            ready(conn)?;
            loop {
                let Some(mut rx) = posted.pop_front() else { unreachable!("receives are always posted") };
                let c = rx.wait_timeout(timeout)?;
                if c.imm == Some(DONE) {
                    sent_inline.drain(timeout)?;
                    sent.drain(timeout)?;
                    return end_of_test(conn, posted, timeout);
                }
                let n = c.byte_len as usize;
                if mode.inline && n <= zeros.len() {
                    let tx = conn.send_inline(&zeros[..n], None);
                    posted.push_back(conn.recv(local.clone().slice(..whole)));
                    sent_inline.push(tx, timeout)?;
                } else {
                    let tx = conn.send(local.clone().slice(..n));
                    posted.push_back(conn.recv(local.clone().slice(..whole)));
                    sent.push(tx, timeout)?;
                }
            }
        }
        Test::WriteLat => {
            let client = client.ok_or_else(|| {
                Error::InvalidArgument("write-lat: the client advertised no region to write back into".into())
            })?;
            let mut sent = Trailing::new();
            let mut rx = local.await_write(conn);
            ready(conn)?;
            loop {
                let c = rx.wait_timeout(timeout)?;
                let Some(imm) = c.imm.filter(|i| *i != DONE) else {
                    sent.drain(timeout)?;
                    return end_of_test::<B>(conn, VecDeque::new(), timeout);
                };
                rx = local.await_write(conn);
                let n = imm as usize;
                let rs = client.slice(0..n as u64)?;
                sent.push(conn.write_with_imm(local.clone().slice(..n), &rs, imm), timeout)?;
            }
        }
    }
}

/// Tells a [`serve`]ing peer that the test is over, and returns once it
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
    let mut fill = Trailing::new();
    for _ in 0..left {
        fill.push(conn.send_inline(&[], None), timeout)?;
    }
    fill.drain(timeout)
}

/// The server's end of [`finish`]: says how many receives `posted` holds
/// and waits for the client to fill them.
fn end_of_test<B: LocalBuffer>(conn: &Connection, mut posted: VecDeque<Pending<B>>, timeout: Duration) -> Result<()> {
    let left = u32::try_from(posted.len()).map_err(|_| Error::InvalidArgument("too many receives posted".into()))?;
    conn.send_inline(&[], Some(left)).wait_timeout(timeout)?;
    posted.iter_mut().try_for_each(|p| p.wait_timeout(timeout).map(drop))
}

fn wait_done(mut p: Pending<()>, timeout: Duration) -> Result<()> {
    match p.wait_timeout(timeout)?.imm {
        Some(DONE) => Ok(()),
        other => {
            Err(Error::InvalidArgument(format!("expected the client's end-of-test message, got immediate {other:?}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tests_parse_by_name_and_by_perftest_name() {
        assert_eq!("write-bw".parse::<Test>().unwrap(), Test::WriteBw);
        assert_eq!("ib_send_lat".parse::<Test>().unwrap(), Test::SendLat);
        assert!("write".parse::<Test>().is_err());
    }

    #[test]
    fn latency_statistics_match_their_definitions() {
        let mut s: Vec<f64> = (1..=1000).rev().map(f64::from).collect();
        let r = LatRow::from_samples(2, &mut s);
        assert_eq!((r.t_min, r.t_max, r.t_typical, r.p99, r.p99_9), (1.0, 1000.0, 500.0, 990.0, 999.0));
        assert!((r.t_avg - 500.5).abs() < 1e-9);
        assert!((r.t_stdev - 288.819).abs() < 1e-3, "{}", r.t_stdev);
        let one = LatRow::from_samples(8, &mut [3.0]);
        assert_eq!((one.t_typical, one.p99_9, one.t_stdev), (3.0, 3.0, 0.0));
    }

    #[test]
    fn params_disagree_when_anything_that_matters_differs() {
        let p = Params { test: Test::WriteBw, sizes: vec![65536], iters: 5000, tx_depth: 128, cq_mod: 32 };
        assert!(p.validate().is_ok());
        let mut q = p.clone();
        q.iters = 1000;
        assert_ne!(p.digest(), q.digest());
        let mut q = p.clone();
        q.test = Test::ReadBw;
        assert_ne!(p.encode(), q.encode());
        let mut q = p.clone();
        q.sizes = vec![4096];
        assert_ne!(p.encode(), q.encode());
        let mut q = p.clone();
        q.tx_depth = 16; // a local choice: may differ
        assert_eq!(p.encode(), q.encode());
        assert!(Params { iters: 4, ..p.clone() }.validate().is_err());
        assert!(Params { sizes: vec![], ..p }.validate().is_err());
        assert_eq!(all_sizes().first(), Some(&2));
        assert_eq!(all_sizes().last(), Some(&(8 << 20)));
    }

    #[test]
    fn the_stopwatch_agrees_with_the_system_clock() {
        let w = Stopwatch::start();
        let t0 = w.ticks();
        std::thread::sleep(Duration::from_millis(30));
        let secs = w.ticks().wrapping_sub(t0) as f64 * w.seconds_per_tick();
        assert!((0.025..0.5).contains(&secs), "{secs}");
    }

    #[test]
    fn the_peak_is_the_best_tenth_and_at_least_the_average() {
        let ms = 1e-3;
        // 100 messages of 1 MiB: the first half at 1 per ms, the second at 2 per ms.
        let mut stamps = Vec::new();
        for i in 1..=50u64 {
            stamps.push((i, ms * i as f64));
        }
        for i in 1..=50u64 {
            stamps.push((50 + i, ms * 50.0 + ms * i as f64 / 2.0));
        }
        let peak = peak_rate(&stamps, 1 << 20, 10) / MIB;
        let avg = 100.0 / 0.075;
        assert!(peak > avg, "{peak} vs {avg}");
        assert!((peak - 2000.0).abs() < 1.0, "{peak}");
        // A window longer than the run: the average.
        let whole = peak_rate(&stamps, 1 << 20, 1000) / MIB;
        assert!((whole - avg).abs() < 1.0, "{whole} vs {avg}");
    }
}
