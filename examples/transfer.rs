//! Moves a buffer between two processes by RDMA WRITE, RDMA READ or SEND,
//! optionally verifying every byte, and prints the bandwidth.
//!
//! ```text
//! transfer --listen 127.0.0.1:7471 --op write --bytes 256MiB --verify    # one process
//! transfer --connect 127.0.0.1:7471 --op write --bytes 256MiB --verify   # the other
//! ```
//!
//! Both sides take the same `--op` and `--bytes`. The listener owns the
//! target (write), the source (read) or the receive buffers (send); the
//! connecting side drives the operation and times it.
//!
//! - write: the listener exposes a region for remote writes; the client
//!   writes it, then sends a zero-byte message with an immediate: RC
//!   ordering delivers it after the data. The listener verifies.
//! - read: the listener fills and exposes a region for remote reads; the
//!   client reads it, verifies, and tells the listener it is done.
//! - send: the listener posts receives for consecutive chunks (each at most
//!   the maximum message size); the client sends them. The listener verifies.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use gpu_rdma::units::{format_bytes, parse_bytes};
use gpu_rdma::{Access, ConnectOptions, Connection, Domain, DomainConfig, Error, LocalBuffer, Pending, Region, Shared};

#[derive(Parser, Debug)]
#[command(about = "Move a buffer between two processes by RDMA, and time it")]
struct Args {
    /// Listen on ADDR (the side that owns the target or source memory).
    #[arg(long, value_name = "ADDR", conflicts_with = "connect", required_unless_present = "connect")]
    listen: Option<SocketAddr>,
    /// Connect to the listener at ADDR (the side that drives and times the transfer).
    #[arg(long, value_name = "ADDR")]
    connect: Option<SocketAddr>,
    /// The operation.
    #[arg(long, value_enum, default_value_t = Op::Write)]
    op: Op,
    /// Bytes to move, like 4096, 64KiB, 256MiB, 1GiB.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    bytes: u64,
    /// Fill the source with a pattern and check every byte at the receiver.
    #[arg(long)]
    verify: bool,
    /// RDMA device (default: GPU_RDMA_DEVICE, else the first with an active port).
    #[arg(long, short = 'd')]
    device: Option<String>,
    /// GID index (default: GPU_RDMA_GID_INDEX, else chosen).
    #[arg(long, short = 'x')]
    gid_index: Option<u32>,
    /// Seconds to wait for the peer and for the transfer.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Op {
    Write,
    Read,
    Send,
}

const TAG_WRITE: u64 = 0x5752_4954; // "WRIT"
const TAG_READ: u64 = 0x5245_4144; // "READ"
const DONE: u32 = 0x444f_4e45; // "DONE"

fn parse_size(s: &str) -> Result<u64, String> {
    parse_bytes(s).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("GPU_RDMA_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(Error::NoDevice { reason }) => {
            eprintln!("transfer: no RDMA device on this machine: {reason}.");
            eprintln!("transfer: this example needs verbs; `cargo xtask demo` runs it on soft-RoCE in a VM.");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("transfer: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(args: &Args) -> gpu_rdma::Result<bool> {
    let mut config = DomainConfig::from_env()?;
    if let Some(d) = &args.device {
        config = config.device(d.clone());
    }
    if let Some(g) = args.gid_index {
        config = config.gid_index(g);
    }
    let domain = Domain::with_config(&config)?;
    let len = usize::try_from(args.bytes).map_err(|_| Error::InvalidArgument("--bytes is too large".into()))?;
    if len == 0 {
        return Err(Error::InvalidArgument("--bytes must be at least 1".into()));
    }
    let timeout = Duration::from_secs(args.timeout);
    let opts = ConnectOptions::default().handshake_timeout(timeout).op_timeout(timeout).queue_depth(256, 256);
    let role = if args.listen.is_some() { "listener" } else { "client" };
    println!("transfer ({role}): {:?} of {} over {}", args.op, format_bytes(args.bytes), domain.info());
    match (args.listen, args.connect) {
        (Some(addr), _) => listener(&domain, addr, args, len, opts),
        (None, Some(addr)) => client(&domain, addr, args, len, opts),
        (None, None) => unreachable!("clap requires one"),
    }
}

/// Byte `i` of the pattern: word `i / 8` of a splitmix64 sequence.
fn fill(buf: &mut [u8]) {
    for (k, chunk) in buf.chunks_mut(8).enumerate() {
        let w = splitmix(k as u64).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

fn splitmix(k: u64) -> u64 {
    let mut z = k.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Checks every byte against the pattern; prints `verified` or the first bad offset.
fn verify(buf: &[u8]) -> bool {
    for (k, chunk) in buf.chunks(8).enumerate() {
        let w = splitmix(k as u64).to_le_bytes();
        if chunk != &w[..chunk.len()] {
            let i = chunk.iter().zip(w).position(|(a, b)| *a != b).unwrap_or(0);
            let off = k * 8 + i;
            println!("MISMATCH at offset {off}: expected {:#04x}, found {:#04x}", w[i], chunk[i]);
            return false;
        }
    }
    println!("verified: all {} bytes match", buf.len());
    true
}

fn report(what: &str, bytes: u64, took: Duration) {
    let secs = took.as_secs_f64();
    println!(
        "{what}: {bytes} bytes in {secs:.3} s = {:.3} GB/s ({:.1} MiB/s)",
        bytes as f64 / secs / 1e9,
        bytes as f64 / secs / (1 << 20) as f64
    );
}

fn accept(domain: &Domain, addr: SocketAddr, opts: &ConnectOptions, timeout: Duration) -> gpu_rdma::Result<Connection> {
    let listener = domain.listen(addr)?;
    println!("listening on {}", listener.local_addr()?);
    listener.accept_timeout(opts, timeout)
}

fn connect(
    domain: &Domain,
    addr: SocketAddr,
    opts: &ConnectOptions,
    timeout: Duration,
) -> gpu_rdma::Result<Connection> {
    // The listener may still be starting: retry a refused connection until the timeout.
    let deadline = Instant::now() + timeout;
    loop {
        match domain.connect(addr, opts) {
            Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            other => return other,
        }
    }
}

/// The chunks a send is cut into: each at most the maximum message size.
fn chunks(len: usize, max: u64) -> Vec<std::ops::Range<usize>> {
    let step = usize::try_from(max).unwrap_or(usize::MAX).max(1);
    (0..len).step_by(step).map(|s| s..(s + step).min(len)).collect()
}

fn listener(
    domain: &Domain,
    addr: SocketAddr,
    args: &Args,
    len: usize,
    opts: ConnectOptions,
) -> gpu_rdma::Result<bool> {
    let timeout = Duration::from_secs(args.timeout);
    match args.op {
        Op::Write => {
            let target = domain.expose(domain.alloc(len)?, Access::REMOTE_WRITE, TAG_WRITE)?;
            let conn = accept(domain, addr, &opts.advertise(&target), timeout)?;
            let done = conn.recv_imm().wait()?;
            if done.imm != Some(DONE) {
                return Err(Error::InvalidArgument(format!("unexpected notification {:?}", done.imm)));
            }
            println!("write: the client wrote {len} bytes");
            drop(conn);
            let region = target.withdraw().map_err(|e| Error::InvalidArgument(e.to_string()))?;
            Ok(!args.verify || verify(&region))
        }
        Op::Read => {
            let mut region = domain.alloc(len)?;
            if args.verify {
                fill(&mut region);
            }
            let source = domain.expose(region, Access::REMOTE_READ, TAG_READ)?;
            let conn = accept(domain, addr, &opts.advertise(&source), timeout)?;
            let done = conn.recv_imm().wait()?;
            println!("read: the client read {len} bytes");
            Ok(done.imm == Some(DONE))
        }
        Op::Send => {
            let buffer = domain.alloc(len)?.share();
            let conn = accept(domain, addr, &opts, timeout)?;
            let parts = chunks(len, conn.info().max_message_size);
            let window = (conn.info().recv_queue_depth as usize / 2).max(1);
            let t0 = Instant::now();
            let mut received = 0u64;
            let mut posted: std::collections::VecDeque<Pending<Shared>> = Default::default();
            let mut next = parts.iter();
            loop {
                while posted.len() < window {
                    let Some(r) = next.next() else { break };
                    posted.push_back(conn.recv(buffer.clone().slice(r.clone())));
                }
                let Some(mut p) = posted.pop_front() else {
                    break;
                };
                received += u64::from(p.wait()?.byte_len);
            }
            report("send (received)", received, t0.elapsed());
            // Tell the client everything arrived, then verify.
            conn.send_inline(&[], Some(DONE)).wait()?;
            let region: Region =
                buffer.try_into_region().map_err(|_| Error::InvalidArgument("buffer in use".into()))?;
            Ok(received == len as u64 && (!args.verify || verify(&region)))
        }
    }
}

fn client(domain: &Domain, addr: SocketAddr, args: &Args, len: usize, opts: ConnectOptions) -> gpu_rdma::Result<bool> {
    let timeout = Duration::from_secs(args.timeout);
    let mut region = domain.alloc(len)?;
    if args.verify && args.op != Op::Read {
        fill(&mut region);
    }
    let conn = connect(domain, addr, &opts, timeout)?;
    println!(
        "connected: queue pair {:#x} -> {:#x}, MTU {}, max message {}",
        conn.info().local_qp_num,
        conn.info().remote_qp_num,
        conn.info().mtu,
        format_bytes(conn.info().max_message_size)
    );
    let remote_for = |tag: u64| {
        let r = conn.remote_region(tag).ok_or_else(|| {
            Error::InvalidArgument(
                "the listener advertised no region for this --op: are both sides given the same --op?".into(),
            )
        })?;
        if r.len != len as u64 {
            return Err(Error::InvalidArgument(format!(
                "the listener's region has {} bytes, --bytes says {len}: give both sides the same --bytes",
                r.len
            )));
        }
        Ok(r)
    };
    match args.op {
        Op::Write => {
            let remote = remote_for(TAG_WRITE)?;
            let t0 = Instant::now();
            let mut write = conn.write(region, &remote.whole());
            let mut note = conn.send_inline(&[], Some(DONE));
            write.wait()?;
            let took = t0.elapsed();
            note.wait()?;
            report("write", len as u64, took);
            Ok(true)
        }
        Op::Read => {
            let remote = remote_for(TAG_READ)?;
            let t0 = Instant::now();
            let (_, region) = conn.read(region, &remote.whole()).finish()?;
            report("read", len as u64, t0.elapsed());
            conn.send_inline(&[], Some(DONE)).wait()?;
            Ok(!args.verify || verify(&region))
        }
        Op::Send => {
            let shared = region.share();
            let parts = chunks(len, conn.info().max_message_size);
            let window = (conn.info().send_queue_depth as usize / 2).max(1);
            let mut done = conn.recv_imm();
            let t0 = Instant::now();
            let mut posted: std::collections::VecDeque<Pending<Shared>> = Default::default();
            let mut next = parts.iter();
            loop {
                while posted.len() < window {
                    let Some(r) = next.next() else { break };
                    posted.push_back(conn.send(shared.clone().slice(r.clone())));
                }
                let Some(mut p) = posted.pop_front() else {
                    break;
                };
                p.wait()?;
            }
            report("send", len as u64, t0.elapsed());
            let ack = done.wait()?;
            Ok(ack.imm == Some(DONE))
        }
    }
}
