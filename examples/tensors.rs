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
//! ```
//!
//! Runs on the best path here: verbs when there is an RDMA device (with
//! the reason printed when not), else TCP.

use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use gpu_rdma::units::{format_bytes, parse_bytes};
use gpu_rdma::{Access, ConnectOptions, Connection, Domain, Error, HostMemory, Piece, Region, Result};

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
        let sender = s.spawn(|| -> Result<(Duration, usize)> {
            let conn = domain.connect(addr, &opts)?;
            send(&domain, &conn, &sizes, &ours, &theirs, args, send_blocks)
        });
        (receiver.join(), sender.join())
    });
    let (sent_in, lists) = sent.map_err(|_| Error::InvalidArgument("the sender panicked".into()))??;
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
        "all {} tensors verified: {} in {} lists and one note, {:.1} ms ({}/s)",
        sizes.len(),
        format_bytes(total),
        lists,
        sent_in.as_secs_f64() * 1e3,
        format_bytes((total as f64 / sent_in.as_secs_f64()) as u64),
    );
    println!(
        "registered once each: {send_blocks} blocks sent from, 1 arena received into, for {} tensors",
        sizes.len()
    );
    Ok(())
}

/// The sender: fills its blocks, registers each once, and moves every
/// tensor in one list per block; the last list notifies.
fn send(
    domain: &Domain,
    conn: &Connection,
    sizes: &[u64],
    ours: &[(usize, u64)],
    theirs: &[(usize, u64)],
    args: Args,
    blocks: usize,
) -> Result<(Duration, usize)> {
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
    Ok((t0.elapsed(), blocks))
}
