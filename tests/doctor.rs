//! The doctor on recorded machines: small sysfs trees built here, and
//! `nvidia-smi topo -m` texts in the layouts real drivers print
//! (`tests/fixtures/topo/`). Needs no device.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpu_rdma::topology::{Inputs, LinkClass, Status, doctor, smi};

/// A sysfs tree under a temporary directory.
struct Tree {
    root: PathBuf,
}

impl Tree {
    fn new(name: &str) -> Tree {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let root = std::env::temp_dir().join(format!("gpu-rdma-sysfs-{name}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(root.join("devices")).unwrap();
        fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
        fs::create_dir_all(root.join("class/infiniband")).unwrap();
        Tree { root }
    }

    /// A PCI device at `complex/path...` (the last element is the device),
    /// with the bridges on the way created too.
    fn device(&self, complex: &str, path: &[&str], numa: i32, vendor: &str, class: &str) -> String {
        let mut dir = self.root.join("devices").join(complex);
        let mut rel = format!("devices/{complex}");
        for p in path {
            dir = dir.join(p);
            rel = format!("{rel}/{p}");
            fs::create_dir_all(&dir).unwrap();
            if !dir.join("class").exists() {
                fs::write(dir.join("vendor"), "0x8086\n").unwrap();
                fs::write(dir.join("class"), "0x060400\n").unwrap();
                fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
            }
        }
        fs::write(dir.join("vendor"), format!("{vendor}\n")).unwrap();
        fs::write(dir.join("class"), format!("{class}\n")).unwrap();
        let addr = path.last().unwrap().to_string();
        let _ = std::os::unix::fs::symlink(format!("../../../{rel}"), self.root.join("bus/pci/devices").join(&addr));
        rel
    }

    fn gpu(&self, complex: &str, path: &[&str], numa: i32) {
        let rel = self.device(complex, path, numa, "0x10de", "0x030200");
        let dir = self.root.join(rel);
        fs::write(dir.join("resource"), "0x00000000f0000000 0x00000000f0ffffff 0x0000000000040200\n0x0000038000000000 0x0000039fffffffff 0x000000000014220c\n").unwrap();
        fs::write(dir.join("current_link_speed"), "16.0 GT/s PCIe\n").unwrap();
        fs::write(dir.join("max_link_speed"), "16.0 GT/s PCIe\n").unwrap();
    }

    fn nic(&self, name: &str, complex: &str, path: &[&str], numa: i32, rate: &str) {
        let rel = self.device(complex, path, numa, "0x15b3", "0x020700");
        let ib = self.root.join("class/infiniband").join(name);
        fs::create_dir_all(ib.join("ports/1/gids")).unwrap();
        fs::create_dir_all(ib.join("ports/1/gid_attrs/types")).unwrap();
        std::os::unix::fs::symlink(format!("../../../{rel}"), ib.join("device")).unwrap();
        fs::write(ib.join("ports/1/state"), "4: ACTIVE\n").unwrap();
        fs::write(ib.join("ports/1/link_layer"), "InfiniBand\n").unwrap();
        fs::write(ib.join("ports/1/rate"), format!("{rate}\n")).unwrap();
        fs::write(ib.join("ports/1/gids/0"), "fe80:0000:0000:0000:0c42:a103:0054:ab12\n").unwrap();
        fs::write(ib.join("ports/1/gids/1"), "0000:0000:0000:0000:0000:0000:0000:0000\n").unwrap();
        fs::write(ib.join("ports/1/gid_attrs/types/0"), "IB/RoCE v1\n").unwrap();
        let dev = self.root.join(rel);
        fs::write(dev.join("current_link_speed"), "16.0 GT/s PCIe\n").unwrap();
        fs::write(dev.join("max_link_speed"), "16.0 GT/s PCIe\n").unwrap();
        fs::write(dev.join("current_link_width"), "16\n").unwrap();
        fs::write(dev.join("max_link_width"), "16\n").unwrap();
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

fn fixture(name: &str) -> String {
    fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/topo").join(name)).unwrap()
}

fn hex(n: u32) -> String {
    format!("{n:02x}")
}

/// The 8-GPU NVLink server: four PCIe switches, each with two GPUs and two
/// NICs; two switches per socket, each switch under its own root complex.
fn dgx8() -> Tree {
    let t = Tree::new("dgx8");
    for k in 0..4u32 {
        let rc = [0x10u32, 0x30, 0x90, 0xb0][k as usize];
        let numa = if k < 2 { 0 } else { 1 };
        let complex = format!("pci0000:{}", hex(rc));
        let rp = format!("0000:{}:01.0", hex(rc));
        let up = format!("0000:{}:00.0", hex(rc + 1));
        let dev = |i: u32, fun: u32| {
            (format!("0000:{}:{:02x}.0", hex(rc + 2), i), format!("0000:{}:00.{fun}", hex(rc + 3 + i)))
        };
        for (i, is_gpu) in [(0u32, true), (1, true), (2, false), (3, false)] {
            let (down, ep) = dev(i, 0);
            let path = [rp.as_str(), up.as_str(), down.as_str(), ep.as_str()];
            if is_gpu {
                t.gpu(&complex, &path, numa);
            } else {
                t.nic(&format!("mlx5_{}", 2 * k + i - 2), &complex, &path, numa, "200 Gb/sec (4X HDR)");
            }
        }
    }
    t
}

/// Two GPUs on socket 0, two NICs (one switch) on socket 1.
fn nics_other_socket() -> Tree {
    let t = Tree::new("other-socket");
    t.gpu("pci0000:17", &["0000:17:00.0", "0000:18:00.0"], 0);
    t.gpu("pci0000:3a", &["0000:3a:00.0", "0000:3b:00.0"], 0);
    let sw = ["0000:ae:00.0", "0000:af:00.0"];
    t.nic("mlx5_0", "pci0000:ae", &[sw[0], sw[1], "0000:b0:00.0", "0000:b1:00.0"], 1, "100 Gb/sec (4X EDR)");
    t.nic("mlx5_1", "pci0000:ae", &[sw[0], sw[1], "0000:b0:01.0", "0000:b2:00.0"], 1, "100 Gb/sec (4X EDR)");
    t
}

/// A workstation: one GPU and one NIC on two root ports of one root complex.
fn workstation() -> Tree {
    let t = Tree::new("workstation");
    t.gpu("pci0000:00", &["0000:00:01.0", "0000:01:00.0"], -1);
    t.nic("mlx5_0", "pci0000:00", &["0000:00:1c.0", "0000:02:00.0"], -1, "100 Gb/sec (4X EDR)");
    t
}

/// Two GPUs, no RDMA NIC.
fn no_nic() -> Tree {
    let t = Tree::new("no-nic");
    t.gpu("pci0000:00", &["0000:00:01.0", "0000:01:00.0"], 0);
    t.gpu("pci0000:00", &["0000:00:02.0", "0000:02:00.0"], 0);
    t
}

/// An RDMA NIC, no GPU.
fn no_gpu() -> Tree {
    let t = Tree::new("no-gpu");
    t.nic("mlx5_0", "pci0000:00", &["0000:00:01.0", "0000:01:00.0"], 0, "100 Gb/sec (4X EDR)");
    t
}

const PEERMEM_MODULES: &str = "nvidia_peermem 16384 0 - Live 0x0\nnvidia 56000000 10 nvidia_peermem, Live 0x0\n";

fn inputs(tree: &Tree, smi: Option<&str>) -> Inputs {
    Inputs {
        sysfs: tree.root.clone(),
        proc_modules: PEERMEM_MODULES.into(),
        nvidia_version: Some("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15\n".into()),
        kernel_release: "6.1.0-57-amd64".into(),
        nvidia_smi_topo: smi.map(fixture),
        rdma_core_dmabuf: true,
        ..Inputs::default()
    }
}

fn sysfs_links(tree: &Tree) -> BTreeMap<(String, String), LinkClass> {
    let r = doctor(&inputs(tree, None), LinkClass::Pxb, None);
    assert_eq!(r.links_source, "sysfs");
    r.links.into_iter().map(|l| ((l.gpu, l.nic), l.link)).collect()
}

#[test]
fn nvidia_smi_layouts_parse_old_and_new() {
    let new = smi::parse(&fixture("dgx8-nvlink.txt")).unwrap();
    assert_eq!(new.gpus.len(), 8);
    assert_eq!(new.nics, (0..8).map(|i| format!("mlx5_{i}")).collect::<Vec<_>>(), "the NIC legend names the columns");
    assert_eq!(new.links[&("GPU0".into(), "mlx5_1".into())], LinkClass::Pix);
    assert_eq!(new.links[&("GPU0".into(), "mlx5_2".into())], LinkClass::Node);
    assert_eq!(new.links[&("GPU7".into(), "mlx5_0".into())], LinkClass::Sys);
    assert_eq!(new.gpu_numa["GPU5"], 1);
    let mp = smi::parse(&fixture("dgx8-mp.txt")).unwrap();
    assert_eq!(mp.links, new.links, "-mp gives the same GPU-NIC pairs");
    let old = smi::parse(&fixture("nics-other-socket-old.txt")).unwrap();
    assert_eq!(old.nics, vec!["mlx5_0", "mlx5_1"]);
    assert!(old.links.values().all(|c| *c == LinkClass::Sys));
    // Older nvidia-smi prints SOC where newer ones print SYS: the same class.
    let soc = smi::parse(&fixture("nics-other-socket-soc.txt")).unwrap();
    assert_eq!(soc.links, old.links, "SOC is SYS");
    assert_eq!(soc.links.len(), 4);
    assert_eq!(LinkClass::parse("soc"), Some(LinkClass::Sys));
    let none = smi::parse(&fixture("no-nic.txt")).unwrap();
    assert_eq!((none.gpus.len(), none.nics.len()), (2, 0));
}

#[test]
fn sysfs_agrees_with_nvidia_smi_pair_by_pair() {
    for (tree, text) in [
        (dgx8(), "dgx8-nvlink.txt"),
        (dgx8(), "dgx8-mp.txt"),
        (nics_other_socket(), "nics-other-socket-old.txt"),
        (nics_other_socket(), "nics-other-socket-soc.txt"),
        (workstation(), "workstation-phb.txt"),
    ] {
        let ours = sysfs_links(&tree);
        let theirs = smi::parse(&fixture(text)).unwrap().links;
        assert_eq!(ours.len(), theirs.len(), "{text}");
        for (pair, class) in &theirs {
            assert_eq!(ours.get(pair), Some(class), "{text}: {pair:?}");
        }
        let r = doctor(&inputs(&tree, Some(text)), LinkClass::Pxb, None);
        assert!(r.disagreements.is_empty(), "{text}: {:?}", r.disagreements);
        assert!(r.checks.iter().any(|c| c.name == "topology cross-check" && c.status == Status::Ok), "{text}");
    }
}

#[test]
fn a_disagreement_between_sysfs_and_nvidia_smi_is_reported() {
    let tree = workstation();
    let text = fixture("workstation-phb.txt").replace("PHB\t0-15", "PIX\t0-15");
    let mut i = inputs(&tree, None);
    i.nvidia_smi_topo = Some(text);
    let r = doctor(&i, LinkClass::Pxb, None);
    assert_eq!(r.disagreements.len(), 1, "{:?}", r.disagreements);
    assert!(r.disagreements[0].contains("nvidia-smi says PIX, sysfs says PHB"));
}

#[test]
fn the_nvlink_server_pairs_each_gpu_with_its_own_nic() {
    let tree = dgx8();
    let r = doctor(&inputs(&tree, None), LinkClass::Pxb, None);
    for v in &r.verdicts {
        let i: usize = v.gpu[3..].parse().unwrap();
        assert_eq!(v.best_nic.as_deref(), Some(format!("mlx5_{i}").as_str()), "{v:?}");
        assert_eq!(v.link, Some(LinkClass::Pix));
        assert!(v.usable, "{v:?}");
    }
    assert_eq!(r.exit_code, 0);
}

#[test]
fn nics_on_the_other_socket_are_not_usable_at_pxb_and_say_how_to_fix() {
    let tree = nics_other_socket();
    let r = doctor(&inputs(&tree, None), LinkClass::Pxb, None);
    assert_eq!(r.exit_code, 1);
    for v in &r.verdicts {
        assert_eq!(v.link, Some(LinkClass::Sys));
        assert!(!v.usable);
        assert!(v.reasons[0].contains("SYS apart"), "{v:?}");
        assert!(v.fixes[0].contains("under one PCIe switch") && v.fixes[0].contains("--gdr-level SYS"), "{v:?}");
    }
    assert_eq!(r.verdicts[0].best_nic.as_deref(), Some("mlx5_0"));
    assert_eq!(r.verdicts[1].best_nic.as_deref(), Some("mlx5_1"), "ties are spread");
    let relaxed = doctor(&inputs(&tree, None), LinkClass::Sys, None);
    assert_eq!(relaxed.exit_code, 0);
}

#[test]
fn a_workstation_through_the_cpu_is_phb() {
    let tree = workstation();
    let r = doctor(&inputs(&tree, None), LinkClass::Pxb, None);
    assert_eq!(r.verdicts[0].link, Some(LinkClass::Phb));
    assert_eq!(r.exit_code, 1);
    assert_eq!(doctor(&inputs(&tree, None), LinkClass::Phb, Some(0)).exit_code, 0);
}

#[test]
fn no_nic_and_no_gpu_are_said_plainly() {
    let tree = no_nic();
    let r = doctor(&inputs(&tree, Some("no-nic.txt")), LinkClass::Pxb, None);
    assert_eq!(r.exit_code, 1);
    assert!(r.verdicts.iter().all(|v| v.best_nic.is_none() && v.reasons[0].contains("no RDMA NIC")));
    let rdma = r.checks.iter().find(|c| c.name == "RDMA devices" && c.status == Status::Fail).expect("the check");
    assert!(!rdma.detail.contains("no RDMA support"), "the RDMA class exists: {rdma:?}");
    assert!(rdma.fix.as_deref().is_some_and(|f| f.contains("rdma_rxe")));
    // A kernel without its RDMA core (no class, no ib_core): said so, and
    // what to do when modprobe finds nothing.
    fs::remove_dir_all(tree.root.join("class/infiniband")).unwrap();
    let r = doctor(&inputs(&tree, Some("no-nic.txt")), LinkClass::Pxb, None);
    let rdma = r.checks.iter().find(|c| c.name == "RDMA devices").expect("the check");
    assert!(rdma.detail.contains("no RDMA support"), "{rdma:?}");
    assert!(rdma.fix.as_deref().is_some_and(|f| f.contains("built without InfiniBand")), "{rdma:?}");

    let tree = no_gpu();
    let r = doctor(&inputs(&tree, None), LinkClass::Pxb, None);
    assert_eq!(r.exit_code, 2, "no GPU: nothing to judge");
    assert!(r.checks.iter().any(|c| c.name == "GPUs" && c.status == Status::Fail));
    assert!(r.checks.iter().any(|c| c.name == "RDMA device mlx5_0" && c.status == Status::Ok));
}

#[test]
fn driver_checks_name_the_missing_piece_and_the_fix() {
    let tree = dgx8();
    let mut i = inputs(&tree, None);
    i.proc_modules = "nvidia 56000000 10 - Live 0x0\nnv_peer_mem 16384 0 - Live 0x0\n".into();
    i.kernel_release = "5.4.0-150-generic".into();
    let r = doctor(&i, LinkClass::Pxb, None);
    let get = |name: &str| r.checks.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no {name} check"));
    assert_eq!(get("nvidia-peermem").status, Status::Fail);
    assert!(get("nvidia-peermem").fix.as_deref().unwrap().contains("modprobe nvidia-peermem"));
    assert_eq!(get("nv_peer_mem (legacy)").status, Status::Warn);
    let dmabuf = get("dma-buf");
    assert_eq!(dmabuf.status, Status::Fail);
    assert!(dmabuf.detail.contains("older than 5.12") && dmabuf.detail.contains("proprietary"), "{}", dmabuf.detail);
    assert!(dmabuf.fix.as_deref().unwrap().contains("open kernel module"));
    assert!(r.verdicts.iter().all(|v| !v.usable && v.reasons.iter().any(|x| x.contains("neither nvidia_peermem"))));

    // The open kernel module on a new kernel makes dma-buf possible without peermem.
    i.nvidia_version = Some("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15\n".into());
    i.kernel_release = "6.8.0".into();
    i.proc_modules = "nvidia 56000000 10 - Live 0x0\n".into();
    let r = doctor(&i, LinkClass::Pxb, None);
    assert_eq!(r.checks.iter().find(|c| c.name == "dma-buf").unwrap().status, Status::Ok);
    assert_eq!(r.exit_code, 0);
}

#[test]
fn bar1_iommu_acs_and_slow_links_are_warned_about() {
    let tree = workstation();
    let gpu_dir = fs::canonicalize(tree.root.join("bus/pci/devices/0000:01:00.0")).unwrap();
    fs::create_dir_all(gpu_dir.join("iommu_group")).unwrap();
    fs::write(gpu_dir.join("iommu_group/type"), "DMA-FQ\n").unwrap();
    let nic_dir = fs::canonicalize(tree.root.join("bus/pci/devices/0000:02:00.0")).unwrap();
    fs::write(nic_dir.join("current_link_width"), "8\n").unwrap();
    let mut i = inputs(&tree, None);
    i.register_bytes = Some(256 << 30); // more than the 128 GiB BAR1
    i.lspci =
        Some("00:1c.0 PCI bridge: Intel\n\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+\n".into());
    let r = doctor(&i, LinkClass::Phb, None);
    let status = |prefix: &str| r.checks.iter().find(|c| c.name.starts_with(prefix)).map(|c| c.status);
    assert_eq!(status("GPU0 IOMMU"), Some(Status::Warn));
    assert_eq!(status("GPU0 BAR1"), Some(Status::Warn));
    assert_eq!(status("mlx5_0 PCIe link"), Some(Status::Warn));
    assert_eq!(status("ACS GPU0 - mlx5_0"), Some(Status::Warn));
    i.register_bytes = Some(1 << 30);
    i.lspci = None;
    let r = doctor(&i, LinkClass::Phb, None);
    assert_eq!(r.checks.iter().find(|c| c.name == "GPU0 BAR1").unwrap().status, Status::Ok);
    assert_eq!(r.checks.iter().find(|c| c.name == "ACS").unwrap().status, Status::Unknown);
}

fn topo_json(file: &str) -> serde_json::Value {
    let empty = std::env::temp_dir().join(format!("gpu-rdma-empty-{}", std::process::id()));
    fs::create_dir_all(&empty).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-rdma"))
        .args(["topo", "--json", "--nvidia-smi-topo"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/topo").join(file))
        .arg("--sysfs-root")
        .arg(&empty)
        .arg("--proc-root")
        .arg(&empty)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn topo_json_gives_links_and_best_nic_for_every_recorded_layout() {
    let v = topo_json("dgx8-nvlink.txt");
    assert_eq!(v["gpus"].as_array().unwrap().len(), 8);
    assert_eq!(v["nics"][3], "mlx5_3");
    assert_eq!(v["links"].as_array().unwrap().len(), 64);
    assert!(
        v["links"].as_array().unwrap().contains(&serde_json::json!({"gpu": "GPU0", "nic": "mlx5_0", "link": "PIX"}))
    );
    assert!(
        v["links"].as_array().unwrap().contains(&serde_json::json!({"gpu": "GPU4", "nic": "mlx5_0", "link": "SYS"}))
    );
    for i in 0..8 {
        assert_eq!(v["best_nic"][format!("GPU{i}")], format!("mlx5_{i}"));
    }
    assert_eq!(topo_json("dgx8-mp.txt")["best_nic"], v["best_nic"]);

    let v = topo_json("nics-other-socket-old.txt");
    assert_eq!(v["nics"], serde_json::json!(["mlx5_0", "mlx5_1"]));
    assert_eq!(v["best_nic"], serde_json::json!({"GPU0": "mlx5_0", "GPU1": "mlx5_1"}));
    assert!(v["links"].as_array().unwrap().iter().all(|l| l["link"] == "SYS"));

    let v = topo_json("workstation-phb.txt");
    assert_eq!(v["links"], serde_json::json!([{"gpu": "GPU0", "nic": "mlx5_0", "link": "PHB"}]));
    assert_eq!(v["best_nic"], serde_json::json!({"GPU0": "mlx5_0"}));

    let v = topo_json("no-nic.txt");
    assert_eq!(v["nics"], serde_json::json!([]));
    assert_eq!(v["best_nic"], serde_json::json!({}));
}

#[test]
fn doctor_on_this_machine_says_what_it_finds_and_never_panics() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-rdma")).args(["doctor", "--json"]).output().unwrap();
    let code = out.status.code().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the JSON parses");
    assert_eq!(v["exit_code"], code);
    let has_gpu = !v["gpus"].as_array().unwrap().is_empty();
    if has_gpu {
        assert!(code == 0 || code == 1);
    } else {
        assert_eq!(code, 2, "no GPU: could not tell");
        let text = String::from_utf8_lossy(
            &Command::new(env!("CARGO_BIN_EXE_gpu-rdma")).arg("doctor").output().unwrap().stdout,
        )
        .into_owned();
        assert!(text.contains("no NVIDIA GPU found"), "{text}");
        assert!(text.contains("could not tell"), "{text}");
    }
}

#[test]
fn an_older_nvidia_smi_saying_soc_gets_the_sys_verdict() {
    let tree = nics_other_socket();
    let soc = doctor(&inputs(&tree, Some("nics-other-socket-soc.txt")), LinkClass::Pxb, None);
    let sys = doctor(&inputs(&tree, Some("nics-other-socket-old.txt")), LinkClass::Pxb, None);
    assert!(!soc.verdicts.is_empty());
    for (a, b) in soc.verdicts.iter().zip(&sys.verdicts) {
        assert_eq!(a.link, Some(LinkClass::Sys), "{a:?}");
        assert_eq!((a.link, a.usable, &a.best_nic), (b.link, b.usable, &b.best_nic), "SOC and SYS alike");
        assert!(!a.usable, "a path across CPU sockets is beyond the GDR level: {a:?}");
    }
    assert_eq!(soc.exit_code, sys.exit_code);
}

#[test]
fn a_missing_libibverbs_is_a_failed_check_that_says_what_to_install() {
    let mut i = inputs(&workstation(), None);
    let why = "rdma-core's libibverbs.so.1 could not be loaded (libibverbs.so.1: cannot open shared object file)";
    i.libibverbs = Some(Err(why.into()));
    let r = doctor(&i, LinkClass::Pxb, None);
    let c = r.checks.iter().find(|c| c.name == "libibverbs").expect("a libibverbs check");
    assert_eq!(c.status, Status::Fail);
    assert!(c.detail.contains("could not be loaded"), "{}", c.detail);
    assert!(c.fix.as_deref().is_some_and(|f| f.contains("libibverbs1") && f.contains("TCP")), "{:?}", c.fix);
    i.libibverbs = Some(Ok(()));
    let r = doctor(&i, LinkClass::Pxb, None);
    assert!(r.checks.iter().any(|c| c.name == "libibverbs" && c.status == Status::Ok));
    i.libibverbs = None;
    assert!(!doctor(&i, LinkClass::Pxb, None).checks.iter().any(|c| c.name == "libibverbs"), "not asked, not shown");
}
