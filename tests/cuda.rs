//! The CUDA layer: driver probe, RDMA-able buffers, copies, dma-buf export,
//! streams. Needs a CUDA driver: on CI the test-only stand-in
//! (`cuda-stub/`, exposed as `libcuda.so` on `LD_LIBRARY_PATH` by
//! `cargo xtask test`), on a GPU machine the real one (`cargo xtask
//! gpu-check`). `#[ignore]`d otherwise, with the reason.

#![cfg(feature = "cuda")]

mod common;

use std::os::fd::AsRawFd;

use common::gpu::{VmmBlock, is_stub, produce, produced};

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

/// The dma-buf tests read the stand-in's record of the last export: one at a time.
static EXPORTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

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
            Err(Error::NoCudaDevice { ordinal, count }) => assert_eq!((ordinal, count), (info.device_count, info.device_count)),
            other => panic!("{other:?}"),
        }
    }
}

cuda_test! {
    fn buffers_are_rounded_to_gpu_pages_and_sync_memops_is_set() {
        let d = device();
        let b = CudaBuffer::alloc(&d, 1000).unwrap();
        assert_eq!(b.len(), GPU_PAGE);
        // cuMemAlloc promises 256-byte alignment, and nothing more.
        assert_eq!(b.device_ptr() % 256, 0, "aligned to 256 bytes");
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
        let _one = EXPORTS.lock().unwrap_or_else(|e| e.into_inner());
        let d = device();
        let b = CudaBuffer::alloc(&d, 2 * GPU_PAGE).unwrap();
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
        match b.export_dmabuf(0, b.len()) {
            Ok(dmabuf) => {
                assert!(d.attrs().dma_buf_supported);
                // SAFETY: fstat into a zeroed struct on a descriptor we own.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: as above.
                assert_eq!(unsafe { libc::fstat(dmabuf.fd.as_raw_fd(), &mut st) }, 0, "a valid fd");
                assert_eq!(dmabuf.offset, b.device_ptr() % page, "the buffer starts where its pointer is");
                assert_eq!(dmabuf.len as u64 % page, 0, "whole pages");
                assert!(dmabuf.len as u64 >= dmabuf.offset + b.len() as u64);
                // Any range works, however it is aligned: a sub-allocation at 512, 100 bytes in.
                for (off, len) in [(512usize, 1000usize), (100, 4096), (4095, 2), (b.len() - 1, 1)] {
                    let x = b.export_dmabuf(off, len).unwrap_or_else(|e| panic!("export {off}+{len}: {e}"));
                    let start = b.device_ptr() + off as u64;
                    assert_eq!(x.offset, start % page, "{off}+{len}");
                    assert_eq!(x.len as u64, (start + len as u64).div_ceil(page) * page - start / page * page);
                }
            }
            Err(e) => {
                assert!(e.is_not_supported(), "{e}");
                assert!(!d.attrs().dma_buf_supported, "the device says it supports dma-buf: {e}");
            }
        }
        assert!(matches!(b.export_dmabuf(0, 3 * GPU_PAGE), Err(Error::OutOfBounds { .. })));
        assert!(matches!(b.export_dmabuf(0, 0), Err(Error::InvalidArgument(_))));
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
        let b = CudaBuffer::alloc(&d, GPU_PAGE).unwrap();
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

cuda_test! {
    /// The class of bug the stand-in exists to catch: the CPU reading or
    /// writing GPU memory through its device address (an inline post, a
    /// slice over device memory) faults, as on a GPU. Checked in a child
    /// process, which must die of SIGSEGV.
    fn the_cpu_faults_on_a_device_pointer() {
        if !is_stub() {
            println!("skipped here: a real driver's device memory is not mapped for the CPU at all");
            return;
        }
        let d = device();
        let b = CudaBuffer::alloc(&d, 4096).unwrap();
        b.copy_from_host(0, b"on the device").unwrap();
        for write in [false, true] {
            let p = b.device_ptr() as *mut u8;
            // SAFETY: the child only touches the device pointer and exits; it
            // calls nothing that is not async-signal-safe after fork.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: deliberately touches the device address: it must fault.
                unsafe {
                    if write {
                        std::ptr::write_volatile(p, 1);
                    } else {
                        let _ = std::ptr::read_volatile(p);
                    }
                    libc::_exit(0)
                }
            }
            let mut status = 0;
            // SAFETY: waits for our own child.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            assert!(
                libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSEGV,
                "a CPU {} through a device pointer did not fault (status {status:#x})",
                if write { "store" } else { "load" }
            );
        }
        let mut back = [0u8; 13];
        b.copy_to_host(0, &mut back).unwrap();
        assert_eq!(&back, b"on the device", "the driver's own copies reach the memory");
    }
}

cuda_test! {
    /// Nothing may assume more than cuMemAlloc's 256-byte alignment: the
    /// stand-in varies the offset, and registration, copies and dma-buf
    /// export work wherever a buffer starts.
    fn allocations_promise_256_byte_alignment_and_no_more() {
        let d = device();
        let bufs: Vec<CudaBuffer> = (0..16).map(|_| CudaBuffer::alloc(&d, 10_000).unwrap()).collect();
        assert!(bufs.iter().all(|b| b.device_ptr() % 256 == 0));
        if is_stub() {
            let unaligned = bufs.iter().filter(|b| b.device_ptr() % 4096 != 0).count();
            assert!(unaligned >= 8, "the stand-in varies offsets: {unaligned} of 16 not page-aligned");
        }
        for (i, b) in bufs.iter().enumerate() {
            let data = pattern(b.len(), i as u8);
            b.copy_from_host(0, &data).unwrap();
            let mut back = vec![0u8; b.len()];
            b.copy_to_host(0, &mut back).unwrap();
            assert!(back == data, "buffer {i} at {:#x}", b.device_ptr());
        }
    }
}

cuda_test! {
    /// VMM memory handed over by a framework (cuMemCreate + cuMemMap):
    /// wrapping it works although the driver refuses SYNC_MEMOPS on it (the
    /// context flag stands in), copies reach it, and the driver's
    /// IS_GPU_DIRECT_RDMA_CAPABLE answer is kept.
    fn vmm_memory_from_a_framework_is_usable() {
        let d = device();
        for gdr in [true, false] {
            let block = std::sync::Arc::new(VmmBlock::new(&d, 3 << 20, gdr));
            let keep = std::sync::Arc::clone(&block);
            // SAFETY: the block stays mapped while `keep` lives inside the wrapper.
            let buf = unsafe { CudaBuffer::from_raw(&d, block.ptr + 512, block.len - 512, Box::new(keep)) }
                .unwrap_or_else(|e| panic!("wrapping VMM memory (gdr {gdr}): {e}"));
            assert_eq!(buf.gdr_capable(), gdr);
            if is_stub() {
                assert!(!buf.sync_memops().unwrap(), "the driver refuses SYNC_MEMOPS on VMM memory");
                assert_eq!(buf.sync_memops_by(), gpu_rdma::cuda::SyncMemops::Context);
            }
            let data = pattern(100_000, 9);
            buf.copy_from_host(4096, &data).unwrap();
            let mut back = vec![0u8; data.len()];
            buf.copy_to_host(4096, &mut back).unwrap();
            assert!(back == data);
        }
    }
}

cuda_test! {
    /// A framework set its own context flags (a blocking-sync scheduling
    /// policy); memory that refuses the SYNC_MEMOPS pointer attribute makes
    /// the crate set the context-wide flag, which cuCtxSetFlags does by
    /// replacing the flags: the framework's must survive.
    fn the_context_wide_sync_memops_keeps_the_frameworks_flags() {
        let d = device();
        const BLOCKING_SYNC: u32 = 0x04;
        const SYNC_MEMOPS: u32 = 0x80;
        let flags = || {
            let _ctx = common::gpu::Ctx::enter(&d);
            let mut f = 0u32;
            // SAFETY: a current context and a valid out-pointer.
            let rc = unsafe { gpu_rdma::cuda::sys::cuCtxGetFlags(&mut f) };
            assert_eq!(rc, gpu_rdma::cuda::sys::CUresult::CUDA_SUCCESS);
            f
        };
        {
            let _ctx = common::gpu::Ctx::enter(&d);
            // SAFETY: a current context; the flags take no pointers.
            let rc = unsafe { gpu_rdma::cuda::sys::cuCtxSetFlags(flags() & !SYNC_MEMOPS | BLOCKING_SYNC) };
            assert_eq!(rc, gpu_rdma::cuda::sys::CUresult::CUDA_SUCCESS, "the framework sets its flags");
        }
        let block = std::sync::Arc::new(VmmBlock::new(&d, 2 << 20, true));
        let keep = std::sync::Arc::clone(&block);
        // SAFETY: the block stays mapped while `keep` lives inside the wrapper.
        let buf = unsafe { CudaBuffer::from_raw(&d, block.ptr, block.len, Box::new(keep)) }.unwrap();
        if buf.sync_memops_by() == gpu_rdma::cuda::SyncMemops::Context {
            let now = flags();
            println!("context flags {now:#x}");
            assert_eq!(now & SYNC_MEMOPS, SYNC_MEMOPS, "SYNC_MEMOPS set context-wide");
            assert_eq!(now & BLOCKING_SYNC, BLOCKING_SYNC, "the framework's flags were dropped: {now:#x}");
        } else {
            println!("SYNC_MEMOPS by {:?}: the context's flags were not touched", buf.sync_memops_by());
        }
    }
}

cuda_test! {
    /// An event recorded again stands for its latest record only: the
    /// earlier record completing, on another stream, does not complete it
    /// (as the staging's reused events rely on, and a stand-in that let the
    /// earlier record answer would make them race).
    fn an_event_recorded_again_stands_for_its_latest_record() {
        let d = device();
        let (fast, slow) = (CudaStream::new(&d).unwrap(), CudaStream::new(&d).unwrap());
        let b = CudaBuffer::alloc(&d, 8192).unwrap();
        produce(&fast, &b, 0, 4096, 1, 20_000);
        let ev = CudaEvent::record(&fast).unwrap();
        produce(&slow, &b, 4096, 4096, 2, 500_000);
        ev.record_again(&slow).unwrap();
        fast.synchronize().unwrap();
        assert!(!ev.is_done().unwrap(), "done when only its first record is");
        ev.synchronize().unwrap();
        assert!(ev.is_done().unwrap());
        let mut back = vec![0u8; 4096];
        b.copy_to_host(4096, &mut back).unwrap();
        assert!(back == produced(2, 4096), "synchronized with its latest record, the slow producer's bytes are there");
    }
}

cuda_test! {
    /// A producer on a stream, fenced with ready_after through a shared
    /// reference (as a registered region hands it out), is waited for; a
    /// fence recorded later replaces the earlier one.
    fn the_fence_is_per_operation_and_replaceable() {
        let d = device();
        let s = CudaStream::new(&d).unwrap();
        let b = CudaBuffer::alloc(&d, 8192).unwrap();
        let shared: &CudaBuffer = &b;
        for seed in 1..=3u64 {
            produce(&s, shared, 0, 8192, seed, 20_000);
            shared.ready_after(&s).unwrap();
            // The synchronous copy is not ordered after the non-blocking stream;
            // the fence is: wait for it as an operation would.
            let ev = gpu_rdma::cuda::CudaEvent::record(&s).unwrap();
            ev.synchronize().unwrap();
            let mut back = vec![0u8; 8192];
            shared.copy_to_host(0, &mut back).unwrap();
            assert!(back == produced(seed, 8192), "iteration {seed}");
        }
    }
}

cuda_test! {
    /// dma-buf exports ask for the PCIe mapping type on CUDA 12.8+ drivers
    /// (so a Grace Hopper NIC goes through PCIe, as NCCL makes it), and fall
    /// back to the plain export where the platform refuses the flag.
    fn dma_buf_export_asks_for_the_pcie_mapping_and_falls_back() {
        if !is_stub() {
            println!("not counted here: needs the stand-in's record of the export flags");
            return;
        }
        let _one = EXPORTS.lock().unwrap_or_else(|e| e.into_inner());
        let last_flags = || {
            let sym = common::gpu::stub_symbol(c"gpu_rdma_stub_last_export_flags").unwrap();
            // SAFETY: the stand-in exports this function with this signature.
            let f: unsafe extern "C" fn() -> u32 = unsafe { std::mem::transmute(sym) };
            // SAFETY: no arguments.
            unsafe { f() }
        };
        let d = device();
        let b = CudaBuffer::alloc(&d, 8192).unwrap();
        assert!(driver().unwrap().version >= 12080);
        b.export_dmabuf(0, 8192).unwrap();
        assert_eq!(last_flags(), 1, "CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE");
        common::gpu::set_attribute(0x7fff_0001, 1); // the platform refuses it
        let x = b.export_dmabuf(512, 1000).unwrap();
        assert_eq!(last_flags(), 0, "the plain export after the refusal");
        assert_eq!(x.offset, (b.device_ptr() + 512) % 4096);
        common::gpu::reset_attributes();
    }
}

cuda_test! {
    /// The allocation a buffer lies in, as a registration cache keys it:
    /// sub-ranges of one block (as a framework's caching allocator hands
    /// them out) name the same allocation; a block freed and allocated
    /// again, at the same address or not, is another allocation (a new
    /// `BUFFER_ID`), so nothing keyed on the old one is ever its.
    fn sub_ranges_name_their_allocation_and_a_new_allocation_is_never_the_old_one() {
        let d = device();
        let block = std::sync::Arc::new(CudaBuffer::alloc(&d, 4 << 20).unwrap());
        let whole = block.allocation().unwrap();
        assert_eq!(whole.base, block.device_ptr());
        assert!(whole.len >= 4 << 20);
        for (off, len) in [(0u64, 4096usize), (1 << 20, 65536), ((4 << 20) - 512, 512)] {
            let keep = std::sync::Arc::clone(&block);
            // SAFETY: inside the block, which `keep` keeps allocated while the wrapper lives.
            let sub = unsafe { CudaBuffer::from_raw(&d, block.device_ptr() + off, len, Box::new(keep)) }.unwrap();
            assert_eq!(sub.allocation().unwrap(), whole, "the sub-range at {off}");
        }
        let mut seen = std::collections::HashSet::from([whole.id]);
        let mut same_address = 0;
        drop(block);
        for _ in 0..16 {
            let again = CudaBuffer::alloc(&d, 4 << 20).unwrap();
            let a = again.allocation().unwrap();
            same_address += usize::from(a.base == whole.base);
            assert!(seen.insert(a.id), "an allocation's identity was given again");
        }
        println!("16 allocations after a free, {same_address} at the freed block's address: each a new identity");
    }
}
