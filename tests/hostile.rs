//! Hostile input: every decoder that reads bytes from a peer is fed at
//! least a million inputs (valid messages mutated field by field, cut,
//! extended, spliced, checksums fixed up so that the mutations reach the
//! payload decoders, and plain random bytes), then the TCP transport's
//! receiver is fed hostile frame streams through a real socket.
//!
//! Each asserts: no panic (on any thread), every outcome a typed value,
//! what decodes re-encodes to the same thing, and no allocation larger than
//! the configured limit whatever a length field says (a counting global
//! allocator records the largest request). The inputs are deterministic
//! (a fixed seed), so a failure reproduces. Coverage-guided fuzzing needs a
//! nightly toolchain, which this project does not use: these are property
//! tests.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::Duration;

use gpu_rdma::bootstrap::{self, CAP_TCP, CAP_VERBS, Deadline, FrameKind, Hello, TcpEndpoint, VerbsEndpoint, wire};
use gpu_rdma::{Access, BootstrapError, ConnectOptions, Domain, DomainConfig, RemoteRegion, TransportPolicy};

// ---- the counting allocator ----

/// Allocations are measured on threads that armed themselves, and on every
/// thread while `ALL_ARMED` is set.
struct Counting;

static ALL_ARMED: AtomicBool = AtomicBool::new(false);
static LARGEST_ALL: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn record(size: usize) {
    // `try_with`: thread-local storage may be gone while a thread exits.
    if ARMED.try_with(Cell::get).unwrap_or(false) {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
    }
    if ALL_ARMED.load(Ordering::Relaxed) {
        LARGEST_ALL.fetch_max(size, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; the
// bookkeeping neither allocates nor touches the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        record(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` with this thread's allocations measured, raising `largest` to
/// the largest single allocation it made.
fn measured<T>(largest: &mut usize, f: impl FnOnce() -> T) -> T {
    LARGEST.with(|l| l.set(0));
    ARMED.with(|a| a.set(true));
    let out = f();
    ARMED.with(|a| a.set(false));
    *largest = (*largest).max(LARGEST.with(Cell::get));
    out
}

// ---- inputs ----

/// xorshift64*: small, fast, deterministic.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

const INTERESTING: [u64; 12] =
    [0, 1, 2, 0x7f, 0x80, 0xff, 0xffff, 0x7fff_ffff, 0x8000_0000, 0xffff_ffff, u64::MAX - 1, u64::MAX];

/// One hostile input from `seeds`, written into `out` (cleared first).
fn mutate(rng: &mut Rng, seeds: &[Vec<u8>], out: &mut Vec<u8>, max_len: usize) {
    out.clear();
    if rng.chance(16) {
        // Plain random bytes.
        let n = rng.below(max_len);
        out.extend((0..n).map(|_| rng.next() as u8));
        return;
    }
    out.extend_from_slice(&seeds[rng.below(seeds.len())]);
    for _ in 0..1 + rng.below(3) {
        let len = out.len();
        match rng.below(8) {
            // Flip a few bits.
            0 if len > 0 => {
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(len);
                    out[i] ^= 1 << rng.below(8);
                }
            }
            // A byte set to an edge value.
            1 if len > 0 => {
                let i = rng.below(len);
                out[i] = INTERESTING[rng.below(INTERESTING.len())] as u8;
            }
            // A 2-, 4- or 8-byte field (either byte order) set to an edge value.
            2 | 3 if len >= 8 => {
                let w = [2, 4, 8][rng.below(3)];
                let i = rng.below(len - w + 1);
                let v = INTERESTING[rng.below(INTERESTING.len())].wrapping_add(rng.below(3) as u64).wrapping_sub(1);
                let bytes = if rng.chance(2) { v.to_be_bytes() } else { v.to_le_bytes() };
                let at = if rng.chance(2) { 8 - w } else { 0 };
                out[i..i + w].copy_from_slice(&bytes[at..at + w]);
            }
            // Cut.
            4 if len > 0 => out.truncate(rng.below(len)),
            // Extend with random bytes.
            5 => {
                let n = 1 + rng.below(64);
                out.extend((0..n).map(|_| rng.next() as u8));
            }
            // Splice another seed's tail.
            6 => {
                let other = &seeds[rng.below(seeds.len())];
                let from = rng.below(other.len());
                let at = rng.below(len + 1);
                out.truncate(at);
                out.extend_from_slice(&other[from..]);
            }
            // Duplicate a chunk.
            _ if len > 0 => {
                let a = rng.below(len);
                let b = a + rng.below(len - a);
                let chunk = out[a..b].to_vec();
                out.extend_from_slice(&chunk);
            }
            _ => {}
        }
    }
    out.truncate(max_len);
}

fn region(rng: &mut Rng) -> RemoteRegion {
    RemoteRegion {
        tag: rng.next(),
        addr: rng.next() >> 20,
        len: rng.next() >> 40,
        rkey: rng.next() as u32,
        access: Access::REMOTE_WRITE,
    }
}

fn hellos(rng: &mut Rng) -> Vec<Hello> {
    let verbs = VerbsEndpoint {
        qp_num: 0x11,
        psn: 0x1234,
        max_msg_sz: 1 << 30,
        lid: 0,
        mtu: 3,
        link_layer: 2,
        responder_resources: 16,
        gid: [0xfe; 16],
    };
    let tcp = TcpEndpoint { rnr_retry: 7, min_rnr_timer: 12, max_message: 1 << 30, send_depth: 128 };
    (0..8)
        .map(|i| Hello {
            caps: [CAP_VERBS | CAP_TCP, CAP_TCP, CAP_VERBS, 0][i % 4],
            verbs: (i % 4 == 0 || i % 4 == 2).then_some(verbs),
            tcp: (i % 4 < 2).then_some(tcp),
            regions: (0..i / 2).map(|_| region(rng)).collect(),
            name: if i % 3 == 0 { b"rank/5".to_vec() } else { vec![] },
        })
        .collect()
}

const INPUTS: usize = 1_000_000;

fn variant(e: &BootstrapError) -> String {
    format!("{e:?}").split([' ', '(', '{']).next().unwrap_or_default().to_owned()
}

fn report(what: &str, outcomes: &BTreeMap<String, usize>, largest: usize) {
    println!("{what}: {INPUTS} hostile inputs, largest allocation {largest} bytes, outcomes {outcomes:?}");
}

#[test]
fn bootstrap_frames_survive_a_million_hostile_inputs() {
    const LIMIT: u32 = 4096;
    let mut rng = Rng(0x5eed_0001);
    let mut seeds: Vec<Vec<u8>> =
        hellos(&mut rng).iter().map(|h| bootstrap::encode_frame(FrameKind::Hello, &h.encode()).to_vec()).collect();
    seeds.push(bootstrap::encode_frame(FrameKind::Ready, &[]).to_vec());
    seeds.push(bootstrap::encode_frame(FrameKind::Bye, &[]).to_vec());
    seeds.push(bootstrap::encode_frame(FrameKind::Reject, &wire::encode_reason("no thanks")).to_vec());
    seeds.push(bootstrap::encode_frame(FrameKind::Challenge, &[7; 32]).to_vec());
    seeds.push(bootstrap::encode_frame(FrameKind::Proof, &[9; 32]).to_vec());
    seeds.push(bootstrap::encode_frame(FrameKind::Accept, &[]).to_vec());
    let mut input = Vec::with_capacity(8192);
    let mut outcomes = BTreeMap::new();
    let mut largest = 0;
    {
        for i in 0..INPUTS {
            mutate(&mut rng, &seeds, &mut input, 2048);
            if i % 2 == 0 && input.len() >= bootstrap::HEADER_LEN {
                // Fix the length and checksum up, so that the payload is what
                // the mutation hit, not the framing.
                let kind = [FrameKind::Hello, FrameKind::Reject, FrameKind::Challenge][i % 3];
                let framed = bootstrap::encode_frame(kind, &input[bootstrap::HEADER_LEN..]);
                input.clear();
                input.extend_from_slice(&framed);
            }
            let key = match measured(&mut largest, || bootstrap::decode_frame(&input, LIMIT)) {
                Ok((kind, payload, used)) => {
                    assert!(used <= input.len() && payload.len() <= LIMIT as usize);
                    if kind == FrameKind::Hello {
                        match measured(&mut largest, || Hello::decode(&payload)) {
                            Ok(h) => {
                                assert_eq!(Hello::decode(&h.encode()).ok().as_ref(), Some(&h), "hello round trip");
                                "Ok(hello)".to_owned()
                            }
                            Err(e) => format!("hello {}", variant(&e)),
                        }
                    } else {
                        format!("Ok({})", kind.name())
                    }
                }
                Err(e) => variant(&e),
            };
            *outcomes.entry(key).or_insert(0usize) += 1;
        }
    }
    report("bootstrap frames", &outcomes, largest);
    assert!(largest <= LIMIT as usize, "an allocation of {largest} bytes, the limit is {LIMIT}");
    for expected in ["Ok(hello)", "BadMagic", "VersionMismatch", "Checksum", "Truncated", "Oversized", "Malformed"] {
        assert!(outcomes.contains_key(expected), "never reached {expected}: {outcomes:?}");
    }
    assert!(outcomes.keys().any(|k| k.starts_with("hello Malformed")), "no hello payload rejected: {outcomes:?}");
}

#[test]
fn hellos_survive_a_million_hostile_payloads() {
    let mut rng = Rng(0x5eed_0002);
    let seeds: Vec<Vec<u8>> = hellos(&mut rng).iter().map(|h| h.encode().to_vec()).collect();
    let mut input = Vec::with_capacity(8192);
    let mut outcomes = BTreeMap::new();
    let mut longest = 0;
    let mut largest = 0;
    {
        for _ in 0..INPUTS {
            mutate(&mut rng, &seeds, &mut input, 1024);
            longest = longest.max(input.len());
            let key = match measured(&mut largest, || Hello::decode(&input)) {
                Ok(h) => {
                    assert_eq!(Hello::decode(&h.encode()).ok().as_ref(), Some(&h), "hello round trip");
                    "Ok".to_owned()
                }
                Err(BootstrapError::Malformed { what, detail }) => {
                    // The field, not the value: "ends before the caps field", "MTU code".
                    let field: String =
                        detail.split(|c: char| c.is_ascii_digit()).next().unwrap_or("").chars().take(24).collect();
                    format!("{what}: {field}")
                }
                Err(BootstrapError::OutOfRange { field, .. }) => format!("out of range: {field}"),
                Err(e) => panic!("a hello decodes to Ok, Malformed or OutOfRange, not {e:?}"),
            };
            *outcomes.entry(key).or_insert(0usize) += 1;
        }
    }
    report("hello payloads", &outcomes, largest);
    // The regions vector is sized from the count only once the bytes are
    // there: never more than the input could describe.
    let per_region = std::mem::size_of::<RemoteRegion>();
    let bound = longest / wire::REGION_LEN * per_region;
    assert!(largest <= bound.max(64), "an allocation of {largest} bytes for inputs of at most {longest}");
    assert!(outcomes.get("Ok").copied().unwrap_or(0) > 1000, "{outcomes:?}");
    assert!(outcomes.len() >= 8, "too few distinct outcomes: {outcomes:?}");
}

#[test]
fn region_descriptors_and_reasons_survive_a_million_hostile_inputs() {
    let mut rng = Rng(0x5eed_0003);
    let seeds: Vec<Vec<u8>> = (0..8).map(|_| wire::encode_region(&region(&mut rng)).to_vec()).collect();
    let mut input = Vec::with_capacity(8192);
    let mut outcomes = BTreeMap::new();
    let mut largest = 0;
    {
        for _ in 0..INPUTS {
            mutate(&mut rng, &seeds, &mut input, 64);
            let key = match measured(&mut largest, || wire::decode_region(&input)) {
                Ok(r) => {
                    assert_eq!(wire::decode_region(&wire::encode_region(&r)).ok(), Some(r));
                    assert!(r.addr.checked_add(r.len).is_some());
                    "Ok"
                }
                Err(BootstrapError::Malformed { .. }) => "Malformed",
                Err(e) => panic!("a descriptor decodes to Ok or Malformed, not {e:?}"),
            };
            *outcomes.entry(key.to_owned()).or_insert(0usize) += 1;
        }
    }
    report("region descriptors", &outcomes, largest);
    // Only the error's message is allocated, whatever the input says.
    assert!(largest <= 512, "decoding a descriptor allocated {largest} bytes");
    assert!(outcomes.len() == 2, "{outcomes:?}");

    // Reject reasons: any bytes, cut to the limit: the lossy conversion of
    // the limit (3 bytes per invalid byte, in a string that grows by
    // doubling) is the most ever allocated, however long the input.
    let seeds: Vec<Vec<u8>> =
        vec![b"the peer is busy".to_vec(), "\u{1F600} \u{00e9}".as_bytes().to_vec(), vec![0xff; 2000]];
    let mut largest = 0;
    {
        for _ in 0..INPUTS {
            mutate(&mut rng, &seeds, &mut input, 4096);
            let reason = measured(&mut largest, || wire::decode_reason(&input));
            assert!(reason.len() <= 3 * wire::MAX_REASON);
        }
    }
    println!("reject reasons: {INPUTS} hostile inputs, largest allocation {largest} bytes");
    assert!(largest <= 4 * wire::MAX_REASON, "an allocation of {largest} bytes");
}

// ---- the TCP transport's receiver, through a socket ----

/// The transport's frame header, as documented in `transport/tcp.rs`:
/// `op u8, flags u8, 2 reserved, seq u32, key u32, imm u32, addr u64,
/// len u32, total u32`, little-endian.
#[allow(clippy::too_many_arguments)]
fn tcp_frame(op: u8, flags: u8, seq: u32, key: u32, imm: u32, addr: u64, payload: &[u8], total: u32) -> Vec<u8> {
    let mut b = vec![op, flags, 0, 0];
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&key.to_le_bytes());
    b.extend_from_slice(&imm.to_le_bytes());
    b.extend_from_slice(&addr.to_le_bytes());
    b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    b.extend_from_slice(&total.to_le_bytes());
    b.extend_from_slice(payload);
    b
}

/// Plays the handshake as a TCP-only peer, then writes `frames` and closes.
/// Returns how many frames went out whole before the victim hung up.
fn hostile_peer(listener: &TcpListener, frames: &[Vec<u8>]) -> usize {
    let Ok((s, _)) = listener.accept() else { return 0 };
    let deadline = Deadline::after(Duration::from_secs(10), "the victim");
    let hello = Hello {
        caps: CAP_TCP,
        verbs: None,
        tcp: Some(TcpEndpoint { rnr_retry: 0, min_rnr_timer: 1, max_message: 1 << 30, send_depth: 128 }),
        // A notification ring it holds no memory for (nothing here writes to it).
        regions: vec![RemoteRegion {
            tag: gpu_rdma::RING_TAG,
            addr: 0x7000_0000,
            len: 64 + gpu_rdma::DEFAULT_RING as u64,
            rkey: 0x5151,
            access: Access::REMOTE_WRITE,
        }],
        name: b"hostile".to_vec(),
    };
    if bootstrap::exchange_hello(&s, &hello, deadline, 1 << 20).is_err()
        || bootstrap::exchange_ready(&s, deadline).is_err()
    {
        return 0;
    }
    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
    let mut sent = 0;
    for f in frames {
        if (&s).write_all(f).is_err() {
            break;
        }
        sent += 1;
    }
    // Closing: the victim reads what was sent, then the end of the stream.
    sent
}

static PANICS: AtomicUsize = AtomicUsize::new(0);

#[test]
fn the_tcp_receiver_survives_hostile_frame_streams() {
    const STREAMS: usize = 1500;
    const FRAMES: usize = 48;
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        previous(info);
    }));
    let d = Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).unwrap();
    let original = common::pattern(8192, 3);
    let mut target = d.alloc(8192).unwrap();
    target.copy_from_slice(&original);
    let target = d.expose(target, Access::REMOTE_WRITE | Access::REMOTE_READ, 1).unwrap();
    // Regions this peer was never given: their keys and addresses are in
    // the corpus, and they must never change.
    let canaries: Vec<_> = (0..2)
        .map(|i| {
            let mut r = d.alloc(8192).unwrap();
            r.copy_from_slice(&common::pattern(8192, 10 + i));
            d.expose(r, Access::REMOTE_WRITE | Access::REMOTE_READ, 2).unwrap()
        })
        .collect();
    let t = target.descriptor();
    let mut rng = Rng(0x5eed_0004);
    let mut seeds: Vec<Vec<u8>> = vec![
        tcp_frame(1, 3, 1, 0, 0, 0, b"hello", 5),
        tcp_frame(1, 7, 2, 0, 42, 0, &[0xab; 100], 100),
        tcp_frame(1, 1, 3, 0, 0, 0, &[1; 64], 128),
        tcp_frame(2, 3, 4, t.rkey, 0, t.addr, &[0xcd; 256], 256),
        tcp_frame(2, 7, 5, t.rkey, 9, t.addr + 4096, &[0xef; 64], 64),
        tcp_frame(3, 3, 6, t.rkey, 0, t.addr, &[], 4096),
        tcp_frame(4, 3, 7, 0, 0, 0, &[1; 32], 0),
        tcp_frame(5, 0, 8, 0, 0, 0, &[], 0),
        tcp_frame(6, 0, 0, 0, 0, 0, &[], 0),
    ];
    for c in &canaries {
        let c = c.descriptor();
        seeds.push(tcp_frame(2, 3, 9, c.rkey, 0, c.addr, &[0x66; 128], 128));
        seeds.push(tcp_frame(3, 3, 10, c.rkey, 0, c.addr, &[], 128));
    }
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let opts = ConnectOptions::default()
        .advertise(&target)
        .handshake_timeout(Duration::from_secs(10))
        .op_timeout(Duration::from_secs(10));
    let (mut frames_sent, mut broken, mut completed_ok, mut completed_err) = (0, 0, 0, 0);
    let mut input = Vec::with_capacity(1 << 16);
    LARGEST_ALL.store(0, Ordering::SeqCst);
    ALL_ARMED.store(true, Ordering::SeqCst);
    for _ in 0..STREAMS {
        let frames: Vec<Vec<u8>> = (0..FRAMES)
            .map(|_| {
                if rng.chance(3) {
                    seeds[rng.below(seeds.len())].clone()
                } else {
                    mutate(&mut rng, &seeds, &mut input, 4096);
                    input.clone()
                }
            })
            .collect();
        let peer = thread::scope(|sc| {
            let peer = sc.spawn(|| hostile_peer(&listener, &frames));
            let conn = d.connect(addr, &opts).expect("the handshake with the hostile peer");
            let mut recvs: Vec<_> = (0..4).map(|_| conn.recv(d.alloc(256).unwrap())).collect();
            let sent = peer.join().expect("the hostile peer");
            // Every receive ends, one way or the other, well within its timeout.
            for r in &mut recvs {
                match r.wait_timeout(Duration::from_secs(10)) {
                    Ok(_) => completed_ok += 1,
                    Err(e) => {
                        assert!(!e.is_timeout(), "a receive hung: {e}");
                        completed_err += 1;
                    }
                }
            }
            broken += usize::from(conn.broken().is_some());
            sent
        });
        frames_sent += peer;
    }
    ALL_ARMED.store(false, Ordering::SeqCst);
    let largest = LARGEST_ALL.load(Ordering::SeqCst);
    println!(
        "TCP receiver: {STREAMS} hostile streams, {frames_sent} frames delivered, {broken} connections broken, \
         receives {completed_ok} ok / {completed_err} failed, largest allocation {largest} bytes"
    );
    for (i, c) in canaries.iter().enumerate() {
        let mut now = vec![0u8; 8192];
        c.read_at(0, &mut now).unwrap();
        assert!(now == common::pattern(8192, 10 + i as u64), "a region never given to the peer changed");
    }
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a thread panicked");
    // Both outcomes were reached: the corpus is not all garbage.
    assert!(completed_ok > 0 && completed_err > 0);
    // The receiver's scratch buffer (1 MiB) is its largest allocation; no
    // length field makes it allocate more.
    assert!(largest <= (1 << 20) + 4096, "an allocation of {largest} bytes");
    drop(original);
}

/// A buffer or region of one domain used with another domain's connection
/// or `expose`: a typed error naming both domains, nothing posted, the
/// buffer back; the error is handed out once, and the connection still works.
#[test]
fn a_buffer_of_another_domain_is_refused_with_a_typed_error_and_comes_back() {
    let tcp = || Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).unwrap();
    let (a, b) = (tcp(), tcp());
    assert_ne!(a.id(), b.id());
    let e = b.expose(a.alloc(4096).unwrap(), Access::REMOTE_WRITE, 1).unwrap_err();
    match e.error {
        gpu_rdma::Error::DomainMismatch { what: "region", registered, used_with: "domain", expected } => {
            assert_eq!((registered, expected), (a.id(), b.id()));
        }
        other => panic!("{other:?}"),
    }
    let foreign = e.buffer;
    assert_eq!(foreign.domain_id(), a.id());

    let target = b.expose(b.alloc(4096).unwrap(), Access::REMOTE_WRITE, 2).unwrap();
    let (server, client) = common::pair_on(&b, &b, common::opts().advertise(&target), common::opts());
    let remote = client.remote_region(2).expect("advertised").slice(0..4096).unwrap();
    let mut p = client.write(foreign, &remote);
    match p.wait() {
        Err(gpu_rdma::Error::DomainMismatch { what: "buffer", registered, used_with: "connection", expected }) => {
            assert_eq!((registered, expected), (a.id(), b.id()));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(p.wait(), Err(gpu_rdma::Error::AlreadyReported)), "the error is handed out once");
    assert_eq!(p.into_buffer().expect("nothing was posted").len(), 4096);
    assert!(client.broken().is_none(), "refused locally: the connection is fine");
    let stats = client.stats();
    assert_eq!((stats.in_flight, stats.orphaned), (0, 0), "nothing was posted");
    assert_eq!(stats, gpu_rdma::ConnectionStats::default());
    // The connection still carries a write from its own domain.
    let (_c, own) = client.write(b.alloc(4096).unwrap(), &remote).finish().unwrap();
    assert_eq!(own.len(), 4096);
    drop(server);
}

/// A batch that can never fit the send queue, and an empty one: typed
/// errors, nothing posted, every buffer back, the connection fine.
#[test]
fn a_batch_larger_than_the_send_queue_or_empty_is_refused_with_a_typed_error() {
    let d = Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).unwrap();
    let target = d.expose(d.alloc(4096).unwrap(), Access::REMOTE_WRITE, 3).unwrap();
    let (_server, client) = common::pair_on(&d, &d, common::opts().advertise(&target), common::opts());
    let remote = client.remote_region(3).expect("advertised").slice(0..64).unwrap();
    let depth = client.info().send_queue_depth;
    let mut batch = client.batch();
    for _ in 0..=depth {
        batch = batch.write(d.alloc(64).unwrap(), &remote);
    }
    let mut p = batch.post();
    match p.wait() {
        Err(gpu_rdma::Error::TooManyRequests { requests, depth: d }) => {
            assert_eq!((requests, d), (u64::from(depth) + 1, depth));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.into_buffer().expect("nothing was posted").len(), depth as usize + 1);
    let mut empty = client.batch::<gpu_rdma::Region>().post();
    assert!(matches!(empty.wait(), Err(gpu_rdma::Error::EmptyBatch)), "an empty batch");
    assert!(client.broken().is_none());
    // A batch that fits still goes through.
    let (_, bufs) = client.batch().write(d.alloc(64).unwrap(), &remote).post().finish().unwrap();
    assert_eq!(bufs.len(), 1);
}

/// What a new user reaches without importing traits or module paths:
/// `.slice()` on regions and exposed regions, and `gpu_rdma::Secret`. A
/// slice out of bounds is a typed error with the buffer back.
#[test]
fn slices_and_the_secret_need_no_extra_imports() {
    let secret = gpu_rdma::Secret::new(b"a shared secret").unwrap();
    let opts = common::opts().secret(secret);
    let d = Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).unwrap();
    let target = d.expose(d.alloc(4096).unwrap(), Access::REMOTE_WRITE | Access::REMOTE_READ, 4).unwrap();
    let (_server, client) = common::pair_on(&d, &d, opts.clone().advertise(&target), opts);
    let remote = client.remote_region(4).expect("advertised").slice(0..512).unwrap();
    let (_, region) = client.write(d.alloc(1024).unwrap().slice(512..1024), &remote).finish().unwrap();
    assert_eq!(region.len(), 1024);
    let mut p = client.read(region.slice(1000..1512), &remote);
    assert!(matches!(p.wait(), Err(gpu_rdma::Error::OutOfBounds { side: "local", .. })));
    assert_eq!(p.into_buffer().unwrap().len(), 1024);
    let (_, back) = client.read(target.clone().slice(0..512), &remote).finish().unwrap();
    assert_eq!(back.tag(), 4);
}

/// Every connection option has a builder; a peer's region reads through
/// getters as a slice does; zero-byte operations work; `stats` counts what
/// the device already finished as done.
#[test]
fn options_build_regions_read_and_zero_byte_operations_work() {
    let o = ConnectOptions::default()
        .max_inline(128)
        .retries(17, 5, 3)
        .min_rnr_timer(9)
        .qos(46, 2)
        .max_handshake_payload(4096)
        .no_secret();
    assert_eq!((o.max_inline, o.ack_timeout, o.retry_count, o.rnr_retry), (128, 17, 5, 3));
    assert_eq!((o.min_rnr_timer, o.traffic_class, o.service_level, o.max_handshake_payload), (9, 46, 2, 4096));
    assert!(o.secret.is_none());

    let d = Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).unwrap();
    let target = d.expose(d.alloc(4096).unwrap(), Access::REMOTE_WRITE | Access::REMOTE_READ, 5).unwrap();
    let (server, client) = common::pair_on(&d, &d, common::opts().advertise(&target), common::opts());
    let r = client.remote_region(5).expect("advertised");
    assert_eq!((r.tag(), r.addr(), r.len(), r.rkey(), r.access()), (r.tag, r.addr, r.len, r.rkey, r.access));
    assert!(!r.is_empty());
    let empty = r.slice(0..0).unwrap();
    let (c, _) = client.write(d.alloc(64).unwrap().slice(0..0), &empty).finish().unwrap();
    assert_eq!(c.byte_len, 0);
    let (c, _) = client.read(d.alloc(64).unwrap().slice(0..0), &empty).finish().unwrap();
    assert_eq!(c.byte_len, 0);
    let rx = server.recv(d.alloc(64).unwrap());
    client.send(d.alloc(64).unwrap().slice(0..0)).finish().unwrap();
    let (c, _) = rx.finish().unwrap();
    assert_eq!(c.byte_len, 0, "a zero-byte send consumes a receive");
    let stats = client.stats();
    assert_eq!((stats.in_flight, stats.orphaned), (0, 0));
}
