//! What a domain and a connection are set up with ([`DomainConfig`],
//! [`ConnectOptions`], [`TransportPolicy`]) and what they turned out to be
//! ([`DomainInfo`], [`ConnectionInfo`]): plain data, below the transports
//! that read it and the domains and connections that hand it out.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::memory::{Exposed, Memory, RemoteRegion};

/// Which transport to use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TransportPolicy {
    /// Verbs when both ends have an RDMA port that can reach the other,
    /// else TCP.
    #[default]
    Auto,
    /// Verbs only: no RDMA on either end is an error.
    Verbs,
    /// TCP only, even where RDMA exists.
    Tcp,
}

impl FromStr for TransportPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(TransportPolicy::Auto),
            "verbs" | "rdma" | "ib" => Ok(TransportPolicy::Verbs),
            "tcp" | "socket" | "sockets" => Ok(TransportPolicy::Tcp),
            other => Err(Error::InvalidArgument(format!("transport `{other}`: expected auto, verbs or tcp"))),
        }
    }
}

impl TransportPolicy {
    /// `GPU_RDMA_TRANSPORT=auto|verbs|tcp`, default auto.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another value.
    pub fn from_env() -> Result<Self> {
        match std::env::var("GPU_RDMA_TRANSPORT") {
            Ok(v) => v.parse().map_err(|e| Error::InvalidArgument(format!("GPU_RDMA_TRANSPORT: {e}"))),
            Err(_) => Ok(TransportPolicy::Auto),
        }
    }
}

impl fmt::Display for TransportPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportPolicy::Auto => "auto",
            TransportPolicy::Verbs => "verbs",
            TransportPolicy::Tcp => "tcp",
        })
    }
}

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
    /// (default 50 us). Zero sleeps at once; long values trade CPU for latency.
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
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
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
            secret: crate::bootstrap::Secret::from_env(),
        }
    }
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
    /// `verbs` or `tcp`.
    pub transport: &'static str,
    /// Why that transport, in plain words.
    pub transport_reason: String,
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
    /// The most memory, in bytes, this side's transport holds for the
    /// connection whatever the peer sends or fails to read (TCP: the
    /// receive buffer, replies queued for the peer's outstanding requests,
    /// this side's own queues, the two threads' stacks in use). `None` on
    /// verbs, where the NIC keeps that state. See the crate docs, "Failure
    /// semantics".
    pub memory_bound: Option<u64>,
}

/// Where to find the device. [`DomainConfig::from_env`] reads
/// `GPU_RDMA_DEVICE`, `GPU_RDMA_PORT`, `GPU_RDMA_GID_INDEX` and
/// `GPU_RDMA_TRANSPORT`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DomainConfig {
    /// Verbs, TCP, or the best that exists (default): with `Auto` a
    /// machine without a usable RDMA device gets a TCP-only domain, and says
    /// why in [`DomainInfo::fallback`].
    pub transport: TransportPolicy,
    /// The device by name (`mlx5_0`, `rxe0`); `None`: the first with an active port.
    pub device: Option<String>,
    /// The port; `None`: the device's first active port.
    pub port: Option<u8>,
    /// The GID index to use; `None`: chosen (RoCE v2 with IPv4 first).
    pub gid_index: Option<u32>,
}

impl DomainConfig {
    /// Defaults overridden by the environment.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a port or GID index that is not a number.
    pub fn from_env() -> Result<Self> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let parse = |name: &'static str| -> Result<Option<u32>> {
            var(name)
                .map(|v| {
                    v.trim().parse::<u32>().map_err(|_| Error::InvalidArgument(format!("{name}={v} is not a number")))
                })
                .transpose()
        };
        let port = parse("GPU_RDMA_PORT")?
            .map(|p| u8::try_from(p).map_err(|_| Error::InvalidArgument(format!("GPU_RDMA_PORT={p} is too large"))))
            .transpose()?;
        Ok(DomainConfig {
            transport: TransportPolicy::from_env()?,
            device: var("GPU_RDMA_DEVICE"),
            port,
            gid_index: parse("GPU_RDMA_GID_INDEX")?,
        })
    }

    /// Uses the device called `name`.
    pub fn device(mut self, name: impl Into<String>) -> Self {
        self.device = Some(name.into());
        self
    }

    /// Uses port `port`.
    pub fn port(mut self, port: u8) -> Self {
        self.port = Some(port);
        self
    }

    /// Uses `transport`.
    pub fn transport(mut self, transport: TransportPolicy) -> Self {
        self.transport = transport;
        self
    }

    /// Uses GID index `index`.
    pub fn gid_index(mut self, index: u32) -> Self {
        self.gid_index = Some(index);
        self
    }
}

/// What a domain runs on, in plain words.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DomainInfo {
    /// `verbs` (connections use verbs when the peer can, else TCP) or
    /// `tcp` (no usable RDMA device, or TCP asked for).
    pub transport: &'static str,
    /// Why this domain has no verbs device, when it has none.
    pub fallback: Option<String>,
    /// Device name.
    pub device: String,
    /// Port number.
    pub port: u8,
    /// Link layer (`InfiniBand`, `Ethernet`).
    pub link_layer: String,
    /// Active MTU in bytes.
    pub mtu: u32,
    /// The GID index used.
    pub gid_index: u32,
    /// The GID, as ibv_devinfo prints it.
    pub gid: String,
    /// Why this GID.
    pub gid_reason: String,
}

impl DomainInfo {
    pub(crate) fn tcp(reason: String) -> DomainInfo {
        DomainInfo {
            transport: "tcp",
            fallback: Some(reason),
            device: String::new(),
            port: 0,
            link_layer: String::new(),
            mtu: 0,
            gid_index: 0,
            gid: String::new(),
            gid_reason: String::new(),
        }
    }
}

impl fmt::Display for DomainInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(why) = &self.fallback {
            return write!(f, "tcp ({why})");
        }
        write!(
            f,
            "{} on {} port {} ({}, MTU {}, GID index {} {}: {})",
            self.transport,
            self.device,
            self.port,
            self.link_layer,
            self.mtu,
            self.gid_index,
            self.gid,
            self.gid_reason
        )
    }
}
