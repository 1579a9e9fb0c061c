//! Tests that need no RDMA device: what a machine without one sees.
//!
//! On a machine with RDMA devices, the same tests check the other branch:
//! that the device opens.

use std::process::Command;

use gpu_rdma::{Domain, DomainConfig, Error, TransportPolicy};

fn has_rdma_devices() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

#[test]
fn without_a_device_a_domain_falls_back_to_tcp_and_says_why() {
    let d = Domain::open().expect("a domain opens on any machine");
    let info = d.info();
    if has_rdma_devices() {
        return;
    }
    assert_eq!(info.transport, "tcp");
    let reason = info.fallback.clone().expect("the fallback says why");
    assert!(
        reason.contains("no RDMA support") || reason.contains("no RDMA devices") || reason.contains("verbs"),
        "the reason should say what is missing: {reason}"
    );
    assert!(info.to_string().starts_with("tcp ("), "{info}");
}

#[test]
fn asking_for_verbs_without_a_device_is_a_typed_error_with_the_reason() {
    match Domain::with_config(&DomainConfig::default().transport(TransportPolicy::Verbs)) {
        Ok(d) => assert!(has_rdma_devices(), "opened {d:?} with no device in sysfs"),
        Err(Error::NoDevice { reason }) => {
            assert!(!has_rdma_devices(), "a device exists but: {reason}");
            assert!(
                reason.contains("no RDMA support") || reason.contains("no RDMA devices"),
                "the reason should say what is missing: {reason}"
            );
            assert!(reason.contains("rdma_rxe") || reason.contains("mlx5"), "and what to do: {reason}");
        }
        Err(Error::FeatureDisabled { .. }) => {}
        Err(other) => panic!("expected NoDevice, got {other:?}"),
    }
}

#[test]
fn asking_for_a_device_by_name_never_panics() {
    // A device named that does not exist is an error, not a fallback.
    let err = Domain::with_config(&DomainConfig::default().device("mlx5_99")).unwrap_err();
    assert!(matches!(err, Error::NoDevice { .. } | Error::DeviceNotFound { .. }), "{err:?}");
}

#[test]
fn bad_environment_values_are_typed_errors() {
    // A child process, so the variable does not leak into parallel tests.
    if std::env::var_os("GPU_RDMA_ENV_CHILD").is_some() {
        let err = DomainConfig::from_env().unwrap_err();
        assert!(matches!(err, Error::BadEnv { var: "GPU_RDMA_GID_INDEX", .. }), "{err}");
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "bad_environment_values_are_typed_errors"])
        .env("GPU_RDMA_ENV_CHILD", "1")
        .env("GPU_RDMA_GID_INDEX", "three")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("1 passed"), "{text}");
}

#[test]
fn the_devices_command_says_plainly_when_there_is_no_device() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-rdma")).arg("devices").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("rdma-core"), "{text}");
    if has_rdma_devices() {
        assert!(out.status.success(), "{text}");
        assert!(text.contains("hca_id:"), "{text}");
    } else {
        assert_eq!(out.status.code(), Some(1), "{text}");
        assert!(text.contains("no RDMA devices"), "{text}");
    }
}

#[cfg(feature = "cuda")]
#[test]
fn without_a_cuda_driver_every_cuda_entry_point_says_so() {
    use gpu_rdma::cuda::{CudaDevice, driver};
    match driver() {
        // A machine with a driver (a GPU machine, or the stand-in on LD_LIBRARY_PATH).
        Ok(info) => assert!(info.device_count > 0),
        Err(Error::CudaUnavailable { reason }) => {
            assert!(reason.contains("libcuda") || reason.contains("no CUDA device"), "{reason}");
            assert!(matches!(CudaDevice::count(), Err(Error::CudaUnavailable { .. })));
            assert!(matches!(CudaDevice::open(0), Err(Error::CudaUnavailable { .. })));
        }
        Err(other) => panic!("expected CudaUnavailable, got {other:?}"),
    }
}
