//! The CUDA layer: driver probe, RDMA-able buffers, copies, dma-buf export,
//! streams. Needs a CUDA driver: on CI the test-only stand-in
//! (`cuda-stub/`, exposed as `libcuda.so` on `LD_LIBRARY_PATH` by
//! `cargo xtask test`), on a GPU machine the real one (`cargo xtask
//! gpu-check`). `#[ignore]`d otherwise, with the reason.

#![cfg(feature = "cuda")]

use std::os::fd::AsRawFd;

use gpu_rdma::cuda::{CudaBuffer, CudaDevice, CudaEvent, CudaStream, GPU_PAGE, PinnedHost, driver};
use gpu_rdma::{Error, Memory, MemoryKind};

macro_rules! cuda_test {
    ($(#[$m:meta])* fn $name:ident() $body:block) => {
        $(#[$m])*
        #[test]
        #[ignore = "cuda: needs a CUDA driver (the stand-in via cargo xtask test, or a GPU via cargo xtask gpu-check)"]
        fn $name() $body
    };
}

fn device() -> CudaDevice {
    CudaDevice::open(0).expect("CUDA device 0 (is the stand-in on LD_LIBRARY_PATH?)")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 9) as u8)).collect()
}

cuda_test! {
    fn the_driver_is_probed_without_panicking() {
        let info = driver().unwrap();
        assert!(info.device_count >= 1, "{info:?}");
        assert!(info.version >= 11000, "{info:?}");
        let d = device();
        assert!(!d.name().is_empty());
        assert!(d.pci_bus_id().contains(':'), "{}", d.pci_bus_id());
        assert!(d.total_mem() > 0);
        match CudaDevice::open(info.device_count) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("does not exist"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}

cuda_test! {
    fn buffers_are_rounded_to_gpu_pages_and_sync_memops_is_set() {
        let d = device();
        let b = CudaBuffer::alloc(&d, 1000).unwrap();
        assert_eq!(b.len(), GPU_PAGE);
        assert_eq!(b.device_ptr() % GPU_PAGE as u64, 0, "aligned to a GPU page");
        assert!(b.sync_memops().unwrap(), "CU_POINTER_ATTRIBUTE_SYNC_MEMOPS");
        assert_eq!(b.kind(), MemoryKind::Cuda { ordinal: 0 });
        assert_eq!(CudaBuffer::alloc(&d, 3 * GPU_PAGE + 1).unwrap().len(), 4 * GPU_PAGE);
        assert!(matches!(CudaBuffer::alloc(&d, 0), Err(Error::InvalidArgument(_))));
    }
}

cuda_test! {
    fn copies_round_trip_and_are_bounds_checked() {
        let d = device();
        let b = CudaBuffer::alloc(&d, 256 * 1024).unwrap();
        let data = pattern(200_000, 3);
        b.copy_from_host(4096, &data).unwrap();
        let mut back = vec![0u8; data.len()];
        b.copy_to_host(4096, &mut back).unwrap();
        assert_eq!(back, data);
        b.fill(0xab).unwrap();
        let mut one = [0u8; 16];
        b.copy_to_host(b.len() - 16, &mut one).unwrap();
        assert_eq!(one, [0xab; 16]);
        assert!(matches!(b.copy_from_host(b.len() - 8, &[0; 16]), Err(Error::OutOfBounds { side: "local", .. })));
        assert!(matches!(b.copy_to_host(usize::MAX - 4, &mut one), Err(Error::OutOfBounds { .. })));
    }
}

cuda_test! {
    fn dma_buf_export_gives_a_valid_descriptor_or_says_not_supported() {
        let d = device();
        let b = CudaBuffer::alloc(&d, 2 * GPU_PAGE).unwrap();
        match b.export_dmabuf(0, b.len()) {
            Ok(fd) => {
                assert!(d.attrs().dma_buf_supported);
                // SAFETY: fstat into a zeroed struct on a descriptor we own.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: as above.
                assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0, "a valid fd");
                assert!(st.st_size as usize >= b.len() || st.st_size == 0, "size {}", st.st_size);
            }
            Err(e) => {
                assert!(e.is_not_supported(), "{e}");
                assert!(!d.attrs().dma_buf_supported, "the device says it supports dma-buf: {e}");
            }
        }
        assert!(matches!(b.export_dmabuf(100, 4096), Err(Error::InvalidArgument(_))), "misaligned");
        assert!(matches!(b.export_dmabuf(0, 3 * GPU_PAGE), Err(Error::OutOfBounds { .. })));
    }
}

cuda_test! {
    fn streams_order_work_and_events_report_it() {
        let d = device();
        let s = CudaStream::new(&d).unwrap();
        let ev = CudaEvent::record(&s).unwrap();
        ev.synchronize().unwrap();
        assert!(ev.is_done().unwrap());
        s.synchronize().unwrap();
        let mut b = CudaBuffer::alloc(&d, GPU_PAGE).unwrap();
        b.ready_after(&s).unwrap();
        let pinned = PinnedHost::new(&d, 3 * 4096).unwrap();
        assert_eq!(pinned.len(), 3 * 4096);
        assert!(pinned.as_slice().iter().all(|&x| x == 0));
    }
}

cuda_test! {
    fn foreign_memory_is_kept_alive_by_the_wrapper() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        struct Owner(#[allow(dead_code)] CudaBuffer, Arc<AtomicBool>);
        impl Drop for Owner {
            fn drop(&mut self) {
                self.1.store(true, Ordering::SeqCst);
            }
        }
        let d = device();
        let inner = CudaBuffer::alloc(&d, GPU_PAGE).unwrap();
        let (ptr, len) = (inner.device_ptr(), inner.len());
        let dropped = Arc::new(AtomicBool::new(false));
        let owner = Owner(inner, Arc::clone(&dropped));
        // SAFETY: `owner` holds the allocation, and moves into the wrapper that uses it.
        let foreign = unsafe { CudaBuffer::from_raw(&d, ptr, len, Box::new(owner)) }.unwrap();
        foreign.copy_from_host(0, b"tensor").unwrap();
        assert!(foreign.sync_memops().unwrap());
        assert!(!dropped.load(Ordering::SeqCst));
        drop(foreign);
        assert!(dropped.load(Ordering::SeqCst), "the owner goes with the wrapper");
        // SAFETY: a null pointer is refused before anything uses it.
        let err = unsafe { CudaBuffer::from_raw(&d, 0, 16, Box::new(())) }.unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
    }
}
