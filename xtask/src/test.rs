//! `cargo xtask test`: the two tiers.
//!
//! 1. Here: formatting, clippy, a build without default features, the
//!    module graph (`cargo xtask layers`: no import cycle, no import against
//!    the layer order, no type name defined in two modules), and
//!    `cargo test` (the verbs tests are `#[ignore]`d here and say why).
//!    Then the CUDA layer's tests, GPU memory over TCP and the bench's
//!    staged runs against the test-only CUDA stand-in (`cuda-stub/`,
//!    exposed as `libcuda.so` in `target/cuda-stub/` and put on
//!    `LD_LIBRARY_PATH` of those test processes only).
//!    Then the README's first command, the transfer example with no
//!    arguments: it must pick TCP here and verify write, read and send.
//! 2. In the soft-RoCE guest: the library's own tests, every test target
//!    named `verbs*`, and the connection suite, with `--ignored` and
//!    `GPU_RDMA_TEST_DEVICE=rxe0` (the `*gpu*` ones with the CUDA
//!    stand-in); the transfer example with no arguments, which must pick
//!    verbs there; the transfer example moving 256 MiB by write, read and
//!    send between two processes, and the GPU example, verified; the
//!    doctor.
//!
//! It fails when anything fails, when fewer than `GPU_RDMA_MIN_VERBS_TESTS`
//! (default 20) verbs tests passed in the guest, or when a transfer did not
//! verify.
//!
//! `cargo xtask demo` is the README's first command: the transfer example
//! with no arguments, here; `demo --vm` is tier 2's two-process transfers.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::setup;
use crate::vm::{self, VmOptions, quote};
use crate::{Result, cargo, output, root, run as run_cmd};

/// Passed, failed and ignored counts from libtest's `test result:` lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    pub suites: u64,
}

impl Tally {
    pub fn parse(text: &str) -> Tally {
        let mut t = Tally::default();
        for line in text.lines() {
            let Some(rest) = line.trim().strip_prefix("test result: ") else {
                continue;
            };
            t.suites += 1;
            for part in rest.split(';') {
                let words: Vec<&str> = part.split_whitespace().collect();
                let n = |w: &str| words.iter().position(|x| x.trim_end_matches('.') == w);
                for (name, slot) in [("passed", &mut t.passed), ("failed", &mut t.failed), ("ignored", &mut t.ignored)]
                {
                    let count = n(name)
                        .and_then(|i| i.checked_sub(1))
                        .and_then(|j| words.get(j))
                        .and_then(|w| w.parse::<u64>().ok());
                    *slot += count.unwrap_or(0);
                }
            }
        }
        t
    }
}

/// Runs a command, echoing its output as it comes, and returns it with the exit status.
fn run_tee(cmd: &mut Command) -> Result<(bool, String)> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    let stderr = child.stderr.take().expect("piped");
    let err_thread = std::thread::spawn(move || {
        let mut text = String::new();
        for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
            eprintln!("{line}");
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    let mut text = String::new();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines().map_while(|l| l.ok()) {
        println!("{line}");
        text.push_str(&line);
        text.push('\n');
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    text.push_str(&err_thread.join().unwrap_or_default());
    Ok((status.success(), text))
}

/// The library's own test target: its ignored tests (the verbs
/// transport's, which reach inside it) run in the guest.
const LIB: &str = "gpu_rdma";

/// The test targets that run in the guest with `--ignored`: the library's
/// unit tests, those named `verbs*`, the connection suite, churn, peer
/// death (whose verbs halves are ignored here), netem (root and
/// namespaces), the steady-state allocation count, transfer lists,
/// waiting (futures, sets, callbacks), many peers (`World`) and
/// registration (arenas, foreign memory).
fn runs_in_guest(name: &str) -> bool {
    name.starts_with("verbs")
        || name == LIB
        || [
            "connection",
            "churn",
            "peer_death",
            "netem",
            "rails",
            "registration",
            "steady_alloc",
            "transfer",
            "waiting",
            "world",
        ]
        .contains(&name)
}

/// The test executables that run in the guest, built for this machine.
fn guest_test_executables() -> Result<Vec<PathBuf>> {
    let out = cargo()
        // With the tokio feature: futures awaited in the tests' runtimes are
        // woken through tokio's reactor on rxe0 (the host tier runs without
        // it, through the engine's thread).
        .args(["test", "--features", "cli,tokio", "--no-run", "--message-format=json-render-diagnostics"])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err("building the test executables failed".into());
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        let (Some(name), Some(exe)) = (msg["target"]["name"].as_str(), msg["executable"].as_str()) else {
            continue;
        };
        let kind = |want: &str| msg["target"]["kind"].as_array().is_some_and(|k| k.iter().any(|v| v == want));
        let is_test = kind("test") || (kind("lib") && msg["profile"]["test"] == true);
        if is_test && runs_in_guest(name) {
            exes.push(PathBuf::from(exe));
        }
    }
    exes.sort();
    if exes.is_empty() {
        return Err("no test targets for the guest were built".into());
    }
    Ok(exes)
}

const TRANSFERS: &str = r#"
# The transfer example between two processes: 256 MiB by write, read and send, verified.
T=target/release/examples/transfer
port=7470
for op in write read send; do
  port=$((port+1))
  "$T" --listen 127.0.0.1:$port --op $op --bytes 256MiB --verify --timeout 300 > "$VM_OUT/listener-$op.log" 2>&1 &
  srv=$!
  "$T" --connect 127.0.0.1:$port --op $op --bytes 256MiB --verify --timeout 300 > "$VM_OUT/client-$op.log" 2>&1
  crc=$?
  wait $srv
  lrc=$?
  echo "=== transfer --op $op: client exit $crc, listener exit $lrc"
  sed 's/^/  client   | /' "$VM_OUT/client-$op.log"
  sed 's/^/  listener | /' "$VM_OUT/listener-$op.log"
  echo "$op $crc $lrc" >> "$VM_OUT/transfers.txt"
done
"#;

/// What the guest run found about the transfers: (op, verified).
fn transfer_results(dir: &Path) -> Vec<(String, bool)> {
    let table = fs::read_to_string(dir.join("transfers.txt")).unwrap_or_default();
    table
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let [op, crc, lrc] = w[..] else { return None };
            let logs = ["client", "listener"]
                .iter()
                .map(|side| fs::read_to_string(dir.join(format!("{side}-{op}.log"))).unwrap_or_default())
                .collect::<String>();
            let ok = crc == "0" && lrc == "0" && logs.contains("verified: all 268435456 bytes match");
            Some((op.to_owned(), ok))
        })
        .collect()
}

fn build_release_tools() -> Result<()> {
    run_cmd(cargo().args([
        "build",
        "--release",
        "--example",
        "transfer",
        "--example",
        "gpu_to_gpu",
        "--example",
        "kv_pages",
        "--example",
        "all_to_all",
        "--example",
        "tensors",
        "--features",
        "cli,etcd,candle",
        "--bin",
        "gpu-rdma",
    ]))
}

/// Builds the CUDA stand-in and exposes it as `libcuda.so` in a directory
/// of its own (never in a directory cargo puts on the loader path), which
/// is returned.
fn cuda_stub_dir() -> Result<PathBuf> {
    run_cmd(cargo().args(["build", "-p", "gpu-rdma-cuda-stub"]))?;
    let dir = root().join("target/cuda-stub");
    fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let link = dir.join("libcuda.so");
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink("../debug/libgpu_rdma_cuda_stub.so", &link)
        .map_err(|e| format!("{}: {e}", link.display()))?;
    Ok(dir)
}

/// What the README's examples and tools say when something is missing: a
/// client with no server (the transfer example, which waits, and bench's,
/// which fails at once), an etcd that is not running, no GPU. Each message
/// must say what is missing, where, and what to do, once; how many were
/// right, or the first that was not.
fn newcomer_messages() -> std::result::Result<usize, String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port for the newcomer checks: {e}"))?
        .port();
    let addr = format!("127.0.0.1:{port}");
    let example = |name: &str| Command::new(root().join("target/release/examples").join(name));
    let mut checks: Vec<(&str, Command, Vec<String>, Vec<String>)> = Vec::new();
    let mut c = example("transfer");
    c.args(["--connect", &addr, "--timeout", "1"]);
    checks.push((
        "transfer --connect with no server",
        c,
        vec![format!("no server at {addr} yet; retrying for 1 s"), format!("no server at {addr} after 1 s: start one")],
        vec![],
    ));
    let mut c = Command::new(root().join("target/release/gpu-rdma"));
    c.args(["bench", "write-bw", "127.0.0.1", "-p", &port.to_string()]);
    checks.push(("bench's client with no server", c, vec![format!("no bench server at {addr}: start")], vec![]));
    let mut c = example("all_to_all");
    c.args(["--ranks", "8", "--etcd", &format!("http://{addr}")]);
    checks.push((
        "all_to_all --etcd with no etcd",
        c,
        vec![format!("cannot meet through etcd at http://{addr}"), "start one first".into()],
        vec!["rank 0".into(), "failed".into()],
    ));
    let mut c = example("gpu_to_gpu");
    c.args(["--bytes", "1MiB"]);
    let no_gpu = !Path::new("/dev/nvidiactl").exists();
    if no_gpu {
        checks.push((
            "gpu_to_gpu with no GPU",
            c,
            vec!["in host memory (no GPU here)".into()],
            vec!["visible on the GPU".into()],
        ));
    }
    let mut right = 0;
    for (what, mut cmd, want, forbid) in checks {
        let (_, out) = run_tee(&mut cmd)?;
        for w in &want {
            if out.matches(w.as_str()).count() != 1 {
                return Err(format!("{what}: `{w}` said {} times, not once", out.matches(w.as_str()).count()));
            }
        }
        if let Some(f) = forbid.iter().find(|f| out.contains(f.as_str())) {
            return Err(format!("{what}: says `{f}`"));
        }
        right += 1;
    }
    Ok(right)
}

/// The Python binding's venv (`target/pyenv`): made, with maturin, pytest
/// and numpy from PyPI, where it is not there yet.
pub(crate) fn python_venv() -> Result<PathBuf> {
    let venv = root().join("target/pyenv");
    let py = venv.join("bin/python");
    if !py.exists() {
        run_cmd(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    if run_cmd(Command::new(&py).args(["-c", "import maturin, pytest, numpy"])).is_err() {
        run_cmd(Command::new(&py).args(["-m", "pip", "install", "-q", "maturin>=1.5,<2", "pytest", "numpy"]))?;
    }
    Ok(py)
}

/// Builds the wheel (one abi3 wheel, `target/wheels`) and installs it into
/// the venv, as `pip install ./python` would, with World through etcd too
/// (`--features etcd`: protoc, which setup installs, and the suite's etcd
/// test).
pub(crate) fn python_wheel(py: &Path) -> Result<PathBuf> {
    let wheels = root().join("target/wheels");
    let _ = fs::remove_dir_all(&wheels);
    run_cmd(
        Command::new(py.with_file_name("maturin"))
            .args(["build", "--release", "--features", "etcd", "-o"])
            .arg(&wheels)
            .current_dir(root().join("python")),
    )?;
    let wheel = fs::read_dir(&wheels)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or("maturin built no wheel")?;
    run_cmd(Command::new(py).args(["-m", "pip", "install", "-q", "--force-reinstall", "--no-deps"]).arg(&wheel))?;
    Ok(wheel)
}

/// The pytest command for the binding's suite (run from outside the
/// source tree, so the installed package is what is imported).
fn pytest_command(py: &Path, tests: &str) -> String {
    format!(
        "cd /tmp && {} -m pytest -q -rs -p no:cacheprovider --import-mode=importlib {}",
        quote(&py.to_string_lossy()),
        quote(&root().join("python/tests").join(tests).to_string_lossy())
    )
}

/// The binding's examples and what each must say.
const PY_EXAMPLES: [(&str, &str); 2] = [
    ("kv_push.py --requests 16", "kv_push: all 16 requests verified"),
    ("weights.py --ranks 3 --mib 16 --steps 3", "weights: 3 steps to 2 ranks, every one verified"),
];

/// The binding's DLPack CUDA tests, against the CUDA stand-in in `stub`
/// (its own run: without a libcuda they skip, saying so).
const PY_CUDA_TESTS: &str = "test_cuda_dlpack.py";

/// pytest's summary line: (passed, failed).
fn pytest_counts(out: &str) -> (u64, u64) {
    let line = out.lines().rev().find(|l| l.contains(" passed") || l.contains(" failed")).unwrap_or("");
    let count = |what: &str| {
        line.split(", ")
            .flat_map(|part| part.split(' '))
            .collect::<Vec<_>>()
            .windows(2)
            .find(|w| w[1].trim_end_matches(|c: char| !c.is_alphabetic()) == what)
            .and_then(|w| w[0].trim_matches(|c: char| !c.is_ascii_digit()).parse().ok())
            .unwrap_or(0)
    };
    (count("passed"), count("failed") + count("error") + count("errors"))
}

/// The release binaries carry no link-time dependency on libibverbs, and
/// the transfer example, run with `libibverbs.so.1` hidden (a mount
/// namespace with `/dev/null` bound over the file), falls back to TCP,
/// verifies all three operations and says why. How many binaries were
/// checked, or what went wrong.
fn without_libibverbs() -> std::result::Result<usize, String> {
    let bins = ["examples/transfer", "examples/tensors", "examples/kv_pages", "gpu-rdma"];
    for bin in bins {
        let path = root().join("target/release").join(bin);
        let dynamic = output(Command::new("readelf").arg("-d").arg(&path))
            .map_err(|e| format!("readelf -d {}: {e}", path.display()))?;
        if dynamic.contains("libibverbs") {
            return Err(format!("{bin} links libibverbs at start-up (readelf -d lists it as NEEDED)"));
        }
    }
    let lib = ["/usr/lib/x86_64-linux-gnu/libibverbs.so.1", "/lib/x86_64-linux-gnu/libibverbs.so.1"]
        .iter()
        .find_map(|p| fs::canonicalize(p).ok())
        .ok_or("libibverbs.so.1 is not installed here, so there is nothing to hide")?;
    let example = root().join("target/release/examples/transfer");
    let script = format!(
        "mount --bind /dev/null {} && exec {} --bytes 16MiB",
        quote(&lib.to_string_lossy()),
        quote(&example.to_string_lossy())
    );
    println!("\n$ unshare -m sh -c '{script}'   # libibverbs.so.1 hidden");
    let (ok, out) = run_tee(Command::new("unshare").args(["-m", "sh", "-c", &script]).current_dir(root()))?;
    let verified = loopback_verified(&out, "tcp").map_err(|e| format!("{e} with libibverbs.so.1 hidden"))?;
    if !ok || verified != 3 {
        return Err(format!("the transfer example with libibverbs.so.1 hidden verified {verified} of 3"));
    }
    if !out.contains("libibverbs.so.1 could not be loaded") {
        return Err("the transfer example with libibverbs.so.1 hidden did not say that it is missing".into());
    }
    // The Python extension module: no libibverbs at start-up, and `import
    // gpu_rdma` with it hidden runs over TCP and says why.
    let py = root().join("target/pyenv/bin/python");
    let ext = output(Command::new(&py).args(["-c", "import gpu_rdma._native as n; print(n.__file__)"]))?;
    let dynamic = output(Command::new("readelf").arg("-d").arg(ext.trim()))?;
    if dynamic.contains("libibverbs") {
        return Err(format!("{} links libibverbs at start-up", ext.trim()));
    }
    let script = format!(
        "mount --bind /dev/null {} && cd /tmp && exec {} -c {}",
        quote(&lib.to_string_lossy()),
        quote(&py.to_string_lossy()),
        quote("import gpu_rdma; i = gpu_rdma.Domain().info(); print('python:', i['transport'], '|', i['fallback'])")
    );
    let (ok, out) = run_tee(Command::new("unshare").args(["-m", "sh", "-c", &script]))?;
    if !ok || !out.contains("python: tcp") || !out.contains("libibverbs.so.1 could not be loaded") {
        return Err("`import gpu_rdma` with libibverbs.so.1 hidden did not run over TCP saying why".into());
    }
    Ok(bins.len() + 1)
}

/// The transfer example with no arguments, both ends in one process: how
/// many of write, read and send it verified, and whether it said it runs on
/// `transport`.
fn loopback_verified(log: &str, transport: &str) -> std::result::Result<usize, String> {
    let path = format!("path: {transport} ");
    if !log.lines().any(|l| l.starts_with(&path)) {
        return Err(format!("the transfer example with no arguments did not pick {transport}"));
    }
    let verified = ["write: ", "read: ", "send: "]
        .iter()
        .filter(|op| log.lines().any(|l| l.starts_with(*op) && l.contains("GB/s") && l.ends_with("verified")))
        .count();
    if verified != 3 {
        return Err(format!("the transfer example with no arguments verified {verified} of write, read and send"));
    }
    Ok(verified)
}

const LOOPBACK: &str = r#"
# The transfer example with no arguments: it must pick verbs on rxe0.
target/release/examples/transfer --bytes 64MiB > "$VM_OUT/loopback.log" 2>&1
echo "transfer exit $?" >> "$VM_OUT/loopback.log"
echo "=== transfer with no arguments (64 MiB)"; sed 's/^/  /' "$VM_OUT/loopback.log"
"#;

const DOCTOR: &str = r#"
# The doctor where there is an RDMA device (rxe0) and no GPU.
target/release/gpu-rdma doctor > "$VM_OUT/doctor.txt" 2>&1; echo $? > "$VM_OUT/doctor.rc"
target/release/gpu-rdma doctor --json > "$VM_OUT/doctor.json" 2>/dev/null
echo "=== gpu-rdma doctor (exit $(cat "$VM_OUT/doctor.rc"))"; sed 's/^/  /' "$VM_OUT/doctor.txt"
"#;

/// Whether the guest's doctor run said the right things: rxe0 found and
/// active, no GPU, exit 2, JSON that parses and agrees.
fn doctor_ok(dir: &Path) -> std::result::Result<(), String> {
    let text = fs::read_to_string(dir.join("doctor.txt")).map_err(|e| e.to_string())?;
    let rc = fs::read_to_string(dir.join("doctor.rc")).unwrap_or_default();
    let json: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dir.join("doctor.json")).map_err(|e| e.to_string())?)
            .map_err(|e| format!("doctor --json does not parse: {e}"))?;
    if rc.trim() != "2" || json["exit_code"] != 2 {
        return Err(format!("exit {} (JSON {}), expected 2: no GPU to judge", rc.trim(), json["exit_code"]));
    }
    let rxe_ok = json["checks"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["name"] == "RDMA device rxe0" && c["status"] == "ok"));
    if !rxe_ok || !text.contains("rxe0") || !text.contains("no NVIDIA GPU found") {
        return Err("the doctor did not report rxe0 active and no GPU".into());
    }
    Ok(())
}

const ALL_TO_ALL: &str = r#"
# All-to-all among 4 rank processes through the directory rendezvous, on rxe0.
target/release/examples/all_to_all --ranks 4 > "$VM_OUT/all-to-all.log" 2>&1
echo "all_to_all exit $?" >> "$VM_OUT/all-to-all.log"
echo "=== all_to_all --ranks 4 (rxe0)"; sed 's/^/  /' "$VM_OUT/all-to-all.log"
# And through a real etcd started here, in a data directory of its own.
ETCD_DIR=$(mktemp -d)
etcd --name guest --data-dir "$ETCD_DIR" --listen-client-urls http://127.0.0.1:23790 \
  --advertise-client-urls http://127.0.0.1:23790 --listen-peer-urls http://127.0.0.1:23800 \
  --initial-advertise-peer-urls http://127.0.0.1:23800 --initial-cluster guest=http://127.0.0.1:23800 \
  > "$VM_OUT/etcd.log" 2>&1 &
ETCD_PID=$!
for i in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/23790) 2>/dev/null && break; sleep 0.1; done
target/release/examples/all_to_all --ranks 4 --etcd http://127.0.0.1:23790 > "$VM_OUT/all-to-all-etcd.log" 2>&1
RC=$?
echo "all_to_all exit $RC" >> "$VM_OUT/all-to-all-etcd.log"
kill $ETCD_PID; wait $ETCD_PID 2>/dev/null
echo "=== all_to_all --ranks 4 --etcd (rxe0)"; sed 's/^/  /' "$VM_OUT/all-to-all-etcd.log"
# On failure, what etcd saw (expired leases, slow requests) goes in the log too.
if [ "$RC" != 0 ]; then echo "=== etcd's log, last 40 lines"; tail -n 40 "$VM_OUT/etcd.log" | sed 's/^/  /'; fi
"#;

/// Whether an all_to_all run of `ranks` verified every shard, each rank
/// over `transport`, meeting through `rendezvous` (`directory`, `etcd`).
fn all_to_all_verified(log: &str, ranks: u32, transport: &str, rendezvous: &str, exited: bool) -> Result<()> {
    let shards = ranks * (ranks - 1);
    let each = log
        .lines()
        .filter(|l| {
            l.contains(&format!("({transport} via"))
                && l.contains(&format!("rendezvous {rendezvous})"))
                && l.contains("shards verified")
        })
        .count();
    if !exited || each != ranks as usize || !log.contains(&format!("all {ranks} ranks exchanged {shards} shards")) {
        return Err(format!(
            "all_to_all: {each} of {ranks} ranks verified their shards over {transport} through the {rendezvous} rendezvous"
        ));
    }
    Ok(())
}

const KV_PAGES: &str = r#"
# The KV-cache example on rxe0: must pick verbs, verify every request.
target/release/examples/kv_pages --async > "$VM_OUT/kv-pages.log" 2>&1
echo "kv_pages exit $?" >> "$VM_OUT/kv-pages.log"
echo "=== kv_pages --async (rxe0)"; sed 's/^/  /' "$VM_OUT/kv-pages.log"
"#;

const TENSORS: &str = r#"
# The tensors example on rxe0: must pick verbs, verify every tensor.
target/release/examples/tensors --tensors 120 --block 8MiB > "$VM_OUT/tensors.log" 2>&1
echo "tensors exit $?" >> "$VM_OUT/tensors.log"
echo "=== tensors --tensors 120 --block 8MiB (rxe0)"; sed 's/^/  /' "$VM_OUT/tensors.log"
# Tensors handed over one by one, registered with and without the cache.
for mode in per-tensor no-cache; do
  flags="--per-tensor"; [ $mode = no-cache ] && flags="--per-tensor --no-cache"
  target/release/examples/tensors --tensors 120 --block 8MiB $flags > "$VM_OUT/tensors-$mode.log" 2>&1
  echo "tensors exit $?" >> "$VM_OUT/tensors-$mode.log"
  echo "=== tensors --tensors 120 --block 8MiB $flags (rxe0)"; sed 's/^/  /' "$VM_OUT/tensors-$mode.log"
done
"#;

/// Whether an example's log says it picked `transport` (its `path:` line).
fn ran_over(log: &str, transport: &str) -> bool {
    log.lines().any(|l| l.starts_with("path: ") && l.to_lowercase().contains(transport))
}

/// Whether a tensors run verified all `n` tensors over `transport`.
fn tensors_verified(log: &str, n: u32, transport: &str, exited: bool) -> Result<()> {
    if !ran_over(log, transport) {
        return Err(format!("the tensors example did not run over {transport}"));
    }
    if !exited || !log.contains(&format!("all {n} tensors verified")) {
        return Err(format!("the tensors example did not verify all {n} tensors"));
    }
    Ok(())
}

/// What a `--per-tensor` tensors run said of registering its `n`
/// tensors: how many were served their block's registration, and how many
/// registered anew.
fn tensors_registration(log: &str, n: u32) -> Option<(u32, u32)> {
    let line = log.lines().find(|l| l.starts_with(&format!("registered {n} tensors one by one")))?;
    let mut words = line.split(": ").nth(1)?.split(' ');
    let served = words.next()?.parse().ok()?;
    let anew = words.skip_while(|w| !w.ends_with("registration,")).nth(1)?.parse().ok()?;
    Some((served, anew))
}

/// Whether a `--per-tensor` tensors run of host memory registered its
/// `n` tensors as asked: every one served its block's registration
/// (`cached`), or every one registered anew.
fn tensors_registered(log: &str, n: u32, cached: bool) -> Result<()> {
    match (tensors_registration(log, n), cached) {
        (Some((s, 0)), true) if s == n => Ok(()),
        (Some((0, a)), false) if a == n => Ok(()),
        (got, _) => Err(format!(
            "the tensors example --per-tensor{} registered {got:?} (served, anew) of {n} tensors, not {}",
            if cached { "" } else { " --no-cache" },
            if cached { "all served" } else { "all anew" }
        )),
    }
}

/// Whether a kv_pages run verified every request over `transport`.
fn kv_pages_verified(log: &str, transport: &str, exited: bool) -> Result<()> {
    if !ran_over(log, transport) {
        return Err(format!("the kv_pages example did not run over {transport}"));
    }
    if !exited || !log.contains("all 16 requests verified page by page") {
        return Err("the kv_pages example did not verify all 16 requests".into());
    }
    Ok(())
}

const GPU_EXAMPLE: &str = r#"
# The GPU example with the CUDA stand-in: direct path, then staged, verified.
LD_LIBRARY_PATH="$STUB" LD_PRELOAD="$STUB/libcuda.so" target/release/examples/gpu_to_gpu --bytes 32MiB --compare > "$VM_OUT/gpu-example.log" 2>&1
echo "gpu_to_gpu exit $?" >> "$VM_OUT/gpu-example.log"
echo "=== gpu_to_gpu --compare (CUDA stand-in)"; sed 's/^/  /' "$VM_OUT/gpu-example.log"
# Tensors in GPU blocks handed over one by one, nvidia-peermem (the stand-in
# plays it): each block registered once, served to the tensors inside it.
GPU_RDMA_MEM_PATH=peermem LD_LIBRARY_PATH="$STUB" LD_PRELOAD="$STUB/libcuda.so" target/release/examples/tensors --gpu --per-tensor --tensors 60 --block 4MiB > "$VM_OUT/tensors-gpu.log" 2>&1
echo "tensors exit $?" >> "$VM_OUT/tensors-gpu.log"
echo "=== tensors --gpu --per-tensor, peermem (CUDA stand-in)"; sed 's/^/  /' "$VM_OUT/tensors-gpu.log"
"#;

pub fn run() -> Result<i32> {
    let kernel = setup::setup()?;
    let mut failures: Vec<String> = Vec::new();

    println!("\n== tier 1 (this machine): format, lints, feature builds, cargo test");
    if run_cmd(cargo().args(["fmt", "--all", "--", "--check"])).is_err() {
        failures.push("cargo fmt --check".into());
    }
    if run_cmd(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--features",
        "gpu-rdma/cli,gpu-rdma/etcd,gpu-rdma/candle",
        "--",
        "-D",
        "warnings",
    ]))
    .is_err()
    {
        failures.push("cargo clippy -D warnings".into());
    }
    if run_cmd(cargo().args(["clippy", "--lib", "--no-default-features", "--", "-D", "warnings"])).is_err() {
        failures.push("cargo clippy --lib --no-default-features (the build without rdma-core)".into());
    }
    if run_cmd(cargo().args(["clippy", "--lib", "--tests", "--features", "tokio", "--", "-D", "warnings"])).is_err() {
        failures.push("cargo clippy --features tokio".into());
    }
    // Frameworks link it beside their own cudarc: each check crate (see
    // checks/README.md) builds in its own workspace, as that framework's
    // build would, and the candle-like one with CUDA 11, 12 and 13 bindings.
    for (check, versions) in [("beside-candle", &["11040", "12080", "13040"][..]), ("fallback-loading", &[""][..])] {
        for v in versions {
            let mut c = cargo();
            c.args(["check", "-q", "--manifest-path", &format!("checks/{check}/Cargo.toml")])
                .args(["--target-dir", "target/checks"]);
            if !v.is_empty() {
                // What `cuda-version-from-build-system` reads where there is no nvcc.
                c.env("CUDARC_CUDA_VERSION", v);
            }
            if run_cmd(&mut c).is_err() {
                failures.push(format!(
                    "checks/{check} (cudarc beside gpu-rdma{})",
                    if v.is_empty() { "".to_owned() } else { format!(", CUDA {v}") }
                ));
            }
        }
    }
    // The library's module graph has no cycle and no import against the
    // layer order, and no type name is defined twice (see `cargo xtask layers`).
    if crate::layers::command(&[]) != Ok(0) {
        failures.push(
            "cargo xtask layers: an import cycle, an import a layer may not make, or a type name defined twice".into(),
        );
    }
    let (host_ok, host_out) =
        run_tee(cargo().args(["test", "--workspace", "--features", "gpu-rdma/cli,gpu-rdma/etcd"]))?;
    let host = Tally::parse(&host_out);
    if !host_ok {
        failures.push("cargo test".into());
    }
    println!("\n== tier 1b (this machine): the CUDA layer against the test-only CUDA stand-in");
    let stub = cuda_stub_dir()?;
    let (cuda_ok, cuda_out) = run_tee(
        // Two stand-in devices: staged messages from two GPUs (two staging
        // streams) on one connection keep their order. The bench's staged
        // runs need the tool (`cli`).
        cargo()
            .args(["test", "--features", "cli", "--test", "cuda", "--test", "gpu_tcp", "--test", "bench_cli"])
            .args(["--", "--ignored"])
            .env("LD_LIBRARY_PATH", &stub)
            .env("GPU_RDMA_STUB_DEVICES", "2"),
    )?;
    let cuda = Tally::parse(&cuda_out);
    if !cuda_ok || cuda.suites != 3 {
        failures.push("the CUDA layer, GPU-over-TCP and staged bench tests on the stand-in".into());
    }
    // The staged round-trip example runs to its end, waited and awaited
    // (its times mean something only on a GPU: gpu-check).
    let (ok, out) = run_tee(
        cargo()
            .args(["run", "-q", "--features", "cuda,tokio", "--example", "staged_latency", "--", "4096", "100"])
            .env("LD_LIBRARY_PATH", &stub),
    )?;
    let staged_latency = ok
        && out.contains("GPU memory path: staged")
        && out.contains("round trip, waited:")
        && out.contains("round trip, awaited:");
    if !staged_latency {
        failures.push("the staged_latency example on the stand-in".into());
    }
    // Tensors in GPU memory on both sides, staged over TCP: lists, then one by one.
    for extra in [None, Some("--per-tensor")] {
        let (ok, out) = run_tee(
            cargo()
                .args(["run", "-q", "--example", "tensors", "--", "--gpu", "--tensors", "60", "--block", "4MiB"])
                .args(extra)
                .env("LD_LIBRARY_PATH", &stub),
        )?;
        if let Err(e) = tensors_verified(&out, 60, "tcp", ok) {
            failures.push(format!("{e} (--gpu {}, the stand-in)", extra.unwrap_or("")));
        }
    }

    println!("\n== tier 1c (this machine): the README's first command, the transfer example with no arguments");
    build_release_tools()?;
    let (_, here_out) = run_tee(Command::new(root().join("target/release/examples/transfer")).current_dir(root()))?;
    let here = loopback_verified(&here_out, "tcp");
    if let Err(e) = &here {
        failures.push(format!("{e} on this machine"));
    }
    let (ok, out) = run_tee(
        Command::new(root().join("target/release/examples/all_to_all")).current_dir(root()).args(["--ranks", "8"]),
    )?;
    let a2a_here = all_to_all_verified(&out, 8, "tcp", "directory", ok);
    if let Err(e) = &a2a_here {
        failures.push(format!("{e} on this machine"));
    }
    let etcd = crate::etcd::Etcd::start()?;
    let (ok, out) =
        run_tee(Command::new(root().join("target/release/examples/all_to_all")).current_dir(root()).args([
            "--ranks",
            "8",
            "--etcd",
            &etcd.endpoint(),
        ]))?;
    drop(etcd);
    let a2a_etcd_here = all_to_all_verified(&out, 8, "tcp", "etcd", ok);
    if let Err(e) = &a2a_etcd_here {
        failures.push(format!("{e} on this machine"));
    }
    let mut kv_here = 0;
    for extra in [None, Some("--async")] {
        let mut cmd = Command::new(root().join("target/release/examples/kv_pages"));
        cmd.current_dir(root()).args(extra);
        let (ok, out) = run_tee(&mut cmd)?;
        match kv_pages_verified(&out, "tcp", ok) {
            Ok(()) => kv_here += 1,
            Err(e) => failures.push(format!("{e} on this machine ({})", extra.unwrap_or("sync"))),
        }
    }
    for (flags, cached) in [
        (&[][..], None),
        (&["--per-tensor"][..], Some(true)),
        (&["--per-tensor", "--no-cache"][..], Some(false)),
        (&["--candle"][..], None),
    ] {
        let (ok, out) =
            run_tee(Command::new(root().join("target/release/examples/tensors")).current_dir(root()).args(flags))?;
        let checked = tensors_verified(&out, 320, "tcp", ok)
            .and_then(|()| cached.map_or(Ok(()), |cached| tensors_registered(&out, 320, cached)));
        if let Err(e) = checked {
            failures.push(format!("{e} on this machine"));
        }
    }

    let newcomer = newcomer_messages();
    if let Err(e) = &newcomer {
        failures.push(e.clone());
    }
    println!("\n== tier 1d (this machine): the Python binding (one abi3 wheel), its pytest suite over TCP");
    let python = python_venv().and_then(|py| python_wheel(&py).map(|w| (py, w)));
    let (py_here, py_cuda_here, py_wheel) = match &python {
        Ok((py, wheel)) => {
            let (_, out) = run_tee(Command::new("sh").args(["-c", &pytest_command(py, "")]))?;
            // The DLPack CUDA tensors, staged over TCP, on the stand-in.
            let (_, cuda) = run_tee(
                Command::new("sh").args(["-c", &pytest_command(py, PY_CUDA_TESTS)]).env("LD_LIBRARY_PATH", &stub),
            )?;
            let name = wheel.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            (pytest_counts(&out), pytest_counts(&cuda), name)
        }
        Err(e) => {
            failures.push(format!("the Python binding did not build: {e}"));
            ((0, 1), (0, 1), String::new())
        }
    };
    if py_here.1 > 0 || py_here.0 == 0 {
        failures.push(format!("the Python suite over TCP: {} passed, {} failed", py_here.0, py_here.1));
    }
    // The binding's examples, as a newcomer runs them.
    if let Ok((py, _)) = &python {
        for (example, want) in PY_EXAMPLES {
            let cmd = format!("{} python/examples/{example}", quote(&py.to_string_lossy()));
            match run_tee(Command::new("sh").args(["-c", &cmd]).current_dir(root())) {
                Ok((true, out)) if out.contains(want) => {}
                _ => failures.push(format!("python/examples/{example} did not say `{want}` on this machine")),
            }
        }
    }
    if py_cuda_here.1 > 0 || py_cuda_here.0 < 2 {
        failures.push(format!(
            "the Python DLPack CUDA tests on the stand-in: {} passed, {} failed",
            py_cuda_here.0, py_cuda_here.1
        ));
    }
    let no_rdma_core = without_libibverbs();
    if let Err(e) = &no_rdma_core {
        failures.push(e.clone());
    }

    println!("\n== tier 2 (soft-RoCE guest, rxe0; rxe1 as a second rail): verbs tests and the transfer example");
    let exes = guest_test_executables()?;
    let mut script = format!(
        "export GPU_RDMA_TEST_DEVICE=rxe0 GPU_RDMA_TEST_RAILS=rxe0,rxe1 RUST_BACKTRACE=1 STUB={}\n",
        quote(&stub.to_string_lossy())
    );
    script.push_str("target/release/gpu-rdma devices > \"$VM_OUT/devices.log\" 2>&1; cat \"$VM_OUT/devices.log\"\n");
    for exe in &exes {
        let name = exe.file_name().unwrap_or_default().to_string_lossy();
        // GPU tests: with the CUDA stand-in, one at a time (256 MiB buffers).
        // Preloaded, the stand-in also plays nvidia-peermem (see cuda-stub/).
        let (env, threads) = if name.starts_with(&format!("{LIB}-")) {
            // The library's tests (named gpu_rdma-HASH: not the GPU tests).
            ("", 2)
        } else if name.contains("gpu") {
            ("LD_LIBRARY_PATH=\"$STUB\" LD_PRELOAD=\"$STUB/libcuda.so\" ", 1)
        } else if name.starts_with("rails") {
            // One at a time: 256 MiB buffers, and one test sets rxe1's link down.
            ("", 1)
        } else {
            ("", 2)
        };
        script.push_str(&format!(
            "echo '=== {name} (--ignored tests in the guest, rxe0)'\n{env}timeout 1200 {} --ignored --test-threads={threads} 2>&1 | tee \"$VM_OUT/{name}.log\"\n",
            quote(&exe.to_string_lossy())
        ));
    }
    script.push_str(LOOPBACK);
    script.push_str(TRANSFERS);
    script.push_str(GPU_EXAMPLE);
    script.push_str(KV_PAGES);
    script.push_str(TENSORS);
    if let Ok((py, _)) = &python {
        // The Python suite again, on rxe0.
        script.push_str(&format!(
            "echo '=== the Python suite on rxe0'\nGPU_RDMA_TEST_DEVICE=rxe0 sh -c {} > \"$VM_OUT/python.log\" 2>&1; tail -n 3 \"$VM_OUT/python.log\"\n",
            quote(&pytest_command(py, ""))
        ));
        for (i, (example, _)) in PY_EXAMPLES.iter().enumerate() {
            script.push_str(&format!(
                "echo '=== python/examples/{example} (rxe0)'\n{} python/examples/{example} > \"$VM_OUT/py-example-{i}.log\" 2>&1; tail -n 2 \"$VM_OUT/py-example-{i}.log\"\n",
                quote(&py.to_string_lossy())
            ));
        }
        // Its DLPack CUDA tensors on the peermem path (the stand-in preloaded).
        script.push_str(&format!(
            "echo '=== the Python DLPack CUDA tests on rxe0, peermem (CUDA stand-in)'\nGPU_RDMA_TEST_DEVICE=rxe0 GPU_RDMA_MEM_PATH=peermem LD_LIBRARY_PATH=\"$STUB\" LD_PRELOAD=\"$STUB/libcuda.so\" sh -c {} > \"$VM_OUT/python-cuda.log\" 2>&1; tail -n 3 \"$VM_OUT/python-cuda.log\"\n",
            quote(&pytest_command(py, PY_CUDA_TESTS))
        ));
    }
    script.push_str(ALL_TO_ALL);
    script.push_str(DOCTOR);
    script.push_str("exit 0\n");
    let opts = VmOptions { timeout: Duration::from_secs(1800), keep: true, ..VmOptions::default() };
    let guest = vm::run_script(&kernel, &root(), &script, &opts)?;
    if guest.code != 0 {
        failures.push(format!("the guest run exited {}", guest.code));
    }
    let mut verbs = Tally::default();
    for exe in &exes {
        let name = exe.file_name().unwrap_or_default().to_string_lossy().into_owned();
        match fs::read_to_string(guest.dir.join(format!("{name}.log"))) {
            Ok(log) => {
                let t = Tally::parse(&log);
                if t.suites == 0 {
                    failures.push(format!("{name}: no test summary in the guest (crashed or timed out?)"));
                }
                verbs.passed += t.passed;
                verbs.failed += t.failed;
                verbs.suites += t.suites;
            }
            Err(_) => failures.push(format!("{name}: no log from the guest")),
        }
    }
    let transfers = transfer_results(&guest.dir);
    let verified = transfers.iter().filter(|(_, ok)| *ok).count();
    let loopback_log = fs::read_to_string(guest.dir.join("loopback.log")).unwrap_or_default();
    let loopback = loopback_verified(&loopback_log, "verbs");
    if let Err(e) = &loopback {
        failures.push(format!("{e} on rxe0"));
    }
    let doctor = doctor_ok(&guest.dir);
    if let Err(e) = &doctor {
        failures.push(format!("gpu-rdma doctor in the guest: {e}"));
    }
    let gpu_log = fs::read_to_string(guest.dir.join("gpu-example.log")).unwrap_or_default();
    let gpu_verified = gpu_log.matches("verified: all").count();
    if gpu_verified != 2 || !gpu_log.contains("gpu_to_gpu exit 0") {
        failures.push(format!("the GPU example verified {gpu_verified} of 2 transfers"));
    }
    let a2a_log = fs::read_to_string(guest.dir.join("all-to-all.log")).unwrap_or_default();
    let a2a_guest = all_to_all_verified(&a2a_log, 4, "verbs", "directory", a2a_log.contains("all_to_all exit 0"));
    if let Err(e) = &a2a_guest {
        failures.push(format!("{e} on rxe0"));
    }
    let a2a_etcd_log = fs::read_to_string(guest.dir.join("all-to-all-etcd.log")).unwrap_or_default();
    let a2a_etcd_guest =
        all_to_all_verified(&a2a_etcd_log, 4, "verbs", "etcd", a2a_etcd_log.contains("all_to_all exit 0"));
    if let Err(e) = &a2a_etcd_guest {
        failures.push(format!("{e} on rxe0"));
    }
    let tensors_log = fs::read_to_string(guest.dir.join("tensors.log")).unwrap_or_default();
    if let Err(e) = tensors_verified(&tensors_log, 120, "verbs", tensors_log.contains("tensors exit 0")) {
        failures.push(format!("{e} on rxe0"));
    }
    for (mode, cached) in [("per-tensor", true), ("no-cache", false)] {
        let log = fs::read_to_string(guest.dir.join(format!("tensors-{mode}.log"))).unwrap_or_default();
        let checked = tensors_verified(&log, 120, "verbs", log.contains("tensors exit 0"))
            .and_then(|()| tensors_registered(&log, 120, cached));
        if let Err(e) = checked {
            failures.push(format!("{e} on rxe0"));
        }
    }
    let log = fs::read_to_string(guest.dir.join("tensors-gpu.log")).unwrap_or_default();
    let checked = tensors_verified(&log, 60, "verbs", log.contains("tensors exit 0")).and_then(|()| {
        match tensors_registration(&log, 60) {
            // A miss per block used (it registers the whole block), hits after.
            Some((served, anew)) if served + anew == 60 && anew <= 30 => Ok(()),
            got => Err(format!("the tensors example --gpu --per-tensor registered {got:?} (served, anew) of 60")),
        }
    });
    if let Err(e) = checked {
        failures.push(format!("{e} on rxe0 (CUDA stand-in, peermem)"));
    }
    let py_guest = pytest_counts(&fs::read_to_string(guest.dir.join("python.log")).unwrap_or_default());
    if python.is_ok() && (py_guest.1 > 0 || py_guest.0 == 0) {
        failures.push(format!("the Python suite on rxe0: {} passed, {} failed", py_guest.0, py_guest.1));
    }
    if python.is_ok() {
        for (i, (example, want)) in PY_EXAMPLES.iter().enumerate() {
            let log = fs::read_to_string(guest.dir.join(format!("py-example-{i}.log"))).unwrap_or_default();
            if !log.contains(want) || !log.contains("verbs") {
                failures.push(format!("python/examples/{example} did not say `{want}` over verbs on rxe0"));
            }
        }
    }
    let py_cuda_guest = pytest_counts(&fs::read_to_string(guest.dir.join("python-cuda.log")).unwrap_or_default());
    if python.is_ok() && (py_cuda_guest.1 > 0 || py_cuda_guest.0 < 2) {
        failures.push(format!(
            "the Python DLPack CUDA tests on rxe0 (peermem): {} passed, {} failed",
            py_cuda_guest.0, py_cuda_guest.1
        ));
    }
    let kv_log = fs::read_to_string(guest.dir.join("kv-pages.log")).unwrap_or_default();
    let kv_guest = kv_pages_verified(&kv_log, "verbs", kv_log.contains("kv_pages exit 0"));
    if let Err(e) = &kv_guest {
        failures.push(format!("{e} on rxe0"));
    }
    for (op, ok) in &transfers {
        if !ok {
            failures.push(format!("transfer --op {op} did not verify"));
        }
    }
    if transfers.len() != 3 {
        failures.push(format!("{} of 3 transfers ran", transfers.len()));
    }
    let min: u64 = std::env::var("GPU_RDMA_MIN_VERBS_TESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    if verbs.failed > 0 {
        failures.push(format!("{} verbs tests failed on rxe0", verbs.failed));
    }
    if verbs.passed < min {
        failures.push(format!("only {} verbs tests passed on rxe0 (at least {min} must)", verbs.passed));
    }
    if failures.is_empty() {
        let _ = fs::remove_dir_all(&guest.dir);
    } else {
        println!("guest logs kept in {}", guest.dir.display());
    }

    println!("\n== summary");
    println!(
        "tier 1, this machine: {} passed, {} failed, {} ignored (the verbs and CUDA tests, run in tiers 1b and 2)",
        host.passed, host.failed, host.ignored
    );
    println!(
        "tier 1b, CUDA stand-in: {} passed, {} failed; the staged_latency example {}",
        cuda.passed,
        cuda.failed,
        if staged_latency { "ran, waited and awaited" } else { "FAILED" }
    );
    println!(
        "tier 1c, the transfer example with no arguments: {} of 3 verified over TCP; kv_pages {kv_here} of 2 (sync, async) verified; all_to_all of 8 ranks {} through the directory, {} through etcd",
        here.as_ref().copied().unwrap_or(0),
        if a2a_here.is_ok() { "verified over TCP" } else { "FAILED" },
        if a2a_etcd_here.is_ok() { "verified" } else { "FAILED" }
    );
    println!(
        "tier 1c, what a newcomer reads when something is missing: {}",
        match &newcomer {
            Ok(n) =>
                format!("{n} messages right (no server, no bench server, no etcd, and no GPU where there is none)"),
            Err(e) => format!("WRONG: {e}"),
        }
    );
    println!(
        "tier 1d, Python ({py_wheel}): {} passed, {} failed over TCP here; {} passed, {} failed on rxe0 in the guest; DLPack CUDA tensors (stand-in) {} passed, {} failed staged here, {} passed, {} failed on peermem in the guest",
        py_here.0, py_here.1, py_guest.0, py_guest.1, py_cuda_here.0, py_cuda_here.1, py_cuda_guest.0, py_cuda_guest.1
    );
    println!(
        "tier 1c, without rdma-core: {}",
        match &no_rdma_core {
            Ok(n) => format!(
                "{n} release binaries and the Python module link no libibverbs; with libibverbs.so.1 hidden the transfer example ran over TCP (3 of 3 verified) and `import gpu_rdma` did too, each saying why"
            ),
            Err(e) => format!("WRONG: {e}"),
        }
    );
    println!(
        "tier 2, rxe0 in the guest: {} passed, {} failed verbs tests; with no arguments {} of 3 verified over verbs; {verified} of 3 transfers of 256 MiB verified; GPU example {gpu_verified} of 2 verified; kv_pages {}; all_to_all of 4 ranks {} through the directory, {} through etcd; doctor {}",
        verbs.passed,
        verbs.failed,
        loopback.as_ref().copied().unwrap_or(0),
        if kv_guest.is_ok() { "verified over verbs" } else { "FAILED" },
        if a2a_guest.is_ok() { "verified over verbs" } else { "FAILED" },
        if a2a_etcd_guest.is_ok() { "verified" } else { "FAILED" },
        if doctor.is_ok() { "right (rxe0 active, no GPU, exit 2, JSON parses)" } else { "wrong" }
    );
    for f in &failures {
        println!("FAILED: {f}");
    }
    let _ = std::io::stdout().flush();
    // Failures that are not counted tests (lints, builds, a guest that died,
    // too few verbs tests) count one each.
    let counted = u64::from(host.failed > 0)
        + u64::from(cuda.failed > 0)
        + u64::from(verbs.failed > 0)
        + (transfers.len() - verified) as u64
        + u64::from(gpu_verified != 2)
        + u64::from(doctor.is_err())
        + u64::from(here.is_err())
        + u64::from(loopback.is_err());
    let other = (failures.len() as u64).saturating_sub(counted);
    println!(
        "total: {} passed, {} failed",
        host.passed
            + cuda.passed
            + verbs.passed
            + verified as u64
            + gpu_verified.min(2) as u64
            + u64::from(doctor.is_ok())
            + u64::from(here.is_ok())
            + u64::from(loopback.is_ok())
            + py_here.0
            + py_guest.0
            + py_cuda_here.0
            + py_cuda_guest.0,
        host.failed
            + cuda.failed
            + verbs.failed
            + (3 - verified.min(3)) as u64
            + (2 - gpu_verified.min(2)) as u64
            + u64::from(doctor.is_err())
            + u64::from(here.is_err())
            + u64::from(loopback.is_err())
            + other
    );
    Ok(if failures.is_empty() { 0 } else { 1 })
}

/// The README's first command: the transfer example with no arguments, on
/// this machine. With `--vm`: between two processes on rxe0 in the guest.
pub fn demo(args: &[String]) -> Result<i32> {
    match args {
        [] => {
            setup::ensure_packages(setup::BUILD_PACKAGES, setup::BUILD_WHY)?;
            println!(
                "xtask: building and running the transfer example (release; a first build takes about 4 minutes on \
                 2 cores, cargo shows its progress)"
            );
            let status = cargo()
                .args(["run", "--release", "--example", "transfer"])
                .status()
                .map_err(|e| format!("cannot run cargo: {e}"))?;
            Ok(status.code().unwrap_or(1))
        }
        [vm] if vm == "--vm" => demo_vm(),
        _ => Err(format!("demo takes no arguments, or --vm; got {args:?}")),
    }
}

fn demo_vm() -> Result<i32> {
    let kernel = setup::setup()?;
    build_release_tools()?;
    println!("xtask: demo: the transfer example between two processes in the soft-RoCE guest");
    let script = format!("{TRANSFERS}\nexit 0\n");
    let opts = VmOptions { keep: true, ..VmOptions::default() };
    let guest = vm::run_script(&kernel, &root(), &script, &opts)?;
    let transfers = transfer_results(&guest.dir);
    let verified = transfers.iter().filter(|(_, ok)| *ok).count();
    println!("demo: {verified} of 3 transfers of 256 MiB verified (write, read, send)");
    if verified == 3 && guest.code == 0 {
        let _ = fs::remove_dir_all(&guest.dir);
        Ok(0)
    } else {
        println!("guest logs kept in {}", guest.dir.display());
        Ok(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tallies_libtest_summaries() {
        let text = "test result: ok. 29 passed; 0 failed; 3 ignored; 0 measured; 0 filtered out\n\
                    noise\n   test result: FAILED. 24 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1s\n";
        assert_eq!(Tally::parse(text), Tally { passed: 53, failed: 1, ignored: 3, suites: 2 });
        assert_eq!(Tally::parse("nothing"), Tally::default());
    }

    #[test]
    fn judges_the_transfer_example_by_its_path_and_verified_lines() {
        let good = "transfer: 64 MiB\npath: verbs (rxe0)\nwrite: 1 bytes in 1 s = 0.1 GB/s, verified\n\
                    read: 1 bytes in 1 s = 0.1 GB/s, verified\nsend: 1 bytes in 1 s = 0.1 GB/s, verified\n";
        assert_eq!(loopback_verified(good, "verbs"), Ok(3));
        assert!(loopback_verified(good, "tcp").is_err());
        let bad = good.replace("send: 1 bytes in 1 s = 0.1 GB/s, verified", "send: MISMATCH at offset 7");
        assert!(loopback_verified(&bad, "verbs").unwrap_err().contains("2 of"));
        assert!(runs_in_guest("verbs_gpu") && runs_in_guest("connection") && !runs_in_guest("gpu_tcp"));
        assert!(runs_in_guest(LIB), "the library's own verbs tests");
    }

    #[test]
    fn judges_the_tensors_cache_by_its_registered_line() {
        let line = |hits, misses| {
            format!(
                "registered 120 tensors one by one in 1.00 ms (8.33 us each): {hits} served their block's registration, {misses} registered anew"
            )
        };
        assert_eq!(tensors_registration(&line(101, 19), 120), Some((101, 19)));
        assert_eq!(tensors_registered(&line(120, 0), 120, true), Ok(()));
        assert!(tensors_registered(&line(119, 1), 120, true).is_err());
        assert_eq!(tensors_registered(&line(0, 120), 120, false), Ok(()));
        assert!(tensors_registered(&line(120, 0), 120, false).is_err());
        assert!(tensors_registered("nothing", 120, true).is_err());
    }

    #[test]
    fn reads_pytest_summaries() {
        assert_eq!(pytest_counts("....\n13 passed in 0.46s\n"), (13, 0));
        assert_eq!(pytest_counts("x\n1 failed, 12 passed in 3.92s\n"), (12, 1));
        assert_eq!(pytest_counts("= 2 failed, 10 passed, 1 error in 1s ="), (10, 3));
        assert_eq!(pytest_counts("nothing"), (0, 0));
    }
}
