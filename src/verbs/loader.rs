//! libibverbs, loaded at run time (as NCCL loads it): the program carries
//! no link-time dependency on rdma-core, so it starts on a machine without
//! it and falls back to TCP, saying why. rdma-sys keeps the types and the
//! static-inline verbs it ports (post, poll, notify: calls through the
//! provider's function table, no exported symbol); the exported entry
//! points this crate calls go through one table resolved with `dlsym`.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use rdma_sys as ffi;

use crate::error::{Error, Result};

/// The library's soname: what the dynamic linker would have loaded.
const SONAME: &CStr = c"libibverbs.so.1";

/// `_ibv_query_gid_table`: the device's GID table in one call (rdma-core 24
/// and later): the number of entries written, or a negative errno.
pub(crate) type QueryGidTable = unsafe extern "C" fn(*mut ffi::ibv_context, *mut c_void, usize, u32, usize) -> isize;

macro_rules! entry_points {
    ($($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// libibverbs' exported entry points, by their C names.
        pub(crate) struct Ibverbs {
            $(pub(crate) $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
            /// rdma-core 34 and later (IBVERBS_1.12); `None` before.
            pub(crate) ibv_reg_dmabuf_mr:
                Option<unsafe extern "C" fn(*mut ffi::ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ffi::ibv_mr>,
            /// rdma-core 24 and later; `None` before.
            pub(crate) query_gid_table: Option<QueryGidTable>,
        }

        fn resolve(lib: Handle) -> std::result::Result<Ibverbs, String> {
            Ok(Ibverbs {
                $($name: {
                    let sym = lib.symbol(concat!(stringify!($name), "\0"))
                        .ok_or_else(|| format!("{} has no {}", SONAME.to_string_lossy(), stringify!($name)))?;
                    // SAFETY: libibverbs exports this name with exactly this C
                    // signature (verbs.h, as rdma-sys's bindings declare it); a
                    // non-null symbol address from dlsym converts to a function
                    // pointer on Linux.
                    unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) $(-> $ret)?>(sym) }
                },)*
                // SAFETY: as above, each with its verbs.h signature.
                ibv_reg_dmabuf_mr: lib.symbol("ibv_reg_dmabuf_mr\0").map(|s| unsafe { std::mem::transmute(s) }),
                // SAFETY: as above (`QueryGidTable` is its signature).
                query_gid_table: lib.symbol("_ibv_query_gid_table\0").map(|s| unsafe { std::mem::transmute(s) }),
            })
        }
    };
}

entry_points! {
    ibv_get_device_list: fn(*mut c_int) -> *mut *mut ffi::ibv_device;
    ibv_free_device_list: fn(*mut *mut ffi::ibv_device);
    ibv_get_device_name: fn(*mut ffi::ibv_device) -> *const c_char;
    ibv_get_device_guid: fn(*mut ffi::ibv_device) -> ffi::__be64;
    ibv_open_device: fn(*mut ffi::ibv_device) -> *mut ffi::ibv_context;
    ibv_close_device: fn(*mut ffi::ibv_context) -> c_int;
    ibv_query_device: fn(*mut ffi::ibv_context, *mut ffi::ibv_device_attr) -> c_int;
    ibv_query_port: fn(*mut ffi::ibv_context, u8, *mut ffi::_compat_ibv_port_attr) -> c_int;
    ibv_query_gid: fn(*mut ffi::ibv_context, u8, c_int, *mut ffi::ibv_gid) -> c_int;
    ibv_alloc_pd: fn(*mut ffi::ibv_context) -> *mut ffi::ibv_pd;
    ibv_dealloc_pd: fn(*mut ffi::ibv_pd) -> c_int;
    ibv_reg_mr_iova2: fn(*mut ffi::ibv_pd, *mut c_void, usize, u64, c_uint) -> *mut ffi::ibv_mr;
    ibv_dereg_mr: fn(*mut ffi::ibv_mr) -> c_int;
    ibv_create_comp_channel: fn(*mut ffi::ibv_context) -> *mut ffi::ibv_comp_channel;
    ibv_destroy_comp_channel: fn(*mut ffi::ibv_comp_channel) -> c_int;
    ibv_create_cq: fn(*mut ffi::ibv_context, c_int, *mut c_void, *mut ffi::ibv_comp_channel, c_int) -> *mut ffi::ibv_cq;
    ibv_destroy_cq: fn(*mut ffi::ibv_cq) -> c_int;
    ibv_get_cq_event: fn(*mut ffi::ibv_comp_channel, *mut *mut ffi::ibv_cq, *mut *mut c_void) -> c_int;
    ibv_ack_cq_events: fn(*mut ffi::ibv_cq, c_uint);
    ibv_create_qp: fn(*mut ffi::ibv_pd, *mut ffi::ibv_qp_init_attr) -> *mut ffi::ibv_qp;
    ibv_modify_qp: fn(*mut ffi::ibv_qp, *mut ffi::ibv_qp_attr, c_int) -> c_int;
    ibv_query_qp: fn(*mut ffi::ibv_qp, *mut ffi::ibv_qp_attr, c_int, *mut ffi::ibv_qp_init_attr) -> c_int;
    ibv_destroy_qp: fn(*mut ffi::ibv_qp) -> c_int;
}

/// Proof that libibverbs was loaded into the global scope (its dlopen
/// handle is never closed).
#[derive(Clone, Copy)]
struct Handle;

impl Handle {
    /// The symbol `name` (ending with a NUL) as the dynamic linker would
    /// bind it at start-up: searched in the global scope, so that a library
    /// preloaded to interpose on libibverbs (a tracer; the CUDA stand-in's
    /// nvidia-peermem, in the tests) is called as it would be if the
    /// program were linked against libibverbs.
    fn symbol(self, name: &str) -> Option<*mut c_void> {
        let name = CStr::from_bytes_with_nul(name.as_bytes()).ok()?;
        // SAFETY: a NUL-terminated name; the address is only looked up here.
        let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
        (!sym.is_null()).then_some(sym)
    }
}

/// libibverbs' entry points, loaded on first use; or why it could not be
/// loaded (the reason a domain gives for running over TCP).
///
/// # Errors
/// [`Error::NoDevice`] when `libibverbs.so.1` is not on this machine (or
/// lacks an entry point this crate needs): install rdma-core's
/// `libibverbs1` and `ibverbs-providers`.
pub(crate) fn ibverbs() -> Result<&'static Ibverbs> {
    static LIB: OnceLock<std::result::Result<Ibverbs, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(|reason| Error::NoDevice { reason: reason.clone() })
}

fn load() -> std::result::Result<Ibverbs, String> {
    // SAFETY: a valid C string. Loading runs libibverbs' initializers as the
    // dynamic linker would at start-up; the handle is never closed, so the
    // table's pointers stay valid for the life of the process. RTLD_GLOBAL:
    // the providers it loads (librxe, libmlx5) bind to its symbols.
    let handle = unsafe { libc::dlopen(SONAME.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a C string valid until the next dl call.
        let why = unsafe { libc::dlerror() };
        let why = if why.is_null() {
            "not found".to_owned()
        } else {
            // SAFETY: non-null, NUL-terminated (dlerror's contract).
            unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned()
        };
        return Err(format!(
            "rdma-core's {} could not be loaded ({why}): install libibverbs1 and ibverbs-providers for RDMA",
            SONAME.to_string_lossy()
        ));
    }
    resolve(Handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_resolves_where_rdma_core_is_installed() {
        // rdma-core is a build dependency here, so the library is on this
        // machine: every entry point must resolve (the kernel may still
        // have no RDMA: that is the device list's answer, not ours).
        let lib = ibverbs().expect("libibverbs.so.1 loads where it was built against");
        assert!(lib.ibv_reg_dmabuf_mr.is_some(), "rdma-core 44 has ibv_reg_dmabuf_mr");
        assert!(lib.query_gid_table.is_some());
    }
}
