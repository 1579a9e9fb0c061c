//! The responder's rules, with no I/O (no socket, thread or libc): what a
//! peer's request may do here, decided from its header and this side's
//! state before a byte of its payload lands, and whether what landed is
//! what it announced. The receiver thread carries the verdicts out. A
//! refusal gets the peer its status and breaks the connection, as a
//! responder in the error state does; a broken rule of the stream breaks
//! it at once.

use std::borrow::Borrow;

use super::frame::Handled;
use crate::completion::WcStatus;
use crate::memory::Access;
use crate::memory::keys::KeyEntry;

/// A request refused: the status the peer's operation fails with, and why
/// this side breaks the connection.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Refusal {
    pub(super) status: WcStatus,
    pub(super) why: String,
}

impl Refusal {
    fn new(status: WcStatus, why: impl Into<String>) -> Self {
        Refusal { status, why: why.into() }
    }
}

/// What becomes of a message (a send, or the notice of a write with
/// immediate) before its payload is read, with the receive `R` taken for it.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Message<R> {
    /// Into the receive.
    Land(R),
    /// No receive was posted within the receiver-not-ready budget.
    NoReceive(Refusal),
    /// Longer than the receive: the receive fails (`LocalLength`) and the
    /// peer's operation is refused.
    TooLong(R, Refusal),
}

/// A message announcing `total` bytes, for the receive taken for it and
/// its length (`None`: none in time). `written`: the notice of a write
/// with immediate, whose bytes went to its region, not the receive.
pub(super) fn message<R>(total: u64, recv: Option<(R, u64)>, written: bool) -> Message<R> {
    let Some((recv, recv_len)) = recv else {
        return Message::NoReceive(Refusal::new(
            WcStatus::RnrRetryExceeded,
            "a peer's message found no posted receive in time",
        ));
    };
    if !written && total > recv_len {
        return Message::TooLong(
            recv,
            Refusal::new(
                WcStatus::RemoteInvalidRequest,
                format!("a message of {total} bytes arrived for a receive of {recv_len} bytes"),
            ),
        );
    }
    Message::Land(recv)
}

/// The next segment of a message, `n` bytes at `off`, into a receive of
/// `recv_len` bytes: it must fit (the message announced it would).
pub(super) fn segment_fits(off: u64, n: u64, recv_len: u64) -> Handled {
    if off.checked_add(n).is_none_or(|end| end > recv_len) {
        return Err("a message grew past its announced length".into());
    }
    Ok(())
}

/// A message or write whose last segment came: `arrived` bytes of the
/// `total` it announced. Short, the receive or the immediate would report
/// bytes that never arrived.
pub(super) fn whole(total: u64, arrived: u64) -> Handled {
    if arrived != total {
        return Err(format!(
            "a garbled frame (a message of {total} bytes announced, {arrived} arrived): the stream is out of step"
        ));
    }
    Ok(())
}

/// A write of `len` bytes at `addr` under `key`, into `entry`: the region
/// this connection may reach under that key, if any. The region, admitted.
pub(super) fn write<E: Borrow<KeyEntry>>(entry: Option<E>, key: u32, addr: u64, len: u64) -> Result<E, Refusal> {
    match entry {
        Some(e) if e.borrow().admits(addr, len, Access::REMOTE_WRITE) => return Ok(e),
        _ => {}
    }
    Err(Refusal::new(
        WcStatus::RemoteAccess,
        format!(
            "a peer's write to {addr:#x}+{len} with key {key:#x} was refused (bad key, outside the region, or no write right)"
        ),
    ))
}

/// One segment of an admitted write, `n` bytes at `addr`: inside the region.
pub(super) fn write_segment(entry: &KeyEntry, addr: u64, n: u64) -> Result<(), Refusal> {
    if entry.admits(addr, n, Access::REMOTE_WRITE) {
        return Ok(());
    }
    Err(Refusal::new(WcStatus::RemoteAccess, "a write segment left its region"))
}

/// A write whose region was withdrawn while its bytes moved (they were
/// dropped): refused.
pub(super) fn withdrawn_during_write() -> Refusal {
    Refusal::new(WcStatus::RemoteAccess, "the region was withdrawn during a write")
}

/// A read of `len` bytes at `addr` under `key`, from `entry`. The region, admitted.
pub(super) fn read<E: Borrow<KeyEntry>>(entry: Option<E>, key: u32, addr: u64, len: u64) -> Result<E, Refusal> {
    match entry {
        Some(e) if e.borrow().admits(addr, len, Access::REMOTE_READ) => return Ok(e),
        _ => {}
    }
    Err(Refusal::new(
        WcStatus::RemoteAccess,
        format!(
            "a peer's read of {addr:#x}+{len} with key {key:#x} was refused (bad key, outside the region, or no read right)"
        ),
    ))
}

#[cfg(test)]
mod tests {
    //! A hostile peer's requests against the rules, with no socket.

    use super::*;
    use crate::memory::keys::KeyTable;

    /// A region of 4 KiB at a fixed address, exposed with `access`.
    fn region(access: Access) -> (KeyTable, crate::memory::keys::Served, std::sync::Arc<KeyEntry>) {
        let table = KeyTable::default();
        // SAFETY: the table only checks ranges here; nothing is written
        // to the address.
        let served = unsafe { table.expose(0x10_0000, 4096, access, None) }.unwrap();
        let entry = table.lookup(served.key()).unwrap();
        (table, served, entry)
    }

    #[test]
    fn a_message_lands_only_in_a_receive_that_holds_it() {
        assert_eq!(message(64, Some(("r", 64)), false), Message::Land("r"));
        assert_eq!(message(0, Some(("r", 0)), false), Message::Land("r"));
        assert!(matches!(
            message(65, Some(("r", 64)), false),
            Message::TooLong("r", Refusal { status: WcStatus::RemoteInvalidRequest, .. })
        ));
        assert!(matches!(
            message::<()>(64, None, false),
            Message::NoReceive(Refusal { status: WcStatus::RnrRetryExceeded, .. })
        ));
        // A write with immediate's bytes went to its region: any receive takes its notice.
        assert_eq!(message(1 << 30, Some(("r", 0)), true), Message::Land("r"));
        assert!(matches!(message::<()>(1, None, true), Message::NoReceive(_)));
    }

    #[test]
    fn segments_never_pass_the_receive_and_a_short_message_breaks_the_stream() {
        assert!(segment_fits(0, 64, 64).is_ok());
        assert!(segment_fits(60, 5, 64).is_err());
        assert!(segment_fits(u64::MAX, 2, u64::MAX).is_err(), "no wrap");
        assert!(whole(64, 64).is_ok());
        assert!(whole(64, 32).unwrap_err().contains("garbled"));
    }

    #[test]
    fn writes_and_reads_need_the_key_the_range_and_the_right() {
        let (_t, served, entry) = region(Access::REMOTE_WRITE);
        let key = served.key();
        let base = 0x10_0000;
        assert!(write(Some(&*entry), key, base, 4096).is_ok());
        assert!(write(Some(&*entry), key, base + 4095, 1).is_ok());
        for (addr, len, what) in [
            (base + 1, 4096, "one past the end"),
            (base - 1, 1, "before the start"),
            (u64::MAX - 1, 4, "an address range that wraps"),
            (base, u64::MAX, "a length that wraps"),
        ] {
            let r = write(Some(&*entry), key, addr, len).unwrap_err();
            assert_eq!(r.status, WcStatus::RemoteAccess, "{what}");
            assert!(r.why.contains(&format!("{key:#x}")), "{what}: {}", r.why);
        }
        assert_eq!(write(None::<&KeyEntry>, 7, base, 1).unwrap_err().status, WcStatus::RemoteAccess, "an unknown key");
        assert_eq!(read(Some(&*entry), key, base, 1).unwrap_err().status, WcStatus::RemoteAccess, "no read right");
        assert!(write_segment(&entry, base + 4000, 96).is_ok());
        assert!(write_segment(&entry, base + 4000, 97).is_err(), "a segment past the region");
        let (_t2, served2, readable) = region(Access::REMOTE_READ);
        assert!(read(Some(&*readable), served2.key(), base, 4096).is_ok());
        assert!(write(Some(&*readable), served2.key(), base, 1).is_err(), "no write right");
        assert_eq!(withdrawn_during_write().status, WcStatus::RemoteAccess);
    }
}
