//! Churn: thousands of connect / transfer / disconnect cycles (each with a
//! transfer list and an operation awaited as a future, dropped mid-flight
//! every other time), then the
//! process's open file descriptors, the domain's live resources (and, on
//! verbs, the kernel's count of queue pairs, completion queues and memory
//! regions) are back where they started, and resident memory has not
//! grown with the cycle count.
//!
//! One test per binary run (the TCP one here; the verbs one, `--ignored`,
//! in the soft-RoCE guest), so that nothing else in the process moves the
//! counts.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use std::future::Future;

use gpu_rdma::{Access, ConnectOptions, Domain, Piece};

use common::{Kind, domain, pattern};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    pages * 4096
}

/// The kernel's verbs objects (`rdma resource show`), if the tool is there.
fn kernel_verbs_objects() -> Option<String> {
    let out = std::process::Command::new("rdma").args(["resource", "show"]).output().ok()?;
    out.status.success().then(|| {
        // "0: rxe0: pd 1 cq 2 qp 1 cm_id 0 mr 0 ctx 1 srq 0": keep the counts
        // of the device under test.
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.contains(&common::device()))
            .unwrap_or("")
            .trim()
            .to_owned()
    })
}

#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    fds: usize,
    stats: gpu_rdma::DomainStats,
    kernel: Option<String>,
}

fn snapshot(d: &Domain, t: Kind) -> Snapshot {
    Snapshot { fds: open_fds(), stats: d.stats(), kernel: if t == Kind::Verbs { kernel_verbs_objects() } else { None } }
}

/// One cycle: connect, write with immediate into the server's region,
/// read it back, exchange a message, disconnect.
fn cycle(d: &Domain, listener: &gpu_rdma::Listener, target: &gpu_rdma::Exposed, i: u64) {
    let opts = ConnectOptions::default()
        .handshake_timeout(Duration::from_secs(20))
        .op_timeout(Duration::from_secs(20))
        .queue_depth(8, 8);
    let addr = listener.local_addr().unwrap();
    let server_opts = opts.clone().advertise(target);
    let (s, c) = thread::scope(|sc| {
        let accepted = sc.spawn(|| listener.accept_timeout(&server_opts, Duration::from_secs(20)));
        let c = d.connect(addr, &opts).unwrap_or_else(|e| panic!("cycle {i}: connect: {e}"));
        (accepted.join().unwrap().unwrap_or_else(|e| panic!("cycle {i}: accept: {e}")), c)
    });
    let remote = c.remote_region(7).expect("advertised");
    let slot = (i % 16) * 4096;
    let data = pattern(4096, i);
    let mut src = d.alloc(4096).unwrap();
    src.copy_from_slice(&data);
    let mut landed = s.recv_imm();
    c.write_with_imm(src, &remote.slice(slot..slot + 4096).unwrap(), i as u32).wait().unwrap();
    assert_eq!(landed.wait().unwrap().imm, Some(i as u32));
    let (_, back) = c.read(d.alloc(4096).unwrap(), &remote.slice(slot..slot + 4096).unwrap()).finish().unwrap();
    assert!(back[..] == data[..], "cycle {i}: read back something else");
    let mut rx = s.recv(d.alloc(64).unwrap());
    c.send_inline(&i.to_le_bytes(), None).wait().unwrap();
    assert_eq!(rx.wait().unwrap().byte_len, 8);
    // A transfer list (longer than the queue) dropped mid-flight or
    // finished, and an operation polled once as a future and dropped: the
    // engine's tasks, timers and watches leave nothing behind.
    let pieces = (0..64u64).map(|k| Piece::new(k * 64, ((k * 7) % 64) * 64, 64));
    let list = c.write_list(d.alloc(4096).unwrap(), &remote.slice(0..4096).unwrap(), pieces);
    if i % 2 == 0 {
        drop(list);
    } else {
        list.finish().unwrap_or_else(|e| panic!("cycle {i}: list: {e}"));
    }
    let mut op = c.write(d.alloc(64).unwrap(), &remote.slice(0..64).unwrap());
    let _ = std::pin::Pin::new(&mut op).poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
    drop(op);
    // Alternate who closes first.
    if i % 2 == 0 {
        drop(c);
        drop(s);
    } else {
        drop(s);
        drop(c);
    }
}

fn churn(t: Kind, cycles: u64) {
    // GPU_RDMA_CHURN_CYCLES changes the count (to see how memory grows with it).
    let cycles = std::env::var("GPU_RDMA_CHURN_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(cycles);
    let d = domain(t);
    let target = d.expose(d.alloc(16 * 4096).unwrap(), Access::REMOTE_WRITE | Access::REMOTE_READ, 7).unwrap();
    let listener = d.listen("127.0.0.1:0").unwrap();
    // Warm up: lazily made things (the stager, thread-local buffers,
    // allocator arenas) exist before the first count.
    for i in 0..20 {
        cycle(&d, &listener, &target, i);
    }
    let before = snapshot(&d, t);
    let rss_before = resident_bytes();
    let t0 = Instant::now();
    for i in 0..cycles {
        cycle(&d, &listener, &target, i);
    }
    let took = t0.elapsed();
    // Torn-down connections finish closing on their own threads: give the
    // counts a moment to settle, then they must be exact.
    let mut after = snapshot(&d, t);
    let settle = Instant::now();
    while after != before && settle.elapsed() < Duration::from_secs(10) {
        thread::sleep(Duration::from_millis(50));
        after = snapshot(&d, t);
    }
    let rss_after = resident_bytes();
    let grown = rss_after.saturating_sub(rss_before);
    println!(
        "{} churn: {cycles} cycles in {:.1} s ({:.2} ms each); before {before:?}; after {after:?}; \
         resident {} -> {} KiB (+{} KiB)",
        t.name(),
        took.as_secs_f64(),
        took.as_secs_f64() * 1e3 / cycles as f64,
        rss_before / 1024,
        rss_after / 1024,
        grown / 1024
    );
    if t == Kind::Verbs && before.kernel.is_none() {
        println!("verbs churn: the `rdma` tool is not here: kernel object counts not checked");
    }
    assert_eq!(after, before, "descriptors, domain resources or kernel objects leaked");
    // A leak of one 4 KiB buffer per cycle would be 40 MB over 10,000.
    assert!(grown < 8 << 20, "resident memory grew by {grown} bytes over {cycles} cycles");
    drop((listener, target));
    assert_eq!(d.stats(), gpu_rdma::DomainStats::default(), "everything released");
}

#[test]
fn tcp_ten_thousand_connect_transfer_disconnect_cycles_leak_nothing() {
    churn(Kind::Tcp, 10_000);
}

#[test]
#[ignore = "verbs: needs an RDMA device: GPU_RDMA_TEST_DEVICE=<dev> and --ignored (cargo xtask test runs it on soft-RoCE)"]
fn verbs_a_thousand_connect_transfer_disconnect_cycles_leak_nothing() {
    churn(Kind::Verbs, 1_000);
}
