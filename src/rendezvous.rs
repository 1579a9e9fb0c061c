//! Rendezvous: how ranks find each other. A rank publishes what its peers
//! need (its [`Endpoint`](crate::Endpoint), region descriptors) under a
//! name, and looks the others' up, waiting until they are there.
//!
//! Built in, with no server: [`DirRendezvous`] (a directory of files, for
//! one machine or a shared file system) and [`MemRendezvous`] (in-process,
//! for tests). With the `etcd` feature, `EtcdRendezvous` keeps the keys
//! in etcd under a lease, so a rank that dies disappears from the store.
//! Anything else (a framework's own store) implements [`Rendezvous`].

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "etcd")]
pub use etcd::{EtcdOptions, EtcdRendezvous};

/// A change under a watched prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// `key` was published (or republished) with `value`.
    Put {
        /// The key.
        key: String,
        /// Its new value.
        value: Vec<u8>,
    },
    /// `key` is gone: removed, or (etcd) its owner's lease expired.
    Removed {
        /// The key.
        key: String,
    },
}

/// The changes under a prefix, as they happen ([`Rendezvous::watch`]).
/// Dropping it stops the watch.
#[derive(Debug)]
pub struct Watch {
    rx: mpsc::Receiver<Change>,
    stop: Arc<AtomicBool>,
    /// Why the feeder cannot see changes now, while it cannot.
    failing: Arc<Mutex<Option<String>>>,
}

impl Watch {
    /// A watch fed through the returned sender; `stop` turns true when it
    /// is dropped (the feeder then ends).
    pub fn channel() -> (mpsc::Sender<Change>, Arc<AtomicBool>, Watch) {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        (tx, Arc::clone(&stop), Watch { rx, stop, failing: Arc::new(Mutex::new(None)) })
    }

    /// Why this watch cannot see changes right now (its store cannot be
    /// listed), or `None` while it can. Changes made meanwhile are
    /// reported once the store can be listed again.
    pub fn failing(&self) -> Option<String> {
        self.failing.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The next change, waiting up to `timeout`; `None` if there was none
    /// (or the store's watch ended).
    pub fn next_timeout(&self, timeout: Duration) -> Option<Change> {
        self.rx.recv_timeout(timeout).ok()
    }

    /// The next change if there is one now.
    pub fn try_next(&self) -> Option<Change> {
        self.rx.try_recv().ok()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// How often a store without watches of its own is listed to find changes.
pub const WATCH_POLL: Duration = Duration::from_millis(100);

/// The changes between two listings.
fn diff(old: &BTreeMap<String, Vec<u8>>, new: &BTreeMap<String, Vec<u8>>) -> Vec<Change> {
    let mut out: Vec<Change> = new
        .iter()
        .filter(|(k, v)| old.get(*k) != Some(*v))
        .map(|(k, v)| Change::Put { key: k.clone(), value: v.clone() })
        .collect();
    out.extend(old.keys().filter(|k| !new.contains_key(*k)).map(|k| Change::Removed { key: k.clone() }));
    out
}

/// A watch for a store with none of its own: lists the prefix every
/// [`WATCH_POLL`] on a thread and reports the differences.
pub fn poll_watch<R: Rendezvous + ?Sized + 'static>(store: Arc<R>, prefix: &str) -> Result<Watch> {
    let mut seen: BTreeMap<String, Vec<u8>> = store.list(prefix)?.into_iter().collect();
    let (tx, stop, watch) = Watch::channel();
    let failing = Arc::clone(&watch.failing);
    let prefix = prefix.to_owned();
    std::thread::Builder::new().name("gpu-rdma-watch".into()).spawn(move || {
        while !stop.load(Ordering::Acquire) {
            std::thread::sleep(WATCH_POLL);
            let listed = store.list(&prefix);
            // Said, not swallowed: the watcher sees it (`Watch::failing`).
            *failing.lock().unwrap_or_else(|e| e.into_inner()) = listed.as_ref().err().map(ToString::to_string);
            let Ok(now) = listed else { continue };
            let now: BTreeMap<String, Vec<u8>> = now.into_iter().collect();
            for change in diff(&seen, &now) {
                if tx.send(change).is_err() {
                    return;
                }
            }
            seen = now;
        }
    })?;
    Ok(watch)
}

/// A store where ranks publish and look each other up.
pub trait Rendezvous: Send + Sync {
    /// Publishes `value` under `key`, replacing what was there.
    ///
    /// # Errors
    /// As the store fails; [`Error::InvalidArgument`] for a bad key.
    fn publish(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value under `key`, waiting up to `timeout` for it to appear.
    ///
    /// # Errors
    /// [`Error::Timeout`] naming the key when it did not appear in time.
    fn lookup(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;

    /// Removes `key` (nothing if it is not there).
    ///
    /// # Errors
    /// As the store fails.
    fn remove(&self, key: &str) -> Result<()>;

    /// Every key that starts with `prefix` (`""` for all), with its value,
    /// in key order.
    ///
    /// # Errors
    /// As the store fails.
    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>>;

    /// The changes under `prefix` from now on. By default the prefix is
    /// listed every [`WATCH_POLL`]; a store with watches of its own (etcd)
    /// reports them as they happen.
    ///
    /// # Errors
    /// As the store fails.
    fn watch(self: Arc<Self>, prefix: &str) -> Result<Watch>
    where
        Self: 'static,
    {
        poll_watch(self, prefix)
    }
}

/// Keys are names with letters, digits, `.`, `_`, `-` and `/` (for
/// levels), not starting with `.` or `/`, at most 200 bytes.
fn check_key(key: &str) -> Result<()> {
    let ok = !key.is_empty()
        && key.len() <= 200
        && !key.starts_with(['.', '/'])
        && !key.contains("..")
        && key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "rendezvous key {key:?}: letters, digits, '.', '_', '-' and '/' only, not starting with '.' or '/'"
        )))
    }
}

/// The time a lookup sleeps between looks at a directory.
const POLL: Duration = Duration::from_millis(10);

/// The largest value a [`DirRendezvous`] publishes or reads (an endpoint
/// or a descriptor takes a few hundred bytes).
pub const MAX_VALUE: usize = 1 << 20;

/// The most bytes of values one [`DirRendezvous`] listing holds: past
/// that, the listing fails rather than grow.
pub const MAX_LISTING: usize = 64 << 20;

/// What reading one entry of the directory found.
enum Found {
    Value(Vec<u8>),
    /// Nothing under that name (or it went while being read).
    Absent,
    /// Something that is not a value: not a regular file, unreadable, too large.
    Skipped(String),
}

/// A directory of files: key `a/b` is the file `a%b` in it, written
/// whole (to a temporary name, then renamed), so a reader never sees half
/// a value.
///
/// It trusts nothing it finds there: an entry is read only if it is a
/// regular file (never through a symbolic link, never blocking on a FIFO
/// or a device) of at most [`MAX_VALUE`] bytes; anything else is skipped
/// and counted ([`skipped`](Self::skipped)), so one stray entry neither
/// blocks nor fails a lookup or a listing of the others. A listing holds
/// at most [`MAX_LISTING`] bytes of values. Every call returns within its
/// timeout.
#[derive(Clone, Debug)]
pub struct DirRendezvous {
    dir: PathBuf,
    skipped: Arc<AtomicU64>,
}

impl DirRendezvous {
    /// Uses `dir`, making it if needed.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be made.
    pub fn new(dir: impl AsRef<Path>) -> Result<Self> {
        std::fs::create_dir_all(dir.as_ref())?;
        Ok(DirRendezvous { dir: dir.as_ref().to_owned(), skipped: Arc::new(AtomicU64::new(0)) })
    }

    /// Entries passed over so far because they were not values: not a
    /// regular file (a directory, a symbolic link, a FIFO, a device),
    /// unreadable, or larger than [`MAX_VALUE`].
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }

    fn path(&self, key: &str) -> Result<PathBuf> {
        check_key(key)?;
        Ok(self.dir.join(key.replace('/', "%")))
    }

    fn store(&self) -> String {
        format!("directory {}", self.dir.display())
    }

    /// Reads the entry at `path` without following a link, without
    /// blocking, and no more than [`MAX_VALUE`] bytes of it.
    fn read_entry(&self, path: &Path) -> Result<Found> {
        use std::io::Read;
        use std::os::unix::fs::OpenOptionsExt;
        let found = match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::Absent),
            Err(e) => Found::Skipped(format!("cannot be examined: {e}")),
            Ok(m) if !m.file_type().is_file() => Found::Skipped(format!("{}, not a regular file", kind_of(&m))),
            Ok(_) => {
                // Opened without following a link or waiting (a FIFO put
                // there since it was examined), then examined again.
                let opened =
                    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path);
                match opened.and_then(|f| f.metadata().map(|m| (f, m))) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::Absent),
                    Err(e) => Found::Skipped(format!("cannot be read: {e}")),
                    Ok((_, m)) if !m.file_type().is_file() => {
                        Found::Skipped(format!("{}, not a regular file", kind_of(&m)))
                    }
                    Ok((_, m)) if m.len() > MAX_VALUE as u64 => {
                        Found::Skipped(format!("{} bytes, over the {MAX_VALUE}-byte limit", m.len()))
                    }
                    Ok((f, _)) => {
                        let mut v = Vec::new();
                        match f.take(MAX_VALUE as u64 + 1).read_to_end(&mut v) {
                            Ok(n) if n > MAX_VALUE => Found::Skipped(format!("over the {MAX_VALUE}-byte limit")),
                            Ok(_) => Found::Value(v),
                            Err(e) => Found::Skipped(format!("cannot be read: {e}")),
                        }
                    }
                }
            }
        };
        if let Found::Skipped(why) = &found {
            let n = self.skipped.fetch_add(1, Ordering::Relaxed);
            // Loud the first few times; a polling watch would repeat it.
            if n < 16 {
                tracing::warn!("rendezvous {}: {} skipped: {why}", self.store(), path.display());
            } else {
                tracing::debug!("rendezvous {}: {} skipped: {why}", self.store(), path.display());
            }
        }
        Ok(found)
    }
}

/// What a file type is, in words.
fn kind_of(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "not a file"
    }
}

impl Rendezvous for DirRendezvous {
    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        use std::io::Write;
        let path = self.path(key)?;
        if value.len() > MAX_VALUE {
            return Err(Error::InvalidArgument(format!(
                "a rendezvous value of {} bytes, at most {MAX_VALUE}",
                value.len()
            )));
        }
        // A fresh name, created here (never an entry someone put there, nor
        // through a link), then renamed over the key.
        let mut attempt = 0u32;
        let (tmp, mut file) = loop {
            let tmp = self.dir.join(format!(".{}.{}.{attempt}.tmp", key.replace('/', "%"), std::process::id()));
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp) {
                Ok(f) => break (tmp, f),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 64 => attempt += 1,
                Err(e) => return Err(e.into()),
            }
        };
        let written = file.write_all(value).and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
        Ok(())
    }

    fn lookup(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let path = self.path(key)?;
        let until = Instant::now() + timeout;
        loop {
            let last_skip = match self.read_entry(&path)? {
                Found::Value(v) => return Ok(v),
                Found::Absent => None,
                // Not a value: a publish may yet replace it (a rename over it).
                Found::Skipped(why) => Some(why),
            };
            let now = Instant::now();
            if now >= until {
                return Err(match last_skip {
                    Some(why) => Error::Rendezvous {
                        store: self.store(),
                        reason: format!("the entry for {key} is {why}; no value was published there in {timeout:?}"),
                    },
                    None => Error::Timeout { what: "a rendezvous key to be published", after: timeout },
                });
            }
            std::thread::sleep(POLL.min(until - now));
        }
    }

    fn remove(&self, key: &str) -> Result<()> {
        match std::fs::remove_file(self.path(key)?) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let mut out = Vec::new();
        let mut held = 0usize;
        for entry in std::fs::read_dir(&self.dir)? {
            let Ok(entry) = entry else {
                self.skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let Some(name) = entry.file_name().to_str().map(|n| n.replace('%', "/")) else { continue };
            if name.starts_with('.') || !name.starts_with(prefix) || check_key(&name).is_err() {
                continue;
            }
            if let Found::Value(v) = self.read_entry(&entry.path())? {
                held += v.len();
                if held > MAX_LISTING {
                    return Err(Error::Rendezvous {
                        store: self.store(),
                        reason: format!("the values under {prefix:?} hold more than {MAX_LISTING} bytes"),
                    });
                }
                out.push((name, v));
            }
        }
        out.sort();
        Ok(out)
    }
}

/// An in-process store (threads of one process, and tests).
#[derive(Debug, Default)]
pub struct MemRendezvous {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl Rendezvous for MemRendezvous {
    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        self.map.lock().unwrap_or_else(|e| e.into_inner()).insert(key.to_owned(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn lookup(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        check_key(key)?;
        let until = Instant::now() + timeout;
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(v) = map.get(key) {
                return Ok(v.clone());
            }
            let now = Instant::now();
            if now >= until {
                return Err(Error::Timeout { what: "a rendezvous key to be published", after: timeout });
            }
            map = self.changed.wait_timeout(map, until - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn remove(&self, key: &str) -> Result<()> {
        check_key(key)?;
        self.map.lock().unwrap_or_else(|e| e.into_inner()).remove(key);
        self.changed.notify_all();
        Ok(())
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<_> =
            map.iter().filter(|(k, _)| k.starts_with(prefix)).map(|(k, v)| (k.clone(), v.clone())).collect();
        out.sort();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exercise(r: &dyn Rendezvous) {
        assert!(matches!(r.lookup("rank/1", Duration::from_millis(30)), Err(Error::Timeout { .. })));
        r.publish("rank/1", b"one").unwrap();
        assert_eq!(r.lookup("rank/1", Duration::ZERO).unwrap(), b"one");
        r.publish("rank/1", b"uno").unwrap();
        assert_eq!(r.lookup("rank/1", Duration::ZERO).unwrap(), b"uno", "replaced");
        r.remove("rank/1").unwrap();
        r.remove("rank/1").unwrap();
        assert!(r.lookup("rank/1", Duration::from_millis(10)).is_err());
        for bad in ["", "../x", "/abs", ".hidden", "a b", "a\\b", &"k".repeat(201)] {
            assert!(matches!(r.publish(bad, b"x"), Err(Error::InvalidArgument(_))), "{bad:?}");
        }
    }

    #[test]
    fn both_stores_publish_replace_look_up_and_remove() {
        exercise(&MemRendezvous::default());
        let dir = std::env::temp_dir().join(format!("gpu-rdma-rv-{}", std::process::id()));
        exercise(&DirRendezvous::new(&dir).unwrap());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn both_stores_list_by_prefix_and_watch_changes() {
        let dir = std::env::temp_dir().join(format!("gpu-rdma-rv-watch-{}", std::process::id()));
        let stores: Vec<Arc<dyn Rendezvous>> =
            vec![Arc::new(MemRendezvous::default()), Arc::new(DirRendezvous::new(&dir).unwrap())];
        for r in stores {
            r.publish("job/rank/0", b"a").unwrap();
            r.publish("job/rank/1", b"b").unwrap();
            r.publish("other/x", b"c").unwrap();
            let listed = r.list("job/").unwrap();
            assert_eq!(listed, vec![("job/rank/0".into(), b"a".to_vec()), ("job/rank/1".into(), b"b".to_vec())]);
            let w = Arc::clone(&r).watch("job/").unwrap();
            r.publish("job/rank/2", b"new").unwrap();
            r.remove("job/rank/0").unwrap();
            r.publish("other/y", b"not watched").unwrap();
            let mut got = Vec::new();
            let until = Instant::now() + Duration::from_secs(5);
            while got.len() < 2 && Instant::now() < until {
                got.extend(w.next_timeout(Duration::from_millis(50)));
            }
            got.sort_by_key(|c| format!("{c:?}"));
            assert_eq!(
                got,
                vec![
                    Change::Put { key: "job/rank/2".into(), value: b"new".to_vec() },
                    Change::Removed { key: "job/rank/0".into() }
                ]
            );
            assert!(w.next_timeout(Duration::from_millis(250)).is_none(), "nothing else changed under the prefix");
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_lookup_waits_for_a_value_published_later() {
        let r = std::sync::Arc::new(MemRendezvous::default());
        let w = std::sync::Arc::clone(&r);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            w.publish("late", b"here").unwrap();
        });
        assert_eq!(r.lookup("late", Duration::from_secs(10)).unwrap(), b"here");
        t.join().unwrap();
    }
}
