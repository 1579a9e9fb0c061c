//! No heap allocation per operation in steady state, for host memory: a
//! counting global allocator (every thread) over 10,000 operations of each
//! kind, after a warm-up, on TCP here and on verbs (rxe0) in the guest.
//!
//! One test per transport in this binary, run one at a time, so nothing
//! else allocates while the window is open.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::{Kind, domain};
use gpu_rdma::Access;

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; the
// bookkeeping neither allocates nor touches the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

static SERIAL: Mutex<()> = Mutex::new(());

/// Allocations made by `f`, on every thread.
fn allocations(f: impl FnOnce()) -> u64 {
    ALLOCS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    f();
    COUNTING.store(false, Ordering::SeqCst);
    ALLOCS.load(Ordering::SeqCst)
}

fn steady_state(kind: Kind) {
    const OPS: u32 = 10_000;
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = domain(kind);
    let target = d.expose(d.alloc(4096).unwrap(), Access::REMOTE_WRITE | Access::REMOTE_READ, 1).unwrap();
    let (s, c) = common::pair_on(&d, &d, common::opts().advertise(&target), common::opts());
    let remote = c.remote_region(1).unwrap().whole();
    let mut src = Some(d.alloc(4096).unwrap());
    let mut rx = Some(d.alloc(4096).unwrap());
    // Made by the last case's warm-up: its slots would take the others' messages.
    let mut ring = None;
    let mut op = |what: &str| match what {
        "write" => {
            let (_, b) = c.write(src.take().unwrap(), &remote).finish().unwrap();
            src = Some(b);
        }
        "read" => {
            let (_, b) = c.read(src.take().unwrap(), &remote).finish().unwrap();
            src = Some(b);
        }
        "send+recv" => {
            let r = s.recv(rx.take().unwrap());
            let (_, b) = c.send(src.take().unwrap().slice(..64)).finish().unwrap();
            src = Some(b);
            let (_, b) = r.finish().unwrap();
            rx = Some(b);
        }
        "receive ring" => {
            let ring = ring.get_or_insert_with(|| s.recv_ring(d.alloc(4 * 64).unwrap(), 64, 4));
            c.send_inline_untracked(b"sixteen bytes!!!", Some(5)).unwrap();
            let got = ring.next().unwrap();
            assert_eq!((got.len(), got.imm(), &got[..]), (16, Some(5), &b"sixteen bytes!!!"[..]));
        }
        "untracked inline send" => {
            let r = s.recv(rx.take().unwrap());
            c.send_inline_untracked(b"sixteen bytes!!!", Some(9)).unwrap();
            let (done, b) = r.finish().unwrap();
            assert_eq!((done.byte_len, done.imm), (16, Some(9)));
            rx = Some(b);
        }
        _ => {
            let r = s.recv(rx.take().unwrap());
            c.send_inline(b"sixteen bytes!!!", Some(7)).finish().unwrap();
            let (done, b) = r.finish().unwrap();
            assert_eq!((done.byte_len, done.imm), (16, Some(7)));
            rx = Some(b);
        }
    };
    let mut report = Vec::new();
    for what in ["write", "read", "send+recv", "inline send", "untracked inline send", "receive ring"] {
        for _ in 0..1000 {
            op(what); // warm-up: queues and tables reach their steady size
        }
        let n = allocations(|| {
            for _ in 0..OPS {
                op(what);
            }
        });
        report.push(format!("{what}: {n} allocations in {OPS}"));
    }
    println!("{}: {}", kind.name(), report.join("; "));
    for line in &report {
        assert!(line.contains(": 0 allocations"), "{}: {line}", kind.name());
    }
}

#[test]
fn tcp_operations_allocate_nothing_in_steady_state() {
    steady_state(Kind::Tcp);
}

#[test]
#[ignore = "verbs: needs an RDMA device: GPU_RDMA_TEST_DEVICE=<dev> and --ignored (cargo xtask test runs it on soft-RoCE)"]
fn verbs_operations_allocate_nothing_in_steady_state() {
    steady_state(Kind::Verbs);
}
