//! A connection over every queue pair of every rail, and its listener.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::connection::{Connection, Direction, Listener};
use crate::error::{Error, Result};
use crate::memory::Memory;

use super::*;

/// Listens on every rail of a set: see [`Rails::listen`].
#[derive(Debug)]
pub struct RailListener {
    pub(super) rails: Rails,
    pub(super) listeners: Vec<Listener>,
}

impl RailListener {
    /// Where each rail listens, in rail order: what the dialer passes to
    /// [`Rails::connect`].
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn addrs(&self) -> Result<Vec<SocketAddr>> {
        self.listeners.iter().map(Listener::local_addr).collect()
    }

    /// Accepts a dialer's connections: `opts.queue_pairs` per rail, each
    /// checked for its place; within `opts.connect.handshake_timeout` each.
    ///
    /// # Errors
    /// [`Error::RailMismatch`] when the dialer has another number of rails
    /// or queue pairs; as [`Listener::accept_timeout`].
    pub fn accept(&self, opts: &RailOptions) -> Result<RailConnection> {
        opts.check()?;
        let n = self.rails.len();
        let mut links = Vec::new();
        for q in 0..opts.queue_pairs {
            for (r, l) in self.listeners.iter().enumerate() {
                let want = place(r, n, q, opts.queue_pairs);
                // Named after the place it expects, so a dialer set up
                // otherwise finds out at once too.
                let mut c = opts.connect.clone();
                c.name = want.clone().into_bytes();
                let conn = l.accept_timeout(&c, opts.connect.handshake_timeout)?;
                let got = String::from_utf8_lossy(&conn.info().peer_name).into_owned();
                if got != want {
                    return Err(Error::RailMismatch {
                        detail: format!("expected the dialer's \"{want}\", it says \"{got}\""),
                    });
                }
                links.push(RailLink::new(r, conn));
            }
        }
        Ok(RailConnection::new(&self.rails, links, opts))
    }
}

/// What one rail of a connection did ([`RailConnection::stats`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RailStats {
    /// The rail's device (`tcp` for a TCP-only domain).
    pub device: String,
    /// Bytes its queue pairs moved in transfers that completed.
    pub bytes: u64,
    /// Its queue pairs.
    pub queue_pairs: usize,
    /// Those still in use.
    pub alive: usize,
    /// Why it was dropped, if it was.
    pub failure: Option<String>,
}

/// Connections on every rail to one peer: see the [module docs](super).
pub struct RailConnection {
    pub(super) shared: Arc<RailShared>,
}

impl std::fmt::Debug for RailConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailConnection").field("rails", &self.stats()).finish()
    }
}

impl RailConnection {
    pub(super) fn new(rails: &Rails, links: Vec<RailLink>, opts: &RailOptions) -> Self {
        let rails = rails
            .names()
            .into_iter()
            .map(|device| RailState { device, bytes: AtomicU64::new(0), failure: Mutex::new(None) })
            .collect();
        RailConnection {
            shared: Arc::new(RailShared { links, rails, stripe: opts.stripe, op_timeout: opts.connect.op_timeout }),
        }
    }

    /// Writes `len` bytes at `local_offset` of `local` to `remote_offset`
    /// of the peer's region, striped over every rail.
    pub fn write<M: Memory>(
        &self,
        local: &RailRegion<M>,
        local_offset: u64,
        remote: &RailDescriptor,
        remote_offset: u64,
        len: u64,
    ) -> Striped<M> {
        let span = Span { local_offset, remote_offset, len };
        Striped::start(self, local, remote, span, Direction::Write, None)
    }

    /// [`write`](Self::write), then a notification with `tag` and `payload`
    /// for the peer's [`RailInbox`], sent once every stripe has landed.
    #[allow(clippy::too_many_arguments)]
    pub fn write_notify<M: Memory>(
        &self,
        local: &RailRegion<M>,
        local_offset: u64,
        remote: &RailDescriptor,
        remote_offset: u64,
        len: u64,
        tag: u32,
        payload: &[u8],
    ) -> Striped<M> {
        let span = Span { local_offset, remote_offset, len };
        Striped::start(self, local, remote, span, Direction::Write, Some((tag, payload.to_vec())))
    }

    /// Reads `len` bytes at `remote_offset` of the peer's region into
    /// `local_offset` of `local`, striped over every rail.
    pub fn read<M: Memory>(
        &self,
        local: &RailRegion<M>,
        local_offset: u64,
        remote: &RailDescriptor,
        remote_offset: u64,
        len: u64,
    ) -> Striped<M> {
        let span = Span { local_offset, remote_offset, len };
        Striped::start(self, local, remote, span, Direction::Read, None)
    }

    /// Lets the peer reach `region` through every queue pair, rail `r`'s
    /// registration on rail `r`; returns the descriptor to send it (see
    /// [`Connection::grant`]: on TCP a peer reaches only what was granted
    /// on its connection).
    ///
    /// # Errors
    /// [`Error::RailMismatch`] when `region` has another number of rails.
    pub fn grant<M: Memory>(&self, region: &RailRegion<M>) -> Result<RailDescriptor> {
        if region.rails.len() != self.shared.rails.len() {
            return Err(Error::RailMismatch {
                detail: format!(
                    "the region has {} rails, the connection {}",
                    region.rails.len(),
                    self.shared.rails.len()
                ),
            });
        }
        if !region.is_exposed() {
            return Err(Error::InvalidArgument(
                "a local-only rail region (Rails::register) cannot be granted: expose it (Rails::expose)".into(),
            ));
        }
        for l in &self.shared.links {
            l.conn.grant(&region.exposed[l.rail]);
        }
        Ok(region.descriptor())
    }

    /// Starts receiving the peer's notifications on every queue pair
    /// (`slots` receives each; see [`Connection::inbox`]).
    ///
    /// # Errors
    /// As [`Connection::inbox`].
    pub fn inbox(&self, slots: usize) -> Result<RailInbox> {
        let inboxes = self.shared.links.iter().map(|l| l.conn.inbox(slots)).collect::<Result<Vec<_>>>()?;
        Ok(RailInbox { inboxes, timeout: self.shared.op_timeout })
    }

    /// Per rail, in rail order: bytes moved, queue pairs alive, why it
    /// was dropped.
    pub fn stats(&self) -> Vec<RailStats> {
        let s = &self.shared;
        s.sweep();
        s.rails
            .iter()
            .enumerate()
            .map(|(r, state)| {
                let mine = s.links.iter().filter(|l| l.rail == r);
                RailStats {
                    device: state.device.clone(),
                    bytes: state.bytes.load(Ordering::Acquire),
                    queue_pairs: mine.clone().count(),
                    alive: mine.filter(|l| l.alive()).count(),
                    failure: state.failure().clone(),
                }
            })
            .collect()
    }

    /// The connections, with their rails, rail-major within each round of
    /// queue pairs.
    pub fn connections(&self) -> impl Iterator<Item = (usize, &Connection)> {
        self.shared.links.iter().map(|l| (l.rail, &l.conn))
    }
}
