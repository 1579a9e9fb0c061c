//! `cargo xtask gpu-check`: builds, here, everything the GPU checks need
//! into one folder (binaries, the rdma-core libraries they link, a script),
//! then runs the script if this machine has a GPU. On a machine without
//! one, it says how to run the folder elsewhere: it needs no Rust toolchain.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{Result, cargo, output, root, run};

const SCRIPT: &str = include_str!("../assets/gpu-check.sh");

/// Libraries the binaries link from rdma-core, and the soft-RoCE provider.
const LIBS: &[&str] = &["libibverbs.so.1", "libnl-3.so.200", "libnl-route-3.so.200", "librdmacm.so.1"];

fn test_executable(target: &str) -> Result<PathBuf> {
    let out = cargo()
        .args([
            "test",
            "--profile",
            "gpu-check",
            "--no-run",
            "--message-format=json-render-diagnostics",
            "--test",
            target,
        ])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("building the {target} tests failed"));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == target && m["executable"].is_string())
        .and_then(|m| m["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| format!("no executable for the {target} tests"))
}

fn find_lib(name: &str) -> Option<PathBuf> {
    let ldconfig = output(Command::new("ldconfig").arg("-p")).unwrap_or_default();
    ldconfig
        .lines()
        .find(|l| l.trim_start().starts_with(name) && l.contains("x86-64"))
        .and_then(|l| l.split("=>").nth(1))
        .map(|p| PathBuf::from(p.trim()))
        .or_else(|| {
            ["/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu"]
                .iter()
                .map(|d| Path::new(d).join(name))
                .find(|p| p.exists())
        })
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    fs::copy(from, to).map(|_| ()).map_err(|e| format!("copying {} to {}: {e}", from.display(), to.display()))
}

pub fn command(args: &[String]) -> Result<i32> {
    let dir = root().join("target/gpu-bundle");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(dir.join("bin")).map_err(|e| e.to_string())?;
    fs::create_dir_all(dir.join("lib")).map_err(|e| e.to_string())?;

    run(cargo().args([
        "build",
        "--profile",
        "gpu-check",
        "--features",
        "cli,tokio",
        "--bin",
        "gpu-rdma",
        "--example",
        "gpu_to_gpu",
        "--example",
        "staged_latency",
        "--example",
        "tensors",
    ]))?;
    // The `gpu-check` profile's outputs, copied into bin/ under stable names.
    let profile_dir = root().join("target/gpu-check");
    copy(&profile_dir.join("gpu-rdma"), &dir.join("bin/gpu-rdma"))?;
    copy(&profile_dir.join("examples/gpu_to_gpu"), &dir.join("bin/gpu_to_gpu"))?;
    copy(&profile_dir.join("examples/staged_latency"), &dir.join("bin/staged_latency"))?;
    copy(&profile_dir.join("examples/tensors"), &dir.join("bin/tensors"))?;
    copy(&test_executable("cuda")?, &dir.join("bin/cuda-tests"))?;
    copy(&test_executable("verbs_gpu")?, &dir.join("bin/verbs-gpu-tests"))?;
    copy(&test_executable("gpu_tcp")?, &dir.join("bin/gpu-tcp-tests"))?;
    for lib in LIBS {
        match find_lib(lib) {
            Some(p) => copy(&p, &dir.join("lib").join(lib))?,
            None => eprintln!("xtask: gpu-check: {lib} not found here; the GPU machine must provide it"),
        }
    }
    if let Some(p) = find_lib("libibverbs.so.1") {
        let provider = p.parent().unwrap_or(Path::new("/")).join("libibverbs/librxe-rdmav34.so");
        if provider.exists() {
            copy(&provider, &dir.join("lib/librxe-rdmav34.so"))?;
        }
    }
    // The Python binding: its wheel unpacked (the GPU machine may have no
    // pip and reaches no registry), and its CUDA check with its producer.
    let py = crate::test::python_venv()?;
    let wheel = crate::test::python_wheel(&py)?;
    run(Command::new(&py).args(["-m", "zipfile", "-e"]).arg(&wheel).arg(dir.join("python")))?;
    for f in ["gpu_check.py", "dlpack_producer.py", "loopback.py"] {
        copy(&root().join("python/tests").join(f), &dir.join("python").join(f))?;
    }
    fs::write(dir.join("run.sh"), SCRIPT).map_err(|e| e.to_string())?;
    run(Command::new("chmod").arg("+x").arg(dir.join("run.sh")))?;
    let size = output(Command::new("du").args(["-sh"]).arg(&dir)).unwrap_or_default();
    println!("xtask: gpu-check bundle ready: {}", size.trim());

    let has_gpu = Command::new("nvidia-smi")
        .arg("-L")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if has_gpu || args.iter().any(|a| a == "--run") {
        let status = Command::new("bash").arg(dir.join("run.sh")).status().map_err(|e| e.to_string())?;
        return Ok(status.code().unwrap_or(1));
    }
    println!(
        "xtask: no GPU here. On a GPU machine (x86-64 Linux, NVIDIA driver, no Rust needed), copy target/gpu-bundle and run:\n  bash target/gpu-bundle/run.sh"
    );
    Ok(0)
}
