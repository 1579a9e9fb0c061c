//! Raw socket I/O: no Rust references to memory the peer fills.

use std::io;
use std::os::fd::RawFd;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::frame::{FrameHeader, HEADER};
use super::replies::Progress;

/// Bytes moved per system call while a gate is held (see
/// [`KeyEntry::alive`](crate::memory::keys::KeyEntry::alive)).
pub(super) const STEP: usize = 1 << 20;
/// The longest one receive call blocks (the socket's receive timeout): the
/// longest a withdrawal waits for a stalled peer's write.
pub(super) const RECV_WAIT: Duration = Duration::from_millis(10);

pub(super) fn wait_fd(fd: RawFd, events: i16) -> io::Result<()> {
    wait_fd_for(fd, events, -1)
}

/// [`wait_fd`] for at most `ms` milliseconds (-1: no limit).
pub(super) fn wait_fd_for(fd: RawFd, events: i16, ms: i32) -> io::Result<()> {
    let mut p = libc::pollfd { fd, events, revents: 0 };
    loop {
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Reads up to `len` bytes into `ptr`: what is there, or, with no
/// `MSG_DONTWAIT` in `flags`, what comes before [`RECV_WAIT`] passes
/// (`WouldBlock` when none came); 0 means EOF.
///
/// # Safety
/// `ptr..ptr + len` must be valid for writes and not referenced by Rust code.
pub(super) unsafe fn recv_some(fd: RawFd, ptr: *mut u8, len: usize, flags: libc::c_int) -> io::Result<usize> {
    loop {
        // SAFETY: the caller guarantees the destination. The socket's receive
        // timeout (RECV_WAIT) bounds a wait. Without MSG_WAITALL: it would
        // wake this thread at every packet only to sleep again until the
        // whole length is there; taking what is there costs fewer wake-ups
        // (measured: 64 KiB lists 0.82x -> 0.92x of a plain socket).
        let n = unsafe { libc::recv(fd, ptr.cast(), len, flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Fills `ptr..ptr+len` from the socket. `gate` is held while bytes move
/// and across at most one [`RECV_WAIT`] for the network, so a withdrawal
/// waits at most that long; when it reports the target gone the rest is
/// read and dropped. Returns `Ok(false)` on EOF.
///
/// # Safety
/// While `gate` returns true, `ptr..ptr + len` must be valid for writes and
/// not referenced by Rust code.
/// With `ahead` (empty), the last call also reads what follows the range on
/// the stream into it, up to a header.
pub(super) unsafe fn recv_into(
    fd: RawFd,
    ptr: *mut u8,
    len: usize,
    gate: Option<&RwLock<bool>>,
    scratch: &mut [u8],
    mut ahead: Option<&mut Ahead>,
) -> io::Result<bool> {
    let mut got = 0;
    while got < len {
        let want = (len - got).min(STEP);
        let guard = gate.map(|g| g.read().unwrap_or_else(|e| e.into_inner()));
        let n = if guard.as_ref().is_none_or(|alive| **alive) {
            match ahead.as_deref_mut() {
                // SAFETY: inside the range the caller vouches for, while the gate holds.
                Some(ahead) if got + want == len && ahead.is_empty() => unsafe {
                    recv_some_ahead(fd, ptr.add(got), want, ahead)
                },
                // SAFETY: as above.
                _ => unsafe { recv_some(fd, ptr.add(got), want, 0) },
            }
        } else {
            // The region was revoked: drop the bytes.
            let k = want.min(scratch.len());
            // SAFETY: `scratch` is our own buffer.
            unsafe { recv_some(fd, scratch.as_mut_ptr(), k, 0) }
        };
        drop(guard);
        match n {
            Ok(0) => return Ok(false),
            Ok(n) => got += n,
            // Nothing for a while: wait for data without holding the gate.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait_fd(fd, libc::POLLIN)?,
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// The start of the next frame's header, read with the end of a payload:
/// a stream of frames costs one receive call a frame, not two (the
/// payload's last call also takes what follows it, up to a header).
#[derive(Default)]
pub(super) struct Ahead {
    buf: [u8; HEADER],
    len: usize,
}

impl Ahead {
    /// Whether it holds bytes of the next frame.
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Moves what it holds to the start of `head`; how many bytes.
    pub(super) fn take_into(&mut self, head: &mut [u8; HEADER]) -> usize {
        let n = std::mem::take(&mut self.len);
        head[..n].copy_from_slice(&self.buf[..n]);
        n
    }
}

/// [`recv_some`] into `ptr..ptr + len`, and, once that is full, into the
/// free part of `ahead` (the bytes after it on the stream): one call.
///
/// # Safety
/// As [`recv_some`] for `ptr..ptr + len`.
unsafe fn recv_some_ahead(fd: RawFd, ptr: *mut u8, len: usize, ahead: &mut Ahead) -> io::Result<usize> {
    let mut iov = [
        libc::iovec { iov_base: ptr.cast(), iov_len: len },
        libc::iovec { iov_base: ahead.buf[ahead.len..].as_mut_ptr().cast(), iov_len: HEADER - ahead.len },
    ];
    loop {
        // SAFETY: a zeroed msghdr is valid; the iovecs (the caller's range,
        // and `ahead`'s free bytes, borrowed mutably here) outlive the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len();
        // SAFETY: valid socket and message; the caller vouches for the range.
        let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
        if n >= 0 {
            let n = n as usize;
            if n > len {
                ahead.len += n - len;
                return Ok(len);
            }
            return Ok(n);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
        iov[1].iov_base = ahead.buf[ahead.len..].as_mut_ptr().cast();
    }
}

/// Reads what is there now, up to `buf.len()` bytes, without waiting
/// (`WouldBlock` when nothing is); with `peek`, leaves it in the socket.
pub(super) fn recv_now(fd: RawFd, buf: &mut [u8], peek: bool) -> io::Result<usize> {
    let flags = libc::MSG_DONTWAIT | if peek { libc::MSG_PEEK } else { 0 };
    // SAFETY: `buf` is exclusively borrowed for the call, so no Rust code
    // refers to it while the kernel writes it.
    unsafe { recv_some(fd, buf.as_mut_ptr(), buf.len(), flags) }
}

/// One attempt to write `bytes` without waiting: how many the socket took
/// (0 when it is full).
pub(super) fn send_now(fd: RawFd, bytes: &[u8]) -> io::Result<usize> {
    sent_without_waiting(|| {
        // SAFETY: `bytes` is borrowed for the call; MSG_NOSIGNAL instead of SIGPIPE.
        unsafe { libc::send(fd, bytes.as_ptr().cast(), bytes.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) }
    })
}

/// The bytes a non-blocking send call took: 0 when the socket is full;
/// the call is made again when a signal interrupted it.
pub(super) fn sent_without_waiting(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::WouldBlock => return Ok(0),
            io::ErrorKind::Interrupted => {}
            _ => return Err(e),
        }
    }
}

pub(super) fn recv_buf(fd: RawFd, buf: &mut [u8]) -> io::Result<bool> {
    let (ptr, len) = (buf.as_mut_ptr(), buf.len());
    let mut scratch = [];
    // SAFETY: `buf` is exclusively borrowed for the call.
    unsafe { recv_into(fd, ptr, len, None, &mut scratch, None) }
}

pub(super) fn discard(fd: RawFd, mut len: usize, scratch: &mut [u8]) -> io::Result<bool> {
    while len > 0 {
        let k = len.min(scratch.len());
        if !recv_buf(fd, &mut scratch[..k])? {
            return Ok(false);
        }
        len -= k;
    }
    Ok(true)
}

/// Where a message's writer reports its progress: the atomic, and the
/// bytes of the message before this frame.
pub(super) type Tx<'a> = Option<(&'a AtomicU64, u64)>;

/// Stores a writer's progress (see [`Inner::tx`]).
pub(super) fn report(tx: Tx<'_>, handed_in_frame: usize, in_call: bool) {
    if let Some((at, base)) = tx {
        at.store(Progress { handed: base + handed_in_frame as u64, in_call }.pack(), Ordering::Release);
    }
}

/// The largest payload [`sendmsg_frame`] copies behind its header to send
/// the frame from one buffer.
pub(super) const SMALL_FRAME: usize = 256;

/// One `sendmsg` of the frame made of `head` and the `len` bytes at `ptr`,
/// from byte `done` of the frame on (the header's first), at most
/// [`STEP`] bytes of payload: the call's raw result (bytes taken, or -1
/// with the error in `errno`).
///
/// # Safety
/// `ptr..ptr + len` must be valid for reads for the call.
pub(super) unsafe fn sendmsg_frame(
    fd: RawFd,
    head: &[u8; HEADER],
    ptr: *const u8,
    len: usize,
    done: usize,
    flags: libc::c_int,
) -> isize {
    if done == 0 && len <= SMALL_FRAME {
        // A small frame goes out of one buffer by `send`: `sendmsg` also has
        // the kernel copy in and check the message header and its vector,
        // which costs more than copying a few hundred bytes here (64 B
        // send-lat over loopback: 0.988x, quartiles 0.979-0.993, 16 pairs).
        let mut frame = [0u8; HEADER + SMALL_FRAME];
        frame[..HEADER].copy_from_slice(head);
        if len > 0 {
            // SAFETY: `ptr..ptr + len` is valid for reads (the caller's
            // promise), and `frame` has room for it after the header.
            unsafe { std::ptr::copy_nonoverlapping(ptr, frame.as_mut_ptr().add(HEADER), len) };
        }
        // SAFETY: `frame` is borrowed for the call; MSG_NOSIGNAL instead of
        // SIGPIPE, if the caller asked.
        return unsafe { libc::send(fd, frame.as_ptr().cast(), HEADER + len, flags) };
    }
    let (head_sent, sent) = (done.min(HEADER), done.saturating_sub(HEADER).min(len));
    let mut iov = [
        libc::iovec { iov_base: head[head_sent..].as_ptr() as *mut libc::c_void, iov_len: HEADER - head_sent },
        // SAFETY: inside the range the caller vouches for.
        libc::iovec { iov_base: unsafe { ptr.add(sent) } as *mut libc::c_void, iov_len: (len - sent).min(STEP) },
    ];
    let first = usize::from(head_sent == HEADER);
    // SAFETY: a zeroed msghdr is valid; the iovecs outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov[first..].as_mut_ptr();
    msg.msg_iovlen = iov.len() - first;
    // SAFETY: valid socket, message and buffers (the caller's range, the
    // header it lends); MSG_NOSIGNAL instead of SIGPIPE, if it asked.
    unsafe { libc::sendmsg(fd, &msg, flags) }
}

/// The flags of a frame's non-blocking send; `more`: more frames follow at
/// once, so the kernel may fill segments across them (a 64 KiB payload and
/// its header would otherwise end in a runt).
pub(super) fn frame_flags(more: bool) -> libc::c_int {
    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL | if more { libc::MSG_MORE } else { 0 }
}

/// How a writer that blocks waits for room in the socket.
pub(super) trait Room {
    fn wait(&self, fd: RawFd) -> io::Result<()>;
}

/// Sends a header and `len` bytes at `ptr`. `gate` is held only while bytes
/// move; if it reports the source gone, `Ok(false)` is returned after the
/// header and the bytes sent so far (the caller then breaks the connection).
/// A message's writer reports through `tx` how much of it the socket has,
/// and when it is inside a call that may hand more. When the socket is
/// full, `room` waits.
///
/// # Safety
/// While `gate` returns true, `ptr..ptr + len` must be valid for reads.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn send_frame(
    fd: RawFd,
    header: &FrameHeader,
    ptr: *const u8,
    len: usize,
    gate: Option<&RwLock<bool>>,
    already: usize,
    more: bool,
    tx: Tx<'_>,
    room: &dyn Room,
) -> io::Result<bool> {
    let head = header.encode();
    let flags = frame_flags(more);
    // The first `already` bytes of the frame went out earlier (a posting
    // thread's attempt that the socket cut short).
    let whole = HEADER + len;
    let mut done = already.min(whole);
    report(tx, done, false);
    while done < whole {
        let guard = gate.map(|g| g.read().unwrap_or_else(|e| e.into_inner()));
        if guard.as_ref().is_some_and(|alive| !**alive) {
            return Ok(false);
        }
        report(tx, done, true);
        // SAFETY: inside the range the caller vouches for, while the gate holds.
        let n = unsafe { sendmsg_frame(fd, &head, ptr, len, done, flags) };
        drop(guard);
        if n < 0 {
            report(tx, done, false);
            let e = io::Error::last_os_error();
            match e.kind() {
                // The socket is full: wait for room without holding the gate.
                io::ErrorKind::WouldBlock => room.wait(fd)?,
                io::ErrorKind::Interrupted => {}
                _ => return Err(e),
            }
            continue;
        }
        done += n as usize;
        report(tx, done, false);
    }
    Ok(true)
}

pub(super) fn send_header(fd: RawFd, header: &FrameHeader, room: &dyn Room) -> io::Result<()> {
    // SAFETY: no payload.
    unsafe { send_frame(fd, header, std::ptr::null(), 0, None, 0, false, None, room) }.map(drop)
}
