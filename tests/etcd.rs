//! The etcd rendezvous against a real etcd (Debian's etcd-server, started
//! by each test on 127.0.0.1 in a data directory of its own).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::etcd::EtcdServer;
use gpu_rdma::Error;
use gpu_rdma::rendezvous::{Change, EtcdOptions, EtcdRendezvous, Rendezvous};

fn store(server: &EtcdServer, ns: &str, ttl: u64) -> EtcdRendezvous {
    EtcdRendezvous::connect(EtcdOptions::new([server.endpoint()]).namespace(ns).lease_ttl(Duration::from_secs(ttl)))
        .expect("connect to etcd")
}

/// This test binary again, running only the helper test `name` with
/// `env`, once it printed READY (it published what it was to).
fn spawn_child(name: &str, env: &[(&str, String)]) -> std::process::Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", name, "--nocapture"])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("READY") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "{name} ended before it was ready");
    }
    child
}

#[test]
fn publish_look_up_list_watch_and_remove() {
    let server = EtcdServer::start();
    let a = Arc::new(store(&server, "job-1/", 5));
    let b = store(&server, "job-1/", 5);
    let other_job = store(&server, "job-2/", 5);
    assert!(matches!(a.lookup("rank/0", Duration::from_millis(100)), Err(Error::Timeout { .. })));
    let w = Arc::clone(&a).watch("rank/").unwrap();
    a.publish("rank/0", b"zero").unwrap();
    b.publish("rank/1", b"one").unwrap();
    other_job.publish("rank/0", b"elsewhere").unwrap();
    assert_eq!(b.lookup("rank/0", Duration::from_secs(5)).unwrap(), b"zero");
    assert_eq!(a.list("rank/").unwrap(), vec![("rank/0".into(), b"zero".to_vec()), ("rank/1".into(), b"one".to_vec())]);
    assert_eq!(other_job.list("").unwrap(), vec![("rank/0".into(), b"elsewhere".to_vec())], "namespaces apart");
    b.remove("rank/1").unwrap();
    let mut seen = Vec::new();
    let until = Instant::now() + Duration::from_secs(10);
    while seen.len() < 3 && Instant::now() < until {
        seen.extend(w.next_timeout(Duration::from_millis(100)));
    }
    assert_eq!(
        seen,
        vec![
            Change::Put { key: "rank/0".into(), value: b"zero".to_vec() },
            Change::Put { key: "rank/1".into(), value: b"one".to_vec() },
            Change::Removed { key: "rank/1".into() },
        ]
    );
    drop(b);
    a.publish("rank/2", b"two").unwrap();
    drop(other_job);
    assert!(matches!(a.lookup("../bad", Duration::ZERO), Err(Error::InvalidArgument(_))));
}

/// A watch reports every change made after it was asked for, even one
/// made at once from another client, before the watch's stream to etcd
/// is set up; and none from before (those are in the listing).
#[test]
fn a_watch_misses_nothing_published_right_after_it_was_asked_for() {
    let server = EtcdServer::start();
    let watcher = Arc::new(store(&server, "gap/", 5));
    let other = store(&server, "gap/", 5);
    other.publish("rank/before", b"old").unwrap();
    for round in 0..40 {
        let w = Arc::clone(&watcher).watch("rank/").unwrap();
        let key = format!("rank/{round}");
        other.publish(&key, b"new").unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        let got = loop {
            match w.next_timeout(Duration::from_millis(100)) {
                Some(c) => break Some(c),
                None if Instant::now() < until => {}
                None => break None,
            }
        };
        assert_eq!(
            got,
            Some(Change::Put { key, value: b"new".to_vec() }),
            "round {round}: the first change the watch reports is the publish made right after it was asked for"
        );
    }
}

/// Run as a child by `a_killed_process_disappears_when_its_lease_expires`:
/// publishes under a 2-second lease, says so, and waits to be killed.
#[test]
#[ignore = "helper: run as a child process by the lease test"]
fn child_publishes_and_waits_to_be_killed() {
    let Ok(endpoint) = std::env::var("GPU_RDMA_ETCD_CHILD") else {
        panic!("run only as the lease test's child (GPU_RDMA_ETCD_CHILD names the endpoint)")
    };
    let s = EtcdRendezvous::connect(EtcdOptions::new([endpoint]).namespace("lease/").lease_ttl(Duration::from_secs(2)))
        .unwrap();
    s.publish("rank/7", b"alive").unwrap();
    println!("READY");
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn a_killed_process_disappears_when_its_lease_expires() {
    let server = EtcdServer::start();
    let watcher = Arc::new(store(&server, "lease/", 5));
    let w = Arc::clone(&watcher).watch("rank/").unwrap();
    let mut child =
        spawn_child("child_publishes_and_waits_to_be_killed", &[("GPU_RDMA_ETCD_CHILD", server.endpoint())]);
    assert_eq!(watcher.lookup("rank/7", Duration::from_secs(5)).unwrap(), b"alive");
    child.kill().unwrap();
    let killed = Instant::now();
    child.wait().unwrap();
    let gone = loop {
        match w.next_timeout(Duration::from_millis(100)) {
            Some(Change::Removed { key }) if key == "rank/7" => break killed.elapsed(),
            _ => assert!(killed.elapsed() < Duration::from_secs(20), "the dead process's key never went"),
        }
    };
    println!("the killed process's key went {gone:?} after the kill (lease: 2 s)");
    assert!(gone <= Duration::from_secs(3), "gone after {gone:?}: lease time plus a second at most");
    assert!(watcher.list("rank/").unwrap().is_empty());
}

/// A TCP socket bound to a port of 127.0.0.1 and never listening: a
/// connect to that port is refused, and no other socket can take the port
/// while the returned descriptor lives (a port picked and let go could be
/// taken by another test's etcd meanwhile).
fn refusing_port() -> (std::os::fd::OwnedFd, u16) {
    use std::os::fd::FromRawFd;
    // SAFETY: socket(2) with constant arguments; it returns a new descriptor
    // or -1, checked next.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a descriptor this function just opened and owns no
    // one else; `OwnedFd` closes it once.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let mut addr = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be() },
        sin_zero: [0; 8],
    };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: `addr` is a valid sockaddr_in and `len` its size; bind(2)
    // only reads it.
    let rc = unsafe { libc::bind(fd, (&raw const addr).cast(), len) };
    assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
    // SAFETY: getsockname(2) writes at most `len` bytes into `addr`, which
    // has room for a sockaddr_in, the family of this socket.
    let rc = unsafe { libc::getsockname(fd, (&raw mut addr).cast(), &mut len) };
    assert_eq!(rc, 0, "getsockname: {}", std::io::Error::last_os_error());
    (owned, u16::from_be(addr.sin_port))
}

#[test]
fn etcd_down_at_start_is_a_clear_error_naming_the_endpoint() {
    // A port nobody listens on, and nobody can while the test runs.
    let (_held, port) = refusing_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let t0 = Instant::now();
    let err =
        EtcdRendezvous::connect(EtcdOptions::new([endpoint.clone()]).timeout(Duration::from_secs(2))).unwrap_err();
    match &err {
        Error::Rendezvous { store, reason } => {
            assert!(store.contains(&endpoint), "{err}");
            assert!(reason.contains("cannot reach"), "{err}");
        }
        other => panic!("{other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[test]
fn a_restarted_etcd_finds_the_ranks_carrying_on() {
    let mut server = EtcdServer::start();
    let a = store(&server, "restart/", 3);
    let b = Arc::new(store(&server, "restart/", 3));
    a.publish("rank/0", b"a").unwrap();
    let w = Arc::clone(&b).watch("rank/").unwrap();
    server.stop();
    // While it is down, a request fails typed, naming the store.
    let err = b.list("rank/").unwrap_err();
    assert!(matches!(err, Error::Rendezvous { .. }), "{err}");
    // Down longer than the lease: the keep-alive has to notice and recover.
    std::thread::sleep(Duration::from_secs(4));
    server.restart();
    // Both carry on: a's key is back (kept, or put back under a new lease)
    // and new keys go in.
    assert_eq!(b.lookup("rank/0", Duration::from_secs(15)).unwrap(), b"a");
    b.publish("rank/1", b"b").unwrap();
    assert_eq!(a.lookup("rank/1", Duration::from_secs(5)).unwrap(), b"b");
    // The watch came back too.
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        match w.next_timeout(Duration::from_millis(100)) {
            Some(Change::Put { key, .. }) if key == "rank/1" => break,
            _ => assert!(Instant::now() < until, "the watch never saw the key published after the restart"),
        }
    }
    // And the lease is kept alive again: the keys outlive a lease's time.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(b.list("rank/").unwrap().len(), 2);
}

mod world {
    use super::*;
    use gpu_rdma::{ConnectOptions, Domain, DomainConfig, TransportPolicy, World, WorldOptions};
    use std::process::Child;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    const LEASE: Duration = Duration::from_secs(2);
    const RANKS: u32 = 4;

    fn tcp_domain() -> Domain {
        Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).unwrap()
    }

    fn join(endpoint: &str, rank: u32) -> (Domain, World) {
        let rdv = EtcdRendezvous::connect(EtcdOptions::new([endpoint.to_owned()]).namespace("kill/").lease_ttl(LEASE))
            .expect("connect to etcd");
        let d = tcp_domain();
        let opts = WorldOptions::new("job")
            .connect(
                ConnectOptions::default().op_timeout(Duration::from_secs(10)).handshake_timeout(Duration::from_secs(5)),
            )
            .lookup_timeout(Duration::from_secs(20));
        let w = World::join(&d, rank, RANKS, Arc::new(rdv), opts).expect("join");
        (d, w)
    }

    /// Run as a child: rank `GPU_RDMA_WORLD_CHILD_RANK` echoes what rank 0
    /// sends it, until killed.
    #[test]
    #[ignore = "helper: run as a child process by the kill test"]
    fn child_rank_echoes_until_killed() {
        let (Ok(endpoint), Ok(rank)) =
            (std::env::var("GPU_RDMA_ETCD_CHILD"), std::env::var("GPU_RDMA_WORLD_CHILD_RANK"))
        else {
            panic!("run only as the kill test's child")
        };
        let (d, w) = join(&endpoint, rank.parse().unwrap());
        println!("READY");
        loop {
            let Ok(c) = w.accepted(0, Duration::from_secs(600)) else { continue };
            loop {
                let mut rx = c.recv(d.alloc(64).unwrap());
                let Ok(got) = rx.wait_timeout(Duration::from_secs(600)) else { break };
                let data = rx.into_buffer().unwrap();
                if c.send_inline(&data[..got.byte_len as usize], None).wait().is_err() {
                    break;
                }
            }
        }
    }

    fn spawn_rank(endpoint: &str, rank: u32) -> Child {
        spawn_child(
            "world::child_rank_echoes_until_killed",
            &[("GPU_RDMA_ETCD_CHILD", endpoint.to_owned()), ("GPU_RDMA_WORLD_CHILD_RANK", rank.to_string())],
        )
    }

    /// One round trip to `rank` through the connection dialed to it.
    fn echo(d: &Domain, w: &World, rank: u32, n: u64) -> gpu_rdma::Result<()> {
        let c = w.peer(rank)?;
        let mut rx = c.recv(d.alloc(64)?);
        let msg = n.to_le_bytes();
        c.send_inline(&msg, None).wait()?;
        rx.wait_timeout(Duration::from_secs(5))?;
        let back = rx.into_buffer().map_err(|_| Error::InvalidArgument("still in flight".into()))?;
        assert_eq!(&back[..8], &msg, "rank {rank} echoed something else");
        Ok(())
    }

    #[test]
    fn a_killed_rank_fails_typed_the_others_go_on_and_a_restarted_one_is_reached_again() {
        let server = EtcdServer::start();
        let endpoint = server.endpoint();
        let mut children: Vec<Child> = (1..RANKS).map(|r| spawn_rank(&endpoint, r)).collect();
        let (d, w) = join(&endpoint, 0);
        let (d, w) = (Arc::new(d), Arc::new(w));
        for r in 1..RANKS {
            echo(&d, &w, r, u64::from(r)).unwrap();
        }
        // Exchanges with every rank, all the time.
        let stop = Arc::new(AtomicBool::new(false));
        let done: Vec<Arc<AtomicU64>> = (0..RANKS).map(|_| Arc::new(AtomicU64::new(0))).collect();
        let loops: Vec<_> = (1..RANKS)
            .map(|r| {
                let (d, w, stop, done) =
                    (Arc::clone(&d), Arc::clone(&w), Arc::clone(&stop), Arc::clone(&done[r as usize]));
                std::thread::spawn(move || {
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        if let Err(e) = echo(&d, &w, r, n) {
                            return Some((e, Instant::now()));
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    None
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let before: Vec<u64> = done.iter().map(|d| d.load(Ordering::Relaxed)).collect();
        assert!(before[1] > 0 && before[2] > 0 && before[3] > 0, "every exchange ran: {before:?}");
        children[1].kill().unwrap();
        let killed = Instant::now();
        children[1].wait().unwrap();
        std::thread::sleep(LEASE + Duration::from_secs(1));
        let after: Vec<u64> = done.iter().map(|d| d.load(Ordering::Relaxed)).collect();
        assert!(after[1] > before[1] && after[3] > before[3], "ranks 1 and 3 went on: {before:?} -> {after:?}");
        stop.store(true, Ordering::Relaxed);
        let mut outcomes: Vec<_> = loops.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(outcomes[0].is_none() && outcomes[2].is_none(), "ranks 1 and 3 never failed");
        let (err, at) = outcomes[1].take().expect("the exchange with the killed rank failed");
        let took = at.duration_since(killed);
        println!("toward the killed rank: {err} after {took:?}");
        assert!(matches!(err, Error::ConnectionLost { .. } | Error::PeerGone { .. } | Error::Io(_)), "typed: {err:?}");
        assert!(took <= LEASE + Duration::from_secs(1), "failed {took:?} after the kill");
        // Its lease has expired: it is gone, by name.
        let t0 = Instant::now();
        loop {
            match w.peer(2) {
                Err(Error::PeerGone { name, .. }) => {
                    assert_eq!(name, "job/rank/2");
                    break;
                }
                other => assert!(t0.elapsed() < Duration::from_secs(10), "not gone yet: {:?}", other.map(drop)),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Restarted under the same rank: reached again.
        children[1] = spawn_rank(&endpoint, 2);
        let t0 = Instant::now();
        while let Err(e) = echo(&d, &w, 2, 99) {
            assert!(t0.elapsed() < Duration::from_secs(20), "the restarted rank was not reached: {e}");
            std::thread::sleep(Duration::from_millis(100));
        }
        println!("the restarted rank answered {:?} after it joined", t0.elapsed());
        echo(&d, &w, 1, 100).unwrap();
        echo(&d, &w, 3, 100).unwrap();
        for c in &mut children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
