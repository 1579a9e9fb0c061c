//! Peer death: the peer is another process (`gpu-rdma bench write-bw`, a
//! server exposing a region), SIGKILLed at several points of a stream of
//! 1 MiB writes with up to 64 in flight. Writing goes on until the death is
//! seen; then every pending operation ends with a typed error (or had
//! completed) well within its timeout, the connection
//! says it is broken, another connection of the same domain keeps working,
//! and a new connection to a restarted peer on the same port works.
//!
//! TCP here; verbs (`--ignored`) on rxe0 in the soft-RoCE guest.

#![cfg(feature = "cli")]

mod common;

use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use gpu_rdma::bench::{self, LocalMode, Params, Test};
use gpu_rdma::{ConnectOptions, Connection, Domain, Error, Piece};

use common::{Kind, domain, pair};

const PEER: &str = env!("CARGO_BIN_EXE_gpu-rdma");
const OP_TIMEOUT: Duration = Duration::from_secs(20);

/// The peer process; killed (SIGKILL) when dropped, if still running.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A message still goes from `c` to `s`, another connection of domain `d`.
fn still_works(d: &Domain, s: &Connection, c: &Connection) {
    let mut rx = s.recv(d.alloc(64).unwrap());
    c.send_inline(b"still here", None).wait().unwrap();
    assert_eq!(rx.wait().unwrap().byte_len, 10);
}
fn spawn_peer(t: Kind, port: u16, iters: u32) -> Peer {
    let mut cmd = Command::new(PEER);
    cmd.args(["bench", "write-bw", "--bind", "127.0.0.1", "-s", "1MiB", "--timeout", "60"])
        .args(["-p", &port.to_string(), "-n", &iters.to_string(), "--transport", t.name()])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if t == Kind::Verbs {
        cmd.args(["-d", &common::device()]);
    }
    Peer(cmd.spawn().expect("start the peer process"))
}

fn params(iters: u32) -> Params {
    Params { test: Test::WriteBw, sizes: vec![1 << 20], iters, tx_depth: 128, cq_mod: 32, list: 1024 }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Connects once the peer listens (it may still be starting).
fn connect(d: &Domain, port: u16) -> Connection {
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let opts = ConnectOptions::default().op_timeout(OP_TIMEOUT).handshake_timeout(Duration::from_secs(20));
    let t0 = Instant::now();
    loop {
        match d.connect(addr, &opts) {
            Ok(c) => return c,
            Err(e) if t0.elapsed() < Duration::from_secs(20) => {
                let _ = e;
                thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("the peer process never accepted: {e}"),
        }
    }
}

fn peer_death(t: Kind) {
    let d = domain(t);
    let (bystander_s, bystander_c) = pair(&d);
    let src = d.alloc(1 << 20).unwrap().share();
    const ITERS: u32 = 1_000_000;
    let mut port = 0;
    for (round, kill_after) in [0u64, 2, 10, 40, 150].into_iter().enumerate() {
        port = free_port();
        let mut peer = spawn_peer(t, port, ITERS);
        let conn = connect(&d, port);
        bench::agree(&conn, &params(ITERS), OP_TIMEOUT).expect("the peer agrees on the test");
        let remote = conn.remote_regions()[0].slice(0..1 << 20).unwrap();
        let mut in_flight = std::collections::VecDeque::new();
        let (mut ok, mut failed) = (0usize, 0usize);
        let t0 = Instant::now();
        let mut killed_at = None;
        // Keep 64 writes in flight; kill the peer `kill_after` ms in, and keep
        // writing: what was posted before the death may still complete (the
        // kernel tears the peer's queue pair down when the process is gone),
        // what comes after must fail, within the timeout.
        loop {
            let dead_for = killed_at.map(|k: Instant| k.elapsed());
            assert!(dead_for.is_none_or(|d| d < OP_TIMEOUT), "round {round}: writes to a dead peer still succeed");
            while in_flight.len() < 64 {
                in_flight.push_back(conn.write(src.clone(), &remote));
            }
            if killed_at.is_none() && t0.elapsed() >= Duration::from_millis(kill_after) {
                peer.0.kill().expect("SIGKILL the peer");
                killed_at = Some(Instant::now());
            }
            let Some(mut p) = in_flight.pop_front() else { break };
            match p.wait() {
                Ok(_) => ok += 1,
                Err(e) => {
                    assert!(!e.is_timeout(), "round {round}: a pending write hung until its timeout: {e}");
                    failed += 1;
                    // Every other pending operation ends too, each with a typed error.
                    for mut p in in_flight.drain(..) {
                        match p.wait() {
                            Ok(_) => ok += 1,
                            Err(e) => {
                                assert!(!e.is_timeout(), "round {round}: a pending write hung: {e}");
                                assert!(
                                    matches!(e, Error::ConnectionLost { .. } | Error::Completion(_)),
                                    "round {round}: not a transport error: {e}"
                                );
                                failed += 1;
                            }
                        }
                    }
                    break;
                }
            }
        }
        let ended = killed_at.map(|k| k.elapsed());
        println!(
            "{} peer death, round {round}: killed {kill_after} ms in; {ok} writes done, {failed} failed; \
             everything ended {:?} after the kill; broken: {:?}",
            t.name(),
            ended,
            conn.broken()
        );
        assert!(failed > 0, "round {round}: nothing failed after the peer died");
        assert!(ended.is_some_and(|e| e < OP_TIMEOUT), "round {round}: the survivor took {ended:?}");
        assert!(conn.broken().is_some(), "round {round}: the connection does not say it is broken");
        // A new operation on the broken connection fails at once.
        let e = conn.write(src.clone(), &remote).wait().unwrap_err();
        assert!(!e.is_timeout(), "{e}");
        // The other connection of this domain still works.
        still_works(&d, &bystander_s, &bystander_c);
    }
    // A new connection to a restarted peer on the same port works: a whole
    // (short) test, ended cleanly.
    let _peer = spawn_peer(t, port, 50);
    let conn = connect(&d, port);
    let remote = conn.remote_regions()[0];
    let rows = bench::run_client(&conn, &params(50), &src, LocalMode::HOST, Some(&remote), OP_TIMEOUT, |_| {})
        .expect("a full test against the restarted peer");
    assert_eq!(rows.len(), 1);
}

#[test]
fn tcp_a_killed_peer_fails_every_pending_operation_and_nothing_else() {
    peer_death(Kind::Tcp);
}

#[test]
#[ignore = "verbs: needs an RDMA device: GPU_RDMA_TEST_DEVICE=<dev> and --ignored (cargo xtask test runs it on soft-RoCE)"]
fn verbs_a_killed_peer_fails_every_pending_operation_and_nothing_else() {
    peer_death(Kind::Verbs);
}

/// A peer process connects (the `gpu-rdma bench` client, whose first
/// message is a send) to a listener that never posts a receive, with the
/// receiver-not-ready budget at "infinite" (`rnr_retry` 7, the default):
/// its send waits here. Then it is SIGKILLed. This side must see the death
/// within a second (on TCP, while its receiver waits for a receive; on
/// verbs, through the handshake socket), and the domain's other connection
/// keeps working.
fn death_during_an_unmatched_send(t: Kind) {
    let d = domain(t);
    let (bystander_s, bystander_c) = pair(&d);
    let listener = d.listen("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut cmd = Command::new(PEER);
    cmd.args(["bench", "send-lat", "127.0.0.1", "-s", "64", "-n", "10", "--timeout", "60"])
        .args(["-p", &port.to_string(), "--transport", t.name()])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if t == Kind::Verbs {
        cmd.args(["-d", &common::device()]);
    }
    let mut peer = Peer(cmd.spawn().expect("start the peer process"));
    let opts = ConnectOptions::default().op_timeout(OP_TIMEOUT).handshake_timeout(Duration::from_secs(20));
    let conn = listener.accept_timeout(&opts, Duration::from_secs(20)).expect("the peer connects");
    // Its first message arrives and waits: no receive is posted here.
    thread::sleep(Duration::from_millis(300));
    assert!(conn.broken().is_none(), "broken before the peer died: {:?}", conn.broken());
    peer.0.kill().expect("SIGKILL the peer");
    let killed = Instant::now();
    let mut seen = None;
    while killed.elapsed() < Duration::from_secs(5) {
        if conn.broken().is_some() {
            seen = Some(killed.elapsed());
            break;
        }
        thread::sleep(Duration::from_millis(1));
    }
    println!(
        "{}: a peer killed while its send waited for a receive was seen after {seen:?}: {:?}",
        t.name(),
        conn.broken()
    );
    assert!(seen.is_some_and(|s| s < Duration::from_secs(1)), "the death was seen after {seen:?}");
    // A receive posted now fails at once: the connection is gone.
    let e = conn.recv(d.alloc(64).unwrap()).wait().unwrap_err();
    assert!(matches!(e, Error::ConnectionLost { .. } | Error::Completion(_)), "{e}");
    // The other connection of this domain still works.
    still_works(&d, &bystander_s, &bystander_c);
}

#[test]
fn tcp_a_peer_killed_while_its_send_waits_for_a_receive_is_seen() {
    death_during_an_unmatched_send(Kind::Tcp);
}

#[test]
#[ignore = "verbs: needs an RDMA device: GPU_RDMA_TEST_DEVICE=<dev> and --ignored (cargo xtask test runs it on soft-RoCE)"]
fn verbs_a_peer_killed_while_its_send_waits_for_a_receive_is_seen() {
    death_during_an_unmatched_send(Kind::Verbs);
}

/// A peer killed while a long transfer list runs to it, with operations
/// awaited as futures beside it (some dropped mid-flight): the list's wait
/// and every future end with a typed error within a second of the kill.
fn death_mid_list(t: Kind) {
    let d = domain(t);
    let (bystander_s, bystander_c) = pair(&d);
    let src = d.alloc(1 << 20).unwrap().share();
    // The list waited on by this thread.
    let port = free_port();
    let mut peer = spawn_peer(t, port, 1_000_000);
    let conn = connect(&d, port);
    bench::agree(&conn, &params(1_000_000), OP_TIMEOUT).expect("the peer agrees on the test");
    let remote = conn.remote_regions()[0].slice(0..1 << 20).unwrap();
    // 4 GiB in 4 KiB pieces over the same 1 MiB: far longer than the peer lives.
    let pieces = (0..1u64 << 20).map(|i| Piece::new((i % 256) * 4096, ((i * 7) % 256) * 4096, 4096));
    let mut list = conn.write_list(src.clone(), &remote, pieces);
    for _ in 0..10 {
        assert!(list.poll().unwrap().is_none());
    }
    peer.0.kill().expect("SIGKILL the peer");
    let killed = Instant::now();
    let outcome = list.wait();
    let took = killed.elapsed();
    println!("{}: a list to a peer killed mid-list ended {took:?} after the kill with {outcome:?}", t.name());
    assert!(matches!(outcome, Err(Error::ConnectionLost { .. } | Error::Completion(_))), "{outcome:?}");
    assert!(took < Duration::from_secs(1), "the list failed {took:?} after the kill");
    drop(list);

    // A list and writes awaited as futures on one thread, half the writes
    // dropped before the kill.
    let port = free_port();
    let mut peer = spawn_peer(t, port, 1_000_000);
    let conn = connect(&d, port);
    bench::agree(&conn, &params(1_000_000), OP_TIMEOUT).expect("the peer agrees on the test");
    let remote = conn.remote_regions()[0].slice(0..1 << 20).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let took = rt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        let pieces = (0..1u64 << 20).map(|i| Piece::new((i % 256) * 4096, ((i * 7) % 256) * 4096, 4096));
        let mut list = conn.write_list(src.clone(), &remote, pieces);
        set.spawn(async move { (&mut list).await.map(|_| ()).map_err(|e| (e, "list")) });
        let mut writes: Vec<_> = (0..32).map(|_| conn.write(src.clone(), &remote)).collect();
        writes.truncate(16);
        for mut w in writes {
            set.spawn(async move { (&mut w).await.map(|_| ()).map_err(|e| (e, "write")) });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        peer.0.kill().expect("SIGKILL the peer");
        let killed = Instant::now();
        let mut failed = 0;
        while let Some(joined) = set.join_next().await {
            if let Err((e, what)) = joined.expect("the task") {
                assert!(matches!(e, Error::ConnectionLost { .. } | Error::Completion(_)), "{what}: {e}");
                failed += 1;
            }
        }
        assert!(failed >= 1, "the list to a killed peer did not fail");
        killed.elapsed()
    });
    println!("{}: futures to a peer killed mid-list all ended {took:?} after the kill", t.name());
    assert!(took < Duration::from_secs(1), "the futures ended {took:?} after the kill");
    assert!(conn.broken().is_some());
    // The other connection of this domain still works.
    still_works(&d, &bystander_s, &bystander_c);
}

#[test]
fn tcp_a_peer_killed_mid_list_fails_the_list_and_its_futures_within_a_second() {
    death_mid_list(Kind::Tcp);
}

#[test]
#[ignore = "verbs: needs an RDMA device: GPU_RDMA_TEST_DEVICE=<dev> and --ignored (cargo xtask test runs it on soft-RoCE)"]
fn verbs_a_peer_killed_mid_list_fails_the_list_and_its_futures_within_a_second() {
    death_mid_list(Kind::Verbs);
}
