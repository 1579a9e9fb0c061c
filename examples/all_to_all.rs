//! All-to-all: every rank sends a shard to every other through the
//! rendezvous, and checks the shards it got.
//!
//! ```text
//! all_to_all                      # starts 4 ranks (processes) on this machine
//! all_to_all --ranks 8            # 8 of them
//! torchrun --nproc-per-node 4 ... # or under a launcher: RANK, WORLD_SIZE, LOCAL_RANK
//!                                 # (Slurm and Open MPI's too), with --dir on a shared file system
//! ```
//!
//! Each rank exposes a region of `ranks x shard` bytes, listens, and
//! publishes its endpoint under `rank/<i>` in the rendezvous directory. It
//! connects to every lower rank and accepts every higher one (each side
//! advertises its region with its rank as the tag, so both know who is
//! who), then writes its shard for rank `j` into slot `i` of `j`'s region
//! with a notification tagged `i`, and waits for one notification from
//! every peer before checking every slot.

use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use clap::Parser;
use gpu_rdma::launch::Rank;
use gpu_rdma::rendezvous::{DirRendezvous, Rendezvous};
use gpu_rdma::{Access, ConnectOptions, Connection, Domain, Endpoint, Error, Piece, Result};

#[derive(Parser, Debug)]
#[command(about = "All-to-all shard exchange through the rendezvous, verified")]
struct Args {
    /// Ranks to start on this machine when no launcher started this process.
    #[arg(long, default_value_t = 4)]
    ranks: u32,
    /// Bytes per shard.
    #[arg(long, default_value_t = 1 << 20)]
    shard: usize,
    /// The rendezvous directory (default: a fresh one under the temp dir).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
}

const TIMEOUT: Duration = Duration::from_secs(60);

/// What rank `from` sends rank `to`: distinct for every pair.
fn shard(from: u32, to: u32, len: usize) -> Vec<u8> {
    let mut x = (u64::from(from) << 32 | u64::from(to)).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match Rank::from_env() {
        Ok(Some(rank)) => run_rank(rank, &args),
        Ok(None) => launch(&args),
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("all_to_all: {e}");
            ExitCode::FAILURE
        }
    }
}

/// No launcher: start `ranks` copies of this program as torchrun would.
fn launch(args: &Args) -> Result<()> {
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("gpu-rdma-all-to-all-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir);
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let children: Vec<_> = (0..args.ranks)
        .map(|r| {
            Command::new(&exe)
                .args(["--shard", &args.shard.to_string(), "--dir", &dir.to_string_lossy()])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", args.ranks.to_string())
                .env("LOCAL_RANK", r.to_string())
                .spawn()
        })
        .collect::<std::io::Result<_>>()?;
    let mut failed = 0;
    for (r, mut c) in children.into_iter().enumerate() {
        if !c.wait()?.success() {
            eprintln!("rank {r} failed");
            failed += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if failed > 0 {
        return Err(Error::InvalidArgument(format!("{failed} of {} ranks failed", args.ranks)));
    }
    println!(
        "all {} ranks exchanged {} shards of {} bytes, every one verified, in {:.1} ms",
        args.ranks,
        args.ranks * (args.ranks - 1),
        args.shard,
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

fn run_rank(me: Rank, args: &Args) -> Result<()> {
    let (i, n, len) = (me.rank, me.world_size, args.shard);
    let dir = args.dir.clone().ok_or_else(|| Error::InvalidArgument("a rank needs --dir (the rendezvous)".into()))?;
    let rv = DirRendezvous::new(dir)?;
    let domain = Domain::open()?;
    let region =
        domain.expose(domain.alloc(n as usize * len)?, Access::REMOTE_WRITE, u64::from(i)).map_err(|e| e.error)?;
    let opts = ConnectOptions::default().op_timeout(TIMEOUT).handshake_timeout(TIMEOUT).advertise(&region);
    let listener = domain.listen("127.0.0.1:0")?;
    rv.publish(&format!("rank/{i}"), &listener.endpoint()?.to_bytes())?;
    // Lower ranks: connect; higher ones: accept. Each peer's rank is the
    // tag of the region it advertised.
    let mut peers: Vec<(u32, Connection)> = Vec::new();
    for j in 0..i {
        let ep = Endpoint::from_bytes(&rv.lookup(&format!("rank/{j}"), TIMEOUT)?)?;
        peers.push((j, domain.connect(ep.addr, &opts)?));
    }
    for _ in i + 1..n {
        let c = listener.accept_timeout(&opts, TIMEOUT)?;
        let j = c
            .remote_regions()
            .first()
            .map(|r| r.tag() as u32)
            .ok_or_else(|| Error::InvalidArgument("a peer advertised no region".into()))?;
        peers.push((j, c));
    }
    peers.sort_by_key(|(j, _)| *j);
    let mut inboxes = peers.iter().map(|(_, c)| c.inbox(4)).collect::<Result<Vec<_>>>()?;
    // Send: my shard for j into slot i of j's region, then a notification.
    let mut lists = Vec::new();
    for (j, c) in &peers {
        let theirs = c.remote_region(u64::from(*j)).expect("advertised").whole();
        let mut src = domain.alloc(len)?;
        src.copy_from_slice(&shard(i, *j, len));
        let at = u64::from(i) * len as u64;
        lists.push(c.write_list_notify(src, &theirs, [Piece::new(0, at, len as u64)], i, &[]));
    }
    for l in lists {
        l.finish()?;
    }
    // Receive: one notification from every peer, then check every slot.
    for ((j, _), inbox) in peers.iter().zip(&mut inboxes) {
        inbox.wait(*j, 1)?;
    }
    let mut got = vec![0u8; len];
    for (j, _) in &peers {
        region.read_at(*j as usize * len, &mut got)?;
        if got != shard(*j, i, len) {
            return Err(Error::InvalidArgument(format!("rank {i}: the shard from rank {j} is wrong")));
        }
    }
    println!("rank {i}/{n} ({} via {}): {} shards verified", domain.info().transport, me.launcher, peers.len());
    drop(inboxes);
    // Everyone is done with everyone's region before anyone leaves.
    rv.publish(&format!("done/{i}"), b"")?;
    for j in 0..n {
        rv.lookup(&format!("done/{j}"), TIMEOUT)?;
    }
    Ok(())
}
