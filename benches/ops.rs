//! Bandwidth and latency of every operation, per transport and memory path
//! that exists on this machine; what does not exist is skipped with the
//! reason printed. The loops are `gpu_rdma::bench`'s, the ones behind
//! `gpu-rdma bench`.
//!
//! - `bandwidth/<transport>/<memory>`: write, read and send, 4 KiB to 1 MiB,
//!   128 in flight in signalled chains of 32 (`Throughput::Bytes`); and
//!   `list`: writes in transfer lists of 1,024 pieces (the engine's path).
//! - `latency/<transport>/<memory>`: send and write-with-immediate
//!   ping-pong (time per iteration is one way, half the round trip, as
//!   perftest reports it) and one read at a time (the whole read).
//!
//! - `register/<transport>`: registering 4 KiB of host memory inside a
//!   declared arena and dropping it, served from the arena (`arena-hit`)
//!   and with the cache off (`no-cache`: a registration of its own, on
//!   verbs an `ibv_reg_mr` and `ibv_dereg_mr`); with a CUDA device and a
//!   NIC, also 4 KiB sub-ranges of a GPU block (`gpu-hit`, `gpu-no-cache`).
//!
//! Plain `cargo bench` measures TCP with host memory (and GPU memory when a
//! CUDA driver is there); `cargo xtask bench` runs the same binary on rxe0
//! in the soft-RoCE guest, where verbs exists too.

use std::thread;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpu_rdma::bench::{self, Landing, LocalMode, Params, Test};
use gpu_rdma::{
    Access, ConnectOptions, Connection, Domain, DomainConfig, Exposed, Memory, Region, RemoteRegion, TransportPolicy,
};

const TIMEOUT: Duration = Duration::from_secs(120);
const BW_SIZES: [usize; 4] = [4 << 10, 64 << 10, 256 << 10, 1 << 20];
const LAT_SIZES: [usize; 3] = [8, 4 << 10, 64 << 10];
const LEN: usize = 1 << 20;
const SERVER: u64 = 1;
const CLIENT: u64 = 2;

/// Two connected ends in this process, each with a region the other may
/// write and read.
struct Rig<M: Memory> {
    name: String,
    server: Connection,
    client: Connection,
    server_mem: Exposed<M>,
    client_mem: Exposed<M>,
    remote: RemoteRegion,
    mode: LocalMode,
}

fn rig<M: Memory>(name: String, d: &Domain, regions: [Region<M>; 2], mode: LocalMode) -> gpu_rdma::Result<Rig<M>> {
    let rights = Access::REMOTE_WRITE | Access::REMOTE_READ;
    let [a, b] = regions;
    let server_mem = d.expose(a, rights, SERVER).map_err(|e| e.error)?;
    let client_mem = d.expose(b, rights, CLIENT).map_err(|e| e.error)?;
    let opts = |e: &Exposed<M>| ConnectOptions::default().advertise(e).spin(TIMEOUT).queue_depth(128, 512);
    let listener = d.listen("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server_opts = opts(&server_mem);
    let server = thread::scope(|s| {
        let h = s.spawn(|| listener.accept_timeout(&server_opts, TIMEOUT));
        let client = d.connect(addr, &opts(&client_mem));
        h.join().expect("the accepting thread").and_then(|server| Ok((server, client?)))
    })?;
    let (server, client) = server;
    let remote = client.remote_region(SERVER).expect("advertised");
    Ok(Rig { name, server, client, server_mem, client_mem, remote, mode })
}

fn params(test: Test, iters: u64) -> Params {
    Params {
        test,
        sizes: vec![LEN],
        iters: iters.clamp(1, u64::from(u32::MAX)) as u32,
        tx_depth: 128,
        cq_mod: 32,
        list: 1024,
    }
}

/// Runs `body` on the client while the server serves `test`, then ends the
/// test; returns what `body` measured.
fn with_server<M: Memory>(r: &Rig<M>, test: Test, body: impl FnOnce() -> Duration) -> Duration
where
    Exposed<M>: Landing,
{
    let client_region = r.server.remote_region(CLIENT);
    thread::scope(|s| {
        let server = s.spawn(|| {
            bench::serve(&r.server, test, &r.server_mem, r.mode, client_region.as_ref(), TIMEOUT, |_| Ok(()))
        });
        let took = body();
        bench::finish(&r.client, TIMEOUT).expect("end of test");
        server.join().expect("the serving thread").expect("the server side");
        took
    })
}

fn bandwidth<M: Memory>(c: &mut Criterion, r: &Rig<M>)
where
    Exposed<M>: Landing,
{
    let mut g = c.benchmark_group(format!("bandwidth/{}", r.name));
    for test in [Test::WriteBw, Test::ReadBw, Test::SendBw, Test::ListBw] {
        for size in BW_SIZES {
            g.throughput(Throughput::Bytes(size as u64));
            let id = BenchmarkId::new(test.name().trim_end_matches("-bw"), size);
            g.bench_function(id, |b| {
                b.iter_custom(|n| {
                    let run = || {
                        let t0 = Instant::now();
                        bench::bandwidth(
                            &r.client,
                            test,
                            &r.client_mem,
                            r.mode,
                            Some(&r.remote),
                            size,
                            &params(test, n),
                            TIMEOUT,
                        )
                        .expect("the bandwidth loop");
                        t0.elapsed()
                    };
                    if test == Test::SendBw { with_server(r, test, run) } else { run() }
                })
            });
        }
    }
    g.finish();
}

fn latency<M: Memory>(c: &mut Criterion, r: &Rig<M>)
where
    Exposed<M>: Landing,
{
    let mut g = c.benchmark_group(format!("latency/{}", r.name));
    for test in [Test::SendLat, Test::WriteLat, Test::ReadLat] {
        for size in LAT_SIZES {
            let id = BenchmarkId::new(test.name().trim_end_matches("-lat"), size);
            g.bench_function(id, |b| {
                b.iter_custom(|n| {
                    let run = || {
                        let row = bench::latency(
                            &r.client,
                            test,
                            &r.client_mem,
                            r.mode,
                            Some(&r.remote),
                            size,
                            &params(test, n),
                            TIMEOUT,
                        )
                        .expect("the latency loop");
                        // One way for the ping-pongs, the whole read for reads.
                        Duration::from_secs_f64(row.t_avg * row.iterations as f64 / 1e6)
                    };
                    if test == Test::ReadLat { run() } else { with_server(r, test, run) }
                })
            });
        }
    }
    g.finish();
}

fn each_rig(c: &mut Criterion) {
    let mut ran = 0;
    for policy in [TransportPolicy::Tcp, TransportPolicy::Verbs] {
        let d = match DomainConfig::from_env().and_then(|cfg| Domain::with_config(&cfg.transport(policy))) {
            Ok(d) => d,
            Err(e) => {
                println!("skipping {policy}: {e}");
                continue;
            }
        };
        let host = || d.alloc(LEN);
        match host().and_then(|a| Ok([a, host()?])) {
            Ok(regions) => match rig(format!("{policy}/host"), &d, regions, LocalMode::HOST) {
                Ok(r) => {
                    bandwidth(c, &r);
                    latency(c, &r);
                    ran += 1;
                }
                Err(e) => println!("skipping {policy}/host: {e}"),
            },
            Err(e) => println!("skipping {policy}/host: {e}"),
        }
        ran += gpu(c, &d, policy);
    }
    assert!(ran > 0, "no transport could run: nothing was measured");
}

#[cfg(feature = "cuda")]
fn gpu(c: &mut Criterion, d: &Domain, policy: TransportPolicy) -> usize {
    use gpu_rdma::cuda::{CudaBuffer, CudaDevice};
    use gpu_rdma::memory::path::{MemPath, PathPolicy};

    let dev = match CudaDevice::open(0) {
        Ok(dev) => dev,
        Err(e) => {
            println!("skipping {policy}/gpu: {e}");
            return 0;
        }
    };
    let mut ran = 0;
    for (label, path) in [("gpu-direct", PathPolicy::Auto), ("gpu-staged", PathPolicy::Force(MemPath::Staged))] {
        let region = || -> gpu_rdma::Result<Region<CudaBuffer>> {
            let buf = CudaBuffer::alloc(&dev, LEN)?;
            d.register_with_path(buf, Access::LOCAL_WRITE, path).map_err(|e| e.error)
        };
        let regions = match region().and_then(|a| Ok([a, region()?])) {
            Ok(r) => r,
            Err(e) => {
                println!("skipping {policy}/{label}: {e}");
                continue;
            }
        };
        let direct = regions[0].path_report().is_some_and(|p| p.chosen.is_direct());
        if label == "gpu-direct" && !direct {
            println!(
                "skipping {policy}/{label}: {}",
                regions[0].path_report().map_or("no direct path".into(), |p| p.to_string())
            );
            continue;
        }
        match rig(format!("{policy}/{label}"), d, regions, LocalMode { batch: direct, inline: false }) {
            Ok(r) => {
                bandwidth(c, &r);
                latency(c, &r);
                ran += 1;
            }
            Err(e) => println!("skipping {policy}/{label}: {e}"),
        }
    }
    ran
}

#[cfg(not(feature = "cuda"))]
fn gpu(_c: &mut Criterion, _d: &Domain, policy: TransportPolicy) -> usize {
    println!("skipping {policy}/gpu: built without the cuda feature");
    0
}

/// Registration with and without the cache, host memory.
fn registration(c: &mut Criterion) {
    for policy in [TransportPolicy::Tcp, TransportPolicy::Verbs] {
        let d = match DomainConfig::from_env().and_then(|cfg| Domain::with_config(&cfg.transport(policy))) {
            Ok(d) => d,
            Err(e) => {
                println!("skipping register/{policy}: {e}");
                continue;
            }
        };
        let arena = d.declare_host_arena(gpu_rdma::HostMemory::new(64 << 20).expect("64 MiB")).expect("an arena");
        let mut g = c.benchmark_group(format!("register/{policy}"));
        for (label, cache) in [("arena-hit", 1 << 30), ("no-cache", 0)] {
            d.set_registration_cache(cache);
            let mut at = 0;
            g.bench_function(label, |b| {
                b.iter(|| {
                    // A different 4 KiB each time, as a framework's tensors come.
                    at = (at + 4096) % (64 << 20);
                    let view = arena.view(at, 4096).expect("in bounds");
                    drop(d.register(view, Access::LOCAL).expect("registered"));
                })
            });
        }
        gpu_registration(&mut g, &d);
        g.finish();
        println!("register/{policy}: {:?}", d.registration_cache_stats());
    }
}

/// GPU sub-ranges of one 64 MiB block on a direct path (forced nvidia-peermem,
/// so the CUDA stand-in serves on rxe0), with and without the cache.
#[cfg(feature = "cuda")]
fn gpu_registration(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, d: &Domain) {
    use gpu_rdma::cuda::{CudaBuffer, CudaDevice};
    use gpu_rdma::memory::path::{MemPath, PathPolicy};
    use std::sync::Arc;
    let Ok(dev) = CudaDevice::open(0) else {
        return println!("skipping register/gpu: no CUDA device");
    };
    let block = Arc::new(CudaBuffer::alloc(&dev, 64 << 20).expect("a 64 MiB block"));
    let sub = |at: u64| {
        let keep = Arc::clone(&block);
        // SAFETY: inside the block, which `keep` keeps allocated while the wrapper lives.
        let buf = unsafe { CudaBuffer::from_raw(&dev, block.device_ptr() + at, 4096, Box::new(keep)) };
        d.register_with_path(buf.expect("a sub-range"), Access::LOCAL, PathPolicy::Force(MemPath::PeerMem))
            .map_err(|e| e.error)
    };
    if let Err(e) = sub(0) {
        return println!("skipping register/gpu: {e}");
    }
    for (label, cache) in [("gpu-hit", 1 << 30), ("gpu-no-cache", 0)] {
        d.set_registration_cache(cache);
        let mut at = 0;
        g.bench_function(label, |b| {
            b.iter(|| {
                at = (at + 4096) % (64 << 20);
                drop(sub(at).expect("registered"));
            })
        });
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_registration(_: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, _: &Domain) {}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = registration, each_rig
}
criterion_main!(benches);
