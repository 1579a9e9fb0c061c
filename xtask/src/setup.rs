//! `cargo xtask setup`: packages, the Debian kernel with `rdma_rxe`, the
//! guest's kernel image and initramfs. Every step is skipped when its
//! output already exists.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{Result, cache_dir, output, privileged, run};

/// Debian packages for building gpu-rdma: rdma-core's headers and
/// libraries, bindgen's libclang.
pub const BUILD_PACKAGES: &[&str] = &[
    "build-essential",
    "pkg-config",
    "libclang-dev",
    "clang",
    "libibverbs-dev",
    "librdmacm-dev",
    "rdma-core",
    "ibverbs-providers",
    // The `etcd` feature's client compiles etcd's protocol files with protoc.
    "protobuf-compiler",
    // A real etcd for the rendezvous tests and examples (started by them).
    "etcd-server",
    // The Python binding: a venv for maturin, pytest and numpy (from PyPI).
    "python3-venv",
    "python3-pip",
];

/// And for the soft-RoCE VM: qemu, busybox, module tools, perftest.
const VM_PACKAGES: &[&str] = &[
    "ibverbs-utils",
    "perftest",
    // UCX's ucx_perftest, the second anchor of `cargo xtask compare`.
    "ucx-utils",
    "qemu-system-x86",
    "busybox-static",
    "kmod",
    "cpio",
    "xz-utils",
    "zstd",
    "gzip",
    "iproute2",
];

/// The modules the initramfs loads to mount the host's root.
const INITRAMFS_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];

const INIT_SH: &str = include_str!("../assets/init.sh");

/// What the VM boots.
#[derive(Clone, Debug)]
pub struct Kernel {
    /// The unpacked linux-image package.
    pub root: PathBuf,
    /// Its kernel release (`6.1.0-57-amd64`).
    pub release: String,
    /// The uncompressed ELF kernel (booted directly, PVH).
    pub vmlinux: PathBuf,
    /// The initramfs.
    pub initramfs: PathBuf,
}

impl Kernel {
    /// The unpacked `/lib/modules`.
    pub fn modules_dir(&self) -> PathBuf {
        self.root.join("lib/modules")
    }
}

pub fn setup() -> Result<Kernel> {
    ensure_packages(BUILD_PACKAGES, BUILD_WHY)?;
    ensure_packages(VM_PACKAGES, VM_WHY)?;
    let kernel = ensure_kernel()?;
    println!("xtask: setup done: kernel {} in {}", kernel.release, kernel.root.display());
    Ok(kernel)
}

/// Why [`BUILD_PACKAGES`] are installed, as setup says before it does.
pub const BUILD_WHY: &str = "to build gpu-rdma and run its tests here: a C toolchain, rdma-core's headers, \
     clang for bindgen, protoc for the etcd client, etcd-server for the rendezvous tests (never left running)";

/// Why [`VM_PACKAGES`] are installed.
const VM_WHY: &str = "for the soft-RoCE test VM: qemu, busybox and module tools, perftest and UCX as the \
     benchmarks' anchors";

/// Services that packages here enable, and that setup leaves stopped and
/// disabled (the tests start their own etcd on a port of their own).
const SERVICES: &[(&str, &str)] = &[("etcd-server", "etcd.service")];

/// Installs those of `packages` that are missing, saying first which and
/// `why`, and what apt would upgrade with them. It never removes a package
/// (`--no-remove`: apt stops instead, and this says what conflicts), and
/// leaves no service of theirs enabled or running.
pub fn ensure_packages(packages: &[&str], why: &str) -> Result<()> {
    let status = Command::new("dpkg-query")
        .args(["-W", "-f=${Package} ${db:Status-Status}\n"])
        .args(packages)
        .stderr(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run dpkg-query (is this Debian?): {e}"))?;
    let text = String::from_utf8_lossy(&status.stdout);
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| !text.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == [*p, "installed"]))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    println!("xtask: installing {} ({why})", missing.join(" "));
    run(privileged("apt-get").arg("update").arg("-q"))?;
    let install = |simulate: bool, target: Option<&str>| {
        let mut c = privileged("apt-get");
        c.env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-q", "--no-install-recommends", "--no-remove"])
            .args(&missing);
        if let Some(suite) = target {
            // Raises the suite's priority for this command only: what it
            // does not carry still comes from the release.
            c.args(["-t", suite]);
        }
        if simulate {
            c.arg("-s");
        }
        c
    };
    let cannot = |e: String| {
        format!(
            "apt cannot install {} without removing packages you have, and xtask never removes one: {e}\n\
             install them yourself, or remove what conflicts, then run this again",
            missing.join(" ")
        )
    };
    let mut target = None;
    let plan = match output(&mut install(true, None)) {
        Ok(text) => Plan::parse(&text),
        // A machine with packages from backports (seen: qemu-utils 10 from
        // bookworm-backports, which breaks Debian 12's qemu-system 7.2) gets
        // what conflicts with them from the same suite.
        Err(e) => {
            let held = from_backports();
            let Some(suite) = backports_suite().filter(|_| !held.is_empty()) else { return Err(cannot(e)) };
            println!(
                "xtask: Debian's release versions of {} conflict with what this machine has from {suite} ({}): \
                 taking them from {suite} where it carries them",
                missing.join(" "),
                held.join(" ")
            );
            ensure_source(&suite)?;
            let plan = Plan::parse(&output(&mut install(true, Some(&suite))).map_err(cannot)?);
            target = Some(suite);
            plan
        }
    };
    if !plan.remove.is_empty() {
        return Err(format!(
            "installing {} would remove {}; xtask never removes a package: resolve that yourself first",
            missing.join(" "),
            plan.remove.join(" ")
        ));
    }
    println!(
        "xtask: apt will install {} package(s){}",
        plan.install.len(),
        if plan.upgrade.is_empty() {
            String::new()
        } else {
            format!(" and upgrade {} they need: {}", plan.upgrade.len(), plan.upgrade.join(" "))
        }
    );
    // A policy that refuses to start services while apt runs (Debian's
    // policy-rc.d), unless the machine has one of its own.
    let policy = Path::new("/usr/sbin/policy-rc.d");
    let ours = !policy.exists()
        && run(privileged("sh").args([
            "-c",
            "printf '#!/bin/sh\\nexit 101\\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d",
        ]))
        .is_ok();
    let installed = run(&mut install(false, target.as_deref()));
    if ours {
        let _ = run(privileged("rm").args(["-f", "/usr/sbin/policy-rc.d"]));
    }
    installed?;
    for (package, service) in SERVICES {
        if missing.contains(package) {
            // Disabling only edits links: it works where systemd is not
            // running (a container, a chroot) too; stopping needs systemd.
            let running = Path::new("/run/systemd/system").exists();
            println!(
                "xtask: {package} enabled {service}: disabling{} it (the tests start their own etcd)",
                if running { " and stopping" } else { "" }
            );
            let mut disable = privileged("systemctl");
            disable.args(["disable", "--quiet", service]);
            if running {
                disable.arg("--now");
            }
            if let Err(e) = run(&mut disable) {
                println!(
                    "xtask: could not disable {service} ({e}); disable it with `systemctl disable --now {service}`"
                );
            }
        }
    }
    Ok(())
}

/// The installed packages whose version came from a Debian backports
/// suite (`1:10.0.2+ds-2+deb13u1~bpo12+1`), as `name version`.
fn from_backports() -> Vec<String> {
    let Ok(text) = output(Command::new("dpkg-query").args(["-W", "-f=${Package} ${Version} ${db:Status-Status}\n"]))
    else {
        return Vec::new();
    };
    backported(&text)
}

/// [`from_backports`] of `dpkg-query`'s `name version status` lines.
fn backported(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [name, version, "installed"] if version.contains("~bpo") => Some(format!("{name} {version}")),
            _ => None,
        })
        .collect()
}

/// This release's backports suite (`bookworm-backports`), from
/// `/etc/os-release`.
fn backports_suite() -> Option<String> {
    suite_of(&fs::read_to_string("/etc/os-release").ok()?)
}

/// [`backports_suite`] of an os-release file's text.
fn suite_of(release: &str) -> Option<String> {
    let codename = release.lines().find_map(|l| l.strip_prefix("VERSION_CODENAME="))?.trim_matches('"');
    (!codename.is_empty()).then(|| format!("{codename}-backports"))
}

/// Makes apt see `suite`: when no source names it, a file of ours in
/// `sources.list.d`, then a refresh of apt's lists (the caller refreshed
/// them just before, so a suite already there needs none). Backports stay
/// at apt's low default priority: nothing comes from them unless asked for.
fn ensure_source(suite: &str) -> Result<()> {
    let policy = output(Command::new("apt-cache").arg("policy"))?;
    if policy.lines().any(|l| l.split_whitespace().any(|w| w.starts_with(&format!("{suite}/")))) {
        return Ok(());
    }
    let file = format!("/etc/apt/sources.list.d/gpu-rdma-{suite}.sources");
    println!("xtask: adding Debian's {suite} to apt's sources ({file})");
    let text = format!(
        "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: {suite}\nComponents: main\n\
         Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    );
    let mut tee = privileged("tee");
    let mut child = tee
        .arg(&file)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run tee: {e}"))?;
    child.stdin.take().ok_or("tee has no stdin")?.write_all(text.as_bytes()).map_err(|e| format!("{file}: {e}"))?;
    let status = child.wait().map_err(|e| format!("tee {file}: {e}"))?;
    if !status.success() {
        return Err(format!("cannot write {file}: {status}"));
    }
    run(privileged("apt-get").arg("update").arg("-q"))
}

/// What `apt-get install -s` says it would do.
#[derive(Debug, Default, PartialEq, Eq)]
struct Plan {
    install: Vec<String>,
    upgrade: Vec<String>,
    remove: Vec<String>,
}

impl Plan {
    /// Parses the simulation's `Inst name [old] (new ...)` (an upgrade when
    /// an old version is named) and `Remv name [old]` lines.
    fn parse(text: &str) -> Plan {
        let mut plan = Plan::default();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some("Inst"), Some(name), Some(next)) if next.starts_with('[') => plan.upgrade.push(name.into()),
                (Some("Inst"), Some(name), _) => plan.install.push(name.into()),
                (Some("Remv"), Some(name), _) => plan.remove.push(name.into()),
                _ => {}
            }
        }
        plan
    }
}

/// The package name of Debian's current kernel (`linux-image-6.1.0-57-amd64`).
fn kernel_package() -> Result<String> {
    if let Ok(p) = std::env::var("GPU_RDMA_VM_KERNEL_PACKAGE") {
        return Ok(p);
    }
    let deps = output(Command::new("apt-cache").args(["depends", "linux-image-amd64"]))?;
    deps.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| p.starts_with("linux-image-") && p.ends_with("-amd64"))
        .map(str::to_owned)
        .ok_or_else(|| format!("no linux-image package in `apt-cache depends linux-image-amd64`:\n{deps}"))
}

pub fn ensure_kernel() -> Result<Kernel> {
    let cache = cache_dir();
    let pkg = kernel_package()?;
    let root = cache.join(&pkg);
    let modules = root.join("lib/modules");
    if !modules.is_dir() {
        let debs = cache.join("debs");
        fs::create_dir_all(&debs).map_err(|e| format!("{}: {e}", debs.display()))?;
        let deb = match find_deb(&debs, &pkg) {
            Some(d) => d,
            None => {
                println!("xtask: downloading {pkg}");
                run(Command::new("apt-get").args(["download", "-q", &pkg]).current_dir(&debs))?;
                find_deb(&debs, &pkg)
                    .ok_or_else(|| format!("apt-get download {pkg} left no .deb in {}", debs.display()))?
            }
        };
        let partial = cache.join(format!("{pkg}.partial"));
        let _ = fs::remove_dir_all(&partial);
        run(Command::new("dpkg").arg("-x").arg(&deb).arg(&partial))?;
        fs::rename(&partial, &root).map_err(|e| format!("{}: {e}", root.display()))?;
    }
    let release = fs::read_dir(&modules)
        .map_err(|e| format!("{}: {e}", modules.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .ok_or_else(|| format!("no kernel release under {}", modules.display()))?;
    if !modules.join(&release).join("modules.dep").is_file() {
        run(Command::new("depmod").arg("-b").arg(&root).arg(&release))?;
    }

    let vmlinux = cache.join(format!("vmlinux-{release}"));
    if !vmlinux.is_file() {
        let image = root.join(format!("boot/vmlinuz-{release}"));
        extract_vmlinux(&image, &vmlinux)?;
    }

    let initramfs = cache.join(format!("initramfs-{release}.cpio.gz"));
    let stamp = cache.join(format!("initramfs-{release}.init.sh"));
    if !initramfs.is_file() || fs::read_to_string(&stamp).ok().as_deref() != Some(INIT_SH) {
        build_initramfs(&root, &release, &initramfs)?;
        fs::write(&stamp, INIT_SH).map_err(|e| format!("{}: {e}", stamp.display()))?;
    }
    Ok(Kernel { root, release, vmlinux, initramfs })
}

fn find_deb(dir: &Path, pkg: &str) -> Option<PathBuf> {
    fs::read_dir(dir).ok()?.filter_map(|e| e.ok()).map(|e| e.path()).find(|p| {
        p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&format!("{pkg}_")) && n.ends_with(".deb"))
    })
}

/// Finds the compressed payload in a bzImage and decompresses it: booting the
/// ELF directly (PVH) skips the in-guest decompression, slow under emulation.
fn extract_vmlinux(image: &Path, out: &Path) -> Result<()> {
    let bytes = fs::read(image).map_err(|e| format!("{}: {e}", image.display()))?;
    let formats: [(&[u8], &str, &[&str]); 3] = [
        (b"\xfd7zXZ\x00", "xz", &["-dc"]),
        (b"\x28\xb5\x2f\xfd", "zstd", &["-dcq"]),
        (b"\x1f\x8b\x08", "gzip", &["-dc"]),
    ];
    for (magic, tool, args) in formats {
        let mut from = 0;
        while let Some(pos) = find(&bytes[from..], magic).map(|p| p + from) {
            from = pos + 1;
            let mut child = Command::new(tool)
                .args(args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("cannot run {tool}: {e}"))?;
            let mut stdin = child.stdin.take().expect("piped");
            let payload = bytes[pos..].to_vec();
            let writer = std::thread::spawn(move || {
                let _ = stdin.write_all(&payload);
            });
            let mut elf = Vec::new();
            let _ = child.stdout.take().expect("piped").read_to_end(&mut elf);
            let _ = child.wait();
            let _ = writer.join();
            if elf.starts_with(b"\x7fELF") {
                fs::write(out, &elf).map_err(|e| format!("{}: {e}", out.display()))?;
                println!("xtask: extracted {} ({} MiB)", out.display(), elf.len() >> 20);
                return Ok(());
            }
        }
    }
    Err(format!("no compressed kernel found in {}", image.display()))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A busybox initramfs with the modules that mount the host's root.
fn build_initramfs(root: &Path, release: &str, out: &Path) -> Result<()> {
    let work = cache_dir().join("initramfs.work");
    let _ = fs::remove_dir_all(&work);
    let modules_dir = work.join("modules");
    fs::create_dir_all(work.join("bin")).map_err(|e| e.to_string())?;
    fs::create_dir_all(&modules_dir).map_err(|e| e.to_string())?;
    fs::copy("/bin/busybox", work.join("bin/busybox")).map_err(|e| format!("/bin/busybox: {e}"))?;
    fs::write(work.join("init"), INIT_SH).map_err(|e| e.to_string())?;
    run(Command::new("chmod").arg("+x").arg(work.join("init")))?;

    let mut order: Vec<String> = Vec::new();
    for module in INITRAMFS_MODULES {
        let deps =
            output(Command::new("modprobe").arg("-d").arg(root).args(["-S", release, "--show-depends", module]))?;
        for line in deps.lines() {
            let mut words = line.split_whitespace();
            if words.next() != Some("insmod") {
                continue;
            }
            let Some(path) = words.next() else { continue };
            let file = Path::new(path).file_name().and_then(|n| n.to_str()).unwrap_or_default();
            let name = file.split(".ko").next().unwrap_or_default().to_owned();
            if name.is_empty() || order.contains(&name) {
                continue;
            }
            let data = match file.rsplit('.').next() {
                Some("xz") => output_bytes(Command::new("xz").arg("-dc").arg(path))?,
                Some("zst") => output_bytes(Command::new("zstd").arg("-dcq").arg(path))?,
                Some("gz") => output_bytes(Command::new("gzip").arg("-dc").arg(path))?,
                _ => fs::read(path).map_err(|e| format!("{path}: {e}"))?,
            };
            fs::write(modules_dir.join(format!("{name}.ko")), data).map_err(|e| e.to_string())?;
            order.push(name);
        }
    }
    fs::write(work.join("modules.order"), order.join("\n") + "\n").map_err(|e| e.to_string())?;
    let script = format!("cd '{}' && find . | cpio -o -H newc --quiet | gzip -1 > '{}'", work.display(), out.display());
    run(Command::new("sh").arg("-c").arg(script))?;
    let _ = fs::remove_dir_all(&work);
    println!("xtask: built {} (modules: {})", out.display(), order.join(" "));
    Ok(())
}

fn output_bytes(cmd: &mut Command) -> Result<Vec<u8>> {
    let out = cmd.output().map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?} failed: {}", out.status));
    }
    Ok(out.stdout)
}

#[cfg(test)]
mod tests {
    use super::{Plan, backported, suite_of};

    #[test]
    fn packages_from_backports_are_told_by_their_version() {
        let text = "qemu-utils 1:10.0.2+ds-2+deb13u1~bpo12+1 installed\n\
                    qemu-system-x86 1:7.2+dfsg-7+deb12u18+b3 installed\n\
                    osslsigncode 2.9-1~bpo12+1 config-files\n\
                    libc6 2.36-9+deb12u10 installed\n";
        assert_eq!(backported(text), ["qemu-utils 1:10.0.2+ds-2+deb13u1~bpo12+1"]);
        assert!(backported("").is_empty());
    }

    #[test]
    fn the_backports_suite_is_named_by_the_release() {
        let release = "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nVERSION_CODENAME=bookworm\nID=debian\n";
        assert_eq!(suite_of(release).as_deref(), Some("bookworm-backports"));
        assert_eq!(suite_of("VERSION_CODENAME=\"trixie\"\n").as_deref(), Some("trixie-backports"));
        assert_eq!(suite_of("ID=debian\n"), None);
        assert_eq!(suite_of("VERSION_CODENAME=\n"), None);
    }

    #[test]
    fn a_simulation_says_what_is_installed_upgraded_and_removed() {
        let text = "NOTE: This is only a simulation!\n\
            Inst libsystemd0 [252.30-1~deb12u2] (252.33-1~deb12u1 Debian:12.9/stable [amd64])\n\
            Inst etcd-server (3.4.23-4+b6 Debian:12.9/stable [amd64])\n\
            Remv qemu-utils [1:7.2+dfsg-7+deb12u7]\n\
            Conf etcd-server (3.4.23-4+b6 Debian:12.9/stable [amd64])\n";
        let plan = Plan::parse(text);
        assert_eq!(plan.install, ["etcd-server"]);
        assert_eq!(plan.upgrade, ["libsystemd0"]);
        assert_eq!(plan.remove, ["qemu-utils"]);
    }
}
