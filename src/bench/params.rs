//! What both ends run: the test, its sizes and iterations ([`Params`]),
//! and how the local buffer may be used.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::memory::Access;

/// A perftest test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum Test {
    /// Bandwidth by RDMA write (`ib_write_bw`).
    WriteBw,
    /// Bandwidth by RDMA read (`ib_read_bw`).
    ReadBw,
    /// Bandwidth by send/receive (`ib_send_bw`).
    SendBw,
    /// Latency by write with immediate, ping-pong (`ib_write_lat` polls
    /// memory instead, which GPU memory does not allow).
    WriteLat,
    /// Latency of one read at a time (`ib_read_lat`).
    ReadLat,
    /// Latency by send/receive, ping-pong (`ib_send_lat`).
    SendLat,
    /// Message rate and bandwidth by RDMA write in transfer lists of
    /// [`Params::list`] pieces of the size each (the engine's path; compare
    /// with `ib_write_bw` at the same size).
    ListBw,
}

impl Test {
    /// Every test.
    pub const ALL: [Test; 7] =
        [Test::WriteBw, Test::ReadBw, Test::SendBw, Test::WriteLat, Test::ReadLat, Test::SendLat, Test::ListBw];

    /// `write-bw`, ...
    pub fn name(self) -> &'static str {
        match self {
            Test::WriteBw => "write-bw",
            Test::ReadBw => "read-bw",
            Test::SendBw => "send-bw",
            Test::WriteLat => "write-lat",
            Test::ReadLat => "read-lat",
            Test::SendLat => "send-lat",
            Test::ListBw => "list-bw",
        }
    }

    /// The perftest program that measures the same thing.
    pub fn perftest(self) -> &'static str {
        match self {
            Test::WriteBw => "ib_write_bw",
            Test::ReadBw => "ib_read_bw",
            Test::SendBw => "ib_send_bw",
            Test::WriteLat => "ib_write_lat",
            Test::ReadLat => "ib_read_lat",
            Test::SendLat => "ib_send_lat",
            Test::ListBw => "ib_write_bw",
        }
    }

    /// Whether it measures bandwidth (else latency).
    pub fn is_bw(self) -> bool {
        matches!(self, Test::WriteBw | Test::ReadBw | Test::SendBw | Test::ListBw)
    }

    /// The rights the server's region is exposed with.
    pub fn server_access(self) -> Access {
        match self {
            Test::WriteBw | Test::WriteLat | Test::ListBw => Access::REMOTE_WRITE,
            Test::ReadBw | Test::ReadLat => Access::REMOTE_READ,
            Test::SendBw | Test::SendLat => Access::empty(),
        }
    }

    /// The rights the client's region is exposed with (the server writes
    /// back in the write ping-pong).
    pub fn client_access(self) -> Access {
        if self == Test::WriteLat { Access::REMOTE_WRITE } else { Access::empty() }
    }

    /// perftest's default iteration count.
    pub fn default_iters(self) -> u32 {
        if self.is_bw() { 5000 } else { 1000 }
    }

    fn code(self) -> u8 {
        Test::ALL.iter().position(|t| *t == self).unwrap_or(0) as u8
    }
}

impl FromStr for Test {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Test::ALL.into_iter().find(|t| t.name() == s || t.perftest() == s).ok_or_else(|| {
            Error::InvalidArgument(format!("test `{s}`: expected one of {}", Test::ALL.map(Test::name).join(", ")))
        })
    }
}

impl fmt::Display for Test {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// perftest's `-a`: every power of two from 2 bytes to 8 MiB.
pub fn all_sizes() -> Vec<usize> {
    (1..=23).map(|k| 1usize << k).collect()
}

/// What both ends run.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Params {
    /// The test.
    pub test: Test,
    /// Message sizes, in order (one, or [`all_sizes`]).
    pub sizes: Vec<usize>,
    /// Iterations per size.
    pub iters: u32,
    /// Requests in flight at most (bandwidth tests).
    pub tx_depth: u32,
    /// Requests per signalled chain (bandwidth tests).
    pub cq_mod: u32,
    /// Pieces per transfer list (`list-bw`; a choice of the client's).
    pub list: u32,
}

pub(super) const PARAMS_LEN: usize = 24;
pub(super) const PARAMS_MAGIC: u32 = 0x4742_4e31; // "GBN1"
/// The immediate that ends a test.
pub(super) const DONE: u32 = u32::MAX;

impl Params {
    /// The largest size.
    pub fn max_size(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(0)
    }

    /// The staging slots a side of this run holds at once when its memory
    /// is staged GPU memory, as `(bytes each, how many)`, for
    /// [`Domain::reserve_staging`](crate::Domain::reserve_staging) before the
    /// timed loops (as perftest registers all its memory before timing).
    /// `chunk` and `depth` are the connection's
    /// [`staging`](crate::ConnectOptions::staging).
    ///
    /// Bandwidth: `tx_depth` operations in flight; a write or read takes a
    /// slot per chunk in flight (up to `depth`, of at most `chunk` bytes),
    /// a send or receive one slot of the message. Latency: the two
    /// receives a ping-pong keeps posted and two sends.
    pub fn staging_slots(&self, chunk: usize, depth: usize) -> (usize, usize) {
        let size = self.max_size();
        let chunked = matches!(self.test, Test::WriteBw | Test::ReadBw | Test::ListBw);
        let (len, per_op) = if chunked {
            let chunk = chunk.max(1);
            (size.min(chunk), size.div_ceil(chunk).min(depth.max(2)))
        } else {
            (size, 1)
        };
        let ops = if self.test.is_bw() { self.tx_depth as usize } else { 4 };
        (len, ops * per_op)
    }

    /// Checks the values a run depends on.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the bad value.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.sizes.is_empty() || self.sizes.contains(&0) {
            return bad("sizes must be at least 1 byte".into());
        }
        if self.iters < 5 {
            return bad(format!("{} iterations: at least 5, as perftest", self.iters));
        }
        if self.tx_depth == 0 || self.cq_mod == 0 || self.list == 0 {
            return bad("tx depth, CQ moderation and list length must be at least 1".into());
        }
        if self.max_size() > u32::MAX as usize - 1 {
            return bad("sizes must be below 4 GiB".into());
        }
        Ok(())
    }

    /// What the client sends first (as an immediate), enough to tell a
    /// mismatch: a checksum of the test, the sizes and the iterations.
    pub(super) fn digest(&self) -> u32 {
        // Never DONE, which the server's answer uses.
        crc32fast::hash(&self.encode()).min(DONE - 1)
    }

    fn encode(&self) -> [u8; PARAMS_LEN] {
        let all = self.sizes == all_sizes();
        let mut b = [0u8; PARAMS_LEN];
        b[0..4].copy_from_slice(&PARAMS_MAGIC.to_le_bytes());
        b[4] = self.test.code();
        b[5] = u8::from(all);
        b[8..12].copy_from_slice(&(self.sizes.len() as u32).to_le_bytes());
        b[12..16].copy_from_slice(&(self.max_size() as u32).to_le_bytes());
        b[16..20].copy_from_slice(&self.iters.to_le_bytes());
        b[20..24].copy_from_slice(&(self.sizes.iter().map(|s| *s as u32).fold(0u32, u32::wrapping_add)).to_le_bytes());
        b
    }
}

/// How the local buffer may be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalMode {
    /// Chains of requests allowed (not for staged GPU memory).
    pub batch: bool,
    /// Small sends may be copied inline (host memory only).
    pub inline: bool,
}

impl LocalMode {
    /// Host memory: chains and inline sends.
    pub const HOST: LocalMode = LocalMode { batch: true, inline: true };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tests_parse_by_name_and_by_perftest_name() {
        assert_eq!("write-bw".parse::<Test>().unwrap(), Test::WriteBw);
        assert_eq!("ib_send_lat".parse::<Test>().unwrap(), Test::SendLat);
        assert!("write".parse::<Test>().is_err());
    }

    #[test]
    fn params_disagree_when_anything_that_matters_differs() {
        let p = Params { test: Test::WriteBw, sizes: vec![65536], iters: 5000, tx_depth: 128, cq_mod: 32, list: 1024 };
        assert!(p.validate().is_ok());
        let mut q = p.clone();
        q.iters = 1000;
        assert_ne!(p.digest(), q.digest());
        let mut q = p.clone();
        q.test = Test::ReadBw;
        assert_ne!(p.encode(), q.encode());
        let mut q = p.clone();
        q.sizes = vec![4096];
        assert_ne!(p.encode(), q.encode());
        let mut q = p.clone();
        q.tx_depth = 16; // a local choice: may differ
        assert_eq!(p.encode(), q.encode());
        assert!(Params { iters: 4, ..p.clone() }.validate().is_err());
        assert!(Params { sizes: vec![], ..p }.validate().is_err());
        assert_eq!(all_sizes().first(), Some(&2));
        assert_eq!(all_sizes().last(), Some(&(8 << 20)));
    }

    #[test]
    fn staging_slots_count_what_a_side_holds_at_once() {
        let p = |test, size| Params { test, sizes: vec![size], iters: 5000, tx_depth: 128, cq_mod: 32, list: 1024 };
        let (chunk, depth) = (4 << 20, 4);
        // A 1 MiB write is one chunk: a slot per operation in flight.
        assert_eq!(p(Test::WriteBw, 1 << 20).staging_slots(chunk, depth), (1 << 20, 128));
        // 10 MiB is three chunks, all in flight at depth 4; at depth 2, two.
        assert_eq!(p(Test::ReadBw, 10 << 20).staging_slots(chunk, depth), (chunk, 3 * 128));
        assert_eq!(p(Test::WriteBw, 40 << 20).staging_slots(chunk, 2), (chunk, 2 * 128));
        // A depth below 2 is taken as 2, as the pipeline does.
        assert_eq!(p(Test::WriteBw, 40 << 20).staging_slots(chunk, 0), (chunk, 2 * 128));
        // A send is one message-sized slot, however large.
        assert_eq!(p(Test::SendBw, 10 << 20).staging_slots(chunk, depth), (10 << 20, 128));
        // A ping-pong keeps two receives posted, and a send may still be
        // finishing when the next goes.
        assert_eq!(p(Test::SendLat, 4096).staging_slots(chunk, depth), (4096, 4));
        // With every size, the largest counts.
        let all = Params { sizes: all_sizes(), ..p(Test::WriteBw, 2) };
        assert_eq!(all.staging_slots(chunk, depth), (chunk, 2 * 128));
    }
}
