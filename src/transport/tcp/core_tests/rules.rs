//! The rules, case by case: every operation kind, chains, refusals,
//! breaks, and a scripted hostile peer.

use super::*;

// ---- every operation kind, two cores, no sockets ----

#[test]
fn every_operation_kind_lands_and_completes_only_once_acknowledged() {
    let mut p = Pair::new();
    let mut target = vec![0u8; 3 << 20];
    let mut readable = pattern(4096, 9);
    let served = p.b.expose(&mut target, Access::REMOTE_WRITE);
    let served_r = p.b.expose(&mut readable, Access::REMOTE_READ);
    let (wkey, rkey) = (served.key(), served_r.key());
    let taddr = target.as_ptr() as u64;

    // A write of two and a half segments.
    let src = pattern(5 << 19, 1);
    let w =
        p.a.post(
            Opcode::Write,
            vec![(OutKind::Write { raddr: taddr, key: wkey, imm: None }, src.as_ptr() as u64, src.len() as u64)],
        )
        .unwrap();
    // Not done while its frames are on their way, nor once written whole.
    while p.a.send_step() {}
    assert!(outcome(&mut p.a, w).is_none(), "done before the peer read it");
    while p.b.read_step(&mut p.a.out) {}
    assert!(outcome(&mut p.a, w).is_none(), "done before the acknowledgement arrived");
    assert_eq!(&target[..src.len()], &src[..], "the write landed");
    p.settle();
    assert!(outcome(&mut p.a, w).unwrap().is_ok());

    // A send into a receive, a send with immediate, an inline send nobody
    // acknowledges, a write with immediate (its receive, its data).
    let mut r1 = vec![0u8; 64];
    let mut r2 = vec![0u8; 64];
    let mut r3 = vec![0u8; 16];
    let mut r4 = vec![0u8; 1];
    let ids: Vec<OpId> = [&mut r1, &mut r2, &mut r3, &mut r4].into_iter().map(|r| p.b.post_recv(r).unwrap()).collect();
    let m1 = pattern(64, 2);
    let m2 = pattern(40, 3);
    let s1 = p.a.post(Opcode::Send, vec![(OutKind::Send { imm: None }, m1.as_ptr() as u64, 64)]).unwrap();
    let s2 = p.a.post(Opcode::SendWithImm, vec![(OutKind::Send { imm: Some(77) }, m2.as_ptr() as u64, 40)]).unwrap();
    let s3 =
        p.a.post(Opcode::Send, vec![(OutKind::Inline { data: b"inline".to_vec(), imm: None, unacked: true }, 0, 6)])
            .unwrap();
    let wi =
        p.a.post(
            Opcode::WriteWithImm,
            vec![(OutKind::Write { raddr: taddr + 100, key: wkey, imm: Some(5) }, m2.as_ptr() as u64, 40)],
        )
        .unwrap();
    // A read of the readable region.
    let mut dst = vec![0u8; 4096];
    let rd =
        p.a.post(
            Opcode::Read,
            vec![(OutKind::ReadReq { raddr: readable.as_ptr() as u64, key: rkey }, dst.as_mut_ptr() as u64, 4096)],
        )
        .unwrap();
    p.settle();
    for id in [s1, s2, s3, wi, rd] {
        assert!(outcome(&mut p.a, id).unwrap().is_ok());
    }
    let got: Vec<_> = ids.iter().map(|&id| outcome(&mut p.b, id).unwrap().unwrap()).collect();
    assert_eq!((got[0].byte_len, got[0].imm), (64, None));
    assert_eq!((got[1].byte_len, got[1].imm), (40, Some(77)));
    assert_eq!(got[2].byte_len, 6);
    assert_eq!(got[3].imm, Some(5), "the write with immediate's receive");
    assert_eq!((&r1[..], &r2[..40], &r3[..6]), (&m1[..], &m2[..], &b"inline"[..]));
    assert_eq!(&target[100..140], &m2[..]);
    assert_eq!(dst, readable);
    assert!(!p.a.is_broken() && !p.b.is_broken());
    drop((served, served_r));
}

/// Counts its wakes.
struct Wakes(std::sync::atomic::AtomicUsize);

impl std::task::Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn an_awaited_look_at_peer_written_memory_is_woken_by_the_next_write_and_by_a_break() {
    let mut p = Pair::new();
    let mut target = vec![0u8; 4096];
    let served = p.b.expose(&mut target, Access::REMOTE_WRITE);
    let (key, taddr) = (served.key(), target.as_ptr() as u64);
    let wakes = Arc::new(Wakes(Default::default()));
    let waker = std::task::Waker::from(Arc::clone(&wakes));
    let woken = || wakes.0.load(std::sync::atomic::Ordering::Relaxed);
    let seen = p.b.core.landed;
    assert!(!p.b.core.landed_or_register(seen, &waker), "nothing landed: registered");
    assert!(!p.b.core.landed_or_register(seen, &waker), "registering again keeps one registration");
    let src = pattern(64, 1);
    let write = |p: &mut Pair| {
        let w = OutKind::Write { raddr: taddr, key, imm: None };
        p.a.post(Opcode::Write, vec![(w, src.as_ptr() as u64, 64)]).unwrap()
    };
    let w = write(&mut p);
    while p.a.send_step() {}
    assert_eq!(woken(), 0, "nothing read yet");
    p.settle();
    assert!(outcome(&mut p.a, w).unwrap().is_ok());
    assert_eq!(woken(), 1, "the landing woke the look, once");
    assert!(p.b.core.landed_or_register(seen, &waker), "a write landed since `seen`: look again");
    let seen = p.b.core.landed;
    assert!(!p.b.core.landed_or_register(seen, &waker));
    // A break wakes it too (the look then sees the connection lost), and
    // a look after it is never registered.
    p.b.core.break_with("cut".into(), &p.b.env);
    assert_eq!(woken(), 2, "the break woke the look");
    assert!(p.b.core.landed_or_register(seen, &waker), "lost: look again, never wait");
    assert_eq!(woken(), 2);
}

#[test]
fn a_chain_completes_once_as_a_whole_after_its_last_message() {
    let mut p = Pair::new();
    let mut target = vec![0u8; 4096];
    let served = p.b.expose(&mut target, Access::REMOTE_WRITE);
    let t = target.as_ptr() as u64;
    let src = pattern(4096, 4);
    let pieces: Vec<_> = (0..4u64)
        .map(|i| {
            (OutKind::Write { raddr: t + i * 1024, key: served.key(), imm: None }, src.as_ptr() as u64 + i * 1024, 1024)
        })
        .collect();
    let id = p.a.post(Opcode::Write, pieces).unwrap();
    // Only the last message asks for an acknowledgement.
    for _ in 0..3 {
        p.a.send_step();
        p.b.read_step(&mut p.a.out);
        p.b.send_step();
        p.a.read_step(&mut p.b.out);
        assert!(outcome(&mut p.a, id).is_none());
    }
    p.settle();
    assert!(outcome(&mut p.a, id).unwrap().is_ok());
    assert_eq!(target, src);
    drop(served);
}

// ---- refusals and breaks ----

#[test]
fn a_refused_request_fails_its_operation_breaks_both_sides_and_nothing_after_it_lands() {
    for case in ["bad key", "out of bounds", "no right", "too long", "no receive"] {
        let mut p = Pair::new();
        let mut target = vec![0u8; 4096];
        let served =
            p.b.expose(&mut target, if case == "no right" { Access::REMOTE_READ } else { Access::REMOTE_WRITE });
        let t = target.as_ptr() as u64;
        let src = pattern(2048, 5);
        let key = if case == "bad key" { served.key() ^ 0x55 } else { served.key() };
        let mut small = vec![0u8; 16];
        let bad = match case {
            "too long" => {
                p.b.post_recv(&mut small).unwrap();
                p.a.post(Opcode::Send, vec![(OutKind::Send { imm: None }, src.as_ptr() as u64, 2048)]).unwrap()
            }
            "no receive" => {
                p.b.rnr_expired = true;
                p.a.post(Opcode::Send, vec![(OutKind::Send { imm: None }, src.as_ptr() as u64, 2048)]).unwrap()
            }
            _ => {
                let at = if case == "out of bounds" { t + 3000 } else { t };
                p.a.post(Opcode::Write, vec![(OutKind::Write { raddr: at, key, imm: None }, src.as_ptr() as u64, 2048)])
                    .unwrap()
            }
        };
        // A good write right behind it: never carried out.
        let after =
            p.a.post(
                Opcode::Write,
                vec![(OutKind::Write { raddr: t, key: served.key(), imm: None }, src.as_ptr() as u64, 64)],
            )
            .unwrap();
        p.settle();
        assert!(p.a.is_broken() && p.b.is_broken(), "{case}: both sides broke");
        let e = outcome(&mut p.a, bad).unwrap().unwrap_err();
        assert!(!e.is_empty(), "{case}");
        assert!(outcome(&mut p.a, after).unwrap().is_err(), "{case}: the write behind it failed");
        assert!(target.iter().all(|&b| b == 0), "{case}: nothing landed");
        if case == "too long" {
            assert!(small.iter().all(|&b| b == 0), "the receive holds nothing");
        }
        p.a.finish_close();
        p.b.finish_close();
        drop(served);
    }
}

#[test]
fn once_this_side_broke_nothing_the_peer_sent_lands() {
    // b breaks by closing (its reader still runs): the write a's stream
    // already holds is not carried out, nor is anything after it.
    let mut p = Pair::new();
    let mut target = vec![0u8; 4096];
    let served = p.b.expose(&mut target, Access::REMOTE_WRITE);
    let src = pattern(4096, 8);
    let kind = OutKind::Write { raddr: target.as_ptr() as u64, key: served.key(), imm: None };
    let w = p.a.post(Opcode::Write, vec![(kind, src.as_ptr() as u64, 4096)]).unwrap();
    while p.a.send_step() {}
    p.b.close();
    p.settle();
    assert!(target.iter().all(|&b| b == 0), "a frame was carried out after the break");
    p.a.finish_close();
    p.b.finish_close();
    assert!(outcome(&mut p.a, w).unwrap().is_err());
    drop(served);
}

/// A scripted hostile peer's replies, written straight into the stream.
fn hostile(p: &mut Pair, frames: &[FrameHeader]) {
    for h in frames {
        put(&mut p.b.out, h, 0, 0);
    }
    while p.a.read_step(&mut p.b.out) {}
}

#[test]
fn replies_that_lie_break_the_connection_and_complete_nothing() {
    let src = pattern(256, 6);
    let mut target = vec![0u8; 256];
    let ack = |seq: u32, status: u32| ack_header(seq, status);
    for case in ["early", "duplicate", "out of order", "unknown", "read response for a write", "after the break"] {
        let mut p = Pair::new();
        let served = p.b.expose(&mut target, Access::REMOTE_WRITE);
        let w = |p: &mut Pair| {
            p.a.post(
                Opcode::Write,
                vec![(
                    OutKind::Write { raddr: target.as_ptr() as u64, key: served.key(), imm: None },
                    src.as_ptr() as u64,
                    256,
                )],
            )
            .unwrap()
        };
        let first = w(&mut p);
        let second = w(&mut p);
        match case {
            "early" => {
                // The acknowledgement of a message this side has not begun to write.
                hostile(&mut p, &[ack(1, 0)]);
            }
            "duplicate" => {
                while p.a.send_step() {}
                hostile(&mut p, &[ack(1, 0), ack(1, 0)]);
            }
            "out of order" => {
                while p.a.send_step() {}
                hostile(&mut p, &[ack(2, 0)]);
            }
            "unknown" => {
                while p.a.send_step() {}
                hostile(&mut p, &[ack(99, 0)]);
            }
            "read response for a write" => {
                while p.a.send_step() {}
                let h =
                    FrameHeader { op: FrameOp::ReadResp as u8, flags: FIRST | LAST, seq: 1, ..FrameHeader::default() };
                hostile(&mut p, &[h]);
            }
            _ => {
                // A refusal, then an acknowledgement after it: not carried out.
                while p.a.send_step() {}
                hostile(&mut p, &[ack(1, crate::completion::WcStatus::RemoteAccess.to_raw()), ack(2, 0)]);
            }
        }
        assert!(p.a.is_broken(), "{case}: broke");
        p.a.finish_close();
        for id in [first, second] {
            let o = outcome(&mut p.a, id).unwrap();
            if case == "duplicate" && id == first {
                assert!(o.is_ok(), "the first acknowledgement was true");
            } else {
                assert!(o.is_err(), "{case}: completed on a lie");
            }
        }
        drop(served);
    }
}

#[test]
fn frames_past_their_bounds_break_the_connection_and_land_nothing() {
    // A segment longer than a segment may be, unknown flag bits, a write
    // whose segments outgrow its announced total, a read response for no
    // read: each breaks a, and nothing lands in its region.
    let mut target = vec![0u8; 4096];
    let cases: [(&str, Vec<FrameHeader>); 4] = [
        (
            "a segment past its bound",
            vec![FrameHeader {
                op: FrameOp::Send as u8,
                flags: FIRST | LAST,
                len: (SEGMENT + 1) as u32,
                total: (SEGMENT + 1) as u32,
                ..FrameHeader::default()
            }],
        ),
        (
            "unknown flags",
            vec![FrameHeader { op: FrameOp::Send as u8, flags: FIRST | LAST | 0x40, ..FrameHeader::default() }],
        ),
        ("a message longer than announced", vec![]),
        (
            "a response for no read",
            vec![FrameHeader {
                op: FrameOp::ReadResp as u8,
                flags: FIRST | LAST,
                seq: 3,
                len: 8,
                ..FrameHeader::default()
            }],
        ),
    ];
    for (what, frames) in cases {
        target.fill(0);
        let mut p = Pair::new();
        let served = p.a.expose(&mut target, Access::REMOTE_WRITE);
        let mut recv = vec![0u8; 64];
        p.a.post_recv(&mut recv).unwrap();
        if frames.is_empty() {
            // A write announcing 8 bytes whose two segments carry 8 and 8.
            let base = FrameHeader {
                op: FrameOp::Write as u8,
                seq: 1,
                key: served.key(),
                addr: target.as_ptr() as u64,
                len: 8,
                total: 8,
                ..FrameHeader::default()
            };
            put(&mut p.b.out, &FrameHeader { flags: FIRST, ..base }, [1u8; 8].as_ptr() as u64, 8);
            put(&mut p.b.out, &FrameHeader { flags: LAST, addr: base.addr + 8, ..base }, [2u8; 8].as_ptr() as u64, 8);
        }
        for h in &frames {
            put(&mut p.b.out, h, [7u8; 16].as_ptr() as u64, (h.len as usize).min(16));
        }
        while p.a.read_step(&mut p.b.out) {}
        assert!(p.a.is_broken(), "{what}: broke");
        assert!(recv.iter().all(|&b| b == 0), "{what}: nothing landed in the receive");
        if what == "a message longer than announced" {
            assert_eq!(&target[..8], &[1u8; 8], "the announced bytes landed");
        }
        let past = if what == "a message longer than announced" { 8 } else { 0 };
        assert!(target[past..].iter().all(|&b| b == 0), "{what}: nothing past what was announced landed");
        drop(served);
    }
}

#[test]
fn a_peer_that_keeps_more_requests_waiting_than_its_depth_breaks_the_connection() {
    let mut p = Pair::new();
    let mut target = vec![0u8; 64];
    let served = p.a.expose(&mut target, Access::REMOTE_WRITE);
    // b's side writes frames by hand: each asks for an acknowledgement, and
    // b never reads what a sends back.
    for seq in 1..=DEPTH + 1 {
        let h = FrameHeader {
            op: FrameOp::Write as u8,
            flags: FIRST | LAST | ACK,
            seq,
            key: served.key(),
            addr: target.as_ptr() as u64,
            len: 1,
            total: 1,
            ..FrameHeader::default()
        };
        put(&mut p.b.out, &h, [7u8].as_ptr() as u64, 1);
    }
    while p.a.read_step(&mut p.b.out) {}
    assert!(p.a.is_broken());
    assert!(p.a.core.control.len() <= DEPTH as usize + 2, "replies owed stay bounded");
    drop(served);
}
