//! All-to-all: every rank sends a shard to every other through the
//! rendezvous, and checks the shards it got.
//!
//! ```text
//! all_to_all                      # starts 4 ranks (processes) on this machine
//! all_to_all --ranks 8            # 8 of them
//! all_to_all --etcd http://127.0.0.1:2379   # meeting in etcd (--features etcd)
//! torchrun --nproc-per-node 4 ... # or under a launcher: RANK, WORLD_SIZE, LOCAL_RANK
//!                                 # (Slurm and Open MPI's too), with --etcd, or --dir
//!                                 # on a shared file system
//! ```
//!
//! Each rank exposes a region of `ranks x shard` bytes and joins a
//! [`World`]: it listens and publishes its endpoint in the rendezvous. It
//! reaches every other rank on first use (every connection advertises the
//! rank's region, tagged with its rank), takes an inbox on every
//! connection dialed to it, writes its shard for rank `j` into slot `i` of
//! `j`'s region with a notification tagged `i`, and waits for one
//! notification from every peer before checking every slot.

use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use gpu_rdma::launch::Rank;
use gpu_rdma::rendezvous::{DirRendezvous, Rendezvous};
use gpu_rdma::{Access, ConnectOptions, Domain, Error, Piece, Result, World, WorldOptions};

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
    /// An etcd to meet through instead (`http://127.0.0.1:2379`; needs
    /// the `etcd` feature).
    #[arg(long)]
    etcd: Option<String>,
    /// The job's name: keys go under it (started ranks get a fresh one).
    #[arg(long, default_value = "all-to-all")]
    job: String,
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
    // The store, once, before any rank starts: a missing feature or an etcd
    // that is not running is one clear line, not one per rank.
    if let Some(endpoint) = &args.etcd {
        #[cfg(not(feature = "etcd"))]
        return Err(Error::InvalidArgument(format!(
            "--etcd {endpoint} needs the etcd feature: cargo run --example all_to_all --features etcd -- --etcd {endpoint}"
        )));
        #[cfg(feature = "etcd")]
        store(args).map_err(|e| {
            // The first line, without the client library's internals.
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            let first: String = first.split(", source:").next().unwrap_or(first).chars().take(200).collect();
            Error::InvalidArgument(format!(
                "cannot meet through etcd at {endpoint}: {first}\n  start one first (Debian: apt install etcd-server, \
                 then `etcd --data-dir /tmp/etcd-data`), or leave out --etcd to meet through a directory"
            ))
        })?;
    }
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let children: Vec<_> = (0..args.ranks)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            cmd.args(["--shard", &args.shard.to_string(), "--dir", &dir.to_string_lossy()]);
            cmd.args(["--job", &format!("{}-{}", args.job, std::process::id())]);
            if let Some(e) = &args.etcd {
                cmd.args(["--etcd", e]);
            }
            cmd.env("RANK", r.to_string())
                .env("WORLD_SIZE", args.ranks.to_string())
                .env("LOCAL_RANK", r.to_string())
                .spawn()
        })
        .collect::<std::io::Result<_>>()?;
    let mut failed = Vec::new();
    for (r, mut c) in children.into_iter().enumerate() {
        if !c.wait()?.success() {
            failed.push(r.to_string());
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if !failed.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{} of {} ranks failed (ranks {}; each said why above)",
            failed.len(),
            args.ranks,
            failed.join(", ")
        )));
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

/// The rendezvous: etcd when pointed at one, else the directory.
fn store(args: &Args) -> Result<Arc<dyn Rendezvous>> {
    if let Some(endpoint) = &args.etcd {
        #[cfg(feature = "etcd")]
        {
            use gpu_rdma::rendezvous::{EtcdOptions, EtcdRendezvous};
            let opts = EtcdOptions::new([endpoint.clone()]).namespace(format!("{}/", args.job));
            return Ok(Arc::new(EtcdRendezvous::connect(opts)?));
        }
        #[cfg(not(feature = "etcd"))]
        return Err(Error::InvalidArgument(format!(
            "--etcd {endpoint}: this build has no etcd support (build with --features etcd)"
        )));
    }
    let dir = args
        .dir
        .clone()
        .ok_or_else(|| Error::InvalidArgument("a rank needs --dir or --etcd (the rendezvous)".into()))?;
    Ok(Arc::new(DirRendezvous::new(dir)?))
}

/// Waits until every rank published `what/<rank>`.
fn barrier(rv: &dyn Rendezvous, what: &str, me: u32, n: u32) -> Result<()> {
    rv.publish(&format!("{what}/{me}"), b"")?;
    for j in 0..n {
        rv.lookup(&format!("{what}/{j}"), TIMEOUT)?;
    }
    Ok(())
}

fn run_rank(me: Rank, args: &Args) -> Result<()> {
    let (i, n, len) = (me.rank, me.world_size, args.shard);
    let rv = store(args)?;
    // The GPU of this local rank, and the NIC nearest it (the first active
    // one on a machine without GPUs).
    let domain = Domain::open_near_gpu(me.local_rank as usize)?;
    let region =
        domain.expose(domain.alloc(n as usize * len)?, Access::REMOTE_WRITE, u64::from(i)).map_err(|e| e.error)?;
    // Every connection advertises this rank's region, tagged with its rank.
    let opts = WorldOptions::new("all-to-all")
        .connect(ConnectOptions::default().op_timeout(TIMEOUT).handshake_timeout(TIMEOUT).advertise(&region))
        .lookup_timeout(TIMEOUT);
    let world = World::join(&domain, i, n, Arc::clone(&rv), opts)?;
    // Dialed on first use, each rank starting with the next one up (so not
    // every rank dials rank 0 first).
    let others: Vec<u32> = (1..n).map(|k| (i + k) % n).collect();
    let out = others.iter().map(|&j| world.peer(j).map(|c| (j, c))).collect::<Result<Vec<_>>>()?;
    // Notifications arrive on what the others dialed to this rank.
    let mut inboxes = others
        .iter()
        .map(|&j| world.accepted(j, TIMEOUT).and_then(|c| c.inbox(4)).map(|inbox| (j, inbox)))
        .collect::<Result<Vec<_>>>()?;
    barrier(rv.as_ref(), "listening", i, n)?;
    // Send: my shard for j into slot i of j's region, then a notification.
    let mut lists = Vec::new();
    for (j, c) in &out {
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
    for (j, inbox) in &mut inboxes {
        inbox.wait(*j, 1)?;
    }
    let mut got = vec![0u8; len];
    for &j in &others {
        region.read_at(j as usize * len, &mut got)?;
        if got != shard(j, i, len) {
            return Err(Error::InvalidArgument(format!("rank {i}: the shard from rank {j} is wrong")));
        }
    }
    println!(
        "rank {i}/{n} ({} via {}, rendezvous {}): {} shards verified",
        domain.info().transport,
        me.launcher,
        if args.etcd.is_some() { "etcd" } else { "directory" },
        others.len()
    );
    drop(inboxes);
    // Everyone is done with everyone's region before anyone leaves.
    barrier(rv.as_ref(), "done", i, n)
}
