//! An open device (`ibv_context`): device and port queries, the GID table.

use std::ffi::CStr;
use std::fmt;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as ffi;

use super::loader::ibverbs;

use super::port::{Gid, GidEntry, GidType, LinkLayer, Mtu, PortAttr, PortState};
use super::result::{self, zeroed};
use crate::error::{Error, Result};

/// An open RDMA device. Cheap to clone; the device is closed when the last
/// clone, and every resource made from it, is gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

pub(crate) struct ContextInner {
    ctx: NonNull<ffi::ibv_context>,
    name: String,
    ibdev_path: PathBuf,
}

// SAFETY: libibverbs contexts are thread-safe: every verb taking an
// `ibv_context` may be called from any thread concurrently.
unsafe impl Send for ContextInner {}
// SAFETY: as above.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        let lib = match ibverbs() {
            Ok(lib) => lib,
            Err(e) => return tracing::error!(device = %self.name, "cannot close the device: {e}"),
        };
        // SAFETY: opened by ibv_open_device, closed once; every child resource
        // holds an Arc of this and is therefore already destroyed.
        let rc = unsafe { (lib.ibv_close_device)(self.ctx.as_ptr()) };
        if let Err(e) = result::errno_rc(rc, "ibv_close_device") {
            tracing::error!(device = %self.name, "{e}");
        }
    }
}

/// What `ibv_query_device` reports, the fields this crate uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version.
    pub fw_ver: String,
    /// Node GUID (host order).
    pub node_guid: u64,
    /// Vendor id.
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Hardware version.
    pub hw_ver: u32,
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Most queue pairs.
    pub max_qp: u32,
    /// Most outstanding work requests per queue.
    pub max_qp_wr: u32,
    /// Most scatter/gather entries per work request.
    pub max_sge: u32,
    /// Most completion queue entries.
    pub max_cqe: u32,
    /// Most memory regions.
    pub max_mr: u32,
    /// Most RDMA reads/atomics a queue pair accepts as target.
    pub max_qp_rd_atom: u32,
    /// Most RDMA reads/atomics a queue pair issues at once.
    pub max_qp_init_rd_atom: u32,
    /// Whether atomics are supported (`atomic_cap` is not `IBV_ATOMIC_NONE`).
    pub atomics: bool,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
}

impl Context {
    /// Takes ownership of an open context.
    ///
    /// # Safety
    /// `ctx` must come from `ibv_open_device` and be owned by no one else:
    /// the returned value closes it.
    pub unsafe fn from_raw(ctx: NonNull<ffi::ibv_context>, name: String) -> Self {
        // SAFETY: the caller guarantees `ctx` is a live context; its `device`
        // pointer stays valid while the context is open.
        let ibdev_path = unsafe {
            let dev = (*ctx.as_ptr()).device;
            if dev.is_null() {
                PathBuf::from(format!("/sys/class/infiniband/{name}"))
            } else {
                PathBuf::from(CStr::from_ptr((*dev).ibdev_path.as_ptr()).to_string_lossy().into_owned())
            }
        };
        Context { inner: Arc::new(ContextInner { ctx, name, ibdev_path }) }
    }

    /// The raw context, for calls this crate does not wrap.
    pub fn as_raw(&self) -> *mut ffi::ibv_context {
        self.inner.ctx.as_ptr()
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device's sysfs directory.
    pub fn sysfs_path(&self) -> &std::path::Path {
        &self.inner.ibdev_path
    }

    /// `ibv_query_device`.
    ///
    /// # Errors
    /// [`Error::Verbs`].
    pub fn query_device(&self) -> Result<DeviceAttr> {
        let mut attr: ffi::ibv_device_attr = zeroed();
        // SAFETY: valid context and out-pointer.
        let rc = unsafe { (ibverbs()?.ibv_query_device)(self.as_raw(), &mut attr) };
        result::errno_rc(rc, "ibv_query_device")?;
        // SAFETY: fw_ver is a NUL-terminated char array filled by the driver.
        let fw_ver = unsafe { CStr::from_ptr(attr.fw_ver.as_ptr()) }.to_string_lossy().into_owned();
        let nonneg = |v: libc::c_int| v.max(0) as u32;
        Ok(DeviceAttr {
            fw_ver,
            node_guid: u64::from_be(attr.node_guid),
            vendor_id: attr.vendor_id,
            vendor_part_id: attr.vendor_part_id,
            hw_ver: attr.hw_ver,
            max_mr_size: attr.max_mr_size,
            max_qp: nonneg(attr.max_qp),
            max_qp_wr: nonneg(attr.max_qp_wr),
            max_sge: nonneg(attr.max_sge),
            max_cqe: nonneg(attr.max_cqe),
            max_mr: nonneg(attr.max_mr),
            max_qp_rd_atom: nonneg(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: nonneg(attr.max_qp_init_rd_atom),
            atomics: attr.atomic_cap != ffi::ibv_atomic_cap::IBV_ATOMIC_NONE,
            phys_port_cnt: attr.phys_port_cnt,
        })
    }

    /// `ibv_query_port`.
    ///
    /// # Errors
    /// [`Error::Verbs`] (for example `EINVAL` for a port that does not exist).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let mut attr: ffi::ibv_port_attr = zeroed();
        // SAFETY: a live context and an out-pointer of the size passed (the
        // extended query), or of the compat struct's prefix (the exported
        // `ibv_query_port` fills only that), as verbs.h's inline does.
        let rc = unsafe {
            match extended_query_port(self.as_raw()) {
                Some(query) => query(self.as_raw(), port, &mut attr, std::mem::size_of::<ffi::ibv_port_attr>()),
                None => (ibverbs()?.ibv_query_port)(self.as_raw(), port, (&mut attr as *mut ffi::ibv_port_attr).cast()),
            }
        };
        result::errno_rc(rc, "ibv_query_port")?;
        Ok(PortAttr {
            port,
            state: PortState::from_raw(attr.state),
            max_mtu: Mtu::from_raw(attr.max_mtu).unwrap_or(Mtu::Mtu256),
            active_mtu: Mtu::from_raw(attr.active_mtu).unwrap_or(Mtu::Mtu256),
            gid_tbl_len: attr.gid_tbl_len.max(0) as u32,
            lid: attr.lid,
            max_msg_sz: attr.max_msg_sz,
            link_layer: LinkLayer::from_raw(attr.link_layer),
            active_width: attr.active_width,
            active_speed: attr.active_speed,
        })
    }

    /// `ibv_query_gid` for one index.
    ///
    /// # Errors
    /// [`Error::Verbs`] for an index outside the table.
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        let mut gid: ffi::ibv_gid = zeroed();
        let index =
            i32::try_from(index).map_err(|_| Error::InvalidArgument(format!("GID index {index} is too large")))?;
        // SAFETY: valid context and out-pointer.
        let rc = unsafe { (ibverbs()?.ibv_query_gid)(self.as_raw(), port, index, &mut gid) };
        result::minus_one(rc, "ibv_query_gid")?;
        // SAFETY: every bit pattern of the union is a valid byte array.
        Ok(Gid(unsafe { gid.raw }))
    }

    /// The non-empty GID table entries of a port, with their types and
    /// network devices read from sysfs.
    ///
    /// Read in one call (`ibv_query_gid_table`) where libibverbs has it,
    /// else index by index (`ibv_query_gid`), where empty entries fail or
    /// read as zero GIDs and their sysfs attributes fail with `EINVAL`; all
    /// are skipped.
    ///
    /// # Errors
    /// [`Error::Verbs`] from `ibv_query_port`.
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let attr = self.query_port(port)?;
        let attrs_dir = self.inner.ibdev_path.join(format!("ports/{port}/gid_attrs"));
        // One call where libibverbs has it; else one query per index (a
        // failing system call for each empty entry: 1,024 on soft-RoCE).
        let valid = match self.valid_gids(port, attr.gid_tbl_len) {
            Some(valid) => valid,
            None => (0..attr.gid_tbl_len).filter_map(|i| self.query_gid(port, i).ok().map(|g| (i, g))).collect(),
        };
        let mut entries = Vec::new();
        for (index, gid) in valid {
            if gid.is_zero() {
                continue;
            }
            let read = |kind: &str| std::fs::read_to_string(attrs_dir.join(format!("{kind}/{index}"))).ok();
            let gid_type = match (read("types"), attr.link_layer) {
                (Some(text), _) => GidType::from_sysfs(&text),
                (None, LinkLayer::InfiniBand) => GidType::IbOrRoceV1,
                (None, _) => GidType::Unknown,
            };
            let netdev = read("ndevs").map(|s| s.trim().to_owned()).filter(|s| !s.is_empty());
            entries.push(GidEntry { index, gid, gid_type, netdev });
        }
        Ok(entries)
    }

    /// The valid GIDs of `port` (index and GID, in index order) from
    /// libibverbs' `ibv_query_gid_table`, or `None` where this libibverbs
    /// lacks it or it failed (the caller then queries index by index).
    fn valid_gids(&self, port: u8, port_len: u32) -> Option<Vec<(u32, Gid)>> {
        let query = ibverbs().ok()?.query_gid_table?;
        // The table holds every port's entries.
        let ports = u32::from(self.query_device().ok()?.phys_port_cnt.max(1));
        let room = usize::try_from(port_len.checked_mul(ports)?).ok()?;
        let mut raw: Vec<RawGidEntry> = Vec::with_capacity(room);
        // SAFETY: a live context; `raw` has room for `room` entries of the
        // size passed, which libibverbs fills from the start and counts in
        // its return value (or returns a negative errno and fills nothing
        // that is read).
        let n = unsafe { query(self.as_raw(), raw.as_mut_ptr().cast(), room, 0, std::mem::size_of::<RawGidEntry>()) };
        let n = usize::try_from(n).ok()?.min(room);
        // SAFETY: the first `n` entries were written (above), and every
        // bit pattern is a valid `RawGidEntry` (integers and bytes).
        unsafe { raw.set_len(n) };
        let mut valid: Vec<(u32, Gid)> =
            raw.iter().filter(|e| e.port_num == u32::from(port)).map(|e| (e.gid_index, Gid(e.gid))).collect();
        valid.sort_unstable_by_key(|(index, _)| *index);
        Some(valid)
    }
}

/// rdma-core's `struct ibv_gid_entry` (verbs.h, since rdma-core 24), which
/// rdma-sys 0.3 does not bind.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawGidEntry {
    gid: [u8; 16],
    gid_index: u32,
    port_num: u32,
    gid_type: u32,
    ndev_ifindex: u32,
}

/// The provider's extended `query_port` (what verbs.h's inline
/// `ibv_query_port` prefers, filling the whole `ibv_port_attr`), where the
/// context is a `verbs_context` new enough to have it.
///
/// # Safety
/// `ctx` must be a live context from `ibv_open_device`.
unsafe fn extended_query_port(
    ctx: *mut ffi::ibv_context,
) -> Option<unsafe extern "C" fn(*mut ffi::ibv_context, u8, *mut ffi::ibv_port_attr, usize) -> libc::c_int> {
    // SAFETY: a live context (the caller's contract).
    if unsafe { (*ctx).abi_compat } as usize != u32::MAX as usize {
        return None;
    }
    // A context whose `abi_compat` is this marker is the `context` member of
    // a `verbs_context` (verbs.h's `verbs_get_ctx`).
    let vctx =
        ctx.cast::<u8>().wrapping_sub(std::mem::offset_of!(ffi::verbs_context, context)).cast::<ffi::verbs_context>();
    // SAFETY: as above, `vctx` is that live `verbs_context`; `sz` says how
    // much of it the provider's libibverbs knows, as verbs.h checks.
    let sz = unsafe { (*vctx).sz };
    if sz < std::mem::size_of::<ffi::verbs_context>() - std::mem::offset_of!(ffi::verbs_context, query_port) {
        return None;
    }
    // SAFETY: within the part of the struct `sz` covers.
    unsafe { (*vctx).query_port }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context").field("name", &self.inner.name).finish()
    }
}
