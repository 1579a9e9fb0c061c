//! GPU to GPU by RDMA WRITE: each side has a buffer on a GPU; the sender
//! fills its buffer on the GPU, writes it into the receiver's GPU buffer and
//! says so with an immediate; the receiver copies its buffer back and checks
//! every page. Each side prints the memory path it used and the bandwidth.
//!
//! ```text
//! gpu_to_gpu                                   # both ends in this process, over loopback
//! gpu_to_gpu --listen 0.0.0.0:7472 --gpu 0     # receiver, on one machine
//! gpu_to_gpu --connect HOST:7472 --gpu 0       # sender, on another
//! gpu_to_gpu --compare                         # the direct path, then the staged path
//! ```
//!
//! `--path auto|dmabuf|peermem|staged` forces a memory path (as does
//! `GPU_RDMA_MEM_PATH`). Without a GPU the buffers are host memory; without
//! an RDMA device the connection runs over TCP and GPU memory is staged
//! through host memory (`GPU_RDMA_TRANSPORT=tcp` forces that). Each side
//! says which memory path and which transport it used, and why.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use gpu_rdma::cuda::{CudaBuffer, CudaDevice};
use gpu_rdma::memory::path::{MemPath, PathPolicy};
use gpu_rdma::units::{format_bytes, parse_bytes};
use gpu_rdma::{Access, ConnectOptions, Connection, Domain, DomainConfig, Error};

#[derive(Parser, Debug, Clone)]
#[command(about = "GPU-to-GPU RDMA write, verified on the GPU side, with the memory path each side used")]
struct Args {
    /// Receive: listen on ADDR.
    #[arg(long, value_name = "ADDR", conflicts_with = "connect")]
    listen: Option<SocketAddr>,
    /// Send: connect to the receiver at ADDR.
    #[arg(long, value_name = "ADDR")]
    connect: Option<SocketAddr>,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Bytes to move, like 64MiB (rounded up to 64 KiB GPU pages).
    #[arg(long, default_value = "64MiB", value_parser = |s: &str| parse_bytes(s).map_err(|e| e.to_string()))]
    bytes: u64,
    /// Memory path: auto, dmabuf, peermem or staged.
    #[arg(long, default_value = "auto")]
    path: String,
    /// Run the direct path and the staged path back to back and print both.
    #[arg(long)]
    compare: bool,
    /// RDMA device (default: GPU_RDMA_DEVICE, else the first with an active port).
    #[arg(long, short = 'd')]
    device: Option<String>,
    /// Seconds to wait for the peer and the transfer.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
}

const TAG: u64 = 0x4750_5532; // "GPU2"
const PAGE: usize = 64 * 1024;

fn page_value(page: usize) -> u32 {
    (page as u32).wrapping_mul(0x9e37_79b1) ^ 0x5bd1_e995
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
            println!("gpu_to_gpu: {reason}");
            ExitCode::from(2)
        }
        Err(e) => {
            println!("gpu_to_gpu: {e}");
            ExitCode::from(1)
        }
    }
}

/// The GPU, or why there is none (then host memory is used).
fn gpu(args: &Args) -> Result<CudaDevice, String> {
    CudaDevice::open(args.gpu).map_err(|e| e.to_string())
}

fn run(args: &Args) -> gpu_rdma::Result<bool> {
    let policy: PathPolicy = match std::env::var("GPU_RDMA_MEM_PATH") {
        Ok(v) if args.path == "auto" => v.parse()?,
        _ => args.path.parse()?,
    };
    let device = gpu(args);
    if let Err(why) = &device {
        println!("gpu_to_gpu: no GPU ({why}); using host memory instead");
    }
    let domain = match (&args.device, &device) {
        (Some(d), _) => Domain::with_config(&DomainConfig::from_env()?.device(d.clone()))?,
        // The RDMA device nearest the GPU, as `gpu-rdma topo` ranks them.
        (None, Ok(_)) => Domain::open_near_gpu(args.gpu)?,
        (None, Err(_)) => Domain::open()?,
    };
    let len = (usize::try_from(args.bytes).unwrap_or(usize::MAX)).div_ceil(PAGE).max(1) * PAGE;
    let timeout = Duration::from_secs(args.timeout);
    let opts = ConnectOptions::default().handshake_timeout(timeout).op_timeout(timeout);

    let policies = if args.compare { vec![PathPolicy::Auto, PathPolicy::Force(MemPath::Staged)] } else { vec![policy] };
    let mut ok = true;
    let mut results = Vec::new();
    for (round, p) in policies.into_iter().enumerate() {
        let port_shift = round as u16;
        let outcome = match (args.listen, args.connect) {
            (Some(addr), _) => receive(&domain, &device, shifted(addr, port_shift), len, p, &opts, timeout),
            (None, Some(addr)) => send(&domain, &device, shifted(addr, port_shift), len, p, &opts, timeout),
            (None, None) => loopback(args, &domain, &device, len, p, &opts, timeout),
        }?;
        ok &= outcome.0;
        results.push(outcome.1);
    }
    if args.compare {
        if let [direct, staged] = &results[..] {
            match (direct, staged) {
                (Some((dp, dbw)), Some((_, sbw))) if dp.is_direct() => {
                    println!("compare: direct ({dp}) {dbw:.3} GB/s, staged {sbw:.3} GB/s: direct is {:.2}x", dbw / sbw)
                }
                (Some((dp, _)), Some((_, sbw))) => println!(
                    "compare: no direct path here (auto chose {dp}); staged {sbw:.3} GB/s. Run `gpu-rdma doctor` to see why."
                ),
                _ => {}
            }
        }
    }
    Ok(ok)
}

fn shifted(mut addr: SocketAddr, by: u16) -> SocketAddr {
    addr.set_port(addr.port().wrapping_add(by));
    addr
}

/// A buffer on the GPU (or host memory without one), registered by `policy`.
enum Buf {
    Gpu(gpu_rdma::Region<CudaBuffer>),
    Host(gpu_rdma::Region),
}

fn alloc(
    domain: &Domain,
    device: &Result<CudaDevice, String>,
    len: usize,
    policy: PathPolicy,
) -> gpu_rdma::Result<Buf> {
    Ok(match device {
        Ok(d) => Buf::Gpu(domain.register_with_path(CudaBuffer::alloc(d, len)?, Access::LOCAL_WRITE, policy)?),
        Err(_) => Buf::Host(domain.alloc(len)?),
    })
}

fn path_line(side: &str, buf: &Buf) -> Option<MemPath> {
    match buf {
        Buf::Gpu(r) => {
            let report = r.path_report()?;
            println!("{side}: GPU memory path {report}");
            Some(report.chosen)
        }
        Buf::Host(_) => {
            println!("{side}: host memory (no GPU)");
            None
        }
    }
}

/// Fills on the GPU (`cuMemsetD32` per page): every 64 KiB page gets its
/// own 32-bit value.
fn fill(buf: &mut Buf) -> gpu_rdma::Result<()> {
    match buf {
        Buf::Gpu(r) => {
            let cuda = r.memory();
            (0..r.len() / PAGE).try_for_each(|page| cuda.fill_u32(page * PAGE, page_value(page), PAGE / 4))
        }
        Buf::Host(r) => {
            for (page, chunk) in r.chunks_mut(PAGE).enumerate() {
                for w in chunk.chunks_mut(4) {
                    w.copy_from_slice(&page_value(page).to_le_bytes()[..w.len()]);
                }
            }
            Ok(())
        }
    }
}

fn check(bytes: &[u8]) -> bool {
    for (page, chunk) in bytes.chunks(PAGE).enumerate() {
        let want = page_value(page).to_le_bytes();
        if let Some(i) = chunk.chunks(4).position(|w| w != &want[..w.len()]) {
            println!("MISMATCH in page {page} at offset {}", page * PAGE + i * 4);
            return false;
        }
    }
    println!("verified: all {} bytes match", bytes.len());
    true
}

type Outcome = (bool, Option<(MemPath, f64)>);

fn report_rx(len: usize, took: Duration, on_gpu: bool) {
    println!(
        "receiver: {} visible {} {:.3} s after connecting = {:.3} GB/s",
        format_bytes(len as u64),
        if on_gpu { "on the GPU" } else { "in host memory (no GPU here)" },
        took.as_secs_f64(),
        len as f64 / took.as_secs_f64() / 1e9
    );
}

fn receive(
    domain: &Domain,
    device: &Result<CudaDevice, String>,
    addr: SocketAddr,
    len: usize,
    policy: PathPolicy,
    opts: &ConnectOptions,
    timeout: Duration,
) -> gpu_rdma::Result<Outcome> {
    let buf = alloc(domain, device, len, policy)?;
    let path = path_line("receiver", &buf);
    let listener = domain.listen(addr)?;
    println!("receiver: listening on {}", listener.local_addr()?);
    let ok = match buf {
        Buf::Gpu(region) => {
            let target = domain.expose(region, Access::REMOTE_WRITE, TAG)?;
            let conn = listener.accept_timeout(&opts.clone().advertise(&target), timeout)?;
            transport_line("receiver", &conn);
            let t0 = Instant::now();
            // The completion includes making the data visible on the GPU
            // (a flush on a direct path, the copy in on the staged path).
            conn.recv_write(&target).wait()?;
            report_rx(len, t0.elapsed(), true);
            let mut back = vec![0u8; len];
            target.cuda().copy_to_host(0, &mut back)?;
            check(&back)
        }
        Buf::Host(region) => {
            let target = domain.expose(region, Access::REMOTE_WRITE, TAG)?;
            let conn = listener.accept_timeout(&opts.clone().advertise(&target), timeout)?;
            transport_line("receiver", &conn);
            let t0 = Instant::now();
            conn.recv_imm().wait()?;
            report_rx(len, t0.elapsed(), false);
            let mut back = vec![0u8; len];
            target.read_at(0, &mut back)?;
            check(&back)
        }
    };
    Ok((ok, path.map(|p| (p, 0.0))))
}

fn transport_line(side: &str, conn: &Connection) {
    let info = conn.info();
    println!("{side}: over {} ({})", info.transport, info.transport_reason);
}

fn send(
    domain: &Domain,
    device: &Result<CudaDevice, String>,
    addr: SocketAddr,
    len: usize,
    policy: PathPolicy,
    opts: &ConnectOptions,
    timeout: Duration,
) -> gpu_rdma::Result<Outcome> {
    let mut buf = alloc(domain, device, len, policy)?;
    let path = path_line("sender", &buf);
    fill(&mut buf)?;
    let deadline = Instant::now() + timeout;
    let conn: Connection = loop {
        match domain.connect(addr, opts) {
            Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused && Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(100));
            }
            other => break other?,
        }
    };
    transport_line("sender", &conn);
    let remote = conn
        .remote_region(TAG)
        .ok_or_else(|| Error::InvalidArgument("the receiver advertised no GPU buffer".into()))?;
    if remote.len != len as u64 {
        return Err(Error::InvalidArgument(format!(
            "the receiver has {} bytes, this side {len}: use the same --bytes",
            remote.len
        )));
    }
    let t0 = Instant::now();
    match buf {
        Buf::Gpu(r) => {
            conn.write(r, &remote.whole()).wait()?;
        }
        Buf::Host(r) => {
            conn.write(r, &remote.whole()).wait()?;
        }
    }
    let took = t0.elapsed();
    conn.send_inline(&[], Some(1)).wait()?;
    let gbps = len as f64 / took.as_secs_f64() / 1e9;
    println!("sender: wrote {} in {:.3} s = {gbps:.3} GB/s", format_bytes(len as u64), took.as_secs_f64());
    Ok((true, path.map(|p| (p, gbps))))
}

fn loopback(
    args: &Args,
    domain: &Domain,
    device: &Result<CudaDevice, String>,
    len: usize,
    policy: PathPolicy,
    opts: &ConnectOptions,
    timeout: Duration,
) -> gpu_rdma::Result<Outcome> {
    let _ = args;
    let listener_domain = domain.clone();
    let dev = device.clone();
    let o = opts.clone();
    let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = probe.local_addr()?;
    drop(probe);
    let rx = thread::spawn(move || receive(&listener_domain, &dev, addr, len, policy, &o, timeout));
    let tx = send(domain, device, addr, len, policy, opts, timeout);
    let rx = rx.join().map_err(|_| Error::InvalidArgument("the receiver thread panicked".into()))??;
    let tx = tx?;
    Ok((tx.0 && rx.0, tx.1))
}
