//! Host memory a framework keeps owning: declared arenas registered once
//! and served to every registration inside them, and foreign memory kept
//! alive by its guard. Each test runs on TCP here and on the verbs device
//! in the VM (`cargo xtask test`), where a miss is a real `ibv_reg_mr`.

#[macro_use]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use gpu_rdma::{Access, Domain, Error, ForeignHost, HostMemory, Memory, RegistrationCacheStats};

use common::{Kind, domain, first_difference, pair, pattern};

/// An arena as large as the issue asks on TCP (1 GiB, mapped lazily, never
/// pinned), and 256 MiB on the VM's device, where registering pins every
/// page of a 3 GiB guest.
fn arena_len(t: Kind) -> usize {
    match t {
        Kind::Tcp => 1 << 30,
        Kind::Verbs => 256 << 20,
    }
}

fn stats(d: &Domain) -> RegistrationCacheStats {
    d.registration_cache_stats()
}

fn ten_thousand_sub_ranges_of_an_arena_share_its_one_registration_and_move_verified(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let len = arena_len(t);
    let before = stats(&d);
    let arena = d.declare_host_arena(HostMemory::new(len).unwrap()).unwrap();
    assert_eq!((stats(&d).arenas, stats(&d).arena_bytes), (1, len));
    let n = 10_000;
    let stride = len / n;
    let piece = 4096.min(stride);
    let regions: Vec<_> = (0..n)
        .map(|i| d.register(arena.view(i * stride, piece).unwrap(), Access::LOCAL).expect("served from the arena"))
        .collect();
    let after = stats(&d);
    assert_eq!(after.hits - before.hits, n as u64, "every sub-range was served: {after:?}");
    assert_eq!(after.misses, before.misses, "none registered anew: {after:?}");
    // All share the arena's one local key: one registration underneath.
    assert!(regions.iter().all(|r| r.lkey() == regions[0].lkey()));
    // Data moves out of them, byte for byte: 100 of them, spread over the arena.
    let target = d.expose(d.alloc(100 * piece).unwrap(), Access::REMOTE_WRITE | Access::REMOTE_READ, 0).unwrap();
    let remote = s.grant(&target);
    let picks: Vec<usize> = (0..100).map(|k| k * (n / 100) + k % 7).collect();
    for &i in &picks {
        arena.write_at(i * stride, &pattern(piece, i as u64)).unwrap();
    }
    let mut regions: Vec<Option<_>> = regions.into_iter().map(Some).collect();
    let ops: Vec<_> = picks
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            let r = regions[i].take().unwrap();
            c.write(r, &remote.slice((k * piece) as u64..((k + 1) * piece) as u64).unwrap())
        })
        .collect();
    for op in ops {
        op.finish().unwrap();
    }
    for (k, &i) in picks.iter().enumerate() {
        let mut got = vec![0u8; piece];
        target.read_at(k * piece, &mut got).unwrap();
        assert_eq!(first_difference(&got, &pattern(piece, i as u64)), None, "sub-range {i}");
    }
    // And into one: a read lands in the arena's bytes.
    target.write_at(0, &pattern(piece, 99_999)).unwrap();
    let view = d.register(arena.view(stride * 3 + 1, piece).unwrap(), Access::LOCAL).unwrap();
    c.read(view, &remote.slice(0..piece as u64).unwrap()).finish().unwrap();
    let mut got = vec![0u8; piece];
    arena.read_at(stride * 3 + 1, &mut got).unwrap();
    assert_eq!(first_difference(&got, &pattern(piece, 99_999)), None);
}

fn memory_the_caller_points_into_an_arena_is_served_and_remote_rights_miss(t: Kind) {
    let d = domain(t);
    let arena = d.declare_host_arena(HostMemory::new(1 << 20).unwrap()).unwrap();
    let base = arena.addr() as *mut u8;
    let before = stats(&d);
    // A framework's own pointer into its pool (not a view).
    let keep = arena.view(0, 1).unwrap();
    // SAFETY: the range lies inside the arena, whose memory outlives the
    // foreign value: `keep`, a view of it, goes with it.
    let foreign = unsafe { ForeignHost::from_raw(base.add(4096), 8192, Box::new(keep)) }.unwrap();
    let r = d.register(foreign, Access::LOCAL).unwrap();
    assert_eq!(stats(&d).hits - before.hits, 1);
    // Memory in no arena is registered as it is: no cache could serve it.
    let plain = d.register(HostMemory::new(4096).unwrap(), Access::LOCAL).unwrap();
    assert_eq!((stats(&d).hits - before.hits, stats(&d).misses - before.misses), (1, 0));
    // Remote rights are never served from an arena (least privilege): a miss.
    let remote = d.register(arena.view(0, 4096).unwrap(), Access::LOCAL | Access::REMOTE_READ).unwrap();
    assert_eq!((stats(&d).hits - before.hits, stats(&d).misses - before.misses), (1, 1));
    if t == Kind::Verbs {
        assert_ne!(remote.lkey(), r.lkey(), "its own registration");
    }
    drop((r, plain, remote));
}

fn the_cache_turned_off_registers_anew_and_a_withdrawn_arena_serves_nothing(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let arena = d.declare_host_arena(HostMemory::new(1 << 20).unwrap()).unwrap();
    let before = stats(&d);
    d.set_registration_cache(0);
    let off = d.register(arena.view(0, 4096).unwrap(), Access::LOCAL).unwrap();
    assert_eq!((stats(&d).hits, stats(&d).misses - before.misses), (before.hits, 1));
    d.set_registration_cache(1 << 30);
    let on = d.register(arena.view(4096, 4096).unwrap(), Access::LOCAL).unwrap();
    assert_eq!(stats(&d).hits - before.hits, 1);
    // Withdrawn: later registrations inside it register anew, and what was
    // served keeps the arena's memory and registration alive and working.
    let late = arena.view(8192, 4096).unwrap();
    arena.write_at(4096, &pattern(4096, 5)).unwrap();
    drop(arena);
    assert_eq!(stats(&d).arenas, 0);
    let late = d.register(late, Access::LOCAL).unwrap();
    assert_eq!((stats(&d).hits - before.hits, stats(&d).misses - before.misses), (1, 1), "no arena holds it now");
    let target = d.expose(d.alloc(4096).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    let (_, on) = c.write(on, &remote).finish().unwrap();
    let mut got = vec![0u8; 4096];
    target.read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &pattern(4096, 5)), None, "the withdrawn arena's region still moved its bytes");
    drop((off, on, late));
}

fn overlapping_arenas_and_empty_or_bad_ranges_are_refused_with_the_memory_back(t: Kind) {
    let d = domain(t);
    let arena = d.declare_host_arena(HostMemory::new(1 << 20).unwrap()).unwrap();
    let inside = arena.view(4096, 4096).unwrap();
    let err = d.declare_host_arena(inside).unwrap_err();
    assert!(matches!(err.error, Error::InvalidArgument(ref m) if m.contains("overlaps")), "{}", err.error);
    assert_eq!(err.buffer.len(), 4096, "the memory came back");
    assert!(matches!(arena.view(1 << 20, 1), Err(Error::OutOfBounds { .. })));
    assert!(matches!(arena.view(usize::MAX, 2), Err(Error::OutOfBounds { .. })));
    assert!(matches!(arena.view(0, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(arena.write_at((1 << 20) - 1, &[1, 2]), Err(Error::OutOfBounds { .. })));
    assert!(matches!(ForeignHost::from_vec(Vec::new()), Err(Error::InvalidArgument(_))));
    // SAFETY: refused before anything is read.
    let null = unsafe { ForeignHost::from_raw(std::ptr::null_mut(), 8, Box::new(())) };
    assert!(matches!(null, Err(Error::InvalidArgument(_))));
}

/// Drops flag `true` when the owner goes.
struct Owner(Vec<u8>, Arc<AtomicBool>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.1.store(true, Ordering::SeqCst);
    }
}

fn foreign_memory_moves_and_its_owner_lives_until_the_region_is_gone(t: Kind) {
    let d = domain(t);
    let (s, c) = pair(&d);
    let gone = Arc::new(AtomicBool::new(false));
    let mut owner = Owner(pattern(64 << 10, 3), Arc::clone(&gone));
    let ptr = owner.0.as_mut_ptr();
    // SAFETY: the vector's buffer, owned by `owner`, which the value keeps.
    let foreign = unsafe { ForeignHost::from_raw(ptr, 64 << 10, Box::new(owner)) }.unwrap();
    let region = d.register(foreign, Access::LOCAL).unwrap();
    let target = d.expose(d.alloc(64 << 10).unwrap(), Access::REMOTE_WRITE, 0).unwrap();
    let remote = s.grant(&target).whole();
    // Dropped in flight: the connection keeps it until the device is done,
    // and lets it go once that completion is taken, here by the wait on the
    // next operation (completions come in order).
    drop(c.write(region, &remote));
    c.write(common::filled(&d, b"next"), &remote.prefix(4).unwrap()).finish().unwrap();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !gone.load(Ordering::SeqCst) {
        assert!(std::time::Instant::now() < until, "the owner was never let go");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let mut got = vec![0u8; 64 << 10];
    target.read_at(0, &mut got).unwrap();
    assert_eq!(&got[..4], b"next");
    assert_eq!(
        first_difference(&got[4..], &pattern(64 << 10, 3)[4..]),
        None,
        "the owner went only after its bytes landed"
    );
    // A Vec handed over: received into, then read back.
    let rx = d.register(ForeignHost::from_vec(vec![0; 4096]).unwrap(), Access::LOCAL).unwrap();
    let recv = s.recv(rx);
    c.send(common::filled(&d, &pattern(4096, 8))).finish().unwrap();
    let (_, rx) = recv.finish().unwrap();
    let mut got = vec![0u8; 4096];
    rx.memory().read_at(0, &mut got).unwrap();
    assert_eq!(first_difference(&got, &pattern(4096, 8)), None);
}

both!(
    ten_thousand_sub_ranges_of_an_arena_share_its_one_registration_and_move_verified,
    memory_the_caller_points_into_an_arena_is_served_and_remote_rights_miss,
    the_cache_turned_off_registers_anew_and_a_withdrawn_arena_serves_nothing,
    overlapping_arenas_and_empty_or_bad_ranges_are_refused_with_the_memory_back,
    foreign_memory_moves_and_its_owner_lives_until_the_region_is_gone,
);
