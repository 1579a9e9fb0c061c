//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::thread;
use std::time::Duration;

#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod raw;

use gpu_rdma::{ConnectOptions, Connection, Domain, DomainConfig, TransportPolicy};

/// Which transport a test of the connection suite runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A TCP-only domain: runs anywhere.
    Tcp,
    /// The RDMA device named by `GPU_RDMA_TEST_DEVICE`.
    Verbs,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Tcp => "tcp",
            Kind::Verbs => "verbs",
        }
    }
}

/// The RDMA device the verbs tests run on, from `GPU_RDMA_TEST_DEVICE`.
/// Verbs tests are `#[ignore]`d, so this runs only when asked for
/// (`-- --ignored`); then a missing variable is a failure, not a skip.
pub fn device() -> String {
    std::env::var("GPU_RDMA_TEST_DEVICE").unwrap_or_else(|_| {
        panic!("GPU_RDMA_TEST_DEVICE is not set: name the RDMA device to test on (cargo xtask test runs these on soft-RoCE rxe0)")
    })
}

/// A domain on the RDMA test device.
pub fn verbs_domain() -> Domain {
    Domain::with_config(&DomainConfig::default().device(device()).transport(TransportPolicy::Verbs))
        .expect("open the test device")
}

/// A domain for `kind`.
pub fn domain(kind: Kind) -> Domain {
    match kind {
        Kind::Verbs => verbs_domain(),
        Kind::Tcp => {
            Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).expect("a TCP domain")
        }
    }
}

pub fn opts() -> ConnectOptions {
    ConnectOptions::default().op_timeout(Duration::from_secs(60)).handshake_timeout(Duration::from_secs(30))
}

/// A connected pair in this process: (server side, client side).
pub fn pair_on(
    server: &Domain,
    client: &Domain,
    server_opts: ConnectOptions,
    client_opts: ConnectOptions,
) -> (Connection, Connection) {
    let listener = server.listen("127.0.0.1:0").expect("listen");
    let addr: SocketAddr = listener.local_addr().unwrap();
    let t = thread::spawn(move || listener.accept_timeout(&server_opts, Duration::from_secs(30)));
    let c = client.connect(addr, &client_opts).expect("connect");
    let s = t.join().expect("accept thread").expect("accept");
    (s, c)
}

/// A connected pair on one domain with default options.
pub fn pair(d: &Domain) -> (Connection, Connection) {
    pair_on(d, d, opts(), opts())
}

/// A registered host region holding `data`.
pub fn filled(d: &Domain, data: &[u8]) -> gpu_rdma::Region {
    let mut r = d.alloc(data.len()).unwrap();
    r.copy_from_slice(data);
    r
}

/// What `len` bytes hold after the transfer list `pieces` moved bytes of
/// `src` into them (zero elsewhere): each piece from its local offset to
/// its remote one (`to_remote`, a write), or the other way (a read).
pub fn apply(pieces: &[gpu_rdma::Piece], src: &[u8], len: usize, to_remote: bool) -> Vec<u8> {
    let mut out = vec![0u8; len];
    for p in pieces {
        let (from, to) = if to_remote { (p.local, p.remote) } else { (p.remote, p.local) };
        out[to as usize..(to + p.len) as usize].copy_from_slice(&src[from as usize..(from + p.len) as usize]);
    }
    out
}

/// A deterministic byte pattern: a 4 KiB block of pseudo-random bytes,
/// tiled, with every page stamped with its index, so no two pages are alike
/// (a misplaced chunk shows) and making 256 MiB is cheap in debug builds.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let block: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    let mut out = Vec::with_capacity(len);
    let mut page = 0u64;
    while out.len() < len {
        let start = out.len();
        let n = (len - start).min(block.len());
        out.extend_from_slice(&block[..n]);
        let stamp = (page ^ seed.rotate_left(32)).to_le_bytes();
        let k = n.min(8);
        out[start..start + k].copy_from_slice(&stamp[..k]);
        page += 1;
    }
    out
}

/// `None` when equal, else the first offset that differs.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a == b {
        return None;
    }
    Some(a.iter().zip(b).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len())))
}

/// xorshift64*: deterministic pieces, so a failure reproduces.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `n` pieces of 1..=`max_len` bytes: disjoint on the `disjoint` side
/// (laid out with random gaps, then shuffled), anywhere on the other side
/// (`other_len` bytes), with runs contiguous on both sides now and then
/// (merged by the planner). Returns the pieces and the disjoint side's span.
pub fn random_pieces(rng: &mut Rng, n: usize, max_len: u64, other_len: u64) -> (Vec<(u64, u64, u64)>, u64) {
    let mut out: Vec<(u64, u64, u64)> = Vec::with_capacity(n);
    let mut at = 0u64;
    while out.len() < n {
        let len = 1 + rng.below(max_len);
        let contiguous = rng.below(5) == 0;
        let (disjoint, other) = match out.last() {
            Some(&(d, o, l)) if contiguous && o + l + len <= other_len => (d + l, o + l),
            _ => (at + rng.below(64), rng.below(other_len - len)),
        };
        out.push((disjoint, other, len));
        at = disjoint + len;
    }
    // Shuffle runs apart only partly: keep a contiguous pair together
    // sometimes, so the planner sees both cases.
    for i in (1..out.len()).rev() {
        if rng.below(2) == 0 {
            let j = rng.below(i as u64 + 1) as usize;
            out.swap(i, j);
        }
    }
    (out, at)
}

/// Each named test function of the connection suite style, twice:
/// `tcp::name` (runs anywhere) and `verbs::name` (`#[ignore]`d without an
/// RDMA device; `--ignored` with `GPU_RDMA_TEST_DEVICE`).
#[macro_export]
macro_rules! both {
    ($($name:ident),* $(,)?) => {
        mod tcp {
            $(
                #[test]
                fn $name() {
                    super::$name(super::Kind::Tcp)
                }
            )*
        }
        mod verbs {
            $(
                #[test]
                #[ignore = "verbs: needs an RDMA device: GPU_RDMA_TEST_DEVICE=<dev> and --ignored (cargo xtask test runs it on soft-RoCE)"]
                fn $name() {
                    super::$name(super::Kind::Verbs)
                }
            )*
        }
    };
}

/// Counts the ticks of a 1 ms timer task on the current tokio runtime:
/// how often the runtime ran something else while a future was awaited
/// (abort the task when done).
pub fn ticker() -> (std::sync::Arc<std::sync::atomic::AtomicU64>, tokio::task::JoinHandle<()>) {
    let ticks = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = ticks.clone();
    let task = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(1)).await;
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    (ticks, task)
}
