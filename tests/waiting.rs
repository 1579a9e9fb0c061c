//! Waiting on many operations without a thread each: futures awaited from
//! a single-threaded tokio runtime, a completion set, callbacks, and what
//! happens when futures are dropped, time out, or their peer goes away.
//!
//! Each test runs on both transports: `tcp::name` in plain `cargo test`,
//! `verbs::name` on an RDMA device (`--ignored`, `GPU_RDMA_TEST_DEVICE`;
//! `cargo xtask test` runs them on soft-RoCE).

#[macro_use]
mod common;

use std::sync::mpsc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use gpu_rdma::{Access, CompletionSet, Connection, Domain, Error, Opcode, Piece};

use common::{Kind, apply, domain, filled, first_difference, opts, pair_on, pattern};

const OPS: usize = 1000;
const LEN: usize = 4096;

/// A pair whose queues hold all `OPS` operations at once.
fn deep_pair(d: &Domain) -> (Connection, Connection) {
    let o = opts().queue_depth(OPS as u32 + 24, OPS as u32 + 24);
    pair_on(d, d, o.clone(), o)
}

/// Threads of this process now.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn a_thousand_operations_are_awaited_from_a_single_threaded_runtime(t: Kind) {
    let d = domain(t);
    let (s, c) = deep_pair(&d);
    let target = d.expose(d.alloc(OPS * LEN).unwrap(), Access::REMOTE_WRITE | Access::REMOTE_READ, 0).unwrap();
    let remote = s.grant(&target);
    let datas: Vec<Vec<u8>> = (0..OPS).map(|i| pattern(LEN, i as u64)).collect();
    let before = threads();
    runtime().block_on(async {
        // All posted before any is awaited: a thousand in flight at once.
        let mut writes: Vec<_> = (0..OPS)
            .map(|i| {
                let slot = remote.slice((i * LEN) as u64..((i + 1) * LEN) as u64).unwrap();
                c.write(filled(&d, &datas[i]), &slot)
            })
            .collect();
        assert!(c.stats().in_flight > 0);
        // Awaited in reverse order, on one thread.
        for w in writes.iter_mut().rev() {
            let done = w.await.unwrap();
            assert_eq!(done.opcode, Opcode::Write);
        }
        // Reads, awaited concurrently through a join set on the same thread.
        let mut set = tokio::task::JoinSet::new();
        for i in 0..OPS {
            let slot = remote.slice((i * LEN) as u64..((i + 1) * LEN) as u64).unwrap();
            let mut read = c.read(d.alloc(LEN).unwrap(), &slot);
            set.spawn(async move {
                (&mut read).await.unwrap();
                (i, read.into_buffer().unwrap())
            });
        }
        let mut n = 0;
        while let Some(joined) = set.join_next().await {
            let (i, back) = joined.unwrap();
            assert_eq!(first_difference(&back, &datas[i]), None, "read {i}");
            n += 1;
        }
        assert_eq!(n, OPS);
    });
    // One engine thread for this domain (tests running beside this one may
    // start a few threads of their own): nothing like a thread per operation.
    let grown = threads().saturating_sub(before);
    assert!(grown < 16, "{grown} threads were started for {OPS} awaited operations");
    drop(s);
}

fn a_completion_set_waits_for_a_thousand_without_a_runtime(t: Kind) {
    let d = domain(t);
    let (s, c) = deep_pair(&d);
    let mut set = CompletionSet::new();
    // A thousand receives at one end, a thousand sends at the other, all
    // in one set, waited for from this thread.
    let mut recv_keys = std::collections::HashMap::new();
    for _ in 0..OPS {
        let key = set.insert(s.recv(d.alloc(LEN).unwrap()));
        recv_keys.insert(key, ());
    }
    for i in 0..OPS {
        set.insert(c.send(filled(&d, &pattern(LEN, 1000 + i as u64))));
    }
    assert_eq!(set.len(), 2 * OPS);
    let mut sends = 0;
    let mut received = Vec::new();
    while let Some(done) = set.wait_any(Duration::from_secs(60)).unwrap() {
        let c = done.result.unwrap();
        if recv_keys.contains_key(&done.key) && c.opcode == Opcode::Recv {
            received.push(done.buffer);
        } else {
            assert_eq!(c.opcode, Opcode::Send);
            sends += 1;
        }
    }
    assert!(set.is_empty());
    assert_eq!((sends, received.len()), (OPS, OPS));
    // Receives complete in order: message i landed in the i-th receive.
    let by_stamp: std::collections::HashMap<Vec<u8>, u64> =
        (0..OPS as u64).map(|i| (pattern(LEN, 1000 + i), i)).map(|(p, i)| (p[..8].to_vec(), i)).collect();
    let mut got: Vec<u64> = received
        .iter()
        .map(|b| {
            let i = by_stamp[&b[..8]];
            assert!(b[..] == pattern(LEN, 1000 + i)[..], "message {i} arrived whole");
            i
        })
        .collect();
    got.sort_unstable();
    assert_eq!(got, (0..OPS as u64).collect::<Vec<_>>(), "every message arrived once");
    // wait_all, and an empty set.
    let target = d.expose(d.alloc(64 * LEN).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target);
    for i in 0..64 {
        set.insert(c.write(filled(&d, &pattern(LEN, i)), &remote.slice(i * LEN as u64..(i + 1) * LEN as u64).unwrap()));
    }
    let all = set.wait_all(Duration::from_secs(60)).unwrap();
    assert_eq!(all.len(), 64);
    assert!(all.iter().all(|f| f.result.is_ok()));
    assert!(set.wait_any(Duration::from_millis(1)).unwrap().is_none());
}

fn a_wait_on_a_set_is_bounded_and_keeps_what_did_not_finish(t: Kind) {
    let d = domain(t);
    let (s, c) = deep_pair(&d);
    let mut set = CompletionSet::new();
    set.insert(s.recv(d.alloc(64).unwrap()));
    let started = Instant::now();
    assert!(matches!(set.wait_any(Duration::from_millis(200)), Err(Error::Timeout { .. })));
    assert!(started.elapsed() >= Duration::from_millis(200) && started.elapsed() < Duration::from_secs(5));
    assert_eq!(set.len(), 1, "still in the set");
    c.send_inline(b"late", None).wait().unwrap();
    let done = set.wait_any(Duration::from_secs(30)).unwrap().unwrap();
    assert_eq!(&done.buffer[..4], b"late");
}

fn callbacks_run_once_each_with_the_buffer(t: Kind) {
    let d = domain(t);
    let (s, c) = deep_pair(&d);
    let (tx, rx) = mpsc::channel();
    for i in 0..200u64 {
        let tx = tx.clone();
        s.recv(d.alloc(64).unwrap()).on_complete(move |result, buffer| {
            let _ = tx.send((i, result.map(|c| c.byte_len), buffer.map(|b| b[0])));
        });
    }
    for i in 0..200u8 {
        c.send_inline(&[i; 16], None).wait().unwrap();
    }
    let mut seen = [false; 200];
    for _ in 0..200 {
        let (i, len, first) = rx.recv_timeout(Duration::from_secs(30)).expect("a callback");
        assert_eq!(len.unwrap(), 16);
        // Receives complete in posting order: receive i got message i.
        assert_eq!(first, Some(i as u8));
        assert!(!seen[i as usize], "callback {i} ran twice");
        seen[i as usize] = true;
    }
    assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "no callback ran twice");
}

fn an_awaited_operation_times_out_and_can_be_awaited_again(t: Kind) {
    let d = domain(t);
    let o = opts().op_timeout(Duration::from_millis(300));
    let (s, c) = pair_on(&d, &d, o.clone(), o);
    runtime().block_on(async {
        let mut r = s.recv(d.alloc(64).unwrap());
        let started = Instant::now();
        assert!(matches!((&mut r).await, Err(Error::Timeout { .. })));
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(3), "{took:?}");
        c.send_inline(b"now", None).wait().unwrap();
        assert_eq!((&mut r).await.unwrap().byte_len, 3);
        assert_eq!(&r.into_buffer().unwrap()[..3], b"now");
    });
}

/// Polls a future once with a waker that does nothing.
fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    let mut cx = Context::from_waker(Waker::noop());
    std::pin::Pin::new(f).poll(&mut cx)
}

fn dropping_futures_mid_flight_keeps_buffers_until_the_device_is_done(t: Kind) {
    let d = domain(t);
    let (s, c) = deep_pair(&d);
    let target = d.expose(d.alloc(OPS * LEN).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target);
    let regions = d.stats().regions;
    for round in 0..5u64 {
        let mut writes: Vec<_> = (0..OPS)
            .map(|i| {
                c.write(
                    filled(&d, &pattern(LEN, round)),
                    &remote.slice((i * LEN) as u64..((i + 1) * LEN) as u64).unwrap(),
                )
            })
            .collect();
        // Polled once (a waker registered, a timer armed), then dropped.
        for w in writes.iter_mut().step_by(2) {
            let _ = poll_once(w);
        }
        let mut list = c.write_list(
            filled(&d, &pattern(OPS * LEN, round)),
            &remote.whole(),
            (0..OPS as u64).map(|i| Piece::new(i * LEN as u64, i * LEN as u64, LEN as u64)),
        );
        let _ = poll_once(&mut list);
        drop(list);
        drop(writes);
    }
    let until = Instant::now() + Duration::from_secs(30);
    while c.stats().in_flight > 0 {
        assert!(Instant::now() < until, "{:?}", c.stats());
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(d.stats().regions, regions, "every dropped operation's buffer was released");
    // Still healthy.
    c.write(filled(&d, b"ok"), &remote.slice(0..2).unwrap()).wait().unwrap();
}

fn an_awaited_receive_fails_promptly_when_the_peer_goes_away(t: Kind) {
    let d = domain(t);
    let (s, c) = deep_pair(&d);
    runtime().block_on(async {
        let mut r = s.recv(d.alloc(64).unwrap());
        let leaving = tokio::task::spawn_blocking(move || {
            std::thread::sleep(Duration::from_millis(100));
            let at = Instant::now();
            drop(c);
            at
        });
        let outcome = (&mut r).await;
        let ended = Instant::now();
        let left_at = leaving.await.unwrap();
        assert!(matches!(outcome, Err(Error::ConnectionLost { .. })), "{outcome:?}");
        let took = ended.saturating_duration_since(left_at);
        assert!(took < Duration::from_secs(1), "the await failed {took:?} after the peer left");
    });
}

fn a_receive_ring_is_awaited_in_order_bounded_and_cancel_safe(t: Kind) {
    let d = domain(t);
    let o = opts().op_timeout(Duration::from_millis(300));
    let (s, c) = pair_on(&d, &d, o.clone(), o);
    let mut ring = s.recv_ring(d.alloc(4 * 64).unwrap(), 64, 4);
    runtime().block_on(async {
        // Sent from another thread while the runtime's one thread awaits.
        let sender = tokio::task::spawn_blocking(move || {
            for k in 0..40u32 {
                c.send_with_imm(filled(&d, &pattern(1 + k as usize, u64::from(k))), k).wait().unwrap();
            }
            (c, d)
        });
        for k in 0..40u32 {
            let got = ring.recv().await.unwrap();
            assert_eq!((got.imm(), &got[..]), (Some(k), &pattern(1 + k as usize, u64::from(k))[..]));
        }
        let (c, d) = sender.await.unwrap();

        // Nothing to receive: a timeout after the operation timeout, and the
        // receive stays posted.
        let started = Instant::now();
        assert!(matches!(ring.recv().await, Err(Error::Timeout { .. })));
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(3), "{took:?}");
        assert_eq!(ring.posted(), 4);

        // A future polled and dropped loses nothing: the message is the
        // next call's, with a deadline of its own.
        {
            let mut first = Box::pin(ring.recv());
            assert!(poll_once(&mut first).is_pending());
        }
        c.send_inline(b"kept", None).wait().unwrap();
        assert_eq!(&ring.recv().await.unwrap()[..], b"kept");

        // A peer that goes away fails the await promptly.
        drop((c, d));
        let e = ring.recv().await.map(|_| ()).unwrap_err();
        assert!(!e.is_timeout(), "{e}");
    });
}

fn a_transfer_list_is_awaited(t: Kind) {
    let d = domain(t);
    let (s, c) = deep_pair(&d);
    let len = 4 << 20;
    let target = d.expose(d.alloc(len).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let data = pattern(len, 77);
    let pieces: Vec<Piece> =
        (0..(len / 1024) as u64).map(|i| Piece::new(i * 1024, ((i * 37) % 4096) * 1024, 1024)).collect();
    let expect = apply(&pieces, &data, len, true);
    runtime().block_on(async {
        let mut list = c.write_list(filled(&d, &data), &remote, pieces);
        let done = (&mut list).await.unwrap();
        assert_eq!(done.bytes, len as u64);
    });
    let mut got = vec![0u8; len];
    target.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &expect), None);
}

/// Lists go in a completion set beside single operations, and take
/// callbacks as operations do: each finishes as a whole, with its bytes,
/// its opcode and its buffer, once every piece landed (checked at the peer
/// when the set hands it out).
fn lists_wait_in_a_set_beside_operations_and_take_callbacks(t: Kind) {
    const LISTS: usize = 8;
    let d = domain(t);
    let (s, c) = deep_pair(&d);
    let len = 1 << 20;
    let target = d.expose(d.alloc(LISTS * len).unwrap(), Access::REMOTE_WRITE | Access::REMOTE_READ, 0).unwrap();
    let remote = s.grant(&target).whole();
    // Each list scatters 1 KiB pieces of its own data over its own 1 MiB.
    let pieces = |k: usize| -> Vec<Piece> {
        (0..(len / 1024) as u64)
            .map(|i| Piece::new(i * 1024, (k * len) as u64 + ((i * 37) % 1024) * 1024, 1024))
            .collect()
    };
    let mut set = CompletionSet::new();
    let mut lists = std::collections::HashMap::new();
    for k in 0..LISTS {
        let key = set.insert(c.write_list(filled(&d, &pattern(len, k as u64)), &remote, pieces(k)));
        lists.insert(key, k);
    }
    // Single operations in the same set: receives the peer fills.
    let recvs: Vec<usize> = (0..4).map(|_| set.insert(c.recv(d.alloc(64).unwrap()))).collect();
    for i in 0..4u8 {
        s.send_inline(&[i; 8], None).wait().unwrap();
    }
    let mut seen_lists = 0;
    let mut seen_recvs = 0;
    while let Some(done) = set.wait_any(Duration::from_secs(60)).unwrap() {
        let completion = done.result.expect("finished");
        if let Some(&k) = lists.get(&done.key) {
            assert_eq!((completion.opcode, completion.byte_len), (Opcode::Write, len as u32));
            assert_eq!(&done.buffer[..], &pattern(len, k as u64)[..], "list {k}'s buffer came back");
            let mut got = vec![0u8; len];
            target.read_at(k * len, &mut got).unwrap();
            let rel: Vec<Piece> =
                pieces(k).iter().map(|p| Piece::new(p.local, p.remote - (k * len) as u64, p.len)).collect();
            let expect = apply(&rel, &pattern(len, k as u64), len, true);
            assert_eq!(first_difference(&got, &expect), None, "list {k} had landed whole when the set handed it out");
            seen_lists += 1;
        } else {
            assert!(recvs.contains(&done.key));
            assert_eq!((completion.opcode, completion.byte_len), (Opcode::Recv, 8));
            seen_recvs += 1;
        }
    }
    assert_eq!((seen_lists, seen_recvs), (LISTS, 4));
    // A list read back with a callback: the outcome and the buffer, once.
    let (tx, rx) = mpsc::channel();
    let back: Vec<Piece> = (0..(len / 4096) as u64).map(|i| Piece::new(i * 4096, i * 4096, 4096)).collect();
    c.read_list(d.alloc(len).unwrap(), &remote, back).on_complete(move |result, buffer| {
        let _ = tx.send((result.map(|t| t.bytes), buffer));
    });
    let (bytes, buffer) = rx.recv_timeout(Duration::from_secs(60)).expect("the list's callback");
    assert_eq!(bytes.unwrap(), len as u64);
    let mut want = vec![0u8; len];
    target.read_at(0, &mut want).unwrap();
    assert_eq!(first_difference(&buffer.expect("the buffer")[..], &want), None);
    assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "the callback ran once");
}

/// Threads blocked on one connection reap each other's completions, and
/// the engine's thread, for a future awaited beside them, takes the
/// completion channel's events: each blocked thread must still be woken
/// for its own completion, not sleep through it to its timeout.
fn threads_waiting_on_one_connection_wake_for_each_others_completions(t: Kind) {
    const THREADS: usize = 4;
    const EACH: usize = 250;
    let d = domain(t);
    // No busy-polling: a wait that does not end at its first look sleeps.
    let o = opts().spin(Duration::ZERO);
    let (s, c) = pair_on(&d, &d, o.clone(), o);
    let target =
        d.expose(d.alloc((THREADS + 1) * LEN).unwrap(), Access::REMOTE_WRITE | Access::REMOTE_READ, 0).unwrap();
    let remote = s.grant(&target);
    let slot = |k: usize| remote.slice((k * LEN) as u64..((k + 1) * LEN) as u64).unwrap();
    let done = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        let awaited = sc.spawn(|| {
            runtime().block_on(async {
                let mut reads = 0;
                while done.load(std::sync::atomic::Ordering::Acquire) < THREADS {
                    c.read(d.alloc(LEN).unwrap(), &slot(THREADS)).await.unwrap();
                    reads += 1;
                }
                reads
            })
        });
        for k in 0..THREADS {
            let (c, d, done, to) = (&c, &d, &done, slot(k));
            sc.spawn(move || {
                let data = pattern(LEN, k as u64);
                let mut buf = filled(d, &data);
                for i in 0..EACH {
                    let mut w = c.write(buf, &to);
                    // Far longer than a 4 KiB write takes: reached only by
                    // a thread that slept through its completion.
                    if let Err(e) = w.wait_timeout(Duration::from_secs(10)) {
                        panic!("thread {k}, write {i} of {EACH}: {e}");
                    }
                    buf = w.into_buffer().unwrap();
                }
                done.fetch_add(1, std::sync::atomic::Ordering::Release);
            });
        }
        assert!(awaited.join().unwrap() > 0, "the awaited reads ran beside the blocked writes");
    });
    for k in 0..THREADS {
        let mut got = vec![0u8; LEN];
        target.read_at(k * LEN, &mut got).unwrap();
        assert_eq!(first_difference(&got, &pattern(LEN, k as u64)), None, "thread {k}'s slot");
    }
}

both!(
    a_thousand_operations_are_awaited_from_a_single_threaded_runtime,
    a_completion_set_waits_for_a_thousand_without_a_runtime,
    a_wait_on_a_set_is_bounded_and_keeps_what_did_not_finish,
    callbacks_run_once_each_with_the_buffer,
    an_awaited_operation_times_out_and_can_be_awaited_again,
    dropping_futures_mid_flight_keeps_buffers_until_the_device_is_done,
    an_awaited_receive_fails_promptly_when_the_peer_goes_away,
    a_transfer_list_is_awaited,
    lists_wait_in_a_set_beside_operations_and_take_callbacks,
    a_receive_ring_is_awaited_in_order_bounded_and_cancel_safe,
    threads_waiting_on_one_connection_wake_for_each_others_completions,
);
