//! Endpoints as data: what a peer needs to connect to a listener (its
//! address, the transport this side offers, the NIC behind it), as bytes
//! or through serde, for a framework that already has a control plane to
//! pass them over. Region descriptors travel the same way
//! ([`RemoteRegion::to_bytes`](crate::RemoteRegion::to_bytes), serde).
//!
//! ```text
//! "GEP1"  u8 version=1  u8 transport (0 tcp, 1 verbs)
//! u8 ip (4 or 6)  ip bytes  u16 port
//! u16 len + device name (UTF-8)   u16 len + GID (UTF-8)      (big-endian)
//! ```

#![forbid(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use bytes::{Buf, BufMut};

use crate::config::Transport;
use crate::error::{BootstrapError, Result};

const MAGIC: &[u8; 4] = b"GEP1";
const VERSION: u8 = 1;
/// Longest device name or GID text accepted.
const MAX_TEXT: usize = 256;

/// What a peer needs to connect to a [`Listener`](crate::Listener).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct Endpoint {
    /// Where the listener is (as bound: a wildcard address needs the
    /// machine's address put in, [`with_ip`](Self::with_ip)).
    pub addr: SocketAddr,
    /// `Verbs` when this side offers RDMA (the peer uses it if it can too),
    /// `Tcp` when it offers only TCP.
    pub transport: Transport,
    /// The RDMA device behind it (empty for TCP only).
    pub device: String,
    /// Its GID, as `ibv_devinfo` prints it (empty for TCP only).
    pub gid: String,
}

impl Endpoint {
    /// An endpoint at `addr` offering `transport`.
    pub fn new(addr: SocketAddr, transport: Transport, device: impl Into<String>, gid: impl Into<String>) -> Self {
        Endpoint { addr, transport, device: device.into(), gid: gid.into() }
    }

    /// The same endpoint at another IP address (the port stays): for a
    /// listener bound to a wildcard address.
    pub fn with_ip(mut self, ip: IpAddr) -> Self {
        self.addr.set_ip(ip);
        self
    }

    /// The wire form (see the module documentation).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.device.len() + self.gid.len());
        out.extend_from_slice(MAGIC);
        out.put_u8(VERSION);
        out.put_u8(u8::from(self.transport == Transport::Verbs));
        match self.addr.ip() {
            IpAddr::V4(ip) => {
                out.put_u8(4);
                out.extend_from_slice(&ip.octets());
            }
            IpAddr::V6(ip) => {
                out.put_u8(6);
                out.extend_from_slice(&ip.octets());
            }
        }
        out.put_u16(self.addr.port());
        for text in [&self.device, &self.gid] {
            let mut n = text.len().min(MAX_TEXT);
            while !text.is_char_boundary(n) {
                n -= 1;
            }
            let t = &text.as_bytes()[..n];
            out.put_u16(t.len() as u16);
            out.extend_from_slice(t);
        }
        out
    }

    /// Parses the wire form.
    ///
    /// # Errors
    /// [`BootstrapError::Malformed`] (as [`crate::Error::Bootstrap`]) naming
    /// what is wrong: the magic, the version, a cut, an unknown value, text
    /// that is not UTF-8 or too long, bytes left over.
    pub fn from_bytes(mut b: &[u8]) -> Result<Self> {
        let bad = |detail: String| crate::Error::from(BootstrapError::Malformed { what: "endpoint", detail });
        let need = |b: &[u8], n: usize, what: &str| {
            if b.len() < n {
                Err(bad(format!("cut short in the {what}: {} bytes left, {n} needed", b.len())))
            } else {
                Ok(())
            }
        };
        need(b, 7, "header")?;
        if &b[..4] != MAGIC {
            return Err(bad(format!("magic {:02x?}, expected {MAGIC:02x?}", &b[..4])));
        }
        b.advance(4);
        let version = b.get_u8();
        if version != VERSION {
            return Err(bad(format!("version {version}, this side reads {VERSION}")));
        }
        let transport = match b.get_u8() {
            0 => Transport::Tcp,
            1 => Transport::Verbs,
            t => return Err(bad(format!("transport {t}"))),
        };
        let ip = match b.get_u8() {
            4 => {
                need(b, 4, "IPv4 address")?;
                let mut o = [0u8; 4];
                b.copy_to_slice(&mut o);
                IpAddr::V4(Ipv4Addr::from(o))
            }
            6 => {
                need(b, 16, "IPv6 address")?;
                let mut o = [0u8; 16];
                b.copy_to_slice(&mut o);
                IpAddr::V6(Ipv6Addr::from(o))
            }
            k => return Err(bad(format!("address family {k}"))),
        };
        need(b, 2, "port")?;
        let port = b.get_u16();
        let mut text = |what: &str| -> Result<String> {
            need(b, 2, what)?;
            let n = b.get_u16() as usize;
            if n > MAX_TEXT {
                return Err(bad(format!("{what} of {n} bytes, at most {MAX_TEXT}")));
            }
            need(b, n, what)?;
            let s = std::str::from_utf8(&b[..n]).map_err(|_| bad(format!("{what} is not UTF-8")))?.to_owned();
            b.advance(n);
            Ok(s)
        };
        let device = text("device name")?;
        let gid = text("GID")?;
        if !b.is_empty() {
            return Err(bad(format!("{} bytes after the end", b.len())));
        }
        Ok(Endpoint { addr: SocketAddr::new(ip, port), transport, device, gid })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_encoded_decodes_to_the_same_in_bytes_and_through_serde() {
        for ep in [
            Endpoint::new("10.1.2.3:7471".parse().unwrap(), Transport::Verbs, "mlx5_0", "fe80::1"),
            Endpoint::new("[::1]:1".parse().unwrap(), Transport::Tcp, "", ""),
        ] {
            assert_eq!(Endpoint::from_bytes(&ep.to_bytes()).unwrap(), ep);
            #[cfg(feature = "serde")]
            {
                let json = serde_json::to_string(&ep).unwrap();
                assert!(json.contains(&ep.addr.port().to_string()) && json.contains(ep.transport.name()), "{json}");
                assert_eq!(serde_json::from_str::<Endpoint>(&json).unwrap(), ep);
            }
        }
        #[cfg(feature = "serde")]
        assert!(
            serde_json::from_str::<Endpoint>(r#"{"addr":"1.2.3.4:5","transport":"ib","device":"","gid":""}"#).is_err()
        );
        let ep =
            Endpoint::new("0.0.0.0:9".parse().unwrap(), Transport::Tcp, "", "").with_ip("192.0.2.7".parse().unwrap());
        assert_eq!(ep.addr, "192.0.2.7:9".parse().unwrap());
    }

    #[test]
    fn anything_else_is_a_typed_error_never_a_panic() {
        let good = Endpoint::new("10.1.2.3:7471".parse().unwrap(), Transport::Verbs, "rxe0", "fe80::2").to_bytes();
        for n in 0..good.len() {
            assert!(Endpoint::from_bytes(&good[..n]).is_err(), "cut at {n}");
        }
        let mut longer = good.clone();
        longer.push(0);
        assert!(Endpoint::from_bytes(&longer).is_err());
        let mut x = 0x0123_4567_89ab_cdefu64;
        for i in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut m = good.clone();
            let at = (x as usize) % m.len();
            m[at] = (x >> 8) as u8;
            if i % 3 == 0 {
                m.truncate((x >> 16) as usize % (m.len() + 1));
            }
            if let Ok(ep) = Endpoint::from_bytes(&m) {
                assert_eq!(Endpoint::from_bytes(&ep.to_bytes()).unwrap(), ep, "re-encodes to the same");
            }
        }
    }
}
