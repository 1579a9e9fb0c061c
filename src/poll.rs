//! Waiting on file descriptors with `poll(2)`, behind a safe interface (a
//! leaf: the listener and the transports use it).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

/// Waits until one of `fds` is readable (or hung up, or in error), at most
/// `timeout` (rounded to whole milliseconds, at least 1). Returns which
/// are; none on a timeout or an interrupted wait.
///
/// # Errors
/// [`io::Error`] from `poll(2)`, other than an interruption.
pub(crate) fn readable<const N: usize>(fds: [BorrowedFd<'_>; N], timeout: Duration) -> io::Result<[bool; N]> {
    let mut p = fds.map(|fd| libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: `p` is an array of N valid pollfds owned by this frame, and the
    // descriptors are borrowed, so open, for the duration of the call.
    let n = unsafe { libc::poll(p.as_mut_ptr(), N as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(p.map(|x| x.revents != 0))
}
