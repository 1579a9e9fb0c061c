//! Access rights of a memory registration (a leaf: used by the verbs layer,
//! errors, descriptors and memory alike).

bitflags::bitflags! {
    /// Access rights of a memory registration. Values match `IBV_ACCESS_*`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        /// The local device may write it (receives, read destinations).
        const LOCAL_WRITE = 1;
        /// Peers may write it.
        const REMOTE_WRITE = 2;
        /// Peers may read it.
        const REMOTE_READ = 4;
        /// Peers may run atomics on it.
        const REMOTE_ATOMIC = 8;
    }
}

impl Access {
    /// Local use only: the least privilege, and the default.
    pub const LOCAL: Access = Access::LOCAL_WRITE;

    /// The remote rights alone.
    pub fn remote(self) -> Access {
        self & (Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC)
    }
}

impl Default for Access {
    fn default() -> Self {
        Access::LOCAL
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_defaults_to_least_privilege() {
        assert_eq!(Access::default(), Access::LOCAL_WRITE);
        assert!(Access::default().remote().is_empty());
        assert_eq!((Access::LOCAL_WRITE | Access::REMOTE_READ).remote(), Access::REMOTE_READ);
    }
}
