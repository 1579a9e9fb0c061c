//! Transfer lists: many pieces between one local buffer and one remote
//! range in one call, verified byte for byte over the whole remote (or
//! local) range, so a misplaced, missing or extra byte shows; refused
//! whole on bad input, with nothing moved and the buffer back; dropped
//! mid-flight safely; failing promptly when the peer goes away.
//!
//! Each test runs on both transports: `tcp::name` in plain `cargo test`,
//! `verbs::name` on an RDMA device (`--ignored`, `GPU_RDMA_TEST_DEVICE`;
//! `cargo xtask test` runs them on soft-RoCE).

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use gpu_rdma::{Access, Error, PageLayout, Piece};

use common::{Kind, Rng, apply, domain, filled, first_difference, pair, pattern, random_pieces};

fn a_list_of_ten_thousand_random_pieces_is_written_byte_for_byte(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let mut rng = Rng(0x5eed_0001);
    let local_len = 1 << 20;
    let (pieces, span) = random_pieces(&mut rng, 10_000, 1024, local_len);
    let target = d.expose(d.alloc(span as usize).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let data = pattern(local_len as usize, 11);
    let list: Vec<Piece> = pieces.iter().map(|&(r, l, len)| Piece::new(l, r, len)).collect();
    let expect = apply(&list, &data, span as usize, true);
    let transfer = c.write_list(filled(&d, &data), &remote, list.iter().copied());
    let total: u64 = list.iter().map(|p| p.len).sum();
    assert_eq!(transfer.len(), total);
    let (done, back) = transfer.finish().unwrap();
    assert_eq!(done.bytes, total);
    let depth = c.info().send_queue_depth as usize;
    assert!(done.requests < 10_000, "adjacent pieces were merged: {} requests", done.requests);
    assert!(done.requests > depth, "the list is longer than the send queue ({depth})");
    assert!(done.posts > 1 && done.posts < done.requests, "chains of requests: {done:?}");
    assert_eq!(&back[..], &data[..], "the local buffer is unchanged");
    let mut got = vec![0u8; span as usize];
    target.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &expect), None, "the remote range differs from the list's result");
    drop(s);
}

fn a_list_of_ten_thousand_random_pieces_is_read_byte_for_byte(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let mut rng = Rng(0x5eed_0002);
    let remote_len = 1 << 20;
    let (pieces, span) = random_pieces(&mut rng, 10_000, 700, remote_len);
    let source = pattern(remote_len as usize, 12);
    let exposed = d.expose(filled(&d, &source), Access::REMOTE_READ, 0).unwrap();
    let remote = s.grant(&exposed).whole();
    let list: Vec<Piece> = pieces.iter().map(|&(l, r, len)| Piece::new(l, r, len)).collect();
    let expect = apply(&list, &source, span as usize, false);
    let total: u64 = list.iter().map(|p| p.len).sum();
    let (done, back) = c.read_list(d.alloc(span as usize).unwrap(), &remote, list).finish().unwrap();
    assert_eq!(done.bytes, total);
    assert_eq!(first_difference(&back, &expect), None, "the local buffer differs from the list's result");
    drop(s);
}

fn pages_of_a_paged_pool_land_where_the_layout_says(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    // Local pool: 64 pages of 4 KiB with 1 KiB of padding between them;
    // remote pool: 128 pages packed.
    let page = 4096u64;
    let layout =
        PageLayout { page_len: page, local_base: 512, local_stride: page + 1024, remote_base: 0, remote_stride: page };
    let local_len = 512 + 64 * (page + 1024);
    let data = pattern(local_len as usize, 13);
    let target = d.expose(d.alloc(128 * page as usize).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let local_pages: Vec<u32> = (0..64).rev().collect();
    let remote_pages: Vec<u32> = (0..64).map(|i| 127 - 2 * i).collect();
    let pieces = Piece::pages(&layout, &local_pages, &remote_pages).unwrap();
    let (done, _) = c.write_list(filled(&d, &data), &remote, pieces).finish().unwrap();
    assert_eq!(done.bytes, 64 * page);
    let mut got = vec![0u8; 128 * page as usize];
    target.read_at(0, &mut got).unwrap();
    for (l, r) in local_pages.iter().zip(&remote_pages) {
        let from = (512 + u64::from(*l) * (page + 1024)) as usize;
        let to = (u64::from(*r) * page) as usize;
        assert_eq!(&got[to..to + page as usize], &data[from..from + page as usize], "page {l} -> {r}");
    }
    let untouched = (0..128u32).filter(|p| !remote_pages.contains(p));
    for p in untouched {
        let at = (u64::from(p) * page) as usize;
        assert!(got[at..at + page as usize].iter().all(|&b| b == 0), "page {p} was not in the list");
    }
}

fn a_bad_piece_refuses_the_whole_list_moves_nothing_and_returns_the_buffer(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let target = d.expose(d.alloc(64 * 1024).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let data = pattern(8192, 14);
    let mut pieces: Vec<Piece> = (0..100).map(|i| Piece::new(i * 64, i * 64, 64)).collect();
    // One piece past the end of the remote range, last in the list.
    pieces.push(Piece::new(0, 64 * 1024 - 10, 11));
    let failed = c.write_list(filled(&d, &data), &remote, pieces).finish().unwrap_err();
    assert!(matches!(failed.error, Error::OutOfBounds { side: "remote", .. }), "{failed}");
    let back = failed.buffer.expect("nothing was posted: the buffer is back");
    assert_eq!(&back[..], &data[..]);
    let mut got = vec![0u8; 64 * 1024];
    target.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "nothing of a refused list reached the peer");
    // Local side, and an overflowing piece: the same.
    let failed = c.write_list(back, &remote, [Piece::new(8190, 0, 4)]).finish().unwrap_err();
    assert!(matches!(failed.error, Error::OutOfBounds { side: "local", .. }), "{failed}");
    let back = failed.buffer.unwrap();
    let failed = c.write_list(back, &remote, [Piece::new(u64::MAX, 0, 2)]).finish().unwrap_err();
    assert!(matches!(failed.error, Error::OutOfBounds { side: "local", offset: u64::MAX, .. }), "{failed}");
    // A remote offset that overflows names the remote side and its range.
    let failed = c.write_list(failed.buffer.unwrap(), &remote, [Piece::new(0, u64::MAX - 1, 4)]).finish().unwrap_err();
    assert!(
        matches!(failed.error, Error::OutOfBounds { side: "remote", offset, len: 4, region_len: 65536 } if offset == u64::MAX - 1),
        "{failed}"
    );
    // A list on a region without the right is refused before posting too.
    let read_only = d.expose(d.alloc(4096).unwrap(), Access::REMOTE_READ, 0).unwrap();
    let ro = s.grant(&read_only).whole();
    let failed = c.write_list(failed.buffer.unwrap(), &ro, [Piece::new(0, 0, 16)]).finish().unwrap_err();
    assert!(matches!(failed.error, Error::AccessDenied { .. }), "{failed}");
    assert!(failed.buffer.is_some());
    // `?` works: the failure converts into the crate's error.
    let as_error = || -> gpu_rdma::Result<()> {
        c.write_list(d.alloc(16).unwrap(), &remote, [Piece::new(0, 0, 32)]).finish()?;
        Ok(())
    };
    assert!(matches!(as_error(), Err(Error::OutOfBounds { .. })));
    // The connection still works.
    c.write_list(d.alloc(16).unwrap(), &remote, [Piece::new(0, 0, 16)]).finish().unwrap();
}

fn an_empty_list_finishes_at_once(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let target = d.expose(d.alloc(64).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let (done, _) = c.write_list(d.alloc(64).unwrap(), &remote, []).finish().unwrap();
    assert_eq!((done.bytes, done.requests, done.posts), (0, 0, 0));
    let (done, _) = c.write_list(d.alloc(64).unwrap(), &remote, [Piece::new(3, 3, 0)]).finish().unwrap();
    assert_eq!(done.bytes, 0);
}

fn dropping_a_list_mid_flight_keeps_the_buffer_until_the_device_is_done(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let len = 8 << 20;
    let target = d.expose(d.alloc(len).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let before = d.stats();
    for round in 0..20u64 {
        let pieces = (0..4096u64).map(|i| Piece::new(i * 2048, (i * 7919 % 4096) * 2048, 2048));
        let transfer = c.write_list(filled(&d, &pattern(len, round)), &remote, pieces);
        if round % 2 == 1 {
            std::thread::yield_now();
        }
        drop(transfer);
    }
    // Everything dropped; the connection drains what was posted.
    let until = Instant::now() + Duration::from_secs(30);
    while c.stats().in_flight > 0 {
        assert!(Instant::now() < until, "posted requests never finished: {:?}", c.stats());
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(c.stats().orphaned, 0);
    // The last list's buffer goes when the thread that recorded its final
    // completion lets go of the list, a moment after the count above.
    while d.stats().regions != before.regions && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(d.stats().regions, before.regions, "every dropped list's buffer was released");
    // And the connection is healthy.
    let data = pattern(4096, 99);
    c.write_list(filled(&d, &data), &remote, [Piece::new(0, 0, 4096)]).finish().unwrap();
    let mut got = vec![0u8; 4096];
    target.read_at(0, &mut got).unwrap();
    assert_eq!(got, data);
}

fn a_peer_that_goes_away_mid_list_fails_the_list_promptly(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let len = 16 << 20;
    let target = d.expose(d.alloc(len).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    // 4 GiB in 4 KiB pieces, over and over the same 16 MiB: far longer
    // than the moment the peer stays.
    let pages = len as u64 / 4096;
    let pieces = (0..1u64 << 20).map(|i| Piece::new((i % pages) * 4096, ((i * 31) % pages) * 4096, 4096));
    let mut transfer = c.write_list(filled(&d, &pattern(len, 15)), &remote, pieces);
    // Part of it through (each poll posts at most a queue's worth), then
    // the peer goes.
    for _ in 0..10 {
        assert!(transfer.poll().unwrap().is_none(), "4 GiB cannot be done yet");
    }
    let left_at = Instant::now();
    drop(s);
    drop(target);
    let outcome = transfer.wait();
    let took = left_at.elapsed();
    eprintln!("the list ended with {outcome:?}, {took:?} after the peer left");
    assert!(
        matches!(outcome, Err(Error::ConnectionLost { .. } | Error::Completion(_))),
        "expected the connection lost, got {outcome:?}"
    );
    assert!(took < Duration::from_secs(1), "the failure took {took:?} after the peer left");
    // Settled: the buffer comes back (the error was already handed out).
    let f = transfer.finish().unwrap_err();
    assert!(matches!(f.error, Error::AlreadyReported), "{}", f.error);
    assert_eq!(f.buffer.expect("settled: the buffer is back").len(), len);
}

fn notifications_are_counted_right_under_eight_concurrent_transfers(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let mut inbox = s.inbox(32).unwrap();
    let page = 4096u64;
    let pages_each = 300u64;
    let target = d.expose(d.alloc((8 * pages_each * page) as usize).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let datas: Vec<Vec<u8>> = (0..8).map(|k| pattern((pages_each * page) as usize, 200 + k)).collect();
    // Transfer k writes its pages, scattered (every 8th page from k), and
    // notifies tag k % 3 with a payload naming k: short (inline) for odd
    // k, 3000 bytes (from a registered buffer) for even k.
    let payload = |k: u64| -> Vec<u8> {
        let n = if k % 2 == 0 { 3000 } else { 8 };
        (0..n).map(|i| (k as u8).wrapping_add(i as u8)).collect()
    };
    std::thread::scope(|scope| {
        for k in 0..8u64 {
            let (c, d, data, remote) = (&c, &d, &datas[k as usize], &remote);
            scope.spawn(move || {
                let pieces = (0..pages_each).map(|i| Piece::new(i * page, (i * 8 + k) * page, page));
                c.write_list_notify(filled(d, data), remote, pieces, (k % 3) as u32, &payload(k)).finish().unwrap();
            });
        }
        // Waited in an order unlike any sending order; each note's
        // transfer has landed whole when the note is taken.
        let mut seen = Vec::new();
        for (tag, n) in [(2u32, 2usize), (0, 3), (1, 3)] {
            let notes = inbox.wait(tag, n).unwrap();
            assert_eq!(notes.len(), n);
            for note in notes {
                assert_eq!(note.tag, tag);
                let k = u64::from(note.payload[0]);
                assert_eq!(&note.payload[..], &payload(k)[..], "tag {tag}");
                assert_eq!(k % 3, u64::from(tag));
                for i in 0..pages_each {
                    let mut got = vec![0u8; page as usize];
                    target.read_at(((i * 8 + k) * page) as usize, &mut got).unwrap();
                    let want = &datas[k as usize][(i * page) as usize..((i + 1) * page) as usize];
                    assert!(got == want, "transfer {k}'s page {i} had not landed when its notification was seen");
                }
                seen.push(k);
            }
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..8).collect::<Vec<_>>());
    });
    assert_eq!(inbox.count(0) + inbox.count(1) + inbox.count(2), 0);
    let st = inbox.stats();
    assert_eq!((st.received, st.malformed, st.queued), (8, 0, 0));
}

fn a_list_that_fails_fails_the_peers_wait_at_once(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let mut inbox = s.inbox(4).unwrap();
    let target = d.expose(d.alloc(4096).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let failed = c.write_list_notify(d.alloc(4096).unwrap(), &remote, [Piece::new(0, 4000, 200)], 7, b"k").finish();
    assert!(matches!(failed.as_ref().map_err(|f| &f.error), Err(Error::OutOfBounds { .. })));
    let started = Instant::now();
    match inbox.wait_timeout(7, 1, Duration::from_secs(20)) {
        Err(Error::PeerTransferFailed { tag: 7, reason }) => assert!(reason.contains("outside"), "{reason}"),
        other => panic!("expected the peer's failure, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(1), "took {:?}", started.elapsed());
    // Taken: the next transfer with that tag is waited for normally, and a
    // notification with no pieces at all works.
    c.write_list_notify(d.alloc(4096).unwrap(), &remote, [Piece::new(0, 0, 4096)], 7, b"ok").finish().unwrap();
    c.write_list_notify(d.alloc(1).unwrap(), &remote, [], 8, b"").finish().unwrap();
    assert_eq!(&inbox.wait(7, 1).unwrap()[0].payload[..], b"ok");
    assert!(inbox.wait(8, 1).unwrap()[0].payload.is_empty());
    // A payload past the limit is the caller's bug: refused, never cut;
    // nothing moves and the peer's wait fails at once.
    let max = gpu_rdma::MAX_NOTIFY_PAYLOAD;
    let long = vec![9u8; max + 1];
    let failed = c.write_list_notify(filled(&d, &[1; 64]), &remote, [Piece::new(0, 0, 64)], 9, &long).finish();
    let failed = failed.unwrap_err();
    assert!(
        matches!(failed.error, Error::NotifyPayloadTooLarge { len, max: m } if len == max as u64 + 1 && m == max as u64),
        "{failed}"
    );
    assert!(failed.buffer.is_some(), "nothing was posted: the buffer is back");
    let mut got = [0u8; 64];
    target.read_at(0, &mut got).unwrap();
    assert_ne!(got, [1; 64], "a refused list moved nothing");
    assert!(matches!(inbox.wait_timeout(9, 1, Duration::from_secs(20)), Err(Error::PeerTransferFailed { tag: 9, .. })));
    c.write_list_notify(d.alloc(1).unwrap(), &remote, [], 10, &long[..max]).finish().unwrap();
    assert_eq!(inbox.wait(10, 1).unwrap()[0].payload.len(), max, "the largest payload, whole");
}

fn a_peer_that_goes_away_fails_the_inbox_wait_promptly(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let mut inbox = s.inbox(4).unwrap();
    let target = d.expose(d.alloc(4096).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    c.write_list_notify(d.alloc(4096).unwrap(), &remote, [Piece::new(0, 0, 4096)], 1, b"").finish().unwrap();
    let left_at = std::thread::scope(|scope| {
        let h = scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            let at = Instant::now();
            drop(c);
            at
        });
        // One arrived; the second never will.
        let outcome = inbox.wait_timeout(1, 2, Duration::from_secs(30));
        let ended = Instant::now();
        let at = h.join().unwrap();
        assert!(matches!(outcome, Err(Error::ConnectionLost { .. })), "{outcome:?}");
        ended.saturating_duration_since(at)
    });
    assert!(left_at < Duration::from_secs(1), "the wait failed {left_at:?} after the peer left");
    // What arrived before the loss is still there.
    assert_eq!(inbox.try_take(1, 1).unwrap().unwrap().len(), 1);
}

/// Notifications take no receive: the connection's own receives, posted
/// beside an inbox, get exactly the peer's messages, in order, while
/// notified lists interleave with them; the inbox gets exactly the notes.
fn messages_and_notifications_share_one_connection(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let mut inbox = s.inbox(1).unwrap();
    let target = d.expose(d.alloc(64 * 64).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    const ROUNDS: u8 = 40;
    let mut recvs: Vec<_> = (0..ROUNDS).map(|_| s.recv(d.alloc(16).unwrap())).collect();
    for i in 0..ROUNDS {
        let off = u64::from(i) * 64;
        let list = c.write_list_notify(filled(&d, &[i; 64]), &remote, [Piece::new(0, off, 64)], 9, &[i]);
        let mut msg = c.send(filled(&d, &[i; 16]));
        list.finish().unwrap();
        msg.wait().unwrap();
    }
    for (i, r) in recvs.iter_mut().enumerate() {
        let c = r.wait().unwrap();
        assert_eq!(c.byte_len, 16, "receive {i} took a message, not a notification");
    }
    for (i, r) in recvs.into_iter().enumerate() {
        let buf = r.into_buffer().unwrap();
        assert!(buf.iter().all(|&b| b == i as u8), "receive {i} got message {}", buf[0]);
    }
    let notes = inbox.wait(9, usize::from(ROUNDS)).unwrap();
    for (i, n) in notes.iter().enumerate() {
        assert_eq!(&n.payload[..], &[i as u8], "notes in order");
    }
    assert_eq!(inbox.stats().malformed, 0);
}

/// Notifications that arrive before the peer made its inbox wait for it in
/// the ring: the sender's lists complete without the receiver doing
/// anything (no choreography: every rank may finish its own lists before
/// it looks at its inboxes), and an inbox made later finds them all.
fn notifications_sent_before_the_inbox_exists_wait_for_it(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let target = d.expose(d.alloc(4096).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    for i in 0..32u32 {
        let list = c.write_list_notify(
            filled(&d, &[i as u8; 128]),
            &remote,
            [Piece::new(0, u64::from(i) * 128, 128)],
            i % 4,
            b"early",
        );
        let t0 = Instant::now();
        list.finish().unwrap();
        assert!(t0.elapsed() < Duration::from_secs(5), "list {i} waited on the peer");
    }
    let mut inbox = s.inbox(1).unwrap();
    for tag in 0..4 {
        assert_eq!(inbox.wait_timeout(tag, 8, Duration::from_secs(5)).unwrap().len(), 8);
    }
    let mut got = vec![0u8; 4096];
    target.read_at(0, &mut got).unwrap();
    assert!(got.chunks(128).enumerate().all(|(i, c)| c.iter().all(|&b| b == i as u8)));
}

/// A connected pair for notifications: the server side exposes 4 KiB for
/// writes, which the client sees as `remote`; the server's inbox.
struct Noted {
    d: gpu_rdma::Domain,
    s: gpu_rdma::Connection,
    c: gpu_rdma::Connection,
    target: gpu_rdma::Exposed<gpu_rdma::HostMemory>,
    remote: gpu_rdma::RemoteSlice,
    inbox: gpu_rdma::Inbox,
}

fn noted(t: Kind) -> Noted {
    let d = domain(t);
    let (s, c) = pair(&d);
    let target = d.expose(d.alloc(4096).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let inbox = s.inbox(1).unwrap();
    Noted { d, s, c, target, remote, inbox }
}

/// An inbox's wait as a future: awaited on a one-thread runtime, it gets
/// notes sent later from another thread while the runtime runs other
/// tasks.
fn an_awaited_inbox_gets_its_notes_without_blocking_its_runtime(t: Kind) {
    let Noted { d, s: _s, c, target, remote, mut inbox } = noted(t);
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let (got, ticks) = rt.block_on(async {
        let (ticks, ticker) = common::ticker();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            for i in 0..4u8 {
                let piece = [Piece::new(0, u64::from(i) * 64, 64)];
                c.write_list_notify(filled(&d, &[i; 64]), &remote, piece, 3, &[i]).finish().unwrap();
            }
            c
        });
        let got = inbox.wait_async(3, 4).await;
        ticker.abort();
        let _c = sender.join().unwrap();
        (got, ticks.load(std::sync::atomic::Ordering::Relaxed))
    });
    let notes = got.unwrap();
    assert_eq!(notes.iter().map(|n| n.payload[0]).collect::<Vec<_>>(), [0, 1, 2, 3]);
    // A blocked runtime ticks at most once (before the block); 50 ms of
    // waiting give tens of ticks, fewer where other tests take the guest's
    // CPUs (one run in four of the verbs suite in soft-RoCE saw under 10).
    println!("{ticks} ticks of the runtime while the inbox was awaited");
    assert!(ticks >= 3, "the runtime ran meanwhile: {ticks} ticks");
    let mut got = vec![0u8; 256];
    target.read_at(0, &mut got).unwrap();
    assert!(got.chunks(64).enumerate().all(|(i, c)| c.iter().all(|&b| b == i as u8)));
}

/// An awaited inbox that waits long for its note is not looked at all the
/// while: over TCP the transport wakes it when the peer's writes land (and
/// its timer at most every 50 ms); over verbs, where nothing sees a write
/// land, the engine's timer has it look every 200 us, then every
/// millisecond once it has waited 10 ms (233-248 looks in 300 ms on rxe0;
/// every 200 us throughout before, 1,316 looks over TCP). Its notes still
/// come.
fn an_idle_awaited_inbox_is_woken_by_its_note_not_by_a_timer(t: Kind) {
    let Noted { d, s: _s, c, target: _target, remote, mut inbox } = noted(t);
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let sender = std::thread::spawn(move || {
        for tag in 0..3u32 {
            // Idle first: the await has nothing to find for 300 ms.
            std::thread::sleep(Duration::from_millis(300));
            c.write_list_notify(filled(&d, &[tag as u8; 64]), &remote, [Piece::new(0, 0, 64)], tag, &[tag as u8])
                .finish()
                .unwrap();
        }
        c
    });
    for tag in 0..3u32 {
        let started = Instant::now();
        let mut looks = 0u32;
        let notes = rt.block_on(async {
            let mut wait = std::pin::pin!(inbox.wait_async(tag, 1));
            std::future::poll_fn(|cx| {
                looks += 1;
                wait.as_mut().poll(cx)
            })
            .await
        });
        let waited = started.elapsed();
        assert_eq!(notes.unwrap()[0].payload.to_vec(), vec![tag as u8], "note {tag}");
        println!("note {tag}: awaited {waited:?}, looked at {looks} times");
        assert!(waited >= Duration::from_millis(200), "note {tag} came before it was sent ({waited:?})");
        // Over TCP, 300 ms: six timer looks at most, and one per write
        // landing; over verbs about 50 in the first 10 ms, then one a
        // millisecond.
        let most = if t == Kind::Tcp { 20 } else { 600 };
        assert!(looks <= most, "note {tag}: looked at {looks} times in {waited:?}");
    }
    drop(sender.join().unwrap());
}

/// A peer that never takes its notes fills its ring and no more: the
/// sender's next notification waits for room, and fails at its operation
/// timeout, naming what it waited for; taking the notes makes room.
fn a_full_ring_holds_the_sender_until_notes_are_taken(t: Kind) {
    let d = domain(t);
    let opts = common::opts().op_timeout(Duration::from_millis(600)).notify_ring(gpu_rdma::MIN_RING);
    let (s, c) = common::pair_on(&d, &d, opts.clone(), opts);
    let target = d.expose(d.alloc(64).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let big = vec![7u8; gpu_rdma::MAX_NOTIFY_PAYLOAD];
    let mut sent = 0;
    let err = loop {
        match c.write_list_notify(d.alloc(64).unwrap(), &remote, [], 1, &big).finish() {
            Ok(_) => sent += 1,
            Err(f) => break f.error,
        }
        assert!(sent <= 16, "the ring never filled");
    };
    assert!(sent >= 3, "a 16 KiB ring holds three of the largest notes: {sent}");
    assert!(matches!(err, Error::Timeout { .. }) && err.to_string().contains("notification ring"), "{err}");
    let mut inbox = s.inbox(1).unwrap();
    // The failed list's own (short) failure note still fit: the peer hears of it.
    match inbox.wait(1, sent) {
        Err(Error::PeerTransferFailed { tag: 1, reason }) => assert!(reason.contains("notification ring"), "{reason}"),
        other => panic!("expected the failure first: {other:?}"),
    }
    assert_eq!(inbox.wait(1, sent).unwrap().len(), sent);
    c.write_list_notify(d.alloc(64).unwrap(), &remote, [], 1, &big).finish().unwrap();
    assert_eq!(inbox.wait(1, 1).unwrap().len(), 1, "room again");
}

fn an_error_in_the_middle_of_a_chain_fails_it_with_that_error(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let target = d.expose(d.alloc(3 * 4096).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target);
    let good = |i: u64| remote.slice(i * 4096..(i + 1) * 4096).unwrap();
    // The middle request names a key the peer never issued.
    let bad = gpu_rdma::RemoteSlice::from_raw_parts(good(1).addr(), 4096, good(1).rkey() ^ 0x5a5a);
    let mut p = c
        .batch()
        .write(filled(&d, &[1; 4096]), &good(0))
        .write(filled(&d, &[2; 4096]), &bad)
        .write(filled(&d, &[3; 4096]), &good(2))
        .post();
    match p.wait() {
        Err(Error::Completion(e)) => assert_eq!(e.status, gpu_rdma::WcStatus::RemoteAccess, "{e}"),
        other => panic!("expected the middle request's remote-access error, got {other:?}"),
    }
    assert_eq!(p.into_buffer().unwrap().len(), 3, "every buffer back");
    let mut got = vec![0u8; 4096];
    target.read_at(4096, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "the refused write changed nothing");
}

fn a_list_nobody_waits_on_is_carried_to_the_end_by_the_engine(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let mut inbox = s.inbox(4).unwrap();
    let len = 16 << 20;
    let data = pattern(len, 51);
    let target = d.expose(d.alloc(len).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    // Far more than the send queue holds, in small pieces: many posts, none
    // of them waited for by this thread until the peer has seen the end.
    let pieces: Vec<Piece> =
        (0..(len / 1024) as u64).map(|i| Piece::new(i * 1024, ((i * 13) % 16384) * 1024, 1024)).collect();
    let list = c.write_list_notify(filled(&d, &data), &remote, pieces.iter().copied(), 9, b"done");
    let notes =
        inbox.wait_timeout(9, 1, Duration::from_secs(60)).expect("the engine carried the list to its notification");
    assert_eq!(&notes[0].payload[..], b"done");
    let mut got = vec![0u8; len];
    target.read_at(0, &mut got).unwrap();
    let want = apply(&pieces, &data, len, true);
    assert_eq!(first_difference(&got, &want), None);
    let (done, _) = list.finish().unwrap();
    assert_eq!(done.bytes, len as u64);
}

/// A peer that closes the moment it saw a notification: the list it saw
/// landed, so the writer's list completes (the acknowledgement goes out
/// before the peer's goodbye), never "flushed". 100 rounds, each a fresh
/// connection, the peer closing from its inbox's wake-up.
fn a_list_the_peer_saw_completes_though_the_peer_closes_at_once(t: Kind) {
    let d = domain(t);
    for round in 0..100u32 {
        let (s, c) = pair(&d);
        let target = d.expose(d.alloc(1 << 16).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
        let remote = s.grant(&target).whole();
        let mut inbox = s.inbox(1).unwrap();
        let peer = std::thread::spawn(move || {
            let got = inbox.wait_timeout(1, 1, Duration::from_secs(30)).map(|n| n.len());
            drop(inbox);
            s.close();
            got
        });
        // A piece of 64 KiB and the note behind it.
        let list =
            c.write_list_notify(filled(&d, &[round as u8; 1 << 16]), &remote, [Piece::new(0, 0, 1 << 16)], 1, b"n");
        let done = list.finish();
        assert_eq!(peer.join().unwrap().unwrap(), 1, "round {round}: the peer saw the note");
        if let Err(f) = done {
            panic!("round {round}: the peer saw every byte of the list, yet it failed: {}", f.error);
        }
        drop(target);
    }
}

/// This thread's CPU time so far.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer for one timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// A thread waiting for a message sleeps while a stream of the peer's
/// writes lands: its message wakes it, the writes do not. Over TCP every
/// landed write woke every sleeping waiter before: this wait cost its
/// thread 7 ms of CPU (0.08 ms since), and a bench's server made 200,000
/// futex calls for 40,000 frames (3,600 since).
fn a_waiting_receive_sleeps_through_a_stream_of_writes(t: Kind) {
    const PIECE: u64 = 16 << 10;
    let d = domain(t);
    let (s, c) = pair(&d);
    let target = d.expose(d.alloc(PIECE as usize).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let mut rx = s.recv(d.alloc(16).unwrap());
    let waiter = std::thread::spawn(move || {
        let cpu = thread_cpu();
        let got = rx.wait().map(|c| c.byte_len);
        (got, thread_cpu() - cpu)
    });
    // Let it fall asleep first.
    std::thread::sleep(Duration::from_millis(50));
    let pieces = (0..4000).map(|_| Piece::new(0, 0, PIECE));
    let moved = c.write_list(filled(&d, &[5; PIECE as usize]), &remote, pieces).finish().unwrap();
    c.send(filled(&d, b"done")).wait().unwrap();
    let (got, cpu) = waiter.join().unwrap();
    assert_eq!(got.unwrap(), 4, "the message ended the wait");
    println!("{} bytes written while a receive waited; its thread used {cpu:?} of CPU", moved.0.bytes);
    if t == Kind::Tcp {
        // Over verbs the device places the writes; nothing wakes anyone.
        assert!(cpu < Duration::from_millis(3), "the waiting thread used {cpu:?} while 4,000 writes landed");
    }
}

/// A waiting inbox sleeps: over TCP until the peer's next write lands
/// (the receiver thread wakes it), over verbs between looks that back off
/// to 200 us. Its notes still come, each wait ending once its note is in.
/// On TCP, 300 ms of an idle wait cost its thread under 10 ms of CPU (it
/// looked every 20 us before: 55 ms of user and 127 ms of system time a
/// second, measured from Python).
fn an_idle_inbox_wait_sleeps_and_wakes_for_its_note(t: Kind) {
    let Noted { d, s: _s, c, target: _target, remote, mut inbox } = noted(t);
    let waiter = std::thread::spawn(move || {
        let mut out = Vec::new();
        for tag in 0..3u32 {
            let cpu = thread_cpu();
            let started = Instant::now();
            let notes = inbox.wait_timeout(tag, 1, Duration::from_secs(30)).map(|n| n[0].payload.to_vec());
            out.push((notes, thread_cpu() - cpu, started.elapsed()));
        }
        out
    });
    for tag in 0..3u32 {
        // Idle first: the waiter is asleep when the note comes.
        std::thread::sleep(Duration::from_millis(300));
        c.write_list_notify(filled(&d, &[tag as u8; 64]), &remote, [Piece::new(0, 0, 64)], tag, &[tag as u8, 7])
            .finish()
            .unwrap();
    }
    for (tag, (notes, cpu, waited)) in waiter.join().unwrap().into_iter().enumerate() {
        assert_eq!(notes.unwrap(), vec![tag as u8, 7], "note {tag}");
        assert!(waited >= Duration::from_millis(250), "note {tag} was waited for ({waited:?})");
        if t == Kind::Tcp {
            assert!(cpu < Duration::from_millis(10), "note {tag}: {cpu:?} of CPU for {waited:?} of waiting");
        }
        println!("note {tag}: waited {waited:?}, {cpu:?} of the waiting thread's CPU");
    }
}

both!(
    a_list_of_ten_thousand_random_pieces_is_written_byte_for_byte,
    a_list_of_ten_thousand_random_pieces_is_read_byte_for_byte,
    pages_of_a_paged_pool_land_where_the_layout_says,
    a_bad_piece_refuses_the_whole_list_moves_nothing_and_returns_the_buffer,
    an_empty_list_finishes_at_once,
    dropping_a_list_mid_flight_keeps_the_buffer_until_the_device_is_done,
    a_peer_that_goes_away_mid_list_fails_the_list_promptly,
    notifications_are_counted_right_under_eight_concurrent_transfers,
    a_list_that_fails_fails_the_peers_wait_at_once,
    a_peer_that_goes_away_fails_the_inbox_wait_promptly,
    messages_and_notifications_share_one_connection,
    notifications_sent_before_the_inbox_exists_wait_for_it,
    a_full_ring_holds_the_sender_until_notes_are_taken,
    an_awaited_inbox_gets_its_notes_without_blocking_its_runtime,
    an_error_in_the_middle_of_a_chain_fails_it_with_that_error,
    a_list_nobody_waits_on_is_carried_to_the_end_by_the_engine,
    a_list_the_peer_saw_completes_though_the_peer_closes_at_once,
    an_idle_inbox_wait_sleeps_and_wakes_for_its_note,
    an_idle_awaited_inbox_is_woken_by_its_note_not_by_a_timer,
    a_waiting_receive_sleeps_through_a_stream_of_writes,
);

/// A peer sending notifications nobody takes cannot grow this side's
/// memory without bound: past `MAX_QUEUED_NOTES` (or `MAX_QUEUED_BYTES`,
/// see `hostile_peers.rs`) they are dropped and counted. (TCP only: 66,000
/// messages.)
#[test]
fn tcp_notifications_nobody_takes_are_bounded() {
    let d = domain(Kind::Tcp);
    let opts = common::opts().notify_ring(1 << 20);
    let (s, c) = common::pair_on(&d, &d, opts.clone(), opts);
    let mut inbox = s.inbox(64).unwrap();
    let total = gpu_rdma::MAX_QUEUED_NOTES as u32 + 500;
    let target = d.expose(d.alloc(64).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let sender = std::thread::spawn(move || {
        // An empty list: just its notification, each with its own tag.
        let mut window = std::collections::VecDeque::new();
        let mut spare: Vec<_> = (0..32).map(|_| d.alloc(64).unwrap()).collect();
        for tag in 0..total {
            let buf = spare.pop().unwrap_or_else(|| {
                let t: gpu_rdma::Transfer<_> = window.pop_front().unwrap();
                t.finish().unwrap().1
            });
            window.push_back(c.write_list_notify(buf, &remote, [], tag, b""));
        }
        for t in window {
            t.finish().unwrap();
        }
        c
    });
    let until = Instant::now() + Duration::from_secs(120);
    loop {
        inbox.poll().unwrap();
        let st = inbox.stats();
        if st.received + st.overflowed == u64::from(total) {
            break;
        }
        assert!(Instant::now() < until, "{st:?}");
    }
    let _c = sender.join().unwrap();
    let st = inbox.stats();
    assert_eq!((st.queued, st.overflowed), (gpu_rdma::MAX_QUEUED_NOTES, 500), "{st:?}");
    // Taking some makes room again; what was kept is intact.
    assert_eq!(inbox.try_take(7, 1).unwrap().unwrap()[0].tag, 7);
    assert_eq!(inbox.stats().queued, gpu_rdma::MAX_QUEUED_NOTES - 1);
}
