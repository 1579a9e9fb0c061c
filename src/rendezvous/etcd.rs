//! The etcd store (feature `etcd`), through the `etcd-client` crate.
//!
//! Every key this process publishes lives under one lease, kept alive by a
//! task on the store's own runtime: when the process dies, hangs, or drops
//! the store, etcd deletes its keys once the lease's time to live has
//! passed, and every watcher sees them go. If etcd goes away for a while, the keep-alive retries; if the
//! lease expired meanwhile (or etcd came back without its data), a new
//! lease is granted and everything published is put back.
//!
//! The calls block; they run on the store's runtime (one worker thread),
//! so they may be made from any thread, inside a tokio runtime or not.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};

use super::{Change, Rendezvous, Watch, check_key};
use crate::error::{Error, Result};

/// Where the etcd store is and how it behaves.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// The servers, as `http://host:port` (or `host:port`).
    pub endpoints: Vec<String>,
    /// What every key is put under, so several jobs can share one etcd.
    pub namespace: String,
    /// The lease's time to live: how long after this process stops keeping
    /// it alive (it died, or hung) its keys disappear. At least a second.
    pub lease_ttl: Duration,
    /// How long connecting, and each request, may take.
    pub timeout: Duration,
}

impl EtcdOptions {
    /// The servers at `endpoints`, namespace `gpu-rdma/`, a 5-second lease,
    /// 5-second requests.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        EtcdOptions {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            namespace: "gpu-rdma/".into(),
            lease_ttl: Duration::from_secs(5),
            timeout: Duration::from_secs(5),
        }
    }

    /// Puts every key under `namespace` (a job's name, say `job-42/`).
    #[must_use]
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// Sets the lease's time to live (at least a second).
    #[must_use]
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// Sets how long connecting, and each request, may take.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// What the keep-alive task shares with the calls.
struct Lease {
    id: i64,
    /// Everything published, to put back under a new lease.
    published: BTreeMap<String, Vec<u8>>,
}

/// A [`Rendezvous`] in etcd: keys under a lease (see the module docs).
pub struct EtcdRendezvous {
    rt: Option<tokio::runtime::Runtime>,
    client: Client,
    opts: EtcdOptions,
    /// `etcd at <endpoints>`, for errors.
    store: String,
    lease: Arc<Mutex<Lease>>,
    keeper: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for EtcdRendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRendezvous").field("store", &self.store).field("namespace", &self.opts.namespace).finish()
    }
}

fn lock(lease: &Mutex<Lease>) -> std::sync::MutexGuard<'_, Lease> {
    lease.lock().unwrap_or_else(|e| e.into_inner())
}

/// Grants a lease and (re)puts `keys` under it.
async fn grant(
    client: &mut Client,
    ttl: i64,
    keys: &BTreeMap<String, Vec<u8>>,
) -> std::result::Result<i64, etcd_client::Error> {
    let id = client.lease_grant(ttl, None).await?.id();
    for (k, v) in keys {
        client.put(k.as_bytes(), v.clone(), Some(PutOptions::new().with_lease(id))).await?;
    }
    Ok(id)
}

/// Keeps the lease alive for as long as the store lives, granting a new
/// one (and putting everything back) when it was lost.
async fn keep_alive(mut client: Client, lease: Arc<Mutex<Lease>>, ttl: i64, store: String) {
    let period = Duration::from_millis((ttl as u64 * 1000 / 3).max(200));
    loop {
        let id = lock(&lease).id;
        let lost = match client.lease_keep_alive(id).await {
            Ok((mut keeper, mut stream)) => loop {
                if keeper.keep_alive().await.is_err() {
                    break false;
                }
                match stream.message().await {
                    Ok(Some(r)) if r.ttl() > 0 => tokio::time::sleep(period).await,
                    // A time to live of 0: the lease is gone.
                    Ok(Some(_)) => break true,
                    _ => break false,
                }
            },
            Err(_) => false,
        };
        if lost {
            let keys = lock(&lease).published.clone();
            match grant(&mut client, ttl, &keys).await {
                Ok(id) => {
                    tracing::warn!(
                        "{store}: the lease expired; granted a new one and published {} keys again",
                        keys.len()
                    );
                    lock(&lease).id = id;
                }
                Err(e) => tracing::warn!("{store}: granting a new lease: {e}"),
            }
        }
        // etcd unreachable, or the stream ended: try again shortly.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

impl EtcdRendezvous {
    /// Connects to etcd and takes a lease.
    ///
    /// # Errors
    /// [`Error::Rendezvous`] naming the endpoints when etcd cannot be
    /// reached within the timeout or refuses the lease.
    pub fn connect(opts: EtcdOptions) -> Result<Self> {
        let store = format!("etcd at {}", opts.endpoints.join(","));
        if opts.endpoints.is_empty() {
            return Err(Error::Rendezvous { store, reason: "no endpoint given".into() });
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("gpu-rdma-etcd")
            .enable_all()
            .build()?;
        let ttl = opts.lease_ttl.as_secs().max(1) as i64;
        let timeout = opts.timeout;
        let endpoints = opts.endpoints.clone();
        let started = run(&rt, timeout * 2, async move {
            let options = ConnectOptions::new().with_connect_timeout(timeout).with_timeout(timeout);
            let mut client = Client::connect(endpoints, Some(options)).await?;
            // Connecting may be lazy: the lease is the first real request.
            let id = grant(&mut client, ttl, &BTreeMap::new()).await?;
            Ok((client, id))
        });
        let (client, id) = started.map_err(|reason| Error::Rendezvous {
            store: store.clone(),
            reason: format!("cannot reach it: {reason}"),
        })?;
        let lease = Arc::new(Mutex::new(Lease { id, published: BTreeMap::new() }));
        let keeper = rt.spawn(keep_alive(client.clone(), Arc::clone(&lease), ttl, store.clone()));
        tracing::info!("{store}: lease {id:#x}, time to live {ttl} s");
        Ok(EtcdRendezvous { rt: Some(rt), client, opts, store, lease, keeper })
    }

    fn full(&self, key: &str) -> String {
        format!("{}{key}", self.opts.namespace)
    }

    /// Runs one request on the store's runtime, bounded by the timeout.
    fn call<T: Send + 'static>(
        &self,
        what: &str,
        f: impl Future<Output = std::result::Result<T, etcd_client::Error>> + Send + 'static,
    ) -> Result<T> {
        let rt = self.rt.as_ref().expect("the runtime lives as long as the store");
        run(rt, self.opts.timeout, f)
            .map_err(|reason| Error::Rendezvous { store: self.store.clone(), reason: format!("{what}: {reason}") })
    }
}

/// Runs `f` on `rt` and waits for it from this thread (any thread: no
/// `block_on`, which a thread inside a runtime may not call).
fn run<T: Send + 'static>(
    rt: &tokio::runtime::Runtime,
    timeout: Duration,
    f: impl Future<Output = std::result::Result<T, etcd_client::Error>> + Send + 'static,
) -> std::result::Result<T, String> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    rt.spawn(async move {
        let out = match tokio::time::timeout(timeout, f).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err(format!("no answer within {timeout:?}")),
        };
        let _ = tx.send(out);
    });
    rx.recv().unwrap_or_else(|_| Err("the store's runtime stopped".into()))
}

impl Rendezvous for EtcdRendezvous {
    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        let full = self.full(key);
        let id = {
            let mut l = lock(&self.lease);
            l.published.insert(full.clone(), value.to_vec());
            l.id
        };
        let mut c = self.client.clone();
        let v = value.to_vec();
        self.call("publishing", async move { c.put(full, v, Some(PutOptions::new().with_lease(id))).await.map(drop) })
    }

    fn lookup(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        check_key(key)?;
        let until = Instant::now() + timeout;
        loop {
            let mut c = self.client.clone();
            let full = self.full(key);
            let found = self.call("looking up", async move {
                Ok(c.get(full, None).await?.kvs().first().map(|kv| kv.value().to_vec()))
            })?;
            if let Some(v) = found {
                return Ok(v);
            }
            if Instant::now() >= until {
                return Err(Error::Timeout { what: "a rendezvous key to be published", after: timeout });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn remove(&self, key: &str) -> Result<()> {
        check_key(key)?;
        let full = self.full(key);
        lock(&self.lease).published.remove(&full);
        let mut c = self.client.clone();
        self.call("removing", async move { c.delete(full, None).await.map(drop) })
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>> {
        // A BTreeMap's order is key order.
        Ok(self.listing(prefix)?.0.into_iter().collect())
    }

    /// etcd's own watch: changes as they happen, from the revision of the
    /// listing it starts from, so a change made while the watch's stream
    /// is being set up is reported too. If etcd goes away (or compacted
    /// what the watch had yet to report) the prefix is listed again once
    /// it is back, what changed meanwhile is reported from that listing,
    /// and the watch goes on from the listing's revision.
    fn watch(self: Arc<Self>, prefix: &str) -> Result<Watch> {
        let (known, revision) = self.listing(prefix)?;
        Ok(self.follow(prefix, known, revision))
    }
}

impl EtcdRendezvous {
    /// The watch's half after the listing: the keys under `prefix` were
    /// `known` at `revision`; reports what changes after it. Apart from
    /// [`Rendezvous::watch`] so that a test can compact etcd's history
    /// between the listing and the watch's request, a moment nothing else
    /// can hit.
    fn follow(&self, prefix: &str, mut known: BTreeMap<String, Vec<u8>>, mut revision: i64) -> Watch {
        let (tx, stop, watch) = Watch::channel();
        let failing = Arc::clone(&watch.failing);
        let set_failing = move |why: Option<String>| *failing.lock().unwrap_or_else(|e| e.into_inner()) = why;
        let store = self.store.clone();
        let ns = self.opts.namespace.clone();
        let full = self.full(prefix);
        let mut client = self.client.clone();
        let rt = self.rt.as_ref().expect("the runtime lives as long as the store");
        rt.spawn(async move {
            let strip = |k: &[u8]| strip_namespace(&ns, k);
            while !stop.load(Ordering::Acquire) {
                // From the revision after the listing's (0: from now, when
                // etcd named none).
                let from = if revision > 0 { revision + 1 } else { 0 };
                let options = WatchOptions::new().with_prefix().with_start_revision(from);
                if let Ok((_watcher, mut stream)) = client.watch(full.clone(), Some(options)).await {
                    loop {
                        let next = tokio::time::timeout(Duration::from_millis(100), stream.message()).await;
                        if stop.load(Ordering::Acquire) {
                            return;
                        }
                        let resp = match next {
                            Err(_) => continue,
                            // Cancelled by etcd (it compacted past `from`).
                            Ok(Ok(Some(resp))) if resp.canceled() => break,
                            Ok(Ok(Some(resp))) => resp,
                            Ok(_) => break,
                        };
                        for ev in resp.events() {
                            let Some(kv) = ev.kv() else { continue };
                            revision = revision.max(kv.mod_revision());
                            let Some(key) = strip(kv.key()) else { continue };
                            let change = match ev.event_type() {
                                EventType::Put => {
                                    known.insert(key.clone(), kv.value().to_vec());
                                    Change::Put { key, value: kv.value().to_vec() }
                                }
                                EventType::Delete => {
                                    known.remove(&key);
                                    Change::Removed { key }
                                }
                            };
                            if tx.send(change).is_err() {
                                return;
                            }
                        }
                    }
                }
                // The watch is down: list again once etcd answers, report
                // what changed meanwhile, and watch on from that listing.
                loop {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    let listed = list_prefix(&mut client, full.clone(), &ns).await;
                    set_failing(
                        listed.as_ref().err().map(|e| format!("{store}: the watch is down and listing fails: {e}")),
                    );
                    if let Ok((now, at)) = listed {
                        for change in super::diff(&known, &now) {
                            if tx.send(change).is_err() {
                                return;
                            }
                        }
                        (known, revision) = (now, at);
                        break;
                    }
                }
            }
        });
        watch
    }

    /// Every key under `prefix` (without the namespace) and the revision
    /// the listing was taken at.
    fn listing(&self, prefix: &str) -> Result<(BTreeMap<String, Vec<u8>>, i64)> {
        let mut c = self.client.clone();
        let full = self.full(prefix);
        let ns = self.opts.namespace.clone();
        self.call("listing", async move { list_prefix(&mut c, full, &ns).await })
    }
}

/// A key without the store's namespace (`None`: not in it, or not UTF-8).
fn strip_namespace(ns: &str, key: &[u8]) -> Option<String> {
    std::str::from_utf8(key).ok()?.strip_prefix(ns).map(str::to_owned)
}

/// Every key under the full prefix `full` (without the namespace `ns`)
/// and the revision the listing was taken at (0 if etcd named none).
async fn list_prefix(
    client: &mut Client,
    full: String,
    ns: &str,
) -> std::result::Result<(BTreeMap<String, Vec<u8>>, i64), etcd_client::Error> {
    let r = client.get(full, Some(GetOptions::new().with_prefix())).await?;
    let kvs = r.kvs().iter().filter_map(|kv| strip_namespace(ns, kv.key()).map(|k| (k, kv.value().to_vec())));
    Ok((kvs.collect(), r.header().map_or(0, |h| h.revision())))
}

impl Drop for EtcdRendezvous {
    /// Stops keeping the lease alive. The lease is not revoked: what this
    /// process published stays for up to the lease's time to live, so peers
    /// still finishing (a last barrier) can read it; what must go at once is
    /// removed first (a [`World`](crate::World) removes its rank's key).
    fn drop(&mut self) {
        self.keeper.abort();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
#[allow(dead_code)] // the integration tests' server: restarting it is theirs
#[path = "../../tests/common/etcd.rs"]
mod etcd_server;

#[cfg(test)]
mod tests {
    use etcd_client::CompactionOptions;

    use super::etcd_server::EtcdServer;
    use super::*;

    /// etcd compacts its history past the listing's revision before the
    /// watch's request reaches it, after the prefix changed: etcd cancels
    /// the watch, whose changes are then gone from the history, and the
    /// watch must find them by listing again, then go on.
    #[test]
    fn a_watch_etcd_compacted_past_lists_again_reports_what_changed_and_goes_on() {
        let server = EtcdServer::start();
        let opts = EtcdOptions::new([server.endpoint()]).namespace("compacted/").timeout(Duration::from_secs(10));
        let store = EtcdRendezvous::connect(opts).unwrap();
        store.publish("p/gone", b"1").unwrap();
        store.publish("p/kept", b"old").unwrap();
        let (known, at) = store.listing("p/").unwrap();
        assert_eq!(known.len(), 2);
        // Three changes after the listing, then the history compacted up
        // to the last: a watch from `at + 1` can no longer be served.
        store.publish("p/new", b"2").unwrap();
        store.remove("p/gone").unwrap();
        store.publish("p/kept", b"changed").unwrap();
        let (_, now) = store.listing("p/").unwrap();
        assert!(now > at + 1, "the changes moved the revision from {at} to {now}");
        let mut c = store.client.clone();
        store
            .call("compacting", async move { c.compact(now, Some(CompactionOptions::new().with_physical())).await })
            .unwrap();
        let (mut c, full) = (store.client.clone(), store.full("p/"));
        let old = store.call("reading the compacted revision", async move {
            c.get(full, Some(GetOptions::new().with_prefix().with_revision(at + 1))).await
        });
        let why = old.expect_err("etcd still serves the revision after the listing's").to_string();
        assert!(why.contains("compacted"), "{why}");

        let watch = store.follow("p/", known, at);
        let mut got = Vec::new();
        while got.len() < 3 {
            match watch.next_timeout(Duration::from_secs(10)) {
                Some(change) => got.push(change),
                None => panic!("after 10 s the watch reported only {got:?}"),
            }
        }
        let key = |c: &Change| match c {
            Change::Put { key, .. } | Change::Removed { key } => key.clone(),
        };
        got.sort_by_key(key);
        assert_eq!(
            got,
            [
                Change::Removed { key: "p/gone".into() },
                Change::Put { key: "p/kept".into(), value: b"changed".to_vec() },
                Change::Put { key: "p/new".into(), value: b"2".to_vec() },
            ]
        );
        // It watches on from the new listing: what follows is reported,
        // once, and what it already reported is not again.
        store.publish("p/later", b"3").unwrap();
        assert_eq!(
            watch.next_timeout(Duration::from_secs(10)),
            Some(Change::Put { key: "p/later".into(), value: b"3".to_vec() })
        );
        assert_eq!(watch.next_timeout(Duration::from_millis(500)), None);
    }
}
