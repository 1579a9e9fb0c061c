//! The result layer: turns each ibverbs error convention into [`Result`].
//!
//! libibverbs uses three conventions:
//! - pointer-returning verbs return NULL and set `errno`;
//! - most `int` verbs return 0 or an errno value (`ibv_modify_qp`,
//!   `ibv_post_send`, `ibv_query_port`, `ibv_dereg_mr`, the destroys);
//! - a few return -1 and set `errno` (`ibv_query_gid`, `ibv_get_cq_event`,
//!   `ibv_req_notify_cq` on some providers).
//!
//! "Not supported" errnos become [`Error::NotSupported`] so that callers can
//! tell "not here" from a fault.

use std::io;
use std::ptr::NonNull;

use libc::c_int;

use crate::error::{Error, Result};

/// C structs from rdma-sys for which the all-zero bit pattern is a valid value.
///
/// # Safety
/// Implement only for `repr(C)` plain-data structs made of integers, raw
/// pointers, arrays and unions of those: no references, no `NonNull`, no
/// Rust enums (rdma-sys binds C enums as integer constants).
pub(crate) unsafe trait Zeroable: Sized {}

/// An all-zero value, as C code gets from `memset(&x, 0, sizeof x)`.
pub(crate) fn zeroed<T: Zeroable>() -> T {
    // SAFETY: `Zeroable` is implemented only for plain C data for which all-zero
    // bits are a valid value (null pointers, zero integers).
    unsafe { std::mem::zeroed() }
}

macro_rules! zeroable {
    ($($t:ty),* $(,)?) => { $(
        // SAFETY: a bindgen-generated repr(C) struct or union of integers, raw
        // pointers and arrays of those (checked against rdma-sys 0.3 bindings).
        unsafe impl Zeroable for $t {}
    )* };
}

zeroable!(
    rdma_sys::ibv_device_attr,
    rdma_sys::ibv_port_attr,
    rdma_sys::ibv_qp_attr,
    rdma_sys::ibv_qp_init_attr,
    rdma_sys::ibv_send_wr,
    rdma_sys::ibv_recv_wr,
    rdma_sys::ibv_sge,
    rdma_sys::ibv_wc,
    rdma_sys::ibv_gid,
);

fn is_not_supported(errno: i32) -> bool {
    errno == libc::EOPNOTSUPP || errno == libc::EPROTONOSUPPORT || errno == libc::ENOSYS
}

/// The error for `op` failing with `errno`.
pub(crate) fn from_errno(op: &'static str, errno: i32) -> Error {
    let source = io::Error::from_raw_os_error(errno);
    if is_not_supported(errno) { Error::NotSupported { op, source } } else { Error::Verbs { op, source } }
}

fn last_errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// NULL-and-errno convention.
pub(crate) fn nonnull<T>(ptr: *mut T, op: &'static str) -> Result<NonNull<T>> {
    NonNull::new(ptr).ok_or_else(|| from_errno(op, last_errno()))
}

/// Returns-an-errno convention (0 is success). A negative value is treated as
/// `-errno`, and -1 as "see errno", which some providers do.
#[inline]
pub(crate) fn errno_rc(rc: c_int, op: &'static str) -> Result<()> {
    match rc {
        0 => Ok(()),
        -1 => Err(from_errno(op, last_errno())),
        rc if rc < 0 => Err(from_errno(op, -rc)),
        rc => Err(from_errno(op, rc)),
    }
}

/// Returns-minus-one-and-sets-errno convention.
pub(crate) fn minus_one(rc: c_int, op: &'static str) -> Result<()> {
    if rc == 0 { Ok(()) } else { Err(from_errno(op, last_errno())) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_supported_errnos_are_their_own_variant() {
        assert!(matches!(errno_rc(libc::EOPNOTSUPP, "x"), Err(Error::NotSupported { .. })));
        assert!(matches!(errno_rc(-libc::EPROTONOSUPPORT, "x"), Err(Error::NotSupported { .. })));
        match errno_rc(libc::EINVAL, "ibv_modify_qp") {
            Err(Error::Verbs { op, source }) => {
                assert_eq!(op, "ibv_modify_qp");
                assert_eq!(source.raw_os_error(), Some(libc::EINVAL));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(errno_rc(0, "x").is_ok());
    }

    #[test]
    fn zeroed_structs_are_zero() {
        let attr: rdma_sys::ibv_qp_attr = zeroed();
        assert_eq!(attr.dest_qp_num, 0);
        assert_eq!(attr.port_num, 0);
    }
}
