//! The soft-RoCE VM: qemu (TCG: KVM does not work on these hosts) boots the
//! Debian kernel directly, mounts the host root read-only with a tmpfs
//! overlay, brings up `rxe0` on a dummy netdev and runs a script as root.
//!
//! The guest has no network device to the outside: `rxe0` is addressed by
//! its IPv6 link-local GID and out-of-band TCP uses 127.0.0.1.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::setup::{self, Kernel};
use crate::{Result, cache_dir};

const RXE_UP: &str = include_str!("../assets/rxe-up.sh");

#[derive(Clone, Debug)]
pub struct VmOptions {
    pub timeout: Duration,
    pub mem: String,
    pub smp: u32,
    pub keep: bool,
}

impl Default for VmOptions {
    fn default() -> Self {
        VmOptions { timeout: Duration::from_secs(900), mem: "3G".into(), smp: 2, keep: false }
    }
}

/// A finished guest run.
pub struct VmRun {
    /// The script's exit code (124 when the VM timed out or died).
    pub code: i32,
    /// Its run directory: the guest's `$VM_OUT`, with what it wrote there.
    pub dir: PathBuf,
    keep: bool,
}

impl VmRun {
    /// Keeps the run directory after all: for a run that went wrong in a
    /// way only its caller can tell (the guest script itself exited 0).
    pub fn keep(&mut self) {
        self.keep = true;
    }
}

impl Drop for VmRun {
    fn drop(&mut self) {
        if !self.keep && self.code == 0 {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// Single-quotes a word for bash.
pub fn quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', "'\\''"))
}

/// Where each guest run's directory is made (and kept runs stay).
pub fn runs_dir() -> PathBuf {
    cache_dir().join("runs")
}

/// Boots the guest and runs `body` (bash) in it from `cwd`, after `rxe0` is up.
pub fn run_script(kernel: &Kernel, cwd: &Path, body: &str, opts: &VmOptions) -> Result<VmRun> {
    let runs = runs_dir();
    fs::create_dir_all(&runs).map_err(|e| format!("{}: {e}", runs.display()))?;
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis();
    let dir = runs.join(format!("run-{stamp}-{}", std::process::id()));
    fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let script = format!("cd {}\n{RXE_UP}\n{body}\n", quote(&cwd.to_string_lossy()));
    fs::write(dir.join("guest.sh"), script).map_err(|e| e.to_string())?;

    let append = format!(
        "console=ttyS0 panic=-1 quiet loglevel=3 mitigations=off vm.out={} vm.mods={}",
        dir.display(),
        kernel.modules_dir().display()
    );
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args(["-accel", "tcg,thread=multi", "-cpu", "max", "-machine", "q35"])
        .args(["-smp", &opts.smp.to_string(), "-m", &opts.mem])
        .args(["-nographic", "-no-reboot", "-nodefaults", "-serial", "stdio"]);
    if Path::new("/usr/share/qemu/qboot.rom").is_file() {
        qemu.args(["-bios", "/usr/share/qemu/qboot.rom"]);
    }
    qemu.arg("-kernel")
        .arg(&kernel.vmlinux)
        .arg("-initrd")
        .arg(&kernel.initramfs)
        .args(["-append", &append])
        .args(["-fsdev", "local,id=fsroot,path=/,security_model=none,readonly=on,multidevs=remap"])
        .args(["-device", "virtio-9p-pci,fsdev=fsroot,mount_tag=hostroot"])
        .arg("-fsdev")
        .arg(format!("local,id=fsout,path={},security_model=none", dir.display()))
        .args(["-device", "virtio-9p-pci,fsdev=fsout,mount_tag=vmout", "-device", "virtio-rng-pci"])
        .stdin(Stdio::null());

    let t0 = Instant::now();
    let mut child = qemu.spawn().map_err(|e| format!("cannot start qemu-system-x86_64: {e}"))?;
    let mut timed_out = false;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if t0.elapsed() > opts.timeout => {
                let _ = child.kill();
                let _ = child.wait();
                timed_out = true;
                break;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => return Err(format!("waiting for qemu: {e}")),
        }
    }
    let code = fs::read_to_string(dir.join("exit_code")).ok().and_then(|s| s.trim().parse::<i32>().ok()).unwrap_or(124);
    let boot = fs::read_to_string(dir.join("boot_seconds")).unwrap_or_default();
    eprintln!(
        "xtask: vm: {:.1} s wall, guest booted in {} s, exit {code}{}",
        t0.elapsed().as_secs_f64(),
        boot.trim(),
        if timed_out { format!(" (timed out after {:?})", opts.timeout) } else { String::new() }
    );
    Ok(VmRun { code, dir, keep: opts.keep })
}

/// `cargo xtask vm [--timeout SECS] [--mem SIZE] [--keep] -- CMD [ARGS]`.
pub fn command(args: &[String]) -> Result<i32> {
    let mut opts = VmOptions::default();
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--" => {
                i += 1;
                break;
            }
            "--timeout" => {
                let v = args.get(i + 1).ok_or("--timeout needs seconds")?;
                opts.timeout = Duration::from_secs(v.parse().map_err(|_| format!("--timeout {v}: not a number"))?);
                i += 2;
            }
            "--mem" => {
                opts.mem = args.get(i + 1).ok_or("--mem needs a size like 3G")?.clone();
                i += 2;
            }
            "--keep" => {
                opts.keep = true;
                i += 1;
            }
            _ => break,
        }
    }
    let cmd = &args[i..];
    if cmd.is_empty() {
        return Err("usage: cargo xtask vm [--timeout SECS] [--mem SIZE] [--keep] -- CMD [ARGS]".into());
    }
    let kernel = setup::ensure_kernel()?;
    let words: Vec<String> = cmd.iter().map(|w| quote(w)).collect();
    let cwd = std::env::current_dir().map_err(|e| e.to_string())?;
    let run = run_script(&kernel, &cwd, &words.join(" "), &opts)?;
    if opts.keep || run.code != 0 {
        eprintln!("xtask: vm: run directory {}", run.dir.display());
    }
    Ok(run.code)
}
