//! The server: the parameter check, serving a test, its end.

use std::time::Duration;

use crate::connection::{Connection, Pending, PersistentRecv, RecvRing};
use crate::error::{Error, Result};
use crate::memory::{Exposed, HostMemory, LocalBuffer, RemoteRegion};

use super::client::{SendRing, Trailing, ring_slots, second_half};
use super::params::{DONE, LocalMode, Params, Test};

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
    // A ping-pong receives into a ring of two slots of the largest size,
    // as the client does, where the buffer holds them apart from the
    // replies; `serve`, which is not told the sizes, keeps two receives
    // of the whole buffer.
    if params.test == Test::SendLat {
        if let Some(at) = ring_slots(local, max) {
            return pong_from_ring(conn, local, at, max, mode, timeout, verdict);
        }
    }
    serve(conn, params.test, local, mode, client, timeout, verdict)
}

/// The server's side of `test` without the parameter exchange: posts what
/// the test receives, calls `ready`, then serves until the client's
/// [`finish`](super::finish). `local` must hold the largest message.
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
        Test::WriteBw | Test::ReadBw | Test::ReadLat | Test::ListBw => {
            // Passive: the client's operations need nothing from this side.
            let done = conn.recv_imm();
            ready(conn)?;
            wait_done(done, timeout)?;
            end_of_test(conn, &mut [] as &mut [PersistentRecv<B>], timeout)
        }
        Test::SendBw => {
            let depth = conn.info().recv_queue_depth.clamp(1, 512) as usize;
            // A ring of receives, each reposted into its range once its
            // message is in, as perftest reposts its prebuilt ones.
            let mut ring: Vec<PersistentRecv<B>> =
                (0..depth).map(|_| conn.recv_persistent(local.clone().slice(..whole))).collect();
            ready(conn)?;
            let mut i = 0;
            loop {
                let c = ring[i].wait_timeout(timeout)?;
                if c.imm == Some(DONE) {
                    // The receives still posted would swallow what this
                    // connection receives next: the client fills them.
                    ring.rotate_left(i + 1);
                    return end_of_test(conn, &mut ring[..depth - 1], timeout);
                }
                ring[i].repost()?;
                i = (i + 1) % depth;
            }
        }
        Test::SendLat => {
            let zeros = vec![0u8; conn.info().max_inline as usize];
            let mut sent = SendRing::new();
            // Two receives posted, used in turn, so that the reply goes out
            // first and the receive is replenished after it, off the path
            // from a message to its reply.
            let mut rx = [(); 2].map(|()| conn.recv_persistent(local.clone().slice(..whole)));
            ready(conn)?;
            let mut i = 0;
            loop {
                let c = rx[i].wait_timeout(timeout)?;
                if c.imm == Some(DONE) {
                    sent.drain(timeout)?;
                    return end_of_test(conn, &mut rx[1 - i..2 - i], timeout);
                }
                let n = c.byte_len as usize;
                if mode.inline && n <= zeros.len() {
                    // The client's next message says it arrived: nothing to track.
                    conn.send_inline_untracked(&zeros[..n], None)?;
                    rx[i].repost()?;
                } else {
                    // From the buffer's second half, apart from where the
                    // message landed (its start) when the buffer holds
                    // both, as perftest's send and receive halves are apart.
                    sent.send(conn, n, |n| {
                        let at = second_half(whole, n);
                        local.clone().slice(at..at + n)
                    })?;
                    rx[i].repost()?;
                    sent.ready_next(timeout)?;
                }
                i = 1 - i;
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
                    return end_of_test(conn, &mut [] as &mut [PersistentRecv<B>], timeout);
                };
                rx = local.await_write(conn);
                let n = imm as usize;
                let rs = client.slice(0..n as u64)?;
                sent.push(conn.write_with_imm(local.clone().slice(..n), &rs, imm), timeout)?;
            }
        }
    }
}

/// The send-lat server on a ring of two receives of `max` bytes from `at`
/// (apart from the replies, which go from the buffer's start), posted
/// before `ready`: each reply goes out before its message's slot is posted
/// again (the loan's end), off the path from a message to its reply.
fn pong_from_ring<B: Landing>(
    conn: &Connection,
    local: &B,
    at: usize,
    max: usize,
    mode: LocalMode,
    timeout: Duration,
    ready: impl FnOnce(&Connection) -> Result<()>,
) -> Result<()> {
    let mut ring = conn.recv_ring(local.clone().slice(at..), max, 2);
    let zeros = vec![0u8; conn.info().max_inline as usize];
    let mut sent = SendRing::new();
    ready(conn)?;
    loop {
        let msg = ring.next_timeout(timeout)?;
        if msg.imm() == Some(DONE) {
            msg.retire();
            sent.drain(timeout)?;
            return end_of_ring(conn, &mut ring, timeout);
        }
        let n = msg.len();
        if mode.inline && n <= zeros.len() {
            // The client's next message says it arrived: nothing to track.
            conn.send_inline_untracked(&zeros[..n], None)?;
            drop(msg);
        } else {
            sent.send(conn, n, |n| local.clone().slice(..n))?;
            drop(msg);
            sent.ready_next(timeout)?;
        }
    }
}

/// [`end_of_test`] for a ring: says how many of its receives are still
/// posted and waits for the client to fill them, leaving none posted.
fn end_of_ring<B: LocalBuffer>(conn: &Connection, ring: &mut RecvRing<B>, timeout: Duration) -> Result<()> {
    let left = say_left(conn, ring.posted(), timeout)?;
    (0..left).try_for_each(|_| ring.next_timeout(timeout).map(|m| m.retire()))
}

/// The server's end of [`finish`]: says how many receives are still
/// posted (`posted`, in the order they were posted) and waits for the
/// client to fill them.
fn end_of_test<B: LocalBuffer>(conn: &Connection, posted: &mut [PersistentRecv<B>], timeout: Duration) -> Result<()> {
    say_left(conn, posted.len(), timeout)?;
    posted.iter_mut().try_for_each(|p| p.wait_timeout(timeout).map(drop))
}

/// Tells the client how many receives are still posted (its `finish`
/// fills them); that count.
fn say_left(conn: &Connection, posted: usize, timeout: Duration) -> Result<u32> {
    let left = u32::try_from(posted).map_err(|_| Error::InvalidArgument("too many receives posted".into()))?;
    conn.send_inline(&[], Some(left)).wait_timeout(timeout)?;
    Ok(left)
}

fn wait_done(mut p: Pending<()>, timeout: Duration) -> Result<()> {
    match p.wait_timeout(timeout)?.imm {
        Some(DONE) => Ok(()),
        other => {
            Err(Error::InvalidArgument(format!("expected the client's end-of-test message, got immediate {other:?}")))
        }
    }
}
