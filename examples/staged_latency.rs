//! The round trip of a small message from staged GPU memory, waited for
//! and awaited: one process, over loopback TCP (where GPU memory is always
//! staged through pinned host memory), against an echo in host memory on
//! a second connection end. It measures what the library adds to a staged
//! message: the copy out of the GPU, the copy into it, and how soon a
//! waiting or awaiting thread notices each. Needs a CUDA device: a GPU, or
//! the test stand-in (`cargo xtask gpu-check` runs it on a GPU).
//!
//! ```text
//! staged_latency                 # 4 KiB, 1000 round trips each way
//! staged_latency 65536 200       # size in bytes, round trips
//! ```

use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpu_rdma::cuda::{CudaBuffer, CudaDevice};
use gpu_rdma::memory::path::PathPolicy;
use gpu_rdma::{Access, ConnectOptions, Connection, Domain, DomainConfig, Error, TransportPolicy};

/// The echo: receives each message into host memory and sends it back.
fn echo(d: &Domain, s: &Connection, size: usize, messages: usize) -> Result<(), Error> {
    let mut rx = s.recv_persistent(d.alloc(size)?);
    let mut tx = s.send_persistent(d.alloc(size)?);
    for i in 0..messages {
        rx.wait()?;
        if i > 0 {
            tx.wait()?;
            tx.repost()?;
        }
        rx.repost()?;
    }
    tx.wait()?;
    Ok(())
}

/// Median and 10th percentile, in microseconds.
fn summary(mut us: Vec<f64>) -> String {
    us.sort_by(f64::total_cmp);
    format!("median {:7.1} us, p10 {:7.1} us", us[us.len() / 2], us[us.len() / 10])
}

fn run(size: usize, n: usize) -> Result<(), Error> {
    let d = Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Tcp))?;
    let opts = ConnectOptions::default();
    let listener = d.listen("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let (c, s) = std::thread::scope(|sc| {
        let accepted = sc.spawn(|| listener.accept_timeout(&opts, Duration::from_secs(30)));
        let c = d.connect(addr, &opts);
        (c, accepted.join().expect("the accepting thread"))
    });
    let (c, s) = (c?, s?);
    let dev = CudaDevice::open(0)?;
    let gpu = |len| {
        d.register_with_path(CudaBuffer::alloc(&dev, len)?, Access::LOCAL_WRITE, PathPolicy::Auto).map_err(|e| e.error)
    };
    let (out, back) = (gpu(size)?, gpu(size)?);
    println!("GPU memory path: {}", out.path_report().map_or_else(|| "none".into(), |r| r.to_string()));
    let mut tx = c.send_persistent(out.slice(..size));
    let mut rx = c.recv_persistent(back.slice(..size));
    std::thread::scope(|sc| -> Result<(), Error> {
        let echoed = sc.spawn(|| echo(&d, &s, size, 2 * n));
        let mut round = |first: bool| -> Result<f64, Error> {
            let t0 = Instant::now();
            if !first {
                tx.repost()?;
            }
            tx.wait()?;
            rx.wait()?;
            rx.repost()?;
            Ok(t0.elapsed().as_secs_f64() * 1e6)
        };
        let waited = (0..n).map(|i| round(i == 0)).collect::<Result<Vec<_>, _>>()?;
        println!("{size} B round trip, waited:  {}", summary(waited));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let awaited = rt.block_on(async {
            let mut us = Vec::with_capacity(n);
            for _ in 0..n {
                let t0 = Instant::now();
                tx.repost()?;
                (&mut tx).await?;
                (&mut rx).await?;
                rx.repost()?;
                us.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            Ok::<_, Error>(us)
        })?;
        println!("{size} B round trip, awaited: {}", summary(awaited));
        echoed.join().expect("the echo thread")
    })
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let size = args.next().map_or(Ok(4096), |s| s.parse::<usize>());
    let n = args.next().map_or(Ok(1000), |s| s.parse::<usize>());
    let (Ok(size @ 1..), Ok(n @ 10..)) = (size, n) else {
        eprintln!("usage: staged_latency [SIZE >= 1] [ROUND TRIPS >= 10]");
        return ExitCode::from(2);
    };
    match run(size, n) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("staged_latency: {e}");
            ExitCode::FAILURE
        }
    }
}
