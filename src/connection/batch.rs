//! [`Batch`]: several operations posted as one chain.

use super::*;

/// Operations to post together; see [`Connection::batch`].
#[derive(Debug)]
#[must_use = "a batch does nothing until posted"]
pub struct Batch<'c, B: LocalBuffer> {
    pub(super) conn: &'c Connection,
    pub(super) items: Vec<(LocalSlice<B>, RemoteOp)>,
}

impl<B: LocalBuffer> Batch<'_, B> {
    /// Adds a send.
    pub fn send(mut self, local: impl Into<LocalSlice<B>>) -> Self {
        self.items.push((local.into(), RemoteOp::Send));
        self
    }

    /// Adds a write.
    pub fn write(mut self, local: impl Into<LocalSlice<B>>, remote: &RemoteSlice) -> Self {
        self.items.push((local.into(), RemoteOp::Write(*remote)));
        self
    }

    /// Adds a write with immediate.
    pub fn write_with_imm(mut self, local: impl Into<LocalSlice<B>>, remote: &RemoteSlice, imm: u32) -> Self {
        self.items.push((local.into(), RemoteOp::WriteWithImm(*remote, imm)));
        self
    }

    /// Adds a read.
    pub fn read(mut self, local: impl Into<LocalSlice<B>>, remote: &RemoteSlice) -> Self {
        self.items.push((local.into(), RemoteOp::Read(*remote)));
        self
    }

    /// Posts them all; the buffers come back together, in order. A batch
    /// needing more send-queue requests than the queue holds fails with
    /// [`Error::TooManyRequests`], an empty one with [`Error::EmptyBatch`],
    /// one with a staged GPU buffer with [`Error::NeedsDirectPath`].
    pub fn post(self) -> Pending<Vec<B>> {
        #[cfg(feature = "cuda")]
        let mut flush: Vec<crate::cuda::CudaDevice> = Vec::new();
        // Fences of GPU buffers still running: the batch is kept at the gate
        // until they are done, nobody blocking on them.
        #[cfg(feature = "cuda")]
        let mut fenced: Vec<crate::protocol::order::DataReady> = Vec::new();
        let items: Result<Vec<WorkItem>> = self
            .items
            .iter()
            .map(|(local, op)| {
                let l = local.resolve()?;
                #[cfg(feature = "cuda")]
                if let (Some(path), Some(cuda)) = (l.path, local.buffer().cuda()) {
                    if !path.is_direct() {
                        return Err(Error::NeedsDirectPath {
                            what: "a batch",
                            reason: "this GPU buffer is staged: post its operations one by one".into(),
                        });
                    }
                    fenced.extend(fences_pending(local.fences()));
                    if op.reads_remote() {
                        flush.push(cuda.device().clone());
                    }
                } else if local.has_own_fences() {
                    fenced.extend(fences_pending(local.fences()));
                }
                Ok(WorkItem { local: Some(l), op: *op })
            })
            .collect();
        let bufs: Vec<B> = self.items.into_iter().map(|(l, _)| l.into_inner()).collect();
        let shared = &self.conn.shared;
        #[allow(unused_mut)]
        let mut pending = match items {
            #[cfg(feature = "cuda")]
            Ok(items) if !fenced.is_empty() => {
                let ready: crate::protocol::order::DataReady =
                    Box::new(move || fenced.iter_mut().try_fold(true, |all, f| Ok(f()? && all)));
                let kept = shared.gate.keep_until(What::Send(items), Instant::now() + shared.post_timeout, ready);
                shared.driver.ask(shared);
                Pending::with(shared, bufs, Stage::Deferred(kept))
            }
            Ok(items) => shared.post_items(bufs, Ok(&items)),
            Err(e) => shared.post_items(bufs, Err(e)),
        };
        #[cfg(feature = "cuda")]
        if !flush.is_empty() {
            pending.after = Some(Box::new(move || flush.iter().try_for_each(|d| d.flush_remote_writes())));
        }
        pending
    }
}
