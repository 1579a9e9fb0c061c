//! Protocols: how an operation moves its bytes.
//!
//! - Transfer lists ([`list`]): many pieces between one local buffer and
//!   one remote range, planned here (checked, coalesced, split) and posted
//!   by the engine in [`Transfer`](crate::Transfer).
//! - Notifications ([`notify`]): the message a list sends after its last
//!   piece, and its codec.
//! - Order ([`order`]): a connection's operations take effect at the peer
//!   in posting order, whatever path each takes.
//! - The operation driver ([`op`]): how any operation in flight is waited
//!   for and awaited. Each says how it moves and what would wake a waiter;
//!   one wait and spin policy and one registration with the engine serve
//!   single operations off their fast paths, transfer lists, receive
//!   rings' awaits and notification waits.
//! - Notification rings ([`mailbox`]): where notes and the covers of writes
//!   with immediate land at the peer without taking a receive.
//!
//! For GPU memory, chosen once per operation (host memory is always direct):
//! - Direct: the operation is posted as it is; the NIC reads or writes the
//!   buffer (host memory, or GPU memory on a dma-buf or nvidia-peermem
//!   path).
//! - Staged ([`staged`]): GPU memory the NIC (or the TCP transport) cannot
//!   reach goes through pinned host slots, with CUDA copies pipelined
//!   against the network.
//!
//! Both post the same `RemoteOp`s through the same transport, so the
//! checks a device makes are made once, in `route`, for both.

pub(crate) mod context;
pub(crate) mod list;
pub(crate) mod mailbox;
pub(crate) mod notify;
pub(crate) mod op;
pub(crate) mod order;
#[cfg(feature = "cuda")]
mod route;
#[cfg(feature = "cuda")]
pub(crate) mod staged;

#[cfg(feature = "cuda")]
pub(crate) use route::{Route, check_staged, route, route_receive};
