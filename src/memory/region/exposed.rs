//! [`Shared`] and [`Exposed`]: a region shared by several operations, and
//! one exposed to peers (a second registration with remote rights; on the
//! staged path a pinned host mirror).

use super::*;

/// The state behind [`Shared`] and [`Exposed`]: a region, possibly a second
/// registration with remote rights, and a lock for CPU-side copies.
struct SharedInner<M: Memory> {
    // Dropped by hand: stop serving TCP peers (waiting for transfers in
    // progress), revoke the remote key, then the region (or leak the region
    // if revoking failed).
    tcp: Option<Served>,
    remote: ManuallyDrop<Option<Registration>>,
    region: ManuallyDrop<Region<M>>,
    access: Access,
    tag: u64,
    // Serializes CPU-side copies through shared handles.
    cpu: Mutex<()>,
    _live: Option<Live>,
}

impl<M: Memory> Drop for SharedInner<M> {
    fn drop(&mut self) {
        drop(self.tcp.take());
        // SAFETY: both fields are taken exactly once, here, and never used again.
        let (remote, region) = unsafe { (ManuallyDrop::take(&mut self.remote), ManuallyDrop::take(&mut self.region)) };
        match remote {
            Some(remote) => release(remote, region),
            None => drop(region),
        }
    }
}

impl<M: Memory> SharedInner<M> {
    /// Takes the region out, revoking the remote key first (if any).
    fn into_region(self) -> std::result::Result<Region<M>, Error> {
        let mut inner = ManuallyDrop::new(self);
        // SAFETY: `inner` is never used again and its Drop does not run; every
        // field is taken or dropped exactly once here.
        let (remote, region) = unsafe {
            std::ptr::drop_in_place(&mut inner.tcp);
            std::ptr::drop_in_place(&mut inner.cpu);
            std::ptr::drop_in_place(&mut inner._live);
            (ManuallyDrop::take(&mut inner.remote), ManuallyDrop::take(&mut inner.region))
        };
        match remote.map(Registration::deregister) {
            Some(Err(e)) => {
                std::mem::forget(region);
                Err(e)
            }
            _ => Ok(region),
        }
    }
}

// Generic over the memory type for the rail set's aliases of host memory;
// callers outside `Exposed<HostMemory>` check that the memory is host memory.
impl<M: Memory> SharedInner<M> {
    fn check(&self, offset: usize, len: usize) -> Result<()> {
        Error::check_local(offset, len, self.region.len())
    }

    fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        let _cpu = self.cpu.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the range is inside the live registered mapping (checked); CPU
        // copies are serialized by the lock, and `out` is a distinct Rust buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(self.region.memory().as_ptr().add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }

    fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        let _cpu = self.cpu.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: as in read_at; no Rust reference to the mapping exists outside
        // `as_slice`, whose contract excludes this call.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.region.memory().as_ptr().add(offset), data.len()) };
        Ok(())
    }

    /// # Safety
    /// As [`Shared::as_slice`].
    unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is live for as long as `self`; the caller
        // guarantees that nothing writes it while the slice lives.
        unsafe { std::slice::from_raw_parts(self.region.memory().as_ptr(), self.region.len()) }
    }
}

/// A [`Region`] shared between several operations at once, for example
/// receives into consecutive chunks of one buffer. Cheap to clone; every
/// clone and every operation using it keeps it registered. Get the
/// [`Region`] back with [`Shared::try_into_region`] once no operation
/// uses it.
///
/// While shared, the device may be writing any part of it, so it offers no
/// safe `&[u8]`: copy with [`read_at`](Shared::read_at) and
/// [`write_at`](Shared::write_at), or use [`as_slice`](Shared::as_slice)
/// under its contract. Operations on overlapping ranges at the same time
/// are the caller's mistake: the bytes may mix, but memory stays safe.
pub struct Shared<M: Memory = HostMemory> {
    inner: Arc<SharedInner<M>>,
}

/// A region a peer may access with its remote key, as granted at
/// [`Domain::expose`](crate::Domain::expose): a [`Shared`] region with a
/// second registration that carries only the remote rights asked for.
///
/// Cheap to clone. Since a peer may write it at any moment, it offers no
/// safe `&[u8]`: copy out with [`Exposed::read_at`], or use
/// [`Exposed::as_slice`] under its contract, or [`withdraw`](Exposed::withdraw)
/// it to revoke the key and get the [`Region`] back.
pub struct Exposed<M: Memory = HostMemory> {
    inner: Arc<SharedInner<M>>,
}

macro_rules! shared_common {
    ($t:ident) => {
        impl<M: Memory> Clone for $t<M> {
            fn clone(&self) -> Self {
                $t { inner: Arc::clone(&self.inner) }
            }
        }

        impl<M: Memory> $t<M> {
            /// Length in bytes.
            pub fn len(&self) -> usize {
                self.inner.region.len()
            }

            /// Whether the length is zero.
            pub fn is_empty(&self) -> bool {
                self.inner.region.is_empty()
            }

            /// The local key.
            pub fn lkey(&self) -> u32 {
                self.inner.region.lkey()
            }

            /// Where the memory lives.
            pub fn kind(&self) -> MemoryKind {
                self.inner.region.kind()
            }
        }

        impl $t<HostMemory> {
            /// Copies `out.len()` bytes at `offset` out. If the device writes
            /// the same bytes meanwhile (a peer's write, a receive in flight),
            /// the copy may mix old and new data: read after the operation that
            /// fills them has completed.
            ///
            /// # Errors
            /// [`Error::OutOfBounds`].
            pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
                self.inner.read_at(offset, out)
            }

            /// Copies `data` in at `offset` (to prepare data to send, or for a
            /// peer to read).
            ///
            /// # Errors
            /// [`Error::OutOfBounds`].
            pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
                self.inner.write_at(offset, data)
            }

            /// The bytes, without a copy.
            ///
            /// # Safety
            /// While the returned slice lives, nothing may write the region: no
            /// peer (for an exposed region), no operation of this side that
            /// writes it (a receive or read into it), and no
            /// [`write_at`](Self::write_at). For example: after the operation
            /// or peer that filled it signalled completion, and before anything
            /// may write it again.
            pub unsafe fn as_slice(&self) -> &[u8] {
                // SAFETY: forwarded contract.
                unsafe { self.inner.as_slice() }
            }
        }

        impl<M: Memory> super::local::Sealed for $t<M> {
            fn parts(&self) -> LocalParts {
                self.inner.region.parts()
            }

            #[cfg(feature = "cuda")]
            fn cuda(&self) -> Option<&crate::cuda::CudaBuffer> {
                self.inner.region.cuda()
            }
        }

        impl<M: Memory> $t<M> {
            /// For GPU memory: the path the NIC reaches it by.
            pub fn memory_path(&self) -> Option<MemPath> {
                self.inner.region.memory_path()
            }

            /// For GPU memory: the path chosen and why the others lost.
            pub fn path_report(&self) -> Option<&PathReport> {
                self.inner.region.path_report()
            }
        }

        impl<M: Memory> LocalBuffer for $t<M> {
            fn buffer_len(&self) -> usize {
                self.len()
            }
        }
    };
}

shared_common!(Shared);
shared_common!(Exposed);

impl<M: Memory> Region<M> {
    /// Shares the region between several operations at once.
    pub fn share(self) -> Shared<M> {
        Shared {
            inner: Arc::new(SharedInner {
                tcp: None,
                remote: ManuallyDrop::new(None),
                region: ManuallyDrop::new(self),
                access: Access::empty(),
                tag: 0,
                cpu: Mutex::new(()),
                _live: None,
            }),
        }
    }
}

impl<M: Memory> Shared<M> {
    /// `read_at` for any host memory type (the rail
    /// set's aliases); other memory is refused.
    pub(crate) fn copy_out(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.host_only()?;
        self.inner.read_at(offset, out)
    }

    /// `write_at` for any host memory type.
    pub(crate) fn copy_in(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.host_only()?;
        self.inner.write_at(offset, data)
    }

    fn host_only(&self) -> Result<()> {
        match self.kind() {
            MemoryKind::Host => Ok(()),
            kind => Err(Error::InvalidArgument(format!("CPU copies need host memory; this region is {kind:?}"))),
        }
    }

    /// The region back when this is the last handle (no clone, no operation
    /// in flight); else `self`.
    ///
    /// # Errors
    /// `Err(self)` while other handles exist.
    pub fn try_into_region(self) -> std::result::Result<Region<M>, Self> {
        let inner = Arc::try_unwrap(self.inner).map_err(|inner| Shared { inner })?;
        // Without a remote registration nothing can fail here.
        Ok(inner.into_region().unwrap_or_else(|_| unreachable!("no remote registration to revoke")))
    }
}

#[cfg(feature = "cuda")]
impl Shared<crate::cuda::CudaBuffer> {
    /// The GPU buffer (copy in and out with its methods once no operation
    /// writes it).
    pub fn cuda(&self) -> &crate::cuda::CudaBuffer {
        self.inner.region.memory()
    }
}

#[cfg(feature = "cuda")]
impl Exposed<crate::cuda::CudaBuffer> {
    /// The GPU buffer.
    pub fn cuda(&self) -> &crate::cuda::CudaBuffer {
        self.inner.region.memory()
    }

    /// Makes the GPU contents readable by peers: waits for the latest fence
    /// (see [`CudaBuffer::ready_after`](crate::cuda::CudaBuffer::ready_after)),
    /// and on the staged path copies them into the host mirror peers read.
    /// Call it before telling a peer to read.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    ///
    /// This copies the whole region on the staged path; when only part of
    /// it changed, [`publish_range`](Self::publish_range) moves just that.
    pub fn publish(&self) -> Result<()> {
        self.publish_range(0..self.cuda().len())
    }

    /// [`publish`](Self::publish) for the bytes in `range` only: on the
    /// staged path only they are copied into the mirror (the rest of the
    /// mirror, which peers may be writing, is left alone).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] past the region; [`Error::Cuda`].
    pub fn publish_range(&self, range: std::ops::Range<usize>) -> Result<()> {
        let buf = self.cuda();
        let (off, len) = self.check_mirror_range(&range)?;
        buf.wait_ready()?;
        if let Some((addr, _)) = self.remote().mirror() {
            let _cpu = self.inner.cpu.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: `off..off + len` is inside the mirror, a live mapping owned by
            // the remote registration (checked); no Rust reference to it exists
            // (CPU copies are serialized).
            unsafe { buf.copy_to_raw(off, (addr as usize + off) as *mut u8, len) }?;
        }
        Ok(())
    }

    /// `range` inside both the GPU buffer and its mirror, as (offset, length).
    fn check_mirror_range(&self, range: &std::ops::Range<usize>) -> Result<(usize, usize)> {
        let buf = self.cuda();
        let limit = self.remote().mirror().map_or(buf.len(), |(_, len)| len.min(buf.len()));
        if range.start > range.end || range.end > limit {
            return Err(Error::OutOfBounds {
                side: "local",
                offset: range.start as u64,
                len: range.end.saturating_sub(range.start) as u64,
                region_len: limit as u64,
            });
        }
        Ok((range.start, range.end - range.start))
    }

    /// Makes what peers wrote visible to CUDA work: on a direct path a flush
    /// of remote writes where the GPU needs one, on the staged path a copy
    /// of the host mirror into GPU memory. Call it after the peer said it
    /// is done; [`Connection::recv_write`](crate::Connection::recv_write)
    /// does it for you.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    ///
    /// This copies the whole mirror on the staged path, over anything the
    /// owner changed in GPU memory meanwhile; when peers wrote only part of
    /// the region, [`pull_range`](Self::pull_range) (or
    /// [`Connection::recv_write_range`](crate::Connection::recv_write_range))
    /// moves just that, and leaves the rest of GPU memory alone.
    pub fn pull(&self) -> Result<()> {
        self.pull_range(0..self.cuda().len())
    }

    /// [`pull`](Self::pull) for the bytes in `range` only: on the staged
    /// path only they are copied from the mirror into GPU memory. The
    /// copy into GPU memory waits for the latest fence (work still reading
    /// the bytes it overwrites).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] past the region; [`Error::Cuda`].
    pub fn pull_range(&self, range: std::ops::Range<usize>) -> Result<()> {
        let (off, len) = self.check_mirror_range(&range)?;
        self.inner.pull(off, len)
    }
}

#[cfg(feature = "cuda")]
impl<M: Memory> Exposed<M> {
    /// What makes peers' writes into this region visible, for the domain's
    /// table (found by key when a notification names the region).
    pub(crate) fn visible(&self) -> std::sync::Weak<dyn crate::memory::visible::Visible> {
        let weak: std::sync::Weak<SharedInner<M>> = Arc::downgrade(&self.inner);
        weak
    }
}

#[cfg(feature = "cuda")]
impl<M: Memory> SharedInner<M> {
    /// Copies `off..off + len` of the staged mirror into GPU memory (checked
    /// by the caller against both), after the latest fence; on a direct
    /// path, flushes remote writes where the GPU needs that.
    fn pull(&self, off: usize, len: usize) -> Result<()> {
        let Some(buf) = self.region.memory().cuda_buffer() else { return Ok(()) };
        let remote = self.remote.as_ref().expect("an exposed region has a remote registration");
        match remote.mirror() {
            Some((addr, _)) => {
                buf.wait_ready()?;
                let _cpu = self.cpu.lock().unwrap_or_else(|e| e.into_inner());
                // SAFETY: `off..off + len` is inside the mirror (the caller checked),
                // a live mapping owned by the remote registration; no Rust reference
                // to it exists (CPU copies are serialized by `cpu`).
                unsafe { buf.copy_from_raw(off, (addr as usize + off) as *const u8, len) }
            }
            None => buf.device().flush_remote_writes(),
        }
    }
}

#[cfg(feature = "cuda")]
impl<M: Memory> crate::memory::visible::Visible for SharedInner<M> {
    fn make_visible(&self, addr: u64, len: u64) -> Result<()> {
        let Some(buf) = self.region.memory().cuda_buffer() else { return Ok(()) };
        let remote = self.remote.as_ref().expect("an exposed region has a remote registration");
        // The range as the peer named it, in the descriptor's addresses (the
        // mirror's on the staged path); what lies outside the region is not
        // this side's to copy.
        let (base, limit) = remote.mirror().map_or((self.region.addr(), buf.len()), |(a, l)| (a, l.min(buf.len())));
        let off = addr.saturating_sub(base).min(limit as u64) as usize;
        let end = addr.saturating_add(len).saturating_sub(base).min(limit as u64) as usize;
        if end <= off && remote.mirror().is_some() {
            return Ok(());
        }
        self.pull(off, end.saturating_sub(off))
    }

    fn flush_direct(&self) -> Result<()> {
        let Some(buf) = self.region.memory().cuda_buffer() else { return Ok(()) };
        match self.remote.as_ref().and_then(|r| r.mirror()) {
            Some(_) => Ok(()),
            None => buf.device().flush_remote_writes(),
        }
    }
}

/// Why [`Exposed::withdraw`] did not give the region back.
#[derive(Debug)]
pub enum WithdrawError<M: Memory> {
    /// Other handles exist (clones, or operations in flight): here it is back.
    InUse(Exposed<M>),
    /// Revoking the remote key failed; the region was leaked so that no
    /// peer can reach freed memory.
    Failed(Error),
}

impl<M: Memory> fmt::Display for WithdrawError<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WithdrawError::InUse(_) => {
                f.write_str("the exposed region is still in use (clones or operations in flight)")
            }
            WithdrawError::Failed(e) => write!(f, "revoking the remote key failed: {e}"),
        }
    }
}

impl<M: Memory + fmt::Debug> std::error::Error for WithdrawError<M> {}

impl<M: Memory> Exposed<M> {
    pub(crate) fn from_parts(
        remote: Registration,
        region: Region<M>,
        access: Access,
        tag: u64,
        live: Live,
        tcp: Option<Served>,
    ) -> Self {
        Exposed {
            inner: Arc::new(SharedInner {
                tcp,
                remote: ManuallyDrop::new(Some(remote)),
                region: ManuallyDrop::new(region),
                access,
                tag,
                cpu: Mutex::new(()),
                _live: Some(live),
            }),
        }
    }

    /// Counts it, and the region inside, as the crate's own, not in
    /// [`DomainStats`](crate::DomainStats).
    pub(crate) fn count_as_internal(&mut self) {
        let inner = Arc::get_mut(&mut self.inner).expect("a fresh exposed region has one handle");
        if let Some(live) = inner._live.as_mut() {
            live.recount(crate::memory::Counter::Internal);
        }
        inner.region._live.recount(crate::memory::Counter::Internal);
    }

    /// A handle on the same registration for local use only (what a rail
    /// transfer posts from): no remote rights of its own.
    pub(crate) fn local_view(&self) -> Shared<M> {
        Shared { inner: Arc::clone(&self.inner) }
    }

    /// The memory (for [`PeerWritten`](super::peer_written::PeerWritten),
    /// which reads it only through raw pointers).
    pub(crate) fn region_memory(&self) -> &M {
        self.inner.region.memory()
    }

    fn remote(&self) -> &Registration {
        self.inner.remote.as_ref().expect("an exposed region has a remote registration")
    }

    /// What a peer needs to access it.
    pub fn descriptor(&self) -> RemoteRegion {
        RemoteRegion {
            tag: self.inner.tag,
            addr: self.remote().mirror().map_or(self.inner.region.addr(), |(addr, _)| addr),
            len: self.inner.region.len() as u64,
            rkey: self.rkey(),
            access: self.inner.access,
        }
    }

    /// The remote rights granted.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        // The verbs key where there is one; the TCP transport serves the
        // region under the same key, so one descriptor works on both.
        self.remote().rkey().or(self.inner.tcp.as_ref().map(Served::key)).unwrap_or(0)
    }

    /// The tag it was exposed with.
    pub fn tag(&self) -> u64 {
        self.inner.tag
    }

    /// A byte range of it, for an operation (the same as
    /// [`LocalBuffer::slice`], without importing the trait).
    pub fn slice(self, range: impl RangeBounds<usize>) -> LocalSlice<Self> {
        LocalSlice::new(self, range)
    }

    /// Revokes the remote key and returns the region, when this is the last
    /// handle (no clone, no operation in flight). A peer that uses the old
    /// key afterwards gets a remote-access error.
    ///
    /// # Errors
    /// [`WithdrawError::InUse`] (with `self` back) while other handles exist;
    /// [`WithdrawError::Failed`] if the key could not be revoked.
    pub fn withdraw(self) -> std::result::Result<Region<M>, WithdrawError<M>> {
        let inner = Arc::try_unwrap(self.inner).map_err(|inner| WithdrawError::InUse(Exposed { inner }))?;
        inner.into_region().map_err(WithdrawError::Failed)
    }
}

impl<M: Memory + fmt::Debug> fmt::Debug for Shared<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared").field("region", &*self.inner.region).finish()
    }
}

impl<M: Memory + fmt::Debug> fmt::Debug for Exposed<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exposed").field("region", &*self.inner.region).field("remote", &self.descriptor()).finish()
    }
}
