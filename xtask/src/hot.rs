//! `cargo xtask hot`: where one `send-lat` client iteration's instructions
//! go, from a run that `cargo xtask instructions --keep` kept.
//!
//! Each tool ran 1,000 and 3,000 iterations under callgrind; the
//! difference of the two counts over 2,000 is one iteration's, start-up
//! and teardown cancelled. This reads the two files and prints each
//! function's own (self) instructions per iteration, the most first. With
//! `--fn NAME`, it also prints the disassembly of each function whose name
//! contains NAME (from `objdump -d` of the binary that ran), each
//! instruction with its executions per iteration and its source line: the
//! hot path read instruction by instruction. A kept run's files carry
//! per-instruction counts (`--dump-instr=yes`), and the binary that ran is
//! kept beside them; older runs give the function totals only.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Result, output, root};

/// One function's own cost, at instruction `addr` (0 where the file has
/// no per-instruction positions).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Key {
    object: String,
    function: String,
    addr: u64,
}

/// The self costs (the first event, Ir) of a callgrind output file, by
/// object, function and instruction. A call's cost line (the inclusive
/// cost of the call, after `calls=`) is the callee's, not counted here.
fn self_costs(text: &str) -> Result<HashMap<Key, u64>> {
    let mut costs = HashMap::new();
    // Name compression: `(id) name` defines, `(id)` refers; objects,
    // functions and files are three spaces.
    let mut names: [HashMap<String, String>; 3] = Default::default();
    let (mut object, mut function) = (String::new(), String::new());
    // Positions: instruction address and/or line, as `positions:` says;
    // each is absolute, `+n`/`-n` relative to the last, or `*` the same.
    let mut columns = 1;
    let mut instr_at = None;
    let mut last = [0i64; 2];
    let mut skip_call_cost = false;
    for line in text.lines() {
        let Some(first) = line.chars().next() else { continue };
        if first.is_ascii_digit() || matches!(first, '+' | '-' | '*') {
            let mut fields = line.split_ascii_whitespace();
            for (i, slot) in last.iter_mut().enumerate().take(columns) {
                let f = fields.next().ok_or_else(|| format!("a cost line without position {i}: {line}"))?;
                *slot = position(f, *slot).ok_or_else(|| format!("a bad position `{f}` in: {line}"))?;
            }
            if std::mem::take(&mut skip_call_cost) {
                continue;
            }
            let Some(ir) = fields.next() else { continue };
            let ir: u64 = ir.parse().map_err(|_| format!("a bad cost `{ir}` in: {line}"))?;
            let addr = instr_at.map_or(0, |i: usize| last[i] as u64);
            *costs.entry(Key { object: object.clone(), function: function.clone(), addr }).or_insert(0) += ir;
            continue;
        }
        if line.starts_with("calls=") {
            skip_call_cost = true;
            continue;
        }
        if let Some(kinds) = line.strip_prefix("positions:") {
            let kinds: Vec<&str> = kinds.split_ascii_whitespace().collect();
            columns = kinds.len().clamp(1, 2);
            instr_at = kinds.iter().position(|k| *k == "instr");
            continue;
        }
        let Some((key, value)) = line.split_once('=') else { continue };
        let space = match key {
            "ob" | "cob" => 0,
            "fn" | "cfn" => 1,
            "fl" | "fi" | "fe" | "cfi" | "cfl" => 2,
            _ => continue,
        };
        let name = expand(&mut names[space], value);
        match key {
            "ob" => object = name,
            "fn" => function = name,
            _ => {}
        }
    }
    Ok(costs)
}

/// A position field: absolute (decimal or `0x` hex), relative to `last`, or `*`.
fn position(field: &str, last: i64) -> Option<i64> {
    match field.as_bytes()[0] {
        b'*' => Some(last),
        b'+' => number(&field[1..]).map(|n| last + n),
        b'-' => number(&field[1..]).map(|n| last - n),
        _ => number(field),
    }
}

fn number(s: &str) -> Option<i64> {
    match s.strip_prefix("0x") {
        Some(hex) => i64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// A compressed name: `(id) name` defines id, `(id)` refers to it.
fn expand(names: &mut HashMap<String, String>, value: &str) -> String {
    let Some(rest) = value.strip_prefix('(') else { return value.to_owned() };
    let Some((id, name)) = rest.split_once(')') else { return value.to_owned() };
    let name = name.trim();
    if name.is_empty() {
        names.get(id).cloned().unwrap_or_else(|| format!("({id})"))
    } else {
        names.insert(id.to_owned(), name.to_owned());
        name.to_owned()
    }
}

/// Per iteration: the 3,000-iteration costs less the 1,000-iteration ones, over 2,000.
fn per_iteration(short: &HashMap<Key, u64>, long: &HashMap<Key, u64>) -> HashMap<Key, f64> {
    let mut out = HashMap::new();
    for (k, &v) in long {
        let d = v as f64 - short.get(k).copied().unwrap_or(0) as f64;
        out.insert(k.clone(), d / 2000.0);
    }
    for (k, &v) in short {
        out.entry(k.clone()).or_insert(-(v as f64) / 2000.0);
    }
    out
}

/// Per function (object and name): its instructions' sum.
fn by_function(costs: &HashMap<Key, f64>) -> Vec<((String, String), f64)> {
    let mut sums: HashMap<(String, String), f64> = HashMap::new();
    for (k, v) in costs {
        *sums.entry((k.object.clone(), k.function.clone())).or_insert(0.0) += v;
    }
    let mut rows: Vec<_> = sums.into_iter().collect();
    rows.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    rows
}

#[derive(Debug, PartialEq)]
struct Options {
    dir: Option<PathBuf>,
    tool: String,
    function: Option<String>,
    top: usize,
    /// Only the instructions that ran about once an iteration.
    once: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options { dir: None, tool: "gpu-rdma".into(), function: None, top: 20, once: false };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |what: &str| it.next().cloned().ok_or_else(|| format!("{a} needs {what}"));
        match a.as_str() {
            "--tool" => o.tool = value("gpu-rdma, perftest or ucx")?,
            "--fn" => o.function = Some(value("a part of a function's name")?),
            "--top" => o.top = value("a count")?.parse().map_err(|_| format!("{a} needs a count"))?,
            "--once" => o.once = true,
            dir if !dir.starts_with('-') && o.dir.is_none() => o.dir = Some(PathBuf::from(dir)),
            _ => return Err(format!("hot takes [RUN_DIR] --tool TOOL --fn NAME --top N --once; got {args:?}")),
        }
    }
    Ok(o)
}

/// The newest kept run with both of `tool`'s files.
fn newest_run(tool: &str) -> Result<PathBuf> {
    let runs = crate::vm::runs_dir();
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = fs::read_dir(&runs)
        .map_err(|e| format!("{}: {e} (keep a run with `cargo xtask instructions --keep`)", runs.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join(format!("{tool}-0-1000.cg")).is_file() && p.join(format!("{tool}-0-3000.cg")).is_file())
        .filter_map(|p| Some((fs::metadata(&p).and_then(|m| m.modified()).ok()?, p)))
        .collect();
    found.sort();
    found.pop().map(|(_, p)| p).ok_or_else(|| {
        format!("no kept run of {tool} in {}: run `cargo xtask instructions --keep` first", runs.display())
    })
}

pub fn command(args: &[String]) -> Result<i32> {
    let o = parse(args)?;
    let dir = match &o.dir {
        Some(d) => d.clone(),
        None => newest_run(&o.tool)?,
    };
    let read = |n: u32| -> Result<HashMap<Key, u64>> {
        let path = dir.join(format!("{}-0-{n}.cg", o.tool));
        let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        self_costs(&text).map_err(|e| format!("{}: {e}", path.display()))
    };
    let mut costs = per_iteration(&read(1000)?, &read(3000)?);
    if o.once {
        costs.retain(|k, v| runs_once(k, *v));
    }
    let rows = by_function(&costs);
    let total: f64 = rows.iter().map(|(_, v)| v).sum();
    println!("{}: {} per iteration, each function's own instructions, the most first:", dir.display(), o.tool);
    println!("{total:9.1}  in all");
    for ((object, function), v) in rows.iter().take(o.top) {
        let object = Path::new(object).file_name().map_or(object.as_str(), |f| f.to_str().unwrap_or(""));
        println!("{v:9.1}  {function}  [{object}]");
    }
    if let Some(name) = &o.function {
        for ((object, function), v) in rows.iter().filter(|((_, f), _)| f.contains(name.as_str())) {
            print!("{}", disassembly(&dir, &costs, object, function, *v)?);
        }
    }
    Ok(0)
}

/// Whether an instruction ran about once an iteration (`--once`): on the
/// path each message takes, not in a spin that runs as often as the
/// timing lets it. Function totals without positions have no such count.
fn runs_once(k: &Key, per_iteration: f64) -> bool {
    k.addr != 0 && (0.5..1.5).contains(&per_iteration)
}

/// `function`'s instructions that ran, each with its executions per
/// iteration and source line, from `objdump -d -l` of `object`.
fn disassembly(dir: &Path, costs: &HashMap<Key, f64>, object: &str, function: &str, sum: f64) -> Result<String> {
    let mut hot: Vec<(u64, f64)> = costs
        .iter()
        .filter(|(k, v)| k.object == object && k.function == function && k.addr != 0 && v.abs() >= 0.5)
        .map(|(k, v)| (k.addr, *v))
        .collect();
    let mut out = format!("\n== {function}: {sum:.1} per iteration\n");
    if hot.is_empty() {
        out.push_str("   (no per-instruction counts: keep a run with `cargo xtask instructions --keep`)\n");
        return Ok(out);
    }
    hot.sort_by_key(|&(a, _)| a);
    let at: HashMap<u64, f64> = hot.iter().copied().collect();
    // A function's code can lie in pieces: one objdump per run of nearby addresses.
    let mut spans: Vec<(u64, u64)> = Vec::new();
    for &(a, _) in &hot {
        match spans.last_mut() {
            Some((_, end)) if a <= *end + 4096 => *end = a + 16,
            _ => spans.push((a, a + 16)),
        }
    }
    // The binary that ran, kept with the run; else the one built since (its
    // addresses match only if nothing was rebuilt: said below).
    let name = Path::new(object).file_name().unwrap_or_default();
    let kept = dir.join(name);
    let binary = if kept.is_file() {
        kept
    } else {
        let _ = writeln!(out, "   (no binary kept with the run: reading {object}, which must be the one that ran)");
        if Path::new(object).is_file() { PathBuf::from(object) } else { root().join(object) }
    };
    for (start, end) in spans {
        let listing = output(
            Command::new("objdump")
                .args([
                    "-d",
                    "-l",
                    "-C",
                    "--no-show-raw-insn",
                    &format!("--start-address={start:#x}"),
                    &format!("--stop-address={end:#x}"),
                ])
                .arg(&binary),
        )?;
        let mut source = String::new();
        for line in listing.lines() {
            let trimmed = line.trim();
            if trimmed.starts_with('/') || trimmed.starts_with("src/") {
                // The file's last two path parts and the line: `transport/verbs.rs:547`.
                let cut = trimmed.rmatch_indices('/').nth(1).map_or(0, |(i, _)| i + 1);
                source = trimmed[cut..].to_owned();
                continue;
            }
            let Some((addr, insn)) = trimmed.split_once(":\t") else { continue };
            let Ok(addr) = u64::from_str_radix(addr, 16) else { continue };
            if let Some(n) = at.get(&addr) {
                let _ = writeln!(out, "{n:7.2}  {addr:x}  {:<48} {source}", insn.replace('\t', " "));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two functions, one calling the other, in callgrind's format with
    /// compressed names and positions.
    const FILE: &str = "\
version: 1
positions: instr line
events: Ir
ob=(1) /bin/tool
fl=(1) a.rs
fn=(1) caller
0x1000 10 3
+2 * 2
cob=(1)
cfi=(1)
cfn=(2) callee
calls=5 0x2000 20
+3 11 100
+4 12 1
fn=(2)
0x2000 20 7
-0 +1 1
totals: 114
";

    #[test]
    fn self_costs_follow_compressed_names_and_positions_and_leave_calls_out() {
        let c = self_costs(FILE).unwrap();
        let at = |f: &str, addr| c.get(&Key { object: "/bin/tool".into(), function: f.into(), addr }).copied();
        assert_eq!(at("caller", 0x1000), Some(3));
        assert_eq!(at("caller", 0x1002), Some(2));
        // The call's 100 at 0x1005 is the callee's (inclusive), not the caller's own.
        assert_eq!(at("caller", 0x1005), None);
        assert_eq!(at("caller", 0x1009), Some(1));
        // `-0` is the same address again.
        assert_eq!(at("callee", 0x2000), Some(8));
        assert_eq!(c.values().sum::<u64>(), 14);
    }

    #[test]
    fn an_iteration_is_the_difference_of_the_two_lengths_over_2000() {
        let key = |f: &str| Key { object: "o".into(), function: f.into(), addr: 0 };
        let short = HashMap::from([(key("loop"), 1_000_500), (key("setup"), 700)]);
        let long = HashMap::from([(key("loop"), 3_000_500), (key("setup"), 700), (key("late"), 4_000)]);
        let rows = by_function(&per_iteration(&short, &long));
        assert_eq!(rows[0], (("o".into(), "loop".into()), 1000.0));
        assert_eq!(rows[1], (("o".into(), "late".into()), 2.0));
        assert_eq!(rows[2], (("o".into(), "setup".into()), 0.0));
    }

    #[test]
    fn once_keeps_what_ran_about_once_an_iteration_and_only_with_a_position() {
        let at = |addr| Key { object: "o".into(), function: "f".into(), addr };
        assert!(runs_once(&at(0x10), 1.0));
        assert!(runs_once(&at(0x10), 0.94));
        assert!(!runs_once(&at(0x10), 0.3), "a branch taken now and then");
        assert!(!runs_once(&at(0x10), 40.0), "a spin");
        assert!(!runs_once(&at(0x10), -1.5), "the lengths' spins differed");
        assert!(!runs_once(&at(0), 1.0), "a function total, no position");
    }

    #[test]
    fn options_parse_and_refuse_what_they_do_not_know() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            parse(&[]).unwrap(),
            Options { dir: None, tool: "gpu-rdma".into(), function: None, top: 20, once: false }
        );
        assert_eq!(
            parse(&args(&["runs/x", "--tool", "perftest", "--fn", "post", "--top", "5", "--once"])).unwrap(),
            Options {
                dir: Some("runs/x".into()),
                tool: "perftest".into(),
                function: Some("post".into()),
                top: 5,
                once: true
            }
        );
        assert!(parse(&args(&["--top"])).is_err());
        assert!(parse(&args(&["--bogus"])).is_err());
    }
}
