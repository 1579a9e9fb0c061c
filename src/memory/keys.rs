//! The key table: what a peer may touch through a transport that serves
//! memory in software (TCP), by key, with bounds, rights and revocation.
//! A verbs NIC keeps its own table (remote keys); this one mirrors it, under
//! the same keys where there are verbs keys, so that one descriptor works on
//! both transports.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, RwLock};

use crate::access::Access;
use crate::error::{Error, Result};

type Table = Arc<RwLock<HashMap<u32, Arc<KeyEntry>>>>;

/// One exposed region, as a software transport serves it.
#[derive(Debug)]
pub(crate) struct KeyEntry {
    addr: u64,
    len: u64,
    access: Access,
    /// `false` once revoked. Held for reading while a thread moves bytes
    /// to or from the region; revoking takes it for writing, so after
    /// revocation no thread touches the memory.
    pub(crate) alive: RwLock<bool>,
}

/// A domain's exposed regions, by key. Cloning shares the table.
#[derive(Clone, Default)]
pub(crate) struct KeyTable {
    table: Table,
}

/// A region served under a key; dropping it revokes the key and waits until
/// no transfer touches the region.
pub(crate) struct Served {
    table: Table,
    key: u32,
    entry: Arc<KeyEntry>,
}

impl KeyTable {
    /// Serves `len` bytes at `addr` to peers under `key` (a verbs remote
    /// key, so one descriptor works on both transports), or a fresh key
    /// drawn from the operating system's CSPRNG, so that no key predicts
    /// another (as a NIC's rkeys do not).
    ///
    /// # Errors
    /// [`Error::Io`] when the system's random source fails.
    ///
    /// # Safety
    /// The memory must stay valid until the returned handle is dropped.
    pub(crate) unsafe fn expose(&self, addr: u64, len: u64, access: Access, key: Option<u32>) -> Result<Served> {
        let entry = Arc::new(KeyEntry { addr, len, access, alive: RwLock::new(true) });
        let mut table = self.table.write().unwrap_or_else(|e| e.into_inner());
        let key = match key {
            Some(k) => k,
            None => loop {
                let k = random_key()?;
                if k != 0 && !table.contains_key(&k) {
                    break k;
                }
            },
        };
        table.insert(key, Arc::clone(&entry));
        Ok(Served { table: Arc::clone(&self.table), key, entry })
    }

    /// The region served under `key`, if any.
    pub(crate) fn lookup(&self, key: u32) -> Option<Arc<KeyEntry>> {
        self.table.read().unwrap_or_else(|e| e.into_inner()).get(&key).cloned()
    }
}

/// A key from the operating system's CSPRNG.
fn random_key() -> Result<u32> {
    let mut b = [0u8; 4];
    getrandom::fill(&mut b).map_err(|e| Error::Io(io::Error::other(format!("the system's random source: {e}"))))?;
    Ok(u32::from_ne_bytes(b))
}

impl Served {
    /// The key peers use.
    pub(crate) fn key(&self) -> u32 {
        self.key
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        {
            let mut table = self.table.write().unwrap_or_else(|e| e.into_inner());
            if table.get(&self.key).is_some_and(|e| Arc::ptr_eq(e, &self.entry)) {
                table.remove(&self.key);
            }
        }
        // Waits for any transfer in progress, then no thread starts another.
        *self.entry.alive.write().unwrap_or_else(|e| e.into_inner()) = false;
    }
}

impl KeyEntry {
    /// Whether `[addr, addr + len)` lies inside and `needed` is granted.
    pub(crate) fn admits(&self, addr: u64, len: u64, needed: Access) -> bool {
        self.access.contains(needed)
            && addr >= self.addr
            && addr.checked_add(len).is_some_and(|e| e <= self.addr + self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposures_check_bounds_and_rights_and_revoke() {
        let d = KeyTable::default();
        let mut mem = vec![0u8; 100];
        // SAFETY: `mem` outlives the exposure.
        let x = unsafe { d.expose(mem.as_mut_ptr() as u64, 100, Access::REMOTE_WRITE, None) }.unwrap();
        let e = d.lookup(x.key()).unwrap();
        let a = mem.as_ptr() as u64;
        assert!(e.admits(a, 100, Access::REMOTE_WRITE));
        assert!(!e.admits(a + 1, 100, Access::REMOTE_WRITE), "past the end");
        assert!(!e.admits(a - 1, 10, Access::REMOTE_WRITE), "before the start");
        assert!(!e.admits(a, 10, Access::REMOTE_READ), "no read right");
        assert!(!e.admits(u64::MAX - 5, 10, Access::REMOTE_WRITE), "wraps");
        let key = x.key();
        drop(x);
        assert!(d.lookup(key).is_none());
        assert!(!*e.alive.read().unwrap());
    }
}
