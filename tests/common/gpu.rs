//! GPU helpers for the tests: memory as a framework's allocator hands it
//! out (a sub-allocation inside a larger block, VMM memory), and the CUDA
//! stand-in's test hooks (absent on a real driver: `None`).

use std::ffi::CStr;

use gpu_rdma::cuda::{CudaBuffer, CudaDevice, CudaStream, sys};

/// A symbol of the CUDA stand-in, when the loaded `libcuda.so` is the stand-in.
pub fn stub_symbol(name: &CStr) -> Option<*mut libc::c_void> {
    // SAFETY: looks up an already loaded library without loading anything.
    let handle = unsafe { libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    // SAFETY: a valid handle and a NUL-terminated name.
    let sym = unsafe { libc::dlsym(handle, name.as_ptr()) };
    // SAFETY: drops the reference dlopen took; the library stays loaded (cudarc holds it).
    unsafe { libc::dlclose(handle) };
    (!sym.is_null()).then_some(sym)
}

/// Whether the CUDA driver in this process is the stand-in (loading the
/// driver first: before that, no library is there to look at).
pub fn is_stub() -> bool {
    gpu_rdma::cuda::driver().expect("a CUDA driver (the stand-in, or a GPU's)");
    stub_symbol(c"gpu_rdma_stub_produce").is_some()
}

/// The 32-bit word a producer writes for `seed` (never zero, varies by seed).
pub fn produced_word(seed: u64) -> u32 {
    ((seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as u32) | 1
}

/// What the producer writes into `len` bytes for `seed`: its word,
/// little-endian, repeated.
pub fn produced(seed: u64, len: usize) -> Vec<u8> {
    let w = produced_word(seed).to_le_bytes();
    (0..len).map(|i| w[i % 4]).collect()
}

/// A buffer of `len` bytes on `device`, holding `data` at its start if
/// given, registered on `d` with `policy` (panics, naming the policy, if
/// that fails).
pub fn gpu_region_on(
    d: &gpu_rdma::Domain,
    device: &CudaDevice,
    len: usize,
    data: Option<&[u8]>,
    policy: gpu_rdma::memory::path::PathPolicy,
) -> gpu_rdma::Region<CudaBuffer> {
    let buf = CudaBuffer::alloc(device, len).unwrap();
    if let Some(data) = data {
        buf.copy_from_host(0, data).unwrap();
    }
    d.register_with_path(buf, gpu_rdma::Access::LOCAL_WRITE, policy)
        .unwrap_or_else(|e| panic!("register with {policy:?}: {}", e.error))
}

/// Queues a producer on `stream` that fills `len` bytes (a multiple of 4)
/// of `buf` at `offset` with the pattern for `seed`, landing late: a write
/// posted without waiting for its fence sends stale bytes. On the stand-in
/// its hook lands after `delay_us`; on a GPU, asynchronous memsets (no
/// compiled kernel needed) behind a large one on the same stream.
pub fn produce(stream: &CudaStream, buf: &CudaBuffer, offset: usize, len: usize, seed: u64, delay_us: u32) {
    assert_eq!(len % 4, 0);
    let dst = buf.device_ptr() + offset as u64;
    let word = produced_word(seed);
    let _ctx = Ctx::enter(buf.device());
    if let Some(sym) = stub_symbol(c"gpu_rdma_stub_produce") {
        type Produce = unsafe extern "C" fn(*mut libc::c_void, u64, usize, u32, u32) -> u32;
        // SAFETY: the stand-in exports this function with this signature.
        let f: Produce = unsafe { std::mem::transmute(sym) };
        // SAFETY: a live stream, and a range inside a live buffer.
        let rc = unsafe { f(stream.as_raw().cast(), dst, len / 4, word, delay_us) };
        assert_eq!(rc, 0, "gpu_rdma_stub_produce");
        return;
    }
    // A real GPU: about 256 MiB of memset per 100 us of delay (HBM runs at
    // TB/s), then the pattern, in stream order.
    static DELAY: std::sync::OnceLock<CudaBuffer> = std::sync::OnceLock::new();
    let delay = DELAY.get_or_init(|| CudaBuffer::alloc(buf.device(), 256 << 20).expect("the delay buffer"));
    for _ in 0..=delay_us / 100 {
        // SAFETY: the delay buffer is live for the process; the stream is live.
        let rc = unsafe { sys::cuMemsetD8Async(delay.device_ptr(), 0x5a, delay.len(), stream.as_raw()) };
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemsetD8Async");
    }
    // SAFETY: a range inside a live buffer, 4-byte aligned (device pointers
    // are 256-byte aligned and offsets here are multiples of 4).
    let rc = unsafe { sys::cuMemsetD32Async(dst, word, len / 4, stream.as_raw()) };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemsetD32Async");
}

/// Sets a device attribute (`cuDeviceGetAttribute` numbering) in the
/// stand-in, for devices opened from now on. Stand-in only.
pub fn set_attribute(attr: u32, value: i32) {
    let sym = stub_symbol(c"gpu_rdma_stub_set_attribute").expect("the CUDA stand-in");
    // SAFETY: the stand-in exports this function with this signature.
    let f: unsafe extern "C" fn(u32, i32) = unsafe { std::mem::transmute(sym) };
    // SAFETY: plain values.
    unsafe { f(attr, value) };
}

/// Every stand-in attribute back to its default.
pub fn reset_attributes() {
    if let Some(sym) = stub_symbol(c"gpu_rdma_stub_reset_attributes") {
        // SAFETY: the stand-in exports this function with this signature.
        let f: unsafe extern "C" fn() = unsafe { std::mem::transmute(sym) };
        // SAFETY: no arguments.
        unsafe { f() };
    }
}

/// The device's primary context, current on this thread while alive.
pub struct Ctx;

impl Ctx {
    pub fn enter(device: &CudaDevice) -> Ctx {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device ordinal; released in Drop.
        let rc = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device.ordinal() as i32) };
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
        // SAFETY: a retained context.
        assert_eq!(unsafe { sys::cuCtxPushCurrent_v2(ctx) }, sys::CUresult::CUDA_SUCCESS);
        Ctx
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops what `enter` pushed on this thread.
        unsafe { sys::cuCtxPopCurrent_v2(&mut ctx) };
    }
}

/// VMM memory, as PyTorch's expandable segments and NCCL's allocator make
/// it: `cuMemCreate` (with or without `gpuDirectRDMACapable`),
/// `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`. Unmapped and
/// released when dropped.
pub struct VmmBlock {
    pub ptr: u64,
    pub len: usize,
    handle: sys::CUmemGenericAllocationHandle,
    device: CudaDevice,
}

// SAFETY: the block is a device allocation, usable from any thread with its context.
unsafe impl Send for VmmBlock {}
// SAFETY: as above; no interior state.
unsafe impl Sync for VmmBlock {}

impl VmmBlock {
    pub fn new(device: &CudaDevice, min_len: usize, gdr: bool) -> VmmBlock {
        let _ctx = Ctx::enter(device);
        // SAFETY: zeroed is a valid CUmemAllocationProp to fill in.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device.ordinal() as i32;
        prop.allocFlags.gpuDirectRDMACapable = u8::from(gdr);
        let mut gran = 0usize;
        // SAFETY: valid pointers.
        let rc = unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemGetAllocationGranularity");
        let len = min_len.div_ceil(gran) * gran;
        let mut handle = 0;
        // SAFETY: valid pointers; released in Drop.
        let rc = unsafe { sys::cuMemCreate(&mut handle, len, &prop, 0) };
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemCreate");
        let mut ptr = 0;
        // SAFETY: valid out-pointer; freed in Drop.
        let rc = unsafe { sys::cuMemAddressReserve(&mut ptr, len, 0, 0, 0) };
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemAddressReserve");
        // SAFETY: a reserved range and a live handle of the same size.
        let rc = unsafe { sys::cuMemMap(ptr, len, 0, handle, 0) };
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemMap");
        // SAFETY: zeroed is a valid CUmemAccessDesc to fill in.
        let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        access.location = prop.location;
        access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: one descriptor over the mapped range.
        let rc = unsafe { sys::cuMemSetAccess(ptr, len, &access, 1) };
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "cuMemSetAccess");
        VmmBlock { ptr, len, handle, device: device.clone() }
    }
}

impl Drop for VmmBlock {
    fn drop(&mut self) {
        let _ctx = Ctx::enter(&self.device);
        // SAFETY: mapped, created and reserved in `new`; undone once, in order.
        unsafe {
            sys::cuMemUnmap(self.ptr, self.len);
            sys::cuMemRelease(self.handle);
            sys::cuMemAddressFree(self.ptr, self.len);
        }
    }
}

/// `rounds` times: `fill` queues producers into a GPU region on the
/// streams it is given (three of one device) and fences it, returning the
/// bytes the region will hold; the region is written to the peer with an
/// immediate, and the peer verifies what landed before the next round
/// (`stale` says what a difference means). The source is registered on
/// `dc` with `policy`; the target is host memory `ds` exposes. Returns the
/// rounds verified. Stand-in only (the producer is its hook).
fn produced_writes(
    ds: &gpu_rdma::Domain,
    dc: &gpu_rdma::Domain,
    policy: gpu_rdma::memory::path::PathPolicy,
    rounds: u64,
    len: usize,
    stale: &str,
    mut fill: impl FnMut(u64, &CudaBuffer, &[CudaStream]) -> Vec<u8>,
) -> u64 {
    use gpu_rdma::Access;
    let target = ds.expose(ds.alloc(len).unwrap(), Access::REMOTE_WRITE, 7).unwrap();
    let (s, c) = super::pair_on(ds, dc, super::opts().advertise(&target), super::opts().staging(len / 4, 4));
    let device = CudaDevice::open(0).unwrap();
    let streams: Vec<CudaStream> = (0..3).map(|_| CudaStream::new(&device).unwrap()).collect();
    let mut src = Some(gpu_region_on(dc, &device, len, None, policy));
    let remote = c.remote_region(7).unwrap().whole();
    let mut got = vec![0u8; len];
    for i in 0..rounds {
        let region = src.take().unwrap();
        let expect = fill(i, region.memory(), &streams);
        let mut note = s.recv_imm();
        let (_, back) =
            c.write_with_imm(region, &remote, i as u32).finish().unwrap_or_else(|e| panic!("round {i}: write: {e}"));
        src = Some(back);
        assert_eq!(note.wait().unwrap().imm, Some(i as u32));
        target.read_at(0, &mut got).unwrap();
        if let Some(at) = super::first_difference(&got, &expect) {
            panic!("round {i}: the peer got stale data at byte {at}: {stale}");
        }
        // Tell the writer the target may be overwritten.
        let mut ok = c.recv_imm();
        s.send_inline(&[], Some(i as u32)).wait().unwrap();
        assert_eq!(ok.wait().unwrap().imm, Some(i as u32));
    }
    rounds
}

/// "A producer kernel writes iteration i into the GPU region, then the
/// region is written to the peer", `iters` times, the peer verifying each
/// iteration before the next starts. Each iteration's producer runs on a
/// stream after a delay, so a write that does not wait for its own fence
/// sends stale or half-written bytes. See [`produced_writes`].
pub fn producer_loop(
    ds: &gpu_rdma::Domain,
    dc: &gpu_rdma::Domain,
    policy: gpu_rdma::memory::path::PathPolicy,
    iters: u64,
    len: usize,
) -> u64 {
    produced_writes(ds, dc, policy, iters, len, "the write did not wait for its producer", |i, buf, streams| {
        let seed = 0x5eed_0000 + i;
        // The "kernel" lands 50-250 us after it is queued, varying.
        produce(&streams[0], buf, 0, len, seed, 50 + (i as u32 * 37) % 200);
        buf.ready_after(&streams[0]).unwrap();
        produced(seed, len)
    })
}

/// Two producers on two streams fill the two halves of one GPU region, the
/// first slower than the second; each fences the region
/// ([`ready_after`](gpu_rdma::cuda::CudaBuffer::ready_after) once per
/// stream); then the region is written to the peer, `rounds` times. A write
/// that waits only for the latest fence sends the first half stale. See
/// [`produced_writes`].
pub fn two_producers(
    ds: &gpu_rdma::Domain,
    dc: &gpu_rdma::Domain,
    policy: gpu_rdma::memory::path::PathPolicy,
    rounds: u64,
    len: usize,
) -> u64 {
    let half = len / 2;
    let stale = "the write waited only for the latest of two fences";
    produced_writes(ds, dc, policy, rounds, len, stale, |i, buf, streams| {
        let (a, b) = (0x7a00_0000 + 2 * i, 0x7a00_0001 + 2 * i);
        produce(&streams[1], buf, 0, half, a, 3000);
        buf.ready_after(&streams[1]).unwrap();
        produce(&streams[2], buf, half, half, b, 10);
        buf.ready_after(&streams[2]).unwrap();
        let mut expect = produced(a, half);
        expect.extend(produced(b, half));
        expect
    })
}

/// A ping-pong awaited: each round writes a GPU buffer (registered on `d`
/// with `policy`: a staged path) into the peer in 64 KiB staged chunks, two
/// at a time, with an immediate on the last (not awaited), and awaits the
/// reply to it in GPU memory. Awaiting the reply must move the write: each
/// chunk after the first two starts only when one before it completes, and
/// that completion must wake the awaiting task (a copy's end, which wakes
/// nobody, is looked at again on a timer). Returns the rounds verified.
pub fn awaited_staged_round_trips(d: &gpu_rdma::Domain, policy: gpu_rdma::memory::path::PathPolicy) -> u32 {
    use gpu_rdma::Access;
    let len = 300 << 10;
    let target = d.expose(d.alloc(len).unwrap(), Access::REMOTE_WRITE, 9).unwrap();
    let (s, c) = super::pair_on(d, d, super::opts().advertise(&target), super::opts().staging(64 << 10, 2));
    let remote = c.remote_region(9).unwrap();
    let limit = std::time::Duration::from_secs(10);
    let rounds = 12u32;
    let msg = |round: u32| super::pattern(len - round as usize * 1000, u64::from(round) + 60);
    let device = CudaDevice::open(0).unwrap();
    let gpu = |len: usize, data: Option<&[u8]>| gpu_region_on(d, &device, len, data, policy);
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    std::thread::scope(|sc| {
        let server = sc.spawn(|| -> gpu_rdma::Result<()> {
            for round in 0..rounds {
                let note = s.recv_imm().wait_timeout(limit)?;
                assert_eq!(note.imm, Some(round));
                let want = msg(round);
                let mut got = vec![0u8; want.len()];
                target.read_at(0, &mut got)?;
                assert_eq!(super::first_difference(&got, &want), None, "round {round}: the write, at the peer");
                s.send_inline(&round.to_le_bytes(), None).wait_timeout(limit)?;
            }
            Ok(())
        });
        rt.block_on(async {
            let mut writes = Vec::new();
            for round in 0..rounds {
                let data = msg(round);
                let mut rx = c.recv(gpu(4096, None));
                let to = remote.slice(0..data.len() as u64).unwrap();
                writes.push(c.write_with_imm(gpu(len, Some(&data)).slice(..data.len()), &to, round));
                let got = tokio::time::timeout(limit, &mut rx)
                    .await
                    .unwrap_or_else(|_| panic!("round {round}: no reply within {limit:?}"))
                    .unwrap_or_else(|e| panic!("round {round}: {e}"));
                assert_eq!(got.byte_len, 4, "round {round}");
                let pong = rx.into_buffer().unwrap_or_else(|_| panic!("round {round}: the receive is done"));
                let mut back = [0u8; 4];
                pong.memory().copy_to_host(0, &mut back).unwrap();
                assert_eq!(back, round.to_le_bytes(), "round {round}: the reply, in GPU memory");
            }
            for w in &mut writes {
                tokio::time::timeout(limit, w).await.expect("a write awaited").unwrap();
            }
        });
        server.join().unwrap().expect("the peer");
    });
    rounds
}

/// Two bursts of `burst` staged 1 MiB writes posted at once, from slices
/// of one GPU buffer registered on `d` with `policy` (a staged path), into
/// a host region of the peer, each burst verified there. Returns the
/// staging slots pinned by each burst and those freed meanwhile: the cache
/// must keep every slot the first burst pinned for the second (pinning is
/// the staged path's most costly step, and a cache that drops what a
/// workload needs pins again on every burst), so the second pins only
/// what it holds at once beyond the first. (The writes take effect in
/// posting order, each starting its copy in its turn, so how many hold a
/// slot at once varies with timing.)
pub fn staged_bursts(
    d: &gpu_rdma::Domain,
    policy: gpu_rdma::memory::path::PathPolicy,
    burst: usize,
) -> (u64, u64, u64) {
    use gpu_rdma::{Access, LocalBuffer};
    let len = 1 << 20;
    let target = d.expose(d.alloc(burst * len).unwrap(), Access::REMOTE_WRITE, 9).unwrap();
    let (s, c) = super::pair_on(d, d, super::opts().advertise(&target), super::opts().queue_depth(burst as u32, 16));
    let remote = c.remote_region(9).unwrap();
    let limit = std::time::Duration::from_secs(60);
    let device = CudaDevice::open(0).unwrap();
    let mut pinned = Vec::new();
    let freed_before = d.staging_stats().slots_freed;
    for round in 0..2u64 {
        let data = super::pattern(burst * len, 70 + round);
        let local = gpu_region_on(d, &device, burst * len, Some(&data), policy).share();
        let before = d.staging_stats().slots_pinned;
        let mut writes: Vec<_> = (0..burst)
            .map(|i| {
                let to = remote.slice((i * len) as u64..((i + 1) * len) as u64).unwrap();
                c.write(local.clone().slice(i * len..(i + 1) * len), &to)
            })
            .collect();
        for (i, w) in writes.iter_mut().enumerate() {
            w.wait_timeout(limit).unwrap_or_else(|e| panic!("round {round}, write {i}: {e}"));
        }
        pinned.push(d.staging_stats().slots_pinned - before);
        let mut got = vec![0u8; burst * len];
        target.read_at(0, &mut got).unwrap();
        assert_eq!(super::first_difference(&got, &data), None, "round {round}: the writes, at the peer");
    }
    drop(s);
    (pinned[0], pinned[1], d.staging_stats().slots_freed - freed_before)
}

/// Slots reserved ahead on `d` ([`gpu_rdma::Domain::reserve_staging`]) are
/// what staged operations use, and they stay: a staged message larger than
/// a chunk, whose slot is freed after it otherwise, keeps its reserved one.
/// Returns the slots pinned while the operations ran (0 when it passes).
pub fn reserved_staging_serves_and_stays(d: &gpu_rdma::Domain, policy: gpu_rdma::memory::path::PathPolicy) -> u64 {
    use gpu_rdma::Access;
    let (big, small, smalls) = (8 << 20, 256 << 10, 4);
    let device = CudaDevice::open(0).unwrap();
    let gpu = |len: usize, data: &[u8]| gpu_region_on(d, &device, len, Some(data), policy);
    let target = d.expose(d.alloc(smalls * small).unwrap(), Access::REMOTE_WRITE, 9).unwrap();
    // Chunks of 1 MiB: the 8 MiB message is larger than a chunk.
    let opts = super::opts().advertise(&target).staging(1 << 20, 4);
    let (s, c) = super::pair_on(d, d, opts.clone(), opts);
    let remote = c.remote_region(9).unwrap();
    let limit = std::time::Duration::from_secs(60);

    let start = d.staging_stats();
    d.reserve_staging(&device, big, 1).unwrap();
    d.reserve_staging(&device, small, smalls).unwrap();
    let reserved = d.staging_stats();
    assert_eq!(reserved.slots_pinned - start.slots_pinned, 1 + smalls as u64, "{reserved:?}");
    assert_eq!(reserved.reserved_bytes - start.reserved_bytes, big + smalls * small, "{reserved:?}");
    assert!(reserved.cached_bytes >= big + smalls * small, "reserved slots wait in the cache: {reserved:?}");

    for round in 0..2u64 {
        // A message-sized slot for the send; the receive is in host memory.
        let msg = super::pattern(big, 80 + round);
        let mut rx = s.recv(d.alloc(big).unwrap());
        c.send(gpu(big, &msg)).wait_timeout(limit).unwrap();
        rx.wait_timeout(limit).unwrap();
        let got = rx.into_buffer().unwrap();
        assert_eq!(super::first_difference(&got.as_slice()[..big], &msg), None, "round {round}: the send");
        // Writes of one chunk each, all in flight at once.
        let data = super::pattern(smalls * small, 90 + round);
        let mut writes: Vec<_> = (0..smalls)
            .map(|i| {
                let to = remote.slice((i * small) as u64..((i + 1) * small) as u64).unwrap();
                c.write(gpu(small, &data[i * small..(i + 1) * small]), &to)
            })
            .collect();
        for w in &mut writes {
            w.wait_timeout(limit).unwrap();
        }
        let mut got = vec![0u8; smalls * small];
        target.read_at(0, &mut got).unwrap();
        assert_eq!(super::first_difference(&got, &data), None, "round {round}: the writes");
    }
    let end = d.staging_stats();
    assert_eq!(end.reserved_bytes, reserved.reserved_bytes, "reserved slots stay reserved: {end:?}");
    assert_eq!(end.slots_freed, reserved.slots_freed, "no reserved slot was freed: {end:?}");
    assert!(end.cached_bytes >= big + smalls * small, "reserved slots are back in the cache: {end:?}");
    // Trimming frees what the cache kept besides them, never them.
    d.trim_staging();
    let trimmed = d.staging_stats();
    assert_eq!(trimmed.reserved_bytes, end.reserved_bytes, "{trimmed:?}");
    assert_eq!(trimmed.cached_bytes, trimmed.reserved_bytes, "only reserved slots stay cached: {trimmed:?}");
    drop((s, c));
    end.slots_pinned - reserved.slots_pinned
}

/// How many CUDA events were made with device `dev`'s context current.
/// Stand-in only (`None` on a real driver).
pub fn events_created(dev: u32) -> Option<u64> {
    let sym = stub_symbol(c"gpu_rdma_stub_events_created")?;
    // SAFETY: the stand-in exports this function with this signature.
    let f: unsafe extern "C" fn(u32) -> u64 = unsafe { std::mem::transmute(sym) };
    // SAFETY: no pointers; any device number is answered.
    Some(unsafe { f(dev) })
}

/// The access flags of the last device-memory registration through the
/// stand-in's nvidia-peermem role, and how many there were. Stand-in only.
pub fn last_device_registration() -> (u32, u64) {
    let sym = stub_symbol(c"gpu_rdma_stub_last_device_registration").expect("the CUDA stand-in");
    // SAFETY: the stand-in exports this function with this signature.
    let f: unsafe extern "C" fn(*mut u64) -> u32 = unsafe { std::mem::transmute(sym) };
    let mut count = 0;
    // SAFETY: a valid out-pointer.
    let access = unsafe { f(&mut count) };
    (access, count)
}

/// What a message of [`ordered_mix`] is.
#[derive(Clone, Copy, Debug)]
enum Message {
    Inline,
    HostSend,
    GpuSend,
    WriteImm,
}

/// A randomized mix of operations on one connection, `rounds` rounds of
/// it: each round posts a few writes of fresh bytes into slots of the
/// peer's host memory (from host memory, from GPU memory on either of two
/// GPUs, registered with `policy`, and as transfer lists of both), then one
/// message (an inline send, a host send, a GPU send, a write with
/// immediate) carrying the round's number. A verifier at the peer, on
/// seeing message `k`, checks at once that every byte written before it is
/// there. Nobody waits on the sender's operations until the round's
/// message was seen: what moves them is the connection. Returns the rounds
/// verified and how many operations of each kind ran.
pub fn ordered_mix(
    ds: &gpu_rdma::Domain,
    dc: &gpu_rdma::Domain,
    policy: gpu_rdma::memory::path::PathPolicy,
    rounds: u32,
    seed: u64,
) -> (u32, [u32; 8]) {
    use gpu_rdma::{Access, Piece};
    use std::sync::mpsc;
    const SLOT: usize = 1 << 20;
    const SLOTS: usize = 12;
    let target = ds.expose(ds.alloc(SLOT * SLOTS).unwrap(), Access::REMOTE_WRITE, 7).unwrap();
    let (s, c) = super::pair_on(ds, dc, super::opts().advertise(&target), super::opts().staging(256 << 10, 4));
    let remote = c.remote_region(7).unwrap();
    let devices: Vec<CudaDevice> =
        (0..CudaDevice::count().unwrap().min(2)).map(|i| CudaDevice::open(i).unwrap()).collect();
    let mut gpu_src: Vec<_> = devices.iter().map(|dev| Some(gpu_region_on(dc, dev, SLOT, None, policy))).collect();
    let gpu_msg = gpu_region_on(dc, &devices[0], 64, None, policy);
    let mut gpu_msg = Some(gpu_msg);
    let mut rng = super::Rng(seed);
    let (to_verifier, expected) = mpsc::channel::<(u32, Vec<(usize, Vec<u8>)>)>();
    let (to_sender, verified) = mpsc::channel::<std::result::Result<u32, String>>();
    let target_v = target.clone();
    let dv = ds.clone();
    let verifier = std::thread::spawn(move || {
        let mut got = vec![0u8; SLOT];
        for _ in 0..rounds {
            let mut rx = s.recv(dv.alloc(16).unwrap());
            let (k, writes) = expected.recv().unwrap();
            let c = rx.wait_timeout(std::time::Duration::from_secs(60)).unwrap_or_else(|e| panic!("round {k}: {e}"));
            let buf = rx.into_buffer().unwrap();
            let said = c.imm.unwrap_or_else(|| u32::from_le_bytes(buf.as_slice()[..4].try_into().unwrap()));
            let mut bad = None;
            for (off, bytes) in &writes {
                target_v.read_at(*off, &mut got[..bytes.len()]).unwrap();
                if let Some(at) = super::first_difference(&got[..bytes.len()], bytes) {
                    bad = Some(format!("round {k}: message {said} seen with byte {at} of the write at {off} stale"));
                    break;
                }
            }
            let verdict = match bad {
                Some(why) => Err(why),
                None if said != k => Err(format!("round {k}: message {said} arrived")),
                None => Ok(k),
            };
            let stop = verdict.is_err();
            to_sender.send(verdict).unwrap();
            if stop {
                return s;
            }
        }
        s
    });
    let mut kinds = [0u32; 8];
    for k in 0..rounds {
        let mut writes = Vec::new();
        let mut held_host = Vec::new();
        let mut held_gpu: Vec<gpu_rdma::Pending<gpu_rdma::Region<CudaBuffer>>> = Vec::new();
        let mut held_lists_host = Vec::new();
        let mut held_lists_gpu = Vec::new();
        let mut slots: Vec<usize> = (0..SLOTS).collect();
        let n = 2 + rng.below(4) as usize;
        let mut gpu_used = vec![false; gpu_src.len()];
        for _ in 0..n {
            let slot = slots.remove(rng.below(slots.len() as u64) as usize);
            let len = (4096 + rng.below((SLOT - 4096) as u64) as usize) & !3;
            let off = slot * SLOT;
            let data = super::pattern(len, u64::from(k) << 8 | slot as u64);
            let dst = remote.slice(off as u64..(off + len) as u64).unwrap();
            let kind = rng.below(4);
            let g = rng.below(gpu_src.len() as u64) as usize;
            let kind = if kind >= 2 && gpu_used[g] { kind - 2 } else { kind };
            match kind {
                0 => held_host.push(c.write(super::filled(dc, &data), &dst)),
                1 => {
                    let pieces: Vec<Piece> = (0..len.div_ceil(4096))
                        .map(|i| i * 4096)
                        .map(|o| Piece::new(o as u64, o as u64, (len - o).min(4096) as u64))
                        .collect();
                    held_lists_host.push(c.write_list(super::filled(dc, &data), &dst, pieces));
                }
                2 => {
                    gpu_used[g] = true;
                    let src = gpu_src[g].take().unwrap();
                    src.memory().copy_from_host(0, &data).unwrap();
                    held_gpu.push(c.write(src.slice(..len), &dst));
                }
                _ => {
                    gpu_used[g] = true;
                    let src = gpu_src[g].take().unwrap();
                    src.memory().copy_from_host(0, &data).unwrap();
                    let pieces: Vec<Piece> = (0..len / 65536 + 1)
                        .map(|i| i * 65536)
                        .filter(|&o| o < len)
                        .map(|o| Piece::new(o as u64, o as u64, (len - o).min(65536) as u64))
                        .collect();
                    held_lists_gpu.push(c.write_list(src, &dst, pieces));
                }
            }
            kinds[kind as usize] += 1;
            writes.push((off, data));
        }
        to_verifier.send((k, writes)).unwrap();
        let message = match rng.below(4) {
            0 => Message::Inline,
            1 => Message::HostSend,
            2 => Message::GpuSend,
            _ => Message::WriteImm,
        };
        kinds[4 + message as usize] += 1;
        let word = k.to_le_bytes();
        let mut msg_gpu = None;
        let mut msg_host = None;
        let mut msg_inline = None;
        match message {
            Message::Inline => msg_inline = Some(c.send_inline(&word, None)),
            Message::HostSend => msg_host = Some(c.send(super::filled(dc, &word))),
            Message::GpuSend => {
                let m = gpu_msg.take().unwrap();
                m.memory().copy_from_host(0, &word).unwrap();
                msg_gpu = Some(c.send(m.slice(..4)));
            }
            Message::WriteImm => {
                let last = remote.slice((SLOT * SLOTS - 4) as u64..(SLOT * SLOTS) as u64).unwrap();
                msg_host = Some(c.write_with_imm(super::filled(dc, &word), &last, k));
            }
        }
        // The peer's verdict comes before anything here is waited on.
        match verified.recv().unwrap() {
            Ok(_) => {}
            Err(why) => panic!("{why} (operations so far: {kinds:?})"),
        }
        for mut p in held_host {
            p.wait().unwrap();
        }
        for t in held_lists_host {
            t.finish().unwrap();
        }
        for p in held_gpu {
            let (_, r) = p.finish().unwrap();
            let g = devices.iter().position(|d| d.ordinal() == r.memory().device().ordinal()).unwrap();
            gpu_src[g] = Some(r);
        }
        for t in held_lists_gpu {
            let (_, r) = t.finish().unwrap();
            let g = devices.iter().position(|d| d.ordinal() == r.memory().device().ordinal()).unwrap();
            gpu_src[g] = Some(r);
        }
        if let Some(mut p) = msg_inline {
            p.wait().unwrap();
        }
        if let Some(mut p) = msg_host {
            p.wait().unwrap();
        }
        if let Some(p) = msg_gpu {
            gpu_msg = Some(p.finish().unwrap().1);
        }
    }
    drop(verifier.join().unwrap());
    (rounds, kinds)
}

/// A transfer list with a notification into GPU memory the receiver
/// exposed (registered on `ds` with `policy`), `rounds` times with fresh
/// bytes over scattered pages: when the receiver's `Inbox` hands the note
/// out, the pages are in its GPU memory (pulled from the staged mirror, or
/// flushed), with nothing else called. Returns the rounds verified.
pub fn notified_pages_are_visible(
    ds: &gpu_rdma::Domain,
    dc: &gpu_rdma::Domain,
    policy: gpu_rdma::memory::path::PathPolicy,
    rounds: u32,
) -> u32 {
    use gpu_rdma::{Access, Piece};
    const PAGE: usize = 16 << 10;
    const PAGES: usize = 256;
    let device = CudaDevice::open(0).unwrap();
    let pool = ds
        .expose(
            gpu_region_on(ds, &device, PAGE * PAGES, Some(&vec![0u8; PAGE * PAGES]), policy),
            Access::REMOTE_WRITE,
            5,
        )
        .unwrap();
    let (s, c) = super::pair_on(ds, dc, super::opts().advertise(&pool), super::opts());
    let remote = c.remote_region(5).unwrap().whole();
    let mut inbox = s.inbox(4).unwrap();
    let mut rng = super::Rng(0x715_1b1e);
    let mut got = vec![0u8; PAGE * PAGES];
    let mut now = vec![0u8; PAGE * PAGES];
    for k in 0..rounds {
        // 40 of the pages, scattered, each from its own place in a local buffer.
        let mut pages: Vec<usize> = (0..PAGES).collect();
        let chosen: Vec<usize> = (0..40).map(|_| pages.remove(rng.below(pages.len() as u64) as usize)).collect();
        let local = super::pattern(40 * PAGE, u64::from(k) + 500);
        let pieces: Vec<Piece> = chosen
            .iter()
            .enumerate()
            .map(|(i, &p)| Piece::new((i * PAGE) as u64, (p * PAGE) as u64, PAGE as u64))
            .collect();
        c.write_list_notify(super::filled(dc, &local), &remote, pieces, k, b"pages").finish().unwrap();
        let notes = inbox.wait(k, 1).unwrap();
        assert_eq!(&notes[0].payload[..], b"pages");
        pool.cuda().copy_to_host(0, &mut got).unwrap();
        for (i, &p) in chosen.iter().enumerate() {
            now[p * PAGE..(p + 1) * PAGE].copy_from_slice(&local[i * PAGE..(i + 1) * PAGE]);
        }
        if let Some(at) = super::first_difference(&got, &now) {
            panic!("round {k}: byte {at} of the receiver's GPU memory is stale when the note was handed out");
        }
    }
    rounds
}
