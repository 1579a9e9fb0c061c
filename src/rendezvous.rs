//! Rendezvous: how ranks find each other. A rank publishes what its peers
//! need (its [`Endpoint`](crate::Endpoint), region descriptors) under a
//! name, and looks the others' up, waiting until they are there.
//!
//! Built in, with no server: [`DirRendezvous`] (a directory of files, for
//! one machine or a shared file system) and [`MemRendezvous`] (in-process,
//! for tests). Anything else (a framework's own store) implements
//! [`Rendezvous`].

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

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

/// A directory of files: key `a/b` is the file `a%b` in it, written
/// whole (to a temporary name, then renamed), so a reader never sees half
/// a value.
#[derive(Clone, Debug)]
pub struct DirRendezvous {
    dir: PathBuf,
}

impl DirRendezvous {
    /// Uses `dir`, making it if needed.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be made.
    pub fn new(dir: impl AsRef<Path>) -> Result<Self> {
        std::fs::create_dir_all(dir.as_ref())?;
        Ok(DirRendezvous { dir: dir.as_ref().to_owned() })
    }

    fn path(&self, key: &str) -> Result<PathBuf> {
        check_key(key)?;
        Ok(self.dir.join(key.replace('/', "%")))
    }
}

impl Rendezvous for DirRendezvous {
    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        let path = self.path(key)?;
        let tmp = self.dir.join(format!(".{}.{}.tmp", key.replace('/', "%"), std::process::id()));
        std::fs::write(&tmp, value)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }

    fn lookup(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let path = self.path(key)?;
        let until = Instant::now() + timeout;
        loop {
            match std::fs::read(&path) {
                Ok(v) => return Ok(v),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
            if Instant::now() >= until {
                return Err(Error::Timeout { what: "a rendezvous key to be published", after: timeout });
            }
            std::thread::sleep(POLL);
        }
    }

    fn remove(&self, key: &str) -> Result<()> {
        match std::fs::remove_file(self.path(key)?) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
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
        Ok(())
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
