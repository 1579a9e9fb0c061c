//! The rules over random interleavings of two cores, with random cuts and
//! closes (proptest).

use proptest::prelude::*;

use super::*;

// ---- random interleavings ----

/// What a run may do at each step.
#[derive(Clone, Debug)]
enum Act {
    /// One actor's step (see [`Pair::step`]).
    RxStep(u8),
    /// A posts a write of `len` bytes at `at` of b's writable region
    /// (`bad`: with a key b never granted).
    Write { len: usize, at: usize, bad: bool },
    /// A posts a send of `len` bytes; b posts a receive of `room` bytes.
    Send { len: usize, room: usize },
    /// A reads `len` bytes at `at` of b's read-only region.
    Read { len: usize, at: usize },
    /// The stream fails under both.
    Cut,
    /// A closes.
    Close,
    /// B closes.
    CloseB,
}

fn act() -> impl Strategy<Value = Act> {
    prop_oneof![
        10 => any::<u8>().prop_map(Act::RxStep),
        2 => (1usize..3 << 19, 0usize..1 << 20, prop::bool::weighted(0.1)).prop_map(|(len, at, bad)| Act::Write { len, at, bad }),
        2 => (0usize..5000, 0usize..6000).prop_map(|(len, room)| Act::Send { len, room }),
        1 => (1usize..70_000, 0usize..1 << 16).prop_map(|(len, at)| Act::Read { len, at }),
        1 => Just(Act::Cut),
        1 => Just(Act::Close),
        1 => Just(Act::CloseB),
    ]
}

/// One operation of a's, to judge its outcome by.
struct Op {
    id: OpId,
    kind: OpKind,
    /// Its outcome, once taken: whether it succeeded.
    ended: Option<bool>,
}

enum OpKind {
    Write { bad: bool },
    Send { data: Vec<u8> },
    Read { at: usize, dst: Box<[u8]> },
}

/// A run's bookkeeping, and the invariants checked after every step.
struct Trial {
    p: Pair,
    ops: Vec<Op>,
    recvs: VecDeque<(OpId, Box<[u8]>)>,
    /// What b's receives took, in order (length, bytes).
    taken: Vec<Vec<u8>>,
    /// b's writable region when b broke.
    frozen: Option<Vec<u8>>,
}

impl Trial {
    fn check(&mut self, region: &[u8], readable: &[u8]) -> std::result::Result<(), TestCaseError> {
        let p = &mut self.p;
        for op in &mut self.ops {
            if op.ended.is_some() {
                continue;
            }
            let Some(o) = outcome(&mut p.a, op.id) else { continue };
            if o.is_ok() {
                // Done only once the peer read the whole message.
                let end = p.a.ends.get(&op.id.wr_id(true)).copied();
                prop_assert!(end.is_some_and(|e| p.b.consumed >= e), "completed before the peer read it all");
                match &op.kind {
                    OpKind::Write { bad } => prop_assert!(!bad, "a write with a key never granted completed"),
                    OpKind::Send { .. } => {}
                    OpKind::Read { at, dst } => {
                        prop_assert!(
                            dst[..] == readable[*at..*at + dst.len()],
                            "a read completed before its data arrived"
                        )
                    }
                }
            }
            op.ended = Some(o.is_ok());
        }
        while let Some((id, _)) = self.recvs.front() {
            let Some(o) = outcome(&mut p.b, *id) else { break };
            let (_, buf) = self.recvs.pop_front().expect("looked at");
            if let Ok(c) = o {
                self.taken.push(buf[..c.byte_len as usize].to_vec());
            }
        }
        for s in [&p.a, &p.b] {
            prop_assert!(s.core.queue.len() <= DEPTH as usize, "the send queue past its depth");
            prop_assert!(s.core.control.len() <= s.core.peer_depth + 2, "replies owed past the peer's depth");
            prop_assert!(s.core.recvs.len() <= DEPTH as usize);
        }
        // A payload already being read when b broke may still land; no
        // more after it.
        if p.b.is_broken() && !matches!(p.b.pending, Some(RxStep::Fill { .. })) {
            match &self.frozen {
                None => self.frozen = Some(region.to_vec()),
                Some(f) => prop_assert!(f[..] == region[..], "b's memory changed after it broke"),
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Whatever the order of the steps, cuts and closes: no operation
    /// completes before the peer read all its bytes (a read, before its
    /// data arrived); once b broke, nothing more lands in its memory (but
    /// the one payload its reader was already reading); what
    /// each side holds stays within its bounds; every operation ends; and
    /// the sends that completed landed in b's receives, in order, whole.
    #[test]
    fn random_interleavings_keep_the_rules(acts in prop::collection::vec(act(), 1..120)) {
        const REGION: usize = 2 << 20;
        let mut region = vec![0u8; REGION].into_boxed_slice();
        let mut readable = pattern(1 << 17, 200).into_boxed_slice();
        let mut run = Trial { p: Pair::new(), ops: Vec::new(), recvs: VecDeque::new(), taken: Vec::new(), frozen: None };
        let base = region.as_ptr() as u64;
        let rbase = readable.as_ptr() as u64;
        let served = run.p.b.expose(&mut region, Access::REMOTE_WRITE);
        let served_r = run.p.b.expose(&mut readable, Access::REMOTE_READ);
        let (key, rkey) = (served.key(), served_r.key());
        let mut sources: Vec<Vec<u8>> = Vec::new();
        let mut seed = 0u8;
        for a in acts {
            let p = &mut run.p;
            match a {
                Act::RxStep(who) => { p.step(who); }
                Act::Write { len, at, bad } => {
                    let at = at.min(REGION - len);
                    seed = seed.wrapping_add(1);
                    let data = pattern(len, seed);
                    let k = if bad { key ^ 0x5a5a } else { key };
                    let kind = OutKind::Write { raddr: base + at as u64, key: k, imm: None };
                    if let Some(id) = p.a.post(Opcode::Write, vec![(kind, data.as_ptr() as u64, len as u64)]) {
                        run.ops.push(Op { id, kind: OpKind::Write { bad }, ended: None });
                        sources.push(data);
                    }
                }
                Act::Send { len, room } => {
                    seed = seed.wrapping_add(1);
                    let data = pattern(len, seed);
                    let mut buf = vec![0u8; room].into_boxed_slice();
                    if let Some(id) = p.b.post_recv(&mut buf) {
                        run.recvs.push_back((id, buf));
                    }
                    if let Some(id) = p.a.post(Opcode::Send, vec![(OutKind::Send { imm: None }, data.as_ptr() as u64, len as u64)]) {
                        run.ops.push(Op { id, kind: OpKind::Send { data: data.clone() }, ended: None });
                        sources.push(data);
                    }
                }
                Act::Read { len, at } => {
                    let at = at.min(readable.len() - len);
                    let mut dst = vec![0u8; len].into_boxed_slice();
                    let kind = OutKind::ReadReq { raddr: rbase + at as u64, key: rkey };
                    if let Some(id) = p.a.post(Opcode::Read, vec![(kind, dst.as_mut_ptr() as u64, len as u64)]) {
                        run.ops.push(Op { id, kind: OpKind::Read { at, dst }, ended: None });
                    }
                }
                Act::Cut => { p.a.cut(); p.b.cut(); }
                Act::Close => p.a.close(),
                Act::CloseB => p.b.close(),
            }
            run.check(&region, &readable)?;
        }
        // The end: every actor moves until none can (a message still
        // waiting for a receive gets none), a closes, and whatever is left
        // fails once both sides' threads are gone.
        run.p.b.rnr_expired = true;
        for phase in 0..2 {
            let mut idle = 0;
            let mut who = 0u8;
            while idle < 4 {
                if run.p.step(who) { idle = 0 } else { idle += 1 }
                who = who.wrapping_add(1);
                run.check(&region, &readable)?;
            }
            if phase == 0 {
                run.p.a.close();
            }
        }
        run.p.a.finish_close();
        run.p.b.finish_close();
        run.check(&region, &readable)?;
        for op in &run.ops {
            prop_assert!(op.ended.is_some(), "an operation never ended");
        }
        let sent: Vec<&Vec<u8>> = run.ops.iter().filter_map(|o| match (&o.kind, o.ended) {
            (OpKind::Send { data }, Some(true)) => Some(data),
            _ => None,
        }).collect();
        prop_assert!(run.taken.len() >= sent.len(), "a send completed that no receive took");
        for (data, got) in sent.iter().zip(&run.taken) {
            prop_assert!(got[..] == data[..], "a send landed elsewhere than in its receive, or not whole");
        }
        drop(run);
        drop((served, served_r, sources));
    }
}
