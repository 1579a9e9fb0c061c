//! Covers for writes with immediate, as the transport posts them: where the
//! peer asked for them in its hello
//! ([`CAP_IMM_COVERS`](crate::bootstrap::CAP_IMM_COVERS)), each write with
//! immediate is posted right behind a small RDMA write of a record naming
//! the range it writes, into the peer's notification ring. On the staged
//! path the peer's GPU memory is reached through a host mirror, and an
//! immediate names no range: the record tells the receiver what to copy in
//! before it hands the immediate out.
//!
//! The transport only asks for the record writes and posts them in the
//! same chain as their writes; what a record holds and where it goes in
//! the ring is the connection's ([`crate::connection`] implements
//! [`ImmCovers`]).

// Only the verbs transport posts covers.
#![cfg_attr(not(feature = "verbs"), allow(dead_code))]

use crate::deadline::Deadline;
use crate::error::Result;
use crate::remote::RemoteSlice;

use super::queue::WorkItem;

/// What puts cover records in the peer's ring.
pub(crate) trait ImmCovers: Send + Sync {
    /// Starts the covers of one post. The returned value holds what keeps
    /// covers in posting order (their ordinals are the order their writes
    /// reach the peer) until it is dropped: the post is made while it lives.
    fn begin(&self) -> Box<dyn CoverPost + '_>;
}

/// The covers of one post.
pub(crate) trait CoverPost {
    /// Appends to `out` the writes of the cover record of the next write
    /// with immediate, into `range` (the whole operation's range), after
    /// those this value placed already. Waits for room in the peer's ring
    /// up to `due`, looking at `broken` (the connection's loss) meanwhile.
    ///
    /// # Errors
    /// [`Error::QueueFull`](crate::Error::QueueFull) for no room when `due`
    /// is immediate; [`Error::Timeout`](crate::Error::Timeout) when it
    /// passed; [`Error::ConnectionLost`](crate::Error::ConnectionLost).
    fn place(
        &mut self,
        range: RemoteSlice,
        due: &mut Deadline,
        broken: &dyn Fn() -> Option<String>,
        out: &mut Vec<WorkItem>,
    ) -> Result<()>;

    /// The post went out (whole, or part of it): the records placed are the
    /// peer's, and their memory is not reused until the send queue has
    /// moved past them.
    fn commit(&mut self);
}

/// Whether `items` hold a write with immediate.
#[inline]
pub(crate) fn any_imm_write(items: &[WorkItem]) -> bool {
    items.iter().any(|i| matches!(i.op, super::queue::RemoteOp::WriteWithImm(..)))
}
