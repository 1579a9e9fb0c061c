//! [`LocalBuffer`] and [`LocalSlice`]: what an operation uses locally, and
//! where it is for posting.

use super::*;

mod sealed {
    /// Where a local buffer is, for posting. Not nameable outside the crate.
    #[derive(Clone, Copy, Debug)]
    pub struct LocalParts {
        pub addr: u64,
        pub len: usize,
        pub lkey: u32,
        pub domain: u64,
        /// GPU memory: how the NIC reaches it.
        pub path: Option<super::MemPath>,
    }

    pub trait Sealed {
        fn parts(&self) -> LocalParts;
        /// GPU memory: the buffer.
        #[cfg(feature = "cuda")]
        fn cuda(&self) -> Option<&crate::cuda::CudaBuffer>;
    }
}

pub(crate) use sealed::{LocalParts, Sealed};

/// Where all of `buf` is, for posting.
pub(crate) fn parts_of<B: LocalBuffer>(buf: &B) -> LocalParts {
    buf.parts()
}

/// A buffer operations can use locally: [`Region`] and [`Exposed`].
///
/// Operations take it by value (an [`Exposed`] by clone) and give it back
/// with their completion. Sealed: the crate relies on its implementations
/// keeping the memory registered.
pub trait LocalBuffer: sealed::Sealed + Send + Sized + 'static {
    /// Length in bytes.
    fn buffer_len(&self) -> usize;

    /// A byte range of it, for an operation. The range is checked when the
    /// operation is posted; a bad one fails that operation with
    /// [`Error::OutOfBounds`] and the buffer comes back.
    fn slice(self, range: impl RangeBounds<usize>) -> LocalSlice<Self> {
        LocalSlice::new(self, range)
    }
}

impl<M: Memory> sealed::Sealed for Region<M> {
    fn parts(&self) -> LocalParts {
        LocalParts {
            addr: self.addr(),
            len: self.len(),
            lkey: self.reg.lkey(),
            domain: self.domain,
            path: self.memory_path(),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self) -> Option<&crate::cuda::CudaBuffer> {
        self.mem.cuda_buffer()
    }
}

impl<M: Memory> LocalBuffer for Region<M> {
    fn buffer_len(&self) -> usize {
        self.len()
    }
}

/// A local buffer and the byte range of it an operation uses, and, for
/// this operation alone, the GPU work it waits for ([`after`](Self::after)).
#[derive(Debug, Clone)]
pub struct LocalSlice<B> {
    buf: B,
    start: usize,
    end: Option<usize>,
    bad: bool,
    /// Fences of this operation alone (stream-ordered), beside the
    /// buffer's own ([`CudaBuffer::ready_after`](crate::cuda::CudaBuffer::ready_after)).
    #[cfg(feature = "cuda")]
    after: Vec<Arc<crate::cuda::CudaEvent>>,
}

impl<B: LocalBuffer> LocalSlice<B> {
    /// `range` of `buf` (checked when posted).
    pub fn new(buf: B, range: impl RangeBounds<usize>) -> Self {
        let mut bad = false;
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.checked_add(1).unwrap_or_else(|| {
                bad = true;
                usize::MAX
            }),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => Some(e.checked_add(1).unwrap_or_else(|| {
                bad = true;
                usize::MAX
            })),
            Bound::Excluded(&e) => Some(e),
            Bound::Unbounded => None,
        };
        LocalSlice {
            buf,
            start,
            end,
            bad,
            #[cfg(feature = "cuda")]
            after: Vec::new(),
        }
    }

    /// The operation on this slice, and it alone, waits for the work queued
    /// on `stream` up to this call: a kernel producing what a send or write
    /// reads, or still reading what a receive or read overwrites. The
    /// stream-ordered form of a fence, as NCCL's operations take the
    /// caller's stream: nothing is synchronized, and no other operation on
    /// the buffer waits for it (a fence for every later operation is
    /// [`CudaBuffer::ready_after`](crate::cuda::CudaBuffer::ready_after)).
    /// Call it once per stream; the operation waits for every one. Posting
    /// never blocks on it: a send, write, read or list is kept in its place
    /// in the connection's order until the work is done, a receive into
    /// GPU memory lands in a host slot whose copy into the GPU waits for
    /// it, and a receive into host memory is kept at the receive queue's
    /// gate (the receives posted after it wait behind it, so each message
    /// still lands in the receive posted for it). Only a receive ring given
    /// the fence waits for it before it posts its slots.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the event cannot be recorded.
    #[cfg(feature = "cuda")]
    pub fn after(self, stream: &crate::cuda::CudaStream) -> Result<Self> {
        Ok(self.after_event(Arc::new(crate::cuda::CudaEvent::record(stream)?)))
    }

    /// [`after`](Self::after) for an event already recorded on the
    /// producer's stream.
    #[cfg(feature = "cuda")]
    pub fn after_event(mut self, event: Arc<crate::cuda::CudaEvent>) -> Self {
        self.after.push(event);
        self
    }

    /// Whether this operation has fences of its own.
    #[cfg(feature = "cuda")]
    pub(crate) fn has_own_fences(&self) -> bool {
        !self.after.is_empty()
    }

    /// Every fence the operation on this slice waits for: the buffer's
    /// (GPU memory) and its own.
    #[cfg(feature = "cuda")]
    pub(crate) fn fences(&self) -> Vec<Arc<crate::cuda::CudaEvent>> {
        let mut all = self.buf.cuda().map(|c| c.fences()).unwrap_or_default();
        all.extend(self.after.iter().cloned());
        all
    }

    /// Waits on the CPU for every fence: the buffer's (those leave its set)
    /// and the slice's own. For a receive, which cannot be kept in order.
    #[cfg(feature = "cuda")]
    pub(crate) fn wait_fences(&self) -> Result<()> {
        if let Some(c) = self.buf.cuda() {
            c.wait_ready()?;
        }
        self.after.iter().try_for_each(|f| f.synchronize())
    }

    /// The buffer back.
    pub fn into_inner(self) -> B {
        self.buf
    }

    /// The buffer.
    pub fn buffer(&self) -> &B {
        &self.buf
    }

    /// Address, length and lkey of the range, checked against the buffer.
    pub(crate) fn resolve(&self) -> Result<LocalParts> {
        let parts = self.buf.parts();
        let end = self.end.unwrap_or(parts.len);
        if self.bad || self.start > end || end > parts.len {
            return Err(Error::OutOfBounds {
                side: "local",
                offset: self.start as u64,
                len: end.saturating_sub(self.start) as u64,
                region_len: parts.len as u64,
            });
        }
        Ok(LocalParts { addr: parts.addr + self.start as u64, len: end - self.start, ..parts })
    }
}

impl<B> LocalSlice<B> {
    /// Where the range starts in the buffer.
    pub(crate) fn start(&self) -> usize {
        self.start
    }

    /// The same range of `buf`, and this slice's buffer.
    pub(crate) fn rebind<C>(self, buf: C) -> (LocalSlice<C>, B) {
        let slice = LocalSlice {
            buf,
            start: self.start,
            end: self.end,
            bad: self.bad,
            #[cfg(feature = "cuda")]
            after: self.after,
        };
        (slice, self.buf)
    }
}

impl<B: LocalBuffer> From<B> for LocalSlice<B> {
    fn from(buf: B) -> Self {
        LocalSlice {
            buf,
            start: 0,
            end: None,
            bad: false,
            #[cfg(feature = "cuda")]
            after: Vec::new(),
        }
    }
}
