//! Making a verbs connection: the queue pair prepared before the hellos,
//! then moved to RTR and RTS with the peer's endpoint.

use super::*;

/// A queue pair made and moved to INIT before the hellos are exchanged: its
/// number goes into this side's hello.
pub(crate) struct Prepared {
    qp: QueuePair,
    cq: CompletionQueue,
    psn: u32,
    responder_resources: u8,
    port: PortAttr,
    gid_index: u32,
    gid: verbs::Gid,
    max_init_rd_atom: u32,
}

impl Prepared {
    pub(crate) fn new(vd: &Nic, opts: &ConnectOptions) -> Result<Self> {
        let channel = CompletionChannel::new(&vd.ctx)?;
        let cq = CompletionQueue::new(&vd.ctx, opts.send_queue_depth + opts.recv_queue_depth, Some(&channel))?;
        let mut qp = QueuePairBuilder::new(&vd.pd, &cq, &cq)
            .caps(QpCaps {
                max_send_wr: opts.send_queue_depth,
                max_recv_wr: opts.recv_queue_depth,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: opts.max_inline,
            })
            .build()?;
        qp.init(vd.port.port, Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)?;
        Ok(Prepared {
            qp,
            cq,
            psn: random_psn(),
            // As many of the peer's reads and atomics in flight as the
            // device takes (perftest's default too): a bandwidth-bound
            // reader is held back by the fewer of the two sides' limits.
            responder_resources: u8::try_from(vd.device.max_qp_rd_atom).unwrap_or(u8::MAX),
            port: vd.port,
            gid_index: vd.gid.entry.index,
            gid: vd.gid.entry.gid,
            max_init_rd_atom: vd.device.max_qp_init_rd_atom,
        })
    }

    /// This side's endpoint, for the hello.
    pub(crate) fn endpoint(&self) -> VerbsEndpoint {
        VerbsEndpoint {
            qp_num: self.qp.qp_num(),
            psn: self.psn,
            max_msg_sz: self.port.max_msg_sz,
            lid: self.port.lid,
            mtu: self.port.active_mtu.to_raw() as u8,
            link_layer: self.port.link_layer.to_raw(),
            responder_resources: self.responder_resources,
            gid: self.gid.raw(),
        }
    }

    /// Connects the queue pair to the peer's (RTR, RTS) and exchanges ready.
    pub(crate) fn finish(
        self,
        domain_id: u64,
        stream: TcpStream,
        theirs: &VerbsEndpoint,
        opts: &ConnectOptions,
        deadline: Deadline,
    ) -> Result<(VerbsConn, ConnectionInfo)> {
        let Prepared { mut qp, cq, psn, responder_resources, port, gid_index, gid: _, max_init_rd_atom } = self;
        let peer_addr = stream.peer_addr().ok();
        let their_mtu = Mtu::from_raw(u32::from(theirs.mtu)).unwrap_or(Mtu::Mtu256);
        let path_mtu = port.active_mtu.min(their_mtu);
        let is_global = port.link_layer != LinkLayer::InfiniBand;
        let rtr = RtrAttr {
            port: port.port,
            path_mtu,
            dest_qp_num: theirs.qp_num,
            rq_psn: theirs.psn,
            max_dest_rd_atomic: responder_resources,
            min_rnr_timer: opts.min_rnr_timer,
            dest_lid: theirs.lid,
            dest_gid: verbs::Gid(theirs.gid),
            is_global,
            sgid_index: u8::try_from(gid_index)
                .map_err(|_| Error::InvalidArgument(format!("GID index {gid_index} does not fit sgid_index")))?,
            hop_limit: 64,
            traffic_class: opts.traffic_class,
            service_level: opts.service_level,
        };
        if let Err(e) = qp.ready_to_receive(&rtr) {
            bootstrap::send_reject(&stream, &e.to_string());
            return Err(e);
        }
        // At least one: with none, this side could post no read at all; a
        // peer that offers none refuses a read instead, a typed error here.
        let reads_in_flight = max_init_rd_atom.min(u32::from(theirs.responder_resources)).max(1) as u8;
        let rts = RtsAttr {
            sq_psn: psn,
            timeout: opts.ack_timeout,
            retry_cnt: opts.retry_count,
            rnr_retry: opts.rnr_retry,
            max_rd_atomic: reads_in_flight,
        };
        if let Err(e) = qp.ready_to_send(&rts) {
            bootstrap::send_reject(&stream, &e.to_string());
            return Err(e);
        }
        bootstrap::exchange_ready(&stream, deadline)?;
        stream.set_nonblocking(true)?;

        let caps = qp.caps();
        let max_message = u64::from(port.max_msg_sz.min(theirs.max_msg_sz)).max(1);
        let info = ConnectionInfo {
            peer_name: Vec::new(),
            transport: Transport::Verbs,
            transport_reason: String::new(),
            peer_addr,
            local_qp_num: qp.qp_num(),
            remote_qp_num: theirs.qp_num,
            mtu: path_mtu.bytes(),
            max_message_size: max_message,
            max_inline: caps.max_inline_data,
            send_queue_depth: caps.max_send_wr,
            recv_queue_depth: caps.max_recv_wr,
            reads_in_flight: u32::from(reads_in_flight),
            memory_bound: None,
        };
        tracing::debug!(?info, "verbs connection established");
        let q = QueueCore::new(Limits {
            domain_id,
            send_depth: caps.max_send_wr,
            recv_depth: caps.max_recv_wr,
            max_message,
            qp_num: info.local_qp_num,
        });
        let succeeded_below = q.succeeded_mark();
        let conn = VerbsConn {
            state: Mutex::new(VerbsState {
                qp: Some(qp),
                q,
                peer_gone: None,
                sleepers: Sleepers::default(),
                count_imm: false,
                imm_writes: 0,
                sges: Vec::with_capacity(64),
                scratch: Vec::with_capacity(64),
            }),
            cq,
            socket: stream,
            max_inline: caps.max_inline_data,
            spin: opts.spin,
            polls_per_read: polls_per_clock_read(opts.spin),
            watched: std::sync::atomic::AtomicBool::new(false),
            succeeded_below,
            qp_num: info.local_qp_num,
            bell: OnceLock::new(),
            #[cfg(feature = "tokio")]
            closing: Default::default(),
            covers: OnceLock::new(),
        };
        Ok((conn, info))
    }
}
