//! The crate's one error type.

use std::io;
use std::time::Duration;

use crate::access::Access;
use crate::completion::{CompletionError, WcStatus};

/// Everything that can go wrong, one variant per failing operation.
///
/// The operating-system error or device status is kept as the source. See the
/// crate documentation's "Failure semantics" for what state each leaves a
/// connection in.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No RDMA device can be used on this machine; `reason` says why
    /// (no kernel support, no device, no driver).
    #[error("no RDMA device: {reason}")]
    NoDevice {
        /// Why, in plain words, with what to do about it.
        reason: String,
    },

    /// The RDMA device asked for by name does not exist.
    #[error("RDMA device `{name}` not found (available: {})", list_or_none(available))]
    DeviceNotFound {
        /// The name asked for.
        name: String,
        /// The devices that do exist.
        available: Vec<String>,
    },

    /// The device has no port in the ACTIVE state (or the port asked for is not active).
    #[error("RDMA device `{device}` has no usable port: {detail}")]
    NoActivePort {
        /// The device.
        device: String,
        /// The port states found.
        detail: String,
    },

    /// No usable GID on the chosen port, or the GID index asked for is empty.
    #[error("RDMA device `{device}` port {port}: {detail}")]
    NoGid {
        /// The device.
        device: String,
        /// The port.
        port: u8,
        /// What was wrong.
        detail: String,
    },

    /// An ibverbs call failed.
    #[error("{op} failed: {source}")]
    Verbs {
        /// The verb, for example `ibv_reg_mr`.
        op: &'static str,
        /// The errno it returned.
        #[source]
        source: io::Error,
    },

    /// The device or driver does not support the operation
    /// (`EOPNOTSUPP`, `EPROTONOSUPPORT`, `ENOSYS`): "not here", not a fault.
    #[error("{op} is not supported by this device or driver: {source}")]
    NotSupported {
        /// The verb that refused.
        op: &'static str,
        /// The errno it returned.
        #[source]
        source: io::Error,
    },

    /// A queue pair state transition failed.
    #[error(
        "queue pair {qp_num:#x}: transition {transition} failed{}: {source} [{detail}]",
        attribute.map(|a| format!(" (attribute `{a}`)")).unwrap_or_default()
    )]
    ModifyQp {
        /// The queue pair number.
        qp_num: u32,
        /// For example `INIT->RTR`.
        transition: &'static str,
        /// The attribute found to be wrong, when it could be told.
        attribute: Option<&'static str>,
        /// The attributes that were set, or why the named one is wrong.
        detail: String,
        /// The errno the driver returned (`EINVAL` for an attribute it checked itself).
        #[source]
        source: io::Error,
    },

    /// A work request completed with an error status.
    #[error(transparent)]
    Completion(#[from] CompletionError),

    /// The out-of-band handshake failed.
    #[error("bootstrap: {0}")]
    Bootstrap(#[from] BootstrapError),

    /// A peer of a [`World`](crate::World) left its job's rendezvous (it
    /// left, or its lease expired: it died or hung).
    #[error("{name} is gone: {reason}")]
    PeerGone {
        /// The peer's key in the rendezvous (`<job>/rank/<r>`).
        name: String,
        /// Why it counts as gone.
        reason: String,
    },

    /// The peer reached at a rank's published address is another: the
    /// rendezvous entry is stale (the rank moved) or its port was reused.
    /// The connection was closed.
    #[error("dialed {expected} at {addr}, but the peer there is {found:?}: a stale rendezvous entry or a reused port")]
    PeerMismatch {
        /// The rank asked for (`<job>/rank/<r>`).
        expected: String,
        /// The name the peer gave in its handshake.
        found: String,
        /// Where it was dialed.
        addr: String,
    },

    /// Every rail of a [`RailConnection`](crate::rails::RailConnection)
    /// failed during a transfer: nothing is left to finish it on.
    #[error("every rail failed: {}", failures.join("; "))]
    NoRailLeft {
        /// Each rail and why it was dropped.
        failures: Vec<String>,
    },

    /// The two sides of a rail connection, or a transfer's regions and its
    /// connection, have different numbers of rails or queue pairs.
    #[error("rail mismatch: {detail}")]
    RailMismatch {
        /// What differs.
        detail: String,
    },

    /// The rendezvous store could not be reached or refused a request.
    #[error("rendezvous store {store}: {reason}")]
    Rendezvous {
        /// Which store, with its address (`etcd at http://127.0.0.1:2379`).
        store: String,
        /// What failed, in plain words.
        reason: String,
    },

    /// Nothing arrived within the time allowed.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// The time allowed.
        after: Duration,
    },

    /// A range lies outside its region; nothing was posted.
    #[error("range of {len} bytes at offset {offset} is outside the {region_len}-byte {side} region")]
    OutOfBounds {
        /// `local` or `remote`.
        side: &'static str,
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },

    /// The peer's region does not grant the access the operation needs; nothing was posted.
    #[error("the remote region grants {granted:?}, this operation needs {needed:?}")]
    AccessDenied {
        /// What the operation needs.
        needed: Access,
        /// What the region grants.
        granted: Access,
    },

    /// A notification payload longer than
    /// [`MAX_NOTIFY_PAYLOAD`](crate::MAX_NOTIFY_PAYLOAD); nothing was posted
    /// (the peer's wait for its tag fails, as for any list that fails).
    #[error("a notification payload of {len} bytes exceeds the limit of {max} bytes")]
    NotifyPayloadTooLarge {
        /// The payload's size.
        len: u64,
        /// The limit.
        max: u64,
    },

    /// A message larger than the transport's maximum message size; nothing was posted.
    #[error("a message of {len} bytes exceeds the maximum message size of {max} bytes")]
    MessageTooLarge {
        /// The message's size.
        len: u64,
        /// The maximum.
        max: u64,
    },

    /// The connection can no longer carry operations: the queue pair is in the
    /// error state, or the peer closed or died. Open a new connection.
    #[error("connection lost: {reason}")]
    ConnectionLost {
        /// What happened.
        reason: String,
    },

    /// A send or receive queue stayed full for the whole timeout.
    #[error("the {queue} queue stayed full ({depth} requests outstanding)")]
    QueueFull {
        /// `send` or `receive`.
        queue: &'static str,
        /// Its depth.
        depth: u32,
    },

    /// An argument or configuration value is invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A write or read was given a local range and a remote range of
    /// different lengths: a one-sided operation moves the same bytes on
    /// both sides. Nothing was posted; the buffer comes back.
    #[error(
        "the local range has {local} bytes and the remote range {remote}: a write or read moves the same bytes on both sides"
    )]
    LengthMismatch {
        /// The local range's length.
        local: u64,
        /// The remote range's length.
        remote: u64,
    },

    /// An environment variable the crate reads holds a value it cannot use.
    #[error("{var}={value:?}: expected {expected}")]
    BadEnv {
        /// The variable.
        var: &'static str,
        /// What it holds.
        value: String,
        /// What it may hold.
        expected: &'static str,
    },

    /// GPU memory on the staged path (the NIC cannot reach it, or the
    /// connection is TCP) was given to something that needs the NIC to
    /// reach it (dma-buf or nvidia-peermem). Nothing was posted or
    /// registered; the buffer comes back.
    #[error("{what} needs a direct path to GPU memory (dma-buf or nvidia-peermem): {reason}")]
    NeedsDirectPath {
        /// What needs it.
        what: &'static str,
        /// Why the memory is staged, or what to do instead.
        reason: String,
    },

    /// A work request asks more of the queue pair than it was made to take:
    /// more bytes inline than its inline limit (a read cannot be inline at
    /// all), or more scatter/gather entries than it takes. Nothing was
    /// posted.
    #[error("{request} {index}: {got} {what}, and the queue pair takes {max}")]
    ExceedsQpCaps {
        /// `work request` (a send-queue request) or `receive request`.
        request: &'static str,
        /// Its place in the chain posted.
        index: usize,
        /// What it has too many of.
        what: &'static str,
        /// How many it has.
        got: u64,
        /// How many the queue pair takes.
        max: u64,
    },

    /// There is no CUDA device of this ordinal.
    #[error("CUDA device {ordinal} does not exist ({count} device(s))")]
    NoCudaDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices there are.
        count: usize,
    },

    /// A buffer or region registered with one domain was used with another
    /// (a connection of another domain, or another domain's `expose`): its
    /// keys mean nothing there. Nothing was posted; the buffer comes back.
    #[error("the {what} is registered with domain {registered}, and this {used_with} belongs to domain {expected}")]
    DomainMismatch {
        /// `buffer` or `region`.
        what: &'static str,
        /// The domain it is registered with ([`Domain::id`](crate::Domain::id)).
        registered: u64,
        /// `connection` or `domain`.
        used_with: &'static str,
        /// The domain of the connection or domain it was given to.
        expected: u64,
    },

    /// One post needs more send-queue requests than the queue holds (a
    /// batch of many operations, or writes split at the message size): it
    /// can never fit. Post it in parts. Nothing was posted.
    #[error("the post needs {requests} send-queue requests, and the send queue holds {depth}: post it in parts")]
    TooManyRequests {
        /// Requests the post needs.
        requests: u64,
        /// The send queue's depth.
        depth: u32,
    },

    /// A batch with no operations was posted.
    #[error("the batch holds no operations")]
    EmptyBatch,

    /// An operation's error was already returned by an earlier wait or
    /// poll of the same handle.
    #[error("this operation failed and its error was already returned")]
    AlreadyReported,

    /// A [`Persistent`](crate::Persistent) receive or send was posted
    /// again while its last round was still in flight. Nothing was posted;
    /// the round in flight is unchanged.
    #[error("the last round is still in flight: wait for it before posting it again")]
    StillInFlight,

    /// A [`RecvRing`](crate::RecvRing) was asked for slots it cannot
    /// have; nothing was posted.
    #[error("the receive ring cannot be posted: {reason}")]
    RingRefused {
        /// Why, in plain words.
        reason: &'static str,
    },

    /// A wait was interrupted on purpose (a [`Listener`](crate::Listener)'s
    /// [`Interrupt`](crate::Interrupt)).
    #[error("{what} was interrupted")]
    Interrupted {
        /// What was interrupted.
        what: &'static str,
    },

    /// The peer's transfer list that was to notify `tag` failed; its
    /// reason, as the peer reported it ([`Inbox`](crate::Inbox) waits).
    #[error("the peer's transfer for notification tag {tag} failed: {reason}")]
    PeerTransferFailed {
        /// The notification's tag.
        tag: u32,
        /// Why, in the peer's words.
        reason: String,
    },

    /// The crate was built without a feature this call needs.
    #[error("gpu-rdma was built without the `{feature}` feature; rebuild with `--features {feature}`")]
    FeatureDisabled {
        /// The Cargo feature.
        feature: &'static str,
    },

    /// CUDA cannot be used here: no driver library, no device, `cuInit`
    /// failed, or the crate was built without the `cuda` feature.
    #[error("CUDA is not available: {reason}")]
    CudaUnavailable {
        /// Why, in plain words.
        reason: String,
    },

    /// A CUDA driver call failed.
    #[error("{op} failed: {name} (CUresult {code})")]
    Cuda {
        /// The driver function, for example `cuMemAlloc`.
        op: &'static str,
        /// The `CUresult` number.
        code: u32,
        /// Its name, for example `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
    },

    /// Another I/O error.
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

impl Error {
    /// `Ok` when `offset..offset + len` lies in a local range of `total`
    /// bytes, else [`Error::OutOfBounds`] (an overflowing end included).
    pub(crate) fn check_local(offset: usize, len: usize, total: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > total) {
            return Err(Error::OutOfBounds {
                side: "local",
                offset: offset as u64,
                len: len as u64,
                region_len: total as u64,
            });
        }
        Ok(())
    }

    /// Whether this is a remote-access error completion: bad rkey, an address
    /// outside the peer's region, or an access right the region does not grant.
    pub fn is_remote_access(&self) -> bool {
        matches!(self, Error::Completion(c) if c.status == WcStatus::RemoteAccess)
    }

    /// Whether this is a timeout.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// Whether this is the driver's "not supported" answer
    /// (`CUDA_ERROR_NOT_SUPPORTED`, or `EOPNOTSUPP`-like from verbs): "not
    /// here", not a fault.
    pub fn is_not_supported(&self) -> bool {
        match self {
            Error::NotSupported { .. } => true,
            Error::Cuda { name, .. } => name == "CUDA_ERROR_NOT_SUPPORTED",
            _ => false,
        }
    }

    /// The completion status, when this is an error completion.
    pub fn wc_status(&self) -> Option<WcStatus> {
        match self {
            Error::Completion(c) => Some(c.status),
            _ => None,
        }
    }

    /// What an operation's failure means, the same on every transport
    /// (see [`Failure`](crate::Failure)); `None` when this is not an
    /// operation's completion error.
    pub fn failure(&self) -> Option<crate::completion::Failure> {
        match self {
            Error::Completion(c) => Some(c.failure()),
            _ => None,
        }
    }
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() { "none".to_owned() } else { names.join(", ") }
}

/// A handshake message that could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// The bytes do not start with this protocol's magic: not a gpu-rdma peer, or garbled.
    #[error("garbled message: bad magic {found:#010x} (expected {expected:#010x}); is the peer a gpu-rdma endpoint?")]
    BadMagic {
        /// What arrived.
        found: u32,
        /// What this protocol sends.
        expected: u32,
    },
    /// The peer speaks another protocol version.
    #[error("protocol version mismatch: this side speaks {ours}, the peer {theirs}")]
    VersionMismatch {
        /// Ours.
        ours: u16,
        /// Theirs.
        theirs: u16,
    },
    /// The message's checksum does not match its payload.
    #[error("garbled message: checksum {found:#010x} does not match the payload's {computed:#010x}")]
    Checksum {
        /// The checksum in the header.
        found: u32,
        /// The payload's.
        computed: u32,
    },
    /// The connection closed in the middle of a message.
    #[error("truncated message: the connection closed after {got} of {expected} bytes")]
    Truncated {
        /// Bytes the message should have.
        expected: usize,
        /// Bytes that arrived.
        got: usize,
    },
    /// A length field larger than the configured limit (nothing was allocated for it).
    #[error("oversized message: {len} bytes announced, the limit is {max}")]
    Oversized {
        /// The announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A well-framed message whose content does not parse.
    #[error("malformed {what}: {detail}")]
    Malformed {
        /// Which message.
        what: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// A message of another kind than the handshake expects at this step.
    #[error("unexpected message: expected {expected}, got {got}")]
    Unexpected {
        /// What the handshake expected.
        expected: &'static str,
        /// What arrived.
        got: String,
    },
    /// The peer closed the connection before sending anything.
    #[error("the peer closed the connection during the handshake")]
    PeerClosed,
    /// The peer refused the connection and said why.
    #[error("the peer rejected the connection: {reason}")]
    Rejected {
        /// The peer's reason.
        reason: String,
    },
    /// The peer's endpoint cannot be used with ours.
    #[error("incompatible peer: {0}")]
    Incompatible(String),
    /// The peer announced a limit (a size, a depth, a count) outside what
    /// this side accepts: too small to work with, or past what this side
    /// would hold for it. Nothing was planned or allocated from it.
    #[error("the peer announced {field} {value}, outside what this side accepts ({min}..={max})")]
    OutOfRange {
        /// The hello's field.
        field: &'static str,
        /// What the peer announced.
        value: u64,
        /// The least this side accepts.
        min: u64,
        /// The most this side accepts.
        max: u64,
    },
    /// The shared-secret check failed; nothing else was exchanged.
    #[error("authentication failed: {0}")]
    Auth(AuthFailure),
}

/// Why the shared-secret check failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthFailure {
    /// The two sides hold different secrets.
    #[error("the peer's shared secret differs from this side's ({})", if *.detected_here { "its proof did not verify here" } else { "it refused this side's proof" })]
    SecretMismatch {
        /// Whether this side found out (else the peer did and said so).
        detected_here: bool,
    },
    /// This side requires a secret; the peer started without one.
    #[error("this side requires a shared secret and the peer has none (set the same secret on both sides)")]
    PeerHasNoSecret,
    /// The peer requires a secret; this side has none.
    #[error("the peer requires a shared secret and this side has none (ConnectOptions::secret, or GPU_RDMA_SECRET)")]
    NoSecretHere,
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
