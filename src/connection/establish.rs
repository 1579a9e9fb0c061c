//! Establishment: listening, connecting, and the concurrent handshakes of
//! a [`Listener`]. `Domain`'s connection methods live here, above the
//! domain, so the domain knows nothing of connections.

use std::fmt;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{ConnectOptions, Connection};
use crate::domain::Domain;
use crate::error::{Error, Result};

impl Domain {
    /// Listens for connections on `addr` (TCP, for the handshake).
    ///
    /// # Errors
    /// [`Error::Io`] when the address cannot be bound.
    pub fn listen(&self, addr: impl ToSocketAddrs) -> Result<Listener> {
        Listener::new(self.clone(), TcpListener::bind(addr)?)
    }

    /// Connects to a listener at `addr`, with `opts`.
    ///
    /// # Errors
    /// [`Error::Io`] when no TCP connection can be made (naming the
    /// address; its kind, such as `ConnectionRefused`, kept), [`Error::Timeout`],
    /// [`Error::Bootstrap`] when the handshake fails, [`Error::ModifyQp`]
    /// when the queue pairs cannot be connected.
    pub fn connect(&self, addr: impl ToSocketAddrs, opts: &ConnectOptions) -> Result<Connection> {
        let deadline = Instant::now() + opts.handshake_timeout;
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(&a, remaining) {
                Ok(stream) => return Connection::establish(self, stream, opts, false),
                Err(e) => last = Some((a, e)),
            }
        }
        Err(match last {
            Some((_, e)) if e.kind() == std::io::ErrorKind::TimedOut => {
                Error::Timeout { what: "the TCP connection to the peer", after: opts.handshake_timeout }
            }
            // The address it could not reach, in the message; the kind kept.
            Some((a, e)) => Error::Io(std::io::Error::new(e.kind(), format!("connecting to {a}: {e}"))),
            None => Error::InvalidArgument("the address resolved to nothing".into()),
        })
    }
}

/// The most handshakes a [`Listener`] runs at once. Past it, the oldest
/// one still running is cut off (its socket shut) to make room, so a flood
/// of silent peers cannot keep a legitimate client out.
pub const MAX_CONCURRENT_HANDSHAKES: usize = 128;

/// Accepts connections for a [`Domain`].
///
/// Handshakes run concurrently, each on its own short-lived thread and
/// bounded by its [`ConnectOptions::handshake_timeout`], at most
/// [`MAX_CONCURRENT_HANDSHAKES`] at once: a slow, silent or half-sent peer
/// never delays another. Dropping the listener cuts off the handshakes
/// still running; connections it already returned are not affected.
pub struct Listener {
    domain: Domain,
    tcp: TcpListener,
    handshakes: Arc<Handshakes>,
}

/// Handshakes in progress and finished, shared with their threads.
struct Handshakes {
    state: std::sync::Mutex<HandshakeState>,
    /// Rung when a handshake finishes or accepting is interrupted.
    wake: crate::poll::Bell,
    /// Set by an [`Interrupt`]: accepting is over.
    interrupted: std::sync::atomic::AtomicBool,
}

/// Stops a [`Listener`]'s accepting from another thread: see
/// [`Listener::interrupt_handle`].
#[derive(Clone)]
pub struct Interrupt {
    handshakes: Arc<Handshakes>,
}

impl Interrupt {
    /// Makes a blocked [`Listener::accept`] (and every later one) return
    /// [`Error::Interrupted`] at once. Connections already accepted are
    /// not affected; handshakes still running finish or fail on their own.
    pub fn interrupt(&self) {
        self.handshakes.interrupted.store(true, std::sync::atomic::Ordering::SeqCst);
        self.handshakes.wake.ring();
    }
}

impl fmt::Debug for Interrupt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Interrupt")
            .field("interrupted", &self.handshakes.interrupted.load(std::sync::atomic::Ordering::SeqCst))
            .finish()
    }
}

#[derive(Default)]
struct HandshakeState {
    next_id: u64,
    /// Running: id, and a handle on the socket to cut the handshake off.
    running: std::collections::VecDeque<(u64, TcpStream)>,
    /// Finished and not yet returned by an accept call.
    finished: std::collections::VecDeque<Result<Connection>>,
}

impl Handshakes {
    fn lock(&self) -> std::sync::MutexGuard<'_, HandshakeState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Listener {
    fn new(domain: Domain, tcp: TcpListener) -> Result<Listener> {
        tcp.set_nonblocking(true)?;
        let wake = crate::poll::Bell::new()?;
        let handshakes = Arc::new(Handshakes { state: Default::default(), wake, interrupted: Default::default() });
        Ok(Listener { domain, tcp, handshakes })
    }

    /// The address it listens on (useful after binding port 0).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.tcp.local_addr()?)
    }

    /// Waits, however long, until a handshake finishes, and returns it: the
    /// connection, or why that peer failed. Peers that arrive meanwhile are
    /// handshaken concurrently with `opts` (a handshake keeps the options
    /// of the call during which its peer arrived); one that finishes while
    /// no call waits is kept for the next call.
    ///
    /// # Errors
    /// As [`Domain::connect`], for the peer whose handshake failed; the
    /// listener stays usable. [`Error::Io`] when accepting fails;
    /// [`Error::Interrupted`] once [`interrupt_handle`](Self::interrupt_handle)'s
    /// handle was used.
    pub fn accept(&self, opts: &ConnectOptions) -> Result<Connection> {
        self.accept_until(opts, None)
    }

    /// Like [`accept`](Self::accept), but gives up after `timeout` without
    /// a finished handshake.
    ///
    /// # Errors
    /// [`Error::Timeout`], or as [`Listener::accept`].
    pub fn accept_timeout(&self, opts: &ConnectOptions, timeout: Duration) -> Result<Connection> {
        self.accept_until(opts, Some((Instant::now() + timeout, timeout)))
    }

    /// A handle another thread uses to stop this listener's accepting
    /// ([`Interrupt::interrupt`]): a blocked accept returns
    /// [`Error::Interrupted`] at once.
    pub fn interrupt_handle(&self) -> Interrupt {
        Interrupt { handshakes: Arc::clone(&self.handshakes) }
    }

    fn accept_until(&self, opts: &ConnectOptions, deadline: Option<(Instant, Duration)>) -> Result<Connection> {
        loop {
            if self.handshakes.interrupted.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(Error::Interrupted { what: "accepting" });
            }
            if let Some(done) = self.handshakes.lock().finished.pop_front() {
                return done;
            }
            // Start a handshake for every peer waiting in the backlog.
            loop {
                match self.tcp.accept() {
                    Ok((stream, _)) => self.start(stream, opts)?,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    // A peer that reset before it was accepted is not this listener's failure.
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if let Some(done) = self.handshakes.lock().finished.pop_front() {
                return done;
            }
            let wait = match deadline {
                Some((at, after)) => {
                    let now = Instant::now();
                    if now >= at {
                        return Err(Error::Timeout { what: "a peer to connect", after });
                    }
                    at - now
                }
                None => Duration::from_secs(1),
            };
            self.wait(wait)?;
        }
    }

    /// Sleeps until a peer arrives, a handshake finishes, or `wait` passes.
    fn wait(&self, wait: Duration) -> Result<()> {
        use std::os::fd::AsFd;
        let wake = &self.handshakes.wake;
        let [_, woken] = crate::poll::readable([self.tcp.as_fd(), wake.as_fd()], wait.min(Duration::from_secs(1)))?;
        if woken {
            wake.drain();
        }
        Ok(())
    }

    /// Runs the handshake with `stream` on its own thread.
    fn start(&self, stream: TcpStream, opts: &ConnectOptions) -> Result<()> {
        stream.set_nonblocking(false)?;
        let cut = stream.try_clone()?;
        let id = {
            let mut st = self.handshakes.lock();
            while st.running.len() >= MAX_CONCURRENT_HANDSHAKES {
                if let Some((_, oldest)) = st.running.pop_front() {
                    tracing::warn!(
                        "{MAX_CONCURRENT_HANDSHAKES} handshakes running: cutting off the oldest ({:?})",
                        oldest.peer_addr().ok()
                    );
                    let _ = oldest.shutdown(std::net::Shutdown::Both);
                }
            }
            st.next_id += 1;
            let id = st.next_id;
            st.running.push_back((id, cut));
            id
        };
        let (domain, opts, shared) = (self.domain.clone(), opts.clone(), Arc::clone(&self.handshakes));
        let spawned = std::thread::Builder::new().name("gpu-rdma-handshake".into()).spawn(move || {
            let done = Connection::establish(&domain, stream, &opts, true);
            let mut st = shared.lock();
            st.running.retain(|(i, _)| *i != id);
            st.finished.push_back(done);
            drop(st);
            shared.wake.ring();
        });
        if let Err(e) = spawned {
            self.handshakes.lock().running.retain(|(i, _)| *i != id);
            return Err(e.into());
        }
        Ok(())
    }

    /// What a peer needs to connect here, as data to pass over a control
    /// plane of your own: this listener's address (as bound: put the
    /// machine's address into a wildcard with
    /// [`Endpoint::with_ip`](crate::Endpoint::with_ip)), the transport its
    /// domain offers and the NIC behind it.
    ///
    /// # Errors
    /// [`Error::Io`] when the socket's address cannot be read.
    pub fn endpoint(&self) -> Result<crate::Endpoint> {
        let info = self.domain.info();
        let verbs = info.transport == crate::Transport::Verbs;
        Ok(crate::Endpoint::new(
            self.local_addr()?,
            info.transport,
            if verbs { info.device } else { String::new() },
            if verbs { info.gid } else { String::new() },
        ))
    }

    /// The domain it accepts for.
    pub fn domain(&self) -> &Domain {
        &self.domain
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Cut off the handshakes still running: their threads end at once
        // and drop what they made.
        for (_, s) in self.handshakes.lock().running.drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.handshakes.lock();
        f.debug_struct("Listener")
            .field("local_addr", &self.tcp.local_addr().ok())
            .field("handshakes_running", &st.running.len())
            .field("handshakes_finished", &st.finished.len())
            .finish_non_exhaustive()
    }
}
