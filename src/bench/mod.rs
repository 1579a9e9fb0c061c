//! The measurement loops behind `gpu-rdma bench`, in perftest's terms, on
//! any [`Connection`](crate::Connection): bandwidth by write, read and send with many requests
//! in flight, and latency by ping-pong (send, write with immediate) or by
//! one read at a time. The criterion benches use them too.
//!
//! Both ends run the same [`Params`] (as with perftest, both sides are given
//! the same flags); the client sends its [`Params`] first and the server
//! refuses a mismatch with [`Error::InvalidArgument`](crate::Error::InvalidArgument) on both sides instead
//! of measuring something else.
//!
//! How the loops stay out of the way:
//! - bandwidth: up to `tx_depth` requests in flight, posted in chains of
//!   `cq_mod` with only the last signalled (one completion per chain, one
//!   doorbell per chain); staged GPU buffers, which cannot be chained, go
//!   one by one;
//! - latency: the connection's busy-poll window ([`ConnectOptions::spin`](crate::ConnectOptions))
//!   covers the round trip, small host-memory sends go inline;
//! - nothing on the timed path allocates in proportion to the iterations:
//!   timestamps go into vectors sized up front.
//!
//! Units as perftest prints them: MB/sec is MiB/s (2^20 bytes), latency in
//! microseconds, one-way for the ping-pong tests (half the round trip) and
//! the whole operation for reads.

mod client;
mod params;
mod report;
mod server;

pub use client::{agree, bandwidth, finish, latency, run_client};
pub use params::{LocalMode, Params, Test, all_sizes};
pub use report::{BwRow, LatRow, Row};
pub use server::{Landing, run_server, serve};
