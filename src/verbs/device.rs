//! Device discovery: `ibv_get_device_list` and `ibv_open_device`.

use std::ffi::CStr;
use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;

use rdma_sys as ffi;

use super::loader::{Ibverbs, ibverbs};

use super::context::Context;
use super::result;
use crate::error::{Error, Result};

/// The RDMA devices on this machine, as `ibv_get_device_list` reports them.
///
/// Devices must be opened while the list lives; an opened [`Context`]
/// outlives it.
pub struct DeviceList {
    list: NonNull<*mut ffi::ibv_device>,
    len: usize,
    lib: &'static Ibverbs,
}

// SAFETY: the list is an immutable array of device pointers owned by this value;
// libibverbs allows reading and opening devices from any thread.
unsafe impl Send for DeviceList {}
// SAFETY: as above: every method takes `&self` and only reads.
unsafe impl Sync for DeviceList {}

impl DeviceList {
    /// Lists the devices.
    ///
    /// # Errors
    /// [`Error::NoDevice`] when rdma-core's libibverbs is not installed,
    /// when the kernel has no RDMA support (`ENOSYS`),
    /// when the uverbs devices cannot be read, or on another errno.
    pub fn new() -> Result<Self> {
        let lib = ibverbs()?;
        let mut n: libc::c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the returned array is freed in Drop.
        let raw = unsafe { (lib.ibv_get_device_list)(&mut n) };
        let list = NonNull::new(raw).ok_or_else(|| {
            let err = std::io::Error::last_os_error();
            let reason = match err.raw_os_error() {
                Some(libc::ENOSYS) => format!(
                    "this kernel has no RDMA support (ibv_get_device_list: {err}); \
                     load an RDMA driver (mlx5_ib, or rdma_rxe for soft-RoCE) on a kernel built with InfiniBand"
                ),
                Some(libc::EPERM) | Some(libc::EACCES) => format!(
                    "no permission to read the RDMA devices (ibv_get_device_list: {err}); check /dev/infiniband"
                ),
                _ => format!("ibv_get_device_list failed: {err}"),
            };
            Error::NoDevice { reason }
        })?;
        Ok(DeviceList { list, len: n.max(0) as usize, lib })
    }

    /// The number of devices.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The devices, in the order libibverbs lists them.
    pub fn iter(&self) -> impl Iterator<Item = Device<'_>> + '_ {
        (0..self.len).filter_map(move |i| {
            // SAFETY: `i < len`, the array has `len` entries and lives as long as `self`.
            let dev = unsafe { *self.list.as_ptr().add(i) };
            NonNull::new(dev).map(|ptr| Device { ptr, lib: self.lib, _list: PhantomData })
        })
    }

    /// The names of all devices.
    pub fn names(&self) -> Vec<String> {
        self.iter().map(|d| d.name()).collect()
    }

    /// The device called `name`.
    ///
    /// # Errors
    /// [`Error::DeviceNotFound`], listing the devices that exist.
    pub fn find(&self, name: &str) -> Result<Device<'_>> {
        self.iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| Error::DeviceNotFound { name: name.to_owned(), available: self.names() })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the pointer came from ibv_get_device_list and is freed once.
        unsafe { (self.lib.ibv_free_device_list)(self.list.as_ptr()) };
    }
}

impl fmt::Debug for DeviceList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// One device of a [`DeviceList`].
#[derive(Clone, Copy)]
pub struct Device<'list> {
    ptr: NonNull<ffi::ibv_device>,
    lib: &'static Ibverbs,
    _list: PhantomData<&'list DeviceList>,
}

impl Device<'_> {
    /// The kernel's name for it, for example `mlx5_0` or `rxe0`.
    pub fn name(&self) -> String {
        // SAFETY: the device pointer is valid while the list lives; the name is a
        // NUL-terminated string owned by libibverbs.
        let name = unsafe { (self.lib.ibv_get_device_name)(self.ptr.as_ptr()) };
        if name.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated, valid while the list lives.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    }

    /// The node GUID, in host byte order.
    pub fn guid(&self) -> u64 {
        // SAFETY: valid device pointer.
        u64::from_be(unsafe { (self.lib.ibv_get_device_guid)(self.ptr.as_ptr()) })
    }

    /// The kernel's sysfs path for it (`/sys/class/infiniband/<name>`).
    pub fn ibdev_path(&self) -> String {
        // SAFETY: valid device pointer; `ibdev_path` is a NUL-terminated array
        // inside the device struct.
        let path = unsafe { &(*self.ptr.as_ptr()).ibdev_path };
        // SAFETY: libibverbs fills it NUL-terminated.
        unsafe { CStr::from_ptr(path.as_ptr()) }.to_string_lossy().into_owned()
    }

    /// Opens it.
    ///
    /// # Errors
    /// [`Error::Verbs`] from `ibv_open_device` (for example no permission on
    /// `/dev/infiniband/uverbsN`).
    pub fn open(&self) -> Result<Context> {
        // SAFETY: valid device pointer; the context is closed by Context's Drop.
        let ctx = unsafe { (self.lib.ibv_open_device)(self.ptr.as_ptr()) };
        let ctx = result::nonnull(ctx, "ibv_open_device")?;
        // SAFETY: `ctx` was just returned by ibv_open_device and is owned by no one else.
        Ok(unsafe { Context::from_raw(ctx, self.name()) })
    }
}

impl fmt::Debug for Device<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name())
            .field("guid", &format_args!("{:016x}", self.guid()))
            .finish()
    }
}
