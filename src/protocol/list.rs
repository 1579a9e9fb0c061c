//! Transfer lists, planned with no I/O: the pieces a caller names (byte
//! ranges of one local buffer and one remote range), checked, with
//! adjacent pieces coalesced and long ones split, so that every planned
//! piece is one request on the wire. The engine that posts them is
//! [`Transfer`](crate::Transfer).

#![forbid(unsafe_code)]

use crate::error::{Error, Result};

/// One piece of a transfer list: `len` bytes at offset `local` of the local
/// buffer and at offset `remote` of the remote range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Piece {
    /// Offset into the local buffer (or slice).
    pub local: u64,
    /// Offset into the remote range.
    pub remote: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Piece {
    /// `len` bytes at `local` here and `remote` there.
    pub const fn new(local: u64, remote: u64, len: u64) -> Self {
        Piece { local, remote, len }
    }

    /// The pieces of a paged layout: page `local_pages[i]` here moves to
    /// page `remote_pages[i]` there (as KV-cache blocks in a paged pool
    /// do). Pages of one side are `layout.page_len` bytes every
    /// `layout.*_stride` bytes from `layout.*_base`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the two index lists differ in
    /// length or an offset overflows.
    pub fn pages(layout: &PageLayout, local_pages: &[u32], remote_pages: &[u32]) -> Result<Vec<Piece>> {
        if local_pages.len() != remote_pages.len() {
            return Err(Error::InvalidArgument(format!(
                "{} local pages and {} remote pages: a page list pairs them one to one",
                local_pages.len(),
                remote_pages.len()
            )));
        }
        local_pages
            .iter()
            .zip(remote_pages)
            .map(|(&l, &r)| {
                let at = |base: u64, stride: u64, page: u32| {
                    u64::from(page).checked_mul(stride).and_then(|o| o.checked_add(base))
                };
                match (at(layout.local_base, layout.local_stride, l), at(layout.remote_base, layout.remote_stride, r)) {
                    (Some(local), Some(remote)) => Ok(Piece { local, remote, len: layout.page_len }),
                    _ => Err(Error::InvalidArgument(format!("page {l} -> {r}: the offset overflows 64 bits"))),
                }
            })
            .collect()
    }

    fn local_end(&self) -> Option<u64> {
        self.local.checked_add(self.len)
    }

    fn remote_end(&self) -> Option<u64> {
        self.remote.checked_add(self.len)
    }
}

/// Where the pages of a paged layout are, on each side: page `i` of a side
/// is `page_len` bytes at `base + i * stride`. The strides may differ (one
/// side's pool may interleave layers, or K and V, differently).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageLayout {
    /// Bytes moved per page.
    pub page_len: u64,
    /// Offset of local page 0.
    pub local_base: u64,
    /// Bytes from one local page to the next.
    pub local_stride: u64,
    /// Offset of remote page 0.
    pub remote_base: u64,
    /// Bytes from one remote page to the next.
    pub remote_stride: u64,
}

impl PageLayout {
    /// Pages of `page_len` bytes packed back to back on both sides.
    pub const fn packed(page_len: u64) -> Self {
        PageLayout { page_len, local_base: 0, local_stride: page_len, remote_base: 0, remote_stride: page_len }
    }
}

/// A checked plan: every piece within both ranges, zero-length pieces
/// dropped, and each run of pieces contiguous on both sides merged. Long
/// pieces are split into requests of at most `max_piece` bytes only as
/// they are posted ([`next`](Self::next)), so a plan holds no more than
/// the pieces the caller passed, whatever `max_piece` (a peer's limit) is.
#[derive(Debug, Default)]
pub(crate) struct ListPlan {
    merged: Vec<Piece>,
    max_piece: u64,
    pub bytes: u64,
}

/// Where posting a [`ListPlan`] is: the merged piece and the offset in it,
/// and how many requests were taken.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Cursor {
    at: usize,
    off: u64,
    pub taken: usize,
}

impl ListPlan {
    /// The requests the plan splits into.
    pub fn requests(&self) -> usize {
        let n: u64 = self.merged.iter().map(|p| p.len.div_ceil(self.max_piece)).fold(0, u64::saturating_add);
        usize::try_from(n).unwrap_or(usize::MAX)
    }

    /// The request after `c` (at most `max_piece` bytes), moving `c` past it.
    pub fn next(&self, c: &mut Cursor) -> Option<Piece> {
        let p = self.merged.get(c.at)?;
        let len = (p.len - c.off).min(self.max_piece);
        let piece = Piece { local: p.local + c.off, remote: p.remote + c.off, len };
        c.off += len;
        if c.off == p.len {
            c.at += 1;
            c.off = 0;
        }
        c.taken += 1;
        Some(piece)
    }

    /// Whether every request was taken.
    pub fn done(&self, c: &Cursor) -> bool {
        c.at >= self.merged.len()
    }

    /// The ranges of the remote range the plan moves: (offset, length).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn remote_ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.merged.iter().map(|p| (p.remote, p.len))
    }
}

/// Plans `pieces` over a local buffer of `local_len` bytes and a remote
/// range of `remote_len`, each request at most `max_piece` bytes.
///
/// # Errors
/// [`Error::OutOfBounds`] naming the first piece outside a range, and the
/// side it leaves (nothing is planned: a list is checked whole before
/// anything is posted).
pub(crate) fn plan(
    pieces: impl IntoIterator<Item = Piece>,
    local_len: u64,
    remote_len: u64,
    max_piece: u64,
) -> Result<ListPlan> {
    let mut merged: Vec<Piece> = Vec::new();
    let mut bytes = 0u64;
    for p in pieces {
        if p.local_end().is_none_or(|end| end > local_len) {
            return Err(Error::OutOfBounds { side: "local", offset: p.local, len: p.len, region_len: local_len });
        }
        if p.remote_end().is_none_or(|end| end > remote_len) {
            return Err(Error::OutOfBounds { side: "remote", offset: p.remote, len: p.len, region_len: remote_len });
        }
        if p.len == 0 {
            continue;
        }
        bytes += p.len;
        match merged.last_mut() {
            Some(last) if last.local_end() == Some(p.local) && last.remote_end() == Some(p.remote) => {
                last.len += p.len;
            }
            _ => merged.push(p),
        }
    }
    Ok(ListPlan { merged, max_piece: max_piece.max(1), bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    impl ListPlan {
        /// Every request, in order.
        fn all(&self) -> Vec<Piece> {
            let mut c = Cursor::default();
            let out: Vec<Piece> = std::iter::from_fn(|| self.next(&mut c)).collect();
            assert!(self.done(&c));
            assert_eq!((out.len(), c.taken), (self.requests(), self.requests()));
            out
        }
    }

    #[test]
    fn adjacent_pieces_merge_and_long_ones_split() {
        let pieces = [Piece::new(0, 100, 10), Piece::new(10, 110, 10), Piece::new(20, 200, 5), Piece::new(40, 0, 25)];
        let p = plan(pieces, 100, 300, 16).unwrap();
        assert_eq!(p.bytes, 50);
        assert_eq!(
            p.all(),
            vec![
                Piece::new(0, 100, 16),
                Piece::new(16, 116, 4),
                Piece::new(20, 200, 5),
                Piece::new(40, 0, 16),
                Piece::new(56, 16, 9),
            ]
        );
    }

    #[test]
    fn only_runs_contiguous_on_both_sides_merge() {
        // Contiguous here but not there, and the reverse.
        let p = plan([Piece::new(0, 0, 4), Piece::new(4, 8, 4), Piece::new(12, 12, 4)], 64, 64, 1024).unwrap();
        assert_eq!(p.all().len(), 3);
    }

    #[test]
    fn zero_length_pieces_vanish_and_an_empty_list_plans_nothing() {
        let p = plan([Piece::new(5, 5, 0)], 4, 4, 8);
        assert!(matches!(p, Err(Error::OutOfBounds { .. })), "even empty, a piece must lie in range");
        let p = plan([Piece::new(4, 4, 0), Piece::new(0, 0, 0)], 4, 4, 8).unwrap();
        assert!(p.all().is_empty());
        assert_eq!(p.bytes, 0);
        assert!(plan([], 0, 0, 8).unwrap().all().is_empty());
    }

    #[test]
    fn a_piece_out_of_either_range_is_refused_whole() {
        let e = plan([Piece::new(0, 0, 8), Piece::new(60, 0, 8)], 64, 64, 8).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { side: "local", offset: 60, len: 8, region_len: 64 }), "{e:?}");
        let e = plan([Piece::new(0, 60, 8)], 64, 64, 8).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { side: "remote", offset: 60, .. }), "{e:?}");
        let e = plan([Piece::new(u64::MAX, 0, 2)], 64, 64, 8).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { side: "local", offset: u64::MAX, .. }), "overflow: {e:?}");
        // A remote offset that overflows names the remote side and its real range.
        let e = plan([Piece::new(0, u64::MAX - 1, 2)], 64, u64::MAX, 8).unwrap_err();
        assert!(
            matches!(e, Error::OutOfBounds { side: "remote", offset, len: 2, region_len: u64::MAX } if offset == u64::MAX - 1),
            "overflow at the end: {e:?}"
        );
    }

    #[test]
    fn pages_follow_the_layout_on_each_side() {
        let layout = PageLayout { page_len: 16, local_base: 8, local_stride: 64, remote_base: 0, remote_stride: 16 };
        let p = Piece::pages(&layout, &[0, 3], &[5, 6]).unwrap();
        assert_eq!(p, vec![Piece::new(8, 80, 16), Piece::new(8 + 192, 96, 16)]);
        assert!(Piece::pages(&layout, &[0], &[]).is_err());
        let huge = PageLayout { local_stride: u64::MAX, ..layout };
        assert!(Piece::pages(&huge, &[2], &[0]).is_err());
        // Packed pages in order coalesce into one piece.
        let packed = Piece::pages(&PageLayout::packed(4096), &[0, 1, 2, 3], &[7, 8, 9, 10]).unwrap();
        let planned = plan(packed, 1 << 20, 1 << 20, 1 << 20).unwrap();
        assert_eq!(planned.all(), vec![Piece::new(0, 7 * 4096, 4 * 4096)]);
    }

    #[test]
    fn a_plan_holds_the_callers_pieces_whatever_the_largest_request() {
        // 8 MiB in one piece, split a byte at a time: eight million
        // requests, planned in one piece's memory.
        let p = plan([Piece::new(0, 0, 8 << 20)], 8 << 20, 8 << 20, 1).unwrap();
        assert_eq!(p.merged.len(), 1);
        assert_eq!(p.requests(), 8 << 20);
        let mut c = Cursor::default();
        assert_eq!(p.next(&mut c), Some(Piece::new(0, 0, 1)));
        assert_eq!(p.next(&mut c), Some(Piece::new(1, 1, 1)));
        assert_eq!(c.taken, 2);
        // A cursor copied and dropped takes nothing (a post refused).
        let mut tried = c;
        p.next(&mut tried);
        assert_eq!(p.next(&mut c), Some(Piece::new(2, 2, 1)));
        assert!(plan([Piece::new(0, 0, u64::MAX)], u64::MAX, u64::MAX, 1).unwrap().requests() > 0);
    }
}
