//! Host memory as registrable [`Memory`].

use super::{HostMemory, Memory};

// SAFETY: the mapping is owned by this value, unmapped only in Drop, and does
// not move when the value moves.
unsafe impl Memory for HostMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.raw()
    }

    fn len(&self) -> usize {
        self.mapped_len()
    }
}
