//! Rails: transfers striped over several NICs and queue pairs, verified,
//! with per-rail counters, and a rail failing mid-transfer.
//!
//! On the host the rails are TCP domains, and a rail fails when a proxy in
//! front of it cuts its connections. In the soft-RoCE guest they are `rxe0`
//! and `rxe1` on two dummy netdevs (`GPU_RDMA_TEST_RAILS`), and a rail
//! fails when its netdev is set down.

#[macro_use]
mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::{first_difference, opts, pattern};
use gpu_rdma::Failure;
use gpu_rdma::rails::{RailStats, Rails};
use gpu_rdma::{
    Access, ConnectOptions, Domain, DomainConfig, Error, HostMemory, RailConnection, RailOptions, TransportPolicy,
};

const MIB: u64 = 1 << 20;

fn tcp_rails(n: usize) -> Rails {
    let d = || Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).expect("a TCP domain");
    Rails::from_domains((0..n).map(|_| d()).collect()).unwrap()
}

/// The guest's rails, by name (`GPU_RDMA_TEST_RAILS`, default `rxe0,rxe1`).
fn verbs_rails() -> Rails {
    let names = std::env::var("GPU_RDMA_TEST_RAILS").unwrap_or_else(|_| "rxe0,rxe1".into());
    let names: Vec<&str> = names.split(',').collect();
    Rails::open_devices(&names).expect("open the test rails")
}

fn rail_opts(op_timeout: Duration) -> RailOptions {
    RailOptions::default().queue_pairs(2).stripe(MIB).connect(opts().op_timeout(op_timeout))
}

/// (server, client) connected over `server`'s rails, the client's going to
/// `addrs` when given (a proxy), else straight to the listener.
fn connect(
    server: &Rails,
    client: &Rails,
    ropts: &RailOptions,
    through: impl FnOnce(Vec<SocketAddr>) -> Vec<SocketAddr>,
) -> (RailConnection, RailConnection) {
    let listener = server.listen("127.0.0.1:0").unwrap();
    let addrs = through(listener.addrs().unwrap());
    let o = ropts.clone();
    let t = thread::spawn(move || listener.accept(&o));
    let c = client.connect(&addrs, ropts).expect("connect the rails");
    let s = t.join().unwrap().expect("accept the rails");
    (s, c)
}

fn near_half(stats: &[RailStats], total: u64) {
    assert_eq!(stats.iter().map(|s| s.bytes).sum::<u64>(), total, "{stats:?}");
    for s in stats {
        let share = s.bytes as f64 / total as f64;
        assert!(
            (0.45..=0.55).contains(&share),
            "rail {} moved {:.1}% of the bytes: {stats:?}",
            s.device,
            share * 100.0
        );
    }
}

/// A striped write and a striped read of `len` bytes over two rails, both
/// verified byte for byte; each rail moved about half.
fn striped_write_and_read(server: Rails, client: Rails, len: u64) {
    let ropts = rail_opts(Duration::from_secs(60));
    let (s, c) = connect(&server, &client, &ropts, |a| a);
    let theirs = server.alloc(len as usize, 7).unwrap();
    let d = s.grant(&theirs).unwrap();
    let mine = client.alloc(len as usize, 8).unwrap();
    let data = pattern(len as usize, 42);
    mine.write_at(0, &data).unwrap();

    let t0 = std::time::Instant::now();
    let moved = c.write(&mine, 0, &d, 0, len).wait().unwrap();
    let secs = t0.elapsed().as_secs_f64();
    println!("striped write: {} MiB in {secs:.2} s ({:.2} GB/s)", len / MIB, len as f64 / secs / 1e9);
    assert_eq!(moved.bytes, len);
    assert_eq!(moved.stripes as u64, len.div_ceil(MIB));
    assert_eq!(moved.moved_again, 0);
    let mut got = vec![0u8; len as usize];
    theirs.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &data), None, "the striped write landed whole");
    let stats = c.stats();
    println!("after the write: {stats:?}");
    assert_eq!(stats.len(), 2);
    near_half(&stats, len);
    assert!(stats.iter().all(|r| r.queue_pairs == 2 && r.alive == 2 && r.failure.is_none()));

    // Read it back into a cleared buffer, at an offset on both sides.
    mine.write_at(0, &vec![0u8; len as usize]).unwrap();
    let half = len / 2;
    let moved = c.read(&mine, 3, &d, 5, half).wait().unwrap();
    assert_eq!(moved.bytes, half);
    let mut back = vec![0u8; half as usize];
    mine.read_at(3, &mut back).unwrap();
    assert_eq!(first_difference(&back, &data[5..5 + half as usize]), None, "the striped read landed whole");
    drop(s);
}

/// The notification of a striped write comes after every stripe: when the
/// peer sees it, all the bytes are there.
fn notification_after_all_stripes(server: Rails, client: Rails) {
    const LEN: u64 = 24 * MIB;
    let ropts = rail_opts(Duration::from_secs(60)).stripe(MIB / 2);
    let (s, c) = connect(&server, &client, &ropts, |a| a);
    let theirs = server.alloc(LEN as usize, 1).unwrap();
    let mine = client.alloc(LEN as usize, 2).unwrap();
    let d = s.grant(&theirs).unwrap();
    let mut inbox = s.inbox(4).unwrap();
    for round in 0..3u64 {
        let data = pattern(LEN as usize, round);
        mine.write_at(0, &data).unwrap();
        let payload = round.to_le_bytes();
        let mut w = c.write_notify(&mine, 0, &d, 0, LEN, 99, &payload);
        // The sender's wait moves the transfer on (and sends the note once
        // every stripe landed), on its own thread as in a framework.
        let sender = thread::spawn(move || w.wait());
        let notes = inbox.wait(99, 1).unwrap();
        assert_eq!(&notes[0].payload[..], &payload);
        let mut got = vec![0u8; LEN as usize];
        theirs.read_at(0, &mut got).unwrap();
        assert_eq!(first_difference(&got, &data), None, "round {round}: every stripe landed before the notification");
        assert_eq!(sender.join().unwrap().unwrap().bytes, LEN);
    }
    // Nobody waits: the handle is dropped at once, and the domains'
    // engines still move every stripe, then send the note.
    let data = pattern(LEN as usize, 3);
    mine.write_at(0, &data).unwrap();
    drop(c.write_notify(&mine, 0, &d, 0, LEN, 99, b"dropped"));
    let notes = inbox.wait(99, 1).unwrap();
    assert_eq!(&notes[0].payload[..], b"dropped");
    let mut got = vec![0u8; LEN as usize];
    theirs.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &data), None, "a dropped handle's stripes all landed before its notification");
}

/// A rail transfer's source needs only local access: a region from
/// `Rails::register` is written striped to the peer and read back into
/// another, while the peer can reach neither (a grant refuses it, and its
/// descriptor grants nothing: the peer's write is refused typed).
fn a_local_only_region_is_a_source_and_destination_no_peer_can_reach(server: Rails, client: Rails) {
    const LEN: u64 = 8 * MIB;
    let ropts = rail_opts(Duration::from_secs(60)).stripe(MIB / 2);
    let (s, c) = connect(&server, &client, &ropts, |a| a);
    let theirs = server.alloc(LEN as usize, 1).unwrap();
    let d = s.grant(&theirs).unwrap();
    let src = client.register(HostMemory::new(LEN as usize).unwrap()).unwrap();
    assert!(!src.is_exposed());
    let data = pattern(LEN as usize, 31);
    src.write_at(0, &data).unwrap();
    assert_eq!(c.write(&src, 0, &d, 0, LEN).wait().unwrap().bytes, LEN);
    let mut got = vec![0u8; LEN as usize];
    theirs.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &data), None, "the local-only source went out whole");
    let dst = client.register(HostMemory::new(LEN as usize).unwrap()).unwrap();
    assert_eq!(c.read(&dst, 0, &d, 0, LEN).wait().unwrap().bytes, LEN);
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &data), None, "read into a local-only destination");
    assert!(matches!(c.grant(&src), Err(Error::InvalidArgument(_))), "a local-only region is never granted");
    let none = src.descriptor();
    assert!(none.rails().iter().all(|r| r.access().is_empty() && r.rkey() == 0), "{none:?}");
    match s.write(&theirs, 0, &none, 0, 64).wait() {
        Err(Error::AccessDenied { .. }) => {}
        other => panic!("the peer reached a local-only region: {other:?}"),
    }
}

/// Bad ranges, missing rights and mismatched regions are refused typed,
/// before anything moves.
fn bad_requests_are_refused(server: Rails, client: Rails) {
    let ropts = rail_opts(Duration::from_secs(30));
    let (s, c) = connect(&server, &client, &ropts, |a| a);
    let theirs = server.alloc(4 * MIB as usize, 1).unwrap();
    let read_only = server.expose(HostMemory::new(MIB as usize).unwrap(), Access::REMOTE_READ, 2).unwrap();
    let mine = client.alloc(4 * MIB as usize, 3).unwrap();
    let d = s.grant(&theirs).unwrap();
    let ro = s.grant(&read_only).unwrap();
    assert!(matches!(c.write(&mine, 0, &d, 1, 4 * MIB).wait(), Err(Error::OutOfBounds { side: "remote", .. })));
    assert!(matches!(c.write(&mine, 4 * MIB, &d, 0, 1).wait(), Err(Error::OutOfBounds { side: "local", .. })));
    assert!(matches!(c.read(&mine, u64::MAX, &d, 0, 2).wait(), Err(Error::OutOfBounds { .. })));
    assert!(matches!(c.write(&mine, 0, &ro, 0, MIB).wait(), Err(Error::AccessDenied { .. })));
    let one = Rails::from_domains(vec![client.domains()[0].clone()]).unwrap();
    let narrow = one.alloc(MIB as usize, 4).unwrap();
    assert!(matches!(c.write(&narrow, 0, &d, 0, MIB).wait(), Err(Error::RailMismatch { .. })));
    // A notification payload past the limit, before any stripe moves.
    let long = vec![0u8; gpu_rdma::MAX_NOTIFY_PAYLOAD + 1];
    let refused = c.write_notify(&mine, 0, &d, 0, MIB, 5, &long).wait();
    assert!(matches!(refused, Err(Error::NotifyPayloadTooLarge { .. })), "{refused:?}");
    // Zero bytes move nothing and succeed.
    assert_eq!(c.write(&mine, 0, &d, 0, 0).wait().unwrap().bytes, 0);
    assert!(c.stats().iter().all(|r| r.failure.is_none() && r.alive == 2), "{:?}", c.stats());
    // A forged key on every rail: the peer refuses the access. That is the
    // transfer's fault, not a rail's: it is not moved to another rail
    // (which would refuse it too) and fails as a remote access error. As on
    // any reliable connection, the queue pair that carried it is broken.
    let forged = gpu_rdma::RailDescriptor::from_bytes(&forge_keys(&d.to_bytes())).unwrap();
    let e = c.write(&mine, 0, &forged, 0, MIB).wait().unwrap_err();
    assert_eq!(e.failure(), Some(Failure::RemoteAccess), "{e}");
}

/// The descriptor's bytes with every rail's remote key changed (the key
/// is at bytes 24..28 of each rail's 32-byte region).
fn forge_keys(bytes: &[u8]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    for i in 0..out[1] as usize {
        let at = 2 + 32 * i + 24;
        out[at + 1] ^= 0x5a;
        out[at] ^= 0x3c;
    }
    out
}

/// Each test on two TCP rails here, and on the guest's two rxe rails.
macro_rules! both_rails {
    ($($name:ident),* $(,)?) => {
        mod tcp {
            $(
                #[test]
                fn $name() {
                    super::$name(super::tcp_rails(2), super::tcp_rails(2))
                }
            )*
        }
        mod verbs {
            $(
                #[test]
                #[ignore = "verbs: needs two RDMA devices: GPU_RDMA_TEST_RAILS=<dev>,<dev> and --ignored (cargo xtask test runs it on rxe0 and rxe1)"]
                fn $name() {
                    super::$name(super::verbs_rails(), super::verbs_rails())
                }
            )*
        }
    };
}

both_rails!(
    striped_write_and_read_256m,
    notification_after_all_stripes,
    bad_requests_are_refused,
    a_local_only_region_is_a_source_and_destination_no_peer_can_reach,
);

fn striped_write_and_read_256m(server: Rails, client: Rails) {
    striped_write_and_read(server, client, 256 * MIB)
}

// ---- a rail failing mid-transfer, on TCP: a proxy cuts it ----

/// Forwards connections to `to`; once `cut_after` bytes went toward `to`
/// in all (or when cut by hand), shuts every forwarded connection down.
struct Proxy {
    addr: SocketAddr,
    streams: Arc<Mutex<Vec<TcpStream>>>,
    cut: Arc<AtomicBool>,
}

impl Proxy {
    fn new(to: SocketAddr, cut_after: u64) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let streams: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let cut = Arc::new(AtomicBool::new(false));
        let forwarded = Arc::new(AtomicU64::new(0));
        let (s2, c2) = (Arc::clone(&streams), Arc::clone(&cut));
        thread::spawn(move || {
            for a in l.incoming() {
                let Ok(a) = a else { return };
                let Ok(b) = TcpStream::connect(to) else { return };
                {
                    let mut all = s2.lock().unwrap();
                    all.push(a.try_clone().unwrap());
                    all.push(b.try_clone().unwrap());
                }
                let pump = |mut from: TcpStream, mut to: TcpStream, count: Option<Arc<AtomicU64>>| {
                    let (streams, cut) = (Arc::clone(&s2), Arc::clone(&c2));
                    thread::spawn(move || {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if let Some(c) = &count {
                                if c.fetch_add(n as u64, Ordering::AcqRel) + n as u64 >= cut_after {
                                    cut.store(true, Ordering::Release);
                                }
                            }
                            if cut.load(Ordering::Acquire) || to.write_all(&buf[..n]).is_err() {
                                for s in streams.lock().unwrap().iter() {
                                    let _ = s.shutdown(Shutdown::Both);
                                }
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Write);
                    });
                };
                pump(a.try_clone().unwrap(), b.try_clone().unwrap(), Some(Arc::clone(&forwarded)));
                pump(b, a, None);
            }
        });
        Proxy { addr, streams, cut }
    }

    fn cut_now(&self) {
        self.cut.store(true, Ordering::Release);
        for s in self.streams.lock().unwrap().iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Two TCP rails each way, rail 1 through a proxy that cuts it after
/// `cut_after` bytes; at the server a granted region of `len`, at the
/// client a source of `len` holding `pattern(len, seed)`. Bind every
/// part: a part left out of a pattern is dropped (a connection closed).
struct CutRail {
    /// Server's and client's (the connections keep their domains; these, their set).
    rails: (Rails, Rails),
    s: RailConnection,
    c: RailConnection,
    theirs: gpu_rdma::RailRegion<HostMemory>,
    d: gpu_rdma::RailDescriptor,
    mine: gpu_rdma::RailRegion<HostMemory>,
    data: Vec<u8>,
    proxy: Option<Proxy>,
}

fn cut_rail(len: u64, cut_after: u64, seed: u64) -> CutRail {
    let (server, client) = (tcp_rails(2), tcp_rails(2));
    let ropts = rail_opts(Duration::from_secs(10));
    let mut proxy = None;
    let (s, c) = connect(&server, &client, &ropts, |mut a| {
        let p = Proxy::new(a[1], cut_after);
        a[1] = p.addr;
        proxy = Some(p);
        a
    });
    let theirs = server.alloc(len as usize, 1).unwrap();
    let d = s.grant(&theirs).unwrap();
    let mine = client.alloc(len as usize, 2).unwrap();
    let data = pattern(len as usize, seed);
    mine.write_at(0, &data).unwrap();
    CutRail { rails: (server, client), s, c, theirs, d, mine, data, proxy }
}

/// Rail 1 is cut after 16 MiB of a 96 MiB write: the write finishes on
/// rail 0, verified, and the stats say what happened.
#[test]
fn tcp_a_rail_cut_mid_transfer_is_dropped_and_the_transfer_finishes() {
    const LEN: u64 = 96 * MIB;
    let CutRail { s: _server, c, theirs, d, mine, data, proxy, rails: _rails } = cut_rail(LEN, 16 * MIB, 9);
    let moved = c.write(&mine, 0, &d, 0, LEN).wait().expect("finished on the rail left");
    assert_eq!(moved.bytes, LEN);
    assert!(moved.moved_again >= 1, "{moved:?}");
    let mut got = vec![0u8; LEN as usize];
    theirs.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &data), None);
    let stats = c.stats();
    println!("{moved:?}\n{stats:?}");
    assert!(stats[1].failure.is_some() && stats[1].alive == 0, "rail 1 dropped: {stats:?}");
    assert!(stats[0].failure.is_none() && stats[0].alive == 2);
    assert!(stats[0].bytes >= LEN / 2, "{stats:?}");
    // Later transfers go on rail 0 alone.
    let moved = c.write(&mine, 0, &d, 0, 8 * MIB).wait().unwrap();
    assert_eq!((moved.bytes, moved.moved_again), (8 * MIB, 0));
    drop(proxy);
}

/// A striped transfer is a future, and so is a rail inbox's wait: both
/// awaited on one one-thread runtime, with a rail cut mid-transfer, the
/// stripes move to the rail left and the notification follows, while the
/// runtime goes on running other tasks.
#[test]
fn tcp_an_awaited_striped_transfer_and_inbox_move_off_a_cut_rail_without_blocking_their_runtime() {
    const LEN: u64 = 64 * MIB;
    let CutRail { s, c, theirs, d, mine, data, proxy, rails: _rails } = cut_rail(LEN, 8 * MIB, 21);
    let mut inbox = s.inbox(1).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let (moved, notes, ticks) = rt.block_on(async {
        let (ticks, ticker) = common::ticker();
        // The sender and the receiving side, both awaited on this one thread.
        let (moved, notes) = tokio::join!(c.write_notify(&mine, 0, &d, 0, LEN, 7, b"all here"), inbox.wait_async(7, 1));
        ticker.abort();
        (moved, notes, ticks.load(std::sync::atomic::Ordering::Relaxed))
    });
    let moved = moved.expect("finished on the rail left");
    println!("{moved:?}, the runtime ticked {ticks} times meanwhile");
    assert_eq!(moved.bytes, LEN);
    assert!(moved.moved_again >= 1, "rail 1 was cut: {moved:?}");
    assert!(ticks > 0, "the runtime was blocked");
    assert_eq!(&notes.expect("the awaited inbox")[0].payload[..], b"all here");
    let mut got = vec![0u8; LEN as usize];
    theirs.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &data), None, "every stripe landed before the notification");
    drop(proxy);
}

/// Nobody waits on a striped transfer: its handle is dropped at once, and
/// the engine still moves the stripes of a rail cut mid-transfer and then
/// sends the notification. Then striped transfers on the rail left go in a
/// completion set and take a callback.
#[test]
fn tcp_a_striped_transfer_nobody_waits_on_moves_off_a_cut_rail_and_notifies() {
    const LEN: u64 = 64 * MIB;
    let CutRail { s, c, theirs, d, mine, data, proxy, rails: (_server_rails, client) } = cut_rail(LEN, 8 * MIB, 33);
    let mut inbox = s.inbox(1).unwrap();
    drop(c.write_notify(&mine, 0, &d, 0, LEN, 7, b"nobody waited"));
    let notes = inbox.wait_timeout(7, 1, Duration::from_secs(60)).expect("the notification, with nobody waiting");
    assert_eq!(&notes[0].payload[..], b"nobody waited");
    let mut got = vec![0u8; LEN as usize];
    theirs.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &data), None, "every stripe landed before the notification");
    let stats = c.stats();
    assert!(stats[1].failure.is_some() && stats[1].alive == 0, "rail 1 was dropped: {stats:?}");
    assert_eq!(stats.iter().map(|r| r.bytes).sum::<u64>(), LEN, "the rails' counters add up: {stats:?}");

    // In a set, beside another: each finishes as a whole, with its region.
    let mut set = gpu_rdma::CompletionSet::new();
    let first = set.insert(c.write(&mine, 0, &d, 0, 8 * MIB));
    let second = set.insert(c.write(&mine, 8 * MIB, &d, 8 * MIB, 4 * MIB));
    let mut seen = Vec::new();
    while let Some(done) = set.wait_any(Duration::from_secs(60)).unwrap() {
        let completion = done.result.expect("moved on the rail left");
        let want = if done.key == first { 8 * MIB } else { 4 * MIB };
        assert_eq!((completion.opcode, u64::from(completion.byte_len)), (gpu_rdma::Opcode::Write, want));
        assert_eq!(done.buffer.len() as u64, LEN, "the local region comes back");
        seen.push(done.key);
    }
    seen.sort_unstable();
    assert_eq!(seen, {
        let mut k = vec![first, second];
        k.sort_unstable();
        k
    });
    // A read with a callback, run once with the outcome.
    let back = client.alloc(LEN as usize, 3).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    c.read(&back, 0, &d, 0, 16 * MIB).on_complete(move |r| {
        let _ = tx.send(r);
    });
    let moved = rx.recv_timeout(Duration::from_secs(60)).expect("the callback").expect("read on the rail left");
    assert_eq!(moved.bytes, 16 * MIB);
    let mut got = vec![0u8; 16 * MIB as usize];
    back.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &data[..16 * MIB as usize]), None);
    assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "the callback ran once");
    drop(proxy);
}

/// Every rail cut: the transfer fails typed, naming each rail's failure.
#[test]
fn tcp_every_rail_cut_fails_typed() {
    const LEN: u64 = 64 * MIB;
    let (server, client) = (tcp_rails(2), tcp_rails(2));
    let ropts = rail_opts(Duration::from_secs(10));
    let mut proxies = Vec::new();
    let (s, c) = connect(&server, &client, &ropts, |a| {
        a.into_iter()
            .map(|to| {
                let p = Proxy::new(to, u64::MAX);
                let addr = p.addr;
                proxies.push(p);
                addr
            })
            .collect()
    });
    let theirs = server.alloc(LEN as usize, 1).unwrap();
    let d = s.grant(&theirs).unwrap();
    let mine = client.alloc(LEN as usize, 2).unwrap();
    let mut w = c.write(&mine, 0, &d, 0, LEN);
    for p in &proxies {
        p.cut_now();
    }
    match w.wait() {
        Err(Error::NoRailLeft { failures }) => {
            println!("{failures:?}");
            assert_eq!(failures.len(), 2);
        }
        // Fast enough to land before the cut: then the next one fails.
        Ok(_) => {
            let e = c.write(&mine, 0, &d, 0, LEN).wait().unwrap_err();
            assert!(matches!(e, Error::NoRailLeft { .. }), "{e}");
        }
        Err(e) => panic!("expected NoRailLeft, got {e}"),
    }
    assert!(matches!(w.wait(), Err(Error::AlreadyReported)));
    assert!(c.stats().iter().all(|r| r.alive == 0 && r.failure.is_some()), "{:?}", c.stats());
}

/// Two sides set up differently are refused typed.
#[test]
fn tcp_mismatched_sides_are_refused() {
    let (server, client) = (tcp_rails(2), tcp_rails(2));
    let listener = server.listen("127.0.0.1:0").unwrap();
    let addrs = listener.addrs().unwrap();
    let t = thread::spawn(move || {
        let r = listener.accept(&rail_opts(Duration::from_secs(5)).queue_pairs(2));
        (r, Instant::now())
    });
    let short = RailOptions::default()
        .queue_pairs(1)
        .connect(ConnectOptions::default().handshake_timeout(Duration::from_secs(5)));
    // Both sides learn it at the first connection, not at a handshake's timeout.
    let t0 = Instant::now();
    let dialed = client.connect(&addrs, &short);
    let dialer_took = t0.elapsed();
    let (accepted, at) = t.join().unwrap();
    let listener_took = at.duration_since(t0);
    println!("dialer: {dialed:?} after {dialer_took:?}; listener: {accepted:?} after {listener_took:?}");
    assert!(matches!(dialed, Err(Error::RailMismatch { .. })), "{dialed:?}");
    assert!(matches!(accepted, Err(Error::RailMismatch { .. })), "{accepted:?}");
    assert!(dialer_took < Duration::from_secs(2) && listener_took < Duration::from_secs(2));
    // A dialer with fewer rails than the listener has ports.
    assert!(matches!(tcp_rails(1).connect(&addrs, &short), Err(Error::RailMismatch { .. })));
    assert!(matches!(client.connect(&addrs, &RailOptions::default().queue_pairs(0)), Err(Error::InvalidArgument(_))));
}

// ---- on soft-RoCE: rxe1's netdev set down mid-transfer ----

fn ip_link(dev: &str, state: &str) {
    let ok = std::process::Command::new("ip").args(["link", "set", dev, state]).status().is_ok_and(|s| s.success());
    assert!(ok, "ip link set {dev} {state}");
}

/// rxe1's netdev (`GPU_RDMA_TEST_RAIL_NETDEV`, default dummy1) goes down
/// while a 256 MiB write is under way: it completes on rxe0, verified, or
/// fails typed.
#[test]
#[ignore = "verbs: needs two RDMA devices and root (cargo xtask test runs it on rxe0 and rxe1 in the guest)"]
fn verbs_a_rail_whose_link_goes_down_is_dropped() {
    const LEN: u64 = 256 * MIB;
    let netdev = std::env::var("GPU_RDMA_TEST_RAIL_NETDEV").unwrap_or_else(|_| "dummy1".into());
    let (server, client) = (verbs_rails(), verbs_rails());
    let ropts = rail_opts(Duration::from_secs(5));
    let (s, c) = connect(&server, &client, &ropts, |a| a);
    let theirs = server.alloc(LEN as usize, 1).unwrap();
    let d = s.grant(&theirs).unwrap();
    let mine = client.alloc(LEN as usize, 2).unwrap();
    let data = pattern(LEN as usize, 5);
    mine.write_at(0, &data).unwrap();
    let mut w = c.write(&mine, 0, &d, 0, LEN);
    thread::sleep(Duration::from_millis(300));
    ip_link(&netdev, "down");
    let t0 = std::time::Instant::now();
    let out = w.wait();
    println!("after the link went down: {:?} in {:?}; {:?}", out, t0.elapsed(), c.stats());
    ip_link(&netdev, "up");
    match out {
        Ok(moved) => {
            assert_eq!(moved.bytes, LEN);
            let mut got = vec![0u8; LEN as usize];
            theirs.read_at(0, &mut got).unwrap();
            assert_eq!(first_difference(&got, &data), None, "finished on rxe0, whole");
            let stats = c.stats();
            assert!(stats[1].failure.is_some() || moved.moved_again == 0, "{stats:?}");
            assert!(stats[0].failure.is_none() && stats[0].alive == 2, "{stats:?}");
        }
        Err(e) => assert!(matches!(e, Error::NoRailLeft { .. }), "failed, but not typed as a rail failure: {e}"),
    }
}
