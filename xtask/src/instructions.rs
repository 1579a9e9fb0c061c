//! `cargo xtask instructions`: the CPU cost of one `send-lat` iteration,
//! perftest's `ib_send_lat` and UCX's `ucx_perftest -t tag_lat` beside
//! `gpu-rdma bench send-lat`, on rxe0 in the guest, counted by callgrind:
//! the counted side (the client, or the server with `--server`) runs
//! 1,000 and then 3,000 iterations under callgrind, and the difference of
//! the two totals over 2,000 is the cost of an iteration, with start-up
//! and teardown cancelled out. The other side runs natively. Instruction
//! counts are steady where times in an emulated machine are not.
//!
//! It prints a second count per tool: the loop alone, with the function
//! that sorts and summarises the samples afterwards (`REPORT_FNS`) taken
//! out of both runs' totals. Sorting grows as n log n, so it does not
//! cancel in the difference, and perftest's `qsort` is costlier than
//! ours: the first count makes perftest's loop look costlier than it is,
//! and so ours closer to it; the second does not.
//!
//! `--size N` (default 2): the message size; above rxe0's inline limit,
//! our sends go from the ring of persistent sends. The server's
//! turnaround (from a message to its reply) is on every round trip's path.
//!
//! `--keep` keeps the guest's run directory, with each run's callgrind
//! files, for `callgrind_annotate`; their counts go down to each
//! instruction (`--dump-instr=yes`), to read against `objdump -d`.
//!
//! It also prints each tool's calls per iteration (callgrind's call
//! counts), and with `--memory` its loads and stores per iteration
//! (callgrind's cache simulation, which makes the counted side slower):
//! in the guest, QEMU's TCG charges a load or a store, and a call and
//! return, several times what it charges an ALU instruction, so where the
//! counts of two tools differ, these say what the difference costs there.
//! Both include the samples' sort and report after the loop.
//!
//! `--both` runs the other side under callgrind too, uncounted. With one
//! side slowed, its peer answers before it looks, so the counted side's
//! first poll finds each message; with both slowed, it spins for each one
//! as in a timed run, and the path a message takes from the poll that
//! finds it to the next post is the one counted. The totals then include
//! that spin and move with timing: read a kept run with `cargo xtask hot
//! --once`, which keeps the instructions that ran about once an iteration.
//!
//! `--runs N` (default 3) counts N times in one boot, the tools alternating,
//! and prints each count and their median: both tools' counts include a
//! busy poll that spins in wall time until the reply arrives, so they move
//! from run to run with how the two sides' timing fell (perftest's by
//! hundreds of instructions, ours by about 130, one empty poll an
//! iteration).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::time::Duration;

use crate::vm::{self, VmOptions};
use crate::{Result, cargo, root, run as run_cmd, setup};

/// The guest's script: `SIZE`, `SIDE` (client or server), `RUNS`, `KEEP`
/// (1 for a kept run) and `CG_OPTS` (callgrind's extra options) are set
/// before it.
const SCRIPT: &str = r#"
B=target/release/gpu-rdma
# UCX's transports as compare runs them; the other tools ignore these.
export UCX_TLS=rc_verbs,ud_verbs,self UCX_NET_DEVICES=rxe0:1
for run in $(seq 0 $((RUNS - 1))); do
for tool in perftest gpu-rdma ucx; do
  for n in 1000 3000; do
    if [ $tool = perftest ]; then
      srv="ib_send_lat -d rxe0 -x 0 -F -s $SIZE -n $n"; cli="$srv 127.0.0.1"; port=18515
    elif [ $tool = ucx ]; then
      # The same warm-up in both lengths: it cancels.
      srv="ucx_perftest -t tag_lat -s $SIZE -n $n -w 100 -p 13337"
      cli="ucx_perftest 127.0.0.1 -t tag_lat -s $SIZE -n $n -w 100 -p 13337"; port=13337
    else
      srv="$B bench send-lat --bind 127.0.0.1 -p 18600 -n $n -s $SIZE -d rxe0"
      cli="$B bench send-lat 127.0.0.1 -p 18600 -n $n -s $SIZE -d rxe0"; port=18600
    fi
    cg="$VM_OUT/$tool-$run-$n.cg"
    counted="valgrind --tool=callgrind $CG_OPTS --callgrind-out-file=$cg"
    # With BOTH=1 the other side runs under callgrind too, uncounted: as
    # slow as the counted side, so the counted side spins for each message.
    other=
    if [ "$BOTH" = 1 ]; then other="valgrind --tool=callgrind --callgrind-out-file=$VM_OUT/$tool-$run-$n.other.cg"; fi
    if [ $SIDE = server ]; then srv="$counted $srv"; cli="$other $cli"; else cli="$counted $cli"; srv="$other $srv"; fi
    timeout 600 $srv > "$VM_OUT/$tool-$run-$n.server" 2>&1 &
    sp=$!
    # The client starts once its server listens (under callgrind, seconds).
    for i in $(seq 600); do ss -ltn | grep -q ":$port " && break; sleep 0.05; done
    timeout 600 $cli > "$VM_OUT/$tool-$run-$n.client" 2>&1
    crc=$?
    wait $sp
    # Both sides' exit statuses: a run that failed has no count.
    echo "$crc $?" > "$VM_OUT/$tool-$run-$n.status"
    # Inclusive costs, for the report's share (its sort grows faster than the loop).
    (cd "$VM_OUT" && callgrind_annotate --inclusive=yes --auto=no --threshold=100 --show-percs=no "$cg" > "$cg.incl" 2>/dev/null)
  done
done
done
# A kept run keeps the binary it counted, for reading its counts against
# its disassembly (`cargo xtask hot`) after the next build.
if [ "$KEEP" = 1 ]; then cp "$B" "$VM_OUT/gpu-rdma"; fi
callgrind_annotate "$VM_OUT/gpu-rdma-0-3000.cg" 2>/dev/null | sed -n '/file:function/,$p' | grep 'gpu-rdma\]' | head -25 > "$VM_OUT/profile.txt"
exit 0
"#;

/// The total instruction count in a callgrind output file.
pub fn total(cg: &str) -> Option<u64> {
    cg.lines()
        .find_map(|l| l.strip_prefix("summary:").or_else(|| l.strip_prefix("totals:")))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// An event's total in a callgrind output file: its place in the
/// `events:` line, that place in the `summary:` (or `totals:`) line.
pub fn event_total(cg: &str, event: &str) -> Option<u64> {
    let names = cg.lines().find_map(|l| l.strip_prefix("events:"))?;
    let at = names.split_whitespace().position(|n| n == event)?;
    cg.lines()
        .find_map(|l| l.strip_prefix("summary:").or_else(|| l.strip_prefix("totals:")))?
        .split_whitespace()
        .nth(at)?
        .parse()
        .ok()
}

/// The calls made in a callgrind output file: the sum of its `calls=N`
/// lines (each call site's count, once, under its caller).
pub fn calls(cg: &str) -> Option<u64> {
    cg.lines()
        .filter_map(|l| l.strip_prefix("calls="))
        .map(|rest| rest.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()))
        .sum()
}

/// The function each tool sorts and summarises its samples in, once the
/// loop is over: perftest's `qsort` of its cycle counts, our report.
/// Sorting n samples costs about n log n, so it does not cancel in the
/// difference of two run lengths; at 2 B perftest's `qsort` adds about
/// 375 instructions to each of its iterations so counted, ours about 50.
const REPORT_FNS: [&str; 2] = ["qsort", "gpu_rdma::bench::report::LatRow::from_ticks"];

/// The inclusive count of the report's function (`REPORT_FNS`) in
/// `callgrind_annotate --inclusive=yes` output. The function can appear
/// on several lines, one per source file its code came from (code inlined
/// into it), and which of them holds the whole depends on where the
/// listing was made (whether the sources resolve): the largest is the
/// whole, since each other line counts a part of it. 0 when a listing
/// does not name it (a side that reports nothing: our bench's server);
/// `None` when `listing` is none (the annotation failed).
pub fn report_cost(listing: &str) -> Option<u64> {
    if !listing.contains("file:function") {
        return None;
    }
    let named = listing
        .lines()
        .filter_map(|line| {
            let (count, rest) = line.trim_start().split_once(char::is_whitespace)?;
            let rest = rest.trim();
            // "FILE:FUNCTION", with " [OBJECT]" after it on some lines.
            let place = rest.rsplit_once(" [").map_or(rest, |(place, _object)| place);
            let (_file, function) = place.split_once(':')?;
            REPORT_FNS.contains(&function).then(|| count.replace(',', "").parse::<u64>().ok())?
        })
        .max();
    Some(named.unwrap_or(0))
}

/// What one clean run of one length counted: its instructions, its
/// report function's share of them, its calls, and (with `--memory`) its
/// loads and stores.
struct Counted {
    total: u64,
    report: Option<u64>,
    calls: Option<u64>,
    loads: Option<u64>,
    stores: Option<u64>,
}

/// The tools counted, as the guest's script names them: perftest's
/// `ib_send_lat` (raw verbs), ours, and UCX's `ucx_perftest -t tag_lat`
/// (UCP's tagged sends over rc_verbs: a library's ping-pong, as ours is).
const TOOLS: [&str; 3] = ["perftest", "gpu-rdma", "ucx"];

/// What to count: the message size, which side, and how many times.
#[derive(Debug, PartialEq)]
struct Options {
    size: u32,
    server: bool,
    runs: u32,
    /// Keep the guest's run directory (the callgrind files, for
    /// `callgrind_annotate`) even when every tool was counted.
    keep: bool,
    /// Count loads and stores too (callgrind's cache simulation).
    memory: bool,
    /// Run the other side under callgrind too (uncounted).
    both: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options { size: 2, server: false, runs: 3, keep: false, memory: false, both: false };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--size" => {
                let n = it.next().ok_or("--size needs a number of bytes")?;
                o.size = n.parse().ok().filter(|s| *s > 0).ok_or_else(|| format!("--size {n}: not a size"))?;
            }
            "--server" => o.server = true,
            "--keep" => o.keep = true,
            "--memory" => o.memory = true,
            "--both" => o.both = true,
            "--runs" => {
                let n = it.next().ok_or("--runs needs a number")?;
                o.runs = n.parse().ok().filter(|r| *r > 0).ok_or_else(|| format!("--runs {n}: not a count"))?;
            }
            _ => {
                return Err(format!(
                    "instructions takes --size N, --server, --runs N, --keep, --memory and --both; got {args:?}"
                ));
            }
        }
    }
    Ok(o)
}

/// One iteration's count from the totals of a 1,000- and a 3,000-iteration
/// run: start-up and teardown cancel.
fn per_iteration(short: Option<u64>, long: Option<u64>) -> Option<u64> {
    match (short, long) {
        (Some(a), Some(b)) if b > a => Some((b - a) / 2000),
        _ => None,
    }
}

/// The median of counts (the lower middle one of an even number).
fn median_count(counts: &[u64]) -> Option<u64> {
    let mut v = counts.to_vec();
    v.sort_unstable();
    v.get(v.len().checked_sub(1)? / 2).copied()
}

/// Whether a run finished as it should: both sides exited 0 (`status`,
/// "CLIENT SERVER"), and UCX's client printed its `Final:` line with a
/// usable latency, as compare reads it (`ucx_figure`): a count of a run
/// that failed part-way would be a count of something else.
fn ran_clean(tool: &str, status: &str, client_log: &str) -> bool {
    let exits: Vec<&str> = status.split_whitespace().collect();
    let clean = exits.len() == 2 && exits.iter().all(|e| *e == "0");
    clean && (tool != "ucx" || crate::compare::ucx_figure(client_log, false).is_some())
}

/// The median of per-run counts, when every run gave one.
fn median_of_all(counts: &[Option<u64>]) -> Option<u64> {
    let got: Vec<u64> = counts.iter().flatten().copied().collect();
    if got.len() == counts.len() { median_count(&got) } else { None }
}

pub fn command(args: &[String]) -> Result<i32> {
    let o = parse(args)?;
    let side = if o.server { "server" } else { "client" };
    let kernel = setup::setup()?;
    run_cmd(cargo().args(["build", "--release", "--features", "cli", "--bin", "gpu-rdma"]))?;
    println!(
        "xtask: instructions: ib_send_lat, gpu-rdma bench send-lat and ucx_perftest tag_lat, the {side} under \
         callgrind on rxe0{}, {} B, 1,000 and 3,000 iterations, {} run(s)",
        if o.both { " (the other side too, uncounted)" } else { "" },
        o.size,
        o.runs
    );
    let opts = VmOptions { timeout: Duration::from_secs(1800), keep: o.keep, ..VmOptions::default() };
    // A kept run's counts go down to each instruction, for reading the hot
    // path against its disassembly (`cargo xtask hot`; the guest keeps the
    // binary with them).
    let cg_opts = [(o.keep, "--dump-instr=yes"), (o.memory, "--cache-sim=yes")]
        .iter()
        .filter_map(|&(on, opt)| on.then_some(opt))
        .collect::<Vec<_>>()
        .join(" ");
    let script = format!(
        "SIZE={}\nSIDE={side}\nRUNS={}\nKEEP={}\nBOTH={}\nCG_OPTS='{cg_opts}'\n{SCRIPT}",
        o.size,
        o.runs,
        u8::from(o.keep),
        u8::from(o.both)
    );
    let mut guest = vm::run_script(&kernel, &root(), &script, &opts)?;
    let mut out = String::new();
    // Each tool's median count, when every run gave one.
    let mut per = BTreeMap::new();
    // Each tool's median count of the loop alone.
    let mut per_loop = BTreeMap::new();
    for tool in TOOLS {
        let read = |run: u32, n: u32, ext: &str| {
            fs::read_to_string(guest.dir.join(format!("{tool}-{run}-{n}.{ext}"))).unwrap_or_default()
        };
        // A clean run's counts, its callgrind file read once.
        let measured = |run: u32, n: u32| {
            if !ran_clean(tool, &read(run, n, "status"), &read(run, n, "client")) {
                return None;
            }
            let cg = read(run, n, "cg");
            Some(Counted {
                total: total(&cg)?,
                report: report_cost(&read(run, n, "cg.incl")),
                calls: calls(&cg),
                loads: event_total(&cg, "Dr"),
                stores: event_total(&cg, "Dw"),
            })
        };
        // Each run's two lengths, each read once.
        let lengths: Vec<_> = (0..o.runs).map(|r| (measured(r, 1000), measured(r, 3000))).collect();
        // One count per run, per iteration: the two lengths' difference.
        let per_run = |count: fn(&Counted) -> Option<u64>| -> Vec<Option<u64>> {
            lengths.iter().map(|(a, b)| per_iteration(a.as_ref().and_then(count), b.as_ref().and_then(count))).collect()
        };
        let counts = per_run(|c| Some(c.total));
        // The same without the report's function.
        let loops = per_run(|c| c.total.checked_sub(c.report?));
        let show =
            |v: &[Option<u64>]| v.iter().map(|c| c.map_or("-".to_owned(), |c| c.to_string())).collect::<Vec<_>>();
        let shown = show(&counts);
        // What TCG charges more for: calls, and (counted) loads and stores.
        let mut extra = vec![("calls", per_run(|c| c.calls))];
        if o.memory {
            extra.push(("loads", per_run(|c| c.loads)));
            extra.push(("stores", per_run(|c| c.stores)));
        }
        match median_of_all(&counts) {
            Some(m) => {
                per.insert(tool, m);
                let _ = writeln!(
                    out,
                    "{tool:<9} {m} instructions per {side} iteration (median; runs: {})",
                    shown.join(", ")
                );
                let _ = match median_of_all(&loops) {
                    Some(l) => {
                        per_loop.insert(tool, l);
                        let runs = show(&loops).join(", ");
                        writeln!(
                            out,
                            "{:<9} {l} of them in the loop, its samples' sort and report left out (runs: {runs})",
                            ""
                        )
                    }
                    None => writeln!(out, "{:<9} no count of its report's function in some runs", ""),
                };
                for (name, v) in &extra {
                    if let Some(m) = median_of_all(v) {
                        let _ = writeln!(out, "{:<9} {m} {name} per iteration (runs: {})", "", show(v).join(", "));
                    }
                }
            }
            None => {
                let _ = writeln!(
                    out,
                    "{tool:<9} no count in some runs ({}; see {})",
                    shown.join(", "),
                    guest.dir.display()
                );
            }
        }
    }
    for anchor in ["perftest", "ucx"] {
        if let (Some(a), Some(g)) = (per.get(anchor), per.get("gpu-rdma")) {
            let _ = writeln!(out, "gpu-rdma / {anchor}: {:.2}x (medians)", *g as f64 / *a as f64);
        }
        if let (Some(a), Some(g)) = (per_loop.get(anchor), per_loop.get("gpu-rdma")) {
            let _ = writeln!(out, "gpu-rdma / {anchor}, the loops alone: {:.2}x (medians)", *g as f64 / *a as f64);
        }
    }
    print!("{out}");
    if let Ok(profile) = fs::read_to_string(guest.dir.join("profile.txt")) {
        println!("gpu-rdma's own functions, first run, 3,000 iterations (self cost):\n{profile}");
    }
    let counted = per.len() == TOOLS.len();
    if !counted || o.keep {
        // The logs of the runs without a count stay, for the "see" above
        // (with --keep, the guest run was made to stay).
        guest.keep();
        println!("(the guest's run kept in {})", guest.dir.display());
    }
    Ok(if counted { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_callgrind_totals() {
        assert_eq!(total("events: Ir\nsummary: 6815764\n"), Some(6_815_764));
        assert_eq!(total("totals: 12\n"), Some(12));
        assert_eq!(total("events: Ir\n"), None);
    }

    #[test]
    fn reads_an_events_total_by_its_place_and_sums_the_calls() {
        let cg = "events: Ir Dr Dw I1mr\nfn=(1) main\n0 5 2 1\ncalls=3 0x10\n0 9\ncfn=(2)\ncalls=40 0x20\n\
                  0 7\nsummary: 900 310 120 4\n";
        assert_eq!(event_total(cg, "Ir"), Some(900));
        assert_eq!(event_total(cg, "Dr"), Some(310));
        assert_eq!(event_total(cg, "Dw"), Some(120));
        assert_eq!(event_total(cg, "D1mw"), None, "an event not counted");
        assert_eq!(event_total("events: Ir\n", "Ir"), None, "no summary");
        assert_eq!(calls(cg), Some(43));
        assert_eq!(calls("events: Ir\nsummary: 1\n"), Some(0));
        assert_eq!(calls("calls=x 0x10\n"), None, "a count that does not parse");
    }

    #[test]
    fn a_run_counts_only_when_both_sides_exited_0_and_ucx_said_final() {
        assert!(ran_clean("perftest", "0 0\n", ""));
        assert!(!ran_clean("perftest", "0 1\n", ""), "the server failed");
        assert!(!ran_clean("gpu-rdma", "124 0\n", ""), "the client timed out");
        assert!(!ran_clean("gpu-rdma", "", ""), "no status: the script did not get that far");
        let ucx = "| Message size: 2 |\nFinal:                  3000     99.699   436.351\n";
        assert!(ran_clean("ucx", "0 0\n", ucx));
        assert!(!ran_clean("ucx", "0 0\n", "| Message size: 2 |\n"), "exit 0 without a result");
    }

    #[test]
    fn finds_the_report_functions_inclusive_count_on_its_own_line() {
        let perftest = "Ir  file:function\n\
            1,041,205  ./stdlib/./stdlib/msort.c:qsort [/usr/lib/x86_64-linux-gnu/libc.so.6]\n\
            1,041,203  ./stdlib/./stdlib/msort.c:qsort_r [/usr/lib/x86_64-linux-gnu/libc.so.6]\n";
        assert_eq!(report_cost(perftest), Some(1_041_205));
        // Made where the sources resolve: the whole on a line of its own,
        // the line with the object only the part from its own file.
        let ours = "Ir  file:function\n\
            153,729  /work/main/src/bench/report.rs:gpu_rdma::bench::report::LatRow::from_ticks\n\
            47,773  src/bench/report.rs:gpu_rdma::bench::report::LatRow::from_ticks [/work/main/target/release/gpu-rdma]\n\
            33,657  /rustc/abc/library/core/src/slice/sort/unstable/quicksort.rs:gpu_rdma::bench::report::LatRow::from_ticks\n";
        assert_eq!(report_cost(ours), Some(153_729));
        // Made elsewhere: the whole on the line with the object.
        let elsewhere = "Ir  file:function\n\
            33,657  /rustc/abc/library/core/src/slice/sort/unstable/quicksort.rs:gpu_rdma::bench::report::LatRow::from_ticks\n\
            153,729  /work/main/src/bench/report.rs:gpu_rdma::bench::report::LatRow::from_ticks [/work/main/target/release/gpu-rdma]\n";
        assert_eq!(report_cost(elsewhere), Some(153_729));
        // Another function whose name ends alike is not it; a listing
        // without it, of a side that reports nothing, says 0.
        assert_eq!(
            report_cost("Ir  file:function\n  7  x.c:my_qsort [/bin/x]\n  9  x.c:qsort_r [/lib/libc.so.6]\n"),
            Some(0)
        );
        // No listing at all (the annotation failed): no count.
        assert_eq!(report_cost(""), None);
    }

    #[test]
    fn an_iteration_is_the_difference_over_2000_and_the_median_the_middle_run() {
        assert_eq!(per_iteration(Some(3_900_000), Some(6_400_000)), Some(1250));
        assert_eq!(per_iteration(Some(6_400_000), Some(3_900_000)), None);
        assert_eq!(per_iteration(None, Some(1)), None);
        assert_eq!(median_count(&[1371, 1239, 1358]), Some(1358));
        assert_eq!(median_count(&[1371, 1239, 1358, 1247]), Some(1247));
        assert_eq!(median_count(&[]), None);
        assert_eq!(median_of_all(&[Some(3), Some(1), Some(2)]), Some(2));
        assert_eq!(median_of_all(&[Some(3), None, Some(2)]), None, "a run without a count: no median");
        assert_eq!(median_of_all(&[]), None);
    }

    #[test]
    fn parses_the_size_and_the_side() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            parse(&[]),
            Ok(Options { size: 2, server: false, runs: 3, keep: false, memory: false, both: false })
        );
        assert_eq!(
            parse(&args(&["--size", "4096", "--server", "--runs", "5", "--keep", "--memory", "--both"])),
            Ok(Options { size: 4096, server: true, runs: 5, keep: true, memory: true, both: true })
        );
        assert!(parse(&args(&["--runs", "0"])).is_err());
        assert!(parse(&args(&["--size", "0"])).is_err());
        assert!(parse(&args(&["--size"])).is_err());
        assert!(parse(&args(&["--bytes", "4"])).is_err());
    }
}
