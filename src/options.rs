//! What a connection is set up with ([`ConnectOptions`]) and what it turned
//! out to be ([`ConnectionInfo`]): plain data, below the transports that read
//! it and the connections that hand it out. The domain's counterparts are in
//! [`crate::config`].

use std::net::SocketAddr;
use std::time::Duration;

pub use crate::config::{Transport, TransportPolicy};
use crate::memory::{Exposed, Memory, RemoteRegion};

/// How to set a connection up, and how long to wait for things.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// The whole handshake, TCP connect included (default 10 s).
    pub handshake_timeout: Duration,
    /// How long [`Pending::wait`](crate::Pending::wait) waits, and posting waits for queue room
    /// (default 60 s).
    pub op_timeout: Duration,
    /// Send-queue requests outstanding at most (default 128; at most
    /// [`MAX_TCP_QUEUE_DEPTH`](crate::bootstrap::MAX_TCP_QUEUE_DEPTH) on TCP).
    pub send_queue_depth: u32,
    /// Receives posted at most (default 128).
    pub recv_queue_depth: u32,
    /// Sends and writes up to this size are copied into the request at post
    /// time (default 64 bytes; the device may grant less).
    pub max_inline: u32,
    /// Descriptors of our exposed regions to send the peer in the handshake.
    pub advertise: Vec<RemoteRegion>,
    /// ACK timeout code: 4.096 us * 2^n (default 14, about 67 ms).
    pub ack_timeout: u8,
    /// Transport retries before an operation fails (default 7).
    pub retry_count: u8,
    /// Receiver-not-ready retries (default 7: retry until a receive is posted;
    /// [`Pending::wait`](crate::Pending::wait)'s timeout still bounds the wait).
    pub rnr_retry: u8,
    /// Receiver-not-ready NAK timer code (default 12, 0.64 ms).
    pub min_rnr_timer: u8,
    /// IP traffic class / DSCP for RoCE (default 0).
    pub traffic_class: u8,
    /// InfiniBand service level (default 0).
    pub service_level: u8,
    /// Busy-poll this long before sleeping on the completion channel
    /// (default 50 us; on TCP, look again this long, yielding the CPU,
    /// before sleeping). Zero sleeps at once; long values trade CPU for
    /// latency. A busy wait looks at the clock every 64 polls; with a window
    /// of 1 ms or more, where reading the clock is slow (a virtual machine
    /// without a usable TSC), only every few thousand polls, so the window
    /// may run that much longer. Asleep, a wait on verbs wakes when the
    /// connection changes (whichever thread reaped the completion), when
    /// the peer leaves, or at its deadline: never on a timer of its own.
    /// A verbs connection on which a wait has slept holds one more file
    /// descriptor for that (an eventfd), until it is dropped.
    pub spin: Duration,
    /// The largest handshake message accepted (default 1 MiB).
    pub max_handshake_payload: u32,
    /// Staged GPU memory: bytes per chunk of a write or read (default 4 MiB).
    pub staging_chunk: usize,
    /// The transport for this connection (default: the domain's, whose
    /// default is `GPU_RDMA_TRANSPORT`, else auto).
    pub transport: TransportPolicy,
    /// Staged GPU memory: chunks in flight per operation (default 4, at least 2).
    pub staging_depth: usize,
    /// A shared secret both sides must hold (default: none, or
    /// `GPU_RDMA_SECRET` when set); see [`secret`](Self::secret).
    pub secret: Option<crate::bootstrap::Secret>,
    /// How long a post waits for room in a full send queue before it is
    /// refused with [`Error::QueueFull`](crate::Error::QueueFull), its buffer
    /// back (default `None`: the operation timeout). `Some(Duration::ZERO)`
    /// makes every post a try-post: refused at once when the queue is full.
    pub post_timeout: Option<Duration>,
    /// Who this side is, told to the peer in the handshake (its
    /// [`ConnectionInfo::peer_name`]); at most 256 bytes, empty for none.
    pub name: Vec<u8>,
    /// Bytes of this side's notification ring: where the peer's
    /// notifications wait to be taken by an [`Inbox`](crate::Inbox),
    /// taking no receive (default [`DEFAULT_RING`](crate::DEFAULT_RING),
    /// 64 KiB: about 500 small notes, at least 14 of the largest; from
    /// [`MIN_RING`](crate::MIN_RING) to [`MAX_RING`](crate::MAX_RING), a
    /// multiple of 64). A peer whose notes fill it waits for room, up to its
    /// operation timeout.
    pub notify_ring: usize,
    /// Over verbs, whether the peer covers each write with immediate into
    /// this side: a 64-byte record naming the range it writes, put in this
    /// side's notification ring just before it. On the staged path that
    /// record is what makes the written GPU memory visible when a receive
    /// takes the immediate; it costs the peer one more write per write with
    /// immediate. `None` (the default, or `GPU_RDMA_IMM_COVERS=auto`): asked
    /// for where a CUDA driver is loaded and either this domain already
    /// exposes GPU memory on the staged path for remote writes or the
    /// machine offers GPU memory no direct path (no nvidia-peermem, no
    /// dma-buf). `Some(true)` (`=1`): always; `Some(false)` (`=0`): never.
    /// Without covers, a write with immediate into staged GPU memory is made
    /// visible by a receive that names its range
    /// ([`Connection::recv_write_range`](crate::Connection::recv_write_range)).
    pub imm_covers: Option<bool>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            name: Vec::new(),
            handshake_timeout: Duration::from_secs(10),
            op_timeout: Duration::from_secs(60),
            send_queue_depth: 128,
            recv_queue_depth: 128,
            max_inline: 64,
            advertise: Vec::new(),
            ack_timeout: 14,
            retry_count: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            traffic_class: 0,
            service_level: 0,
            spin: Duration::from_micros(50),
            max_handshake_payload: crate::bootstrap::DEFAULT_MAX_PAYLOAD,
            staging_chunk: 4 << 20,
            transport: TransportPolicy::Auto,
            staging_depth: 4,
            secret: secret_from_env(),
            post_timeout: None,
            notify_ring: crate::bootstrap::DEFAULT_RING,
            imm_covers: covers_from_env(),
        }
    }
}

/// `GPU_RDMA_IMM_COVERS`: `1` always, `0` never, else (`auto`, unset) as
/// needed ([`ConnectOptions::imm_covers`]).
fn covers_from_env() -> Option<bool> {
    match std::env::var("GPU_RDMA_IMM_COVERS").as_deref().map(str::trim) {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    }
}

/// `GPU_RDMA_SECRET`, said once per process when it is used, so a secret
/// from the environment is never applied silently.
fn secret_from_env() -> Option<crate::bootstrap::Secret> {
    static SAID: std::sync::Once = std::sync::Once::new();
    let secret = crate::bootstrap::Secret::from_env();
    if secret.is_some() {
        SAID.call_once(|| {
            tracing::info!("connections authenticate with the shared secret in GPU_RDMA_SECRET");
        });
    }
    secret
}

impl ConnectOptions {
    /// Sends `region`'s descriptor to the peer in the handshake.
    pub fn advertise<M: Memory>(mut self, region: &Exposed<M>) -> Self {
        self.advertise.push(region.descriptor());
        self
    }

    /// Requires the peer to prove that it holds `secret` before anything
    /// else is exchanged (mutual challenge-response; the secret never
    /// crosses the wire). A peer with another secret or none is refused,
    /// and both sides get [`BootstrapError::Auth`](crate::BootstrapError::Auth).
    pub fn secret(mut self, secret: crate::bootstrap::Secret) -> Self {
        self.secret = Some(secret);
        self
    }

    /// Sets the size of this side's notification ring
    /// ([`notify_ring`](Self::notify_ring)).
    pub fn notify_ring(mut self, bytes: usize) -> Self {
        self.notify_ring = bytes;
        self
    }

    /// Sets whether the peer covers its writes with immediate into this
    /// side ([`imm_covers`](Self#structfield.imm_covers); `None`: as the
    /// machine and the domain need).
    pub fn imm_covers(mut self, covers: Option<bool>) -> Self {
        self.imm_covers = covers;
        self
    }

    /// Sets the handshake timeout.
    pub fn handshake_timeout(mut self, t: Duration) -> Self {
        self.handshake_timeout = t;
        self
    }

    /// Sets the default operation timeout.
    pub fn op_timeout(mut self, t: Duration) -> Self {
        self.op_timeout = t;
        self
    }

    /// Sets how long a post waits for room in a full send queue;
    /// `Duration::ZERO` makes posts try-posts (see
    /// [`post_timeout`](Self#structfield.post_timeout)).
    pub fn post_timeout(mut self, t: Duration) -> Self {
        self.post_timeout = Some(t);
        self
    }

    /// Sets the queue depths.
    pub fn queue_depth(mut self, send: u32, recv: u32) -> Self {
        self.send_queue_depth = send;
        self.recv_queue_depth = recv;
        self
    }

    /// Sets the staging chunk size and depth (staged GPU memory).
    pub fn staging(mut self, chunk: usize, depth: usize) -> Self {
        self.staging_chunk = chunk;
        self.staging_depth = depth;
        self
    }

    /// Sets the transport for this connection.
    pub fn transport(mut self, transport: TransportPolicy) -> Self {
        self.transport = transport;
        self
    }

    /// Sets the largest send that goes inline (asked of the device; the
    /// connection reports what it granted).
    pub fn max_inline(mut self, bytes: u32) -> Self {
        self.max_inline = bytes;
        self
    }

    /// Sets the transport's retry timer code, retry count and
    /// receiver-not-ready retries (see the fields).
    pub fn retries(mut self, ack_timeout: u8, retry_count: u8, rnr_retry: u8) -> Self {
        self.ack_timeout = ack_timeout;
        self.retry_count = retry_count;
        self.rnr_retry = rnr_retry;
        self
    }

    /// Sets the receiver-not-ready timer code this side asks peers to wait.
    pub fn min_rnr_timer(mut self, code: u8) -> Self {
        self.min_rnr_timer = code;
        self
    }

    /// Sets the traffic class (RoCE: DSCP) and the InfiniBand service level.
    pub fn qos(mut self, traffic_class: u8, service_level: u8) -> Self {
        self.traffic_class = traffic_class;
        self.service_level = service_level;
        self
    }

    /// Sets the largest handshake message accepted.
    pub fn max_handshake_payload(mut self, bytes: u32) -> Self {
        self.max_handshake_payload = bytes;
        self
    }

    /// Uses no shared secret, even when `GPU_RDMA_SECRET` is set.
    pub fn no_secret(mut self) -> Self {
        self.secret = None;
        self
    }

    /// Names this side to the peer (at most 256 bytes): the peer reads it
    /// as [`ConnectionInfo::peer_name`], to tell its connections apart.
    pub fn name(mut self, name: impl Into<Vec<u8>>) -> Self {
        self.name = name.into();
        self
    }

    /// Sets how long to busy-poll before sleeping.
    pub fn spin(mut self, t: Duration) -> Self {
        self.spin = t;
        self
    }
}

/// Facts about an established connection.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionInfo {
    /// Verbs or TCP.
    pub transport: Transport,
    /// Why that transport, in plain words.
    pub transport_reason: String,
    /// The name the peer gave in the handshake (its
    /// [`ConnectOptions::name`]); empty when it gave none.
    pub peer_name: Vec<u8>,
    /// The peer's handshake address.
    pub peer_addr: Option<SocketAddr>,
    /// Our queue pair number.
    pub local_qp_num: u32,
    /// The peer's queue pair number.
    pub remote_qp_num: u32,
    /// Path MTU in bytes (the smaller of both ends' active MTU).
    pub mtu: u32,
    /// The largest single message (send, or write with immediate); larger
    /// writes and reads are split transparently.
    pub max_message_size: u64,
    /// Sends up to this size are inline.
    pub max_inline: u32,
    /// Send queue depth granted.
    pub send_queue_depth: u32,
    /// Receive queue depth granted.
    pub recv_queue_depth: u32,
    /// The most RDMA reads this side has in flight at once. Verbs: the
    /// smaller of this device's initiator limit and the peer's responder
    /// resources (each side offers its device's limit, as perftest does);
    /// further reads wait in the send queue for earlier ones to finish.
    /// TCP: the send queue depth (the peer answers reads as they arrive).
    pub reads_in_flight: u32,
    /// The most memory, in bytes, this side's transport holds for the
    /// connection whatever the peer sends or fails to read (TCP: the
    /// receive buffer, replies queued for the peer's outstanding requests,
    /// this side's own queues, the two threads' stacks in use). `None` on
    /// verbs, where the NIC keeps that state. See the crate docs, "Failure
    /// semantics".
    pub memory_bound: Option<u64>,
}
