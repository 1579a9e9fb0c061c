//! Hostile local stores: a directory rendezvous whose directory holds
//! what an attacker (or an accident) put there: FIFOs, links to devices,
//! huge sparse files, stray directories, links planted where this side
//! writes. Every call stays inside its timeout, reads no more than a
//! value's limit, skips and counts what is not a value, and a World on
//! such a directory keeps working and keeps noticing ranks that leave.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use gpu_rdma::rendezvous::{DirRendezvous, MAX_VALUE, Rendezvous};
use gpu_rdma::{ConnectOptions, Domain, DomainConfig, Error, TransportPolicy, World, WorldOptions};

/// A fresh directory of its own for each test.
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gpu-rdma-stores-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn mkfifo(path: &Path) {
    let ok = Command::new("mkfifo").arg(path).status().expect("mkfifo runs").success();
    assert!(ok, "mkfifo {}", path.display());
}

/// Runs `f` on a thread and waits up to `limit` for it: a call that
/// blocks past its own timeout shows as `None` (the thread is left).
fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<(T, Duration)> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let t0 = Instant::now();
        let v = f();
        let _ = tx.send((v, t0.elapsed()));
    });
    rx.recv_timeout(limit).ok()
}

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()).unwrap_or(0) * 4096
}

/// A FIFO, a link to `/dev/zero`, a huge sparse file, a stray directory,
/// a link that loops: each under the prefix, next to a real value. A
/// lookup of any of them ends at its timeout with an error naming what
/// is there; a listing skips them (counted) and returns the real value;
/// nothing is read past a value's limit.
#[test]
fn entries_that_are_not_values_neither_block_nor_fail_lookups_and_listings() {
    let d = dir("entries");
    let rdv = Arc::new(DirRendezvous::new(&d).unwrap());
    rdv.publish("job/rank/0", b"real").unwrap();
    mkfifo(&d.join("job%rank%1"));
    std::os::unix::fs::symlink("/dev/zero", d.join("job%rank%2")).unwrap();
    let sparse = std::fs::File::create(d.join("job%rank%3")).unwrap();
    sparse.set_len(64 << 30).unwrap();
    std::fs::create_dir(d.join("job%rank%4")).unwrap();
    std::os::unix::fs::symlink(d.join("job%rank%5"), d.join("job%rank%5")).unwrap();
    let base = resident_bytes();

    for (rank, what) in [(1, "FIFO"), (2, "symbolic link"), (3, "over the"), (4, "directory"), (5, "symbolic link")] {
        let r = Arc::clone(&rdv);
        let key = format!("job/rank/{rank}");
        let got = bounded(Duration::from_secs(10), move || r.lookup(&key, Duration::from_millis(300)));
        let Some((got, took)) = got else {
            panic!("rank {rank}: a lookup with a 300 ms timeout still blocks after 10 s")
        };
        println!("rank {rank}: {got:?} after {took:?}");
        match got {
            Err(Error::Rendezvous { reason, .. }) => assert!(reason.contains(what), "rank {rank}: {reason}"),
            other => panic!("rank {rank}: {other:?}"),
        }
        assert!(took < Duration::from_secs(2), "rank {rank}: {took:?}");
    }
    let r = Arc::clone(&rdv);
    let (listed, took) = bounded(Duration::from_secs(10), move || r.list("job/")).expect("a listing returns");
    assert_eq!(listed.unwrap(), vec![("job/rank/0".to_owned(), b"real".to_vec())], "only the value");
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(rdv.skipped() >= 10, "skipped {}", rdv.skipped());
    let grew = resident_bytes().saturating_sub(base);
    assert!(grew < 2 * MAX_VALUE as u64 + (8 << 20), "grew by {grew} bytes reading what is not a value");
    // A value published over any of them (a rename) is read again.
    rdv.publish("job/rank/1", b"now a value").unwrap();
    assert_eq!(rdv.lookup("job/rank/1", Duration::ZERO).unwrap(), b"now a value");
    let _ = std::fs::remove_dir_all(&d);
}

/// A value just over the limit is refused on publish and skipped on read;
/// one at the limit goes through.
#[test]
fn values_are_bounded_both_ways() {
    let d = dir("bounded");
    let rdv = DirRendezvous::new(&d).unwrap();
    assert!(matches!(rdv.publish("k", &vec![1; MAX_VALUE + 1]), Err(Error::InvalidArgument(_))));
    rdv.publish("k", &vec![1; MAX_VALUE]).unwrap();
    assert_eq!(rdv.lookup("k", Duration::ZERO).unwrap().len(), MAX_VALUE);
    std::fs::write(d.join("big"), vec![2; MAX_VALUE + 1]).unwrap();
    assert!(matches!(rdv.lookup("big", Duration::from_millis(50)), Err(Error::Rendezvous { .. })));
    assert_eq!(rdv.list("").unwrap().len(), 1, "the one value at the limit");
    let _ = std::fs::remove_dir_all(&d);
}

/// A link planted where a publish writes its temporary file is not
/// followed: the file it points to keeps its contents.
#[test]
fn a_publish_never_writes_through_a_planted_link() {
    let d = dir("planted");
    let rdv = DirRendezvous::new(&d).unwrap();
    let victim = d.join("victim-file");
    std::fs::write(&victim, b"precious").unwrap();
    // Every temporary name this process could try first.
    for attempt in 0..4 {
        let tmp = d.join(format!(".job%rank%0.{}.{attempt}.tmp", std::process::id()));
        std::os::unix::fs::symlink(&victim, tmp).unwrap();
    }
    rdv.publish("job/rank/0", b"endpoint").unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert_eq!(rdv.lookup("job/rank/0", Duration::ZERO).unwrap(), b"endpoint");
    let _ = std::fs::remove_dir_all(&d);
}

fn tcp_domain() -> Domain {
    Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).unwrap()
}

fn world_opts(job: &str) -> WorldOptions {
    WorldOptions::new(job)
        .connect(ConnectOptions::default().handshake_timeout(Duration::from_secs(3)))
        .lookup_timeout(Duration::from_secs(2))
}

/// Ranks join a directory that holds a stray directory, a FIFO and a
/// dangling link under the job's prefix: joining works, a peer that is
/// a FIFO fails within the lookup timeout, and a rank that leaves is still
/// noticed by the others' watch.
#[test]
fn a_world_on_a_littered_directory_joins_and_notices_ranks_that_leave() {
    let d = dir("world");
    std::fs::create_dir(d.join("job%rank%7")).unwrap();
    mkfifo(&d.join("job%rank%2"));
    std::os::unix::fs::symlink("/nonexistent", d.join("job%rank%6")).unwrap();
    let rdv: Arc<dyn Rendezvous> = Arc::new(DirRendezvous::new(&d).unwrap());
    let domain = tcp_domain();
    let w0 = World::join(&domain, 0, 8, Arc::clone(&rdv), world_opts("job")).expect("rank 0 joins");
    let w1 = World::join(&domain, 1, 8, Arc::clone(&rdv), world_opts("job")).expect("rank 1 joins");
    w0.peer(1).expect("rank 0 reaches rank 1");
    let t0 = Instant::now();
    let e = w0.peer(2).unwrap_err();
    println!("peer(2) after {:?}: {e}", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(8), "past the lookup timeout: {:?}", t0.elapsed());
    assert!(w0.watch_failing().is_none(), "{:?}", w0.watch_failing());
    drop(w1);
    let gone = (0..100).any(|_| {
        thread::sleep(Duration::from_millis(50));
        matches!(w0.peer(1), Err(Error::PeerGone { .. }))
    });
    assert!(gone, "rank 1 left and rank 0 did not notice");
    drop(w0);
    let _ = std::fs::remove_dir_all(&d);
}

/// A store that cannot be listed any more is said, not swallowed: the
/// world's watch reports it, and reports when it can see again.
#[test]
fn a_world_says_when_its_rendezvous_cannot_be_watched() {
    let d = dir("unwatchable");
    let rdv: Arc<dyn Rendezvous> = Arc::new(DirRendezvous::new(&d).unwrap());
    let w = World::join(&tcp_domain(), 0, 2, rdv, world_opts("job")).unwrap();
    assert!(w.watch_failing().is_none());
    std::fs::remove_dir_all(&d).unwrap();
    let failing = (0..100).find_map(|_| {
        thread::sleep(Duration::from_millis(20));
        w.watch_failing()
    });
    println!("{failing:?}");
    assert!(failing.is_some(), "the watch went blind silently");
    std::fs::create_dir_all(&d).unwrap();
    let back = (0..100).any(|_| {
        thread::sleep(Duration::from_millis(20));
        w.watch_failing().is_none()
    });
    assert!(back, "the watch did not say it can see again");
    drop(w);
    let _ = std::fs::remove_dir_all(&d);
}
