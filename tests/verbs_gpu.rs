//! GPU memory over verbs: the path choice, the nvidia-peermem call path and
//! the staged pipeline end to end, verified byte for byte.
//!
//! Needs an RDMA device and a CUDA driver. CI runs these in the soft-RoCE
//! guest against the test-only CUDA stand-in (`cuda-stub/`), preloaded so
//! that it also plays nvidia-peermem: device memory faults for the CPU,
//! and `ibv_reg_mr` on a device pointer registers its pages for the NIC, as
//! the kernel module makes it on a GPU machine. dma-buf is refused by rxe,
//! as it must fall back. `#[ignore]`d otherwise.

#![cfg(feature = "cuda")]

mod common;

use std::time::{Duration, Instant};

use gpu_rdma::cuda::{CudaBuffer, CudaDevice};
use gpu_rdma::memory::path::{MemPath, Outcome, PathPolicy};
use gpu_rdma::{Access, ConnectOptions, Connection, Domain, Error, Exposed, LocalBuffer, Pending, Region, Shared};

use common::{first_difference, opts, pair_on, pattern, verbs_domain as domain};

macro_rules! gpu_test {
    ($(#[$m:meta])* fn $name:ident() $body:block) => {
        $(#[$m])*
        #[test]
        #[ignore = "verbs+cuda: needs an RDMA device and a CUDA driver (cargo xtask test runs it on soft-RoCE with the CUDA stand-in)"]
        fn $name() $body
    };
}

fn gpu() -> CudaDevice {
    CudaDevice::open(0).expect("CUDA device 0 (the stand-in on LD_LIBRARY_PATH, or a GPU)")
}

fn gpu_region(d: &Domain, len: usize, data: Option<&[u8]>, policy: PathPolicy) -> Region<CudaBuffer> {
    common::gpu::gpu_region_on(d, &gpu(), len, data, policy)
}

fn read_gpu(buf: &CudaBuffer, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    buf.copy_to_host(0, &mut out).unwrap();
    out
}

fn staging_opts() -> ConnectOptions {
    opts().staging(1 << 20, 4)
}

gpu_test! {
    /// See [`common::gpu::staged_bursts`]: the slots registered with the
    /// device are kept for the next burst.
    fn a_second_staged_burst_finds_its_slots_in_the_cache() {
        let d = domain();
        let (first, second, freed) = common::gpu::staged_bursts(&d, PathPolicy::Force(MemPath::Staged), 72);
        println!("staging slots pinned and registered: {first} by the first burst of 72, {second} by the second, {freed} freed");
        assert!((1..=72).contains(&first), "the first burst pins what it needs: {first}");
        // Every slot the first burst pinned was kept and served the second,
        // which pinned only what it held at once beyond the first.
        assert_eq!(freed, 0, "the cache freed {freed} slot(s) a burst had needed");
        assert!(first + second <= 72, "the second burst pinned anew what the first had: {first} then {second}");
    }
}

gpu_test! {
    /// See [`common::gpu::reserved_staging_serves_and_stays`]: reserved
    /// slots are registered with the device once.
    fn reserved_staging_slots_serve_the_operations_and_stay() {
        let d = domain();
        let pinned = common::gpu::reserved_staging_serves_and_stays(&d, PathPolicy::Force(MemPath::Staged));
        assert_eq!(pinned, 0, "every slot came from the reservation");
    }
}

gpu_test! {
    /// See [`common::gpu::awaited_staged_round_trips`]: on verbs, each
    /// completion is seen by the progress engine watching the connection.
    fn an_awaited_staged_receive_moves_the_write_nobody_awaits() {
        let d = domain();
        let n = common::gpu::awaited_staged_round_trips(&d, PathPolicy::Force(MemPath::Staged));
        println!("{n} awaited staged round trips verified on verbs");
    }
}

gpu_test! {
    fn auto_path_on_soft_roce_falls_back_to_staged_and_says_why() {
        let d = domain();
        let r = gpu_region(&d, 1 << 20, None, PathPolicy::Auto);
        let report = r.path_report().expect("GPU memory has a path report").clone();
        assert_eq!(report.chosen, MemPath::Staged, "{report}");
        let text = report.to_string();
        assert!(text.starts_with("staged: "), "{text}");
        let dmabuf = &report.outcomes.iter().find(|(p, _)| *p == MemPath::DmaBuf).unwrap().1;
        match dmabuf {
            // rxe cannot register dma-bufs: tried and refused, with the reason.
            Outcome::Failed(reason) => assert!(reason.contains("ibv_reg_dmabuf_mr"), "{reason}"),
            // Built against rdma-core without dma-buf, or an old kernel: not tried.
            Outcome::Skipped(reason) => assert!(!reason.is_empty()),
            Outcome::Chosen => panic!("dma-buf cannot work on soft-RoCE: {text}"),
        }
        let peermem = &report.outcomes.iter().find(|(p, _)| *p == MemPath::PeerMem).unwrap().1;
        match peermem {
            // The module is not loaded (CI, most machines without an RDMA NIC).
            Outcome::Skipped(r) => assert!(r.contains("nvidia_peermem not loaded") || r.contains("GPUDirect"), "{text}"),
            // Loaded, but soft-RoCE cannot pin GPU pages.
            Outcome::Failed(r) => assert!(r.contains("device pointer"), "{text}"),
            Outcome::Chosen => panic!("soft-RoCE cannot reach GPU memory: {text}"),
        }
        eprintln!("auto path report: {text}");
        assert_eq!(r.memory_path(), Some(MemPath::Staged));
    }
}

gpu_test! {
    fn a_forced_path_that_fails_is_a_typed_error_and_gives_the_buffer_back() {
        let d = domain();
        let buf = CudaBuffer::alloc(&gpu(), 1 << 20).unwrap();
        match d.register_with_path(buf, Access::LOCAL_WRITE, PathPolicy::Force(MemPath::DmaBuf)) {
            Ok(r) => panic!("dma-buf cannot work on soft-RoCE: {:?}", r.path_report()),
            Err(e) => {
                assert!(e.error.is_not_supported() || matches!(e.error, Error::Verbs { .. }), "{}", e.error);
                assert_eq!(e.buffer.len(), 1 << 20, "the buffer comes back");
            }
        }
    }
}

gpu_test! {
    fn forced_peermem_registers_the_device_pointer_and_warns() {
        let d = domain();
        let r = gpu_region(&d, 1 << 20, None, PathPolicy::Force(MemPath::PeerMem));
        let report = r.path_report().unwrap();
        assert_eq!(report.chosen, MemPath::PeerMem);
        assert!(report.warnings.iter().any(|w| w.contains("nvidia_peermem not loaded")), "{report}");
        assert_ne!(r.lkey(), 0);
    }
}

/// Writes, reads back and sends `len` bytes GPU to GPU between two domains
/// (two "processes"), both sides on `path`, verifying every byte.
fn gpu_to_gpu(path: MemPath, len: usize) {
    let policy = PathPolicy::Force(path);
    let (ds, dc) = (domain(), domain());
    let data = pattern(len, path as u64 + 1);

    let target = ds.expose(gpu_region(&ds, len, None, policy), Access::REMOTE_WRITE | Access::REMOTE_READ, 1).unwrap();
    let (s, c) = pair_on(&ds, &dc, staging_opts().advertise(&target), staging_opts());
    let remote = c.remote_region(1).unwrap();

    // RDMA WRITE, then a zero-byte send that tells the owner it is done.
    let t0 = Instant::now();
    let mut done = s.recv_write(&target);
    let (_, src) = c.write(gpu_region(&dc, len, Some(&data), policy), &remote.whole()).finish().unwrap();
    c.send_inline(&[], Some(1)).wait().unwrap();
    done.wait().unwrap();
    let got = read_gpu(target.cuda(), len);
    assert_eq!(first_difference(&got, &data), None, "{path}: write corrupted data");
    eprintln!("{path}: write of {len} bytes verified in {:?}", t0.elapsed());

    // RDMA READ of what was written.
    let t0 = Instant::now();
    target.publish().unwrap();
    let (c1, dst) = c.read(gpu_region(&dc, len, None, policy), &remote.whole()).finish().unwrap();
    assert_eq!(c1.byte_len as usize, len);
    assert_eq!(first_difference(&read_gpu(dst.memory(), len), &data), None, "{path}: read corrupted data");
    eprintln!("{path}: read of {len} bytes verified in {:?}", t0.elapsed());

    // SEND, in messages of at most the maximum message size: every receive
    // posted first, the sends with a window.
    let t0 = Instant::now();
    let max = c.info().max_message_size as usize;
    let rx_buf = gpu_region(&ds, len, None, policy).share();
    let tx_buf = src.share();
    let chunks: Vec<_> = (0..len).step_by(max).map(|o| o..(o + max).min(len)).collect();
    assert!(chunks.len() <= s.info().recv_queue_depth as usize, "{} messages", chunks.len());
    let mut rx: Vec<Pending<Shared<CudaBuffer>>> =
        chunks.iter().map(|r| s.recv(rx_buf.clone().slice(r.clone()))).collect();
    let mut tx: std::collections::VecDeque<Pending<Shared<CudaBuffer>>> = Default::default();
    for r in &chunks {
        if tx.len() >= 8 {
            tx.pop_front().unwrap().wait().unwrap();
        }
        tx.push_back(c.send(tx_buf.clone().slice(r.clone())));
    }
    for mut p in tx {
        p.wait().unwrap();
    }
    let received: usize = rx.iter_mut().map(|p| p.wait().unwrap().byte_len as usize).sum();
    assert_eq!(received, len);
    drop(rx);
    let got = read_gpu(rx_buf.cuda(), len);
    assert_eq!(first_difference(&got, &data), None, "{path}: send corrupted data");
    eprintln!("{path}: send of {len} bytes verified in {:?}", t0.elapsed());
}

gpu_test! {
    fn gpu_to_gpu_256_mib_by_write_read_and_send_through_the_peermem_call_path() {
        gpu_to_gpu(MemPath::PeerMem, 256 << 20);
    }
}

gpu_test! {
    fn gpu_to_gpu_256_mib_by_write_read_and_send_through_the_staged_path() {
        gpu_to_gpu(MemPath::Staged, 256 << 20);
    }
}

gpu_test! {
    fn a_direct_sender_and_a_staged_receiver_interoperate() {
        let (ds, dc) = (domain(), domain());
        let len = 3 << 20;
        let data = pattern(len, 40);
        let target = ds
            .expose(gpu_region(&ds, len, None, PathPolicy::Force(MemPath::Staged)), Access::REMOTE_WRITE, 2)
            .unwrap();
        let (s, c) = pair_on(&ds, &dc, staging_opts().advertise(&target), staging_opts());
        let direct = gpu_region(&dc, len, Some(&data), PathPolicy::Force(MemPath::PeerMem));
        // A one-sided write lands in the staged region's host mirror, and only
        // the owner's recv_write moves it into GPU memory.
        let mut done = s.recv_write(&target);
        let (_, direct) = c.write_with_imm(direct, &c.remote_region(2).unwrap().whole(), 9).finish().unwrap();
        assert_eq!(done.wait().unwrap().imm, Some(9));
        assert_eq!(first_difference(&read_gpu(target.cuda(), len), &data), None);
        // A direct send into a staged receive.
        let mut rx = s.recv(gpu_region(&ds, len, None, PathPolicy::Force(MemPath::Staged)));
        c.send(direct).wait().unwrap();
        assert_eq!(rx.wait().unwrap().byte_len as usize, len);
        let got = rx.into_buffer().unwrap();
        assert_eq!(first_difference(&read_gpu(got.memory(), len), &data), None);
    }
}

gpu_test! {
    fn a_staged_write_with_immediate_arrives_after_all_its_chunks() {
        let (ds, dc) = (domain(), domain());
        let len = 6 << 20; // six 1 MiB chunks; the immediate rides on the last
        let target = ds.expose(ds.alloc(len).unwrap(), Access::REMOTE_WRITE, 3).unwrap();
        let (s, c) = pair_on(&ds, &dc, opts().advertise(&target), staging_opts());
        let data = pattern(len, 41);
        let mut note = s.recv_imm();
        let mut w = c.write_with_imm(
            gpu_region(&dc, len, Some(&data), PathPolicy::Force(MemPath::Staged)),
            &c.remote_region(3).unwrap().whole(),
            77,
        );
        w.wait().unwrap();
        assert_eq!(note.wait().unwrap().imm, Some(77));
        let mut got = vec![0u8; len];
        target.read_at(0, &mut got).unwrap();
        assert_eq!(first_difference(&got, &data), None, "data must be complete when the immediate arrives");
    }
}

gpu_test! {
    fn receives_into_direct_gpu_memory_flush_remote_writes() {
        let (ds, dc) = (domain(), domain());
        let (s, c) = pair_on(&ds, &dc, opts(), opts());
        let before = stub_flush_count();
        let mut rx = s.recv(gpu_region(&ds, 1 << 16, None, PathPolicy::Force(MemPath::PeerMem)));
        c.send_inline(b"flush me", None).wait().unwrap();
        rx.wait().unwrap();
        let got = rx.into_buffer().unwrap();
        assert_eq!(&read_gpu(got.memory(), 8), b"flush me");
        let policy = gpu().flush_policy();
        if let (Some(b), Some(a)) = (before, stub_flush_count()) {
            // The stand-in reports ordering "none" with a host flush available.
            assert_eq!(policy, gpu_rdma::cuda::FlushPolicy::Flush);
            assert!(a > b, "cuFlushGPUDirectRDMAWrites was not called ({b} -> {a})");
        }
    }
}

gpu_test! {
    /// A write with immediate into direct GPU memory, taken by a receive
    /// that does not name the region: its completion flushes the remote
    /// writes (an immediate names no range), and the bytes are there.
    fn a_write_with_immediate_into_direct_gpu_memory_is_flushed_before_its_receive_completes() {
        let (ds, dc) = (domain(), domain());
        let len = 1 << 20;
        let exposed = ds
            .expose(gpu_region(&ds, len, None, PathPolicy::Force(MemPath::PeerMem)), Access::REMOTE_WRITE, 8)
            .unwrap();
        let (s, c) = pair_on(&ds, &dc, opts().advertise(&exposed), opts());
        let remote = c.remote_region(8).unwrap().slice(4096..4096 + 8192).unwrap();
        let data = pattern(8192, 81);
        for round in 0..2u32 {
            let mut src = dc.alloc(8192).unwrap();
            src.copy_from_slice(&data);
            let before = stub_flush_count();
            let imm = if round == 0 {
                let mut rx = s.recv_imm();
                c.write_with_imm(src, &remote, round).wait().unwrap();
                rx.wait().unwrap().imm
            } else {
                let mut rx = s.recv(ds.alloc(64).unwrap());
                c.write_with_imm(src, &remote, round).wait().unwrap();
                rx.wait().unwrap().imm
            };
            assert_eq!(imm, Some(round));
            assert_eq!(first_difference(&read_gpu(exposed.cuda(), len)[4096..4096 + 8192], &data), None);
            if let (Some(b), Some(a)) = (before, stub_flush_count()) {
                assert!(a > b, "round {round}: the receive completed without a flush ({b} -> {a})");
            }
        }
    }
}

gpu_test! {
    /// A write with immediate into a staged GPU region over verbs, taken
    /// by a receive that does not name the region (`recv_imm`, a host
    /// receive, a receive ring; several in flight at once; the last piece
    /// of a staged source split into chunks; two in one batch): when the
    /// receive completes the bytes are in GPU memory, and only they moved
    /// (the owner's newer data elsewhere in the region survives). An inbox
    /// on the same connection still gets its notes.
    fn a_write_with_immediate_into_staged_gpu_memory_is_visible_whatever_receive_takes_it() {
        let (ds, dc) = (domain(), domain());
        let len = 8 << 20;
        let old = pattern(len, 71);
        let exposed = ds
            .expose(gpu_region(&ds, len, Some(&old), PathPolicy::Force(MemPath::Staged)), Access::REMOTE_WRITE, 9)
            .unwrap();
        exposed.publish().unwrap();
        let (s, c) = pair_on(&ds, &dc, opts().advertise(&exposed), staging_opts());
        let newer = pattern(4096, 72);
        exposed.cuda().copy_from_host(0, &newer).unwrap();
        let mut expect = old.clone();
        expect[..4096].copy_from_slice(&newer);
        let region = c.remote_region(9).unwrap();
        let host = |data: &[u8]| {
            let mut r = dc.alloc(data.len()).unwrap();
            r.copy_from_slice(data);
            r
        };
        let check = |what: &str, expect: &[u8]| {
            assert_eq!(first_difference(&read_gpu(exposed.cuda(), len), expect), None, "{what}: GPU memory when the immediate was seen");
        };
        // One at a time, by each kind of receive (a ring last: a dropped
        // ring's receives stay posted, ahead of later ones).
        for (round, at) in [(0u32, 1usize << 20), (1, 2 << 20)] {
            let n = 64 << 10;
            let data = pattern(n, 100 + u64::from(round));
            expect[at..at + n].copy_from_slice(&data);
            let remote = region.slice(at as u64..(at + n) as u64).unwrap();
            let imm = match round {
                0 => {
                    let mut rx = s.recv_imm();
                    c.write_with_imm(host(&data), &remote, round).wait().unwrap();
                    rx.wait().unwrap().imm
                }
                _ => {
                    let mut rx = s.recv(ds.alloc(64).unwrap());
                    c.write_with_imm(host(&data), &remote, round).wait().unwrap();
                    rx.wait().unwrap().imm
                }
            };
            assert_eq!(imm, Some(round));
            check(&format!("round {round}"), &expect);
        }
        // Eight in flight, then taken in order: each visible when taken.
        let mut rxs: Vec<_> = (0..8).map(|_| s.recv_imm()).collect();
        let mut txs = Vec::new();
        let mut expects = Vec::new();
        for k in 0..8usize {
            let at = (4 << 20) + k * 8192;
            let data = pattern(8192, 200 + k as u64);
            expect[at..at + 8192].copy_from_slice(&data);
            expects.push(expect.clone());
            txs.push(c.write_with_imm(host(&data), &region.slice(at as u64..at as u64 + 8192).unwrap(), 10 + k as u32));
        }
        for (k, rx) in rxs.iter_mut().enumerate() {
            assert_eq!(rx.wait().unwrap().imm, Some(10 + k as u32));
            let gpu = read_gpu(exposed.cuda(), len);
            let at = (4 << 20) + k * 8192;
            assert_eq!(first_difference(&gpu[at..at + 8192], &expects[k][at..at + 8192]), None, "in flight: write {k}");
        }
        for t in txs {
            t.finish().unwrap();
        }
        check("eight in flight", &expect);
        // From staged GPU memory, 3 MiB in 1 MiB chunks: the cover names all of it.
        let n = 3 << 20;
        let data = pattern(n, 300);
        let at = 5 << 20;
        expect[at..at + n].copy_from_slice(&data);
        let mut rx = s.recv_imm();
        let src = gpu_region(&dc, n, Some(&data), PathPolicy::Force(MemPath::Staged));
        c.write_with_imm(src, &region.slice(at as u64..(at + n) as u64).unwrap(), 30).wait().unwrap();
        assert_eq!(rx.wait().unwrap().imm, Some(30));
        check("a staged source in chunks", &expect);
        // Two in one batch.
        let (a, b) = (pattern(4096, 400), pattern(4096, 401));
        expect[8192..12288].copy_from_slice(&a);
        expect[16384..20480].copy_from_slice(&b);
        let (mut r1, mut r2) = (s.recv_imm(), s.recv_imm());
        c.batch()
            .write_with_imm(host(&a), &region.slice(8192..12288).unwrap(), 40)
            .write_with_imm(host(&b), &region.slice(16384..20480).unwrap(), 41)
            .post()
            .wait()
            .unwrap();
        assert_eq!((r1.wait().unwrap().imm, r2.wait().unwrap().imm), (Some(40), Some(41)));
        check("a batch of two", &expect);
        let at = 3 << 20 | 512;
        let data = pattern(64 << 10, 102);
        expect[at..at + data.len()].copy_from_slice(&data);
        let mut ring = s.recv_ring(ds.alloc(4 * 64).unwrap(), 64, 4);
        c.write_with_imm(host(&data), &region.slice(at as u64..(at + data.len()) as u64).unwrap(), 2).wait().unwrap();
        assert_eq!(ring.next().unwrap().imm(), Some(2));
        check("a receive ring", &expect);
        // Notes still come through the ring the covers share.
        let mut inbox = s.inbox(1).unwrap();
        let target = ds.expose(ds.alloc(4096).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
        let t = c.write_list_notify(host(&[5; 4096]), &s.grant(&target).whole(), [gpu_rdma::Piece::new(0, 0, 4096)], 3, b"after");
        assert_eq!(&inbox.wait(3, 1).unwrap()[0].payload[..], b"after");
        t.finish().unwrap();
        assert_eq!(inbox.stats().malformed, 0);
    }
}

gpu_test! {
    /// A receive ring in GPU memory on a direct path: each message lands in
    /// its slot, byte for byte, flushed before it is lent out; on the
    /// staged path each lands in host staging and is copied into its slot.
    fn a_receive_ring_in_gpu_memory_lands_each_message_flushed_or_staged() {
        let (ds, dc) = (domain(), domain());
        // Ten messages through a fresh ring of four 64-byte slots on a
        // connection of its own, each read back from GPU memory at its
        // range; `lent` checks each loan further.
        let ring_of_ten = |path: MemPath, len: fn(u32) -> usize, lent: &dyn Fn(u32, Option<u64>)| {
            let (s, c) = pair_on(&ds, &dc, opts(), opts());
            let mut ring = s.recv_ring(gpu_region(&ds, 4 * 64, None, PathPolicy::Force(path)), 64, 4);
            assert_eq!(ring.posted(), 4);
            for k in 0..10u32 {
                let msg = pattern(len(k), u64::from(k) + 50);
                let before = stub_flush_count();
                let mut r = dc.alloc(msg.len()).unwrap();
                r.copy_from_slice(&msg);
                c.send_with_imm(r, k).wait().unwrap();
                let got = ring.next().unwrap();
                assert_eq!((got.imm(), got.len(), got.slot()), (Some(k), msg.len(), k as usize % 4), "{path:?}");
                let mut landed = vec![0u8; got.len()];
                got.buffer().memory().copy_to_host(got.range().start, &mut landed).unwrap();
                assert_eq!(first_difference(&landed, &msg), None, "{path:?}: message {k}");
                lent(k, before);
            }
        };
        // Direct: the NIC wrote GPU memory, so each message is flushed
        // before it is lent out.
        ring_of_ten(MemPath::PeerMem, |k| 1 + k as usize * 5, &|k, before| {
            if let (Some(b), Some(a)) = (before, stub_flush_count()) {
                assert!(a > b, "message {k}: lent out without a flush ({b} -> {a})");
            }
        });
        // Staged: each message lands in host staging and is copied in.
        ring_of_ten(MemPath::Staged, |k| 64 - k as usize * 5, &|_, _| {});
    }
}

gpu_test! {
    fn dropping_a_staged_operation_midway_is_safe() {
        let (ds, dc) = (domain(), domain());
        let len = 32 << 20;
        let target = ds.expose(ds.alloc(len).unwrap(), Access::REMOTE_WRITE, 4).unwrap();
        let (_s, c) = pair_on(&ds, &dc, opts().advertise(&target), staging_opts());
        let w = c.write(
            gpu_region(&dc, len, Some(&pattern(len, 42)), PathPolicy::Force(MemPath::Staged)),
            &c.remote_region(4).unwrap().whole(),
        );
        drop(w); // copies are waited for, slots on the wire stay with the connection
        let t0 = Instant::now();
        while c.in_flight().0 > 0 {
            c.progress().unwrap();
            assert!(t0.elapsed() < Duration::from_secs(120));
            std::thread::sleep(Duration::from_millis(1));
        }
        // The connection still works.
        let small = pattern(4096, 43);
        let (_, _) = c
            .write(gpu_region(&dc, 4096, Some(&small), PathPolicy::Force(MemPath::Staged)).slice(..4096), &c.remote_region(4).unwrap().slice(0..4096).unwrap())
            .finish()
            .unwrap();
        let mut got = vec![0u8; 4096];
        target.read_at(0, &mut got).unwrap();
        assert_eq!(got, small);
    }
}

gpu_test! {
    fn a_staged_region_exposed_for_reading_serves_what_was_published() {
        let (ds, dc) = (domain(), domain());
        let len = 2 << 20;
        let data = pattern(len, 44);
        let source = ds
            .expose(gpu_region(&ds, len, Some(&data), PathPolicy::Force(MemPath::Staged)), Access::REMOTE_READ, 5)
            .unwrap();
        source.publish().unwrap(); // GPU -> the host mirror peers read
        let (_s, c): (Connection, Connection) = pair_on(&ds, &dc, opts().advertise(&source), opts());
        let (_, got) = c.read(dc.alloc(len).unwrap(), &c.remote_region(5).unwrap().whole()).finish().unwrap();
        assert_eq!(first_difference(&got, &data), None);
        let _: &Exposed<CudaBuffer> = &source;
    }
}

/// The stand-in's flush counter, when the loaded libcuda is the stand-in.
fn stub_flush_count() -> Option<u64> {
    // SAFETY: RTLD_NOLOAD only finds a library already loaded (cudarc loaded it).
    let handle = unsafe { libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    // SAFETY: looking a symbol up in a loaded library.
    let sym = unsafe { libc::dlsym(handle, c"gpu_rdma_stub_flush_count".as_ptr()) };
    if sym.is_null() {
        return None; // a real driver
    }
    // SAFETY: the stand-in defines it as `extern "C" fn() -> u64`.
    let f: extern "C" fn() -> u64 = unsafe { std::mem::transmute(sym) };
    Some(f())
}

gpu_test! {
    /// A send of 8 bytes from GPU memory on a direct path: small enough to
    /// go inline, which would make the CPU copy from the device pointer (a
    /// fault on a GPU, and on the stand-in). It must be posted by
    /// reference, and arrive intact.
    fn a_small_send_from_direct_gpu_memory_is_not_inlined() {
        let (ds, dc) = (domain(), domain());
        let (s, c) = pair_on(&ds, &dc, opts(), opts());
        assert!(c.info().max_inline >= 8, "the device inlines small sends: {:?}", c.info());
        for len in [1usize, 8, 60] {
            let data = pattern(len, len as u64);
            let src = gpu_region(&dc, 1 << 16, Some(&data), PathPolicy::Force(MemPath::PeerMem));
            let mut rx = s.recv(ds.alloc(64).unwrap());
            c.send(src.slice(..len)).wait().unwrap_or_else(|e| panic!("{len}-byte GPU send: {e}"));
            assert_eq!(rx.wait().unwrap().byte_len as usize, len);
            let got = rx.into_buffer().unwrap();
            assert_eq!(&got[..len], &data[..], "{len}-byte GPU send");
        }
    }
}

gpu_test! {
    /// 1,000 iterations of "a producer kernel writes iteration i, then the
    /// region is written to the peer", verified by the peer each time, on
    /// the direct call path (the NIC reads GPU memory).
    fn a_thousand_produced_iterations_reach_the_peer_on_the_direct_path() {
        let (ds, dc) = (domain(), domain());
        let n = common::gpu::producer_loop(&ds, &dc, PathPolicy::Force(MemPath::PeerMem), 1000, 64 << 10);
        println!("{n} produced iterations verified on rxe0, peermem call path");
    }
}

gpu_test! {
    /// The same on the staged path (copies out of the GPU on a stream).
    fn a_thousand_produced_iterations_reach_the_peer_on_the_staged_path() {
        let (ds, dc) = (domain(), domain());
        let n = common::gpu::producer_loop(&ds, &dc, PathPolicy::Force(MemPath::Staged), 1000, 64 << 10);
        println!("{n} produced iterations verified on rxe0, staged path");
    }
}

gpu_test! {
    /// Two producers on two streams, each fencing its half of one buffer:
    /// a write waits for both, on the direct and on the staged path.
    fn a_write_waits_for_every_producers_fence_on_rxe0() {
        for path in [MemPath::PeerMem, MemPath::Staged] {
            let (ds, dc) = (domain(), domain());
            let n = common::gpu::two_producers(&ds, &dc, PathPolicy::Force(path), 20, 64 << 10);
            println!("{n} rounds of two producers verified on rxe0, {path:?}");
        }
    }
}

gpu_test! {
    /// [`common::gpu::ordered_mix`] on rxe0: the direct path (the NIC reads
    /// GPU memory) and the staged path.
    fn a_random_mix_takes_effect_in_posting_order_on_rxe0() {
        for (path, seed) in [(MemPath::PeerMem, 0x0bde_0002), (MemPath::Staged, 0x0bde_0003)] {
            let (ds, dc) = (domain(), domain());
            let (rounds, kinds) = common::gpu::ordered_mix(&ds, &dc, PathPolicy::Force(path), 30, seed);
            println!("{rounds} rounds in posting order on rxe0, {path:?}: {kinds:?}");
        }
    }
}

gpu_test! {
    /// See [`common::gpu::notified_pages_are_visible`], on rxe0 with the
    /// receiver's GPU region staged and on the direct path.
    fn a_notified_list_into_gpu_memory_is_visible_when_the_note_is_handed_out_on_rxe0() {
        for path in [MemPath::Staged, MemPath::PeerMem] {
            let (ds, dc) = (domain(), domain());
            let n = common::gpu::notified_pages_are_visible(&ds, &dc, PathPolicy::Force(path), 10);
            println!("{n} rounds of scattered pages visible at the note on rxe0, {path:?}");
        }
    }
}

/// Registers `buf` with `path` in `d` and writes it to a fresh host region
/// of the peer's, verified; or returns the registration error.
fn register_and_write(d: &Domain, peer: &Domain, buf: CudaBuffer, path: MemPath) -> Result<(), Error> {
    let len = buf.len();
    let data = pattern(len, 5);
    buf.copy_from_host(0, &data).unwrap();
    let region = d.register_with_path(buf, Access::LOCAL_WRITE, PathPolicy::Force(path)).map_err(|e| e.error)?;
    let target = peer.expose(peer.alloc(len).unwrap(), Access::REMOTE_WRITE, 9).unwrap();
    let (_s, c) = pair_on(peer, d, opts().advertise(&target), staging_opts());
    c.write(region, &c.remote_region(9).unwrap().whole()).finish()?;
    let mut got = vec![0u8; len];
    target.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &data), None, "{path}: the bytes at the peer");
    Ok(())
}

gpu_test! {
    /// A tensor 512 bytes into a larger allocation (what framework
    /// allocators hand out) registers and moves on every path that allows
    /// it, and says why where not (rxe refuses dma-buf).
    fn a_sub_allocation_at_offset_512_works_on_every_path_that_allows_it() {
        let (d, peer) = (domain(), domain());
        for path in MemPath::ALL {
            let block = std::sync::Arc::new(CudaBuffer::alloc(&gpu(), 1 << 20).unwrap());
            let keep = std::sync::Arc::clone(&block);
            // SAFETY: `keep` holds the allocation for as long as the wrapper lives.
            let tensor = unsafe { CudaBuffer::from_raw(&gpu(), block.device_ptr() + 512, 256 << 10, Box::new(keep)) }
                .unwrap();
            match (path, register_and_write(&d, &peer, tensor, path)) {
                (MemPath::DmaBuf, Err(e)) => assert!(e.is_not_supported(), "rxe refuses dma-buf, typed: {e}"),
                (_, Err(e)) => panic!("{path} at offset 512: {e}"),
                (_, Ok(())) => println!("{path}: a tensor at offset 512 registered and moved, verified"),
            }
        }
    }
}

gpu_test! {
    /// VMM memory (cuMemCreate + cuMemMap), as PyTorch's expandable
    /// segments hand it out: registered directly when made GPUDirect RDMA
    /// capable; never directly when not (forced is an error, auto stages
    /// it and says why).
    fn vmm_memory_registers_where_the_driver_allows_it() {
        let (d, peer) = (domain(), domain());
        for gdr in [true, false] {
            let wrap = |block: &std::sync::Arc<common::gpu::VmmBlock>| {
                let keep = std::sync::Arc::clone(block);
                // SAFETY: `keep` holds the mapping for as long as the wrapper lives.
                unsafe { CudaBuffer::from_raw(&gpu(), block.ptr, 1 << 20, Box::new(keep)) }.unwrap()
            };
            let block = std::sync::Arc::new(common::gpu::VmmBlock::new(&gpu(), 2 << 20, gdr));
            let direct = register_and_write(&d, &peer, wrap(&block), MemPath::PeerMem);
            match (gdr, direct) {
                (true, Ok(())) => {}
                (false, Err(e)) => {
                    assert!(e.is_not_supported() && e.to_string().contains("IS_GPU_DIRECT_RDMA_CAPABLE"), "{e}")
                }
                (gdr, other) => panic!("VMM memory, gdr {gdr}, forced peermem: {other:?}"),
            }
            let r = d.register_with_path(wrap(&block), Access::LOCAL_WRITE, PathPolicy::Auto).unwrap();
            let report = r.path_report().unwrap().to_string();
            if !gdr {
                assert_eq!(r.memory_path(), Some(MemPath::Staged), "{report}");
                assert!(report.contains("IS_GPU_DIRECT_RDMA_CAPABLE"), "{report}");
            }
            drop(r);
            register_and_write(&d, &peer, wrap(&block), MemPath::Staged).unwrap();
            println!("VMM memory, gdr {gdr}: auto chose {report}");
        }
    }
}

gpu_test! {
    /// GPU registrations ask for PCIe relaxed ordering (an optional flag,
    /// through ibv_reg_mr_iova2, which keeps it).
    fn gpu_registrations_ask_for_relaxed_ordering() {
        const RELAXED: u32 = 1 << 20; // IBV_ACCESS_RELAXED_ORDERING
        let d = domain();
        let (_, before) = common::gpu::last_device_registration();
        let r = gpu_region(&d, 1 << 16, None, PathPolicy::Force(MemPath::PeerMem));
        let (access, after) = common::gpu::last_device_registration();
        assert_eq!(after, before + 1, "registered through the nvidia-peermem call path");
        assert_ne!(access & RELAXED, 0, "access flags {access:#x}");
        drop(r);
    }
}

gpu_test! {
    /// Every branch of the flush logic, with the device attributes the
    /// stand-in is told to report: ordering by the owner (no flush needed),
    /// a host flush (called once per incoming direct operation), and a
    /// needed flush the driver lacks (auto stages instead and says so; a
    /// forced direct path warns in its report).
    fn the_flush_follows_the_device_attributes() {
        use common::gpu::{reset_attributes, set_attribute};
        use gpu_rdma::cuda::FlushPolicy;
        const FLUSH_OPTIONS: u32 = 117;
        const WRITES_ORDERING: u32 = 118;
        let (ds, dc) = (domain(), domain());
        let (s, c) = pair_on(&ds, &dc, opts(), opts());
        let cases = [(1, 100, FlushPolicy::NotNeeded), (1, 0, FlushPolicy::Flush), (0, 0, FlushPolicy::Unavailable)];
        for (options, ordering, want) in cases {
            set_attribute(FLUSH_OPTIONS, options);
            set_attribute(WRITES_ORDERING, ordering);
            assert_eq!(gpu().flush_policy(), want);
            let region = gpu_region(&ds, 1 << 16, None, PathPolicy::Force(MemPath::PeerMem));
            let warned = region.path_report().unwrap().warnings.iter().any(|w| w.contains("flush"));
            assert_eq!(warned, want == FlushPolicy::Unavailable, "{want:?}: {:?}", region.path_report());
            let before = stub_flush_count().unwrap();
            let mut rx = s.recv(region);
            c.send_inline(b"flush?", None).wait().unwrap();
            rx.wait().unwrap();
            let flushes = stub_flush_count().unwrap() - before;
            assert_eq!(flushes, u64::from(want == FlushPolicy::Flush), "{want:?}: {flushes} flushes");
            if want == FlushPolicy::Unavailable {
                let auto = gpu_region(&ds, 1 << 16, None, PathPolicy::Auto);
                let report = auto.path_report().unwrap().to_string();
                assert_eq!(auto.memory_path(), Some(MemPath::Staged), "{report}");
                assert!(report.contains("need a flush"), "{report}");
                // Memory the NIC never writes (registered without write rights) needs no flush.
                let buf = CudaBuffer::alloc(&gpu(), 1 << 16).unwrap();
                let send_only = ds.register_with_path(buf, Access::empty(), PathPolicy::Auto).unwrap();
                let report = send_only.path_report().unwrap().to_string();
                assert!(!report.contains("need a flush"), "{report}");
            }
        }
        reset_attributes();
    }
}

gpu_test! {
    /// A receive into direct GPU memory whose consumer runs late (GPU work
    /// that writes the buffer 400 ms from now, fenced): posting it returns
    /// at once, and the message lands after that work, not under it (it
    /// goes through a host slot, its copy into the GPU behind the fence).
    fn a_fenced_receive_into_direct_gpu_memory_never_blocks_its_poster() {
        use common::gpu::produce;
        const LEN: usize = 64 << 10;
        let (ds, dc) = (domain(), domain());
        let (s, c) = pair_on(&ds, &dc, opts(), opts());
        let stream = gpu_rdma::cuda::CudaStream::new(&gpu()).unwrap();
        for round in 0..2u64 {
            let dst = gpu_region(&ds, LEN, None, PathPolicy::Force(MemPath::PeerMem));
            produce(&stream, dst.memory(), 0, LEN, 91 + round, 400_000);
            let t0 = Instant::now();
            // The buffer's fence, then the operation's own.
            let mut rx = if round == 0 {
                dst.memory().ready_after(&stream).unwrap();
                s.recv(dst)
            } else {
                s.recv(dst.slice(..).after(&stream).unwrap())
            };
            let posted_in = t0.elapsed();
            let msg = pattern(LEN, 95 + round);
            let mut src = dc.alloc(LEN).unwrap();
            src.copy_from_slice(&msg);
            c.send(src).wait().unwrap();
            rx.wait_timeout(Duration::from_secs(20)).unwrap();
            let took = t0.elapsed();
            let got = rx.into_buffer().unwrap();
            println!("round {round}: the receive posted in {posted_in:?}, done in {took:?}");
            assert!(posted_in < Duration::from_millis(100), "round {round}: the poster waited for the fence: {posted_in:?}");
            assert!(took >= Duration::from_millis(350), "round {round}: done before its fence: {took:?}");
            assert_eq!(first_difference(&read_gpu(got.memory(), LEN), &msg), None, "round {round}: the late work overwrote the message");
        }
        stream.synchronize().unwrap();
    }
}

gpu_test! {
    /// A receive ring in GPU memory on a direct path whose buffer has a
    /// consumer fence (GPU work still reading the slot a message was lent
    /// from): ending the loan returns at once, the slot is kept at the gate
    /// until that work is done, and the next message lands in it only then
    /// (the late work does not overwrite it). Before, ending the loan
    /// waited for the work.
    fn a_direct_gpu_ring_gives_a_slot_back_behind_its_consumer_fence_without_blocking() {
        use common::gpu::produce;
        let (ds, dc) = (domain(), domain());
        let (s, c) = pair_on(&ds, &dc, opts(), opts());
        let stream = gpu_rdma::cuda::CudaStream::new(&gpu()).unwrap();
        let mut ring = s.recv_ring(gpu_region(&ds, 64, None, PathPolicy::Force(MemPath::PeerMem)), 64, 1);
        assert_eq!(ring.posted(), 1);
        for round in 0..3u64 {
            c.send_inline(format!("first {round}").as_bytes(), None).wait().unwrap();
            let got = ring.next_timeout(Duration::from_secs(20)).unwrap();
            let mut landed = vec![0u8; got.len()];
            got.buffer().memory().copy_to_host(got.range().start, &mut landed).unwrap();
            assert_eq!(landed, format!("first {round}").as_bytes(), "round {round}");
            // The consumer's work on the slot: 300 ms on the stream.
            produce(&stream, got.buffer().memory(), 0, 64, 97 + round, 300_000);
            got.buffer().memory().ready_after(&stream).unwrap();
            let t0 = Instant::now();
            drop(got);
            let given_back_in = t0.elapsed();
            assert_eq!(ring.posted(), 1, "round {round}: a kept slot counts as posted");
            let mut tx = c.send_inline(format!("second {round}").as_bytes(), None);
            let got = ring.next_timeout(Duration::from_secs(20)).unwrap();
            let lent_after = t0.elapsed();
            tx.wait().unwrap();
            let mut landed = vec![0u8; got.len()];
            got.buffer().memory().copy_to_host(got.range().start, &mut landed).unwrap();
            println!("round {round}: the slot given back in {given_back_in:?}, the next message lent after {lent_after:?}");
            assert!(given_back_in < Duration::from_millis(100), "round {round}: ending the loan waited: {given_back_in:?}");
            assert!(lent_after >= Duration::from_millis(250), "round {round}: a message landed before the fence: {lent_after:?}");
            assert_eq!(landed, format!("second {round}").as_bytes(), "round {round}: the late work overwrote it");
            got.retire();
            assert_eq!(ring.post_idle(), 1);
        }
        stream.synchronize().unwrap();
    }
}

gpu_test! {
    /// Posting a write, a list or a batch from GPU memory whose producer is
    /// still running returns at once (the fence is looked at, never waited
    /// on by the posting thread), the operation goes once the producer is
    /// done, what is posted after it waits behind it, and it can be awaited
    /// in an async runtime without blocking the runtime's thread.
    fn a_fenced_direct_operation_never_blocks_its_poster_and_keeps_its_place() {
        use common::gpu::{produce, produced};
        const LEN: usize = 64 << 10;
        let (ds, dc) = (domain(), domain());
        let target = ds.expose(ds.alloc(5 * LEN).unwrap(), Access::REMOTE_WRITE, 3).unwrap();
        let (s, c) = pair_on(&ds, &dc, opts().advertise(&target), opts());
        let remote = c.remote_region(3).unwrap();
        let stream = gpu_rdma::cuda::CudaStream::new(&gpu()).unwrap();
        // The last two take the fence as the operation's own (stream-ordered).
        for (round, kind) in ["write", "list", "batch", "write after", "list after"].into_iter().enumerate() {
            let src = gpu_region(&dc, LEN, None, PathPolicy::Force(MemPath::PeerMem));
            let seed = 80 + round as u64;
            produce(&stream, src.memory(), 0, LEN, seed, 400_000);
            if !kind.ends_with("after") {
                src.memory().ready_after(&stream).unwrap();
            }
            let dst = remote.slice((round * LEN) as u64..((round + 1) * LEN) as u64).unwrap();
            let mut rx = s.recv(ds.alloc(16).unwrap());
            let t0 = Instant::now();
            let mut op: Box<dyn FnMut() -> gpu_rdma::Result<()>> = match kind {
                "write" => {
                    let mut w = c.write(src, &dst);
                    Box::new(move || w.wait().map(drop))
                }
                "write after" => {
                    let mut w = c.write(src.slice(..).after(&stream).unwrap(), &dst);
                    Box::new(move || w.wait().map(drop))
                }
                "list after" => {
                    let l = c.write_list(src.slice(..).after(&stream).unwrap(), &dst, [gpu_rdma::Piece::new(0, 0, LEN as u64)]);
                    let mut l = Some(l);
                    Box::new(move || l.take().map_or(Ok(()), |l| l.finish().map(drop).map_err(|f| f.error)))
                }
                "list" => {
                    let l = c.write_list(src, &dst, [gpu_rdma::Piece::new(0, 0, LEN as u64)]);
                    let mut l = Some(l);
                    Box::new(move || l.take().map_or(Ok(()), |l| l.finish().map(drop).map_err(|f| f.error)))
                }
                _ => {
                    let mut b = c.batch().write(src, &dst).post();
                    Box::new(move || b.wait().map(drop))
                }
            };
            let posted_in = t0.elapsed();
            // Posted after it: seen by the peer only once the write landed.
            let mut after = c.send_inline(&[round as u8], None);
            rx.wait_timeout(Duration::from_secs(20)).unwrap();
            let seen_after = t0.elapsed();
            let mut got = vec![0u8; LEN];
            target.read_at(round * LEN, &mut got).unwrap();
            println!("{kind}: posted in {posted_in:?}, the send after it seen after {seen_after:?}");
            assert!(posted_in < Duration::from_millis(150), "{kind}: the poster waited for the fence: {posted_in:?}");
            assert_eq!(first_difference(&got, &produced(seed, LEN)), None, "{kind}: the send after it overtook it");
            assert!(seen_after >= Duration::from_millis(350), "{kind}: went before its producer: {seen_after:?}");
            op().unwrap();
            after.wait().unwrap();
        }
        // Awaited on a one-thread runtime, a fenced write does not block it.
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let src = gpu_region(&dc, LEN, None, PathPolicy::Force(MemPath::PeerMem));
        produce(&stream, src.memory(), 0, LEN, 90, 300_000);
        src.memory().ready_after(&stream).unwrap();
        let dst = remote.slice(0..LEN as u64).unwrap();
        let ticks = rt.block_on(async {
            let ticks = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
            let t = std::sync::Arc::clone(&ticks);
            let ticker = tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    t.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
            let mut w = c.write(src, &dst);
            (&mut w).await.unwrap();
            ticker.abort();
            ticks.load(std::sync::atomic::Ordering::Relaxed)
        });
        println!("the runtime ticked {ticks} times while the fenced write was awaited");
        assert!(ticks >= 10, "the awaited write blocked the runtime's thread: {ticks} ticks");
        let mut got = vec![0u8; LEN];
        target.read_at(0, &mut got).unwrap();
        assert_eq!(first_difference(&got, &produced(90, LEN)), None);
    }
}

gpu_test! {
    /// The registration cache: 10,000 sub-ranges of one block (as a
    /// framework's caching allocator carves tensors; 1 GiB here) register
    /// with one registration of the whole block, and messages land in
    /// several of them, verified. The block freed and allocated again is a
    /// miss, never served the old keys, and the freed block's registration
    /// goes; with the cache off each buffer registers alone.
    fn ten_thousand_sub_ranges_of_one_block_share_one_registration() {
        use std::sync::Arc;
        const BLOCK: usize = 1 << 30;
        let (ds, dc) = (domain(), domain());
        let dev = gpu();
        let sub = |block: &Arc<CudaBuffer>, off: u64, len: usize| {
            let keep = Arc::clone(block);
            // SAFETY: inside the block, which `keep` keeps allocated while the wrapper lives.
            let buf = unsafe { CudaBuffer::from_raw(&dev, block.device_ptr() + off, len, Box::new(keep)) }.unwrap();
            ds.register_with_path(buf, Access::LOCAL_WRITE, PathPolicy::Force(MemPath::PeerMem)).unwrap()
        };
        let block = Arc::new(CudaBuffer::alloc(&dev, BLOCK).unwrap());
        let before = ds.registration_cache_stats();
        let t0 = Instant::now();
        let mut regions: Vec<Region<CudaBuffer>> =
            (0..10_000u64).map(|i| sub(&block, (i * 6_553) % (BLOCK as u64 - 4096) / 256 * 256, 4096)).collect();
        let took = t0.elapsed();
        let after = ds.registration_cache_stats();
        println!("10,000 sub-ranges registered in {took:?}: {after:?}");
        assert_eq!(after.misses - before.misses, 1, "one registration of the block");
        assert_eq!(after.hits - before.hits, 9_999);
        // Messages land in sub-ranges through the shared registration.
        let (s, c) = pair_on(&ds, &dc, opts(), opts());
        for (k, at) in [17usize, 4_000, 9_999].into_iter().enumerate() {
            let region = regions.swap_remove(at.min(regions.len() - 1));
            let off = region.memory().device_ptr() - block.device_ptr();
            let rx = s.recv(region);
            let msg = pattern(4096, 70 + k as u64);
            let mut src = dc.alloc(4096).unwrap();
            src.copy_from_slice(&msg);
            c.send(src).wait().unwrap();
            let (done, region) = rx.finish().unwrap();
            assert_eq!(done.byte_len, 4096);
            let mut landed = vec![0u8; 4096];
            block.copy_to_host(off as usize, &mut landed).unwrap();
            assert_eq!(first_difference(&landed, &msg), None, "message {k} in the sub-range at {off}");
            drop(region);
        }
        drop(regions);
        // Freed and allocated again (at the same address or not): a new block.
        drop(block);
        let again = Arc::new(CudaBuffer::alloc(&dev, BLOCK).unwrap());
        let r = sub(&again, 0, 4096);
        let now = ds.registration_cache_stats();
        println!("the block freed and allocated again: {now:?}");
        assert_eq!((now.misses - after.misses, now.hits - after.hits), (1, 0), "a new block is never served the old one");
        // The freed block's registration is let go at that miss: it does
        // not stay pinned until the bound pushes it out.
        assert_eq!((now.blocks, now.bytes), (1, BLOCK), "only the live block is held");
        drop(r);
        // Off: every buffer registers alone, and the cache holds nothing.
        ds.set_registration_cache(0);
        let alone: Vec<_> = (0..3).map(|i| sub(&again, i * 8192, 4096)).collect();
        let off = ds.registration_cache_stats();
        assert_eq!((off.misses, off.hits, off.blocks), (now.misses + 3, now.hits, 0), "three made anew");
        assert!(alone.iter().all(|r| r.lkey() != alone[0].lkey() || std::ptr::eq(r, &alone[0])), "each its own");
        drop(alone);
    }
}

gpu_test! {
    /// GPU memory exposed on a direct path while its producer still runs (a
    /// fenced fill landing 300 ms later, as a framework's zeroing memset
    /// may): peers reach it only after that work, so what a peer writes at
    /// once stays. Before, the fill landed over the peer's write (the tail
    /// of a cudarc slice read back zero, now and then, in this suite).
    fn memory_exposed_while_its_producer_runs_is_the_peers_only_after_it() {
        use common::gpu::produce;
        const LEN: usize = 64 << 10;
        let (d, peer) = (domain(), domain());
        let stream = gpu_rdma::cuda::CudaStream::new(&gpu()).unwrap();
        let region = gpu_region(&d, LEN, None, PathPolicy::Force(MemPath::PeerMem));
        produce(&stream, region.memory(), 0, LEN, 61, 300_000);
        region.memory().ready_after(&stream).unwrap();
        let t0 = Instant::now();
        let target = d.expose(region, Access::REMOTE_WRITE, 3).unwrap();
        let exposed_in = t0.elapsed();
        let (s, c) = pair_on(&peer, &d, opts(), opts().advertise(&target));
        let mut imm = c.recv_imm();
        let msg = pattern(LEN, 62);
        s.write_with_imm(common::filled(&peer, &msg), &s.remote_region(3).unwrap().whole(), 5).wait().unwrap();
        assert_eq!(imm.wait().unwrap().imm, Some(5));
        // Whatever the producer had queued has run by now.
        stream.synchronize().unwrap();
        println!("exposed in {exposed_in:?}");
        assert_eq!(first_difference(&read_gpu(target.cuda(), LEN), &msg), None, "the producer's late fill landed over the peer's write");
        assert!(exposed_in >= Duration::from_millis(250), "exposed before its producer ran: {exposed_in:?}");
    }
}

gpu_test! {
    /// A framework's cudarc slices on the device: one given by value is
    /// written to a peer, one the framework keeps (shared) is written by
    /// the peer and read back through cudarc itself. Whatever path each
    /// takes (the path report says which and why), the bytes arrive.
    fn a_frameworks_cudarc_slices_move_on_the_device_as_they_are() {
        for policy in [PathPolicy::Auto, PathPolicy::Force(MemPath::PeerMem)] {
            cudarc_slices_move(policy);
        }
    }
}

fn cudarc_slices_move(policy: PathPolicy) {
    use cudarc::driver::CudaContext;
    use std::sync::Arc;
    let (d, peer) = (domain(), domain());
    let ctx = CudaContext::new(0).expect("cudarc's context on device 0");
    let stream = ctx.default_stream();
    let len = 256 << 10;
    let data = pattern(len, 17);
    let owned = CudaBuffer::from_cudarc(stream.clone_htod(&data).unwrap()).unwrap();
    let src = d.register_with_path(owned, Access::LOCAL, policy).map_err(|e| e.error).unwrap();
    println!("{policy:?}: a slice by value: {}", src.path_report().unwrap());
    let kept: Arc<cudarc::driver::CudaSlice<u8>> = Arc::new(stream.alloc_zeros::<u8>(len).unwrap());
    let shared = CudaBuffer::from_cudarc_shared(Arc::clone(&kept)).unwrap();
    let shared = d.register_with_path(shared, Access::LOCAL, policy).map_err(|e| e.error).unwrap();
    println!("{policy:?}: a shared slice: {}", shared.path_report().unwrap());
    if let PathPolicy::Force(path) = policy {
        assert_eq!((src.memory_path(), shared.memory_path()), (Some(path), Some(path)));
    }
    let target = d.expose(shared, Access::REMOTE_WRITE, 3).unwrap();
    let sink = peer.expose(peer.alloc(len).unwrap(), Access::REMOTE_WRITE, 4).unwrap();
    let (s, c) = pair_on(&peer, &d, opts().advertise(&sink), staging_opts().advertise(&target));
    let src = c.write(src, &c.remote_region(4).unwrap().whole()).finish().unwrap().1;
    let mut got = vec![0u8; len];
    sink.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &data), None, "the owned slice's bytes at the peer");
    // The peer writes into the framework's slice, with an immediate.
    let back = common::filled(&peer, &pattern(len, 18));
    let mut imm = c.recv_imm();
    s.write_with_imm(back, &s.remote_region(3).unwrap().whole(), 6).wait().unwrap();
    assert_eq!(imm.wait().unwrap().imm, Some(6));
    let seen: Vec<u8> = stream.clone_dtoh(&*kept).unwrap();
    assert_eq!(first_difference(&seen, &pattern(len, 18)), None, "read back through cudarc");
    drop((target, src, s, c));
    assert_eq!(Arc::strong_count(&kept), 1, "the framework's slice is its own again");
}
