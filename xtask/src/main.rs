//! `cargo xtask`: project automation for gpu-rdma.
//!
//! - `setup`: installs the Debian packages the build and the VM need, then
//!   downloads and unpacks the Debian kernel that carries `rdma_rxe`
//!   (soft-RoCE) and builds the VM's initramfs. Idempotent.
//! - `vm -- CMD [ARGS]`: runs CMD as root in a qemu guest booted from that
//!   kernel, with the host's root file system shared read-only at the same
//!   paths and `rxe0` up; passes CMD's output and exit code through.
//! - `test`: `cargo test` here, then the verbs tests and the transfer
//!   example inside the guest on `rxe0`; prints both tiers' summaries.
//! - `demo`: the README's first command: the transfer example with no
//!   arguments, here, on the best path this machine has; `demo --vm`: two
//!   processes on rxe0 in the guest.
//! - `bench`: the criterion suite `benches/ops.rs` in the guest, on rxe0.
//! - `compare`: `gpu-rdma bench` beside perftest and UCX, interleaved on
//!   rxe0 in the guest, and beside UCX over TCP here; medians and ratios.
//! - `instructions`: the instructions of one `send-lat` iteration under
//!   callgrind, `ib_send_lat` and `ucx_perftest` beside `gpu-rdma bench`, on rxe0.
//! - `hot`: one send-lat iteration's instructions by function, and with
//!   `--fn` instruction by instruction, from a run `instructions --keep` kept.
//! - `gpu-check`: the GPU checks as one folder (binaries, the rdma-core
//!   libraries they link, `run.sh`) for a GPU machine without Rust; runs
//!   them when this machine has a GPU.

mod bench;
mod compare;
mod etcd;
mod gpu;
mod hot;
mod instructions;
mod layers;
mod setup;
mod stats;
mod steady;
mod test;
mod vm;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

pub type Result<T> = std::result::Result<T, String>;

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  setup                 install packages, fetch the Debian kernel, build the VM initramfs
  vm [OPTS] -- CMD ...  run CMD as root in the soft-RoCE guest (rxe0 up)
                          --timeout SECS (default 900)  --mem SIZE (default 3G)  --keep
  test                  cargo test here, then the verbs tests and the transfer example on rxe0
  demo [--vm]           the transfer example with no arguments here: best path, write/read/send, verified;
                          --vm: two processes on rxe0 in the guest, 256 MiB each way
  bench [FILTER]        the criterion suite benches/ops.rs on rxe0 in the guest (verbs and TCP);
                          FILTER: only the benchmarks whose names contain it (e.g. register)
  compare [--rounds N] [--host] [--only TEST] [--size BYTES] [--null] [--from DIR]...
                        gpu-rdma bench beside perftest and UCX on rxe0 (and here over TCP: UCX, a plain socket
                          with its null, and the Python binding against Rust): medians, ratios; --host: here only;
                          --only, --size: the guest's cases of one test, of one size (no host part);
                          --null: perftest twice a round, its second run against its first (the noise floor);
                          --from: the table from kept guest runs, their rounds pooled
  instructions [--size N] [--server] [--runs N] [--keep] [--memory] [--both]
                        instructions per send-lat iteration under callgrind: ib_send_lat, gpu-rdma, ucx_perftest
                          (the client's, or with --server the server's; 2 B unless --size; the median of
                          3 runs unless --runs; --keep: the callgrind files kept; --memory: loads and stores too;
                          --both: the other side under callgrind too, uncounted, so the counted one spins as in
                          a timed run)
  hot [RUN_DIR] [--tool TOOL] [--fn NAME] [--top N] [--once]
                        one send-lat iteration's instructions by function (self cost, the most first), from a
                          run `instructions --keep` kept (the newest unless RUN_DIR); --fn: each function whose
                          name has NAME, instruction by instruction against its disassembly; --once: only the
                          instructions that ran about once an iteration (the path, not the spin)
  layers [--cycles]     the library's module graph: fails on a cycle or an import a layer may not make
                          (--cycles: on a cycle only, reporting the rest)
  gpu-check [--run]     build the GPU checks into target/gpu-bundle (binaries, libraries, run.sh)
                          and run them when this machine has a GPU
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let outcome = match args.first().map(String::as_str) {
        Some("setup") => setup::setup().map(|_| 0),
        Some("vm") => vm::command(&args[1..]),
        Some("test") => test::run(),
        Some("demo") => test::demo(&args[1..]),
        Some("gpu-check") => gpu::command(&args[1..]),
        Some("compare") => compare::command(&args[1..]),
        Some("bench") => bench::command(&args[1..]),
        Some("layers") => layers::command(&args[1..]),
        Some("instructions") => instructions::command(&args[1..]),
        Some("hot") => hot::command(&args[1..]),
        Some("-h" | "--help" | "help") | None => {
            print!("{USAGE}");
            Ok(0)
        }
        Some(other) => Err(format!("unknown command `{other}`\n{USAGE}")),
    };
    match outcome {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("xtask: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// Where downloads, the kernel and VM runs live.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("GPU_RDMA_VM_CACHE").map(PathBuf::from).unwrap_or_else(|| root().join("target").join("softroce"))
}

/// Runs a command, failing with its description when it does not exit 0.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{cmd:?} failed: {status}")) }
}

/// Runs a command and returns its standard output.
pub fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?} failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A command prefixed with `sudo` unless we are root.
pub fn privileged(program: &str) -> Command {
    let is_root = output(Command::new("id").arg("-u")).map(|s| s.trim() == "0").unwrap_or(false);
    if is_root {
        Command::new(program)
    } else {
        let mut c = Command::new("sudo");
        c.arg(program);
        c
    }
}

/// `cargo`, as the one running us.
pub fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}
