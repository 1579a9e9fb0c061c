//! Frames over the handshake's TCP stream, with deadlines: reading and
//! writing them, and the exchanges built from them (hello, ready, reject,
//! bye). The shared-secret exchange (`auth`) uses these too.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use bytes::Bytes;

use super::wire::{self, FrameKind, HEADER_LEN, Hello, encode_frame};
pub use crate::deadline::Deadline;
use crate::error::{AuthFailure, BootstrapError, Error, Result};

/// Reads exactly `buf.len()` bytes before the deadline. Returns how many
/// bytes arrived before the peer closed (less than `buf.len()` on EOF).
fn read_full(stream: &TcpStream, buf: &mut [u8], deadline: Deadline) -> Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        let remaining = deadline.remaining().ok_or_else(|| deadline.expired())?;
        stream.set_read_timeout(Some(remaining))?;
        match (&*stream).read(&mut buf[got..]) {
            Ok(0) => return Ok(got),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(deadline.expired());
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Ok(got),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(got)
}

/// Reads one frame, checking it fully before returning it.
///
/// # Errors
/// [`Error::Timeout`] when the peer is silent past the deadline;
/// [`BootstrapError::PeerClosed`] on a clean close before the frame;
/// [`BootstrapError::Truncated`] on a close inside it; the header and
/// checksum errors of [`wire::decode_header`]; [`Error::Io`].
pub fn read_frame(stream: &TcpStream, deadline: Deadline, max_payload: u32) -> Result<(FrameKind, Bytes)> {
    let mut head = [0u8; HEADER_LEN];
    let got = read_full(stream, &mut head, deadline)?;
    if got == 0 {
        return Err(BootstrapError::PeerClosed.into());
    }
    if got < HEADER_LEN {
        return Err(BootstrapError::Truncated { expected: HEADER_LEN, got }.into());
    }
    let header = wire::decode_header(&head, max_payload)?;
    let mut payload = vec![0u8; header.len as usize];
    let got = read_full(stream, &mut payload, deadline)?;
    if got < payload.len() {
        return Err(BootstrapError::Truncated { expected: HEADER_LEN + payload.len(), got: HEADER_LEN + got }.into());
    }
    wire::check_payload(&header, &payload)?;
    Ok((header.kind, Bytes::from(payload)))
}

/// Writes one frame before the deadline.
///
/// # Errors
/// [`Error::Timeout`] when the peer does not drain its socket in time;
/// [`Error::Io`].
pub fn write_frame(stream: &TcpStream, kind: FrameKind, payload: &[u8], deadline: Deadline) -> Result<()> {
    let frame = encode_frame(kind, payload);
    let mut sent = 0;
    while sent < frame.len() {
        let remaining = deadline.remaining().ok_or_else(|| deadline.expired())?;
        stream.set_write_timeout(Some(remaining))?;
        match (&*stream).write(&frame[sent..]) {
            Ok(0) => return Err(Error::Io(io::Error::from(io::ErrorKind::WriteZero))),
            Ok(n) => sent += n,
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                return Err(deadline.expired());
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

pub(super) fn unexpected(expected: &'static str, kind: FrameKind, payload: &[u8]) -> Error {
    match kind {
        FrameKind::Reject => BootstrapError::Rejected { reason: wire::decode_reason(payload) }.into(),
        other => BootstrapError::Unexpected { expected, got: other.name().to_owned() }.into(),
    }
}

/// Sends our hello and reads the peer's.
///
/// # Errors
/// As [`read_frame`], plus [`BootstrapError::Malformed`] for a hello that
/// does not parse, [`BootstrapError::Rejected`] when the peer refuses and
/// [`BootstrapError::Unexpected`] for another message.
pub fn exchange_hello(stream: &TcpStream, mine: &Hello, deadline: Deadline, max_payload: u32) -> Result<Hello> {
    write_frame(stream, FrameKind::Hello, &mine.encode(), deadline.for_("sending the hello"))?;
    let (kind, payload) = read_frame(stream, deadline.for_("the peer's hello"), max_payload)?;
    match kind {
        FrameKind::Hello => Ok(Hello::decode(&payload)?),
        FrameKind::Challenge => {
            send_reject(stream, "this side has no shared secret");
            Err(BootstrapError::Auth(AuthFailure::NoSecretHere).into())
        }
        other => Err(unexpected("hello", other, &payload)),
    }
}

/// Sends ready and waits for the peer's: after this both queue pairs can
/// receive, so the first message of either side finds its peer ready.
///
/// # Errors
/// As [`exchange_hello`].
pub fn exchange_ready(stream: &TcpStream, deadline: Deadline) -> Result<()> {
    write_frame(stream, FrameKind::Ready, &[], deadline.for_("sending ready"))?;
    let (kind, payload) = read_frame(stream, deadline.for_("the peer's ready"), wire::MAX_REASON as u32)?;
    match kind {
        FrameKind::Ready => Ok(()),
        other => Err(unexpected("ready", other, &payload)),
    }
}

/// Tells the peer why we refuse the connection (best effort: errors are
/// ignored, the connection is being dropped anyway).
pub fn send_reject(stream: &TcpStream, reason: &str) {
    let deadline = Deadline::after(Duration::from_millis(500), "sending a reject");
    let _ = write_frame(stream, FrameKind::Reject, &wire::encode_reason(reason), deadline);
}

/// Tells the peer we are closing (best effort).
pub fn send_bye(stream: &TcpStream) {
    let deadline = Deadline::after(Duration::from_millis(500), "sending bye");
    let _ = write_frame(stream, FrameKind::Bye, &[], deadline);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::thread;
    use std::time::Instant;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    #[test]
    fn frames_cross_a_socket() {
        let (a, b) = pair();
        let t = thread::spawn(move || read_frame(&b, Deadline::after(Duration::from_secs(5), "x"), 64).unwrap());
        write_frame(&a, FrameKind::Reject, b"no", Deadline::after(Duration::from_secs(5), "x")).unwrap();
        let (kind, payload) = t.join().unwrap();
        assert_eq!((kind, &payload[..]), (FrameKind::Reject, &b"no"[..]));
    }

    #[test]
    fn silent_peer_times_out_on_time() {
        let (a, _b) = pair();
        let t0 = Instant::now();
        let err = read_frame(&a, Deadline::after(Duration::from_millis(200), "the peer's hello"), 64).unwrap_err();
        let took = t0.elapsed();
        assert!(matches!(err, Error::Timeout { what: "the peer's hello", .. }), "{err}");
        assert!(took >= Duration::from_millis(190) && took < Duration::from_secs(3), "{took:?}");
    }

    #[test]
    fn close_before_and_inside_a_frame() {
        let (a, b) = pair();
        drop(b);
        let err = read_frame(&a, Deadline::after(Duration::from_secs(5), "x"), 64).unwrap_err();
        assert!(matches!(err, Error::Bootstrap(BootstrapError::PeerClosed)), "{err}");

        let (a, b) = pair();
        let frame = encode_frame(FrameKind::Reject, b"0123456789");
        (&b).write_all(&frame[..HEADER_LEN + 4]).unwrap();
        drop(b);
        let err = read_frame(&a, Deadline::after(Duration::from_secs(5), "x"), 64).unwrap_err();
        assert!(matches!(err, Error::Bootstrap(BootstrapError::Truncated { expected: 26, got: 20 })), "{err}");
    }
}
