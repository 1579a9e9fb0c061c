//! How far a ratio of two tools' figures can be trusted, from a handful of
//! interleaved rounds: the Hodges-Lehmann estimate of the ratio from the
//! rounds' paired log-ratios and its distribution-free (Wilcoxon
//! signed-rank) interval.
//!
//! Why: in the soft-RoCE guest, the emulated machine's speed wanders with
//! the host's own CPU (see [`crate::steady`]), and every tool with it:
//! latency flips between a fast mode and a slow one every few tens of
//! milliseconds (at 2 B, a typical one-way time of about 14 us or 25-34
//! us), and a bandwidth round of every tool can run a third
//! above or below the round before. The median of five rounds then swings
//! by a third, and a ratio of two such medians says "met" or "MISSED" by
//! chance. Each round runs the tools back to back, so the ratio within a
//! round cancels what the round's stretch of weather did to both: over
//! five kept runs of `cargo xtask compare` (35 rounds), the spread across
//! rounds of the log-ratio of bandwidths and typical latencies was smaller
//! paired than unpaired for 39 of 45 figures (median standard deviation
//! 0.13 against 0.19); for minimum latencies, a fast moment within a run,
//! pairing did not help (8 of 20). The interval says which verdicts the
//! rounds settle and which they cannot.

/// The median, or `None` for no values.
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    median_of_sorted(&v)
}

/// The median of values already in order.
fn median_of_sorted(v: &[f64]) -> Option<f64> {
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// A ratio `ours / theirs` with a range that holds it at `confidence`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RatioRange {
    /// The Hodges-Lehmann estimate: the median of the Walsh averages of
    /// the rounds' log-ratios.
    pub estimate: f64,
    pub lo: f64,
    pub hi: f64,
    /// How often such a range holds the true ratio (0.9375 for 5 rounds,
    /// 0.952 for 15), if the rounds' log-ratios are independent and
    /// symmetric about it.
    pub confidence: f64,
}

/// The number of subsets of the ranks `1..=n` whose sum is `w`, for `w` in
/// `0..=n(n+1)/2`: under no difference, each sign pattern of `n` paired
/// differences is equally likely, and `w` is the Wilcoxon signed-rank
/// statistic (the sum of the positive differences' ranks).
fn signed_rank_counts(n: usize) -> Vec<f64> {
    let mut counts = vec![1.0];
    for rank in 1..=n {
        let mut next = vec![0.0; counts.len() + rank];
        for (w, c) in counts.iter().enumerate() {
            // Rank `rank`'s difference negative (adds nothing) or positive.
            next[w] += c;
            next[w + rank] += c;
        }
        counts = next;
    }
    counts
}

/// The ratio of `ours` to `theirs` round by round, and the distribution-free
/// range that holds it with about 95% confidence (the widest level `n`
/// rounds allow when they allow less: 93.75% for 5). Round `i` of each tool
/// ran back to back in the same stretch of the machine's weather, so the
/// ratio of the two is free of what slowed or sped up that stretch for
/// both; a round where either has no figure is left out. `None` without a
/// round that has both.
pub fn paired_range(ours: &[Option<f64>], theirs: &[Option<f64>]) -> Option<RatioRange> {
    let logs: Vec<f64> = ours
        .iter()
        .zip(theirs)
        .filter_map(|(o, t)| match (o, t) {
            (Some(o), Some(t)) if o.is_finite() && t.is_finite() && *o > 0.0 && *t > 0.0 => Some(o.ln() - t.ln()),
            _ => None,
        })
        .collect();
    let n = logs.len();
    if n == 0 {
        return None;
    }
    let mut walsh: Vec<f64> =
        logs.iter().enumerate().flat_map(|(i, a)| logs[i..].iter().map(move |b| (a + b) / 2.0)).collect();
    walsh.sort_by(f64::total_cmp);
    let estimate = median_of_sorted(&walsh)?.exp();
    let (k, confidence) = paired_rank(n);
    Some(RatioRange { estimate, lo: walsh[k - 1].exp(), hi: walsh[walsh.len() - k].exp(), confidence })
}

/// For `n` paired rounds: which Walsh average, counted from either end,
/// bounds the range (the k-th smallest and k-th largest), and the
/// confidence of that range, 1 - 2 P(W < k): the largest k that keeps it
/// at or above 95%, and k = 1 where even the widest range falls short.
pub fn paired_rank(n: usize) -> (usize, f64) {
    let counts = signed_rank_counts(n);
    let total: f64 = counts.iter().sum();
    let mut k = 1;
    let mut below = counts[0];
    while k < counts.len() && 1.0 - 2.0 * (below + counts[k]) / total >= 0.95 {
        below += counts[k];
        k += 1;
    }
    (k, 1.0 - 2.0 * below / total)
}

/// A goal's verdict: the point figure decides met or missed, as the goal
/// is written; the range says whether the rounds settle it.
pub fn verdict(ratio: Option<f64>, range: Option<RatioRange>, meets: impl Fn(f64) -> bool) -> &'static str {
    match (ratio, range) {
        (None, _) => "MISSED (no figure)",
        (Some(r), Some(g)) if meets(g.lo) != meets(g.hi) => {
            if meets(r) {
                "met (noisy: range crosses the goal)"
            } else {
                "MISSED (noisy: range crosses the goal)"
            }
        }
        (Some(r), _) => {
            if meets(r) {
                "met"
            } else {
                "MISSED"
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_rank_counts_match_the_tables() {
        // Every sign pattern once: 2^n in all, symmetric about n(n+1)/4.
        for n in [1, 2, 5, 9, 15] {
            let c = signed_rank_counts(n);
            assert_eq!(c.len(), n * (n + 1) / 2 + 1);
            assert_eq!(c.iter().sum::<f64>(), 2f64.powi(n as i32), "{n}");
            assert!(c.iter().zip(c.iter().rev()).all(|(a, b)| a == b), "{n} symmetric");
        }
        // 3 ranks: the sums 0..=6 of the subsets of {1, 2, 3}.
        assert_eq!(signed_rank_counts(3), [1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0]);
        // 5 ranks: W = 0, 1, 2, 3 in 1, 1, 1, 2 of 32 patterns.
        assert_eq!(signed_rank_counts(5)[..4], [1.0, 1.0, 1.0, 2.0]);
        // The tables' critical value for 15 pairs at 5% two-sided is 25.
        assert_eq!(paired_rank(15).0, 26);
        assert!((paired_rank(15).1 - 0.95209).abs() < 1e-4, "{:?}", paired_rank(15));
    }

    #[test]
    fn the_range_holds_the_paired_ratio_at_the_stated_confidence() {
        let some = |v: &[f64]| v.iter().map(|x| Some(*x)).collect::<Vec<_>>();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let r = paired_range(&some(&[2.0; 5]), &some(&[1.0; 5])).unwrap();
        assert_eq!((r.estimate, r.lo, r.hi), (2.0, 2.0, 2.0));
        // 5 rounds: nothing reaches 95%; the whole span, at 1 - 2/32.
        assert!(close(r.confidence, 1.0 - 2.0 / 32.0), "{r:?}");
        // Rounds that move both tools together move no ratio: a machine
        // twice as slow in round 2 and half as fast in round 4.
        let theirs = [10.0, 20.0, 10.0, 5.0, 10.0];
        let ours = [11.0, 22.0, 11.0, 5.5, 11.0];
        let r = paired_range(&some(&ours), &some(&theirs)).unwrap();
        assert!(close(r.estimate, 1.1) && close(r.lo, 1.1) && close(r.hi, 1.1), "{r:?}");
        // The ends of the range are the extreme rounds at 5; the estimate
        // is the median of the 15 Walsh averages of the log-ratios.
        let ours = [1.0, 2.0, 4.0, 8.0, 16.0];
        let r = paired_range(&some(&ours), &some(&[1.0; 5])).unwrap();
        assert!(close(r.estimate, 4.0) && close(r.lo, 1.0) && close(r.hi, 16.0), "{r:?}");
        // A round without a figure on either side is left out: 4 pairs.
        let r = paired_range(&[Some(2.0), None, Some(2.0), Some(2.0), Some(2.0)], &[Some(1.0); 5]).unwrap();
        assert!(close(r.estimate, 2.0) && close(r.confidence, 1.0 - 2.0 / 16.0), "{r:?}");
        assert_eq!(paired_range(&[None], &[Some(1.0)]), None);
        assert_eq!(paired_range(&[Some(1.0)], &[Some(0.0)]), None, "a zero figure has no ratio");
        assert_eq!(paired_range(&[Some(f64::NAN)], &[Some(1.0)]), None);
    }

    #[test]
    fn a_verdict_says_when_the_rounds_cannot_settle_it() {
        let at_most = |r: f64| r <= 1.05;
        let range = |lo, hi| Some(RatioRange { estimate: (lo + hi) / 2.0, lo, hi, confidence: 0.95 });
        assert_eq!(verdict(Some(1.0), range(0.9, 1.04), at_most), "met");
        assert_eq!(verdict(Some(1.2), range(1.1, 1.3), at_most), "MISSED");
        assert_eq!(verdict(Some(1.0), range(0.8, 1.3), at_most), "met (noisy: range crosses the goal)");
        assert_eq!(verdict(Some(1.1), range(0.8, 1.3), at_most), "MISSED (noisy: range crosses the goal)");
        assert_eq!(verdict(Some(1.1), None, at_most), "MISSED");
        assert_eq!(verdict(None, None, at_most), "MISSED (no figure)");
    }
}
