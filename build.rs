//! Build script: finds what the installed rdma-core offers when the `verbs`
//! feature is on, and stops with one clear line when its headers are missing.
//!
//! It sets:
//! - `cfg(gpu_rdma_dmabuf_mr)` when `<infiniband/verbs.h>` declares
//!   `ibv_reg_dmabuf_mr` (rdma-core 34 and later), so that the dma-buf
//!   registration path is compiled only where rdma-sys can bind it;
//! - `GPU_RDMA_RDMA_CORE_VERSION`, the libibverbs version pkg-config reports
//!   (or `unknown`), shown by `gpu-rdma devices`.

use std::env;
use std::fs;
use std::path::PathBuf;

const INSTALL_HINT: &str = "sudo apt-get install libibverbs-dev librdmacm-dev libclang-dev pkg-config";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(gpu_rdma_dmabuf_mr)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=PKG_CONFIG_PATH");

    if env::var_os("CARGO_FEATURE_VERBS").is_none() {
        println!("cargo::rustc-env=GPU_RDMA_RDMA_CORE_VERSION=none (built without the verbs feature)");
        return;
    }

    let probe = pkg_config::Config::new().cargo_metadata(false).env_metadata(false).probe("libibverbs");
    let (version, mut include_dirs) = match probe {
        Ok(lib) => (lib.version, lib.include_paths),
        Err(_) => ("unknown".to_owned(), Vec::new()),
    };
    include_dirs.push(PathBuf::from("/usr/include"));

    let Some(header) = include_dirs.iter().map(|dir| dir.join("infiniband/verbs.h")).find(|path| path.is_file()) else {
        eprintln!(
            "error: gpu-rdma needs the rdma-core headers (infiniband/verbs.h) for its `verbs` feature: \
             install them with `{INSTALL_HINT}`, or build with `--no-default-features`"
        );
        std::process::exit(1);
    };
    println!("cargo::rerun-if-changed={}", header.display());

    let text = fs::read_to_string(&header).unwrap_or_default();
    if text.contains("ibv_reg_dmabuf_mr") {
        println!("cargo::rustc-cfg=gpu_rdma_dmabuf_mr");
    } else {
        println!(
            "cargo::warning=rdma-core {version} has no ibv_reg_dmabuf_mr: the dma-buf GPU memory path is compiled out"
        );
    }
    println!("cargo::rustc-env=GPU_RDMA_RDMA_CORE_VERSION={version}");
}
