//! World: ranks reach each other on first use through a rendezvous.

#[macro_use]
mod common;

use std::net::TcpListener;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::{Kind, domain, opts};
use gpu_rdma::rendezvous::{MemRendezvous, Rendezvous};
use gpu_rdma::{Endpoint, Error, Transport, World, WorldOptions};

fn world_opts(job: &str) -> WorldOptions {
    WorldOptions::new(job)
        .connect(opts().handshake_timeout(Duration::from_secs(3)))
        .lookup_timeout(Duration::from_secs(20))
}

/// Every rank sends its number to every other, on the connection it dialed
/// on first use; every rank receives one from each on the connections it
/// accepted.
fn ranks_reach_each_other_on_first_use(t: Kind) {
    const RANKS: u32 = 4;
    let rdv: Arc<dyn Rendezvous> = Arc::new(MemRendezvous::default());
    let handles: Vec<_> = (0..RANKS)
        .map(|r| {
            let rdv = Arc::clone(&rdv);
            thread::spawn(move || {
                let d = domain(t);
                let w = World::join(&d, r, RANKS, rdv, world_opts("first-use")).unwrap();
                // Dialed on first use, in no particular order.
                for to in (0..RANKS).filter(|&p| p != r).rev() {
                    w.peer(to).unwrap();
                }
                let mut rx = Vec::new();
                for from in (0..RANKS).filter(|&p| p != r) {
                    let c = w.accepted(from, Duration::from_secs(30)).unwrap();
                    assert_eq!(c.info().peer_name, format!("first-use/rank/{from}").into_bytes());
                    rx.push((from, c.recv(d.alloc(8).unwrap())));
                }
                for to in (0..RANKS).filter(|&p| p != r) {
                    w.peer(to).unwrap().send_inline(&r.to_le_bytes(), None).wait().unwrap();
                }
                for (from, mut p) in rx {
                    p.wait().unwrap();
                    let got = p.into_buffer().unwrap();
                    assert_eq!(u32::from_le_bytes(got[..4].try_into().unwrap()), from);
                }
                // The same connection on later uses.
                let a = w.peer((r + 1) % RANKS).unwrap();
                let b = w.peer((r + 1) % RANKS).unwrap();
                assert!(Arc::ptr_eq(&a, &b));
                assert!(matches!(w.peer(r), Err(Error::InvalidArgument(_))), "not a peer of its own");
                assert!(matches!(w.peer(RANKS), Err(Error::InvalidArgument(_))));
                // Everyone is done before anyone leaves.
                thread::sleep(Duration::from_millis(500));
                w
            })
        })
        .collect();
    let worlds: Vec<World> = handles.into_iter().map(|h| h.join().expect("rank thread")).collect();
    drop(worlds);
    assert!(rdv.list("first-use/").unwrap().is_empty(), "every rank took its key away when it left");
}

/// The pool keeps at most its bound of dialed connections, dropping the
/// least recently used that nobody holds.
fn the_pool_is_bounded(t: Kind) {
    const RANKS: u32 = 5;
    let rdv: Arc<dyn Rendezvous> = Arc::new(MemRendezvous::default());
    let d = domain(t);
    let others: Vec<World> =
        (1..RANKS).map(|r| World::join(&d, r, RANKS, Arc::clone(&rdv), world_opts("pool")).unwrap()).collect();
    let w = World::join(&d, 0, RANKS, Arc::clone(&rdv), world_opts("pool").max_connections(2)).unwrap();
    let held = w.peer(1).unwrap();
    for r in 2..RANKS {
        w.peer(r).unwrap();
        assert!(w.pooled() <= 2, "{} pooled", w.pooled());
    }
    // The held one stayed (it is in use); the others came and went.
    assert!(Arc::ptr_eq(&held, &w.peer(1).unwrap()));
    // An evicted rank is dialed again on its next use.
    assert!(w.peer(2).unwrap().broken().is_none());
    drop(others);
}

/// A rank whose handshake hangs holds up only the callers that want it.
fn a_slow_handshake_blocks_no_other_rank(t: Kind) {
    let rdv: Arc<dyn Rendezvous> = Arc::new(MemRendezvous::default());
    let d = domain(t);
    // "Rank 2" accepts TCP connections and never says a word.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let ep = Endpoint::new(silent.local_addr().unwrap(), Transport::Tcp, "", "");
    rdv.publish("slow/rank/2", &ep.to_bytes()).unwrap();
    let _one = World::join(&d, 1, 3, Arc::clone(&rdv), world_opts("slow")).unwrap();
    let w = Arc::new(World::join(&d, 0, 3, Arc::clone(&rdv), world_opts("slow")).unwrap());
    let stuck = {
        let w = Arc::clone(&w);
        thread::spawn(move || {
            let t0 = Instant::now();
            (w.peer(2).map(drop), t0.elapsed())
        })
    };
    thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    assert!(w.peer(1).unwrap().broken().is_none());
    let fast = t0.elapsed();
    let (slow, took) = stuck.join().unwrap();
    assert!(fast < Duration::from_secs(2), "rank 1 took {fast:?} while rank 2's handshake hung");
    assert!(slow.is_err(), "the silent rank's handshake times out");
    assert!(took >= Duration::from_secs(2), "it failed only at its handshake timeout ({took:?})");
    drop(silent);
}

/// A rank that leaves the rendezvous is gone: its connections break with
/// its name in the reason, and dialing it fails typed until it is back.
fn a_rank_that_leaves_is_gone_until_it_comes_back(t: Kind) {
    let rdv: Arc<dyn Rendezvous> = Arc::new(MemRendezvous::default());
    let d = domain(t);
    let w = World::join(&d, 0, 2, Arc::clone(&rdv), world_opts("leave")).unwrap();
    let one = World::join(&d, 1, 2, Arc::clone(&rdv), world_opts("leave")).unwrap();
    let c = w.peer(1).unwrap();
    let mut rx = c.recv(d.alloc(8).unwrap());
    drop(one);
    let err = rx.wait_timeout(Duration::from_secs(10)).unwrap_err();
    assert!(matches!(err, Error::ConnectionLost { .. }), "{err}");
    let t0 = Instant::now();
    let gone = loop {
        match w.peer(1) {
            Err(e @ Error::PeerGone { .. }) => break e,
            other if t0.elapsed() > Duration::from_secs(10) => panic!("never reported gone: {:?}", other.map(drop)),
            _ => thread::sleep(Duration::from_millis(50)),
        }
    };
    assert!(gone.to_string().contains("leave/rank/1"), "{gone}");
    // Back under the same rank (a new endpoint): dialed afresh.
    let _again = World::join(&d, 1, 2, Arc::clone(&rdv), world_opts("leave")).unwrap();
    let t0 = Instant::now();
    let c2 = loop {
        match w.peer(1) {
            Ok(c) => break c,
            Err(_) if t0.elapsed() < Duration::from_secs(10) => thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("{e}"),
        }
    };
    assert!(!Arc::ptr_eq(&c, &c2));
    assert!(c2.broken().is_none());
}

/// A store whose lookups answer late: each looks once, then takes its
/// whole timeout and more to answer, as a loaded etcd can. What it
/// answers is what was there when it looked.
struct SlowLookups(MemRendezvous);

impl Rendezvous for SlowLookups {
    fn publish(&self, key: &str, value: &[u8]) -> gpu_rdma::Result<()> {
        self.0.publish(key, value)
    }
    fn lookup(&self, key: &str, timeout: Duration) -> gpu_rdma::Result<Vec<u8>> {
        let seen = self.0.lookup(key, Duration::ZERO);
        thread::sleep(timeout + Duration::from_millis(400));
        seen
    }
    fn remove(&self, key: &str) -> gpu_rdma::Result<()> {
        self.0.remove(key)
    }
    fn list(&self, prefix: &str) -> gpu_rdma::Result<Vec<(String, Vec<u8>)>> {
        self.0.list(prefix)
    }
}

/// A rank that publishes while a lookup of it is on its way is not taken
/// for gone: the lookup looked before the rank was there, and the watch
/// saw it arrive before the lookup answered.
#[test]
fn a_rank_published_while_a_late_lookup_is_out_is_dialed_not_gone() {
    let rdv: Arc<dyn Rendezvous> = Arc::new(SlowLookups(MemRendezvous::default()));
    let d = domain(Kind::Tcp);
    let w = Arc::new(World::join(&d, 0, 2, Arc::clone(&rdv), world_opts("late")).unwrap());
    let dialing = {
        let w = Arc::clone(&w);
        thread::spawn(move || w.peer(1).map(|c| c.broken().is_none()))
    };
    // Rank 1 arrives while rank 0's first lookup of it is out.
    thread::sleep(Duration::from_millis(100));
    let _one = World::join(&d, 1, 2, Arc::clone(&rdv), world_opts("late")).unwrap();
    match dialing.join().unwrap() {
        Ok(healthy) => assert!(healthy, "the dialed connection works"),
        Err(e) => panic!("rank 1 published while it was looked up, and dialing it failed: {e}"),
    }
}

/// Rank 2's endpoint published under rank 1's key (a stale entry, or a
/// port another rank now uses): dialing rank 1 is refused, typed, naming
/// both, not a silent connection to rank 2; once rank 1 publishes, it is
/// dialed.
#[test]
fn a_dialed_peer_that_is_not_the_rank_asked_for_is_refused() {
    let rdv: Arc<dyn Rendezvous> = Arc::new(MemRendezvous::default());
    let d = domain(Kind::Tcp);
    let w0 = World::join(&d, 0, 3, Arc::clone(&rdv), world_opts("who")).unwrap();
    let _w2 = World::join(&d, 2, 3, Arc::clone(&rdv), world_opts("who")).unwrap();
    let two = rdv.lookup("who/rank/2", Duration::ZERO).unwrap();
    rdv.publish("who/rank/1", &two).unwrap();
    let t0 = Instant::now();
    match w0.peer(1) {
        Err(Error::PeerMismatch { expected, found, .. }) => {
            assert_eq!((expected.as_str(), found.as_str()), ("who/rank/1", "who/rank/2"));
        }
        other => panic!("rank 2 taken for rank 1: {:?}", other.map(|c| c.info().peer_name.clone())),
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let _w1 = World::join(&d, 1, 3, Arc::clone(&rdv), world_opts("who")).unwrap();
    let c = w0.peer(1).expect("rank 1, once it published");
    assert_eq!(c.info().peer_name, b"who/rank/1");
}

/// A connection claiming a rank whose connection to this rank is live does
/// not displace it, unless the world's connections are authenticated (a
/// shared secret): then a restarted rank takes over at once.
#[test]
fn a_claim_to_a_rank_displaces_its_live_connection_only_when_authenticated() {
    for secret in [None, Some("job secret")] {
        let rdv: Arc<dyn Rendezvous> = Arc::new(MemRendezvous::default());
        let d = domain(Kind::Tcp);
        let base = world_opts("claim");
        let connect = match secret {
            Some(s) => base.connect.clone().secret(gpu_rdma::Secret::new(s).unwrap()),
            None => base.connect.clone().no_secret(),
        };
        let o = base.connect(connect);
        let w0 = World::join(&d, 0, 2, Arc::clone(&rdv), o.clone()).unwrap();
        let w1 = World::join(&d, 1, 2, Arc::clone(&rdv), o.clone()).unwrap();
        w1.peer(0).unwrap();
        let first = w0.accepted(1, Duration::from_secs(10)).unwrap();
        // Someone else says it is rank 1.
        let addr = Endpoint::from_bytes(&rdv.lookup("claim/rank/0", Duration::ZERO).unwrap()).unwrap().addr;
        let claim = d.connect(addr, &o.connect.clone().name("claim/rank/1")).unwrap();
        thread::sleep(Duration::from_millis(300));
        let now = w0.accepted(1, Duration::from_secs(10)).unwrap();
        if secret.is_none() {
            assert!(Arc::ptr_eq(&first, &now), "an unauthenticated claim displaced rank 1's live connection");
            assert!(first.broken().is_none());
            let refused = (0..100).any(|_| {
                thread::sleep(Duration::from_millis(20));
                claim.broken().is_some()
            });
            assert!(refused, "the claim was kept open");
        } else {
            assert!(!Arc::ptr_eq(&first, &now), "an authenticated rank 1 did not take over");
            assert!(claim.broken().is_none());
        }
    }
}

both!(
    ranks_reach_each_other_on_first_use,
    the_pool_is_bounded,
    a_slow_handshake_blocks_no_other_rank,
    a_rank_that_leaves_is_gone_until_it_comes_back,
);
