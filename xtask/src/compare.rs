//! `cargo xtask compare`: perftest and `gpu-rdma bench` side by side on
//! rxe0 in one guest run, interleaved (each round alternates which goes
//! first, so drift in the emulated machine hits both), with the same sizes
//! and iteration counts; a table of medians over the rounds and the ratios.
//! Absolute speeds in the guest mean nothing; the ratios do.

use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::time::Duration;

use crate::vm::{self, VmOptions};
use crate::{Result, cargo, root, run as run_cmd, setup};

/// One measurement: a test at a size.
struct Case {
    test: &'static str,
    perftest: &'static str,
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
    for (test, perftest) in [("write-bw", "ib_write_bw"), ("read-bw", "ib_read_bw")] {
        v.push(Case { test, perftest, size: 64 << 10, iters: 1000 });
        v.push(Case { test, perftest, size: 1 << 20, iters: 100 });
    }
    // Latency runs are short next to process start-up: 5000 ping-pongs
    // steady the median at little cost.
    for size in [2, 64, 1024, 4096] {
        v.push(Case { test: "send-lat", perftest: "ib_send_lat", size, iters: 5000 });
    }
    v
}

const PAIR: &str = r#"
pair() { # name, server command, client command
  timeout 600 $2 > "$VM_OUT/$1.server" 2>&1 &
  local sp=$!
  sleep 1
  timeout 600 $3 > "$VM_OUT/$1.client" 2>&1
  echo $? > "$VM_OUT/$1.rc"
  wait $sp
  echo "  $1: exit $(cat "$VM_OUT/$1.rc")"
}
B=target/release/gpu-rdma
"#;

/// The figure a client printed for `size`: average bandwidth (MiB/s) for a
/// bandwidth test, typical latency (usec) for a latency test. perftest's and
/// gpu-rdma's tables share their columns.
pub fn figure(log: &str, size: u64, bw: bool) -> Option<f64> {
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
            return f.get(if bw { 3 } else { 4 }).and_then(|s| s.parse().ok());
        }
    }
    None
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

pub fn command(args: &[String]) -> Result<i32> {
    let rounds: usize = match args {
        [] => 3,
        [flag, n] if flag == "--rounds" => n.parse().map_err(|_| format!("--rounds {n}: not a number"))?,
        _ => return Err(format!("compare takes --rounds N (default 3); got {args:?}")),
    };
    let kernel = setup::setup()?;
    run_cmd(cargo().args(["build", "--release", "--bin", "gpu-rdma"]))?;
    let cases = cases();
    let mut script = String::from(PAIR);
    for round in 0..rounds {
        let _ = writeln!(script, "echo 'round {}'", round + 1);
        for (i, c) in cases.iter().enumerate() {
            let pt = format!("{} -d rxe0 -x 0 -F -s {} -n {}", c.perftest, c.size, c.iters);
            let gr = format!("$B bench {} -d rxe0 -p 18516 -s {} -n {}", c.test, c.size, c.iters);
            let both = [("perftest", pt, "127.0.0.1"), ("gpu-rdma", gr, "127.0.0.1")];
            let order: Vec<&(&str, String, &str)> =
                if (round + i) % 2 == 0 { both.iter().collect() } else { both.iter().rev().collect() };
            for (tool, cmd, host) in order {
                let _ = writeln!(script, "pair {}-{tool}-{round} \"{cmd}\" \"{cmd} {host}\"", c.name());
            }
        }
    }
    script.push_str("exit 0\n");
    println!(
        "xtask: compare: {} cases x {rounds} rounds, perftest and gpu-rdma bench interleaved on rxe0",
        cases.len()
    );
    let opts = VmOptions { timeout: Duration::from_secs(3600), keep: true, ..VmOptions::default() };
    let guest = vm::run_script(&kernel, &root(), &script, &opts)?;
    let (table, missing) = report(&guest.dir, &cases, rounds);
    print!("{table}");
    let _ = fs::write(root().join("target/compare.txt"), &table);
    println!("(also in target/compare.txt; guest logs in {})", guest.dir.display());
    Ok(if missing == 0 && guest.code == 0 { 0 } else { 1 })
}

/// The table, and how many runs gave no figure.
fn report(dir: &Path, cases: &[Case], rounds: usize) -> (String, usize) {
    let mut out = String::new();
    let mut missing = 0;
    let _ = writeln!(
        out,
        "\n{:<10} {:>9} {:>7}  {:>14} {:>14}  {:>7}  goal",
        "test", "bytes", "iters", "perftest", "gpu-rdma", "ratio"
    );
    for c in cases {
        let mut med = [None, None];
        for (k, tool) in ["perftest", "gpu-rdma"].iter().enumerate() {
            let vals: Vec<f64> = (0..rounds)
                .filter_map(|r| {
                    let log =
                        fs::read_to_string(dir.join(format!("{}-{tool}-{r}.client", c.name()))).unwrap_or_default();
                    let v = figure(&log, c.size, c.is_bw());
                    if v.is_none() {
                        missing += 1;
                    }
                    v
                })
                .collect();
            med[k] = median(vals);
        }
        let unit = if c.is_bw() { "MiB/s" } else { "us" };
        let show = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2} {unit}"));
        let ratio = match med {
            [Some(p), Some(g)] if p > 0.0 => Some(g / p),
            _ => None,
        };
        // Bandwidth: higher is better, at least 1.00x from 64 KiB. Latency:
        // lower is better, at most 1.05x up to 4 KiB.
        let (goal, met) = match (c.is_bw(), ratio) {
            (true, Some(r)) => (">= 1.00x", r >= 1.0),
            (false, Some(r)) => ("<= 1.05x", r <= 1.05),
            (bw, None) => (if bw { ">= 1.00x" } else { "<= 1.05x" }, false),
        };
        let _ = writeln!(
            out,
            "{:<10} {:>9} {:>7}  {:>14} {:>14}  {:>7}  {goal} {}",
            c.test,
            c.size,
            c.iters,
            show(med[0]),
            show(med[1]),
            ratio.map_or("-".to_owned(), |r| format!("{r:.2}x")),
            if met { "met" } else { "MISSED" }
        );
    }
    let _ = writeln!(out, "medians of {rounds} rounds; bandwidth: BW average; latency: t_typical (median), one-way");
    (out, missing)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_figure_from_perftest_and_gpu_rdma_tables() {
        let perftest = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
                        65536      1000             19.97              18.24  \t\t   0.000292\n";
        assert_eq!(figure(perftest, 65536, true), Some(18.24));
        let lat = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec] ...\n \
                   2       1000          29.87          1408.71      54.77    \t       60.42\n";
        assert_eq!(figure(lat, 2, false), Some(54.77));
        assert_eq!(figure(lat, 4096, false), None);
        assert_eq!(figure("65536 1000 1 2 3", 65536, true), None, "no header, no figure");
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0]), Some(2.5));
    }
}
