//! # gpu-rdma
//!
//! Zero-copy RDMA transfers between machines through one safe API, built to
//! carry GPU memory (GPUDirect RDMA: GPU HBM -> PCIe -> NIC -> network, with no
//! copy through host RAM) as well as host memory.
//!
//! It has the verbs core (devices, memory registration, reliable-connected
//! queue pairs, the out-of-band handshake, the safe [`Connection`]) and CUDA
//! memory through three paths (dma-buf, nvidia-peermem, staged through
//! pinned host memory) behind the same calls, diagnostics that say whether
//! GPUDirect RDMA is really active ([`topology`], `gpu-rdma doctor`), and a
//! TCP transport with the same semantics for machines without RDMA.
//!
//! ## Quick start
//!
//! ```no_run
//! use gpu_rdma::{Access, ConnectOptions, Domain};
//!
//! # fn main() -> gpu_rdma::Result<()> {
//! let domain = Domain::open()?; // GPU_RDMA_DEVICE, else the first active port
//!
//! // Side A: expose 1 MiB for remote writes, and wait for a peer.
//! let target = domain.expose(domain.alloc(1 << 20)?, Access::REMOTE_WRITE, 1)?;
//! let listener = domain.listen("0.0.0.0:7471")?;
//! let conn = listener.accept(&ConnectOptions::default().advertise(&target))?;
//! let done = conn.recv_imm().wait()?; // the peer's write with immediate
//! # Ok(()) }
//! ```
//!
//! ```no_run
//! # use gpu_rdma::{ConnectOptions, Domain};
//! # fn main() -> gpu_rdma::Result<()> {
//! # let domain = Domain::open()?;
//! // Side B: write into A's region, and tell A in the same message.
//! let conn = domain.connect("10.0.0.1:7471", &ConnectOptions::default())?;
//! let remote = conn.remote_region(1).expect("A advertised it");
//! let mut data = domain.alloc(1 << 20)?;
//! data.fill(42);
//! let (completion, data) = conn.write_with_imm(data, &remote.whole(), 7).finish()?;
//! # Ok(()) }
//! ```
//!
//! ## Memory safety
//!
//! The device reads and writes memory behind the compiler's back, so the
//! API is built so that no safe code can free, move or reuse memory while
//! the device may touch it:
//!
//! - A [`Region`] owns its memory and its registration, and deregisters
//!   before it frees. Operations take it **by value** and hand it back with
//!   their completion through [`Pending`]; while it is in flight, nothing
//!   else can reach it.
//! - A [`Pending`] dropped early keeps its buffer inside the connection
//!   until the device is done with it (its final completion, or the queue
//!   pair's destruction). A connection dropped with work in flight moves its
//!   queue pair to the error state, waits briefly for the flushes, destroys
//!   it, and only then frees the buffers.
//! - Memory a peer may write ([`Exposed`]) or several operations share
//!   ([`Shared`]) gives no safe `&[u8]`: copy out with `read_at`, or use the
//!   `unsafe fn as_slice` under its written contract.
//! - The low-level [`verbs`] layer is complete but its registration and
//!   posting calls are `unsafe`, with a `# Safety` contract each.
//!
//! Every place memory comes back to its owner, and the rule that makes it
//! safe then (an operation completes only when no code of the transport,
//! the device or the engine can touch its memory again):
//!
//! | memory | comes back | why nothing touches it after |
//! |---|---|---|
//! | a send's, write's or write-with-immediate's buffer | at the operation's completion ([`Pending`]) | verbs: the NIC's completion, in order on the queue pair. TCP: only once its writer handed every byte to the socket **and** the peer acknowledged it, in request order; a reply while bytes were never handed, a second reply, one out of order or for a request never sent breaks the connection; one that arrives during the writer's last call is held for the writer, which completes the operation when it lets go |
//! | a read's buffer | at its completion | verbs: the NIC. TCP: a response must answer the oldest request waiting, a read that reached the peer whole, landing in order inside the buffer; only the thread filling the read completes it, and a failed final request of the same operation waits until that thread lets go |
//! | a receive's buffer, a [`RecvRing`] slot | at its completion; a ring's slot is posted again only when its [`Received`] loan ends | TCP: a receive is its reader's from the moment a message is matched to it until it is filled or failed; a message larger than it, or shorter than announced, fails it |
//! | a transfer list's buffer ([`Transfer`]) | once every chain it posted completed | each chain is an operation as above |
//! | a dropped [`Pending`], [`Transfer`], future or set | never to the caller | the connection keeps the buffer (a share of it per chain in flight) until the final completion, or until the queue pair or the transport's threads are gone |
//! | an inline send's bytes | at once | verbs copies them into the work request; TCP into a buffer of the connection's pool, recycled only after its writer is done with it |
//! | a notification's registered buffer | to the connection's pool, at the completion of its write into the peer's ring | as a write |
//! | this side's notification ring | with the connection (an in-flight credit write keeps it registered until it completes) | the peer may write it at any time: it is read only word by word (atomics) and by volatile copies, never through a Rust reference, and a record is taken only once both its ends show the number expected |
//! | a staging slot (GPU memory on the staged path) | to the GPU's cache, at the completion of the network operation on it | copies are synchronized before a GPU buffer comes back; a dropped operation leaves its slots that are on the network with the connection |
//! | a [`RailRegion`] | shared: freed when its last holder, a transfer included, drops it | as [`Shared`]: no safe slice |
//! | an [`Exposed`] region, withdrawn | after a TCP write or read of the peer in progress on it ends (its gate) | verbs: deregistration; a peer using the old key gets a remote-access error |
//!
//! The compiler enforces these rules; for example, a buffer moved into an
//! operation cannot be touched:
//!
//! ```compile_fail,E0382
//! # fn f(conn: &gpu_rdma::Connection, domain: &gpu_rdma::Domain) -> gpu_rdma::Result<()> {
//! let mut buf = domain.alloc(4096)?;
//! let pending = conn.send(buf);
//! buf[0] = 1; // error: borrow of moved value: the device owns it now
//! # Ok(()) }
//! ```
//!
//! nor can a buffer be sent while borrowed:
//!
//! ```compile_fail,E0505
//! # fn f(conn: &gpu_rdma::Connection, domain: &gpu_rdma::Domain) -> gpu_rdma::Result<()> {
//! let buf = domain.alloc(4096)?;
//! let view: &[u8] = &buf;
//! let pending = conn.send(buf); // error: cannot move out of `buf` while borrowed
//! println!("{}", view[0]);
//! # Ok(()) }
//! ```
//!
//! a region a peer may write has no safe slice:
//!
//! ```compile_fail,E0608
//! # fn f(exposed: gpu_rdma::Exposed) {
//! let first = exposed[0]; // error: cannot index into an `Exposed`
//! # }
//! ```
//!
//! a region cannot be duplicated to keep a handle while the device uses it:
//!
//! ```compile_fail,E0599
//! # fn f(region: gpu_rdma::Region) {
//! let copy = region.clone(); // error: `Region` is not `Clone`
//! # }
//! ```
//!
//! an operation's buffer is not reachable through its `Pending`:
//!
//! ```compile_fail,E0616
//! # fn f(p: gpu_rdma::Pending<gpu_rdma::Region>) {
//! let b = p.buf; // error: field `buf` is private
//! # }
//! ```
//!
//! a message a receive ring lends out ends its loan before the ring moves
//! on (its slot is posted again only then), so no message is read while
//! its slot is written:
//!
//! ```compile_fail,E0499
//! # fn f(mut ring: gpu_rdma::RecvRing<gpu_rdma::Region>) -> gpu_rdma::Result<()> {
//! let first = ring.next()?;
//! let second = ring.next()?; // error: `ring` is still lent to `first`
//! println!("{}", first[0]);
//! # Ok(()) }
//! ```
//!
//! and raw posting must be `unsafe`:
//!
//! ```compile_fail,E0133
//! # fn f(qp: &mut gpu_rdma::verbs::QueuePair) {
//! qp.post_send([]); // error: call to unsafe function
//! # }
//! ```
//!
//! ## Completions and errors
//!
//! A [`Completion`] is a small `Copy` value: work request id, [`Opcode`],
//! byte count, immediate, [`WcStatus`]. A failed operation is an
//! [`Error::Completion`] naming the status (with its `IBV_WC_*` name), the
//! operation, the work request and the queue pair; [`Error::is_remote_access`]
//! tells a bad rkey, an out-of-bounds address or a missing right at the
//! peer. Everything that can fail returns a typed [`Error`]; nothing panics
//! on bad input, and everything that waits for a peer has a timeout
//! ([`ConnectOptions::handshake_timeout`], [`ConnectOptions::op_timeout`]).
//!
//! [`Error::failure`] gives a condition one meaning on every transport and
//! device ([`Failure`]): a receive smaller than its message is
//! [`Failure::MessageTooLong`] on both sides, whether the device reports
//! `LOC_LEN_ERR`, `LOC_QP_OP_ERR`, `REM_INV_REQ_ERR` or `REM_OP_ERR`.
//!
//! ## Many operations at once: lists, notifications, futures
//!
//! - [`Connection::write_list`] / [`Connection::read_list`] move any number
//!   of [`Piece`]s (or [`Piece::pages`] of a paged layout) between one local
//!   buffer and one remote range with one [`Transfer`]: the list is checked
//!   whole before anything is posted, adjacent pieces are merged, long
//!   ones split, and the domain's engine keeps as many posts in flight as
//!   the send queue holds, with nobody waiting. On verbs, TCP and staged
//!   GPU memory alike.
//! - [`Connection::write_list_notify`] sends a tagged notification (with up
//!   to [`MAX_NOTIFY_PAYLOAD`] bytes) after the list's last piece; the
//!   peer's [`Inbox`] counts them by tag, in any arrival order. A list that
//!   fails sends a failure notification instead
//!   ([`Error::PeerTransferFailed`] at the peer, at once).
//!   Notifications take no receive: each is an RDMA write into the peer's
//!   notification ring (exchanged at the handshake, under [`RING_TAG`]),
//!   behind the data it covers. They wait there from the moment the
//!   connection exists, before any [`Inbox`] is made, so no rank has to
//!   make its inboxes before it finishes its own lists, and the
//!   connection's own receives take only messages. A peer that takes none
//!   holds a sender's next notification once its ring
//!   ([`ConnectOptions::notify_ring`], 64 KiB by default) is full, up to the
//!   sender's operation timeout.
//! - [`Pending`] and [`Transfer`] implement `Future` for any runtime; one
//!   progress engine per domain (a thread, started on first use) wakes
//!   them: it sleeps on every awaited connection's completion channel and
//!   peer socket (verbs), while TCP connections wake their waiters from
//!   their own threads. Every await is bounded by the operation timeout.
//!   With the `tokio` feature, futures awaited in a tokio runtime with IO
//!   enabled are woken through its reactor (`AsyncFd` on the completion
//!   channel) instead of through the engine's thread.
//!   [`CompletionSet`] waits for any or all of many operations, transfer
//!   lists and striped transfers from one thread; [`Pending::on_complete`]
//!   (and `Transfer`'s and `Striped`'s) runs a callback on the engine.
//! - A striped transfer ([`rails::Striped`]) is driven by the engine from
//!   the moment it is posted: a failed rail's stripes move and its
//!   notification goes out whether or not anyone waits on its handle.
//! - Dropping a future, a `Transfer` or a whole set mid-flight is safe: the
//!   buffers stay with their connections until the device is done.
//! - [`Connection::recv_persistent`] and [`Connection::send_persistent`]
//!   post a receive or an (unsignaled) send whose handle posts the next on
//!   the same range once it finished ([`Persistent::repost`]), as perftest
//!   reposts its prebuilt requests: the range is checked once and no handle
//!   is built per message.
//! - [`Connection::recv_ring`] posts receives into the slots of one buffer
//!   (host memory, or GPU memory: on a direct path the NIC writes the
//!   slots, on the staged path each message is copied in from host
//!   staging before it is lent out) and lends the messages
//!   out in order ([`RecvRing::next`], or awaited: [`RecvRing::recv`]); a
//!   [`Received`] of host memory reads as the message's bytes, and dropping
//!   it posts its slot again. A slot is never written while its message is
//!   lent out, and the buffer stays with the connection while any slot is
//!   posted.
//! - [`ConnectOptions::post_timeout`] `(Duration::ZERO)` makes posts
//!   try-posts ([`Error::QueueFull`] at once, the buffer back);
//!   [`Pending::into_result`] hands the buffer back on error too.
//!
//! ## Many peers, several NICs
//!
//! - [`World`] connects a rank to the others of its job on first use,
//!   through a [`rendezvous`] store (a directory, or etcd with leases).
//! - [`Rails`] is one [`Domain`] per NIC (by default every NIC as near the
//!   GPU as its nearest: [`Rails::open_near_gpu`]); memory registered with
//!   it ([`RailRegion`]) has a key per rail, and a [`RailConnection`]
//!   stripes writes and reads over several queue pairs per rail, moving a
//!   failed rail's stripes to the others. See [`rails`].
//!
//! ## Transports: verbs, or TCP with the same semantics
//!
//! Each connection picks its transport in the handshake: verbs (an RC queue
//! pair) when both ends have an active RDMA port that can reach the other's
//! (same link layer; same subnet on InfiniBand), else TCP over the
//! handshake's own stream. [`TransportPolicy`] forces one, in code
//! ([`DomainConfig::transport`], [`ConnectOptions::transport`]) or with
//! `GPU_RDMA_TRANSPORT=auto|verbs|tcp`; asking for verbs where either end
//! has none is an error naming the end and the reason. The choice and why
//! are in [`ConnectionInfo::transport`] and
//! [`ConnectionInfo::transport_reason`], and logged once per connection.
//! On a machine without RDMA, [`Domain::open`] gives a TCP-only domain
//! ([`DomainInfo::transport`] says so, [`DomainInfo::fallback`] why).
//!
//! The TCP transport keeps the verbs contract, and the connection test
//! suite runs unchanged on both:
//!
//! - send/receive keeps message boundaries; each send consumes the next
//!   posted receive; a send larger than that receive fails on both sides,
//!   and a send with no receive posted waits the receiver-not-ready budget
//!   ([`ConnectOptions::rnr_retry`](ConnectOptions#structfield.rnr_retry)), then fails as on verbs;
//! - write, write with immediate and read are carried out at the target by
//!   the connection's receiving thread, against the target domain's table
//!   of exposed regions: the key, the bounds and the access right are
//!   checked first, and a violation is a remote-access completion error at
//!   the initiator with the target's memory untouched; an immediate arrives
//!   as a receive completion, as on verbs;
//! - an operation completes when the peer acknowledged it (a write: the
//!   data is in the peer's memory), in posting order, as on RC; an error
//!   completion breaks the connection on both ends, as an RC queue pair in
//!   the error state does;
//! - payloads go from and into registered memory with `sendmsg`/`recv`, no
//!   user-space copy; several operations may be in flight.
//!
//! GPU memory over TCP takes the staged path (pinned host buffers, copies
//! pipelined with the network): there is no NIC to register it with.
//!
//! ## Measuring
//!
//! [`bench`](mod@bench) holds perftest's tests as library loops (bandwidth with many
//! requests in flight in signalled chains, latency by ping-pong), the same
//! ones behind `gpu-rdma bench` and the criterion benches, so a framework
//! can measure its own connections the way perftest would.
//!
//! ## Failure semantics
//!
//! | error | what happened | the connection | what to do |
//! |---|---|---|---|
//! | [`Error::OutOfBounds`], [`Error::AccessDenied`], [`Error::MessageTooLarge`], [`Error::NotifyPayloadTooLarge`], [`Error::DomainMismatch`], [`Error::TooManyRequests`], [`Error::EmptyBatch`], [`Error::LengthMismatch`], [`Error::NeedsDirectPath`], [`Error::InvalidArgument`] | refused before posting | unchanged, usable | fix the request; the buffer comes back from [`Pending::into_buffer`] |
//! | [`Error::Timeout`] from [`Pending::wait`] | nothing yet | unchanged | wait again, or drop the connection to abort |
//! | [`Error::Completion`] | the device failed the operation | the queue pair is in the error state ([`Connection::broken`] says why) | connect again |
//! | [`Error::ConnectionLost`] | the peer closed or died, or this side closed: every pending operation gets it (a killed peer is seen within milliseconds on TCP, and through the handshake socket on verbs, before the transport's retries run out) | broken; the domain's other connections are unaffected | connect again (a restarted peer on the same address works) |
//! | [`Error::Bootstrap`], [`Error::Timeout`] from connect/accept | the handshake failed | never established; a listener stays usable | check the peer, retry |
//! | [`BootstrapError::Auth`] | the shared secrets differ, or only one side has one (both sides get it; nothing but nonces and proofs was exchanged) | never established | give both sides the same [`ConnectOptions::secret`] (or `GPU_RDMA_SECRET`) |
//! | [`Error::NoDevice`], [`Error::DeviceNotFound`], [`Error::NoActivePort`], [`Error::NoGid`] | no usable RDMA port | - | see the reason; `gpu-rdma devices` |
//! | [`Error::QueueFull`] | the send queue stayed full for [`ConnectOptions::post_timeout`] (zero: a try-post) | unchanged | wait for completions, post again; the buffer comes back |
//! | [`Error::PeerMismatch`] from [`World::peer`] | the address under a rank's key answered as another rank (a stale entry, a reused port) | closed | the rank republishes; ask again |
//! | [`Error::PeerTransferFailed`] from an [`Inbox`] wait | the peer's transfer list for that tag failed (its reason) | unchanged | ask again, or give up on the tag |
//! | [`Error::Interrupted`] from accept | [`Listener::interrupt_handle`] was used | accepted connections unaffected | - |
//!
//! What a peer can and cannot do to this side, whatever bytes it sends:
//!
//! - **A broken connection stops.** After the first error on a connection
//!   (a request of the peer refused: bad key, out of bounds, missing right,
//!   a send larger than the receive, no receive within the
//!   receiver-not-ready budget; or an error the peer reports; or a garbled
//!   frame) this side carries out nothing more from that peer: no later
//!   write lands, no later read is served. On TCP the refusal is the last
//!   reply the peer gets; the connection is then shut (the peer sees the end
//!   of the stream within milliseconds, or after 0.5 s at most if it does
//!   not read) and both transport threads end, though the [`Connection`]
//!   lives until dropped. On verbs the queue pair is in the error state, as
//!   the NIC puts it.
//! - **A dead peer is seen**, also while its message waits for a receive
//!   here with the receiver-not-ready budget at "infinite" (`rnr_retry` 7):
//!   on TCP the socket is watched every 5 ms meanwhile; on verbs the
//!   handshake socket's closure breaks the connection. Dropping the
//!   connection ends any such wait at once.
//! - **A peer's replies are checked, not believed.** On TCP an
//!   acknowledgement or read response must answer the oldest request
//!   waiting for one, a request that reached the peer whole; anything
//!   else (early, twice, out of order, for nothing) breaks the connection
//!   and completes nothing (see the table under Memory safety).
//! - **Announced limits are checked.** A hello announcing a largest
//!   message below [`bootstrap::MIN_MAX_MESSAGE`] (64 KiB), no responder
//!   resources, a send depth, receiver-not-ready retry or timer out of
//!   range is refused at the handshake ([`BootstrapError::OutOfRange`],
//!   naming the field); work planned against the peer's limits (a list's
//!   requests) holds only what the caller passed.
//! - **Memory per connection is bounded.** On TCP a peer may have at most
//!   its announced send-queue depth of requests awaiting replies (at most
//!   [`bootstrap::MAX_TCP_QUEUE_DEPTH`]); one that sends more, or stops
//!   reading its acknowledgements until that many queue up, breaks its
//!   connection instead of growing this side's memory.
//!   [`ConnectionInfo::memory_bound`] states the bound in bytes: the 1 MiB
//!   receive buffer, the two threads' stacks, the replies
//!   queued for the peer (tens of bytes each), and this side's own queues;
//!   about 1.4 MiB with default depths, 5.5 MiB with the deepest peer.
//!   Other connections of the domain are unaffected. A peer's
//!   notifications wait in this side's ring, of the size this side chose,
//!   until taken (a peer that writes past the room it was given only
//!   spoils its own notifications; one that breaks the ring's format
//!   breaks the connection). An [`Inbox`] holds
//!   at most [`MAX_QUEUED_BYTES`] (64 MiB) of notifications nobody took,
//!   each charged its payload and [`NOTE_OVERHEAD`], and at most
//!   [`MAX_QUEUED_NOTES`]; past that new ones are dropped and counted.
//! - **Local stores are not trusted either.** A
//!   [`DirRendezvous`](rendezvous::DirRendezvous) reads only regular files
//!   (never through a link, never blocking on a FIFO), at most
//!   [`MAX_VALUE`](rendezvous::MAX_VALUE) (1 MiB) each and
//!   [`MAX_LISTING`](rendezvous::MAX_LISTING) (64 MiB) a listing, skips
//!   and counts the rest, and returns within its timeout; a watch that
//!   cannot list its store says so ([`World::watch_failing`]). A dialed
//!   rank must name itself as the rank asked for
//!   ([`Error::PeerMismatch`]); without a shared secret a connection
//!   claiming a rank does not displace that rank's live one.
//! - **Handshakes are concurrent.** [`Listener`] runs each handshake on its
//!   own thread, bounded by [`ConnectOptions::handshake_timeout`], up to
//!   [`MAX_CONCURRENT_HANDSHAKES`] at once (past that the oldest is cut
//!   off): silent or half-sent peers, with or without a secret, never
//!   delay another client.
//!
//! ## Access control
//!
//! - Registration grants local access only; [`Domain::expose`] adds exactly
//!   the remote rights asked for (no remote read or atomics unless asked).
//! - [`Exposed::withdraw`] deregisters: a peer still using the old key gets
//!   a remote-access error, never this memory or whatever reuses it.
//! - A region is reachable only through the connections it was advertised
//!   on ([`ConnectOptions::advertise`]) or granted to
//!   ([`Connection::grant`]) on TCP; on verbs a remote key is valid on
//!   every queue pair of its protection domain, so peers that must not see
//!   each other's regions get a [`Domain`] each (a protection domain each).
//! - Remote keys do not predict each other: verbs keys are the NIC's, and
//!   a TCP-only domain draws each key from the operating system's CSPRNG.
//! - [`ConnectOptions::secret`]: mutual challenge-response (HMAC-SHA256
//!   over fresh nonces, role-bound, compared in constant time) before the
//!   hello, so a peer without the secret never sees an endpoint or a key.
//!
//! ## Cargo features
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `verbs` | yes | ibverbs through `rdma-sys`; building needs rdma-core headers (`libibverbs-dev`) |
//! | `cuda` | yes | CUDA through `cudarc`, loaded at run time: building needs no CUDA, and a machine without a GPU gets [`Error::CudaUnavailable`] with the reason from every CUDA call, never a panic |
//! | `cli` | no | the `gpu-rdma` command-line tool (`clap`, `serde_json`, `tracing-subscriber`): `cargo run --features cli --bin gpu-rdma` |
//! | `tokio` | no | futures awaited in a tokio runtime with IO enabled are woken through its reactor rather than the engine's thread |
//! | `serde` | no | `Serialize`/`Deserialize` for [`Endpoint`], [`RemoteRegion`] (checked as the wire form is), topology reports and bench rows |
//! | `etcd` | no | `rendezvous::EtcdRendezvous`: a rendezvous in etcd, with leases; building needs `protoc` |
//!
//! `cargo build --no-default-features` builds on a machine without
//! rdma-core; [`Domain::open`] then says the crate was built without verbs.
//!
//! ## System requirements
//!
//! - Linux. For verbs: rdma-core (libibverbs) and an RDMA device:
//!   InfiniBand or RoCE (ConnectX), or soft-RoCE (`rdma_rxe`) for
//!   development; enough locked-memory allowance for registered buffers
//!   (`ulimit -l`).
//! - Without an RDMA device, connections run over TCP and say why
//!   (for example a kernel without InfiniBand support); forcing verbs there
//!   is [`Error::NoDevice`] with that reason. `cargo xtask vm` runs
//!   programs in a soft-RoCE VM.
//!
//! ## Which memory path will I get?
//!
//! Host memory ([`HostMemory`], any host [`Memory`]) is registered with
//! `ibv_reg_mr`. GPU memory ([`cuda::CudaBuffer`]) is registered by the first
//! path that works, in this order (`GPU_RDMA_MEM_PATH=dmabuf|peermem|staged`
//! or [`Domain::register_with_path`] forces one; a forced path that fails is
//! an error, not a fallback):
//!
//! | path | needs | the NIC | cost |
//! |---|---|---|---|
//! | `dmabuf` | GPU reports `DMA_BUF_SUPPORTED` (open kernel module), CUDA 11.7+, rdma-core 34+ (`ibv_reg_dmabuf_mr`), kernel 5.12+, a NIC driver that takes dma-bufs | reads/writes GPU memory | none |
//! | `peermem` | the `nvidia_peermem` module loaded, GPU reports `GPU_DIRECT_RDMA_SUPPORTED` | reads/writes GPU memory | none |
//! | `staged` | nothing | reads/writes pinned host buffers; CUDA copies on their own streams | a copy each way, pipelined |
//!
//! The staged path's host buffers are pinned on first use and kept for the
//! next operations (per GPU, as many bytes as were ever on loan at once, at
//! least 64 MiB); [`Domain::reserve_staging`] pins them ahead of a deep
//! pipeline, and [`Domain::staging_stats`] says whether any was pinned on
//! the hot path.
//!
//! Under `auto` a direct path is also left out, with the reason, when the
//! GPU and the domain's NIC are further apart on PCIe than the GDR level
//! (`GPU_RDMA_GDR_LEVEL`, default PXB, as NCCL: PHB, NODE and SYS cross the
//! CPU, where staging is as fast and safer), when NIC writes into the GPU
//! need a flush the driver does not offer (incoming data could be read
//! stale; memory registered without write rights, which only goes out,
//! stays direct), or when the driver says the allocation is not GPUDirect RDMA
//! capable (VMM memory made without `gpuDirectRDMACapable`; never tried
//! directly, even when forced). A forced path whose other requirements are
//! missing is tried, and its report carries the warning. [`Region::path_report`] says which path won and why
//! the others lost, in plain words, for example `staged: dma-buf refused
//! (ibv_reg_dmabuf_mr is not supported by this device or driver) and
//! nvidia_peermem not loaded`; the first registration per GPU logs it, and
//! `gpu-rdma gpu` prints what each GPU would get.
//!
//! ### Is the fast path really active?
//!
//! GPUDirect RDMA fails silently: a missing module, a GPU and NIC on
//! different PCIe switches, or no dma-buf support, and transfers quietly
//! take the slow path. `gpu-rdma doctor` (and [`topology::doctor`], the same
//! report as data) checks the driver support, the RDMA devices, the GPU x
//! NIC PCIe distance (from sysfs, cross-checked with `nvidia-smi topo -m`),
//! ACS, the IOMMU, BAR1 and link speeds, and gives a verdict per GPU with
//! the fix for each failed check. [`Domain::open_near_gpu`] opens the NIC
//! nearest a GPU by the same ranking.
//!
//! ### Ordering and visibility on the GPU
//!
//! - Before the NIC reads GPU memory (a send or write from it), the CUDA
//!   work producing it must be complete; before it writes GPU memory (a
//!   receive or read into it), the work still reading the old contents
//!   must be. Call [`cuda::CudaBuffer::ready_after`] with that work's stream
//!   before posting each such operation (it takes `&self`: call it through
//!   `region.memory()` or `exposed.cuda()`), once per stream whose work
//!   touches the buffer: the operation waits for the work queued on each up
//!   to its call; fences add up until their work is done. Nothing blocks
//!   on them: a staged operation's copies wait on the GPU, and a send,
//!   write, read, batch or list on a direct path is kept, in its place in
//!   the connection's order, until its fences are done (the posting call
//!   returns at once, and an awaited operation stays asynchronous). A
//!   receive into direct GPU memory whose fences still run goes through
//!   host staging (a receive kept back would let a later one take its
//!   message): the message lands in a host slot in its turn, and its copy
//!   into the GPU waits for the fences on the GPU. The
//!   stream-ordered form fences one operation alone:
//!   `conn.write(region.slice(..).after(&stream)?, &remote)`
//!   ([`LocalSlice::after`], or [`LocalSlice::after_event`] with an event
//!   of yours); other operations on the buffer do not wait for it, and it
//!   works for host memory filled by GPU work as well. Without
//!   it the contents are taken as settled (after a synchronous copy or your
//!   own synchronize); the crate never synchronizes the whole context,
//!   which would wait for unrelated work and is illegal under graph capture.
//! - GPU memory is never touched by the CPU through its device address:
//!   small sends from it are posted by reference, never inline.
//! - Any device pointer registers: `cuMemAlloc` memory (only 256-byte
//!   alignment is assumed), a tensor at any offset inside a larger block,
//!   VMM memory (`cuMemCreate`, [`cuda::CudaBuffer::from_raw`]; its
//!   `IS_GPU_DIRECT_RDMA_CAPABLE` decides whether a direct path may be
//!   tried). dma-buf exports round the range out to whole pages and
//!   register it by offset, with the device address as the iova. GPU
//!   registrations ask for PCIe relaxed ordering
//!   (`GPU_RDMA_RELAXED_ORDERING=0` opts out).
//! - After the NIC writes GPU memory (a receive or read into it), the
//!   completion is reported only once the data is visible to CUDA work:
//!   `cuFlushGPUDirectRDMAWrites` where the device's ordering attributes
//!   need it, the copy into the GPU on the staged path.
//! - A peer's one-sided write into an [`Exposed`] GPU region is visible to
//!   CUDA once an [`Inbox`] hands out the notification of the transfer
//!   list that wrote it (the notification names the region and the ranges
//!   the list wrote; the inbox copies them in from the staged path's host
//!   mirror, or flushes on a direct path, before it hands the note out), or
//!   after [`Connection::recv_write`] completes for the peer's "done" (a
//!   write with immediate, or a zero-byte send): on a direct path it
//!   flushes, on the staged path it copies the region's host mirror into
//!   the GPU. A write with immediate is visible once any receive takes its
//!   immediate ([`Connection::recv_imm`], a receive with a buffer, a
//!   receive ring): over TCP its range is copied in before the receive
//!   completes, over verbs on a direct path the remote writes are flushed,
//!   and over verbs into a staged region the writer first puts a 64-byte
//!   cover naming the range in this side's notification ring (asked for in
//!   the handshake where this side may hold staged GPU memory:
//!   [`ConnectOptions::imm_covers`]), which the receive copies in. A plain
//!   write that nothing names reaches GPU memory on the staged path only
//!   through [`Exposed::pull`].
//!   Before letting a peer read an exposed staged region, call
//!   [`Exposed::publish`], which copies the GPU contents to the mirror.
//! - **Posting order.** On one connection, sends, writes (with or without
//!   immediate), reads, transfer lists and their notifications take effect
//!   at the peer in the order they were posted, whatever memory each uses
//!   and whatever path it takes: a staged GPU write followed by a send
//!   (host or GPU) is seen by the peer only once every byte of the write
//!   landed. An operation whose requests cannot all go to the transport at
//!   once (a staged one, whose chunks follow their copies; a list longer
//!   than the send queue) holds back what is posted after it until it has
//!   handed over its last request; the domain's engine moves it meanwhile,
//!   whether or not anyone waits on it. Receives are a queue of their own,
//!   held back only behind a receive kept for its fences. As on RC, a read's data may still be on its way when a
//!   later operation takes effect; a list's failure notification goes out
//!   at once (it carries no data).
//! - Staged copies of different operations never wait on each other: each
//!   staged operation copies on a stream of its own (from a pool per GPU),
//!   after its own fences only, and dropping one waits for nothing (what
//!   its copies in flight touch is released once they end).
//! - Staged operations also advance when they are waited on or polled;
//!   their chunk size and depth are [`ConnectOptions::staging_chunk`] and
//!   [`ConnectOptions::staging_depth`]. A direct-path peer and a staged
//!   peer interoperate: the wire does not know the difference.
//!
//! ## Threads and cleanup
//!
//! [`Domain`], [`Connection`], [`Exposed`] and [`Shared`] are `Send + Sync`;
//! operations may be posted and waited on from several threads. Threads:
//! one progress engine per domain (started when something is first
//! awaited), and per TCP connection a sender and a receiver; verbs
//! connections have none.
//!
//! Who may touch what, when: host memory a peer writes into is the
//! owner's to read once the peer says so (a notification, a message, a
//! write with immediate arrives after the data on a reliable connection);
//! the exposer keeps its connection open while the peer's one-sided
//! operations are to run (they go through its queue pair); a remote-access
//! error breaks the connection it happened on, on both transports, and no
//! other; dropping a [`Listener`] cuts off only the handshakes it has
//! running. Resources
//! keep their parents alive, so they may be dropped in any order: the
//! device context, protection domain, queue pairs and registrations are
//! released in dependency order when the last user goes.
//! [`Domain::stats`] counts what is live.
//!
//! ## Environment
//!
//! `GPU_RDMA_DEVICE`, `GPU_RDMA_PORT`, `GPU_RDMA_GID_INDEX` choose the
//! device, port and GID ([`DomainConfig::from_env`]); `GPU_RDMA_TRANSPORT`
//! the transport; `GPU_RDMA_MEM_PATH` the GPU memory path; `GPU_RDMA_GDR_LEVEL`
//! (PIX, PXB, PHB, NODE or SYS; default PXB) how far apart on PCIe a GPU and
//! the NIC may be for a direct path under `auto`; `GPU_RDMA_RELAXED_ORDERING=0`
//! turns off relaxed ordering for GPU registrations; `GPU_RDMA_LOG` sets the log filter of the tools
//! (`tracing` directives).

#![warn(missing_docs)]

mod access;
pub mod bench;
pub mod bootstrap;
mod completion;
mod config;
mod connection;
mod deadline;
mod domain;
mod endpoint;
mod error;
mod host_memory;
pub mod launch;
pub mod memory;
mod ops;
mod options;
mod poll;
mod protocol;
pub mod rails;
mod remote;
pub mod rendezvous;
pub mod topology;
mod transport;
pub mod units;
#[cfg(feature = "verbs")]
pub mod verbs;
pub mod world;

pub use bootstrap::Secret;
pub use bootstrap::{DEFAULT_RING, MAX_RING, MIN_RING, RING_TAG};
pub use completion::{Completion, CompletionError, Failure, Opcode, WcStatus};
pub use config::{Transport, TransportPolicy};
pub use connection::{
    Batch, CompletionSet, ConnectOptions, Connection, ConnectionInfo, ConnectionStats, Failed, Finished, Inbox,
    InboxStats, Interrupt, Listener, Looking, MAX_CONCURRENT_HANDSHAKES, MAX_QUEUED_BYTES, MAX_QUEUED_NOTES,
    NOTE_OVERHEAD, Note, Pending, Persistent, PersistentRecv, PersistentSend, Received, RecvRing, SetMember, Transfer,
    Transferred,
};
#[cfg(feature = "cuda")]
pub use domain::StagingStats;
pub use domain::{BufError, Domain, DomainConfig, DomainInfo, DomainStats};
pub use endpoint::Endpoint;
pub use error::{AuthFailure, BootstrapError, Error, Result};
pub use memory::{
    Access, Exposed, ForeignHost, HostArena, HostMemory, LocalBuffer, LocalSlice, Memory, MemoryKind, Region,
    RegistrationCacheStats, RemoteRegion, RemoteSlice, Shared, WithdrawError,
};
pub use protocol::list::{PageLayout, Piece};
pub use protocol::notify::MAX_NOTIFY_PAYLOAD;
pub use rails::{RailConnection, RailDescriptor, RailOptions, RailRegion, Rails};
pub use world::{World, WorldOptions};
#[cfg(feature = "cuda")]
pub mod cuda;

/// The README's Rust examples, compiled (not run) as doctests, so the
/// README cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
