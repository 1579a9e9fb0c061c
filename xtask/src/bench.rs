//! `cargo xtask bench`: the criterion suite `benches/ops.rs` on rxe0 in the
//! soft-RoCE guest, where the verbs transport exists (plain `cargo bench`
//! measures what this machine has: TCP). Reports land in
//! `target/criterion-rxe0/` (criterion's HTML under `report/`).

use std::fs;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use crate::vm::{self, VmOptions, quote};
use crate::{Result, cargo, root, setup};

fn bench_executable() -> Result<PathBuf> {
    let out = cargo()
        .args(["bench", "--no-run", "--bench", "ops", "--message-format=json-render-diagnostics"])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err("building the ops bench failed".into());
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "ops" && m["executable"].is_string())
        .and_then(|m| m["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| "no executable for the ops bench".into())
}

pub fn command(args: &[String]) -> Result<i32> {
    // One optional criterion filter: `cargo xtask bench register`.
    let filter = match args {
        [] => String::new(),
        [f] if !f.starts_with('-') => format!(" {}", quote(f)),
        _ => return Err(format!("bench takes at most one filter (a benchmark name's part); got {args:?}")),
    };
    let kernel = setup::setup()?;
    let exe = bench_executable()?;
    let script = format!(
        "export GPU_RDMA_DEVICE=rxe0 CRITERION_HOME=\"$VM_OUT/criterion\"\n\
         {} --bench{filter} 2>&1 | tee \"$VM_OUT/bench.log\"\nexit ${{PIPESTATUS[0]}}\n",
        quote(&exe.to_string_lossy())
    );
    let opts = VmOptions { timeout: Duration::from_secs(3600), keep: true, ..VmOptions::default() };
    let guest = vm::run_script(&kernel, &root(), &script, &opts)?;
    let dest = root().join("target/criterion-rxe0");
    let _ = fs::remove_dir_all(&dest);
    if fs::rename(guest.dir.join("criterion"), &dest).is_ok() {
        println!("xtask: bench: criterion's reports in {}", dest.display());
    }
    let log = fs::read_to_string(guest.dir.join("bench.log")).unwrap_or_default();
    let measured = log.lines().filter(|l| l.contains("time:")).count();
    let verbs = log.lines().any(|l| {
        ["bandwidth/verbs", "latency/verbs", "register/verbs"].iter().any(|p| l.starts_with(p)) && l.contains("time:")
    });
    println!(
        "xtask: bench: {measured} benchmarks measured in the guest; verbs {}",
        if verbs { "included" } else { "MISSING" }
    );
    Ok(if guest.code == 0 && measured > 0 && verbs { 0 } else { 1 })
}
