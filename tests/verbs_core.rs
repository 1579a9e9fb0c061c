//! The low-level verbs layer on a real device (soft-RoCE in CI):
//! devices, ports, GIDs, completion queues, queue-pair transitions and
//! their diagnosis, posting singly and in batches.
//!
//! Every test here needs an RDMA device and is `#[ignore]`d without one:
//! `GPU_RDMA_TEST_DEVICE=rxe0 cargo test --test verbs_core -- --ignored`,
//! or `cargo xtask test`, which runs them in the soft-RoCE VM.

mod common;

use std::time::{Duration, Instant};

use gpu_rdma::verbs::{
    self, CompletionChannel, CompletionQueue, Context, DeviceList, LinkLayer, MemoryRegion, Mtu, PortAttr,
    ProtectionDomain, QpCaps, QpState, QueuePair, QueuePairBuilder, RecvWr, RtrAttr, RtsAttr, SendOp, SendWr, Sge,
    WaitOutcome, WcOpcode, WorkCompletion,
};
use gpu_rdma::{Access, Error, HostMemory, Memory, WcStatus};

use common::{device, pattern};

macro_rules! verbs_test {
    ($(#[$m:meta])* fn $name:ident() $body:block) => {
        $(#[$m])*
        #[test]
        #[ignore = "verbs: needs an RDMA device: GPU_RDMA_TEST_DEVICE=<dev> and --ignored (cargo xtask test runs it on soft-RoCE)"]
        fn $name() $body
    };
}

fn open() -> (Context, PortAttr) {
    verbs::open_device(Some(&device()), None).expect("open the test device")
}

/// Two queue pairs of one device, connected to each other by hand.
struct Loop {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    a: QueuePair,
    b: QueuePair,
}

fn rtr_to(port: &PortAttr, gid_index: u8, peer: &QueuePair, psn: u32) -> RtrAttr {
    RtrAttr {
        port: port.port,
        path_mtu: port.active_mtu,
        dest_qp_num: peer.qp_num(),
        rq_psn: psn,
        max_dest_rd_atomic: 4,
        min_rnr_timer: 12,
        dest_lid: port.lid,
        dest_gid: verbs::Gid::default(),
        is_global: port.link_layer != LinkLayer::InfiniBand,
        sgid_index: gid_index,
        hop_limit: 64,
        traffic_class: 0,
        service_level: 0,
    }
}

fn rts(psn: u32) -> RtsAttr {
    RtsAttr { sq_psn: psn, timeout: 14, retry_cnt: 7, rnr_retry: 7, max_rd_atomic: 4 }
}

fn connected_loop() -> Loop {
    let (ctx, port) = open();
    let table = ctx.gid_table(port.port).unwrap();
    let gid = verbs::choose_gid(&table, port.link_layer, None).expect("a usable GID").entry;
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 64, None).unwrap();
    let mut a = QueuePairBuilder::new(&pd, &cq, &cq).build().unwrap();
    let mut b = QueuePairBuilder::new(&pd, &cq, &cq).build().unwrap();
    let remote = Access::REMOTE_READ | Access::REMOTE_WRITE;
    a.init(port.port, remote).unwrap();
    b.init(port.port, remote).unwrap();
    assert_eq!(a.state(), QpState::Init);
    let mut ra = rtr_to(&port, gid.index as u8, &b, 200);
    ra.dest_gid = gid.gid;
    let mut rb = rtr_to(&port, gid.index as u8, &a, 100);
    rb.dest_gid = gid.gid;
    a.ready_to_receive(&ra).unwrap();
    b.ready_to_receive(&rb).unwrap();
    assert_eq!(a.state(), QpState::ReadyToReceive);
    a.ready_to_send(&rts(100)).unwrap();
    b.ready_to_send(&rts(200)).unwrap();
    Loop { pd, cq, a, b }
}

fn poll_n(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::EMPTY; 16];
    let deadline = Instant::now() + Duration::from_secs(30);
    while out.len() < n {
        let got = cq.poll(&mut buf).unwrap();
        out.extend_from_slice(&buf[..got]);
        assert!(Instant::now() < deadline, "only {} of {n} completions after 30 s", out.len());
    }
    out
}

/// Host memory and its registration, registration dropped first.
struct Buf {
    mr: MemoryRegion,
    mem: HostMemory,
}

fn buf(pd: &ProtectionDomain, data: &[u8], access: Access) -> Buf {
    let mem = HostMemory::from_slice(data).unwrap();
    // SAFETY: `mem` lives in the same struct and is dropped after `mr`.
    let mr = unsafe { MemoryRegion::register(pd, mem.as_ptr(), mem.len(), access) }.unwrap();
    Buf { mr, mem }
}

impl Buf {
    fn sge(&self) -> Sge {
        Sge::new(self.mem.as_ptr() as u64, self.mem.len() as u32, self.mr.lkey())
    }
}

verbs_test! {
    fn device_list_finds_the_test_device_and_names_missing_ones() {
        let list = DeviceList::new().unwrap();
        assert!(list.names().contains(&device()), "{:?}", list.names());
        let dev = list.find(&device()).unwrap();
        assert_ne!(dev.guid(), 0);
        match list.find("no-such-hca") {
            Err(Error::DeviceNotFound { name, available }) => {
                assert_eq!(name, "no-such-hca");
                assert!(available.contains(&device()));
            }
            other => panic!("{other:?}"),
        }
    }
}

verbs_test! {
    fn open_by_name_picks_an_active_port_and_refuses_a_missing_one() {
        let (ctx, port) = open();
        assert_eq!(ctx.name(), device());
        assert!(port.is_active(), "{port:?}");
        let (_, first) = verbs::open_device(None, None).unwrap();
        assert!(first.is_active());
        match verbs::open_device(Some(&device()), Some(9)) {
            Err(Error::NoActivePort { detail, .. }) => assert!(detail.contains("port 9"), "{detail}"),
            other => panic!("{other:?}"),
        }
    }
}

verbs_test! {
    fn port_attributes_and_gid_table_are_read() {
        let (ctx, port) = open();
        let attr = ctx.query_device().unwrap();
        assert!(attr.phys_port_cnt >= 1 && attr.max_qp_wr > 0 && attr.max_sge > 0);
        assert!(port.active_mtu <= port.max_mtu);
        assert!(port.max_msg_sz > 0);
        let table = ctx.gid_table(port.port).unwrap();
        assert!(!table.is_empty(), "no GIDs");
        assert!(table.iter().all(|e| !e.gid.is_zero()), "empty entries are skipped");
        let choice = verbs::choose_gid(&table, port.link_layer, None).unwrap();
        if port.link_layer == LinkLayer::Ethernet {
            assert_eq!(choice.entry.gid_type, verbs::GidType::RoceV2, "{choice:?}");
        }
        assert_eq!(ctx.query_gid(port.port, choice.entry.index).unwrap(), choice.entry.gid);
    }
}

verbs_test! {
    fn the_gid_table_holds_exactly_the_valid_entries_of_a_scan_in_index_order() {
        let (ctx, port) = open();
        let table = ctx.gid_table(port.port).unwrap();
        // Every index asked one by one: the table (read in one call where
        // libibverbs can) must hold the same entries.
        let scanned: Vec<(u32, verbs::Gid)> = (0..port.gid_tbl_len)
            .filter_map(|i| ctx.query_gid(port.port, i).ok().filter(|g| !g.is_zero()).map(|g| (i, g)))
            .collect();
        let read: Vec<(u32, verbs::Gid)> = table.iter().map(|e| (e.index, e.gid)).collect();
        assert!(!read.is_empty());
        assert_eq!(read, scanned);
        assert!(read.windows(2).all(|w| w[0].0 < w[1].0), "{read:?}");
        // A port past the device's has no table.
        assert!(ctx.gid_table(port.port.wrapping_add(8)).is_err());
    }
}

verbs_test! {
    fn completion_queue_polls_empty_and_channel_wait_times_out() {
        let (ctx, _) = open();
        let ch = CompletionChannel::new(&ctx).unwrap();
        let cq = CompletionQueue::new(&ctx, 16, Some(&ch)).unwrap();
        assert!(cq.capacity() >= 16);
        let mut buf = [WorkCompletion::EMPTY; 4];
        assert_eq!(cq.poll(&mut buf).unwrap(), 0);
        cq.req_notify(false).unwrap();
        let t0 = Instant::now();
        assert_eq!(cq.wait_event(Duration::from_millis(100), None).unwrap(), WaitOutcome::TimedOut);
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(90) && took < Duration::from_secs(5), "{took:?}");
        let no_channel = CompletionQueue::new(&ctx, 4, None).unwrap();
        assert!(matches!(no_channel.wait_event(Duration::from_millis(1), None), Err(Error::InvalidArgument(_))));
    }
}

verbs_test! {
    fn queue_pairs_go_reset_init_rtr_rts_and_carry_a_send() {
        let mut l = connected_loop();
        assert_eq!(l.a.query_state().unwrap(), QpState::ReadyToSend);
        assert_eq!(l.b.query_state().unwrap(), QpState::ReadyToSend);
        let data = pattern(4096, 1);
        let src = buf(&l.pd, &data, Access::LOCAL);
        let dst = buf(&l.pd, &[0; 4096], Access::LOCAL_WRITE);
        let (ds, ss) = ([dst.sge()], [src.sge()]);
        // SAFETY: `dst` and `src` outlive the completions polled below.
        unsafe {
            l.b.post_recv([RecvWr::new(7, &ds)]).unwrap();
            l.a.post_send([SendWr::new(8, SendOp::Send, &ss)]).unwrap();
        }
        let wcs = poll_n(&l.cq, 2);
        let recv = wcs.iter().find(|w| w.wr_id == 7).unwrap();
        let send = wcs.iter().find(|w| w.wr_id == 8).unwrap();
        assert_eq!((recv.status, recv.opcode, recv.byte_len), (WcStatus::Success, WcOpcode::Recv, 4096));
        assert_eq!((send.status, send.opcode), (WcStatus::Success, WcOpcode::Send));
        assert_eq!(dst.mem.as_slice(), &data[..]);
    }
}

verbs_test! {
    fn a_failed_transition_names_the_wrong_attribute() {
        let (ctx, port) = open();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let cq = CompletionQueue::new(&ctx, 8, None).unwrap();
        let peer = QueuePairBuilder::new(&pd, &cq, &cq).build().unwrap();
        let table = ctx.gid_table(port.port).unwrap();
        let gid = verbs::choose_gid(&table, port.link_layer, None).unwrap().entry;
        let mut good = rtr_to(&port, gid.index as u8, &peer, 1);
        good.dest_gid = gid.gid;
        let attr = ctx.query_device().unwrap();

        let cases: Vec<(&str, RtrAttr)> = vec![
            ("path_mtu", RtrAttr { path_mtu: Mtu::Mtu4096, ..good }),
            ("ah_attr.grh.sgid_index", RtrAttr { sgid_index: 200, ..good }),
            ("dest_qp_num", RtrAttr { dest_qp_num: 0, ..good }),
            ("max_dest_rd_atomic", RtrAttr { max_dest_rd_atomic: (attr.max_qp_rd_atom + 1).min(255) as u8, ..good }),
            ("ah_attr.is_global", RtrAttr { is_global: false, ..good }),
        ];
        let mut named = 0;
        for (attribute, rtr) in cases {
            if attribute == "path_mtu" && port.active_mtu == Mtu::Mtu4096 {
                continue; // cannot exceed the largest MTU
            }
            if attribute == "ah_attr.is_global" && port.link_layer != LinkLayer::Ethernet {
                continue;
            }
            if attribute == "max_dest_rd_atomic" && attr.max_qp_rd_atom >= 255 {
                continue;
            }
            let mut qp = QueuePairBuilder::new(&pd, &cq, &cq).build().unwrap();
            qp.init(port.port, Access::REMOTE_WRITE).unwrap();
            match qp.ready_to_receive(&rtr) {
                Err(Error::ModifyQp { attribute: Some(a), transition, .. }) => {
                    assert_eq!((a, transition), (attribute, "INIT->RTR"));
                    named += 1;
                }
                other => panic!("{attribute}: {other:?}"),
            }
            assert_eq!(qp.state(), QpState::Init, "a refused transition leaves the state");
        }
        assert!(named >= 3, "only {named} attributes checked");
        let mut qp = QueuePairBuilder::new(&pd, &cq, &cq).build().unwrap();
        assert!(matches!(qp.init(0, Access::empty()), Err(Error::ModifyQp { attribute: Some("port_num"), .. })));
        qp.init(port.port, Access::empty()).unwrap();
        qp.ready_to_receive(&good).unwrap();
        let bad_rts = RtsAttr { retry_cnt: 9, ..rts(1) };
        assert!(matches!(qp.ready_to_send(&bad_rts), Err(Error::ModifyQp { attribute: Some("retry_cnt"), .. })));
        let text = qp.ready_to_send(&RtsAttr { timeout: 40, ..rts(1) }).unwrap_err().to_string();
        assert!(text.contains("RTR->RTS") && text.contains("`timeout`"), "{text}");
    }
}

verbs_test! {
    fn a_batch_of_unsignaled_writes_completes_with_its_signaled_tail() {
        let mut l = connected_loop();
        let data = pattern(64 * 1024, 2);
        let src = buf(&l.pd, &data, Access::LOCAL);
        let dst = buf(&l.pd, &vec![0; data.len()], Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let quarter = data.len() / 4;
        let sges: Vec<Sge> = (0..4)
            .map(|i| Sge::new(src.mem.as_ptr() as u64 + (i * quarter) as u64, quarter as u32, src.mr.lkey()))
            .collect();
        let wrs: Vec<SendWr<'_>> = (0..4)
            .map(|i| {
                let op = SendOp::Write { remote_addr: dst.mr.addr() + (i * quarter) as u64, rkey: dst.mr.rkey() };
                SendWr::new(i as u64, op, &sges[i..i + 1]).signaled(i == 3)
            })
            .collect();
        // SAFETY: both buffers outlive the completion polled below, which (RC
        // ordering) also completes the unsignaled requests before it.
        unsafe { l.a.post_send(wrs) }.unwrap();
        let wcs = poll_n(&l.cq, 1);
        assert_eq!((wcs[0].wr_id, wcs[0].status), (3, WcStatus::Success));
        std::thread::sleep(Duration::from_millis(50));
        let mut more = [WorkCompletion::EMPTY; 4];
        assert_eq!(l.cq.poll(&mut more).unwrap(), 0, "unsignaled requests make no completions");
        assert_eq!(dst.mem.as_slice(), &data[..]);
    }
}

verbs_test! {
    fn inline_sends_copy_at_post_time_and_oversized_inline_is_refused() {
        let mut l = connected_loop();
        let limit = l.a.caps().max_inline_data as usize;
        assert!(limit >= 16, "the device grants {limit} bytes inline");
        let dst = buf(&l.pd, &[0; 64], Access::LOCAL_WRITE);
        let ds = [dst.sge()];
        let mut msg = *b"inline payload!!";
        let sge = [Sge::new(msg.as_ptr() as u64, msg.len() as u32, 0)];
        // SAFETY: inline data is copied during the post; `dst` outlives the completions.
        unsafe {
            l.b.post_recv([RecvWr::new(1, &ds)]).unwrap();
            l.a.post_send([SendWr::new(2, SendOp::Send, &sge).inline(true)]).unwrap();
        }
        msg.fill(0); // the data was copied at post time
        let wcs = poll_n(&l.cq, 2);
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        assert_eq!(&dst.mem.as_slice()[..16], b"inline payload!!");
        let big = vec![0u8; limit + 1];
        let sge = [Sge::new(big.as_ptr() as u64, big.len() as u32, 0)];
        // SAFETY: refused before anything is posted.
        let err = unsafe { l.a.post_send([SendWr::new(3, SendOp::Send, &sge).inline(true)]) }.unwrap_err();
        assert_eq!(err.posted, 0);
        assert!(
            matches!(err.error, Error::ExceedsQpCaps { what: "bytes inline", got, max, .. } if got == limit as u64 + 1 && max == limit as u64),
            "{:?}",
            err.error
        );
    }
}

verbs_test! {
    fn the_safe_inline_post_carries_bytes_and_immediates_and_refuses_what_does_not_fit() {
        let mut l = connected_loop();
        let limit = l.a.caps().max_inline_data as usize;
        let dst = [buf(&l.pd, &[0; 64], Access::LOCAL_WRITE), buf(&l.pd, &[0; 64], Access::LOCAL_WRITE)];
        let ds = [[dst[0].sge()], [dst[1].sge()]];
        // SAFETY: both receive buffers outlive their completions.
        unsafe { l.b.post_recv([RecvWr::new(10, &ds[0]), RecvWr::new(11, &ds[1])]).unwrap() };
        let mut msg = *b"no unsafe needed";
        l.a.post_send_inline(20, &msg, None, false).unwrap();
        msg.fill(0); // copied at post time
        // Empty, with an immediate, signaled: its completion also says the quiet one before it is done.
        l.a.post_send_inline(21, &[], Some(0xfeed_f00d), true).unwrap();
        let wcs = poll_n(&l.cq, 3);
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        let sends: Vec<u64> = wcs.iter().filter(|w| w.opcode == WcOpcode::Send).map(|w| w.wr_id).collect();
        assert_eq!(sends, [21], "only the signaled send reports: {wcs:?}");
        let first = wcs.iter().find(|w| w.wr_id == 10).expect("the first receive");
        assert_eq!((first.byte_len, first.imm), (16, None));
        let second = wcs.iter().find(|w| w.wr_id == 11).expect("the second receive");
        assert_eq!((second.byte_len, second.imm), (0, Some(0xfeed_f00d)));
        assert_eq!(&dst[0].mem.as_slice()[..16], b"no unsafe needed");
        let err = l.a.post_send_inline(22, &vec![0u8; limit + 1], None, true).unwrap_err();
        assert_eq!(err.posted, 0);
        assert!(matches!(err.error, Error::ExceedsQpCaps { what: "bytes inline", .. }), "{:?}", err.error);
    }
}

verbs_test! {
    fn read_and_write_with_immediate_at_the_verbs_level() {
        let mut l = connected_loop();
        let data = pattern(8192, 3);
        let remote = buf(&l.pd, &data, Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE);
        let local = buf(&l.pd, &[0; 8192], Access::LOCAL_WRITE);
        let ls = [local.sge()];
        // SAFETY: both buffers outlive the completions polled below.
        unsafe {
            l.a.post_send([SendWr::new(1, SendOp::Read { remote_addr: remote.mr.addr(), rkey: remote.mr.rkey() }, &ls)])
                .unwrap();
        }
        let wcs = poll_n(&l.cq, 1);
        assert_eq!((wcs[0].status, wcs[0].opcode), (WcStatus::Success, WcOpcode::RdmaRead));
        assert_eq!(local.mem.as_slice(), &data[..]);

        let src = buf(&l.pd, &pattern(100, 4), Access::LOCAL);
        let ss = [src.sge()];
        let op = SendOp::WriteWithImm { remote_addr: remote.mr.addr(), rkey: remote.mr.rkey(), imm: 0xdead_beef };
        // SAFETY: as above; a write with immediate consumes a receive with no buffer.
        unsafe {
            l.b.post_recv([RecvWr::new(5, &[])]).unwrap();
            l.a.post_send([SendWr::new(6, op, &ss)]).unwrap();
        }
        let wcs = poll_n(&l.cq, 2);
        let recv = wcs.iter().find(|w| w.wr_id == 5).unwrap();
        assert_eq!((recv.opcode, recv.imm), (WcOpcode::RecvRdmaWithImm, Some(0xdead_beef)));
        assert_eq!(&remote.mem.as_slice()[..100], &pattern(100, 4)[..]);
    }
}

verbs_test! {
    fn queue_pair_capacities_are_granted_and_error_state_flushes() {
        let mut l = connected_loop();
        let caps = l.a.caps();
        assert!(caps.max_send_wr >= QpCaps::default().max_send_wr);
        let dst = buf(&l.pd, &[0; 64], Access::LOCAL_WRITE);
        let ds = [dst.sge()];
        // SAFETY: `dst` outlives the flush completions polled below.
        unsafe { l.b.post_recv([RecvWr::new(11, &ds), RecvWr::new(12, &ds)]) }.unwrap();
        l.b.set_error().unwrap();
        assert_eq!(l.b.query_state().unwrap(), QpState::Error);
        let wcs = poll_n(&l.cq, 2);
        assert!(wcs.iter().all(|w| w.status == WcStatus::WrFlush), "{wcs:?}");
    }
}
