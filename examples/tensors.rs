//! A model's weights from one process's memory to another's, as a training
//! or inference framework moves them (a checkpoint shard to a new worker,
//! weights to an inference replica): a few hundred tensors of mixed sizes,
//! each a sub-range of a few large blocks, as a caching allocator hands
//! them out, and laid out differently on each side (each side has its own
//! allocator). Each side registers its blocks once, whatever the number of
//! tensors in them; the sender moves every tensor in transfer lists, one
//! per block, the last one notifying; the receiver waits for that one note
//! and checks every tensor byte for byte. On one connection the note is
//! seen only after every list posted before it landed.
//!
//! ```text
//! tensors                       # both sides in this process, over loopback
//! tensors --tensors 600 --block 64MiB
//! tensors --per-tensor          # the framework hands tensors one by one
//! tensors --per-tensor --no-cache
//! tensors --gpu                 # the tensors in GPU memory (device 0)
//! tensors --candle              # candle tensors (CPU device; --features candle)
//! ```
//!
//! With `--per-tensor` the sender registers every tensor as the framework
//! hands it over (a view of its block) and writes each on its own, the
//! last write notifying. Its blocks are declared host arenas, so each
//! registration is served the block's (`registration_cache_stats` counts
//! the hits); `--no-cache` turns that off, and every tensor is registered
//! anew, as without a cache.
//!
//! With `--gpu` both sides keep the tensors in GPU memory: the sender's
//! blocks come from cudarc (as a framework's allocator hands them out) and
//! each tensor is a [`CudaBuffer::view`] of its block. On a direct path
//! (dma-buf, nvidia-peermem) a block is registered once and served to its
//! tensors; where GPU memory is staged, the path report says why.
//!
//! Runs on the best path here: verbs when there is an RDMA device (with
//! the reason printed when not), else TCP.

use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use gpu_rdma::units::{format_bytes, parse_bytes};
use gpu_rdma::{
    Access, ConnectOptions, Connection, Domain, Error, Exposed, ForeignHost, HostArena, HostMemory, Memory, Piece,
    Result,
};

#[derive(Parser, Debug, Clone, Copy)]
#[command(about = "A model's tensors, sub-ranges of a few large blocks, moved in transfer lists with one notification")]
struct Args {
    /// Tensors in the model.
    #[arg(long, default_value_t = 320)]
    tensors: u32,
    /// Size of each allocator block (tensors never straddle one).
    #[arg(long, default_value = "32MiB", value_parser = |s: &str| parse_bytes(s).map_err(|e| e.to_string()))]
    block: u64,
    /// Seed of the model's shapes and of the receiver's layout.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Register and write each tensor on its own, as handed over.
    #[arg(long)]
    per_tensor: bool,
    /// With `--per-tensor`: no registration cache (each tensor registered anew).
    #[arg(long, requires = "per_tensor")]
    no_cache: bool,
    /// The tensors in GPU memory (device 0) on both sides.
    #[arg(long)]
    gpu: bool,
    /// The sender's tensors are candle tensors (on candle's CPU device),
    /// each registered as it is, no copy (implies `--per-tensor`; needs
    /// `--features candle`).
    #[arg(long, conflicts_with = "gpu")]
    candle: bool,
}

/// The receiver's arena: one region the sender writes into.
const ARENA_TAG: u64 = 0x5445_4e53; // "TENS"
/// The note the last list carries.
const DONE_TAG: u32 = 1;

/// Where a caching allocator put each tensor: (block, offset), in blocks of
/// `block` bytes, 512-byte aligned, in an order of its own.
fn place(sizes: &[u64], block: u64, order_seed: u64) -> Vec<(usize, u64)> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    let mut x = order_seed | 1;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let mut at = vec![(0, 0); sizes.len()];
    let (mut b, mut off) = (0usize, 0u64);
    for i in order {
        if off + sizes[i] > block {
            b += 1;
            off = 0;
        }
        at[i] = (b, off);
        off = (off + sizes[i]).div_ceil(512) * 512;
    }
    at
}

/// A transformer's tensors, in bytes: embeddings, then per layer the
/// attention and MLP weights, biases and norms (a few hundred, from bytes
/// to megabytes), each capped at one block.
fn shapes(n: u32, block: u64) -> Vec<u64> {
    let per_layer = [1536u64 << 10, 1536 << 10, 512 << 10, 4 << 10, 2 << 20, 2 << 20, 6 << 10, 2 << 10];
    let mut sizes = vec![(4u64 << 20).min(block)];
    let mut i = 0;
    while sizes.len() < n as usize {
        sizes.push(per_layer[i % per_layer.len()].min(block) + (i as u64 % 3) * 256);
        i += 1;
    }
    sizes
}

/// Tensor `t`'s bytes.
fn content(t: usize, len: u64) -> impl Iterator<Item = u8> {
    (0..len).map(move |i| (i as u8).wrapping_mul(29) ^ (t as u8).wrapping_mul(113) ^ (i >> 11) as u8)
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tensors: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<()> {
    // Candle tensors are handed over one by one.
    let args = Args { per_tensor: args.per_tensor || args.candle, ..args };
    if args.tensors == 0 || args.block < 64 << 10 {
        return Err(Error::InvalidArgument("at least one tensor, in blocks of at least 64 KiB".into()));
    }
    let domain = Domain::open()?;
    let info = domain.info();
    match &info.fallback {
        Some(why) => println!("path: TCP, no RDMA here: {why}"),
        None => println!("path: {} on {} port {}", info.transport, info.device, info.port),
    }
    let sizes = shapes(args.tensors, args.block);
    let total: u64 = sizes.iter().sum();
    // Each side's allocator placed the tensors in its own blocks, its own way.
    let theirs = place(&sizes, args.block, args.seed.wrapping_mul(0x9e37_79b9));
    let ours = place(&sizes, args.block, args.seed);
    let blocks = |at: &[(usize, u64)]| at.iter().map(|&(b, _)| b).max().unwrap_or(0) + 1;
    let (send_blocks, recv_blocks) = (blocks(&ours), blocks(&theirs));
    println!(
        "{} tensors, {} in all, {} to {}: {} blocks of {} here, {} there",
        sizes.len(),
        format_bytes(total),
        format_bytes(*sizes.iter().min().unwrap_or(&0)),
        format_bytes(*sizes.iter().max().unwrap_or(&0)),
        send_blocks,
        format_bytes(args.block),
        recv_blocks
    );

    // The receiver's blocks, one arena exposed once for writes.
    let len = recv_blocks * args.block as usize;
    let arena = if args.gpu { Arena::gpu(&domain, len)? } else { Arena::host(&domain, len)? };
    let opts = ConnectOptions::default().op_timeout(Duration::from_secs(60));
    let listener = domain.listen("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let recv_opts = arena.advertise(opts.clone());
    let (received, sent) = thread::scope(|s| {
        let receiver = s.spawn(|| -> Result<()> {
            let conn = listener.accept_timeout(&recv_opts, Duration::from_secs(30))?;
            let mut inbox = conn.inbox(1)?;
            let note = inbox.wait(DONE_TAG, 1)?;
            println!("receiver: note {:?}", String::from_utf8_lossy(&note[0].payload));
            Ok(())
        });
        let sender = s.spawn(|| -> Result<Sent> {
            let conn = domain.connect(addr, &opts)?;
            let layout = Layout { sizes: &sizes, ours: &ours, theirs: &theirs, blocks: send_blocks };
            if args.gpu {
                send(&domain, &conn, &layout, args, &gpu_blocks(send_blocks, args.block as usize)?)
            } else if args.candle {
                send(&domain, &conn, &layout, args, &candle_tensors()?)
            } else {
                let arenas: Vec<HostArena> = (0..send_blocks)
                    .map(|_| domain.declare_host_arena(HostMemory::new(args.block as usize)?).map_err(|e| e.error))
                    .collect::<Result<_>>()?;
                send(&domain, &conn, &layout, args, &arenas)
            }
        });
        (receiver.join(), sender.join())
    });
    let sent = sent.map_err(|_| Error::InvalidArgument("the sender panicked".into()))??;
    received.map_err(|_| Error::InvalidArgument("the receiver panicked".into()))??;
    // Every tensor, byte for byte, where the receiver's allocator put it.
    drop((recv_opts, listener));
    let mut bad = 0;
    let mut got = Vec::new();
    let read = arena.reader()?;
    for (t, (&len, &(b, off))) in sizes.iter().zip(&theirs).enumerate() {
        got.resize(len as usize, 0);
        read(b * args.block as usize + off as usize, &mut got)?;
        if !got.iter().copied().eq(content(t, len)) {
            bad += 1;
        }
    }
    if bad > 0 {
        return Err(Error::InvalidArgument(format!("{bad} of {} tensors arrived wrong", sizes.len())));
    }
    println!(
        "all {} tensors verified: {} in {} {} and one note, {:.1} ms ({}/s)",
        sizes.len(),
        format_bytes(total),
        sent.ops,
        if args.per_tensor { "writes" } else { "lists" },
        sent.elapsed.as_secs_f64() * 1e3,
        format_bytes((total as f64 / sent.elapsed.as_secs_f64()) as u64),
    );
    let cache = sent.cache;
    if args.per_tensor {
        println!(
            "registered {} tensors one by one in {:.2} ms ({:.2} us each): {} served their block's registration, {} registered anew{}",
            sizes.len(),
            sent.registering.as_secs_f64() * 1e3,
            sent.registering.as_secs_f64() * 1e6 / sizes.len() as f64,
            cache.hits,
            cache.misses,
            match (args.no_cache, cache.hits + cache.misses) {
                (true, _) => " (--no-cache)",
                (false, 0) if args.gpu => " (GPU memory staged: a tensor registers nothing of its own)",
                (false, 0) if args.candle => " (candle tensors: each its own allocation, registered as it is)",
                _ => "",
            }
        );
    } else {
        println!(
            "registered once each: {send_blocks} blocks sent from, 1 arena received into, for {} tensors",
            sizes.len()
        );
    }
    Ok(())
}

/// Where the tensors are, on each side.
struct Layout<'a> {
    sizes: &'a [u64],
    ours: &'a [(usize, u64)],
    theirs: &'a [(usize, u64)],
    blocks: usize,
}

/// What the sender did.
struct Sent {
    /// From the first post to the last completion.
    elapsed: Duration,
    /// Time spent registering (per tensor only).
    registering: Duration,
    /// Operations posted.
    ops: usize,
    /// What the registration caches did for the sender's registrations.
    cache: gpu_rdma::RegistrationCacheStats,
}

/// Copies the bytes at an offset of the receiver's arena out.
type Reader = Box<dyn Fn(usize, &mut [u8]) -> Result<()>>;

/// The receiver's arena: one region the sender writes into.
enum Arena {
    Host(Exposed<HostMemory>),
    #[cfg(feature = "cuda")]
    Gpu(Exposed<gpu_rdma::cuda::CudaBuffer>),
}

impl Arena {
    fn host(domain: &Domain, len: usize) -> Result<Arena> {
        Ok(Arena::Host(domain.expose(domain.alloc(len)?, Access::REMOTE_WRITE, ARENA_TAG).map_err(|e| e.error)?))
    }

    #[cfg(feature = "cuda")]
    fn gpu(domain: &Domain, len: usize) -> Result<Arena> {
        let buf = gpu_rdma::cuda::CudaBuffer::alloc(&gpu_rdma::cuda::CudaDevice::open(0)?, len)?;
        let region = domain.register(buf, Access::LOCAL)?;
        println!("receiver: GPU memory path {}", region.path_report().map_or("?".into(), |r| r.to_string()));
        Ok(Arena::Gpu(domain.expose(region, Access::REMOTE_WRITE, ARENA_TAG).map_err(|e| e.error)?))
    }

    #[cfg(not(feature = "cuda"))]
    fn gpu(_: &Domain, _: usize) -> Result<Arena> {
        Err(Error::FeatureDisabled { feature: "cuda" })
    }

    fn advertise(&self, opts: ConnectOptions) -> ConnectOptions {
        match self {
            Arena::Host(e) => opts.advertise(e),
            #[cfg(feature = "cuda")]
            Arena::Gpu(e) => opts.advertise(e),
        }
    }

    /// Reads the arena's bytes once every write landed.
    fn reader(self) -> Result<Reader> {
        Ok(match self {
            Arena::Host(e) => Box::new(move |at, out| e.read_at(at, out)),
            #[cfg(feature = "cuda")]
            Arena::Gpu(e) => {
                // The note makes visible what its own list wrote; the lists
                // before it landed too (one connection keeps order), and
                // one pull makes all of them visible to CUDA work (on a
                // direct path a flush where the GPU needs one, staged a copy
                // from the host mirror).
                e.pull()?;
                let region = e.withdraw().map_err(|e| Error::InvalidArgument(e.to_string()))?;
                Box::new(move |at, out| region.memory().copy_to_host(at, out))
            }
        })
    }
}

/// The sender's blocks, as its allocator made them: host arenas, or GPU
/// blocks. A tensor is a view of its block.
trait Blocks {
    type View: Memory;
    /// Writes a tensor's bytes where the allocator put it.
    fn fill(&self, b: usize, off: usize, data: &[u8]) -> Result<()>;
    /// The tensor at `off` of block `b`, as memory to register.
    fn view(&self, b: usize, off: usize, len: usize) -> Result<Self::View>;
}

impl Blocks for Vec<HostArena> {
    type View = ForeignHost;
    fn fill(&self, b: usize, off: usize, data: &[u8]) -> Result<()> {
        self[b].write_at(off, data)
    }
    fn view(&self, b: usize, off: usize, len: usize) -> Result<ForeignHost> {
        self[b].view(off, len)
    }
}

#[cfg(feature = "cuda")]
impl Blocks for Vec<std::sync::Arc<gpu_rdma::cuda::CudaBuffer>> {
    type View = gpu_rdma::cuda::CudaBuffer;
    fn fill(&self, b: usize, off: usize, data: &[u8]) -> Result<()> {
        self[b].copy_from_host(off, data)
    }
    fn view(&self, b: usize, off: usize, len: usize) -> Result<gpu_rdma::cuda::CudaBuffer> {
        gpu_rdma::cuda::CudaBuffer::view(&self[b], off, len)
    }
}

/// The sender's tensors as candle made them: each its own tensor (a
/// candle `Tensor` of f32 on the CPU device), found by where the layout put
/// it; registered as it is, the registration holding a clone of the tensor
/// (so candle frees its storage only after the NIC is done with it).
#[cfg(feature = "candle")]
struct CandleTensors(std::sync::Mutex<std::collections::HashMap<(usize, usize), candle_core::Tensor>>);

#[cfg(feature = "candle")]
fn candle_tensors() -> Result<CandleTensors> {
    Ok(CandleTensors(Default::default()))
}

#[cfg(not(feature = "candle"))]
fn candle_tensors() -> Result<Vec<HostArena>> {
    Err(Error::FeatureDisabled { feature: "candle" })
}

#[cfg(feature = "candle")]
impl Blocks for CandleTensors {
    type View = ForeignHost;
    fn fill(&self, b: usize, off: usize, data: &[u8]) -> Result<()> {
        let floats: Vec<f32> = data.chunks_exact(4).map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect();
        let n = floats.len();
        let t = candle_core::Tensor::from_vec(floats, n, &candle_core::Device::Cpu)
            .map_err(|e| Error::InvalidArgument(format!("candle: {e}")))?;
        self.0.lock().unwrap_or_else(|e| e.into_inner()).insert((b, off), t);
        Ok(())
    }
    fn view(&self, b: usize, off: usize, len: usize) -> Result<ForeignHost> {
        let t = self.0.lock().unwrap_or_else(|e| e.into_inner()).get(&(b, off)).cloned();
        let t = t.ok_or_else(|| Error::InvalidArgument(format!("no candle tensor at block {b} offset {off}")))?;
        let ptr = {
            let (storage, layout) = t.storage_and_layout();
            match &*storage {
                candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) if t.is_contiguous() => {
                    v[layout.start_offset()..].as_ptr().cast::<u8>().cast_mut()
                }
                _ => return Err(Error::InvalidArgument("a contiguous f32 tensor on the CPU device".into())),
            }
        };
        if len > t.elem_count() * 4 {
            return Err(Error::InvalidArgument(format!("{len} bytes asked of a {}-byte tensor", t.elem_count() * 4)));
        }
        // SAFETY: `ptr..ptr + len` lies in the tensor's CPU storage (a Vec<f32>
        // candle never reallocates), which the tensor clone moved into the
        // guard keeps alive as long as the memory value; nothing writes the
        // tensor while it is sent (candle tensors are immutable here).
        unsafe { ForeignHost::from_raw(ptr, len, Box::new(t)) }
    }
}

/// The sender's GPU blocks, from cudarc (a framework's allocator).
#[cfg(feature = "cuda")]
fn gpu_blocks(n: usize, len: usize) -> Result<Vec<std::sync::Arc<gpu_rdma::cuda::CudaBuffer>>> {
    let ctx = cudarc::driver::CudaContext::new(0)
        .map_err(|e| Error::InvalidArgument(format!("cudarc could not open GPU 0: {e}")))?;
    let stream = ctx.default_stream();
    (0..n)
        .map(|_| {
            let slice = stream
                .alloc_zeros::<u8>(len)
                .map_err(|e| Error::InvalidArgument(format!("cudarc could not allocate: {e}")))?;
            Ok(std::sync::Arc::new(gpu_rdma::cuda::CudaBuffer::from_cudarc(slice)?))
        })
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn gpu_blocks(_: usize, _: usize) -> Result<Vec<HostArena>> {
    Err(Error::FeatureDisabled { feature: "cuda" })
}

/// The sender: writes every tensor into its block, then either registers
/// each block once and moves every tensor in one list per block
/// (`--per-tensor` not given), or registers each tensor as it is handed
/// over (a view of its block: served the block's registration unless the
/// cache is off) and writes it on its own. The last list or write notifies.
fn send<B: Blocks>(domain: &Domain, conn: &Connection, at: &Layout<'_>, args: Args, blocks: &B) -> Result<Sent> {
    let remote = conn
        .remote_region(ARENA_TAG)
        .ok_or_else(|| Error::InvalidArgument("the receiver advertised no arena".into()))?
        .whole();
    if args.no_cache {
        domain.set_registration_cache(0);
    }
    let tensors = at.sizes.iter().zip(at.ours.iter().zip(at.theirs));
    for (t, (&len, &(b, off))) in at.sizes.iter().zip(at.ours).enumerate() {
        blocks.fill(b, off as usize, &content(t, len).collect::<Vec<u8>>())?;
    }
    let before = domain.registration_cache_stats();
    let t0 = Instant::now();
    let mut registering = Duration::ZERO;
    let mut register = |b, off, len| -> Result<_> {
        let r0 = Instant::now();
        let region = domain.register(blocks.view(b, off, len)?, Access::LOCAL)?;
        registering += r0.elapsed();
        Ok(region)
    };
    // (local region, its pieces) per operation.
    let mut ops = Vec::new();
    if args.per_tensor {
        for (&len, (&(b, off), &(rb, roff))) in tensors {
            let piece = Piece::new(0, rb as u64 * args.block + roff, len);
            ops.push((register(b, off as usize, len as usize)?, vec![piece]));
        }
    } else {
        let mut pieces: Vec<Vec<Piece>> = vec![Vec::new(); at.blocks];
        for (&len, (&(b, off), &(rb, roff))) in tensors {
            pieces[b].push(Piece::new(off, rb as u64 * args.block + roff, len));
        }
        for (b, pieces) in pieces.into_iter().enumerate() {
            ops.push((register(b, 0, args.block as usize)?, pieces));
        }
    }
    let n = ops.len();
    let note = format!("{} tensors in {n} {}", at.sizes.len(), if args.per_tensor { "writes" } else { "lists" });
    let transfers: Vec<_> = ops
        .into_iter()
        .enumerate()
        .map(|(i, (region, pieces))| {
            if i == n - 1 {
                conn.write_list_notify(region, &remote, pieces, DONE_TAG, note.as_bytes())
            } else {
                conn.write_list(region, &remote, pieces)
            }
        })
        .collect();
    for t in transfers {
        t.finish()?;
    }
    let after = domain.registration_cache_stats();
    let cache = gpu_rdma::RegistrationCacheStats {
        hits: after.hits - before.hits,
        misses: after.misses - before.misses,
        ..after
    };
    Ok(Sent { elapsed: t0.elapsed(), registering, ops: n, cache })
}
