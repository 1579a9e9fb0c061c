//! GPU memory over the TCP transport: the staging pipeline between two
//! GPU buffers with no RDMA device anywhere, verified byte for byte.
//!
//! Needs a CUDA driver: `cargo xtask test` runs these against the test-only
//! CUDA stand-in on this machine; `cargo xtask gpu-check` on a GPU machine.
//! `#[ignore]`d otherwise.

#![cfg(feature = "cuda")]

mod common;

use gpu_rdma::cuda::{CudaBuffer, CudaDevice};
use gpu_rdma::memory::path::{MemPath, PathPolicy};
use gpu_rdma::{Access, Domain, DomainConfig, Error, LocalBuffer, Pending, Region, Shared, TransportPolicy};

use common::{apply, first_difference, opts, pair_on, pattern};

macro_rules! gpu_tcp_test {
    ($(#[$m:meta])* fn $name:ident() $body:block) => {
        $(#[$m])*
        #[test]
        #[ignore = "cuda: needs a CUDA driver (the stand-in via cargo xtask test, or a GPU via cargo xtask gpu-check)"]
        fn $name() $body
    };
}

fn tcp_domain() -> Domain {
    Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp)).unwrap()
}

fn gpu_region(d: &Domain, len: usize, data: Option<&[u8]>) -> Region<CudaBuffer> {
    common::gpu::gpu_region_on(d, &CudaDevice::open(0).expect("a CUDA device"), len, data, PathPolicy::Auto)
}

fn read_gpu(buf: &CudaBuffer, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    buf.copy_to_host(0, &mut out).unwrap();
    out
}

gpu_tcp_test! {
    fn without_rdma_gpu_memory_is_staged_and_says_why() {
        let d = tcp_domain();
        let r = gpu_region(&d, 1 << 20, None);
        let report = r.path_report().unwrap();
        assert_eq!(report.chosen, MemPath::Staged);
        assert!(report.to_string().contains("no RDMA device"), "{report}");
    }
}

gpu_tcp_test! {
    /// Over TCP GPU memory goes through host staging: a receive ring's
    /// messages land in pinned host slots and are copied into their GPU
    /// slots before they are lent out, each after the consumer fence of
    /// the work still reading that slot; a ring dropped with receives
    /// posted keeps its staging until they are done.
    fn a_receive_ring_in_gpu_memory_over_tcp_lands_each_message_in_its_gpu_slot() {
        use common::gpu::{produce, produced};
        let d = tcp_domain();
        let (s, c) = pair_on(&d, &d, opts(), opts());
        let slot = 4096;
        let mut ring = s.recv_ring(gpu_region(&d, 4 * slot + 512, None).slice(512..), slot, 4);
        assert_eq!(ring.posted(), 4);
        let send = |k: u32, msg: &[u8]| {
            let mut r = d.alloc(msg.len().max(1)).unwrap();
            r.as_mut_slice()[..msg.len()].copy_from_slice(msg);
            c.send_with_imm(r.slice(..msg.len()), k).wait().unwrap();
        };
        let stream = gpu_rdma::cuda::CudaStream::new(&CudaDevice::open(0).unwrap()).unwrap();
        // Message 5's slot (1) is "still read" by work that lands 200 ms
        // late when its loan ends; message 9, the next in that slot, must
        // be copied in after it, not overwritten by it.
        let mut fenced = None;
        for k in 0..12u32 {
            let msg = pattern(k as usize * 373 % (slot + 1), u64::from(k) + 900);
            send(k, &msg);
            let got = ring.next_timeout(std::time::Duration::from_secs(10)).unwrap();
            assert_eq!((got.imm(), got.len(), got.slot()), (Some(k), msg.len(), k as usize % 4), "message {k}");
            assert_eq!(got.range(), 512 + (k as usize % 4) * slot..512 + (k as usize % 4) * slot + msg.len());
            if k == 9 {
                stream.synchronize().unwrap(); // the late work has landed by now
            }
            let mut landed = vec![0u8; slot];
            got.buffer().memory().copy_to_host(512 + got.slot() * slot, &mut landed).unwrap();
            assert_eq!(first_difference(&landed[..msg.len()], &msg), None, "message {k} in its GPU slot");
            if k == 9 {
                let late: Vec<u8> = fenced.take().expect("message 5 was fenced");
                assert_eq!(first_difference(&landed[msg.len()..], &late[msg.len()..]), None, "the late work's bytes");
            }
            if k == 5 {
                produce(&stream, got.buffer().memory(), 512 + slot, slot, 55, 200_000);
                got.buffer().memory().ready_after(&stream).unwrap();
                fenced = Some(produced(55, slot));
            }
        }
        // Dropped with all four posted: the staging stays with the
        // connection until the last of them lands.
        drop(ring);
        assert_eq!(s.in_flight().0, 4);
        for k in 0..4 {
            send(100 + k, &pattern(64, u64::from(k)));
        }
        let t0 = std::time::Instant::now();
        while s.in_flight().0 > 0 {
            s.progress().unwrap();
            assert!(t0.elapsed() < std::time::Duration::from_secs(20), "{:?} still in flight", s.in_flight());
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // The connection goes on, and a ring that posted nothing (every slot
        // retired) gives its buffer back.
        let mut ring = s.recv_ring(gpu_region(&d, 2 * 64, None), 64, 2);
        send(7, &[7u8; 64]);
        let got = ring.next().unwrap();
        assert_eq!((got.imm(), got.len()), (Some(7), 64));
        got.retire();
        send(8, &[]);
        let got = ring.next().unwrap();
        assert_eq!((got.imm(), got.len(), got.slot()), (Some(8), 0, 1));
        got.retire();
        let buf = ring.into_buffer().map_err(|_| "nothing posted").unwrap();
        assert_eq!(read_gpu(buf.memory(), 64), [7u8; 64]);

        // A hostile peer's message one byte longer than a slot fails that
        // receive (and the connection): an error, no hang, and no GPU byte
        // is touched (a failed receive copies nothing in).
        let (s, c) = pair_on(&d, &d, opts(), opts());
        let marked = pattern(3 * 64, 3);
        let gpu: Shared<CudaBuffer> = gpu_region(&d, 3 * 64, Some(&marked)).share();
        let mut ring = s.recv_ring(gpu.clone().slice(64..), 32, 2);
        let mut big = c.send(d.alloc(33).unwrap());
        let limit = std::time::Duration::from_secs(20);
        assert!(ring.next_timeout(limit).is_err(), "a message longer than its slot");
        assert!(big.wait_timeout(limit).is_err());
        drop(c);
        let e = ring.next_timeout(limit).map(|_| ()).unwrap_err();
        assert!(!e.is_timeout(), "a lost connection is not a timeout: {e}");
        drop(ring);
        assert_eq!(first_difference(&read_gpu(gpu.cuda(), 3 * 64), &marked), None, "GPU bytes changed");
    }
}

gpu_tcp_test! {
    fn gpu_to_gpu_over_tcp_by_write_read_and_send() {
        let (ds, dc) = (tcp_domain(), tcp_domain());
        let len = 64 << 20;
        let data = pattern(len, 21);
        let target = ds.expose(gpu_region(&ds, len, None), Access::REMOTE_WRITE | Access::REMOTE_READ, 1).unwrap();
        let (s, c) = pair_on(&ds, &dc, opts().staging(1 << 20, 4).advertise(&target), opts().staging(1 << 20, 4));
        assert_eq!(c.info().transport, "tcp");
        let remote = c.remote_region(1).unwrap();

        let mut done = s.recv_write(&target);
        let (_, src) = c.write(gpu_region(&dc, len, Some(&data)), &remote.whole()).finish().unwrap();
        c.send_inline(&[], Some(1)).wait().unwrap();
        done.wait().unwrap();
        assert_eq!(first_difference(&read_gpu(target.cuda(), len), &data), None, "write");

        target.publish().unwrap();
        let (_, dst) = c.read(gpu_region(&dc, len, None), &remote.whole()).finish().unwrap();
        assert_eq!(first_difference(&read_gpu(dst.memory(), len), &data), None, "read");

        let chunk = 8 << 20;
        let rx_buf: Shared<CudaBuffer> = gpu_region(&ds, len, None).share();
        let tx_buf = src.share();
        let mut rx: Vec<Pending<Shared<CudaBuffer>>> =
            (0..len).step_by(chunk).map(|o| s.recv(rx_buf.clone().slice(o..o + chunk))).collect();
        let mut tx: Vec<Pending<Shared<CudaBuffer>>> =
            (0..len).step_by(chunk).map(|o| c.send(tx_buf.clone().slice(o..o + chunk))).collect();
        for p in &mut tx {
            p.wait().unwrap();
        }
        let got: usize = rx.iter_mut().map(|p| p.wait().unwrap().byte_len as usize).sum();
        assert_eq!(got, len);
        drop(rx);
        assert_eq!(first_difference(&read_gpu(rx_buf.cuda(), len), &data), None, "send");
    }
}

gpu_tcp_test! {
    fn a_staged_send_reaches_the_peer_while_its_owner_waits_only_for_the_reply() {
        // A ping-pong in GPU memory: each side posts its send and waits for
        // the next receive, not for the send; waiting on the receive must
        // move the staged send along (copy out, post).
        let d = tcp_domain();
        let (s, c) = pair_on(&d, &d, opts(), opts());
        let msg = pattern(4096, 5);
        let ping = gpu_region(&d, 4096, Some(&msg)).share();
        let pong = gpu_region(&d, 4096, None).share();
        let echo = gpu_region(&d, 4096, None).share();
        let limit = std::time::Duration::from_secs(10);
        std::thread::scope(|sc| {
            let server = sc.spawn(|| -> gpu_rdma::Result<()> {
                let mut sent = Vec::new();
                for _ in 0..20 {
                    let n = s.recv(echo.clone()).wait_timeout(limit)?.byte_len as usize;
                    sent.push(s.send(echo.clone().slice(..n)));
                }
                sent.iter_mut().try_for_each(|p| p.wait_timeout(limit).map(drop))
            });
            let mut sent = Vec::new();
            for round in 0..20 {
                let mut rx = c.recv(pong.clone());
                sent.push(c.send(ping.clone().slice(..4096)));
                let got = rx.wait_timeout(limit).unwrap_or_else(|e| panic!("round {round}: no reply: {e}"));
                assert_eq!(got.byte_len, 4096);
            }
            for p in &mut sent {
                p.wait_timeout(limit).unwrap();
            }
            server.join().unwrap().expect("the echoing side");
        });
        assert_eq!(first_difference(&read_gpu(pong.cuda(), 4096), &msg), None);
    }
}

gpu_tcp_test! {
    /// See [`common::gpu::staged_bursts`]: 72 writes of 1 MiB at once,
    /// twice; the second burst finds its slots in the cache. (The writes
    /// take effect in posting order: each starts its copy in its turn, so a
    /// burst holds slots for the writes on the network, not one per queued
    /// write.)
    fn a_second_staged_burst_finds_its_slots_in_the_cache() {
        let d = tcp_domain();
        let (first, second, freed) = common::gpu::staged_bursts(&d, PathPolicy::Auto, 72);
        println!("staging slots pinned: {first} by the first burst of 72, {second} by the second, {freed} freed");
        assert!((1..=72).contains(&first), "the first burst pins what it needs: {first}");
        // Every slot the first burst pinned was kept and served the second,
        // which pinned only what it held at once beyond the first.
        assert_eq!(freed, 0, "the cache freed {freed} slot(s) a burst had needed");
        assert!(first + second <= 72, "the second burst pinned anew what the first had: {first} then {second}");
        // Nothing is on loan or reserved now: trimming gives all of it back.
        let held = d.staging_bytes();
        assert!(held >= (first as usize) << 20, "the cache kept the burst's slots: {held} bytes");
        assert_eq!(d.trim_staging(), held);
        let after = d.staging_stats();
        assert_eq!((after.pinned_bytes, after.cached_bytes), (0, 0), "{after:?}");
        assert_eq!(after.slots_freed, after.slots_pinned, "{after:?}");
    }
}

gpu_tcp_test! {
    /// A staged ping-pong between GPU buffers, 40 rounds verified byte for
    /// byte at both ends: each copy's event is recorded again from the
    /// staging's pool, so after the first rounds no event is made (the
    /// stand-in counts them; on the last GPU the test runs on, where the
    /// other tests run too, only the bytes are checked). The stand-in makes
    /// a reused event stand for its latest record only, as CUDA does, so a
    /// stale completion would show as wrong bytes.
    fn staged_copies_record_pooled_events_and_steady_rounds_make_none() {
        let ordinal = CudaDevice::count().unwrap().saturating_sub(1);
        let dev = CudaDevice::open(ordinal).unwrap();
        let d = tcp_domain();
        let (s, c) = pair_on(&d, &d, opts(), opts());
        let gpu = |len: usize| common::gpu::gpu_region_on(&d, &dev, len, None, PathPolicy::Auto);
        let limit = std::time::Duration::from_secs(30);
        let (len, rounds, warm) = (64 << 10, 40u64, 5u64);
        let (mut a, mut b) = (gpu(len), gpu(len));
        let mut made_when_warm = None;
        for round in 0..rounds {
            if round == warm {
                made_when_warm = common::gpu::events_created(ordinal as u32);
            }
            let msg = pattern(len, round);
            a.memory().copy_from_host(0, &msg).unwrap();
            let mut rx = s.recv(b);
            let mut tx = c.send(a);
            tx.wait_timeout(limit).unwrap_or_else(|e| panic!("round {round}: {e}"));
            let got = rx.wait_timeout(limit).unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert_eq!(got.byte_len as usize, len, "round {round}");
            let landed = rx.into_buffer().unwrap_or_else(|_| panic!("round {round}: the receive is done"));
            assert_eq!(first_difference(&read_gpu(landed.memory(), len), &msg), None, "round {round}");
            // The buffers swap roles: each is written by a copy in and read by a copy out in turn.
            (a, b) = (landed, tx.into_buffer().unwrap_or_else(|_| panic!("round {round}: the send is done")));
        }
        match (made_when_warm, common::gpu::events_created(ordinal as u32)) {
            (Some(then), Some(now)) => {
                println!("CUDA events made on device {ordinal}: {then} in the first {warm} rounds' time, {} after", now - then);
                assert_eq!(now, then, "steady rounds make no event");
            }
            _ => println!("event count not checked: not the CUDA stand-in (the bytes of {rounds} rounds were)"),
        }
    }
}

gpu_tcp_test! {
    /// See [`common::gpu::reserved_staging_serves_and_stays`].
    fn reserved_staging_slots_serve_the_operations_and_stay() {
        let d = tcp_domain();
        let pinned = common::gpu::reserved_staging_serves_and_stays(&d, PathPolicy::Auto);
        assert_eq!(pinned, 0, "every slot came from the reservation");
    }
}

gpu_tcp_test! {
    /// A reservation no message could use is refused, typed, pinning
    /// nothing (a size class past it would overflow); none at all is fine.
    fn a_reservation_larger_than_any_message_is_refused_and_pins_nothing() {
        let d = tcp_domain();
        let dev = CudaDevice::open(0).unwrap();
        let before = d.staging_stats();
        for len in [usize::MAX, (u32::MAX as usize) + 1] {
            let e = d.reserve_staging(&dev, len, 1).unwrap_err();
            assert!(matches!(e, Error::MessageTooLarge { len: l, max } if l == len as u64 && max == u64::from(u32::MAX)), "{e}");
        }
        d.reserve_staging(&dev, 4096, 0).unwrap();
        assert_eq!(d.staging_stats(), before);
    }
}

gpu_tcp_test! {
    /// See [`common::gpu::awaited_staged_round_trips`].
    fn an_awaited_staged_receive_moves_the_write_nobody_awaits() {
        let d = tcp_domain();
        let n = common::gpu::awaited_staged_round_trips(&d, PathPolicy::Auto);
        println!("{n} awaited staged round trips verified over TCP");
    }
}

gpu_tcp_test! {
    /// 1,000 iterations of "a producer kernel writes iteration i, then the
    /// region is written to the peer", verified at the peer each time, over
    /// TCP (GPU memory staged): each write waits for its own fence.
    fn a_thousand_produced_iterations_each_reach_the_peer_over_tcp() {
        let d = tcp_domain();
        let n = common::gpu::producer_loop(&d, &d, PathPolicy::Auto, 1000, 64 << 10);
        println!("{n} produced iterations verified over TCP (staged)");
    }
}

gpu_tcp_test! {
    /// Two producers on two streams, each fencing its half of one buffer:
    /// a write waits for both, over TCP (GPU memory staged).
    fn a_write_waits_for_every_producers_fence_over_tcp() {
        let d = tcp_domain();
        let n = common::gpu::two_producers(&d, &d, PathPolicy::Auto, 20, 64 << 10);
        println!("{n} rounds of two producers verified over TCP (staged)");
    }
}

gpu_tcp_test! {
    /// Forcing a direct path where the domain has no RDMA device is an
    /// error that names the reason and gives the buffer back, never a
    /// region with key 0.
    fn forcing_a_direct_path_without_rdma_is_an_error() {
        let d = tcp_domain();
        let dev = gpu_rdma::cuda::CudaDevice::open(0).unwrap();
        for path in [MemPath::PeerMem, MemPath::DmaBuf] {
            let buf = gpu_rdma::cuda::CudaBuffer::alloc(&dev, 4096).unwrap();
            let ptr = buf.device_ptr();
            let e = d.register_with_path(buf, Access::LOCAL_WRITE, PathPolicy::Force(path)).unwrap_err();
            assert!(matches!(e.error, Error::NoDevice { .. }), "{path}: {}", e.error);
            assert!(e.error.to_string().contains(path.name()), "{}", e.error);
            assert_eq!(e.buffer.device_ptr(), ptr, "the buffer comes back");
        }
    }
}

gpu_tcp_test! {
    /// Staging slots come in size classes capped near the request (a
    /// 40 MiB message pins 42 MiB, not 64 MiB), and a slot larger than a
    /// chunk is freed when its operation is done rather than cached.
    fn a_large_staged_message_pins_its_size_class_and_frees_it_after() {
        let d = tcp_domain();
        let len = (40 << 20) + (64 << 10);
        let class = 42 << 20;
        let (s, c) = pair_on(&d, &d, opts(), opts().staging(4 << 20, 4));
        let data = pattern(len, 3);
        let before = d.staging_bytes();
        let mut rx = s.recv(gpu_region(&d, len, None));
        let mut tx = c.send(gpu_region(&d, len, Some(&data)));
        // Both messages' slots are live now (a message is one slot each way).
        let live = d.staging_bytes() - before;
        tx.wait().unwrap();
        assert_eq!(rx.wait().unwrap().byte_len as usize, len);
        let got = rx.into_buffer().unwrap();
        assert_eq!(first_difference(&read_gpu(got.memory(), len), &data), None);
        drop((tx, got));
        let after = d.staging_bytes();
        println!("staging: {} MiB pinned for two {len}-byte messages; {} KiB held after", live >> 20, after >> 10);
        assert!(live >= 2 * len, "both slots were live when measured: {live}");
        assert!(live <= 2 * class, "pinned {live} bytes for two messages of {len}: more than their size class");
        assert!(after < len, "the message-sized slots were freed: {after} bytes still pinned");
    }
}

gpu_tcp_test! {
    /// A peer's 4 KiB write into a staged 8 MiB region moves 4 KiB into GPU
    /// memory: the owner's newer data elsewhere in the region survives
    /// (a whole-region pull would overwrite it with the stale mirror).
    fn a_peer_write_into_part_of_a_staged_region_moves_only_that_part() {
        let d = tcp_domain();
        let len = 8 << 20;
        let at = 1 << 20;
        let old = pattern(len, 1);
        let exposed = d.expose(gpu_region(&d, len, Some(&old)), Access::REMOTE_WRITE, 4).unwrap();
        exposed.publish().unwrap();
        let (s, c) = pair_on(&d, &d, opts().advertise(&exposed), opts());
        // The owner changes the start of its GPU memory after publishing.
        let newer = pattern(4096, 2);
        exposed.cuda().copy_from_host(0, &newer).unwrap();
        // The peer writes 4 KiB at 1 MiB, with an immediate.
        let mut note = s.recv_write_range(&exposed, at..at + 4096);
        let data = pattern(4096, 3);
        let mut src = d.alloc(4096).unwrap();
        src.copy_from_slice(&data);
        let remote = c.remote_region(4).unwrap().slice(at as u64..at as u64 + 4096).unwrap();
        c.write_with_imm(src, &remote, 1).wait().unwrap();
        assert_eq!(note.wait().unwrap().imm, Some(1));
        let gpu = read_gpu(exposed.cuda(), len);
        assert_eq!(&gpu[at..at + 4096], &data[..], "the peer's write reached GPU memory");
        assert_eq!(&gpu[..4096], &newer[..], "the owner's newer data survived");
        assert_eq!(first_difference(&gpu[4096..at], &old[4096..at]), None);
        assert_eq!(first_difference(&gpu[at + 4096..], &old[at + 4096..]), None);
        // A range past the region fails the receive, typed.
        let mut bad = s.recv_write_range(&exposed, len - 10..len + 10);
        c.send_inline(&[], Some(2)).wait().unwrap();
        assert!(matches!(bad.wait(), Err(gpu_rdma::Error::OutOfBounds { .. })));
    }
}

gpu_tcp_test! {
    /// A staged write into a region the peer granted only reading is
    /// refused before anything is copied, with the typed error, and the GPU
    /// buffer comes back.
    fn a_staged_write_without_the_right_is_refused_before_copying() {
        let d = tcp_domain();
        let target = d.expose(d.alloc(1 << 20).unwrap(), Access::REMOTE_READ, 6).unwrap();
        let (_s, c) = pair_on(&d, &d, opts().advertise(&target), opts());
        let src = gpu_region(&d, 1 << 20, Some(&pattern(1 << 20, 8)));
        let ptr = src.memory().device_ptr();
        let mut w = c.write(src, &c.remote_region(6).unwrap().whole());
        let e = w.wait().unwrap_err();
        assert!(matches!(e, Error::AccessDenied { .. }), "{e}");
        assert_eq!(w.into_buffer().unwrap().memory().device_ptr(), ptr, "the buffer comes back");
        assert!(c.broken().is_none(), "refused before posting: the connection is unchanged");
    }
}

gpu_tcp_test! {
    fn a_list_of_ten_thousand_random_pieces_goes_through_the_staging_pipeline_both_ways() {
        use common::{Rng, random_pieces};
        use gpu_rdma::Piece;
        let d = tcp_domain();
        let (s, c) = pair_on(&d, &d, opts(), opts());
        // GPU -> peer: the GPU side is staged (no RDMA here).
        let gpu_len = 1 << 20;
        let data = pattern(gpu_len, 41);
        let mut rng = Rng(0x5eed_0041);
        let (raw, span) = random_pieces(&mut rng, 10_000, 600, gpu_len as u64);
        let pieces: Vec<Piece> = raw.iter().map(|&(r, l, n)| Piece::new(l, r, n)).collect();
        let target = d.expose(d.alloc(span as usize).unwrap(), Access::REMOTE_WRITE | Access::REMOTE_READ, 0).unwrap();
        let remote = s.grant(&target).whole();
        let local = gpu_region(&d, gpu_len, Some(&data));
        assert_eq!(local.memory_path(), Some(MemPath::Staged));
        let staged_before = d.staging_stats().slots_pinned;
        let (done, local) = c.write_list(local, &remote, pieces.iter().copied()).finish().unwrap();
        assert_eq!(done.bytes, pieces.iter().map(|p| p.len).sum::<u64>());
        // Small pieces go in groups: one slot, one copy event and one post
        // (a chain) for many pieces, not a pipeline each.
        println!("{} requests in {} posts, {} slots pinned", done.requests, done.posts, d.staging_stats().slots_pinned - staged_before);
        assert!(done.posts * 8 <= done.requests, "small pieces were not gathered: {done:?}");
        let mut got = vec![0u8; span as usize];
        target.read_at(0, &mut got).unwrap();
        assert_eq!(first_difference(&got, &apply(&pieces, &data, span as usize, true)), None, "GPU -> peer");
        // Peer -> GPU: read the pieces back to other places of a zeroed GPU buffer.
        let source = pattern(span as usize, 42);
        target.write_at(0, &source).unwrap();
        let back: Vec<Piece> = raw.iter().map(|&(r, _, n)| Piece::new(r, r, n)).collect();
        let zero = gpu_region(&d, span as usize, Some(&vec![0u8; span as usize]));
        let (done, zero) = c.read_list(zero, &remote, back.iter().copied()).finish().unwrap();
        assert!(done.posts * 8 <= done.requests, "small pieces were not gathered: {done:?}");
        let want = apply(&back, &source, span as usize, false);
        assert_eq!(first_difference(&read_gpu(zero.memory(), span as usize), &want), None, "peer -> GPU");
        drop(local);
        drop(s);
    }
}

gpu_tcp_test! {
    /// A write with immediate into a staged GPU region, taken by a receive
    /// that does not name the region (`recv_imm`, a receive into a host
    /// buffer, a receive ring): when the receive completes, the bytes are
    /// in GPU memory, and only they moved (the owner's newer data elsewhere
    /// in the region survives).
    fn a_write_with_immediate_is_visible_in_staged_gpu_memory_whatever_receive_takes_it() {
        let d = tcp_domain();
        let len = 4 << 20;
        let old = pattern(len, 61);
        let exposed = d.expose(gpu_region(&d, len, Some(&old)), Access::REMOTE_WRITE, 6).unwrap();
        exposed.publish().unwrap();
        let (s, c) = pair_on(&d, &d, opts().advertise(&exposed), opts());
        let newer = pattern(4096, 62);
        exposed.cuda().copy_from_host(0, &newer).unwrap();
        let region = c.remote_region(6).unwrap();
        let mut expect = old.clone();
        expect[..4096].copy_from_slice(&newer);
        for (round, at) in [(0u32, 1usize << 20), (1, 2 << 20), (2, 3 << 20 | 512)].into_iter() {
            let n = 64 << 10;
            let data = pattern(n, 100 + u64::from(round));
            expect[at..at + n].copy_from_slice(&data);
            let mut src = d.alloc(n).unwrap();
            src.copy_from_slice(&data);
            let remote = region.slice(at as u64..(at + n) as u64).unwrap();
            let got_imm = match round {
                0 => {
                    let mut rx = s.recv_imm();
                    c.write_with_imm(src, &remote, round).wait().unwrap();
                    rx.wait().unwrap().imm
                }
                1 => {
                    let mut rx = s.recv(d.alloc(64).unwrap());
                    c.write_with_imm(src, &remote, round).wait().unwrap();
                    rx.wait().unwrap().imm
                }
                _ => {
                    // Receives are taken in posting order: the ring's come last.
                    let mut ring = s.recv_ring(d.alloc(4 * 64).unwrap(), 64, 4);
                    c.write_with_imm(src, &remote, round).wait().unwrap();
                    ring.next().unwrap().imm()
                }
            };
            assert_eq!(got_imm, Some(round));
            let gpu = read_gpu(exposed.cuda(), len);
            assert_eq!(
                first_difference(&gpu, &expect),
                None,
                "round {round}: GPU memory when the immediate was seen (the write at {at}, the owner's data at 0)"
            );
        }
    }
}

gpu_tcp_test! {
    fn a_staged_list_notifies_after_its_last_piece_and_dropping_one_mid_flight_is_safe() {
        use gpu_rdma::Piece;
        let d = tcp_domain();
        let (s, c) = pair_on(&d, &d, opts(), opts());
        let mut inbox = s.inbox(4).unwrap();
        let len = 8 << 20;
        let data = pattern(len, 43);
        let target = d.expose(d.alloc(len).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
        let remote = s.grant(&target).whole();
        let pieces: Vec<Piece> = (0..(len / 4096) as u64).map(|i| Piece::new(i * 4096, ((i * 7) % 2048) * 4096, 4096)).collect();
        let list = c.write_list_notify(gpu_region(&d, len, Some(&data)), &remote, pieces.iter().copied(), 5, b"staged");
        let notes = inbox.wait(5, 1).unwrap();
        // Seen only after every piece landed.
        let mut got = vec![0u8; len];
        target.read_at(0, &mut got).unwrap();
        assert_eq!(first_difference(&got, &apply(&pieces, &data, len, true)), None);
        assert_eq!(&notes[0].payload[..], b"staged");
        list.finish().unwrap();
        // Dropped mid-flight: slots kept until the network is done, buffers
        // until their copies are.
        let regions = d.stats().regions;
        for round in 0..3u64 {
            let mut t = c.write_list(gpu_region(&d, len, Some(&pattern(len, round))), &remote, pieces.iter().copied());
            let _ = t.poll();
            drop(t);
        }
        let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
        // The drops waited for nothing: the network lets go of the slots, the
        // engine of what copies in flight held, each once done.
        while c.stats().in_flight > 0 || d.stats().regions != regions {
            assert!(std::time::Instant::now() < until, "{:?}, {} regions", c.stats(), d.stats().regions);
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // Still healthy.
        c.write_list(gpu_region(&d, 4096, Some(&[9; 4096])), &remote, [Piece::new(0, 0, 4096)]).finish().unwrap();
    }
}

gpu_tcp_test! {
    fn eight_concurrent_staged_lists_notify_right_and_a_peer_leaving_mid_list_fails_the_rest_promptly() {
        use gpu_rdma::Piece;
        let d = tcp_domain();
        let (s, c) = pair_on(&d, &d, opts(), opts());
        let mut inbox = s.inbox(16).unwrap();
        let page = 4096u64;
        let per = 64u64;
        let target = d.expose(d.alloc((8 * per * page) as usize).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
        let remote = s.grant(&target).whole();
        let datas: Vec<Vec<u8>> = (0..8).map(|k| pattern((per * page) as usize, 300 + k)).collect();
        // Eight staged lists in flight at once, tags k % 3, nobody waiting on them.
        let lists: Vec<_> = (0..8u64)
            .map(|k| {
                let pieces = (0..per).map(move |i| Piece::new(i * page, (i * 8 + k) * page, page));
                c.write_list_notify(gpu_region(&d, (per * page) as usize, Some(&datas[k as usize])), &remote, pieces, (k % 3) as u32, &[k as u8])
            })
            .collect();
        for (tag, n) in [(1u32, 3usize), (2, 2), (0, 3)] {
            for note in inbox.wait(tag, n).unwrap() {
                let k = u64::from(note.payload[0]);
                assert_eq!(k % 3, u64::from(tag));
                for i in 0..per {
                    let mut got = vec![0u8; page as usize];
                    target.read_at(((i * 8 + k) * page) as usize, &mut got).unwrap();
                    assert!(got[..] == datas[k as usize][(i * page) as usize..((i + 1) * page) as usize], "list {k} page {i}");
                }
            }
        }
        for l in lists {
            l.finish().unwrap();
        }
        // The peer goes away in the middle of a long staged list.
        let len = 8 << 20;
        let pieces = (0..1u64 << 20).map(|i| Piece::new((i % 2048) * 4096, ((i * 7) % 512) * 4096, 4096));
        let mut long = c.write_list(gpu_region(&d, len, None), &remote, pieces);
        for _ in 0..20 {
            assert!(long.poll().unwrap().is_none());
        }
        let left = std::time::Instant::now();
        drop(inbox);
        drop(s);
        let outcome = long.wait();
        assert!(matches!(outcome, Err(Error::ConnectionLost { .. } | Error::Completion(_))), "{outcome:?}");
        assert!(left.elapsed() < std::time::Duration::from_secs(1), "the staged list failed {:?} after the peer left", left.elapsed());
        let f = long.finish().unwrap_err();
        assert!(f.buffer.is_some(), "settled: the GPU buffer is back");
    }
}

gpu_tcp_test! {
    fn staged_sends_reach_the_peers_receives_in_the_order_they_were_made() {
        use common::gpu::{produce, produced};
        let d = tcp_domain();
        let (s, c) = pair_on(&d, &d, opts(), opts());
        // The first message's data comes from a producer that lands 200 ms
        // late: its copy out of the GPU waits for that fence, while the
        // messages made after it come from another GPU (another staging
        // stream), copied at once. They must still reach the peer's
        // receives after it, in the order made.
        let n = 64 << 10;
        let dev = CudaDevice::open(0).unwrap();
        let other = match CudaDevice::count() {
            Ok(k) if k >= 2 => 1,
            _ => {
                eprintln!("one CUDA device: the later messages share the first one's staging stream");
                0
            }
        };
        let on = |ordinal: usize, data: &[u8]| {
            common::gpu::gpu_region_on(&d, &CudaDevice::open(ordinal).unwrap(), n, Some(data), PathPolicy::Auto)
        };
        let stream = gpu_rdma::cuda::CudaStream::new(&dev).unwrap();
        let first = gpu_region(&d, n, None);
        produce(&stream, first.memory(), 0, n, 77, 200_000);
        first.memory().ready_after(&stream).unwrap();
        let later: Vec<Vec<u8>> = (0..7).map(|i| pattern(n, 600 + i)).collect();
        let rx: Vec<_> = (0..8).map(|_| s.recv(d.alloc(n).unwrap())).collect();
        let mut tx = vec![c.send(first)];
        tx.extend(later.iter().map(|data| c.send(on(other, data))));
        for p in tx.iter_mut().rev() {
            let _ = p.poll();
        }
        for (i, mut p) in tx.into_iter().enumerate() {
            p.wait().unwrap_or_else(|e| panic!("send {i}: {e}"));
        }
        for (i, p) in rx.into_iter().enumerate() {
            let (_, got) = p.finish().unwrap();
            let want = if i == 0 { produced(77, n) } else { later[i - 1].clone() };
            assert_eq!(first_difference(&got, &want), None, "receive {i} got another message");
        }
    }
}

gpu_tcp_test! {
    fn staged_gpu_memory_is_refused_on_several_rails_and_comes_back() {
        let rails = gpu_rdma::rails::Rails::from_domains(vec![tcp_domain(), tcp_domain()]).unwrap();
        let buf = CudaBuffer::alloc(&CudaDevice::open(0).expect("a CUDA device"), 1 << 20).unwrap();
        buf.copy_from_host(0, &[7u8; 16]).unwrap();
        let e = rails.expose(buf, Access::REMOTE_WRITE, 1).unwrap_err();
        assert!(matches!(e.error, Error::NeedsDirectPath { ref reason, .. } if reason.contains("staged")), "{}", e.error);
        let buf = e.buffer.expect("the buffer back");
        assert_eq!(read_gpu(&buf, 16), [7u8; 16]);
        assert_eq!(rails.domains().iter().map(|d| d.stats().regions).sum::<usize>(), 0, "every registration undone");
        // One rail is a plain domain: staged works there.
        let one = gpu_rdma::rails::Rails::from_domains(vec![tcp_domain()]).unwrap();
        assert!(one.expose(buf, Access::REMOTE_WRITE, 1).is_ok());
    }
}

gpu_tcp_test! {
    /// A batch posts its requests as they are, and staged GPU memory goes
    /// through a pipeline per operation: refused, typed, nothing posted,
    /// every buffer back, and the connection goes on.
    fn a_batch_with_staged_gpu_memory_is_refused_and_gives_its_buffers_back() {
        let d = tcp_domain();
        let (s, c) = pair_on(&d, &d, opts(), opts());
        let mut rx = s.recv(d.alloc(64).unwrap());
        let mut p = c.batch().send(gpu_region(&d, 64, Some(&[5u8; 64]))).send(gpu_region(&d, 64, None)).post();
        match p.wait() {
            Err(Error::NeedsDirectPath { what: "a batch", .. }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(c.in_flight().0, 0, "nothing posted");
        let bufs = p.into_buffer().expect("the buffers back");
        assert_eq!(bufs.len(), 2);
        assert_eq!(read_gpu(bufs[0].memory(), 64), [5u8; 64]);
        c.send(bufs.into_iter().next().unwrap().slice(..64)).wait().unwrap();
        assert_eq!(rx.wait().unwrap().byte_len, 64);
        assert!(c.broken().is_none());
    }
}

gpu_tcp_test! {
    /// On one connection operations take effect at the peer in posting
    /// order, whatever path each takes: a staged GPU write of 32 MiB, then
    /// a host send; when the peer sees the send, every byte of the write
    /// is there.
    fn a_send_after_a_staged_write_is_seen_only_after_the_write_landed() {
        let d = tcp_domain();
        const LEN: usize = 32 << 20;
        let target = d.expose(d.alloc(LEN).unwrap(), Access::REMOTE_WRITE, 7).unwrap();
        let (s, c) = pair_on(&d, &d, opts().advertise(&target), opts());
        let remote = c.remote_region(7).unwrap().whole();
        for round in 0..3u64 {
            let data = pattern(LEN, 40 + round);
            let src = gpu_region(&d, LEN, Some(&data));
            let mut note = s.recv(d.alloc(16).unwrap());
            let mut write = c.write(src, &remote);
            let mut sent = c.send_inline(&round.to_le_bytes(), None);
            note.wait().unwrap();
            let mut got = vec![0u8; LEN];
            target.read_at(0, &mut got).unwrap();
            let landed = first_difference(&got, &data);
            sent.wait().unwrap();
            write.wait().unwrap();
            assert_eq!(landed, None, "round {round}: the send overtook the staged write (first stale byte)");
            target.write_at(0, &vec![0u8; LEN]).unwrap();
        }
    }
}

gpu_tcp_test! {
    /// A randomized mix on one connection (host, staged GPU and list
    /// writes from two GPUs, then an inline, host, GPU or write-with-
    /// immediate message), verified at the peer as each message arrives:
    /// everything written before it is there. See
    /// [`common::gpu::ordered_mix`].
    fn a_random_mix_takes_effect_in_posting_order_over_tcp() {
        let d = tcp_domain();
        let (rounds, kinds) = common::gpu::ordered_mix(&d, &d, PathPolicy::Auto, 60, 0x0bde_0001);
        println!("{rounds} rounds in posting order over TCP; writes host/list/gpu/gpu list, messages inline/host/gpu/imm: {kinds:?}");
    }
}

gpu_tcp_test! {
    /// See [`common::gpu::notified_pages_are_visible`]: over TCP the
    /// receiver's GPU region is staged, and the note pulls its pages in.
    fn a_notified_list_into_staged_gpu_memory_is_visible_when_the_note_is_handed_out() {
        let d = tcp_domain();
        let n = common::gpu::notified_pages_are_visible(&d, &d, PathPolicy::Auto, 20);
        println!("{n} rounds of scattered pages visible in GPU memory at the note, over TCP (staged)");
    }
}

gpu_tcp_test! {
    /// A note names the region its transfer wrote by key, and the receiver
    /// copies the named range in from the staged mirror before it hands the
    /// note out: only where peers may write that region. A hostile peer
    /// writing raw ring records that names a region exposed for reading
    /// alone brings nothing of its mirror back over the owner's newer GPU
    /// data; the same record naming a writable region does pull its range
    /// (so the check is not vacuous).
    fn a_note_naming_a_region_peers_may_not_write_pulls_nothing_into_it() {
        use common::raw;
        use std::io::Write;
        let d = tcp_domain();
        let len = 64 << 10;
        let published = pattern(len, 71);
        let read_only = d.expose(gpu_region(&d, len, Some(&published)), Access::REMOTE_READ, 1).unwrap();
        let writable = d.expose(gpu_region(&d, len, Some(&published)), Access::REMOTE_WRITE, 2).unwrap();
        let newer = pattern(len, 72);
        for e in [&read_only, &writable] {
            e.publish().unwrap();
            e.cuda().copy_from_host(0, &newer).unwrap();
        }
        let listener = d.listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let o = opts().advertise(&read_only).advertise(&writable);
        let server = std::thread::spawn(move || listener.accept_timeout(&o, std::time::Duration::from_secs(10)));
        let (mut sock, theirs) = raw::hostile_client(addr, raw::endpoint(7, 64), vec![]);
        let victim = server.join().unwrap().expect("the victim accepts");
        let ring = raw::ring_of(&theirs);
        let (mut out, mut msg, mut at) = (Vec::new(), Vec::new(), 0);
        for tag in [1u32, 2] {
            let r = theirs.regions.iter().find(|r| r.tag == u64::from(tag)).copied().expect("advertised");
            raw::note_covering(false, r.rkey, &[(r.addr, len as u64)], b"", &mut msg);
            let rec = raw::ring_record(u64::from(tag), tag, &msg);
            raw::ring_write(&ring, tag, at, &rec, &mut out);
            at += rec.len() as u64;
        }
        sock.write_all(&out).unwrap();
        let mut inbox = victim.inbox(4).unwrap();
        assert_eq!(inbox.wait(1, 1).unwrap().len(), 1);
        assert_eq!(
            first_difference(&read_gpu(read_only.cuda(), len), &newer),
            None,
            "a read-only region's GPU memory after a note that names it"
        );
        assert_eq!(inbox.wait(2, 1).unwrap().len(), 1);
        assert_eq!(
            first_difference(&read_gpu(writable.cuda(), len), &published),
            None,
            "a writable region's GPU memory after a note that names it: its mirror pulled in"
        );
        assert!(victim.broken().is_none());
        drop((victim, sock));
    }
}

gpu_tcp_test! {
    /// The stream-ordered fence, given to one operation
    /// (`LocalSlice::after`): that send alone waits for the producer queued
    /// on the stream (its bytes are the producer's), its post returns at
    /// once, and a send of the other half of the same buffer, posted right
    /// after on another connection without it, does not wait. The buffer's
    /// own fence set stays empty: the fence was the operation's.
    fn a_fence_given_to_one_operation_is_waited_for_by_that_operation_alone() {
        use common::gpu::{produce, produced};
        use std::time::{Duration, Instant};
        let d = tcp_domain();
        let dev = CudaDevice::open(0).unwrap();
        let (sa, ca) = pair_on(&d, &d, opts(), opts());
        let (sb, cb) = pair_on(&d, &d, opts(), opts());
        let stream = gpu_rdma::cuda::CudaStream::new(&dev).unwrap();
        let len = 64 << 10;
        let other = pattern(len, 71);
        let mut init = vec![0u8; 2 * len];
        init[len..].copy_from_slice(&other);
        let buf: Shared<CudaBuffer> = gpu_region(&d, 2 * len, Some(&init)).share();
        produce(&stream, buf.cuda(), 0, len, 72, 400_000);
        let mut rxa = sa.recv(d.alloc(len).unwrap());
        let mut rxb = sb.recv(d.alloc(len).unwrap());
        let t0 = Instant::now();
        let mut a = ca.send(buf.clone().slice(..len).after(&stream).unwrap());
        let posted_in = t0.elapsed();
        let mut b = cb.send(buf.clone().slice(len..));
        b.wait_timeout(Duration::from_secs(10)).unwrap();
        rxb.wait_timeout(Duration::from_secs(10)).unwrap();
        let b_took = t0.elapsed();
        a.wait_timeout(Duration::from_secs(10)).unwrap();
        rxa.wait_timeout(Duration::from_secs(10)).unwrap();
        let a_took = t0.elapsed();
        println!("posted in {posted_in:?}; the other half went in {b_took:?}, the fenced half in {a_took:?}");
        assert!(posted_in < Duration::from_millis(100), "the post blocked on its fence: {posted_in:?}");
        assert!(a_took >= Duration::from_millis(350), "the send did not wait for its fence: {a_took:?}");
        assert!(b_took < Duration::from_millis(250), "a send without the fence waited for it: {b_took:?}");
        assert_eq!(first_difference(&rxa.into_buffer().unwrap()[..], &produced(72, len)), None, "stale data");
        assert_eq!(first_difference(&rxb.into_buffer().unwrap()[..], &other), None);
        // A host buffer filled by GPU work on the stream: the fence holds
        // its write in place too, and what follows it on the connection
        // stays behind it.
        let target = d.expose(d.alloc(len).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
        let remote = sa.grant(&target).whole();
        let host = d.alloc(len).unwrap();
        let dev_src = gpu_region(&d, len, None);
        produce(&stream, dev_src.memory(), 0, len, 73, 300_000);
        let t0 = Instant::now();
        // Stand-in for an asynchronous copy into host memory on the stream:
        // the producer's bytes land in `dev_src` late; the host buffer's
        // write waits for the stream, then the send behind it follows.
        let mut w = ca.write(host.slice(..).after(&stream).unwrap(), &remote);
        let mut rx = sa.recv(d.alloc(8).unwrap());
        let mut tail = ca.send_inline(b"after it", None);
        rx.wait_timeout(Duration::from_secs(10)).unwrap();
        let tail_seen = t0.elapsed();
        tail.wait_timeout(Duration::from_secs(10)).unwrap();
        w.wait_timeout(Duration::from_secs(10)).unwrap();
        println!("the send behind the fenced host write arrived after {tail_seen:?}");
        assert!(
            tail_seen >= Duration::from_millis(250),
            "the send overtook a write kept for its stream: {tail_seen:?}"
        );
        // A receive ring given the fence: made at once, its slots kept at
        // the gate until the work on its memory is done, so that work
        // cannot overwrite a message.
        let ring_buf = gpu_region(&d, 4 * 64, None);
        produce(&stream, ring_buf.memory(), 0, 4 * 64, 74, 300_000);
        let t0 = Instant::now();
        let mut ring = sa.recv_ring(ring_buf.slice(..).after(&stream).unwrap(), 64, 4);
        let made_in = t0.elapsed();
        assert_eq!(ring.posted(), 4, "kept slots count as posted");
        ca.send_inline(b"in the ring", None).wait_timeout(Duration::from_secs(10)).unwrap();
        let got = ring.next_timeout(Duration::from_secs(10)).unwrap();
        let landed_after = t0.elapsed();
        let mut landed = [0u8; 11];
        got.buffer().memory().copy_to_host(got.slot() * 64, &mut landed).unwrap();
        println!("the fenced ring was made in {made_in:?}; its first message was lent out after {landed_after:?}");
        assert!(made_in < Duration::from_millis(150), "the ring waited for its fence: {made_in:?}");
        assert!(landed_after >= Duration::from_millis(250), "a message landed before the ring's fence: {landed_after:?}");
        assert_eq!(&landed, b"in the ring");
        drop(got);
        stream.synchronize().unwrap();
    }
}

gpu_tcp_test! {
    /// A receive into host memory given a fence (`LocalSlice::after`: GPU
    /// work on a stream still reading that memory) is posted without its
    /// poster waiting: it is kept at the receive queue's gate until the
    /// work is done, and the receives posted after it wait behind it, so
    /// each message still lands in the receive posted for it, and none
    /// lands in the fenced memory while the work reads it.
    fn a_fenced_host_receive_never_blocks_its_poster_and_keeps_its_place() {
        use common::gpu::produce;
        use std::time::{Duration, Instant};
        let d = tcp_domain();
        let dev = CudaDevice::open(0).unwrap();
        let (s, c) = pair_on(&d, &d, opts(), opts());
        let stream = gpu_rdma::cuda::CudaStream::new(&dev).unwrap();
        // The GPU work the fence stands for: 400 ms on the stream.
        let busy = gpu_region(&d, 4096, None);
        produce(&stream, busy.memory(), 0, 4096, 81, 400_000);
        let t0 = Instant::now();
        let first = s.recv(d.alloc(4096).unwrap().slice(..).after(&stream).unwrap());
        let second = s.recv(d.alloc(4096).unwrap());
        let mut imm = s.recv_imm();
        let posted_in = t0.elapsed();
        let (m1, m2) = (pattern(4096, 82), pattern(4096, 83));
        let mut a = d.alloc(4096).unwrap();
        a.copy_from_slice(&m1);
        let mut b = d.alloc(4096).unwrap();
        b.copy_from_slice(&m2);
        let tx1 = c.send(a);
        let tx2 = c.send(b);
        let tx3 = c.send_inline(&[], Some(9));
        let (c1, r1) = first.finish().unwrap();
        let landed_after = t0.elapsed();
        let (_, r2) = second.finish().unwrap();
        assert_eq!(imm.wait().unwrap().imm, Some(9));
        for t in [tx1, tx2] {
            t.finish().unwrap();
        }
        tx3.finish().unwrap();
        println!("posted in {posted_in:?}; the fenced receive's message landed after {landed_after:?}");
        assert!(posted_in < Duration::from_millis(150), "the posts waited for the fence: {posted_in:?}");
        assert!(landed_after >= Duration::from_millis(350), "a message landed before the fence: {landed_after:?}");
        assert_eq!(c1.byte_len, 4096);
        assert_eq!(first_difference(&r1[..], &m1), None, "the first message, in the first receive");
        assert_eq!(first_difference(&r2[..], &m2), None, "the second message, in the second receive");
        // Dropping a receive still kept for its fence is safe and frees its place.
        produce(&stream, busy.memory(), 0, 4096, 84, 300_000);
        drop(s.recv(d.alloc(4096).unwrap().slice(..).after(&stream).unwrap()));
        let next = s.recv(d.alloc(64).unwrap());
        c.send_inline(b"after the drop", None).wait().unwrap();
        let (done, got) = next.finish().unwrap();
        assert_eq!(&got[..done.byte_len as usize], b"after the drop");
        // A receive ring made behind a receive kept for its fences is made
        // at once: its slots are kept behind that one, go once it was
        // posted, and take the messages after its.
        produce(&stream, busy.memory(), 0, 4096, 85, 300_000);
        let t0 = Instant::now();
        let kept = s.recv(d.alloc(64).unwrap().slice(..).after(&stream).unwrap());
        let mut ring = s.recv_ring(d.alloc(4 * 64).unwrap(), 64, 4);
        let ring_made_in = t0.elapsed();
        assert!(ring_made_in < Duration::from_millis(150), "the ring waited for the kept receive: {ring_made_in:?}");
        assert_eq!(ring.posted(), 4);
        c.send_inline(b"first", None).wait().unwrap();
        c.send_inline(b"second", None).wait().unwrap();
        let (done, got) = kept.finish().unwrap();
        assert_eq!(&got[..done.byte_len as usize], b"first");
        assert_eq!(&ring.next().unwrap()[..], b"second");
        stream.synchronize().unwrap();
    }
}

gpu_tcp_test! {
    /// Staged operations of different connections never wait for each
    /// other's fences: connection A's send waits for a producer that lands
    /// 600 ms late; connection B's unfenced send on the same GPU goes at
    /// once. And dropping A's send, its fence still pending, returns at
    /// once: nothing is synchronized on drop.
    fn a_fence_on_one_connection_holds_up_no_other_and_no_drop() {
        use common::gpu::produce;
        use std::time::{Duration, Instant};
        let d = tcp_domain();
        let dev = CudaDevice::open(0).unwrap();
        let (sa, ca) = pair_on(&d, &d, opts(), opts());
        let (sb, cb) = pair_on(&d, &d, opts(), opts());
        let stream = gpu_rdma::cuda::CudaStream::new(&dev).unwrap();
        let slow = gpu_region(&d, 64 << 10, None);
        produce(&stream, slow.memory(), 0, 64 << 10, 61, 600_000);
        slow.memory().ready_after(&stream).unwrap();
        let mut rxa = sa.recv(d.alloc(64 << 10).unwrap());
        let t0 = Instant::now();
        let mut a = ca.send(slow);
        let msg = pattern(64 << 10, 62);
        let mut rxb = sb.recv(d.alloc(64 << 10).unwrap());
        let mut b = cb.send(gpu_region(&d, 64 << 10, Some(&msg)));
        b.wait_timeout(Duration::from_secs(10)).unwrap();
        rxb.wait_timeout(Duration::from_secs(10)).unwrap();
        let b_took = t0.elapsed();
        assert_eq!(first_difference(&rxb.into_buffer().unwrap()[..], &msg), None);
        a.wait_timeout(Duration::from_secs(10)).unwrap();
        rxa.wait_timeout(Duration::from_secs(10)).unwrap();
        let a_took = t0.elapsed();
        println!("the unfenced send on another connection took {b_took:?}; the fenced one {a_took:?}");
        assert!(a_took >= Duration::from_millis(550), "the fenced send did not wait for its producer: {a_took:?}");
        assert!(b_took < Duration::from_millis(300), "an unrelated send waited for another connection's fence: {b_took:?}");
        assert_eq!(first_difference(&rxa.into_buffer().unwrap()[..], &common::gpu::produced(61, 64 << 10)), None);

        // Dropped with its fence pending: the drop does not wait for it.
        let slow = gpu_region(&d, 64 << 10, None);
        produce(&stream, slow.memory(), 0, 64 << 10, 63, 600_000);
        slow.memory().ready_after(&stream).unwrap();
        let a = ca.send(slow);
        let t0 = Instant::now();
        drop(a);
        let dropped_in = t0.elapsed();
        println!("dropped a staged send with its fence 600 ms out in {dropped_in:?}");
        assert!(dropped_in < Duration::from_millis(200), "the drop waited for the fence: {dropped_in:?}");
        // The connection goes on: the next send on it works (the dropped
        // one never reached the network).
        let mut rx = sa.recv(d.alloc(64).unwrap());
        ca.send_inline(b"after", None).wait_timeout(Duration::from_secs(10)).unwrap();
        rx.wait_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(&rx.into_buffer().unwrap()[..5], b"after");
        stream.synchronize().unwrap();
    }
}

gpu_tcp_test! {
    /// A framework's own GPU memory, as cudarc hands it around (candle's
    /// `CudaStorage` holds a `CudaSlice`): registered as it is, no copy.
    /// A slice given by value is sent, its producer's work on the slice's
    /// stream fencing the send; a slice the framework keeps (shared) is the
    /// target of the peer's write and of a write with immediate, and the
    /// framework reads the written bytes back through cudarc itself. A
    /// send fenced on the framework's cudarc stream waits for its work
    /// without blocking its poster.
    fn a_frameworks_cudarc_slices_move_over_tcp_as_they_are() {
        use cudarc::driver::CudaContext;
        use std::sync::Arc;
        let d = tcp_domain();
        let ctx = CudaContext::new(0).expect("cudarc's context on the stand-in's device 0");
        let stream = ctx.default_stream();
        let len = 256 << 10;
        let data = pattern(len, 91);
        // By value: the buffer owns the slice, and cudarc frees it after.
        let owned = stream.clone_htod(&data).unwrap();
        let buf = CudaBuffer::from_cudarc(owned).unwrap();
        assert_eq!(buf.len(), len);
        let src = d.register(buf, Access::LOCAL).unwrap();
        // Shared: the framework keeps the slice, as f32s.
        let kept: Arc<cudarc::driver::CudaSlice<f32>> = Arc::new(stream.alloc_zeros::<f32>(len / 4).unwrap());
        let target = d.expose(d.register(CudaBuffer::from_cudarc_shared(Arc::clone(&kept)).unwrap(), Access::LOCAL).unwrap(), Access::REMOTE_WRITE, 4).unwrap();
        let (s, c) = pair_on(&d, &d, opts().advertise(&target), opts());
        let rx = s.recv(d.alloc(len).unwrap());
        let src = c.send(src).finish().unwrap().1;
        let (done, got) = rx.finish().unwrap();
        assert_eq!(done.byte_len as usize, len);
        assert_eq!(first_difference(&got[..], &data), None, "the owned slice's bytes, sent");
        // The peer writes the owned slice's bytes into the shared one, with
        // an immediate: visible to the framework when the immediate is seen.
        let mut imm = s.recv_imm();
        c.write_with_imm(src, &c.remote_region(4).unwrap().whole(), 5).wait().unwrap();
        assert_eq!(imm.wait().unwrap().imm, Some(5));
        let back: Vec<f32> = stream.clone_dtoh(&*kept).unwrap();
        let bytes: Vec<u8> = back.iter().flat_map(|f| f.to_ne_bytes()).collect();
        assert_eq!(first_difference(&bytes, &data), None, "the framework reads the written bytes through cudarc");
        // A fence from the framework's own stream: 300 ms of its work on a
        // buffer, then a send of that buffer fenced on the stream. The post
        // returns at once; the peer sees the work's bytes.
        let theirs = ctx.new_stream().unwrap();
        let fence = gpu_rdma::cuda::CudaStream::from_cudarc(&theirs).unwrap();
        let busy = gpu_region(&d, 4096, None);
        common::gpu::produce(&fence, busy.memory(), 0, 4096, 93, 300_000);
        let t0 = std::time::Instant::now();
        let rx = s.recv(d.alloc(4096).unwrap());
        let tx = c.send(busy.slice(..4096).after(&fence).unwrap());
        let posted_in = t0.elapsed();
        let (_, got) = rx.finish().unwrap();
        let seen_after = t0.elapsed();
        tx.finish().unwrap();
        println!("a send fenced on the framework's stream: posted in {posted_in:?}, seen after {seen_after:?}");
        assert!(posted_in < std::time::Duration::from_millis(150), "the post waited: {posted_in:?}");
        assert!(seen_after >= std::time::Duration::from_millis(250), "the send overtook the work: {seen_after:?}");
        assert_eq!(first_difference(&got[..], &common::gpu::produced(93, 4096)), None, "the work's bytes");
        // The framework's slice outlives the registration; it is still its own.
        drop((target, s, c));
        assert_eq!(Arc::strong_count(&kept), 1);
    }
}
