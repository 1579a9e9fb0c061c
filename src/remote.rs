//! Descriptors of a peer's regions and their 32-byte wire form (a leaf:
//! the handshake, memory and the transports all use them).
//!
//! ```text
//! tag u64, addr u64, len u64, rkey u32, access u32   (big-endian)
//! ```

use std::fmt;
use std::ops::{Bound, RangeBounds};

use bytes::{Buf, BufMut};

use crate::access::Access;
use crate::error::{BootstrapError, Error, Result};

/// Bytes in an encoded region descriptor.
pub const REGION_LEN: usize = 32;

/// What a peer needs to read or write one of our regions: sent in the
/// handshake, or in a message of your own (see [`RemoteRegion::to_bytes`],
/// or serde: checked on the way in as the wire form is).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(into = "RegionRepr", try_from = "RegionRepr"))]
pub struct RemoteRegion {
    /// A tag chosen by the owner, to tell regions apart.
    pub tag: u64,
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
    /// The remote rights granted.
    pub access: Access,
}

impl RemoteRegion {
    /// The tag it was exposed with.
    pub fn tag(&self) -> u64 {
        self.tag
    }

    /// Start address at the peer.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The rights the peer granted.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The whole region.
    pub fn whole(&self) -> RemoteSlice {
        RemoteSlice { addr: self.addr, len: self.len, rkey: self.rkey, access: self.access }
    }

    /// A byte range of it.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range does not fit.
    pub fn slice(&self, range: impl RangeBounds<u64>) -> Result<RemoteSlice> {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.saturating_add(1),
            Bound::Excluded(&e) => e,
            Bound::Unbounded => self.len,
        };
        if start > end || end > self.len {
            return Err(Error::OutOfBounds {
                side: "remote",
                offset: start,
                len: end.saturating_sub(start),
                region_len: self.len,
            });
        }
        Ok(RemoteSlice { addr: self.addr + start, len: end - start, rkey: self.rkey, access: self.access })
    }

    /// The 32-byte wire form (the same as in the handshake).
    pub fn to_bytes(&self) -> [u8; REGION_LEN] {
        encode_region(self)
    }

    /// Parses the wire form.
    ///
    /// # Errors
    /// [`crate::BootstrapError::Malformed`] for a wrong length, an address
    /// range that wraps, or unknown access bits.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        Ok(decode_region(bytes)?)
    }
}

/// A region descriptor's fields as serde sees them (the rights as bits).
#[cfg(feature = "serde")]
#[derive(serde::Serialize, serde::Deserialize)]
struct RegionRepr {
    tag: u64,
    addr: u64,
    len: u64,
    rkey: u32,
    access: u32,
}

#[cfg(feature = "serde")]
impl From<RemoteRegion> for RegionRepr {
    fn from(r: RemoteRegion) -> Self {
        RegionRepr { tag: r.tag, addr: r.addr, len: r.len, rkey: r.rkey, access: r.access.bits() }
    }
}

#[cfg(feature = "serde")]
impl TryFrom<RegionRepr> for RemoteRegion {
    type Error = BootstrapError;
    fn try_from(r: RegionRepr) -> std::result::Result<Self, BootstrapError> {
        // Through the wire form, so it gets that form's checks (unknown
        // rights bits, a range that wraps).
        let unchecked = RemoteRegion {
            tag: r.tag,
            addr: r.addr,
            len: r.len,
            rkey: r.rkey,
            access: Access::from_bits_retain(r.access),
        };
        decode_region(&encode_region(&unchecked))
    }
}

impl fmt::Debug for RemoteRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RemoteRegion(tag {} {:#x}+{} rkey {:#x} {:?})",
            self.tag, self.addr, self.len, self.rkey, self.access
        )
    }
}

/// A byte range of a peer's region: the target of a write, the source of a read.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteSlice {
    addr: u64,
    len: u64,
    rkey: u32,
    access: Access,
}

impl RemoteSlice {
    /// A range named by raw address, length and remote key, with no local
    /// check at all: what is wrong is found by the peer's device and
    /// reported as a remote-access error completion. Safe, since only the
    /// peer's memory is at stake, and the peer's device protects it.
    pub fn from_raw_parts(addr: u64, len: u64, rkey: u32) -> Self {
        RemoteSlice { addr, len, rkey, access: Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC }
    }

    /// Start address at the peer.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The rights the region grants, as far as this side knows.
    pub fn access(&self) -> Access {
        self.access
    }

    /// `len` bytes at `offset` (the caller checked the range).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn sub(&self, offset: u64, len: u64) -> RemoteSlice {
        RemoteSlice { addr: self.addr + offset, len, ..*self }
    }

    /// The first `len` bytes.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn prefix(&self, len: u64) -> Result<RemoteSlice> {
        if len > self.len {
            return Err(Error::OutOfBounds { side: "remote", offset: 0, len, region_len: self.len });
        }
        Ok(RemoteSlice { len, ..*self })
    }
}

impl fmt::Debug for RemoteSlice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RemoteSlice({:#x}+{} rkey {:#x})", self.addr, self.len, self.rkey)
    }
}

/// Encodes one region descriptor.
pub fn encode_region(r: &RemoteRegion) -> [u8; REGION_LEN] {
    let mut out = [0u8; REGION_LEN];
    let mut b = &mut out[..];
    b.put_u64(r.tag);
    b.put_u64(r.addr);
    b.put_u64(r.len);
    b.put_u32(r.rkey);
    b.put_u32(r.access.bits());
    out
}

/// Decodes one region descriptor.
///
/// # Errors
/// [`BootstrapError::Malformed`].
pub fn decode_region(bytes: &[u8]) -> std::result::Result<RemoteRegion, BootstrapError> {
    let bad = |detail: String| BootstrapError::Malformed { what: "region descriptor", detail };
    if bytes.len() != REGION_LEN {
        return Err(bad(format!("{} bytes, expected {REGION_LEN}", bytes.len())));
    }
    let mut b = bytes;
    let tag = b.get_u64();
    let addr = b.get_u64();
    let len = b.get_u64();
    let rkey = b.get_u32();
    let bits = b.get_u32();
    if addr.checked_add(len).is_none() {
        return Err(bad(format!("{addr:#x}+{len} wraps around the address space")));
    }
    let access = Access::from_bits(bits).ok_or_else(|| bad(format!("unknown access bits {bits:#x}")))?;
    Ok(RemoteRegion { tag, addr, len, rkey, access })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region() -> RemoteRegion {
        RemoteRegion { tag: 7, addr: 0x1000, len: 100, rkey: 0x42, access: Access::REMOTE_WRITE }
    }

    #[cfg(feature = "serde")]
    #[test]
    fn descriptors_travel_through_serde_checked_as_the_wire_form_is() {
        let r = region();
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<RemoteRegion>(&json).unwrap(), r);
        // Unknown rights bits, or a range that wraps, are refused.
        let bad_bits = json.replace(&format!("\"access\":{}", r.access.bits()), "\"access\":4096");
        assert_ne!(bad_bits, json);
        assert!(serde_json::from_str::<RemoteRegion>(&bad_bits).is_err(), "{bad_bits}");
        let wraps = json.replace("\"addr\":4096", &format!("\"addr\":{}", u64::MAX - 10));
        assert!(serde_json::from_str::<RemoteRegion>(&wraps).is_err(), "{wraps}");
    }

    #[test]
    fn slices_are_bounds_checked() {
        let r = region();
        let s = r.slice(10..20).unwrap();
        assert_eq!((s.addr(), s.len(), s.rkey()), (0x100a, 10, 0x42));
        assert_eq!(r.slice(..).unwrap(), r.whole());
        assert_eq!(r.slice(100..).unwrap().len(), 0);
        assert!(matches!(
            r.slice(90..101),
            Err(Error::OutOfBounds { side: "remote", offset: 90, len: 11, region_len: 100 })
        ));
        let (start, end) = (50, 40);
        assert!(matches!(r.slice(start..end), Err(Error::OutOfBounds { .. })));
        assert!(matches!(r.whole().prefix(101), Err(Error::OutOfBounds { .. })));
    }

    #[test]
    fn descriptor_round_trips_through_bytes() {
        let r = region();
        assert_eq!(RemoteRegion::from_bytes(&r.to_bytes()).unwrap(), r);
        assert!(RemoteRegion::from_bytes(&r.to_bytes()[..31]).is_err());
    }
}
