//! `gpu-rdma bench`: perftest's tests and table, on every path this crate
//! has. Server: `gpu-rdma bench write-bw`; client: `gpu-rdma bench write-bw
//! HOST`. Both sides take the same test, sizes and iteration count.

use std::net::{SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

use gpu_rdma::bench::{self, BwRow, Landing, LatRow, LocalMode, Params, Row, Test};
use gpu_rdma::units::parse_bytes;
use gpu_rdma::{
    ConnectOptions, Connection, Domain, DomainConfig, Error, Exposed, Memory, Region, Result, Shared, TransportPolicy,
};

/// Tags of the advertised regions.
const SERVER_TAG: u64 = 0x6265_6e63_6873_7276; // "benchsrv"
const CLIENT_TAG: u64 = 0x6265_6e63_6863_6c69; // "benchcli"

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// write-bw, read-bw, send-bw, write-lat, read-lat or send-lat (perftest's
    /// names, ib_write_bw and so on, work too).
    #[arg(value_parser = |s: &str| s.parse::<Test>().map_err(|e| e.to_string()))]
    test: Test,
    /// The server to connect to (HOST or HOST:PORT); without it, this side
    /// is the server and waits for a client.
    server: Option<String>,
    /// Port to listen on or connect to.
    #[arg(short = 'p', long, default_value_t = 18515)]
    port: u16,
    /// The server's listening address.
    #[arg(long, default_value = "0.0.0.0")]
    bind: String,
    /// Message size (default as perftest's: 2 bytes for the latency tests,
    /// 65536 for the bandwidth tests).
    #[arg(short = 's', long, value_parser = size_arg)]
    size: Option<usize>,
    /// Every size from 2 bytes to 8 MiB (powers of two).
    #[arg(short = 'a', long)]
    all: bool,
    /// Iterations per size (default 5000 for bandwidth, 1000 for latency).
    #[arg(short = 'n', long)]
    iters: Option<u32>,
    /// RDMA device (default GPU_RDMA_DEVICE, else the first with an active port).
    #[arg(short = 'd', long)]
    device: Option<String>,
    /// GID index (default GPU_RDMA_GID_INDEX, else chosen).
    #[arg(short = 'x', long)]
    gid_index: Option<u32>,
    /// Requests in flight at most (bandwidth tests).
    #[arg(short = 't', long, default_value_t = 128)]
    tx_depth: u32,
    /// Requests per signalled chain (bandwidth tests).
    #[arg(short = 'Q', long, default_value_t = 32)]
    cq_mod: u32,
    /// Pieces per transfer list (list-bw).
    #[arg(long, default_value_t = 1024)]
    list: u32,
    /// Use memory of this CUDA device (as perftest's --use_cuda).
    #[arg(long)]
    gpu: Option<usize>,
    /// GPU memory path: auto, dmabuf, peermem, staged; or host (host memory
    /// even with --gpu).
    #[arg(long, default_value = "auto")]
    mem_path: String,
    /// auto, verbs or tcp (default GPU_RDMA_TRANSPORT, else auto).
    #[arg(long)]
    transport: Option<String>,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    json: bool,
    /// Seconds to wait for the peer and for any one operation.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Sleep on completion events instead of busy-polling (perftest's -e).
    #[arg(short = 'e', long)]
    events: bool,
    /// Accepted for perftest compatibility (gpu-rdma does not read CPU frequency).
    #[arg(short = 'F', long = "CPU-freq")]
    _cpu_freq: bool,
}

fn size_arg(s: &str) -> std::result::Result<usize, String> {
    parse_bytes(s).map(|b| b as usize).map_err(|e| e.to_string())
}

impl BenchArgs {
    fn params(&self) -> Params {
        Params {
            test: self.test,
            sizes: if self.all {
                bench::all_sizes()
            } else {
                vec![self.size.unwrap_or(if self.test.is_bw() { 65536 } else { 2 })]
            },
            iters: self.iters.unwrap_or(self.test.default_iters()),
            tx_depth: self.tx_depth,
            cq_mod: self.cq_mod,
            list: self.list,
        }
    }

    fn domain(&self) -> Result<Domain> {
        let mut config = DomainConfig::from_env()?;
        if let Some(d) = &self.device {
            config = config.device(d.clone());
        }
        if let Some(x) = self.gid_index {
            config = config.gid_index(x);
        }
        if let Some(t) = &self.transport {
            config = config.transport(t.parse::<TransportPolicy>()?);
        }
        Domain::with_config(&config)
    }

    fn options(&self) -> ConnectOptions {
        // Busy-poll like perftest, except on a server that only waits for the
        // end of a one-sided test: it would take a CPU from the device.
        let passive =
            self.server.is_none() && matches!(self.test, Test::WriteBw | Test::ReadBw | Test::ReadLat | Test::ListBw);
        let timeout = Duration::from_secs(self.timeout);
        ConnectOptions::default()
            .op_timeout(timeout)
            .handshake_timeout(timeout)
            .queue_depth(self.tx_depth.max(1), 512)
            .spin(if passive || self.events { Duration::ZERO } else { timeout })
    }
}

/// What a run reports besides its rows.
struct Setup {
    memory: String,
    mode: LocalMode,
    /// Staged GPU memory: the staging slots pinned ahead, `(bytes each, how many)`.
    reserved: Option<(usize, usize)>,
}

pub fn run(args: &BenchArgs) -> ExitCode {
    match run_inner(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu-rdma bench: {e}");
            ExitCode::from(if matches!(e, Error::NoDevice { .. } | Error::CudaUnavailable { .. }) { 2 } else { 1 })
        }
    }
}

fn run_inner(args: &BenchArgs) -> Result<()> {
    let params = args.params();
    params.validate()?;
    let domain = args.domain()?;
    // Three times the largest message (at least a page each, so that the
    // region is never empty): a ping-pong's sends and receives use separate
    // ranges, as perftest's do, and the client's two receive slots are apart.
    let len = 3 * params.max_size().max(4096);
    let host = args.gpu.is_none() || args.mem_path == "host";
    if host {
        if args.mem_path != "auto" && args.mem_path != "host" {
            return Err(Error::InvalidArgument(format!("--mem-path {} needs --gpu", args.mem_path)));
        }
        let region = domain.alloc(len)?;
        let setup = Setup { memory: "host memory".into(), mode: LocalMode::HOST, reserved: None };
        return side(args, &params, &domain, region, setup);
    }
    gpu_side(args, &params, &domain, len)
}

#[cfg(feature = "cuda")]
fn gpu_side(args: &BenchArgs, params: &Params, domain: &Domain, len: usize) -> Result<()> {
    use gpu_rdma::cuda::{CudaBuffer, CudaDevice};
    use gpu_rdma::memory::path::PathPolicy;

    let ordinal = args.gpu.unwrap_or(0);
    let policy: PathPolicy = args.mem_path.parse()?;
    let device = CudaDevice::open(ordinal)?;
    let buf = CudaBuffer::alloc(&device, len)?;
    let region = domain.register_with_path(buf, gpu_rdma::Access::LOCAL_WRITE, policy).map_err(|e| e.error)?;
    let report = region.path_report().map(ToString::to_string).unwrap_or_default();
    let direct = region.path_report().is_some_and(|r| r.chosen.is_direct());
    // Staged: the slots the loops hold at once are pinned now, as perftest
    // registers all its memory before it starts the clock.
    let reserved = if direct {
        None
    } else {
        let opts = args.options();
        let (each, count) = params.staging_slots(opts.staging_chunk, opts.staging_depth);
        domain.reserve_staging(&device, each, count)?;
        Some((each, count))
    };
    let setup = Setup {
        memory: format!("GPU {ordinal} memory, path {report}"),
        mode: LocalMode { batch: direct, inline: false },
        reserved,
    };
    side(args, params, domain, region, setup)
}

#[cfg(not(feature = "cuda"))]
fn gpu_side(_args: &BenchArgs, _params: &Params, _domain: &Domain, _len: usize) -> Result<()> {
    Err(Error::FeatureDisabled { feature: "cuda" })
}

fn side<M: Memory>(args: &BenchArgs, params: &Params, domain: &Domain, region: Region<M>, setup: Setup) -> Result<()>
where
    Exposed<M>: Landing,
    Shared<M>: Landing,
{
    let timeout = Duration::from_secs(args.timeout);
    let (access, tag) = match &args.server {
        None => (params.test.server_access(), SERVER_TAG),
        Some(_) => (params.test.client_access(), CLIENT_TAG),
    };
    // Exposed only with the rights the test needs; else shared, not exposed.
    let (exposed, shared) = if access.is_empty() {
        (None, Some(region.share()))
    } else {
        (Some(domain.expose(region, access, tag).map_err(|e| e.error)?), None)
    };
    let mut opts = args.options();
    if params.test.is_bw() && domain.info().transport == gpu_rdma::Transport::Tcp {
        // Over TCP a bandwidth test's waiter sleeps: the connection's own
        // threads move the bytes, and a spinning waiter takes their CPU.
        opts = opts.spin(Duration::ZERO);
    }
    if let Some(e) = &exposed {
        opts = opts.advertise(e);
    }
    let conn = match &args.server {
        None => {
            let listener = domain.listen((args.bind.as_str(), args.port))?;
            if !args.json {
                println!(
                    "\n************************************\n* Waiting for client to connect... *\n************************************"
                );
            }
            listener.accept_timeout(&opts, timeout)?
        }
        Some(server) => {
            let addr = server_addr(server, args.port)?;
            domain.connect(addr, &opts).map_err(|e| match e {
                // As perftest: the client fails at once; say what to do.
                Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => Error::Io(std::io::Error::new(
                    io.kind(),
                    format!(
                        "no bench server at {addr}: start `gpu-rdma bench {}` (no address) on that machine first",
                        args.test.name()
                    ),
                )),
                other => other,
            })?
        }
    };
    let banner = banner(args, params, domain, &conn, &setup);
    let mode = setup.mode;
    let pinned_before = slots_pinned(domain);
    let rows = match (&args.server, &exposed, &shared) {
        (None, Some(e), _) => serve(&conn, params, e, mode, timeout),
        (None, None, Some(s)) => serve(&conn, params, s, mode, timeout),
        (Some(_), Some(e), _) => drive(args, &conn, params, e, mode, timeout, &banner),
        (Some(_), None, Some(s)) => drive(args, &conn, params, s, mode, timeout, &banner),
        _ => unreachable!("the region is exposed or shared"),
    }?;
    // Pinning on the hot path would be measured as the path's own cost: say so.
    let pinned_in_loops = slots_pinned(domain).zip(pinned_before).map(|(after, before)| after - before);
    if let (Some(n), Some(_), false) = (pinned_in_loops, setup.reserved, args.json) {
        println!(" staging: {n} slot(s) pinned during the test, after those pinned ahead");
    }
    if args.server.is_none() && !args.json {
        println!("{banner}");
        println!("{}", "-".repeat(87));
        println!(" the client measured {} size(s); its table is on the client", params.sizes.len());
        println!("{}", "-".repeat(87));
    }
    if args.json {
        let doc = serde_json::json!({
            "tool": "gpu-rdma bench",
            "role": if args.server.is_some() { "client" } else { "server" },
            "test": params.test.name(),
            "perftest": params.test.perftest(),
            "iterations": params.iters,
            "transport": conn.info().transport,
            "transport_reason": conn.info().transport_reason,
            "device": domain.info().device,
            "memory": setup.memory,
            "staging": setup.reserved.map(|(each, count)| serde_json::json!({
                "reserved_slots": count,
                "slot_bytes": each,
                "pinned_during_test": pinned_in_loops,
            })),
            "units": { "bandwidth": "MiB/s", "latency": "usec" },
            "rows": rows,
        });
        println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
    }
    Ok(())
}

fn server_addr(server: &str, port: u16) -> Result<SocketAddr> {
    let with_port = if server.parse::<SocketAddr>().is_ok()
        || server.rsplit_once(':').is_some_and(|(h, p)| !h.contains(':') && p.parse::<u16>().is_ok())
    {
        server.to_owned()
    } else {
        format!("{server}:{port}")
    };
    with_port
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| Error::InvalidArgument(format!("`{server}` resolves to no address")))
}

/// Staging slots the domain has pinned so far (staged GPU memory).
#[cfg(feature = "cuda")]
fn slots_pinned(domain: &Domain) -> Option<u64> {
    Some(domain.staging_stats().slots_pinned)
}

#[cfg(not(feature = "cuda"))]
fn slots_pinned(_domain: &Domain) -> Option<u64> {
    None
}

/// The header: perftest's title, then one line naming the path and the transport.
fn banner(args: &BenchArgs, params: &Params, domain: &Domain, conn: &Connection, setup: &Setup) -> String {
    let memory = &setup.memory;
    let title = match params.test {
        Test::WriteBw => "RDMA_Write BW Test",
        Test::ListBw => "RDMA_Write transfer-list BW Test",
        Test::ReadBw => "RDMA_Read BW Test",
        Test::SendBw => "Send BW Test",
        Test::WriteLat => "RDMA_Write (with immediate) Latency Test",
        Test::ReadLat => "RDMA_Read Latency Test",
        Test::SendLat => "Send Latency Test",
    };
    let d = domain.info();
    let i = conn.info();
    let device = if i.transport == "verbs" {
        format!("{} port {} ({}, MTU {}, GID index {})", d.device, d.port, d.link_layer, i.mtu, d.gid_index)
    } else {
        "none".into()
    };
    let mut s = format!("{}\n{:>20}{title}   (gpu-rdma bench)\n", "-".repeat(87), "");
    s.push_str(&format!(
        " path: transport {} ({}); device {device}; memory: {memory}\n",
        i.transport, i.transport_reason
    ));
    if params.test.is_bw() {
        s.push_str(&format!(
            " TX depth        : {}\n CQ Moderation   : {}\n",
            args.tx_depth.min(i.send_queue_depth),
            args.cq_mod
        ));
    }
    if let Some((each, count)) = setup.reserved {
        s.push_str(&format!(
            " Staging slots   : {count} of {} pinned ahead\n",
            gpu_rdma::units::format_bytes(each as u64)
        ));
    }
    if matches!(params.test, Test::ReadBw | Test::ReadLat) {
        s.push_str(&format!(" Outstand reads  : {}\n", i.reads_in_flight));
    }
    s.push_str(&format!(
        " Max inline data : {}[B]\n Iterations      : {}\n{}",
        i.max_inline,
        params.iters,
        "-".repeat(87)
    ));
    s
}

fn serve<B: Landing>(
    conn: &Connection,
    params: &Params,
    local: &B,
    mode: LocalMode,
    timeout: Duration,
) -> Result<Vec<Row>> {
    let client = conn.remote_region(CLIENT_TAG);
    bench::run_server(conn, params, local, mode, client.as_ref(), timeout)?;
    Ok(Vec::new())
}

fn drive<B: Landing>(
    args: &BenchArgs,
    conn: &Connection,
    params: &Params,
    local: &B,
    mode: LocalMode,
    timeout: Duration,
    banner: &str,
) -> Result<Vec<Row>> {
    let remote = conn.remote_region(SERVER_TAG);
    if !args.json {
        println!("{banner}");
        println!("{}", if params.test.is_bw() { BwRow::HEADER } else { LatRow::HEADER });
    }
    let rows = bench::run_client(conn, params, local, mode, remote.as_ref(), timeout, |row| {
        if !args.json {
            println!("{row}");
        }
    })?;
    if !args.json {
        println!("{}", "-".repeat(87));
    }
    Ok(rows)
}
