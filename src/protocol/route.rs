//! Direct or staged: the route of one operation on GPU memory, and the
//! checks a device makes, made once for both routes.

use crate::error::{Error, Result};
use crate::memory::LocalParts;
use crate::memory::path::MemPath;
use crate::transport::RemoteOp;

/// How an operation moves its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// Posted as it is.
    Direct,
    /// Through pinned host slots.
    Staged,
}

/// The route for an operation on `local` over a transport that reaches
/// only host memory (`cpu_only`: TCP) or GPU memory too (verbs).
pub(crate) fn route(local: &LocalParts, cpu_only: bool) -> Route {
    match local.path {
        None => Route::Direct,
        Some(MemPath::Staged) => Route::Staged,
        Some(_) if cpu_only => Route::Staged,
        Some(_) => Route::Direct,
    }
}

/// The route for a receive into `local`, whose consumers' fences may
/// still run (`fenced`): on a direct path the NIC would write the GPU
/// memory as soon as a message arrives, and the receive queue cannot keep
/// a receive back without letting a later one take its message. So a
/// fenced receive goes through staging: the message lands in a host slot
/// at once, in its place in the queue, and its copy into the GPU waits for
/// the fences on the GPU. Nobody blocks.
pub(crate) fn route_receive(local: &LocalParts, cpu_only: bool, fenced: bool) -> Route {
    match route(local, cpu_only) {
        Route::Direct if local.path.is_some() && fenced => Route::Staged,
        other => other,
    }
}

/// The checks a device makes on a staged operation before anything is
/// copied: the right granted and the same length (one-sided operations),
/// and one message's limit (sends; a staged write with immediate is
/// chunked, its immediate on the last chunk). `op` is `None` for a receive.
///
/// # Errors
/// [`Error::AccessDenied`], [`Error::LengthMismatch`],
/// [`Error::MessageTooLarge`].
pub(crate) fn check_staged(op: Option<RemoteOp>, len: u64, max_message: u64) -> Result<()> {
    let Some(op) = op else { return Ok(()) };
    op.check_remote(len)?;
    if matches!(op, RemoteOp::Send | RemoteOp::SendWithImm(_)) && len > max_message {
        return Err(Error::MessageTooLarge { len, max: max_message });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::Access;
    use crate::remote::RemoteRegion;

    #[test]
    fn staged_operations_are_checked_as_a_device_would() {
        let r = RemoteRegion { tag: 0, addr: 0x1000, len: 64, rkey: 1, access: Access::REMOTE_READ }.whole();
        assert!(check_staged(None, 1 << 40, 8).is_ok(), "a receive has no remote side");
        assert!(check_staged(Some(RemoteOp::Read(r)), 64, 8).is_ok(), "one-sided operations are chunked");
        assert!(matches!(check_staged(Some(RemoteOp::Write(r)), 64, 8), Err(Error::AccessDenied { .. })));
        assert!(matches!(
            check_staged(Some(RemoteOp::Read(r)), 32, 8),
            Err(Error::LengthMismatch { local: 32, remote: 64 })
        ));
        assert!(matches!(check_staged(Some(RemoteOp::Send), 9, 8), Err(Error::MessageTooLarge { len: 9, max: 8 })));
        assert!(check_staged(Some(RemoteOp::SendWithImm(1)), 8, 8).is_ok());
    }

    #[test]
    fn host_memory_goes_direct_and_gpu_memory_by_its_path_and_transport() {
        let host = LocalParts { addr: 0, len: 1, lkey: 0, domain: 1, path: None };
        assert_eq!(route(&host, true), Route::Direct);
        assert_eq!(route(&host, false), Route::Direct);
        let gpu = |path| LocalParts { path: Some(path), ..host };
        assert_eq!(route(&gpu(MemPath::PeerMem), false), Route::Direct);
        assert_eq!(route(&gpu(MemPath::DmaBuf), false), Route::Direct);
        assert_eq!(route(&gpu(MemPath::PeerMem), true), Route::Staged, "TCP reaches only host memory");
        assert_eq!(route(&gpu(MemPath::Staged), false), Route::Staged);
        // A receive whose consumers still run: staged, whatever the path.
        assert_eq!(route_receive(&gpu(MemPath::PeerMem), false, true), Route::Staged);
        assert_eq!(route_receive(&gpu(MemPath::PeerMem), false, false), Route::Direct);
        assert_eq!(route_receive(&host, false, true), Route::Direct, "host memory has no route to change");
    }
}
