//! What a domain is opened with ([`DomainConfig`], [`TransportPolicy`]) and
//! what it turned out to be ([`DomainInfo`], [`Transport`]): plain data,
//! below the memory domain and the transports that read it.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The transport a domain or a connection runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transport {
    /// ibverbs: RC queue pairs on an RDMA device.
    Verbs,
    /// TCP with verbs semantics (no RDMA device on one end, or asked for).
    Tcp,
}

impl Transport {
    /// `"verbs"` or `"tcp"`.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Verbs => "verbs",
            Transport::Tcp => "tcp",
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl PartialEq<str> for Transport {
    fn eq(&self, other: &str) -> bool {
        self.name() == other
    }
}

impl PartialEq<&str> for Transport {
    fn eq(&self, other: &&str) -> bool {
        self.name() == *other
    }
}

impl PartialEq<Transport> for &str {
    fn eq(&self, other: &Transport) -> bool {
        *self == other.name()
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for Transport {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for Transport {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        match &*name {
            "verbs" => Ok(Transport::Verbs),
            "tcp" => Ok(Transport::Tcp),
            other => Err(serde::de::Error::unknown_variant(other, &["verbs", "tcp"])),
        }
    }
}

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

/// The values a transport policy is written as.
const TRANSPORTS: &str = "auto, verbs or tcp";

impl FromStr for TransportPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(TransportPolicy::Auto),
            "verbs" | "rdma" | "ib" => Ok(TransportPolicy::Verbs),
            "tcp" | "socket" | "sockets" => Ok(TransportPolicy::Tcp),
            other => Err(Error::InvalidArgument(format!("transport `{other}`: expected {TRANSPORTS}"))),
        }
    }
}

impl TransportPolicy {
    /// `GPU_RDMA_TRANSPORT=auto|verbs|tcp`, default auto.
    ///
    /// # Errors
    /// [`Error::BadEnv`] for another value.
    pub fn from_env() -> Result<Self> {
        match std::env::var("GPU_RDMA_TRANSPORT") {
            Ok(v) => v.parse().map_err(|_| Error::BadEnv { var: "GPU_RDMA_TRANSPORT", value: v, expected: TRANSPORTS }),
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
    /// [`Error::BadEnv`] for a port or GID index that is not a number, or a
    /// port past 255, or a transport that is not one.
    pub fn from_env() -> Result<Self> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let parse = |name: &'static str| -> Result<Option<u32>> {
            var(name)
                .map(|v| {
                    v.trim().parse::<u32>().map_err(|_| Error::BadEnv { var: name, value: v, expected: "a number" })
                })
                .transpose()
        };
        let port = parse("GPU_RDMA_PORT")?
            .map(|p| {
                u8::try_from(p).map_err(|_| Error::BadEnv {
                    var: "GPU_RDMA_PORT",
                    value: p.to_string(),
                    expected: "a port number up to 255",
                })
            })
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
    pub transport: Transport,
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
            transport: Transport::Tcp,
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
