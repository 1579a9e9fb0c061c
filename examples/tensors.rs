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
//! ```
//!
//! With `--per-tensor` the sender registers every tensor as the framework
//! hands it over (a view of its block) and writes each on its own, the
//! last write notifying. Its blocks are declared host arenas, so each
//! registration is served the block's (`registration_cache_stats` counts
//! the hits); `--no-cache` turns that off, and every tensor is registered
//! anew, as without a cache.
//!
//! Runs on the best path here: verbs when there is an RDMA device (with
//! the reason printed when not), else TCP.

use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use gpu_rdma::units::{format_bytes, parse_bytes};
use gpu_rdma::{Access, ConnectOptions, Connection, Domain, Error, HostArena, HostMemory, Piece, Region, Result};

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
    let arena = domain
        .expose(domain.alloc(recv_blocks * args.block as usize)?, Access::REMOTE_WRITE, ARENA_TAG)
        .map_err(|e| e.error)?;
    let opts = ConnectOptions::default().op_timeout(Duration::from_secs(60));
    let listener = domain.listen("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let recv_opts = opts.clone().advertise(&arena);
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
            if args.per_tensor {
                send_each(&domain, &conn, &layout, args)
            } else {
                send_lists(&domain, &conn, &layout, args)
            }
        });
        (receiver.join(), sender.join())
    });
    let sent = sent.map_err(|_| Error::InvalidArgument("the sender panicked".into()))??;
    received.map_err(|_| Error::InvalidArgument("the receiver panicked".into()))??;
    // Every tensor, byte for byte, where the receiver's allocator put it.
    let mut bad = 0;
    let mut got = Vec::new();
    for (t, (&len, &(b, off))) in sizes.iter().zip(&theirs).enumerate() {
        got.resize(len as usize, 0);
        arena.read_at(b * args.block as usize + off as usize, &mut got)?;
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
    let cache = domain.registration_cache_stats();
    if args.per_tensor {
        println!(
            "registered {} tensors one by one in {:.2} ms ({:.2} us each): {} served their block's registration, {} registered anew{}",
            sizes.len(),
            sent.registering.as_secs_f64() * 1e3,
            sent.registering.as_secs_f64() * 1e6 / sizes.len() as f64,
            cache.hits,
            cache.misses,
            if args.no_cache { " (--no-cache)" } else { "" }
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
}

/// The sender, as a framework handing over its tensors one by one: each
/// block is a declared arena, each tensor a view of it registered as it
/// comes (served the block's registration unless the cache is off) and
/// written on its own; the last write notifies.
fn send_each(domain: &Domain, conn: &Connection, at: &Layout<'_>, args: Args) -> Result<Sent> {
    let remote = conn
        .remote_region(ARENA_TAG)
        .ok_or_else(|| Error::InvalidArgument("the receiver advertised no arena".into()))?
        .whole();
    let arenas: Vec<HostArena> = (0..at.blocks)
        .map(|_| domain.declare_host_arena(HostMemory::new(args.block as usize)?).map_err(|e| e.error))
        .collect::<Result<_>>()?;
    if args.no_cache {
        domain.set_registration_cache(0);
    }
    for (t, (&len, &(b, off))) in at.sizes.iter().zip(at.ours).enumerate() {
        arenas[b].write_at(off as usize, &content(t, len).collect::<Vec<u8>>())?;
    }
    let t0 = Instant::now();
    let mut registering = Duration::ZERO;
    let last = at.sizes.len() - 1;
    let mut writes = Vec::with_capacity(at.sizes.len());
    for (t, (&len, (&(b, off), &(rb, roff)))) in at.sizes.iter().zip(at.ours.iter().zip(at.theirs)).enumerate() {
        let r0 = Instant::now();
        let tensor = domain.register(arenas[b].view(off as usize, len as usize)?, Access::LOCAL)?;
        registering += r0.elapsed();
        let piece = [Piece::new(0, rb as u64 * args.block + roff, len)];
        writes.push(if t == last {
            let note = format!("{} tensors, one by one", at.sizes.len());
            conn.write_list_notify(tensor, &remote, piece, DONE_TAG, note.as_bytes())
        } else {
            conn.write_list(tensor, &remote, piece)
        });
    }
    for w in writes {
        w.finish()?;
    }
    Ok(Sent { elapsed: t0.elapsed(), registering, ops: at.sizes.len() })
}

/// The sender: fills its blocks, registers each once, and moves every
/// tensor in one list per block; the last list notifies.
fn send_lists(domain: &Domain, conn: &Connection, at: &Layout<'_>, args: Args) -> Result<Sent> {
    let (sizes, ours, theirs, blocks) = (at.sizes, at.ours, at.theirs, at.blocks);
    let remote = conn
        .remote_region(ARENA_TAG)
        .ok_or_else(|| Error::InvalidArgument("the receiver advertised no arena".into()))?
        .whole();
    let mut regions: Vec<Region<HostMemory>> =
        (0..blocks).map(|_| domain.alloc(args.block as usize)).collect::<Result<_>>()?;
    let mut pieces: Vec<Vec<Piece>> = vec![Vec::new(); blocks];
    for (t, (&len, (&(b, off), &(rb, roff)))) in sizes.iter().zip(ours.iter().zip(theirs)).enumerate() {
        for (dst, byte) in regions[b][off as usize..(off + len) as usize].iter_mut().zip(content(t, len)) {
            *dst = byte;
        }
        pieces[b].push(Piece::new(off, rb as u64 * args.block + roff, len));
    }
    let t0 = Instant::now();
    let last = blocks - 1;
    let transfers: Vec<_> = regions
        .into_iter()
        .zip(pieces)
        .enumerate()
        .map(|(b, (region, pieces))| {
            if b == last {
                let note = format!("{} tensors from {blocks} blocks", sizes.len());
                conn.write_list_notify(region, &remote, pieces, DONE_TAG, note.as_bytes())
            } else {
                conn.write_list(region, &remote, pieces)
            }
        })
        .collect();
    for t in transfers {
        t.finish()?;
    }
    Ok(Sent { elapsed: t0.elapsed(), registering: Duration::ZERO, ops: blocks })
}
