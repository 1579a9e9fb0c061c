//! Moves a buffer by write, read and send, verifies every byte, and prints
//! the bandwidth.
//!
//! With no arguments it runs both ends in this process over loopback, on
//! the best path that exists (verbs or TCP; GPU or host memory), says which
//! and why, and runs write, read and send of `--bytes` (default 256 MiB)
//! with a progress bar. It works on any machine.
//!
//! Between two processes (one or two hosts), one operation at a time:
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
    /// Without --listen or --connect both ends run in this process.
    #[arg(long, value_name = "ADDR", conflicts_with = "connect")]
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
    /// Fill the source with a pattern and check every byte at the receiver
    /// (always on when both ends run in this process).
    #[arg(long)]
    verify: bool,
    /// Use host memory even where a GPU exists (both ends in this process).
    #[arg(long)]
    host: bool,
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
            eprintln!("transfer: verbs was asked for; without it, leave GPU_RDMA_TRANSPORT unset to use TCP.");
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
    if args.listen.is_none() && args.connect.is_none() {
        return loopback::run(&domain, len, args.host, Duration::from_secs(args.timeout));
    }
    let timeout = Duration::from_secs(args.timeout);
    let opts = ConnectOptions::default().handshake_timeout(timeout).op_timeout(timeout).queue_depth(256, 256);
    let role = if args.listen.is_some() { "listener" } else { "client" };
    println!("transfer ({role}): {:?} of {} over {}", args.op, format_bytes(args.bytes), domain.info());
    match (args.listen, args.connect) {
        (Some(addr), _) => listener(&domain, addr, args, len, opts),
        (None, Some(addr)) => client(&domain, addr, args, len, opts),
        (None, None) => unreachable!("handled above"),
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
    // The listener may still be starting: retry a refused connection until
    // the timeout, saying so once.
    let deadline = Instant::now() + timeout;
    let mut said = false;
    loop {
        match domain.connect(addr, opts) {
            Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                if Instant::now() >= deadline {
                    return Err(Error::Io(std::io::Error::new(
                        e.kind(),
                        format!(
                            "no server at {addr} after {} s: start one there first (transfer --listen {addr}), \
                             or check the address, the port and any firewall",
                            timeout.as_secs()
                        ),
                    )));
                }
                if !said {
                    println!(
                        "no server at {addr} yet; retrying for {} s (start the other side with --listen)",
                        timeout.as_secs()
                    );
                    said = true;
                }
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
    let info = conn.info();
    if info.transport == "verbs" {
        println!(
            "connected: queue pair {:#x} -> {:#x}, MTU {}, max message {}",
            info.local_qp_num,
            info.remote_qp_num,
            info.mtu,
            format_bytes(info.max_message_size)
        );
    } else {
        println!("connected over {} to {addr}, max message {}", info.transport, format_bytes(info.max_message_size));
    }
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

/// Both ends in this process: the best path there is, write, read and send,
/// verified, with a progress bar.
mod loopback {
    use std::time::{Duration, Instant};

    use gpu_rdma::units::format_bytes;
    use gpu_rdma::{
        Access, ConnectOptions, Connection, Domain, Exposed, HostMemory, LocalBuffer, Memory, Pending, Shared,
    };
    use indicatif::{ProgressBar, ProgressStyle};

    /// How to get bytes in and out of a kind of memory.
    trait Mem: Memory + Sized {
        fn alloc(domain: &Domain, len: usize) -> gpu_rdma::Result<gpu_rdma::Region<Self>>;
        fn put(s: &Shared<Self>, data: &[u8]) -> gpu_rdma::Result<()>;
        fn get(s: &Shared<Self>, len: usize) -> gpu_rdma::Result<Vec<u8>>;
        fn get_exposed(e: &Exposed<Self>, len: usize) -> gpu_rdma::Result<Vec<u8>>;
        /// The receive for the writer's "done" (GPU: it also makes the data visible to CUDA).
        fn done_receive(conn: &Connection, e: &Exposed<Self>) -> Pending<()>;
        /// Before the peer reads.
        fn publish(e: &Exposed<Self>) -> gpu_rdma::Result<()>;
    }

    impl Mem for HostMemory {
        fn alloc(domain: &Domain, len: usize) -> gpu_rdma::Result<gpu_rdma::Region<Self>> {
            domain.alloc(len)
        }
        fn put(s: &Shared<Self>, data: &[u8]) -> gpu_rdma::Result<()> {
            s.write_at(0, data)
        }
        fn get(s: &Shared<Self>, len: usize) -> gpu_rdma::Result<Vec<u8>> {
            let mut v = vec![0u8; len];
            s.read_at(0, &mut v)?;
            Ok(v)
        }
        fn get_exposed(e: &Exposed<Self>, len: usize) -> gpu_rdma::Result<Vec<u8>> {
            let mut v = vec![0u8; len];
            e.read_at(0, &mut v)?;
            Ok(v)
        }
        fn done_receive(conn: &Connection, _: &Exposed<Self>) -> Pending<()> {
            conn.recv_imm()
        }
        fn publish(_: &Exposed<Self>) -> gpu_rdma::Result<()> {
            Ok(())
        }
    }

    impl Mem for gpu_rdma::cuda::CudaBuffer {
        fn alloc(domain: &Domain, len: usize) -> gpu_rdma::Result<gpu_rdma::Region<Self>> {
            let buf = gpu_rdma::cuda::CudaBuffer::alloc(&gpu_rdma::cuda::CudaDevice::open(0)?, len)?;
            Ok(domain.register(buf, Access::LOCAL)?)
        }
        fn put(s: &Shared<Self>, data: &[u8]) -> gpu_rdma::Result<()> {
            s.cuda().copy_from_host(0, data)
        }
        fn get(s: &Shared<Self>, len: usize) -> gpu_rdma::Result<Vec<u8>> {
            let mut v = vec![0u8; len];
            s.cuda().copy_to_host(0, &mut v)?;
            Ok(v)
        }
        fn get_exposed(e: &Exposed<Self>, len: usize) -> gpu_rdma::Result<Vec<u8>> {
            let mut v = vec![0u8; len];
            e.cuda().copy_to_host(0, &mut v)?;
            Ok(v)
        }
        fn done_receive(conn: &Connection, e: &Exposed<Self>) -> Pending<()> {
            conn.recv_write(e)
        }
        fn publish(e: &Exposed<Self>) -> gpu_rdma::Result<()> {
            e.publish()
        }
    }

    pub(super) fn run(domain: &Domain, len: usize, host_only: bool, timeout: Duration) -> gpu_rdma::Result<bool> {
        let gpu = if host_only {
            Err("--host was given".to_owned())
        } else {
            gpu_rdma::cuda::CudaDevice::open(0).map(|d| d.name().to_owned()).map_err(|e| e.to_string())
        };
        println!("transfer: {} between two endpoints in this process, over loopback", format_bytes(len as u64));
        match gpu {
            Ok(name) => {
                ops::<gpu_rdma::cuda::CudaBuffer>(domain, len, (&format!("GPU memory ({name})"), None), timeout)
            }
            Err(why) => ops::<HostMemory>(domain, len, ("host memory", Some(&format!("no GPU: {why}"))), timeout),
        }
    }

    fn pattern(len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        super::fill(&mut v);
        v
    }

    fn check(what: &str, got: &[u8], want: &[u8]) -> bool {
        if got == want {
            return true;
        }
        match got.iter().zip(want).position(|(a, b)| a != b) {
            None if got.len() == want.len() => true,
            Some(i) => {
                println!("{what}: MISMATCH at offset {i}: expected {:#04x}, found {:#04x}", want[i], got[i]);
                false
            }
            None => {
                println!("{what}: {} bytes arrived, {} expected", got.len(), want.len());
                false
            }
        }
    }

    fn progress(what: &str, len: usize) -> ProgressBar {
        let bar = ProgressBar::new(len as u64);
        bar.set_style(
            ProgressStyle::with_template("{msg:>5} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_message(what.to_owned());
        bar
    }

    fn report(what: &str, len: usize, took: Duration, ok: bool) {
        println!(
            "{what}: {len} bytes in {:.3} s = {:.3} GB/s, {}",
            took.as_secs_f64(),
            len as f64 / took.as_secs_f64() / 1e9,
            if ok { "verified" } else { "NOT verified" }
        );
    }

    /// Runs `post` for each chunk with a few in flight, advancing the bar.
    fn chunked<B: Send + 'static>(
        len: usize,
        chunk: usize,
        bar: &ProgressBar,
        mut post: impl FnMut(std::ops::Range<usize>) -> Pending<B>,
    ) -> gpu_rdma::Result<()> {
        let mut window: std::collections::VecDeque<(usize, Pending<B>)> = Default::default();
        let mut next = 0;
        while next < len || !window.is_empty() {
            while next < len && window.len() < 8 {
                let end = (next + chunk).min(len);
                window.push_back((end - next, post(next..end)));
                next = end;
            }
            if let Some((n, mut p)) = window.pop_front() {
                p.wait()?;
                bar.inc(n as u64);
            }
        }
        Ok(())
    }

    /// `memory`: what it moves, and why not GPU memory where it is not.
    fn ops<M: Mem>(
        domain: &Domain,
        len: usize,
        memory: (&str, Option<&str>),
        timeout: Duration,
    ) -> gpu_rdma::Result<bool> {
        let opts = ConnectOptions::default().handshake_timeout(timeout).op_timeout(timeout);
        let target = domain.expose(M::alloc(domain, len)?, Access::REMOTE_WRITE | Access::REMOTE_READ, 1)?;
        let listener = domain.listen("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let server_opts = opts.clone().advertise(&target);
        let accept = std::thread::spawn(move || listener.accept_timeout(&server_opts, timeout));
        let client = domain.connect(addr, &opts)?;
        let server = accept.join().map_err(|_| gpu_rdma::Error::InvalidArgument("accept panicked".into()))??;
        let info = client.info();
        // One short line first; the reasons, which can be long, after it.
        let (short, _) = info.transport_reason.split_once(':').unwrap_or((&info.transport_reason, ""));
        println!("path: {} ({short}), {}", info.transport, memory.0);
        if short.len() < info.transport_reason.len() {
            println!("  why {}: {}", info.transport, info.transport_reason);
        }
        if let Some(why) = memory.1 {
            println!("  why {}: {why}", memory.0);
        }
        if info.transport == "verbs" {
            println!("      {}", domain.info());
        }
        let remote = client.remote_region(1).expect("advertised");
        let chunk = (info.max_message_size as usize).min(8 << 20);
        let data = pattern(len);
        let src = M::alloc(domain, len)?.share();
        M::put(&src, &data)?;
        let mut all = true;

        // Write, then tell the owner: it checks its memory.
        let mut done = M::done_receive(&server, &target);
        let bar = progress("write", len);
        let t0 = Instant::now();
        chunked(len, chunk, &bar, |r| {
            let remote = remote.slice(r.start as u64..r.end as u64).expect("in bounds");
            client.write(src.clone().slice(r), &remote)
        })?;
        let took = t0.elapsed();
        bar.finish_and_clear();
        client.send_inline(&[], Some(1)).wait()?;
        done.wait()?;
        let ok = check("write", &M::get_exposed(&target, len)?, &data);
        report("write", len, took, ok);
        all &= ok;

        // Read it back.
        M::publish(&target)?;
        let dst = M::alloc(domain, len)?.share();
        let bar = progress("read", len);
        let t0 = Instant::now();
        chunked(len, chunk, &bar, |r| {
            let remote = remote.slice(r.start as u64..r.end as u64).expect("in bounds");
            client.read(dst.clone().slice(r), &remote)
        })?;
        let took = t0.elapsed();
        bar.finish_and_clear();
        let ok = check("read", &M::get(&dst, len)?, &data);
        report("read", len, took, ok);
        all &= ok;

        // Send, into receives posted for each chunk.
        let rbuf = M::alloc(domain, len)?.share();
        let mut receives: Vec<Pending<Shared<M>>> =
            (0..len).step_by(chunk).map(|o| server.recv(rbuf.clone().slice(o..(o + chunk).min(len)))).collect();
        let bar = progress("send", len);
        let t0 = Instant::now();
        chunked(len, chunk, &bar, |r| client.send(src.clone().slice(r)))?;
        for p in &mut receives {
            p.wait()?;
        }
        let took = t0.elapsed();
        bar.finish_and_clear();
        drop(receives);
        let ok = check("send", &M::get(&rbuf, len)?, &data);
        report("send", len, took, ok);
        all &= ok;
        Ok(all)
    }
}
