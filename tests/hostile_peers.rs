//! Hostile peers against the TCP transport, from raw sockets: the peer
//! plays the handshake with the crate's own codec, then writes transport
//! frames by hand, as an attacker would.
//!
//! 1. After the first refused request the target carries out nothing more
//!    from that peer, and tears the connection down promptly.
//! 2. A peer that dies while its message waits for a receive is seen within
//!    a second (the receiver keeps watching the socket), even with the
//!    receiver-not-ready budget at "infinite".
//! 3. A peer that never reads its acknowledgements cannot make this side
//!    buffer without bound: resident memory stays within the documented
//!    per-connection bound, and the victim's other connections work.
//! 4. Silent and half-sent handshakes do not delay other clients: the
//!    listener runs handshakes concurrently, each with its deadline.
//! 5. Region keys on a TCP-only domain are not predictable from each other.
//! 6. An untracked inline send asks for no acknowledgement and is done
//!    without one; a tracked send waits for the peer's.
//! 7. A message, write or read response shorter than it announced fails
//!    its operation and breaks the connection.
//! 8. Replies that lie (an acknowledgement before the request reached the
//!    peer whole, twice, out of order, for nothing; a read answered out of
//!    order) break the connection and complete nothing: no buffer comes
//!    back while the transport still reads it.
//! 9. An inbox holds at most its byte bound, whatever notes arrive in its
//!    ring, and charges each note at least what it costs; a record that is
//!    not a notification is counted, one that breaks the ring breaks the
//!    connection.
//! 10. Limits a peer announces outside what this side accepts are refused
//!     at the handshake, naming the field; so is a notification ring this
//!     side cannot use.
//!
//! These tests count threads, descriptors and resident memory of this
//! process, so they run one at a time (a lock), and each measures against
//! a baseline taken after the previous one has cleaned up.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use gpu_rdma::bootstrap::{self, CAP_TCP, Deadline, Hello, Secret, TcpEndpoint};
use gpu_rdma::{Access, ConnectOptions, Connection, Domain, DomainConfig, Exposed, RemoteRegion, TransportPolicy};

use common::raw::*;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn tcp_domain() -> Domain {
    Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).expect("a TCP domain")
}

// ---- what this process holds ----

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Threads of this process whose name starts with `prefix`.
fn threads_named(prefix: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    tasks
        .filter_map(|t| t.ok())
        .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with(prefix)))
        .count()
}

fn transport_threads() -> usize {
    threads_named("gpu-rdma-tcp")
}

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}

/// Waits until `f` holds, up to `limit`; returns how long it took, or `None`.
fn within(limit: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    loop {
        if f() {
            return Some(t0.elapsed());
        }
        if t0.elapsed() >= limit {
            return None;
        }
        thread::sleep(Duration::from_millis(2));
    }
}

/// A victim: a TCP domain exposing one 4 KiB region (write and read),
/// accepting one connection that advertises it.
struct Victim {
    domain: Domain,
    region: Exposed,
    original: Vec<u8>,
}

impl Victim {
    fn new() -> Victim {
        let domain = tcp_domain();
        let original = common::pattern(4096, 11);
        let mut r = domain.alloc(4096).unwrap();
        r.copy_from_slice(&original);
        let region = domain.expose(r, Access::REMOTE_WRITE | Access::REMOTE_READ, 1).unwrap();
        Victim { domain, region, original }
    }

    fn opts(&self) -> ConnectOptions {
        ConnectOptions::default()
            .advertise(&self.region)
            .handshake_timeout(Duration::from_secs(10))
            .op_timeout(Duration::from_secs(30))
    }

    /// Accepts the hostile client; returns the victim's connection, the
    /// socket and the region's descriptor as the client saw it.
    fn accept(&self, tcp: TcpEndpoint) -> (Connection, TcpStream, RemoteRegion) {
        self.accept_advertising(tcp, Vec::new())
    }

    /// As [`accept`](Self::accept), the hostile client advertising
    /// `regions` of its own.
    fn accept_advertising(
        &self,
        tcp: TcpEndpoint,
        regions: Vec<RemoteRegion>,
    ) -> (Connection, TcpStream, RemoteRegion) {
        let (conn, s, theirs) = self.accept_hello(tcp, regions);
        let region = theirs.regions.first().copied().expect("the victim advertised its region");
        (conn, s, region)
    }

    /// As [`accept_advertising`](Self::accept_advertising), with the
    /// victim's whole hello.
    fn accept_hello(&self, tcp: TcpEndpoint, regions: Vec<RemoteRegion>) -> (Connection, TcpStream, Hello) {
        let listener = self.domain.listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let opts = self.opts();
        let server = thread::spawn(move || listener.accept_timeout(&opts, Duration::from_secs(10)));
        let (s, theirs) = hostile_client(addr, tcp, regions);
        let conn = server.join().unwrap().expect("the victim accepts");
        (conn, s, theirs)
    }

    fn unchanged(&self) -> bool {
        let mut now = vec![0u8; 4096];
        self.region.read_at(0, &mut now).unwrap();
        now == self.original
    }
}

/// Everything the victim sends until it closes or `limit` passes: the
/// frames (header fields op, seq, total), and whether the stream ended.
fn read_replies(s: &TcpStream, limit: Duration) -> (Vec<(u8, u32, u32)>, bool) {
    let deadline = Instant::now() + limit;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let ended = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break false;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match (&*s).read(&mut chunk) {
            Ok(0) => break true,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break false,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => break true, // reset: ended too
        }
    };
    let mut frames = Vec::new();
    let mut at = 0;
    while at + HEADER <= buf.len() {
        let h = &buf[at..at + HEADER];
        frames.push((h[0], u32_at(h, 4), u32_at(h, 28)));
        at += HEADER + u32_at(h, 24) as usize;
    }
    (frames, ended)
}

// ---- 1. a refused request stops the connection ----

#[test]
fn after_a_refused_request_the_target_carries_out_nothing_more_and_hangs_up() {
    let _serial = serial();
    let victim = Victim::new();
    let (conn, s, r) = victim.accept(endpoint(0, 128));
    let mut out = Vec::new();
    // A guessed key: refused.
    frame(WRITE, FIRST | LAST, 1, r.rkey ^ 0x5a5a_5a5a, r.addr, 16, 16, &mut out);
    out.extend_from_slice(&[0xee; 16]);
    // Then a write into the advertised region, which must not land...
    frame(WRITE, FIRST | LAST, 2, r.rkey, r.addr, 64, 64, &mut out);
    out.extend_from_slice(&[0xee; 64]);
    // ...a read of it, which must not be served...
    frame(READ_REQ, FIRST | LAST, 3, r.rkey, r.addr, 0, 64, &mut out);
    // ...and a thousand more key guesses, none of which may be answered.
    for i in 0..1000u32 {
        frame(WRITE, FIRST | LAST, 4 + i, r.rkey.wrapping_add(i + 1), r.addr, 0, 0, &mut out);
    }
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = (&s).write_all(&out); // the victim may hang up before taking all of it
    let t0 = Instant::now();
    let (replies, ended) = read_replies(&s, Duration::from_secs(3));
    let took = t0.elapsed();
    let shown: Vec<_> = replies.iter().take(4).collect();
    println!("{} replies to the hostile stream, first {shown:?}; stream ended: {ended} after {took:?}", replies.len());

    assert_eq!(replies.len(), 1, "exactly one reply (the refusal), got {} starting {shown:?}", replies.len());
    let (op, seq, status) = replies[0];
    assert_eq!((op, seq), (ACK, 1), "the refusal answers the first request");
    assert_eq!(status, 10, "status IBV_WC_REM_ACCESS_ERR");
    assert!(!replies.iter().any(|&(op, ..)| op == READ_RESP), "a read was served after the refusal");
    assert!(ended, "the victim kept the connection open after the refusal ({took:?})");
    assert!(victim.unchanged(), "a write landed after the refusal");
    assert!(conn.broken().is_some(), "the victim's connection says it is broken");
    // Both transport threads are gone, though the connection is not dropped yet.
    let gone = within(Duration::from_secs(2), || transport_threads() == 0);
    assert!(gone.is_some(), "{} transport threads still run after the refusal", transport_threads());
    drop(conn);
}

#[test]
fn a_refused_read_also_stops_the_connection() {
    let _serial = serial();
    let victim = Victim::new();
    let (conn, s, r) = victim.accept(endpoint(0, 128));
    let mut out = Vec::new();
    // Out of bounds: refused.
    frame(READ_REQ, FIRST | LAST, 1, r.rkey, r.addr + 4000, 0, 200, &mut out);
    frame(WRITE, FIRST | LAST, 2, r.rkey, r.addr, 32, 32, &mut out);
    out.extend_from_slice(&[0x11; 32]);
    frame(READ_REQ, FIRST | LAST, 3, r.rkey, r.addr, 0, 64, &mut out);
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = (&s).write_all(&out);
    let (replies, ended) = read_replies(&s, Duration::from_secs(3));
    assert_eq!(replies, vec![(ACK, 1, 10)], "only the refusal");
    assert!(ended, "the victim hung up");
    assert!(victim.unchanged());
    assert!(conn.broken().is_some());
}

// ---- 2. a peer that dies while its message waits for a receive ----

/// Writes the frames of a message left waiting for a receive.
type Unmatched = fn(&RemoteRegion, &mut Vec<u8>);

/// The victim sees the peer's death within a second, and its transport
/// threads end, for each way of leaving a message unmatched.
#[test]
fn a_peer_that_dies_while_its_message_waits_for_a_receive_is_seen_promptly() {
    let _serial = serial();
    let victim = Victim::new();
    let cases: [(&str, Unmatched); 3] = [
        ("a send with no receive posted", |_, out| {
            frame(SEND, FIRST | LAST, 1, 0, 0, 16, 16, out);
            out.extend_from_slice(&[1; 16]);
        }),
        ("a truncated send with no receive posted", |_, out| {
            // Announces 2 MiB, sends part of its first 1 MiB segment.
            frame(SEND, FIRST, 1, 0, 0, 1 << 20, 2 << 20, out);
            out.extend_from_slice(&[2; 1000]);
        }),
        ("a write with immediate with no receive posted", |r, out| {
            frame(WRITE, FIRST | LAST | IMM, 1, r.rkey, r.addr, 8, 8, out);
            out.extend_from_slice(&[3; 8]);
        }),
    ];
    for (what, make) in cases {
        let before = transport_threads();
        // rnr_retry 7: the peer's message waits for a receive forever.
        let (conn, s, r) = victim.accept(endpoint(7, 128));
        let mut out = Vec::new();
        make(&r, &mut out);
        (&s).write_all(&out).unwrap();
        thread::sleep(Duration::from_millis(100));
        assert!(conn.broken().is_none(), "{what}: broken before the peer died");
        // The peer dies: its socket closes.
        drop(s);
        let seen = within(Duration::from_secs(1), || conn.broken().is_some());
        println!("{what}: the peer's death seen after {seen:?}: {:?}", conn.broken());
        assert!(seen.is_some(), "{what}: the peer's death was not seen within 1 s");
        let ended = within(Duration::from_secs(1), || transport_threads() <= before);
        assert!(ended.is_some(), "{what}: the connection's threads still run");
        drop(conn);
    }
}

/// Dropping the connection ends an "infinite" wait for a receive at once.
#[test]
fn dropping_the_connection_ends_an_infinite_wait_for_a_receive() {
    let _serial = serial();
    let victim = Victim::new();
    let before = transport_threads();
    let (conn, s, _) = victim.accept(endpoint(7, 128));
    let mut out = Vec::new();
    frame(SEND, FIRST | LAST, 1, 0, 0, 16, 16, &mut out);
    out.extend_from_slice(&[1; 16]);
    (&s).write_all(&out).unwrap();
    thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    drop(conn);
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(1), "dropping took {took:?}");
    // Joined by the drop; /proc may list an exited thread for an instant longer.
    let gone = within(Duration::from_secs(1), || transport_threads() <= before);
    assert!(gone.is_some(), "{} transport threads, {before} before", transport_threads());
    drop(s);
}

// ---- 3. unread acknowledgements ----

/// A peer sends 4 M zero-byte writes and never reads a reply. The victim's
/// resident memory stays within the documented per-connection bound
/// (within 2x), and another connection of the same domain keeps working
/// meanwhile.
#[test]
fn four_million_unread_acknowledgements_stay_within_the_per_connection_bound() {
    const REQUESTS: usize = 4 << 20;
    const PER_WRITE: usize = 1 << 15;
    let _serial = serial();
    let victim = Victim::new();
    // A legitimate pair on the same domain, used while the flood runs.
    let (good_server, good_client) = {
        let listener = victim.domain.listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let opts = victim.opts();
        let t = thread::spawn(move || listener.accept_timeout(&opts, Duration::from_secs(10)));
        let c = victim.domain.connect(addr, &common::opts()).unwrap();
        (t.join().unwrap().unwrap(), c)
    };
    let peer_depth = gpu_rdma::bootstrap::wire::MAX_TCP_QUEUE_DEPTH;
    let rss0 = resident_bytes();
    let (conn, s, r) = victim.accept(endpoint(0, peer_depth));
    let bound = conn.info().memory_bound.expect("a TCP connection states its memory bound");
    let mut out = Vec::with_capacity(PER_WRITE * HEADER);
    let mut seq = 1u32;
    let mut sent = 0usize;
    let mut peak = rss0;
    let mut good_ok = 0;
    s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let t0 = Instant::now();
    while sent < REQUESTS {
        out.clear();
        for _ in 0..PER_WRITE {
            frame(WRITE, FIRST | LAST, seq, r.rkey, r.addr, 0, 0, &mut out);
            seq = seq.wrapping_add(1).max(1);
        }
        if (&s).write_all(&out).is_err() {
            break; // the victim stopped reading or hung up
        }
        sent += PER_WRITE;
        peak = peak.max(resident_bytes());
        if sent % (PER_WRITE * 2) == 0 {
            // The victim's other connection works meanwhile.
            let remote = good_client.remote_region(1).unwrap();
            let mut b = victim.domain.alloc(4096).unwrap();
            b.copy_from_slice(&victim.original);
            let (done, _) = good_client.write(b, &remote.whole()).finish().expect("the other connection writes");
            assert_eq!(done.byte_len, 4096);
            good_ok += 1;
        }
    }
    let flood = t0.elapsed();
    thread::sleep(Duration::from_millis(200));
    peak = peak.max(resident_bytes());
    let grew = peak.saturating_sub(rss0);
    println!(
        "unread acknowledgements: {sent} zero-byte writes sent in {flood:?}; resident memory grew {} KiB \
         (bound {} KiB for a peer depth of {peer_depth}); victim broken: {:?}; other connection: {good_ok} writes",
        grew >> 10,
        bound >> 10,
        conn.broken()
    );
    assert!(grew <= 2 * bound, "resident memory grew {grew} bytes, the bound is {bound}");
    // The victim's other connection still works after the flood.
    let remote = good_client.remote_region(1).unwrap();
    let mut b = victim.domain.alloc(4096).unwrap();
    b.copy_from_slice(&victim.original);
    good_client.write(b, &remote.whole()).finish().expect("the other connection writes after the flood");
    assert!(good_server.broken().is_none() && good_client.broken().is_none());
    drop(s);
    drop(conn);
}

/// A peer that sends small writes without pause cannot hold a waiter past
/// its deadline, though a waiter that spins carries such frames out itself:
/// it looks at its deadline between turns of a few frames.
#[test]
fn a_flood_of_small_writes_does_not_hold_a_spinning_waiter_past_its_deadline() {
    let _serial = serial();
    let victim = Victim::new();
    let listener = victim.domain.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // The waiter spins for far longer than its deadline.
    let opts = victim.opts().spin(Duration::from_secs(30));
    let server = thread::spawn(move || listener.accept_timeout(&opts, Duration::from_secs(10)));
    let (s, theirs) = hostile_client(addr, endpoint(0, 128), Vec::new());
    let conn = server.join().unwrap().expect("the victim accepts");
    let target = theirs.regions.first().copied().expect("the victim advertised its region");
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = Arc::clone(&stop);
        let s = s.try_clone().unwrap();
        thread::spawn(move || {
            let mut out = Vec::new();
            for seq in 1..=4096u32 {
                // 8 bytes into the advertised region, not acknowledged.
                frame(WRITE, FIRST | LAST, seq, target.rkey, target.addr, 8, 8, &mut out);
                out.extend_from_slice(&[0x5a; 8]);
            }
            s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
            // Once the waiter spins.
            thread::sleep(Duration::from_millis(20));
            let mut frames = 0u64;
            // At most 5 s: a waiter held by the flood shows as a slow wait.
            let t0 = Instant::now();
            while !stop.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(5) && (&s).write_all(&out).is_ok()
            {
                frames += 4096;
            }
            frames
        })
    };
    // A receive the peer never fills, waited for with a deadline.
    let mut rx = conn.recv(victim.domain.alloc(64).unwrap());
    let t0 = Instant::now();
    let r = rx.wait_timeout(Duration::from_millis(200));
    let took = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    let frames = flood.join().unwrap();
    println!("a wait of 200 ms under a flood of {frames} small writes returned after {took:?}: {r:?}");
    assert!(r.is_err(), "the receive completed: {r:?}");
    assert!(took < Duration::from_secs(2), "the wait took {took:?}");
    assert!(frames > 0, "the flood never started");
    drop(rx);
    drop(s);
    drop(conn);
}

// ---- 4. handshakes run concurrently ----

/// 64 stalled handshakes (32 silent after connecting, 32 that sent half a
/// frame header) do not keep a legitimate client out: it connects and
/// transfers within a second. After the stalled peers leave, descriptors,
/// threads and domain resources return to their baseline.
fn stalled_handshakes_do_not_delay_a_legitimate_client(secret: Option<&str>) {
    let victim = Victim::new();
    let mut opts = victim.opts().handshake_timeout(Duration::from_secs(10));
    let mut client_opts = common::opts().handshake_timeout(Duration::from_secs(5));
    if let Some(s) = secret {
        opts = opts.secret(Secret::new(s).unwrap());
        client_opts = client_opts.secret(Secret::new(s).unwrap());
    }
    let (fds0, threads0, stats0, rss0) = (open_fds(), thread_count(), victim.domain.stats(), resident_bytes());
    let listener = victim.domain.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            let mut accepted = Vec::new();
            let mut failed = 0;
            while !stop.load(Ordering::SeqCst) {
                match listener.accept_timeout(&opts, Duration::from_millis(100)) {
                    Ok(c) => accepted.push(c),
                    Err(e) if e.is_timeout() => {}
                    Err(_) => failed += 1,
                }
            }
            (accepted, failed)
        })
    };
    let stalled: Vec<TcpStream> = (0..64)
        .map(|i| {
            let s = TcpStream::connect(addr).unwrap();
            if i % 2 == 1 {
                // Half a frame header, then nothing.
                (&s).write_all(&bootstrap::MAGIC.to_be_bytes()).unwrap();
                (&s).write_all(&bootstrap::VERSION.to_be_bytes()).unwrap();
            }
            s
        })
        .collect();
    thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    let conn = victim.domain.connect(addr, &client_opts).expect("the legitimate client connects");
    let remote = conn.remote_region(1).unwrap();
    let data = common::pattern(4096, 99);
    let mut b = victim.domain.alloc(4096).unwrap();
    b.copy_from_slice(&data);
    conn.write(b, &remote.whole()).finish().expect("the legitimate client writes");
    let took = t0.elapsed();
    let mut now = vec![0u8; 4096];
    victim.region.read_at(0, &mut now).unwrap();
    println!("with 64 stalled handshakes (secret: {}): connected and wrote 4 KiB in {took:?}", secret.is_some());
    assert!(now == data, "the write landed");
    assert!(took < Duration::from_secs(1), "the legitimate client took {took:?}");
    drop(conn);
    drop(stalled);
    // The stalled handshakes end as their peers leave; then everything is back.
    thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    let (accepted, failed) = server.join().unwrap();
    assert_eq!(accepted.len(), 1, "one connection accepted");
    assert_eq!(failed, 64, "each stalled handshake ends as an error of accept");
    drop(accepted);
    let back = within(Duration::from_secs(5), || {
        open_fds() <= fds0 && thread_count() <= threads0 && victim.domain.stats() == stats0
    });
    let rss = resident_bytes();
    println!(
        "after: fds {} (baseline {fds0}), threads {} ({threads0}), stats {:?}, resident +{} KiB",
        open_fds(),
        thread_count(),
        victim.domain.stats(),
        rss.saturating_sub(rss0) >> 10
    );
    assert!(back.is_some(), "descriptors, threads or domain resources did not return to their baseline");
    assert!(rss.saturating_sub(rss0) < 16 << 20, "resident memory grew {} KiB", rss.saturating_sub(rss0) >> 10);
}

/// This crate's threads (the test harness's own come and go).
fn thread_count() -> usize {
    threads_named("gpu-rdma")
}

#[test]
fn stalled_handshakes_do_not_delay_a_legitimate_client_without_a_secret() {
    let _serial = serial();
    stalled_handshakes_do_not_delay_a_legitimate_client(None);
}

#[test]
fn stalled_handshakes_do_not_delay_a_legitimate_client_with_a_secret() {
    let _serial = serial();
    stalled_handshakes_do_not_delay_a_legitimate_client(Some("the same secret on both sides"));
}

// ---- 5. keys ----

/// On a TCP-only domain, no key predicts another: consecutive keys are not
/// a fixed step apart, and the bits are balanced.
#[test]
fn tcp_region_keys_are_not_predictable_from_each_other() {
    let _serial = serial();
    let d = tcp_domain();
    let mut keys = Vec::new();
    let mut live = Vec::new();
    for _ in 0..2000 {
        let e = d.expose(d.alloc(64).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
        keys.push(e.rkey());
        live.push(e);
    }
    let mut steps: Vec<u32> = keys.windows(2).map(|w| w[1].wrapping_sub(w[0])).collect();
    steps.sort_unstable();
    steps.dedup();
    assert!(steps.len() > 1900, "only {} distinct steps between 2000 consecutive keys", steps.len());
    for bit in 0..32 {
        let set = keys.iter().filter(|k| *k >> bit & 1 == 1).count();
        assert!((800..=1200).contains(&set), "bit {bit} is set in {set} of 2000 keys");
    }
    let mut unique = keys.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), keys.len(), "keys repeat");
    assert!(!keys.contains(&0));
}

// ---- 6. acknowledgements asked for ----

/// The next `n` frames the victim sends: (op, flags, seq, payload).
fn next_frames(s: &TcpStream, n: usize) -> Vec<(u8, u8, u32, Vec<u8>)> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    (0..n)
        .map(|_| {
            let mut h = [0u8; HEADER];
            (&*s).read_exact(&mut h).expect("a frame from the victim");
            let mut payload = vec![0u8; u32_at(&h, 24) as usize];
            (&*s).read_exact(&mut payload).expect("the frame's payload");
            (h[0], h[1], u32_at(&h, 4), payload)
        })
        .collect()
}

/// A peer that acknowledges nothing: untracked inline sends reach it
/// without asking for an acknowledgement and leave nothing in flight; a
/// tracked send asks for one, stays in flight without it, and completes
/// when it comes.
#[test]
fn an_untracked_inline_send_is_done_without_an_acknowledgement_and_a_tracked_one_waits_for_it() {
    let _serial = serial();
    let victim = Victim::new();
    let (conn, s, _) = victim.accept(endpoint(0, 128));
    for i in 0..8u8 {
        conn.send_inline_untracked(&[i; 16], Some(u32::from(i))).unwrap();
    }
    for (i, (op, flags, _, payload)) in next_frames(&s, 8).into_iter().enumerate() {
        assert_eq!((op, flags & !IMM), (SEND, FIRST | LAST), "frame {i}: one whole message, no acknowledgement asked");
        assert_eq!(payload, vec![i as u8; 16], "frame {i}");
    }
    let drained = within(Duration::from_secs(5), || conn.stats().in_flight == 0);
    assert!(drained.is_some(), "untracked sends stay in flight without acknowledgements: {:?}", conn.stats());

    let mut tracked = conn.send_inline(b"tracked", None);
    let (op, flags, seq, payload) = next_frames(&s, 1).remove(0);
    assert_eq!((op, flags), (SEND, FIRST | LAST | WANTS_ACK), "a tracked send asks for an acknowledgement");
    assert_eq!(payload, b"tracked");
    assert!(tracked.wait_timeout(Duration::from_millis(200)).is_err(), "completed without its acknowledgement");
    assert_eq!(conn.stats().in_flight, 1, "the tracked send waits for its acknowledgement");
    let mut ack = Vec::new();
    frame(ACK, 0, seq, 0, 0, 0, 0, &mut ack);
    (&s).write_all(&ack).unwrap();
    tracked.wait_timeout(Duration::from_secs(10)).expect("acknowledged");
    assert_eq!(conn.stats().in_flight, 0);
    drop(s);
    drop(conn);
}

// ---- 7. lengths that do not add up ----

/// The hostile peer writes `out`; `op` must fail (not complete with bytes
/// that never arrived) and the connection break with a reason naming `named`.
fn fails_and_breaks<B: Send + 'static>(
    what: &str,
    conn: &Connection,
    s: &TcpStream,
    op: &mut gpu_rdma::Pending<B>,
    out: &[u8],
    named: &str,
) {
    (&*s).write_all(out).unwrap();
    let got = op.wait_timeout(Duration::from_secs(10));
    assert!(got.is_err(), "{what}: completed as if whole: {got:?}");
    let why = within(Duration::from_secs(5), || conn.broken().is_some()).and_then(|_| conn.broken());
    assert!(why.as_deref().is_some_and(|w| w.contains(named)), "{what}: {why:?}");
}

/// A peer whose message, write or read response ends before the length it
/// announced, or that acknowledges a read instead of answering it: the
/// operation it lands in fails (it would otherwise report
/// bytes that never arrived, or leave part of a read's buffer as it was),
/// and the connection breaks, naming why. A small frame may be carried
/// out by a waiter that spins, a large one (over 1 KiB) always by the
/// receiver thread: both sizes are tried.
#[test]
fn a_message_write_or_read_response_shorter_than_announced_fails_and_breaks_the_connection() {
    let _serial = serial();
    let victim = Victim::new();
    for payload in [16u32, 4000] {
        // A send announcing twice what its only segment carries.
        let (conn, s, _) = victim.accept(endpoint(0, 128));
        let mut rx = conn.recv(victim.domain.alloc(16384).unwrap());
        let mut out = Vec::new();
        frame(SEND, FIRST | LAST | WANTS_ACK, 1, 0, 0, payload, 2 * payload, &mut out);
        out.extend(std::iter::repeat_n(5u8, payload as usize));
        fails_and_breaks(&format!("a send of {payload}"), &conn, &s, &mut rx, &out, "announced");
        drop((conn, s));

        // A write with immediate announcing more than it carries.
        let (conn, s, r) = victim.accept(endpoint(0, 128));
        let mut rx = conn.recv_imm();
        let mut out = Vec::new();
        frame(WRITE, FIRST | LAST | IMM | WANTS_ACK, 1, r.rkey, r.addr, payload, payload + 32, &mut out);
        out.extend(std::iter::repeat_n(6u8, payload as usize));
        fails_and_breaks(&format!("a write of {payload}"), &conn, &s, &mut rx, &out, "announced");
        drop((conn, s));
    }
    // A read answered with half of what it asked, or acknowledged as if
    // answered (an acknowledgement carries a read's refusal, never its data).
    for (want, acknowledged) in [(64u64, false), (8192, false), (64, true)] {
        let theirs = RemoteRegion { tag: 9, addr: 0x1000, len: 1 << 20, rkey: 77, access: Access::REMOTE_READ };
        let (conn, s, _) = victim.accept_advertising(endpoint(0, 128), vec![theirs]);
        let remote = conn.remote_region(9).expect("advertised");
        let mut local = victim.domain.alloc(want as usize).unwrap();
        local.copy_from_slice(&vec![0xee; want as usize]);
        let mut read = conn.read(local, &remote.slice(0..want).unwrap());
        let (op, _, seq, _) = next_frames(&s, 1).remove(0);
        assert_eq!(op, READ_REQ);
        let half = (want / 2) as u32;
        let mut out = Vec::new();
        if acknowledged {
            frame(ACK, 0, seq, 0, 0, 0, 0, &mut out);
        } else {
            frame(READ_RESP, FIRST | LAST, seq, 0, 0, half, 0, &mut out);
            out.extend(std::iter::repeat_n(7u8, half as usize));
        }
        let named = if acknowledged { "without sending its data".to_owned() } else { format!("for a read of {want}") };
        fails_and_breaks(
            &format!("a read of {want} (acknowledged: {acknowledged})"),
            &conn,
            &s,
            &mut read,
            &out,
            &named,
        );
    }
}

// ---- 8. replies that lie ----

/// Waits for the victim's connection to break; its reason.
fn broken_within(conn: &Connection, limit: Duration) -> Option<String> {
    within(limit, || conn.broken().is_some()).and_then(|_| conn.broken())
}

/// A peer that reads only the first frame header of a 32 MiB write or send
/// and acknowledges it at once: the operation must not complete (its
/// buffer would come back while the transport still reads it to send the
/// rest); the connection breaks, naming the early reply.
#[test]
fn an_acknowledgement_before_the_request_reached_the_peer_whole_breaks_and_never_completes_it() {
    let _serial = serial();
    let victim = Victim::new();
    const BIG: u64 = 32 << 20;
    for send in [false, true] {
        let theirs = RemoteRegion { tag: 9, addr: 0x1000, len: BIG, rkey: 77, access: Access::REMOTE_WRITE };
        let (conn, s, _) = victim.accept_advertising(endpoint(0, 128), vec![theirs]);
        let remote = conn.remote_region(9).expect("advertised");
        let mut local = victim.domain.alloc(BIG as usize).unwrap();
        local.as_mut_slice().fill(0x5a);
        let mut op = if send { conn.send(local) } else { conn.write(local, &remote.slice(0..BIG).unwrap()) };
        let mut h = [0u8; HEADER];
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        (&s).read_exact(&mut h).expect("the first frame's header");
        assert_eq!(h[0], if send { SEND } else { WRITE });
        (&s).write_all(&ack_frame(u32_at(&h, 4), 0)).unwrap();
        let got = op.wait_timeout(Duration::from_secs(10));
        let why = broken_within(&conn, Duration::from_secs(5));
        println!("send {send}: {got:?}; broken: {why:?}");
        assert!(got.is_err(), "send {send}: completed on an acknowledgement of bytes never sent");
        assert!(
            why.as_deref().is_some_and(|w| w.contains("before the request reached it whole")),
            "send {send}: {why:?}"
        );
        // The buffer comes back, once the transport let go of it.
        assert_eq!(op.into_buffer().map(|b| b.len()).ok(), Some(BIG as usize));
        drop((conn, s));
    }
}

/// Acknowledgements for nothing, twice, out of order, a refusal of a
/// request never sent, a read answered out of order: each breaks the
/// connection (naming why) and completes nothing wrongly.
#[test]
fn duplicate_unknown_and_out_of_order_replies_break_the_connection() {
    let _serial = serial();
    let victim = Victim::new();

    // An acknowledgement when nothing was sent.
    let (conn, s, _) = victim.accept(endpoint(0, 128));
    (&s).write_all(&ack_frame(4242, 0)).unwrap();
    let why = broken_within(&conn, Duration::from_secs(5));
    assert!(why.as_deref().is_some_and(|w| w.contains("no reply is due")), "unknown: {why:?}");
    drop((conn, s));

    // The same acknowledgement twice.
    let (conn, s, _) = victim.accept(endpoint(0, 128));
    let mut first = conn.send_inline(b"once", None);
    let (_, _, seq, _) = next_frames(&s, 1).remove(0);
    (&s).write_all(&ack_frame(seq, 0)).unwrap();
    first.wait_timeout(Duration::from_secs(10)).expect("acknowledged once");
    assert!(conn.broken().is_none());
    (&s).write_all(&ack_frame(seq, 0)).unwrap();
    let why = broken_within(&conn, Duration::from_secs(5));
    assert!(why.as_deref().is_some_and(|w| w.contains("a duplicate")), "twice: {why:?}");
    drop((conn, s));

    // The second request acknowledged before the first.
    let (conn, s, _) = victim.accept(endpoint(0, 128));
    let mut one = conn.send_inline(b"one", None);
    let mut two = conn.send_inline(b"two", None);
    let frames = next_frames(&s, 2);
    (&s).write_all(&ack_frame(frames[1].2, 0)).unwrap();
    let why = broken_within(&conn, Duration::from_secs(5));
    assert!(why.as_deref().is_some_and(|w| w.contains("out of order")), "out of order: {why:?}");
    assert!(two.wait_timeout(Duration::from_secs(5)).is_err(), "the second completed out of order");
    assert!(one.wait_timeout(Duration::from_secs(5)).is_err(), "the first completed without its reply");
    drop((conn, s));

    // A refusal of a request never sent.
    let (conn, s, _) = victim.accept(endpoint(0, 128));
    (&s).write_all(&ack_frame(17, 10)).unwrap();
    let why = broken_within(&conn, Duration::from_secs(5));
    assert!(why.as_deref().is_some_and(|w| w.contains("never sent")), "refused unsent: {why:?}");
    drop((conn, s));

    // A read answered before the send posted ahead of it.
    let theirs = RemoteRegion { tag: 9, addr: 0x1000, len: 1 << 20, rkey: 77, access: Access::REMOTE_READ };
    let (conn, s, _) = victim.accept_advertising(endpoint(0, 128), vec![theirs]);
    let remote = conn.remote_region(9).expect("advertised");
    let mut sent = conn.send_inline(b"first", None);
    let mut read = conn.read(victim.domain.alloc(64).unwrap(), &remote.slice(0..64).unwrap());
    let frames = next_frames(&s, 2);
    assert_eq!(frames[1].0, READ_REQ);
    let mut out = Vec::new();
    frame(READ_RESP, FIRST | LAST, frames[1].2, 0, 0, 64, 0, &mut out);
    out.extend_from_slice(&[0x77; 64]);
    (&s).write_all(&out).unwrap();
    let why = broken_within(&conn, Duration::from_secs(5));
    assert!(why.as_deref().is_some_and(|w| w.contains("out of order")), "read first: {why:?}");
    assert!(read.wait_timeout(Duration::from_secs(5)).is_err(), "the read completed out of order");
    assert!(sent.wait_timeout(Duration::from_secs(5)).is_err());
    drop((conn, s));
}

// ---- 9. an inbox's bound is in bytes ----

/// Writes `n` notifications (`note(i, msg)` fills the i-th and returns its
/// tag) into the victim's notification `ring`, as the crate's ring format
/// says (`protocol/mailbox.rs`: records of `seq u64, len u32, tag u32,
/// message, seq u64`, 64-byte aligned, a pad record before a wrap), a MiB
/// of frames at a time, on a thread. It keeps within the credits the
/// victim writes back (read off the socket, and acknowledged, by a second
/// thread). The socket comes back when all went.
fn feed_notes(
    s: TcpStream,
    ring: RemoteRegion,
    n: u32,
    mut note: impl FnMut(u32, &mut Vec<u8>) -> u32 + Send + 'static,
) -> thread::JoinHandle<TcpStream> {
    let credits = Arc::new(AtomicU64::new(0));
    // Credits go back and forth in small frames: no Nagle delay.
    s.set_nodelay(true).unwrap();
    let sock = Arc::new(Mutex::new(s.try_clone().unwrap()));
    {
        let (credits, sock, r) = (Arc::clone(&credits), Arc::clone(&sock), s.try_clone().unwrap());
        // Ends when the victim hangs up.
        thread::spawn(move || {
            loop {
                let mut h = [0u8; HEADER];
                if (&r).read_exact(&mut h).is_err() {
                    return;
                }
                let mut payload = vec![0u8; u32_at(&h, 24) as usize];
                if (&r).read_exact(&mut payload).is_err() {
                    return;
                }
                if h[0] == WRITE && u32_at(&h, 8) == FAKE_RING_KEY && payload.len() == 8 {
                    credits.fetch_max(u64::from_le_bytes(payload[..8].try_into().unwrap()), Ordering::AcqRel);
                }
                if h[1] & WANTS_ACK != 0 {
                    let ack = ack_frame(u32_at(&h, 4), 0);
                    if sock.lock().unwrap().write_all(&ack).is_err() {
                        return;
                    }
                }
            }
        });
    }
    thread::spawn(move || {
        let cap = ring.len - 64;
        let (mut head, mut rseq, mut fseq) = (0u64, 1u64, 1u32);
        let (mut out, mut msg) = (Vec::with_capacity(1 << 20), Vec::new());
        let mut put = |out: &mut Vec<u8>, at: u64, bytes: &[u8]| {
            ring_write(&ring, fseq, at, bytes, out);
            fseq += 1;
        };
        let flush = |out: &mut Vec<u8>| {
            sock.lock().unwrap().write_all(out).expect("the victim reads on");
            out.clear();
        };
        for i in 0..n {
            let tag = note(i, &mut msg);
            let size = (16 + msg.len() as u64 + 8).div_ceil(64) * 64;
            let off = head % cap;
            let pad = cap - off < size;
            let need = if pad { cap - off + size } else { size };
            while head + need - credits.load(Ordering::Acquire) > cap {
                if !out.is_empty() {
                    flush(&mut out);
                }
                thread::sleep(Duration::from_micros(50));
            }
            let mut at = off;
            if pad {
                let mut p = rseq.to_le_bytes().to_vec();
                p.extend_from_slice(&u32::MAX.to_le_bytes());
                p.extend_from_slice(&[0; 4]);
                put(&mut out, at, &p);
                rseq += 1;
                at = 0;
            }
            let rec = ring_record(rseq, tag, &msg);
            put(&mut out, at, &rec);
            rseq += 1;
            head += need;
            if out.len() >= 1 << 20 || i + 1 == n {
                flush(&mut out);
            }
        }
        s
    })
}

/// The worst payload for an inbox: 70,000 failure notes of 4 KiB of bytes
/// that are not UTF-8 (each would grow to 12 KiB as text), every one under
/// a tag of its own, that nobody takes. The inbox holds at most
/// `MAX_QUEUED_BYTES` of them, and this process grows by no more than that
/// (and the transport's own bound); a reason taken is the text of what
/// arrived.
#[test]
fn an_inbox_holds_at_most_its_byte_bound_whatever_notes_arrive() {
    let _serial = serial();
    let victim = Victim::new();
    let (conn, s, theirs) = victim.accept_hello(endpoint(7, 128), Vec::new());
    let mut inbox = conn.inbox(64).unwrap();
    const NOTES: u32 = 70_000;
    let base = resident_bytes();
    let payload = vec![0xffu8; gpu_rdma::MAX_NOTIFY_PAYLOAD];
    let feeder = feed_notes(s, ring_of(&theirs), NOTES, move |i, msg| {
        note_msg(true, &payload, msg);
        1_000_000 + i
    });
    let t0 = Instant::now();
    let mut peak = 0u64;
    loop {
        inbox.poll().unwrap();
        let st = inbox.stats();
        peak = peak.max(resident_bytes().saturating_sub(base));
        if st.received + st.overflowed >= u64::from(NOTES) || t0.elapsed() > Duration::from_secs(60) {
            break;
        }
    }
    let s = feeder.join().unwrap();
    let st = inbox.stats();
    println!(
        "{NOTES} notes: {st:?}; resident +{} MiB at most (bound {} MiB)",
        peak >> 20,
        gpu_rdma::MAX_QUEUED_BYTES >> 20
    );
    assert_eq!(st.received + st.overflowed, u64::from(NOTES), "every note was seen: {st:?}");
    assert!(st.overflowed > 0, "the bound was never reached: {st:?}");
    assert!(st.queued_bytes <= gpu_rdma::MAX_QUEUED_BYTES, "{st:?}");
    let cost = gpu_rdma::NOTE_OVERHEAD + gpu_rdma::MAX_NOTIFY_PAYLOAD;
    assert_eq!(st.queued, gpu_rdma::MAX_QUEUED_BYTES / cost, "{st:?}");
    // What the process holds for them, with the slots, the transport's
    // bound and the allocator's slack (16 MiB) on top.
    let allowed = (gpu_rdma::MAX_QUEUED_BYTES + (16 << 20)) as u64 + conn.info().memory_bound.unwrap_or(0);
    assert!(peak <= allowed, "grew by {} MiB, allowed {} MiB", peak >> 20, allowed >> 20);
    // A reason comes out as the text of the bytes that arrived.
    match inbox.try_take(1_000_000, 1) {
        Err(gpu_rdma::Error::PeerTransferFailed { tag, reason }) => {
            assert_eq!(tag, 1_000_000);
            assert_eq!(reason.chars().count(), gpu_rdma::MAX_NOTIFY_PAYLOAD);
            assert!(reason.chars().all(|c| c == char::REPLACEMENT_CHARACTER));
        }
        other => panic!("not the failure: {other:?}"),
    }
    assert_eq!(inbox.stats().queued, st.queued - 1);
    assert_eq!(inbox.stats().queued_bytes, st.queued_bytes - cost);
    drop((inbox, conn, s));
}

/// The other worst case: empty notes, each under a tag of its own, cost
/// the inbox only their overhead; what the process grows by stays within
/// what the inbox charges them (`NOTE_OVERHEAD` each).
#[test]
fn an_inbox_charges_each_note_at_least_what_it_costs() {
    let _serial = serial();
    let victim = Victim::new();
    let (conn, s, theirs) = victim.accept_hello(endpoint(7, 128), Vec::new());
    let mut inbox = conn.inbox(64).unwrap();
    const NOTES: u32 = 60_000;
    let base = resident_bytes();
    let feeder = feed_notes(s, ring_of(&theirs), NOTES, |i, msg| {
        note_msg(false, b"", msg);
        i
    });
    let t0 = Instant::now();
    while inbox.stats().received < u64::from(NOTES) && t0.elapsed() < Duration::from_secs(60) {
        inbox.poll().unwrap();
    }
    let grew = resident_bytes().saturating_sub(base);
    let s = feeder.join().unwrap();
    let st = inbox.stats();
    println!("{NOTES} empty notes: {st:?}; resident +{} bytes a note", grew / u64::from(NOTES));
    assert_eq!(st.queued, NOTES as usize);
    assert_eq!(st.queued_bytes, NOTES as usize * gpu_rdma::NOTE_OVERHEAD);
    let slack = 4 << 20;
    assert!(grew <= st.queued_bytes as u64 + slack, "grew by {grew} bytes, charged {}", st.queued_bytes);
    drop((inbox, conn, s));
}

/// A record in the ring that is not a notification is dropped and counted,
/// and the next one still arrives; a record that breaks the ring's format
/// (a length past the largest notification) breaks the connection, naming
/// the ring, and the inbox's wait fails at once rather than at its
/// timeout.
#[test]
fn a_bad_notification_is_counted_and_a_record_that_breaks_the_ring_breaks_the_connection() {
    let _serial = serial();
    let victim = Victim::new();
    let (conn, s, theirs) = victim.accept_hello(endpoint(7, 128), Vec::new());
    let ring = ring_of(&theirs);
    let mut inbox = conn.inbox(1).unwrap();
    let feeder = feed_notes(s, ring, 2, |i, msg| {
        if i == 0 {
            msg.clear();
            msg.extend_from_slice(b"not a notification");
        } else {
            note_msg(false, b"after", msg);
        }
        5
    });
    let s = feeder.join().unwrap();
    let notes = inbox.wait_timeout(5, 1, Duration::from_secs(10)).unwrap();
    assert_eq!(&notes[0].payload[..], b"after");
    assert_eq!(inbox.stats().malformed, 1);
    // Record 3, after two of 64 bytes each, claims a length past the
    // largest notification.
    let mut rec = 3u64.to_le_bytes().to_vec();
    rec.extend_from_slice(&(1u32 << 20).to_le_bytes());
    rec.extend_from_slice(&5u32.to_le_bytes());
    let mut out = Vec::new();
    frame(WRITE, FIRST | LAST, 3, ring.rkey, ring.addr + 64 + 128, 16, 16, &mut out);
    out.extend_from_slice(&rec);
    (&s).write_all(&out).unwrap();
    let t0 = Instant::now();
    match inbox.wait_timeout(5, 1, Duration::from_secs(10)) {
        Err(gpu_rdma::Error::ConnectionLost { reason }) => assert!(reason.contains("notification ring"), "{reason}"),
        other => panic!("expected the connection lost: {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(2), "at once, not at the timeout");
    assert!(conn.broken().is_some_and(|r| r.contains("notification ring")), "{:?}", conn.broken());
    drop((inbox, conn, s));
}

// ---- 10. limits a peer announces ----

/// What the victim's `listener` makes of a client whose hello announces
/// `tcp` and exactly `regions` (no ring added), the client reading no
/// reply.
fn accept_hello(
    victim: &Victim,
    listener: &gpu_rdma::Listener,
    tcp: TcpEndpoint,
    regions: Vec<RemoteRegion>,
) -> gpu_rdma::Result<Connection> {
    let addr = listener.local_addr().unwrap();
    let opts = victim.opts();
    thread::scope(|sc| {
        let server = sc.spawn(move || listener.accept_timeout(&opts, Duration::from_secs(10)));
        let s = TcpStream::connect(addr).unwrap();
        let deadline = Deadline::after(Duration::from_secs(10), "the victim");
        let mine = Hello { caps: CAP_TCP, verbs: None, tcp: Some(tcp), regions, name: vec![] };
        let _ = bootstrap::exchange_hello(&s, &mine, deadline, 1 << 20);
        server.join().unwrap()
    })
}

/// A peer announcing limits too small to work with (a largest message of
/// one byte would split an 8 MiB list into eight million requests) or past
/// what this side holds for it is refused at the handshake, naming the
/// field; the listener goes on serving.
#[test]
fn announced_limits_outside_what_this_side_accepts_are_refused_at_the_handshake() {
    let _serial = serial();
    let victim = Victim::new();
    let listener = victim.domain.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let bad = [
        ("TCP max_message", TcpEndpoint { max_message: 1, ..endpoint(0, 128) }),
        ("TCP max_message", TcpEndpoint { max_message: 65_535, ..endpoint(0, 128) }),
        ("TCP send_depth", TcpEndpoint { send_depth: 0, ..endpoint(0, 128) }),
        ("TCP send_depth", TcpEndpoint { send_depth: u32::MAX, ..endpoint(0, 128) }),
        ("TCP rnr_retry", TcpEndpoint { rnr_retry: 8, ..endpoint(0, 128) }),
    ];
    for (field, tcp) in bad {
        let accepted = accept_hello(&victim, &listener, tcp, vec![]);
        match accepted {
            Err(gpu_rdma::Error::Bootstrap(e @ gpu_rdma::BootstrapError::OutOfRange { field: f, .. })) => {
                assert_eq!(f, field);
                println!("refused: {e}");
            }
            other => panic!("{field}: accepted or refused otherwise: {other:?}"),
        }
    }
    // At the floor, it works.
    let tcp = TcpEndpoint { max_message: gpu_rdma::bootstrap::MIN_MAX_MESSAGE, ..endpoint(0, 128) };
    let opts = victim.opts();
    let server = thread::spawn(move || listener.accept_timeout(&opts, Duration::from_secs(10)));
    let (_s, _) = hostile_client(addr, tcp, vec![]);
    let conn = server.join().unwrap().expect("accepted at the floor");
    assert_eq!(conn.info().max_message_size, u64::from(gpu_rdma::bootstrap::MIN_MAX_MESSAGE));
}

/// A notification ring this side cannot use (none, two, too small to hold
/// two of the largest notifications, past `MAX_RING`, not a multiple of
/// 64, not writable) is refused at the handshake, saying why.
#[test]
fn a_notification_ring_this_side_cannot_use_is_refused_at_the_handshake() {
    let _serial = serial();
    let victim = Victim::new();
    let listener = victim.domain.listen("127.0.0.1:0").unwrap();
    let ring = fake_ring();
    let with_len = |len: usize| RemoteRegion { len: len as u64, ..ring };
    let cases = [
        (vec![], "0 notification rings"),
        (vec![ring, ring], "2 notification rings"),
        (vec![with_len(64 + gpu_rdma::MIN_RING - 64)], "notification ring length"),
        (vec![with_len(64 + gpu_rdma::MAX_RING + 64)], "notification ring length"),
        (vec![with_len(64 + gpu_rdma::MIN_RING + 8)], "notification ring length"),
        (vec![RemoteRegion { access: Access::REMOTE_READ, ..ring }], "not writable"),
    ];
    for (regions, why) in cases {
        let accepted = accept_hello(&victim, &listener, endpoint(0, 128), regions);
        match accepted {
            Err(e) => assert!(e.to_string().contains(why), "{why}: {e}"),
            Ok(_) => panic!("{why}: accepted"),
        }
    }
}
