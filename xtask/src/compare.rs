//! `cargo xtask compare`: `gpu-rdma bench` beside two anchors, perftest and
//! UCX (`ucx_perftest`), with the same sizes and iteration counts,
//! interleaved (each round runs them in another order: over the rounds each
//! runs right after every other equally often, so neither drift nor what a
//! run leaves behind falls on one tool), and
//! a table of medians over the rounds and their ratios, each tool's figure
//! over perftest's round by round with the range the rounds put it in (see
//! [`crate::stats`]), then each tool's best round.
//!
//! 1. On this machine, TCP on loopback: our TCP transport against UCX over
//!    TCP (`UCX_TLS=tcp`), put bandwidth at 64 KiB and 1 MiB and latency;
//!    transfer lists against a plain socket, with the socket against itself
//!    as the null; and the Python binding against the Rust bench
//!    (`python/bench.py`).
//! 2. In one soft-RoCE guest run, on rxe0: perftest, UCX
//!    (`UCX_TLS=rc_verbs,ud_verbs,self`) and gpu-rdma.
//!
//! Absolute speeds in the guest mean nothing; the ratios do. Under the
//! table, how steady this machine's own CPU ran before and after the guest
//! run ([`crate::steady`]): the guest's CPUs are its threads.
//! `--host` runs part 1 only; `--only TEST` and `--size BYTES` run part 2's
//! cases of one test, of one size, or both (one case in many rounds costs
//! minutes where every case costs a quarter of an hour, so one doubtful
//! verdict can be settled alone); `--from DIR` prints part 2's table again from
//! a kept guest run, and from several (`--from A --from B`) with their
//! rounds pooled: kept runs of the same settings add up to the rounds that
//! settle what five cannot. `--null` runs perftest twice in each round and
//! adds the null comparison: perftest against itself, paired and judged by
//! the same goals, which shows how far the machine alone moves a ratio.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::stats::{RatioRange, median, paired_range, paired_rank, verdict};
use crate::vm::{self, VmOptions};
use crate::{Result, cargo, root, run as run_cmd, setup, steady};

/// One measurement: a test at a size.
struct Case {
    test: &'static str,
    perftest: &'static str,
    /// The `ucx_perftest` test that does the same (put, get, tag ping-pong).
    ucx: &'static str,
    size: u64,
    iters: u32,
}

impl Case {
    fn is_bw(&self) -> bool {
        self.test.ends_with("-bw")
    }

    fn name(&self) -> String {
        format!("{}-{}", self.test, self.size)
    }
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for (test, perftest, ucx) in [("write-bw", "ib_write_bw", "ucp_put_bw"), ("read-bw", "ib_read_bw", "ucp_get")] {
        v.push(Case { test, perftest, ucx, size: 64 << 10, iters: 1000 });
        v.push(Case { test, perftest, ucx, size: 1 << 20, iters: 100 });
    }
    // The engine: 4 KiB pages in lists of 1,024 against ib_write_bw's
    // message rate at 4 KiB (the same bytes each, so bandwidth is rate).
    v.push(Case { test: "list-bw", perftest: "ib_write_bw", ucx: "ucp_put_bw", size: 4096, iters: 51200 });
    // Latency runs of 2-4 s each in the guest. The emulated machine flips
    // between a fast mode and a slow one every few tens of milliseconds
    // (an unsorted 40,000-iteration `ib_send_lat -U` at 2 B: medians of
    // 200-iteration windows from 17 to 34 us), so a run of 5,000 (0.3 s)
    // caught few flips and its typical latency and minimum were whichever
    // mode it met: over 6 interleaved rounds, 5,000 iterations spread
    // perftest's typical over 24.9-29.0 us and ours over 16.7-33.4 us (the
    // minimum: 14.2-20.8 and 14.4-31.8), 50,000 over 26.9-28.6 and
    // 26.3-29.6 (minimum 14.7-16.2 and 13.7-15.4).
    for (size, iters) in [(2, 50_000), (64, 50_000), (1024, 25_000), (4096, 10_000)] {
        v.push(Case { test: "send-lat", perftest: "ib_send_lat", ucx: "tag_lat", size, iters });
    }
    v
}

/// The host's TCP cases: bandwidth at 64 KiB and 1 MiB, and latency.
fn host_cases() -> Vec<Case> {
    vec![
        Case { test: "write-bw", perftest: "", ucx: "ucp_put_bw", size: 64 << 10, iters: 5000 },
        Case { test: "write-bw", perftest: "", ucx: "ucp_put_bw", size: 1 << 20, iters: 1000 },
        Case { test: "send-lat", perftest: "", ucx: "tag_lat", size: 64, iters: 20000 },
    ]
}

/// The `ucx_perftest` command line for a case (server side: without a host).
fn ucx_cmd(c: &Case, port: u16) -> String {
    // Warm-up as perftest's: a small share of the run.
    format!("ucx_perftest -t {} -s {} -n {} -w {} -p {port}", c.ucx, c.size, c.iters, (c.iters / 10).max(10))
}

/// UCX's figure from its `Final:` line: the median latency (usec) for a
/// latency test, the whole run's bandwidth (MB/s, 2^20 bytes, as
/// perftest's) for a bandwidth test.
///
/// ucx_perftest's `average` columns cover only the stretch since its last
/// progress report (libperf's moment average) and its `overall` columns
/// the whole run: the `Final:` line's bandwidth `average` is the last
/// stretch's, and 0.00 when no iteration ended after the last report (seen
/// in the guest at 1 MiB: `average` 0.00, `overall` 49.72). perftest's BW
/// average is bytes over the whole run's time, so `overall` is the one to
/// set beside it.
pub fn ucx_figure(log: &str, bw: bool) -> Option<f64> {
    let line = log.lines().find(|l| l.trim_start().starts_with("Final:"))?;
    let f: Vec<&str> = line.split_whitespace().collect();
    // Final: iterations p50 average overall bw-average bw-overall rate-average rate-overall
    f.get(if bw { 6 } else { 2 }).and_then(|s| usable(s))
}

/// A figure that measures something: a finite, positive number. perftest
/// prints 0.00 or `inf` when a run failed to time itself (seen in the
/// guest: a first round's 1 MiB `ib_write_bw` printed 0.00 MB/s, and a 64 B
/// `ib_send_lat` printed `inf` in every column); such a round has no figure.
fn usable(text: &str) -> Option<f64> {
    text.parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0)
}

/// Each case's two sides, one after the other. Every tool's server runs
/// on the guest's first CPU and its client on the second (when it has
/// two): left to the scheduler, where a busy-polling pair and rxe's
/// packet work landed changed from run to run and moved whole rounds of
/// the same binary by a third and more (a 2-byte ping-pong's minimum at
/// 11 us in one round, 15-19 us in the next), for perftest and gpu-rdma
/// alike. The client starts as soon as its server listens (at most 10 s
/// later), not after a fixed second: a latency run takes 2-4 s, and rounds
/// are what narrow a ratio's range.
const PAIR: &str = r#"
if [ "$(nproc)" -ge 2 ]; then ON_SERVER="taskset -c 0"; ON_CLIENT="taskset -c 1"; else ON_SERVER=; ON_CLIENT=; fi
pair() { # name, server's TCP port, server command, client command
  timeout 600 $ON_SERVER $3 > "$VM_OUT/$1.server" 2>&1 &
  local sp=$! i
  for i in $(seq 200); do ss -ltn | grep -q ":$2 " && break; sleep 0.05; done
  timeout 600 $ON_CLIENT $4 > "$VM_OUT/$1.client" 2>&1
  echo $? > "$VM_OUT/$1.rc"
  wait $sp
  echo "  $1: exit $(cat "$VM_OUT/$1.rc")"
}
B=target/release/gpu-rdma
"#;

/// The orders the tools of a case run in, one a round in turn: each tool
/// comes right after every other equally often, and takes every place
/// equally often (a Williams design). A run can leave the guest slower or
/// faster for the next one; in one fixed cyclic order each tool always
/// followed the same tool (with perftest twice, gpu-rdma always came right
/// after perftest's second run and perftest's first right after
/// gpu-rdma), so what one tool left behind would have counted against a
/// single other tool round after round. (Measured once, over 16 balanced
/// rounds of read-bw at 1 MiB: the runs after each tool lay within 2% of
/// their rounds' means, so no such effect showed there.)
fn balanced_orders(n: usize) -> Vec<Vec<usize>> {
    // First row 0, 1, n-1, 2, n-2, ...; the others add 1, 2, ... mod n.
    let first: Vec<usize> = (0..n).map(|j| if j % 2 == 1 { j.div_ceil(2) } else { (n - j / 2) % n }).collect();
    let mut rows: Vec<Vec<usize>> = (0..n).map(|r| first.iter().map(|&t| (t + r) % n).collect()).collect();
    if n % 2 == 1 {
        // An odd number of tools needs the mirror images too.
        let mirrored: Vec<Vec<usize>> = rows.iter().map(|row| row.iter().rev().copied().collect()).collect();
        rows.extend(mirrored);
    }
    rows
}

/// The figure a client printed for `size`: average bandwidth (MiB/s) for a
/// bandwidth test, typical latency (usec) for a latency test. perftest's and
/// gpu-rdma's tables share their columns.
pub fn figure(log: &str, size: u64, bw: bool) -> Option<f64> {
    column(log, size, if bw { 3 } else { 4 })
}

/// The minimum latency (usec) a latency test's client printed for `size`.
pub fn min_latency(log: &str, size: u64) -> Option<f64> {
    column(log, size, 2)
}

/// Column `index` of the row for `size` in a perftest-style table.
fn column(log: &str, size: u64, index: usize) -> Option<f64> {
    let mut after_header = false;
    for line in log.lines() {
        if line.contains("#bytes") {
            after_header = true;
            continue;
        }
        if !after_header {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.first().and_then(|s| s.parse::<u64>().ok()) == Some(size) {
            return f.get(index).and_then(|s| usable(s));
        }
    }
    None
}

/// The guest's cases of test `only` and of `size` (each when given), or
/// why none is.
fn chosen(only: Option<&str>, size: Option<u64>) -> Result<Vec<Case>> {
    let cases: Vec<Case> = cases_of(only).into_iter().filter(|c| size.is_none_or(|s| c.size == s)).collect();
    if cases.is_empty() {
        // Which sizes there are, to say what would have matched.
        let of = |only| {
            let mut sizes: Vec<u64> = cases_of(only).iter().map(|c| c.size).collect();
            sizes.sort_unstable();
            sizes.dedup();
            sizes.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
        };
        let size = size.map_or_else(String::new, |s| s.to_string());
        return Err(match only {
            Some(t) if cases_of(only).is_empty() => format!("--only {t}: no such test among the guest's cases"),
            Some(t) => format!("--only {t} --size {size}: {t} runs at {} bytes", of(only)),
            None => format!("--size {size}: no case of the guest runs at that size (they run at {})", of(None)),
        });
    }
    Ok(cases)
}

/// The guest's cases of test `only`, or all.
fn cases_of(only: Option<&str>) -> Vec<Case> {
    cases().into_iter().filter(|c| only.is_none_or(|t| c.test == t)).collect()
}

pub fn command(args: &[String]) -> Result<i32> {
    let mut rounds = None;
    let mut host_only = false;
    let mut from = Vec::new();
    let mut only: Option<String> = None;
    let mut size: Option<u64> = None;
    let mut null = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--rounds" => {
                let n = it.next().ok_or("--rounds needs a number")?;
                rounds = Some(n.parse().map_err(|_| format!("--rounds {n}: not a number"))?);
            }
            "--host" => host_only = true,
            "--null" => null = true,
            "--only" => only = Some(it.next().ok_or("--only needs a test name (write-bw, list-bw, ...)")?.clone()),
            "--size" => {
                let n = it.next().ok_or("--size needs a message size in bytes")?;
                size = Some(n.parse().map_err(|_| format!("--size {n}: not a number of bytes"))?);
            }
            "--from" => from.push(PathBuf::from(it.next().ok_or("--from needs the folder of a guest run")?)),
            _ => {
                return Err(format!(
                    "compare takes --rounds N (default 3), --host, --only TEST (the guest's cases of one test, \
                     without the host part), --size BYTES (the guest's cases of one size, without the host \
                     part), --null (perftest a second time each round, against itself) and --from DIR \
                     (repeatable: the kept runs' rounds pooled); got {args:?}"
                ));
            }
        }
    }
    let cases = chosen(only.as_deref(), size)?;
    let guest_only = only.is_some() || size.is_some();
    if !from.is_empty() {
        // The table again from kept guest runs' logs, without running
        // anything: each run's rounds (the first N with --rounds), pooled.
        let runs = from
            .into_iter()
            .map(|dir| {
                let n = rounds.unwrap_or_else(|| rounds_in(&dir, &cases));
                check_settings(&dir, &cases, n).map(|()| Run { dir, rounds: n })
            })
            .collect::<Result<Vec<Run>>>()?;
        let (table, missing) = report(&runs, &cases);
        print!("{table}");
        return Ok(i32::from(missing != 0));
    }
    let rounds = rounds.unwrap_or(3);
    let kernel = setup::setup()?;
    run_cmd(cargo().args(["build", "--release", "--features", "cli", "--bin", "gpu-rdma"]))?;
    let (host_table, host_missing) = if guest_only { (String::new(), 0) } else { host(rounds)? };
    print!("{host_table}");
    if host_only {
        let _ = fs::write(root().join("target/compare.txt"), &host_table);
        return Ok(i32::from(host_missing != 0));
    }
    let mut script = String::from(PAIR);
    for round in 0..rounds {
        let _ = writeln!(script, "echo 'round {}'", round + 1);
        for (i, c) in cases.iter().enumerate() {
            let pt = format!("{} -d rxe0 -x 0 -F -s {} -n {}", c.perftest, c.size, c.iters);
            let gr = format!("$B bench {} -d rxe0 -p 18516 -s {} -n {}", c.test, c.size, c.iters);
            let ucx = format!("env UCX_TLS=rc_verbs,ud_verbs,self UCX_NET_DEVICES=rxe0:1 {}", ucx_cmd(c, 13337));
            let mut all = vec![("perftest", pt.clone(), 18515), ("ucx", ucx, 13337), ("gpu-rdma", gr, 18516)];
            if null {
                all.insert(2, (AGAIN, pt, 18515));
            }
            let orders = balanced_orders(all.len());
            for &k in &orders[(round + i) % orders.len()] {
                let (tool, cmd, port) = &all[k];
                let client = if *tool == "ucx" {
                    cmd.replace("ucx_perftest ", "ucx_perftest 127.0.0.1 ")
                } else {
                    format!("{cmd} 127.0.0.1")
                };
                let _ = writeln!(script, "pair {}-{tool}-{round} {port} \"{cmd}\" \"{client}\"", c.name());
            }
        }
    }
    script.push_str("exit 0\n");
    println!(
        "xtask: compare: {} cases x {rounds} rounds, perftest{}, UCX and gpu-rdma bench interleaved on rxe0",
        cases.len(),
        if null { " (twice)" } else { "" }
    );
    let opts = VmOptions { timeout: Duration::from_secs(3600), keep: true, ..VmOptions::default() };
    let before = host_steadiness("before");
    let guest = vm::run_script(&kernel, &root(), &script, &opts)?;
    let steadiness = format!("{before}{}", host_steadiness("after"));
    // Kept with the logs, so that `--from` shows it again.
    let _ = fs::write(guest.dir.join(STEADINESS), &steadiness);
    let (table, missing) = report(&[Run { dir: guest.dir.clone(), rounds }], &cases);
    print!("{table}");
    let _ = fs::write(root().join("target/compare.txt"), format!("{host_table}{table}"));
    println!("(also in target/compare.txt; guest logs in {})", guest.dir.display());
    Ok(if missing == 0 && host_missing == 0 && guest.code == 0 { 0 } else { 1 })
}

/// Runs a server and, a second later, its client; the client's output.
fn pair(server: &[String], client: &[String], env: &[(&str, &str)]) -> Result<String> {
    let spawn = |argv: &[String]| {
        let mut c = Command::new(&argv[0]);
        c.args(&argv[1..]).envs(env.iter().copied()).stdin(Stdio::null());
        c
    };
    let mut srv =
        spawn(server).stdout(Stdio::null()).stderr(Stdio::null()).spawn().map_err(|e| format!("{}: {e}", server[0]))?;
    std::thread::sleep(Duration::from_secs(1));
    let out = spawn(client).output().map_err(|e| format!("{}: {e}", client[0]));
    let deadline = Instant::now() + Duration::from_secs(10);
    while srv.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = srv.kill();
    let _ = srv.wait();
    let out = out?;
    Ok(format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Part 1: our TCP transport and UCX over TCP on loopback, interleaved.
fn host(rounds: usize) -> Result<(String, usize)> {
    let bin = root().join("target/release/gpu-rdma").display().to_string();
    let cases = host_cases();
    println!(
        "xtask: compare: {} cases x {rounds} rounds on this machine: gpu-rdma over TCP and UCX over TCP",
        cases.len()
    );
    let words = |s: String| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    // Per case: gpu-rdma's runs, UCX's before them and UCX's after them, by
    // round. gpu-rdma is judged against both UCX runs of its round; UCX's
    // second run over its first is the null.
    let mut figures: Vec<[Vec<Option<f64>>; 3]> = cases.iter().map(|_| Default::default()).collect();
    let mut missing = 0;
    for round in 0..rounds {
        for (i, c) in cases.iter().enumerate() {
            for (k, ucx_turn) in [true, false, true].into_iter().enumerate() {
                let log = if ucx_turn {
                    let server = words(ucx_cmd(c, 13390));
                    let client = words(ucx_cmd(c, 13390).replace("ucx_perftest ", "ucx_perftest 127.0.0.1 "));
                    pair(&server, &client, &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")])?
                } else {
                    let server =
                        words(format!("{bin} bench {} --transport tcp -p 18590 -s {} -n {}", c.test, c.size, c.iters));
                    let mut client = server.clone();
                    client.push("127.0.0.1".into());
                    pair(&server, &client, &[])?
                };
                let v = if ucx_turn { ucx_figure(&log, c.is_bw()) } else { figure(&log, c.size, c.is_bw()) };
                if v.is_none() {
                    missing += 1;
                    println!("  no figure from {} (round {round}):\n{log}", if ucx_turn { "ucx" } else { "gpu-rdma" });
                }
                figures[i][[1, 0, 2][k]].push(v);
            }
        }
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nthis machine, TCP on loopback\n{:<10} {:>9} {:>7}  {:>14} {:>14}  {:>7}  {:>9}  {:<8}  null (UCX again)",
        "test", "bytes", "iters", "ucx (tcp)", "gpu-rdma (tcp)", "ratio", "range", "goal"
    );
    for (c, [ours, first, again]) in cases.iter().zip(figures) {
        let j = sandwiched(&ours, &first, &again);
        let unit = if c.is_bw() { "MiB/s" } else { "us" };
        let show = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2} {unit}"));
        // Bandwidth: at least UCX's; latency: at most UCX's.
        let (goal, judged) = if c.is_bw() {
            (">= 1.00x", verdict(j.ratio, j.range, |r| r >= 1.0))
        } else {
            ("<= 1.00x", verdict(j.ratio, j.range, |r| r <= 1.0))
        };
        let _ = writeln!(
            out,
            "{:<10} {:>9} {:>7}  {:>14} {:>14}  {:>7}  {:>9}  {goal} {judged}; {} ({})",
            c.test,
            c.size,
            c.iters,
            show(j.anchor),
            show(j.ours),
            times(j.ratio),
            show_range(j.range),
            times(j.null.map(|r| r.estimate)),
            show_range(j.null),
        );
    }
    let _ = writeln!(
        out,
        "medians of {rounds} rounds, each UCX, gpu-rdma, UCX again; UCX: ucp_put_bw / tag_lat (median latency, \
         one-way); gpu-rdma: write-bw / send-lat; ratio against both UCX runs of a round, range paired by round; \
         null: UCX's second run over its first"
    );
    // Transfer lists of 64 KiB pieces against a plain socket moving the
    // same bytes in 64 KiB writes: each round the socket twice and the
    // lists once, the lists first, between or last in turn (a run here
    // went slower the later it came in its round: the socket's second run
    // over its first was 0.83x, 0.75-0.95, when the lists always came
    // between); the lists against both socket runs of their round, and the
    // second socket run against the first (the null).
    let (size, iters) = (64u64 << 10, 20_000u32);
    let (mut lists, mut plain, mut again, mut replied) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let lists_at = [1, 0, 2][round % 3];
        for slot in 0..3 {
            if slot != lists_at {
                let v = Some(socket_mib_s(size as usize, iters as usize, None)?);
                if plain.len() == round {
                    plain.push(v)
                } else {
                    again.push(v)
                }
                continue;
            }
            let server = words(format!("{bin} bench list-bw --transport tcp -p 18591 -s {size} -n {iters}"));
            let mut client = server.clone();
            client.push("127.0.0.1".into());
            let log = pair(&server, &client, &[])?;
            let v = figure(&log, size, true);
            if v.is_none() {
                missing += 1;
                println!("  no figure from gpu-rdma list-bw (round {round}):\n{log}");
            }
            lists.push(v);
        }
        replied.push(socket_mib_s(size as usize, iters as usize, Some(32))?);
    }
    let Sandwiched { ours: g, anchor: p, ratio, range, null } = sandwiched(&lists, &plain, &again);
    let show = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2} MiB/s"));
    let _ = writeln!(
        out,
        "\n{:<10} {:>9} {:>7}  {:>14} {:>14}  {:>7}  {:>9}  goal\n{:<10} {:>9} {:>7}  {:>14} {:>14}  {:>7}  {:>9}  >= 1.00x {}",
        "test",
        "bytes",
        "iters",
        "plain socket",
        "gpu-rdma (tcp)",
        "ratio",
        "range",
        "list-bw",
        size,
        iters,
        show(p),
        show(g),
        times(ratio),
        show_range(range),
        verdict(ratio, range, |r| r >= 1.0)
    );
    let _ = writeln!(
        out,
        "null: the socket's second run of a round over its first, {} ({}); lists over both runs of their round\n\
         medians of {rounds} rounds, the lists first, between the socket's runs or last in turn; plain socket: one TCP \
         stream on loopback, 64 KiB writes into a 64 KiB read buffer",
        times(null.map(|r| r.estimate)),
        show_range(null)
    );
    // What one stream pays for carrying replies at all: the plain socket's
    // writes with an 8-byte reply every 32 of them (2 MiB), read on the
    // writer's side by a second thread, as any one-stream transport's
    // acknowledgements are.
    let r = median(replied.clone());
    let _ = writeln!(
        out,
        "one stream with replies: the plain socket with an 8-byte reply every 32 writes, read by another thread on the \
         writer's side: {}, {} the plain socket; the lists {} it",
        show(r),
        times(ratio_of(r, p)),
        times(ratio_of(g, r)),
    );
    match python_beside(&bin, rounds) {
        Ok(table) => {
            let _ = write!(out, "\nPython over Rust, TCP on loopback (python/bench.py)\n{table}");
        }
        Err(e) => {
            missing += 1;
            let _ = writeln!(out, "\nPython over Rust: no figures: {e}");
        }
    }
    Ok((out, missing))
}

/// `python/bench.py` (the binding against `gpu-rdma bench`, each round
/// Rust, Python, Rust again) in the binding's venv, with the wheel of this
/// tree built and installed; its table.
fn python_beside(bin: &str, rounds: usize) -> Result<String> {
    let py = crate::test::python_venv()?;
    crate::test::python_wheel(&py)?;
    println!("xtask: compare: python/bench.py, {rounds} rounds");
    let out = Command::new(&py)
        .arg(root().join("python/bench.py"))
        .args(["--rust", bin, "--rounds", &rounds.to_string()])
        // Outside the source tree: the installed package is imported.
        .current_dir(std::env::temp_dir())
        .output()
        .map_err(|e| format!("{}: {e}", py.display()))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!(
            "python/bench.py failed ({}):\n{text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(text)
}

/// A plain TCP stream on loopback: one thread writes `iters` buffers of
/// `size` bytes, another reads them; MiB/s from the first byte written to
/// the last read. With `replies_every`, the reader answers every that many
/// buffers with 8 bytes on the same stream, and a second thread of the
/// writer's side reads them, contending with the writer for the socket (as
/// a one-stream transport's acknowledgements do).
fn socket_mib_s(size: usize, iters: usize, replies_every: Option<usize>) -> Result<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; size];
        let Some(every) = replies_every else {
            let mut left = size * iters;
            while left > 0 {
                let n = s.read(&mut buf[..size.min(left)])?;
                if n == 0 {
                    break;
                }
                left -= n;
            }
            return Ok(());
        };
        s.set_nodelay(true)?;
        for i in 0..iters {
            s.read_exact(&mut buf)?;
            if (i + 1) % every == 0 {
                s.write_all(&[1u8; 8])?;
            }
        }
        Ok(())
    });
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
    let _ = s.set_nodelay(true);
    let buf = vec![7u8; size];
    let started = Instant::now();
    let replies = match replies_every {
        Some(every) => {
            let mut r = s.try_clone().map_err(|e| e.to_string())?;
            Some(std::thread::spawn(move || -> std::io::Result<()> {
                let mut b = [0u8; 8];
                for _ in 0..iters / every {
                    r.read_exact(&mut b)?;
                }
                Ok(())
            }))
        }
        None => None,
    };
    for _ in 0..iters {
        s.write_all(&buf).map_err(|e| e.to_string())?;
    }
    drop(s);
    reader.join().map_err(|_| "the reader panicked".to_owned())?.map_err(|e| e.to_string())?;
    if let Some(r) = replies {
        r.join().map_err(|_| "the reply reader panicked".to_owned())?.map_err(|e| e.to_string())?;
    }
    Ok((size * iters) as f64 / started.elapsed().as_secs_f64() / (1024.0 * 1024.0))
}

/// Where a guest run's folder keeps [`host_steadiness`]'s lines.
const STEADINESS: &str = "host-steadiness.txt";

/// A line on how steady this machine's CPU ran just `when` the guest run
/// (2 s of a fixed loop in 10 ms windows; see [`crate::steady`]).
fn host_steadiness(when: &str) -> String {
    match steady::probe(Duration::from_millis(10), Duration::from_secs(2)) {
        Some(s) => format!("this machine's CPU {when} the guest run: {s}\n"),
        None => format!("this machine's CPU {when} the guest run: not measured\n"),
    }
}

/// The table, and how many runs gave no figure.
fn report(runs: &[Run], cases: &[Case]) -> (String, usize) {
    let rounds: usize = runs.iter().map(|r| r.rounds).sum();
    let mut out = String::new();
    let mut noisy = 0;
    // Each tool's best round, beside the medians (see `best_row`).
    let mut best = format!(
        "\nbest round of {rounds}\n{:<10} {:>9}  {:>14} {:>14}  {:>7}   {:>14} {:>14}  {:>7}\n",
        "test", "bytes", "perftest", "gpu-rdma", "ratio", "perftest (min)", "gpu-rdma (min)", "ratio"
    );
    let _ = writeln!(
        out,
        "\nrxe0 in the soft-RoCE guest\n{:<10} {:>9} {:>7}  {:>14} {:>14} {:>14}  {:>7} {:>7} {:>11}  {:>7}  goal (paired, vs perftest)",
        "test", "bytes", "iters", "perftest", "ucx", "gpu-rdma", "vs pt", "paired", "range", "vs ucx"
    );
    // perftest against itself, where the runs have its second run.
    let mut null = format!(
        "\nthe null: perftest's second run of a round over its first, paired and judged as gpu-rdma is; \
         and gpu-rdma over both perftest runs of its round (their geometric mean), the steadier baseline\n\
         {:<10} {:>9}  {:>7} {:>11} {:>7}  {:<47}  {:>7} {:>11}\n",
        "test", "bytes", "paired", "range", "rounds", "goal", "vs both", "range"
    );
    let mut null_rows = 0;
    // The runs with no figure, left out of medians and ranges.
    let mut lost: Vec<String> = Vec::new();
    for c in cases {
        let typical = |log: &str| figure(log, c.size, c.is_bw());
        let mut take = |tool: &str, pick: &dyn Fn(&str) -> Option<f64>| {
            let (vals, without) = per_round(runs, c, tool, pick);
            lost.extend(without);
            vals
        };
        let pt = take("perftest", &typical);
        let gr = take("gpu-rdma", &typical);
        let ux = take("ucx", &|log: &str| ucx_figure(log, c.is_bw()));
        let unit = if c.is_bw() { "MiB/s" } else { "us" };
        let show = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2} {unit}"));
        // Bandwidth: higher is better, at least 1.00x from 64 KiB (transfer
        // lists: 0.90x of perftest's message rate). Latency: lower is
        // better, at most 1.05x up to 4 KiB.
        let floor = if c.test == "list-bw" { 0.90 } else { 1.0 };
        let goal = if c.is_bw() { format!(">= {floor:.2}x") } else { "<= 1.05x".to_owned() };
        let meets = |r: f64| if c.is_bw() { r >= floor } else { r <= 1.05 };
        // The null's row: perftest's second run over its first, judged by
        // the same goal (`None` rounds without a second run are left out).
        let mut null_row = |label: &str, pt: &[Option<f64>], again: &[Option<f64>], gr: &[Option<f64>]| {
            let Some(range) = paired_range(again, pt) else { return };
            let said = format!("{goal} {}", verdict(Some(range.estimate), Some(range), meets));
            let paired = times(Some(range.estimate));
            // Pooled with runs without `--null`, fewer rounds than the table's.
            let n = pt.iter().zip(again).filter(|(p, a)| p.is_some() && a.is_some()).count();
            // Against both of perftest's runs, a round's baseline is less
            // of a draw than against one.
            let vs_both = paired_range(gr, &round_means(pt, again));
            let _ = writeln!(
                null,
                "{label:<10} {:>9}  {paired:>7} {:>11} {n:>7}  {said:<47}  {:>7} {:>11}",
                c.size,
                show_range(Some(range)),
                times(vs_both.map(|r| r.estimate)),
                show_range(vs_both),
            );
            null_rows += 1;
        };
        null_row(c.test, &pt, &per_round(runs, c, AGAIN, &typical).0, &gr);
        // A row: the medians and their ratios, the paired ratio with its
        // range, and the goal's verdict on it.
        let mut row = |label: &str, pt: &[Option<f64>], gr: &[Option<f64>], ucx: Option<f64>| {
            let (p, g) = (median(figures(pt)), median(figures(gr)));
            let range = paired_range(gr, pt);
            let paired = range.map(|r| r.estimate);
            let said = verdict(paired, range, meets);
            noisy += usize::from(said.contains("noisy"));
            let _ = writeln!(
                out,
                "{label:<10} {:>9} {:>7}  {:>14} {:>14} {:>14}  {:>7} {:>7} {:>11}  {:>7}  {goal} {said}",
                c.size,
                c.iters,
                show(p),
                show(ucx),
                show(g),
                times(ratio_of(g, p)),
                times(paired),
                show_range(range),
                times(ratio_of(g, ucx)),
            );
        };
        row(c.test, &pt, &gr, median(figures(&ux)));
        let _ = write!(best, "{:<10} {:>9}  {}", c.test, c.size, best_row(c, &pt, &gr));
        if !c.is_bw() {
            // The minimum too: steadier than the median in an emulated machine.
            let least = |log: &str| min_latency(log, c.size);
            let (pt, _) = per_round(runs, c, "perftest", &least);
            let (gr, _) = per_round(runs, c, "gpu-rdma", &least);
            row("  (min)", &pt, &gr, None);
            null_row("  (min)", &pt, &per_round(runs, c, AGAIN, &least).0, &gr);
            let _ = write!(best, "   {}", best_row(c, &pt, &gr));
        }
        best.push('\n');
    }
    let level = if rounds == 0 { 0.0 } else { paired_rank(rounds).1 * 100.0 };
    let _ = writeln!(
        out,
        "medians of {rounds} rounds; bandwidth: BW average; latency: t_typical (median) and, under (min), \
         t_min, one-way; UCX: ucp_put_bw, ucp_get, tag_lat (median)\n\
         vs pt: the ratio of the medians; paired: gpu-rdma's figure over perftest's in the same round, the \
         Hodges-Lehmann estimate over the rounds (the tools of a round run back to back: the ratio cancels what \
         the machine did to both), and the goal's verdict\n\
         range: where the paired ratio lies with {level:.1}% confidence (Wilcoxon signed-rank, {rounds} rounds); \
         {noisy} verdict(s) noisy: their range crosses the goal, and {rounds} rounds cannot settle them either way"
    );
    for run in runs {
        // A goal nearer than this spread needs many rounds to settle.
        if let Ok(lines) = fs::read_to_string(run.dir.join(STEADINESS)) {
            let from = if runs.len() > 1 { format!(" ({})", run.dir.display()) } else { String::new() };
            lines.lines().for_each(|l| {
                let _ = writeln!(out, "{l}{from}");
            });
        }
    }
    if runs.len() > 1 {
        let each: Vec<String> = runs.iter().map(|r| format!("{} ({})", r.dir.display(), r.rounds)).collect();
        let _ = writeln!(out, "pooled: the rounds of {} kept runs: {}", runs.len(), each.join(", "));
    }
    if null_rows != 0 {
        out.push_str(&null);
    }
    if !lost.is_empty() {
        // Named, so a reader can open their logs (`<name>.client`).
        let _ = writeln!(
            out,
            "{} run(s) gave no figure (no table, or 0 or inf in it), left out of medians and ranges: {}",
            lost.len(),
            lost.join(", ")
        );
    }
    out.push_str(&best);
    (out, lost.len())
}

/// The tools of a guest round, as their logs are named.
const TOOLS: [&str; 4] = ["perftest", "ucx", "gpu-rdma", AGAIN];

/// perftest's second run in a round, under `--null`.
const AGAIN: &str = "perftest-again";

/// A kept guest run of `compare`: its folder of logs and how many of its
/// rounds to read.
struct Run {
    dir: PathBuf,
    rounds: usize,
}

/// A client's log: `<case>-<tool>-<round>.client` in a run's folder.
fn log_path(dir: &Path, c: &Case, tool: &str, round: usize) -> PathBuf {
    dir.join(format!("{}-{tool}-{round}.client", c.name()))
}

/// A tool's figure in each round of a case, over every run in turn
/// (`pick` reads it from the client's log), `None` in a round that has
/// none; and those rounds, named as their logs are (with their run's
/// folder when there are several).
fn per_round(
    runs: &[Run],
    c: &Case,
    tool: &str,
    pick: &dyn Fn(&str) -> Option<f64>,
) -> (Vec<Option<f64>>, Vec<String>) {
    let mut values = Vec::new();
    let mut without = Vec::new();
    for run in runs {
        for r in 0..run.rounds {
            let value = pick(&fs::read_to_string(log_path(&run.dir, c, tool, r)).unwrap_or_default());
            if value.is_none() {
                let name = format!("{}-{tool}-{r}", c.name());
                without.push(if runs.len() > 1 { format!("{}/{name}", run.dir.display()) } else { name });
            }
            values.push(value);
        }
    }
    (values, without)
}

/// How many rounds a kept run holds: one past the highest round of any
/// case's log in its folder.
fn rounds_in(dir: &Path, cases: &[Case]) -> usize {
    let Ok(entries) = fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let stem = name.strip_suffix(".client")?;
            let (case_tool, round) = stem.rsplit_once('-')?;
            let ours = |c: &Case| TOOLS.iter().any(|t| case_tool.strip_suffix(t) == Some(&format!("{}-", c.name())));
            let round: usize = round.parse().ok()?;
            cases.iter().any(ours).then_some(round + 1)
        })
        .max()
        .unwrap_or(0)
}

/// Pooled rounds must have run what this compare runs: a run whose
/// perftest or gpu-rdma log shows another iteration count for a case (an
/// older compare's settings) is refused, as is a folder with no rounds.
fn check_settings(dir: &Path, cases: &[Case], rounds: usize) -> Result<()> {
    if rounds == 0 {
        return Err(format!("{}: no rounds of these cases (no <case>-<tool>-<round>.client logs)", dir.display()));
    }
    for c in cases {
        for tool in ["perftest", "gpu-rdma"] {
            for r in 0..rounds {
                let log = fs::read_to_string(log_path(dir, c, tool, r)).unwrap_or_default();
                if let Some(n) = column(&log, c.size, 1).filter(|n| *n != f64::from(c.iters)) {
                    return Err(format!(
                        "{}: {tool} ran {} with {n} iterations, where this compare runs {}: \
                         pool only runs of the same settings",
                        dir.display(),
                        c.name(),
                        c.iters
                    ));
                }
            }
        }
    }
    Ok(())
}

/// One tool judged against an anchor run just before and just after it in
/// each round: the medians (the anchor's of each round's two runs), the
/// ratio of the medians, the paired range against both anchor runs of each
/// round, and the null (the anchor's second run over its first).
struct Sandwiched {
    ours: Option<f64>,
    anchor: Option<f64>,
    ratio: Option<f64>,
    range: Option<RatioRange>,
    null: Option<RatioRange>,
}

fn sandwiched(ours: &[Option<f64>], first: &[Option<f64>], again: &[Option<f64>]) -> Sandwiched {
    let both = round_means(first, again);
    let (g, a) = (median(figures(ours)), median(figures(&both)));
    Sandwiched {
        ours: g,
        anchor: a,
        ratio: ratio_of(g, a),
        range: paired_range(ours, &both),
        null: paired_range(again, first),
    }
}

/// Each round's geometric mean of a tool's two runs (none where either
/// has no figure).
fn round_means(a: &[Option<f64>], b: &[Option<f64>]) -> Vec<Option<f64>> {
    a.iter().zip(b).map(|(a, b)| Some(((*a)? * (*b)?).sqrt())).collect()
}

/// The rounds' figures, without the rounds that have none.
fn figures(rounds: &[Option<f64>]) -> Vec<f64> {
    rounds.iter().flatten().copied().collect()
}

/// `num / den`, when both are figures.
fn ratio_of(num: Option<f64>, den: Option<f64>) -> Option<f64> {
    match (num, den) {
        (Some(n), Some(d)) if d > 0.0 => Some(n / d),
        _ => None,
    }
}

/// A ratio as `1.02x`.
fn times(ratio: Option<f64>) -> String {
    ratio.map_or("-".to_owned(), |r| format!("{r:.2}x"))
}

/// perftest's and gpu-rdma's best round of a case (the least latency, the
/// most bandwidth) and their ratio. Noise in the guest only ever adds time,
/// and every tool reaches the guest's fast mode in some rounds of a long
/// enough run: the best round is the nearest to a tool's own cost, where a
/// median mixes the modes in whatever share the run drew.
fn best_row(c: &Case, perftest: &[Option<f64>], ours: &[Option<f64>]) -> String {
    let unit = if c.is_bw() { "MiB/s" } else { "us" };
    let best =
        |v: &[Option<f64>]| v.iter().flatten().copied().reduce(|a, b| if c.is_bw() { a.max(b) } else { a.min(b) });
    let (p, g) = (best(perftest), best(ours));
    let show = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2} {unit}"));
    let ratio = match (p, g) {
        (Some(p), Some(g)) if p > 0.0 => format!("{:.2}x", g / p),
        _ => "-".to_owned(),
    };
    format!("{:>14} {:>14}  {:>7}", show(p), show(g), ratio)
}

/// A ratio range as `lo-hi`.
fn show_range(r: Option<RatioRange>) -> String {
    r.map_or("-".to_owned(), |r| format!("{:.2}-{:.2}", r.lo, r.hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_between_two_anchor_runs_is_judged_against_both() {
        let ours = [Some(90.0), Some(100.0), None];
        let (first, again) = ([Some(100.0), Some(81.0), Some(1.0)], [Some(100.0), Some(121.0), None]);
        assert_eq!(round_means(&first, &again), vec![Some(100.0), Some(99.0), None]);
        let j = sandwiched(&ours, &first, &again);
        assert_eq!((j.ours, j.anchor), (Some(95.0), Some(99.5)));
        assert_eq!(j.ratio, Some(95.0 / 99.5));
        let null = j.null.expect("two rounds with both anchor runs");
        assert!((null.lo..=null.hi).contains(&1.0) && null.hi > 1.0, "{null:?}");
    }

    #[test]
    fn each_tool_follows_every_other_equally_often_and_takes_every_place() {
        for n in 1..=6 {
            let rows = balanced_orders(n);
            assert_eq!(rows.len(), if n % 2 == 0 { n } else { 2 * n }, "{n} tools");
            let mut after = vec![vec![0; n]; n];
            let mut place = vec![vec![0; n]; n];
            for row in &rows {
                let mut sorted = row.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "{row:?}: every tool once");
                for (p, &t) in row.iter().enumerate() {
                    place[t][p] += 1;
                }
                for w in row.windows(2) {
                    after[w[1]][w[0]] += 1;
                }
            }
            let times = rows.len() / n;
            assert!(place.iter().flatten().all(|&c| c == times), "{n} tools: places {place:?}");
            // Each of the n(n-1) ordered pairs is adjacent equally often.
            for (b, row) in after.iter().enumerate() {
                for (a, &c) in row.iter().enumerate() {
                    assert_eq!(c, if a == b { 0 } else { times }, "{n} tools: {a} then {b}");
                }
            }
        }
        // With --null the tools are perftest, ucx, perftest again and
        // gpu-rdma: the first order runs perftest, ucx, gpu-rdma, then
        // perftest again.
        assert_eq!(balanced_orders(4)[0], [0, 1, 3, 2]);
    }

    #[test]
    fn reads_the_figure_from_perftest_and_gpu_rdma_tables() {
        let perftest = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
                        65536      1000             19.97              18.24  \t\t   0.000292\n";
        assert_eq!(figure(perftest, 65536, true), Some(18.24));
        let lat = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec] ...\n \
                   2       1000          29.87          1408.71      54.77    \t       60.42\n";
        assert_eq!(figure(lat, 2, false), Some(54.77));
        assert_eq!(figure(lat, 4096, false), None);
        assert_eq!(min_latency(lat, 2), Some(29.87));
        assert_eq!(figure("65536 1000 1 2 3", 65536, true), None, "no header, no figure");
        // What perftest prints when a run failed to time itself: no figure.
        let zero = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
                    1048576    100              0.00               0.00   \t\t   0.000000\n";
        assert_eq!(figure(zero, 1 << 20, true), None);
        let inf = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec] ...\n \
                   64      5000          inf            inf          inf      \t       inf\n";
        assert_eq!(figure(inf, 64, false), None);
        assert_eq!(min_latency(inf, 64), None);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0]), Some(2.5));
        let ucx = "|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |\n\
                   Final:                  2000      4.011     8.168     8.168        7.47       7.47      122436      122436\n";
        assert_eq!(ucx_figure(ucx, false), Some(4.011));
        assert_eq!(ucx_figure(ucx, true), Some(7.47));
        // The last stretch had no iteration: its average is 0.00 and `inf`,
        // the whole run's figures are there (a guest's 1 MiB get).
        let last_empty = "Final:                   100  20113.000       inf 20113.740        0.00      49.72           0          50\n";
        assert_eq!(ucx_figure(last_empty, true), Some(49.72));
        assert_eq!(ucx_figure(last_empty, false), Some(20113.0));
        // The two bandwidth columns differ: the whole run's is taken.
        let differ = "Final: 100 10.0 11.0 12.0 40.00 45.50 0 0\n";
        assert_eq!(ucx_figure(differ, true), Some(45.5));
        assert_eq!(ucx_figure("no final line", true), None);
    }

    /// A kept run's folder with a 2-byte send-lat case's client logs:
    /// `(perftest, gpu-rdma)` typical latencies per round (UCX's as
    /// perftest's), run with `iters`.
    fn kept_run(name: &str, rounds: &[(f64, f64)], iters: u32) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-compare-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let log = |typical: f64| {
            format!(
                " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]\n 2  {iters}  10.00  99.00  {typical}\n"
            )
        };
        for (r, (pt, ours)) in rounds.iter().enumerate() {
            fs::write(dir.join(format!("send-lat-2-perftest-{r}.client")), log(*pt)).unwrap();
            fs::write(dir.join(format!("send-lat-2-gpu-rdma-{r}.client")), log(*ours)).unwrap();
            let ucx = format!("Final: {iters} {pt} {pt} {pt} 0 0 0 0\n");
            fs::write(dir.join(format!("send-lat-2-ucx-{r}.client")), ucx).unwrap();
        }
        // Another case's log, and a server's, count no rounds.
        fs::write(dir.join("send-lat-8-perftest-9.client"), log(1.0)).unwrap();
        fs::write(dir.join("send-lat-2-perftest-9.server"), "").unwrap();
        dir
    }

    #[test]
    fn one_case_is_chosen_by_test_and_size_and_a_miss_names_the_sizes_there_are() {
        let names = |c: Vec<Case>| c.iter().map(Case::name).collect::<Vec<_>>();
        assert_eq!(names(chosen(Some("send-lat"), Some(1024)).unwrap()), ["send-lat-1024"]);
        assert_eq!(names(chosen(None, Some(1 << 20)).unwrap()), ["write-bw-1048576", "read-bw-1048576"]);
        assert_eq!(chosen(None, None).unwrap().len(), cases().len());
        let e = chosen(Some("send-lat"), Some(1000)).err().unwrap();
        assert!(e.contains("send-lat runs at 2, 64, 1024, 4096 bytes"), "{e}");
        let e = chosen(None, Some(3)).err().unwrap();
        assert!(e.starts_with("--size 3: no case") && e.contains("4096, 65536, 1048576"), "{e}");
        assert!(chosen(Some("send-bw"), None).err().unwrap().contains("no such test"));
    }

    #[test]
    fn the_null_pairs_perftest_with_itself_only_where_it_ran_twice() {
        let cases: Vec<Case> = cases().into_iter().filter(|c| c.test == "send-lat" && c.size == 2).collect();
        let iters = cases[0].iters;
        let rounds = [(20.0, 21.0), (30.0, 30.0), (25.0, 24.0), (22.0, 23.0), (26.0, 27.0)];
        let dir = kept_run("null", &rounds, iters);
        let runs = [Run { dir: dir.clone(), rounds: rounds.len() }];
        let (table, _) = report(&runs, &cases);
        assert!(!table.contains("the null"), "no second perftest run, no null: {table}");
        // perftest's second run 10% slower than its first in every round:
        // the null's ratio is 1.10x, and the goal (at most 1.05x) MISSED.
        for (r, (pt, _)) in rounds.iter().enumerate() {
            let log = format!(
                " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]\n 2  {iters}  11.00  99.00  {}\n",
                pt * 1.1
            );
            fs::write(dir.join(format!("send-lat-2-{AGAIN}-{r}.client")), log).unwrap();
        }
        assert_eq!(rounds_in(&dir, &cases), rounds.len());
        let (table, missing) = report(&runs, &cases);
        assert_eq!(missing, 0, "{table}");
        let null = table.split("the null").nth(1).unwrap_or_else(|| panic!("a null section: {table}"));
        let typical = null.lines().find(|l| l.starts_with("send-lat")).expect("the typical latency's row");
        assert!(typical.contains("1.10x") && typical.contains("1.10-1.10       5 "), "{typical}");
        assert!(typical.contains("<= 1.05x MISSED"), "{typical}");
        // gpu-rdma against both perftest runs, their geometric mean: the
        // Hodges-Lehmann estimate of ours over perftest's first (1.022x)
        // over the square root of 1.10.
        let vs_both = |row: &str| row.split_whitespace().rev().nth(1).unwrap_or_default().to_owned();
        assert_eq!(vs_both(typical), "0.97x", "{typical}");
        // The minimum: 11 us over 10 us in every round; ours 10 us against
        // the square root of 10 x 11.
        let least = null.lines().find(|l| l.starts_with("  (min)")).expect("the minimum's row");
        assert!(least.contains("1.10x"), "{least}");
        assert_eq!(vs_both(least), "0.95x", "{least}");
        let _ = fs::remove_dir_all(dir);
    }

    #[test]
    fn kept_runs_pool_their_rounds_and_refuse_other_settings() {
        let cases: Vec<Case> = cases().into_iter().filter(|c| c.test == "send-lat" && c.size == 2).collect();
        let iters = cases[0].iters;
        let a = kept_run("a", &[(20.0, 21.0), (30.0, 30.0), (25.0, 24.0)], iters);
        let b = kept_run("b", &[(22.0, 22.0), (26.0, 27.0)], iters);
        assert_eq!(rounds_in(&a, &cases), 3);
        assert_eq!(rounds_in(&b, &cases), 2);
        assert!(check_settings(&a, &cases, 3).is_ok());
        let runs = [Run { dir: a.clone(), rounds: 3 }, Run { dir: b.clone(), rounds: 2 }];
        let typical = |log: &str| figure(log, 2, false);
        let (values, without) = per_round(&runs, &cases[0], "gpu-rdma", &typical);
        assert_eq!(values, [21.0, 30.0, 24.0, 22.0, 27.0].map(Some));
        assert!(without.is_empty(), "{without:?}");
        // A round without a figure is named with its run.
        fs::write(b.join("send-lat-2-gpu-rdma-0.client"), "no table").unwrap();
        let (values, without) = per_round(&runs, &cases[0], "gpu-rdma", &typical);
        assert_eq!(values, [Some(21.0), Some(30.0), Some(24.0), None, Some(27.0)]);
        assert_eq!(without.len(), 1);
        assert!(without[0].ends_with("-b/send-lat-2-gpu-rdma-0"), "named with its run: {}", without[0]);
        let b = kept_run("b", &[(22.0, 22.0), (26.0, 27.0)], iters);
        let (table, missing) = report(&runs, &cases);
        assert_eq!(missing, 0);
        assert!(table.contains("medians of 5 rounds"), "{table}");
        assert!(table.contains("pooled: the rounds of 2 kept runs"), "{table}");
        // A run of an older compare's iteration count is not pooled.
        let old = kept_run("old", &[(20.0, 20.0)], iters / 10);
        let refused = check_settings(&old, &cases, 1).unwrap_err();
        assert!(refused.contains("iterations"), "{refused}");
        assert!(check_settings(&old, &cases, 0).is_err(), "a run with no rounds");
        for d in [a, b, old] {
            let _ = fs::remove_dir_all(d);
        }
    }
}
