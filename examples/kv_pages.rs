//! KV-cache pages from a prefill side to a decode side, as disaggregated
//! inference moves them: each request's cache is layers x (K, V) x pages,
//! scattered in a paged pool on each side (each side picks its own pages,
//! and the pools are laid out differently). The decode side allocates
//! pages for a request and sends the prefill side its page table; the
//! prefill side moves every page of every layer in one transfer list that
//! notifies the request's id after its last page; the decode side waits per
//! request (in whatever order they finish) and checks every page.
//!
//! ```text
//! kv_pages                 # both sides in this process, over loopback
//! kv_pages --async         # the prefill side awaits its transfers under tokio
//! kv_pages --requests 32 --layers 8 --page 32KiB
//! ```
//!
//! Runs on the best path here: verbs when there is an RDMA device (with
//! the reason printed when not), else TCP.

use std::collections::HashMap;
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use gpu_rdma::units::{format_bytes, parse_bytes};
use gpu_rdma::{
    Access, ConnectOptions, Connection, Domain, Error, HostMemory, PageLayout, Piece, Result, Shared, Transfer,
};

#[derive(Parser, Debug, Clone, Copy)]
#[command(about = "KV-cache pages pushed from a prefill side to a decode side in transfer lists, verified")]
struct Args {
    /// Requests (each one transfer list, notified on its own tag).
    #[arg(long, default_value_t = 16)]
    requests: u32,
    /// Transformer layers.
    #[arg(long, default_value_t = 4)]
    layers: u32,
    /// Pages per request (per layer and K/V).
    #[arg(long, default_value_t = 24)]
    pages: u32,
    /// Bytes per page (tokens per block x heads x head dim x element size).
    #[arg(long, default_value = "16KiB", value_parser = |s: &str| parse_bytes(s).map_err(|e| e.to_string()))]
    page: u64,
    /// Prefill side: await the transfers concurrently under a
    /// single-threaded tokio runtime.
    #[arg(long = "async")]
    use_async: bool,
}

const POOL_TAG: u64 = 0x4b56_5043; // "KVPC"

/// A pool of pages: `slots` pages per (layer, K/V) plane. The prefill side
/// lays planes out one after another (page-major within a plane); the
/// decode side interleaves them (layer-major within a page slot), so the
/// same page moves between different strides.
#[derive(Clone, Copy)]
struct Pool {
    layers: u32,
    slots: u32,
    page: u64,
}

impl Pool {
    fn len(&self) -> usize {
        (u64::from(self.layers) * 2 * u64::from(self.slots) * self.page) as usize
    }

    /// Prefill: plane (layer, kv) is contiguous.
    fn prefill_layout(&self, layer: u32, kv: u32) -> PageLayout {
        let plane = u64::from(layer * 2 + kv);
        PageLayout {
            page_len: self.page,
            local_base: plane * u64::from(self.slots) * self.page,
            local_stride: self.page,
            remote_base: 0,
            remote_stride: 0,
        }
    }

    /// Decode: slot s holds every (layer, kv) page of that slot together.
    fn decode_at(&self, layer: u32, kv: u32, slot: u32) -> u64 {
        (u64::from(slot) * u64::from(self.layers) * 2 + u64::from(layer * 2 + kv)) * self.page
    }
}

/// What page `i` of (request, layer, kv) holds: a stamp of where it belongs,
/// repeated, so a misplaced page shows which one it is.
fn content(request: u32, layer: u32, kv: u32, i: u32, len: usize) -> Vec<u8> {
    let stamp = [request.to_le_bytes(), layer.to_le_bytes(), kv.to_le_bytes(), i.to_le_bytes()].concat();
    stamp.iter().copied().cycle().take(len).collect()
}

/// Distinct pseudo-random slots: a paged allocator's free list after churn.
fn scatter(n: u32, slots: u32, seed: u64) -> Vec<u32> {
    let mut all: Vec<u32> = (0..slots).collect();
    let mut x = seed | 1;
    for i in (1..all.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        all.swap(i, (x % (i as u64 + 1)) as usize);
    }
    all.truncate(n as usize);
    all
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv_pages: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<()> {
    let domain = Domain::open()?;
    let info = domain.info();
    match &info.fallback {
        Some(why) => println!("path: TCP, no RDMA here: {why}"),
        None => println!("path: {} on {} port {}", info.transport, info.device, info.port),
    }
    let slots = args.requests * args.pages;
    let pool = Pool { layers: args.layers, slots, page: args.page };
    let per_request = u64::from(args.layers) * 2 * u64::from(args.pages) * args.page;
    println!(
        "{} requests x {} layers x K/V x {} pages of {}: {} per request, {} in all",
        args.requests,
        args.layers,
        args.pages,
        format_bytes(args.page),
        format_bytes(per_request),
        format_bytes(per_request * u64::from(args.requests))
    );

    // The decode side's pool, exposed for writes; the prefill side learns
    // it at the handshake.
    let decode_pool = domain.expose(domain.alloc(pool.len())?, Access::REMOTE_WRITE, POOL_TAG).map_err(|e| e.error)?;
    let opts = ConnectOptions::default().op_timeout(Duration::from_secs(60));
    let listener = domain.listen("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let decode_opts = opts.clone().advertise(&decode_pool);
    let started = Instant::now();
    let (decoded, prefilled) = thread::scope(|s| {
        let decode = s.spawn(|| -> Result<Duration> {
            let conn = listener.accept_timeout(&decode_opts, Duration::from_secs(30))?;
            decode_side(&domain, &conn, &decode_pool, pool, args)
        });
        let prefill = s.spawn(|| -> Result<()> {
            let conn = domain.connect(addr, &opts)?;
            prefill_side(&domain, &conn, pool, args)
        });
        (decode.join(), prefill.join())
    });
    prefilled.map_err(|_| Error::InvalidArgument("the prefill side panicked".into()))??;
    let took = decoded.map_err(|_| Error::InvalidArgument("the decode side panicked".into()))??;
    let bytes = per_request * u64::from(args.requests);
    println!(
        "all {} requests verified page by page: {} landed in {:.1} ms ({}/s); {:.1} ms with setup and checks",
        args.requests,
        format_bytes(bytes),
        took.as_secs_f64() * 1e3,
        format_bytes((bytes as f64 / took.as_secs_f64()) as u64),
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

/// Decode: allocates pages per request, sends the page tables, then waits
/// for each request's notification and checks its pages.
fn decode_side(
    domain: &Domain,
    conn: &Connection,
    pool_mem: &gpu_rdma::Exposed<HostMemory>,
    pool: Pool,
    args: Args,
) -> Result<Duration> {
    let mut inbox = conn.inbox(args.requests as usize)?;
    // Each request's slots, scattered over the pool.
    let all = scatter(pool.slots, pool.slots, 0xdec0de);
    let tables: Vec<Vec<u32>> = all.chunks(args.pages as usize).map(<[u32]>::to_vec).collect();
    for (r, table) in tables.iter().enumerate() {
        let bytes: Vec<u8> = table.iter().flat_map(|s| s.to_le_bytes()).collect();
        let mut msg = domain.alloc(bytes.len())?;
        msg.copy_from_slice(&bytes);
        conn.send_with_imm(msg, r as u32).finish()?;
    }
    let started = Instant::now();
    // Waited for in an order unlike the sending order: any order works.
    let mut order: Vec<u32> = (0..args.requests).collect();
    order.reverse();
    let mut landed = Vec::new();
    for r in order {
        let notes = inbox.wait(r, 1)?;
        landed.push((r, started.elapsed(), notes[0].payload.clone()));
    }
    let took = started.elapsed();
    // Every page of every request, checked once all have landed.
    let mut page = vec![0u8; pool.page as usize];
    for (r, at, note) in landed {
        for layer in 0..pool.layers {
            for kv in 0..2 {
                for (i, &slot) in tables[r as usize].iter().enumerate() {
                    pool_mem.read_at(pool.decode_at(layer, kv, slot) as usize, &mut page)?;
                    if page != content(r, layer, kv, i as u32, page.len()) {
                        return Err(Error::InvalidArgument(format!(
                            "request {r} layer {layer} {} page {i} (slot {slot}) is wrong",
                            if kv == 0 { "K" } else { "V" }
                        )));
                    }
                }
            }
        }
        println!(
            "decode: request {r:>3} landed at {:>7.2} ms (note: {:?}); its {} pages are right",
            at.as_secs_f64() * 1e3,
            String::from_utf8_lossy(&note),
            pool.layers * 2 * args.pages
        );
    }
    Ok(took)
}

/// Prefill: fills its pool, reads each request's page table, and pushes
/// every page of the request in one transfer list with a notification.
fn prefill_side(domain: &Domain, conn: &Connection, pool: Pool, args: Args) -> Result<()> {
    let remote = conn
        .remote_region(POOL_TAG)
        .ok_or_else(|| Error::InvalidArgument("the decode side advertised no pool".into()))?
        .whole();
    // This side's pages of each request, scattered too.
    let mine: Vec<Vec<u32>> =
        scatter(pool.slots, pool.slots, 0x9e7f11).chunks(args.pages as usize).map(<[u32]>::to_vec).collect();
    let mut region = domain.alloc(pool.len())?;
    for (r, pages) in mine.iter().enumerate() {
        for layer in 0..pool.layers {
            for kv in 0..2 {
                let l = pool.prefill_layout(layer, kv);
                for (i, &slot) in pages.iter().enumerate() {
                    let at = (l.local_base + u64::from(slot) * l.local_stride) as usize;
                    region[at..at + pool.page as usize].copy_from_slice(&content(
                        r as u32,
                        layer,
                        kv,
                        i as u32,
                        pool.page as usize,
                    ));
                }
            }
        }
    }
    let local = region.share();
    // The decode side's page tables, by request.
    let mut tables: HashMap<u32, Vec<u32>> = HashMap::new();
    for _ in 0..args.requests {
        let (c, buf) = conn.recv(domain.alloc(4 * args.pages as usize)?).finish()?;
        let table =
            buf[..c.byte_len as usize].chunks(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        tables.insert(c.imm.unwrap_or(u32::MAX), table);
    }
    let list = |r: u32| -> Result<Transfer<Shared<HostMemory>>> {
        let theirs = tables.get(&r).ok_or_else(|| Error::InvalidArgument(format!("no page table for request {r}")))?;
        let mut pieces = Vec::with_capacity((pool.layers * 2 * args.pages) as usize);
        for layer in 0..pool.layers {
            for kv in 0..2 {
                // Remote page `s` of this plane is at decode_at(layer, kv, s):
                // a base and a stride, as the layout says.
                let layout = PageLayout {
                    remote_base: pool.decode_at(layer, kv, 0),
                    remote_stride: u64::from(pool.layers) * 2 * pool.page,
                    ..pool.prefill_layout(layer, kv)
                };
                pieces.extend(Piece::pages(&layout, &mine[r as usize], theirs)?);
            }
        }
        let note = format!("request {r} ready");
        Ok(conn.write_list_notify(local.clone(), &remote, pieces, r, note.as_bytes()))
    };
    if args.use_async {
        prefill_async(list, args.requests)
    } else {
        // Every request in flight at once; the engine keeps the queue full.
        let transfers: Vec<_> = (0..args.requests).map(list).collect::<Result<_>>()?;
        for (r, t) in transfers.into_iter().enumerate() {
            let (done, _) = t.finish()?;
            println!("prefill: request {r:>3} sent: {} requests on the wire in {} posts", done.requests, done.posts);
        }
        Ok(())
    }
}

/// The prefill side's transfers awaited concurrently on one thread.
fn prefill_async(list: impl Fn(u32) -> Result<Transfer<Shared<HostMemory>>>, requests: u32) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for r in 0..requests {
            let mut t = list(r)?;
            set.spawn(async move { (r, (&mut t).await) });
        }
        while let Some(joined) = set.join_next().await {
            let (r, done) = joined.map_err(|e| Error::InvalidArgument(format!("a prefill task failed: {e}")))?;
            let done = done?;
            println!(
                "prefill (async): request {r:>3} sent: {} requests on the wire in {} posts",
                done.requests, done.posts
            );
        }
        Ok(())
    })
}
