//! How far a ratio of two tools' figures can be trusted, from a handful of
//! rounds each: the Hodges-Lehmann estimate of the ratio and its
//! distribution-free (Moses) interval, both from the pairwise ratios of one
//! tool's rounds to the other's.
//!
//! Why: in the soft-RoCE guest, latency runs of perftest and of gpu-rdma
//! alike flip between two modes (at 2 B, a typical one-way time of about
//! 11.5 us or of 17-22 us), within a run and from run to run. The median of
//! five rounds then swings by a third, and a ratio of two such medians says
//! "met" or "MISSED" by chance. The interval says which verdicts the rounds
//! settle and which they cannot.

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
    /// The Hodges-Lehmann estimate: the median of all pairwise ratios.
    pub estimate: f64,
    pub lo: f64,
    pub hi: f64,
    /// How often such a range holds the true ratio (0.968 for 5 rounds
    /// against 5, 0.90 for 3 against 3), if the rounds of each tool are
    /// independent draws and the two differ by a factor.
    pub confidence: f64,
}

/// The number of orderings of `n` values of one sample among `m` of
/// another, with no ties, that give the Mann-Whitney statistic `U = u`
/// (the count of pairs where the first sample's value is the smaller),
/// for `u` in `0..=n*m`.
fn mann_whitney_counts(n: usize, m: usize) -> Vec<f64> {
    // counts[j] for the current i: the distribution for (i, j).
    let mut prev: Vec<Vec<f64>> = (0..=m).map(|_| vec![1.0]).collect();
    for i in 1..=n {
        let mut cur: Vec<Vec<f64>> = vec![vec![1.0]];
        for j in 1..=m {
            // The largest of all i + j values is either the first sample's
            // (i - 1 of them left, each pair with it adds nothing), or the
            // second's (it is above all i of the first: U grows by i).
            let mut d = vec![0.0; i * j + 1];
            for (u, c) in prev[j].iter().enumerate() {
                d[u] += c;
            }
            for (u, c) in cur[j - 1].iter().enumerate() {
                d[u + i] += c;
            }
            cur.push(d);
        }
        prev = cur;
    }
    prev.swap_remove(m)
}

/// The ratio of `ours` to `theirs` (positive figures, a round each) and the
/// distribution-free range that holds it with about 95% confidence (the
/// widest level the sample sizes allow when they allow less: 90% for 3
/// rounds each). `None` when either side has no figure.
pub fn ratio_range(ours: &[f64], theirs: &[f64]) -> Option<RatioRange> {
    let (n, m) = (ours.len(), theirs.len());
    if n == 0 || m == 0 || ours.iter().chain(theirs).any(|v| !v.is_finite() || *v <= 0.0) {
        return None;
    }
    let mut logs: Vec<f64> = ours.iter().flat_map(|o| theirs.iter().map(move |t| o.ln() - t.ln())).collect();
    logs.sort_by(f64::total_cmp);
    let estimate = median_of_sorted(&logs)?.exp();
    let (k, confidence) = interval_rank(n, m);
    Some(RatioRange { estimate, lo: logs[k - 1].exp(), hi: logs[logs.len() - k].exp(), confidence })
}

/// For `n` figures against `m`: which pairwise ratio, counted from either
/// end, bounds the range (the k-th smallest and k-th largest), and the
/// confidence of that range, 1 - 2 P(U < k): the largest k that keeps it
/// at or above 95%, and k = 1 where even the widest range falls short.
pub fn interval_rank(n: usize, m: usize) -> (usize, f64) {
    let counts = mann_whitney_counts(n, m);
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

    fn binomial(n: usize, k: usize) -> f64 {
        (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (i + 1) as f64)
    }

    #[test]
    fn mann_whitney_counts_match_the_tables() {
        // Every ordering once: C(n + m, n) in all, symmetric about nm / 2.
        for (n, m) in [(1, 1), (2, 3), (3, 3), (5, 5), (4, 7), (9, 9)] {
            let c = mann_whitney_counts(n, m);
            assert_eq!(c.len(), n * m + 1);
            assert_eq!(c.iter().sum::<f64>(), binomial(n + m, n), "{n} x {m}");
            assert!(c.iter().zip(c.iter().rev()).all(|(a, b)| a == b), "{n} x {m} symmetric");
        }
        // 5 against 5: U = 0, 1, 2, 3 in 1, 1, 2, 3 of 252 orderings.
        assert_eq!(mann_whitney_counts(5, 5)[..4], [1.0, 1.0, 2.0, 3.0]);
        assert_eq!(mann_whitney_counts(2, 2), [1.0, 1.0, 2.0, 1.0, 1.0]);
    }

    #[test]
    fn the_range_holds_the_ratio_at_the_stated_confidence() {
        let r = ratio_range(&[2.0; 5], &[1.0; 5]).unwrap();
        assert_eq!((r.estimate, r.lo, r.hi), (2.0, 2.0, 2.0));
        // 5 rounds each: the 3rd smallest and largest of 25 pairwise
        // ratios, 1 - 2 * 4/252.
        assert!((r.confidence - (1.0 - 8.0 / 252.0)).abs() < 1e-12);
        let ours = [1.0, 2.0, 3.0, 4.0, 5.0];
        let theirs = [1.0, 1.0, 1.0, 1.0, 1.0];
        let r = ratio_range(&ours, &theirs).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(r.estimate, 3.0) && close(r.lo, 1.0) && close(r.hi, 5.0), "{r:?}");
        // 3 each: nothing reaches 95%; the whole span, at 90%.
        let r = ratio_range(&[1.0, 1.1, 1.2], &[1.0, 1.0, 1.0]).unwrap();
        assert!((r.confidence - 0.9).abs() < 1e-12);
        assert!((r.lo - 1.0).abs() < 1e-12 && (r.hi - 1.2).abs() < 1e-12);
        assert_eq!(ratio_range(&[], &[1.0]), None);
        assert_eq!(ratio_range(&[1.0], &[0.0]), None, "a zero figure has no ratio");
        assert_eq!(ratio_range(&[f64::NAN], &[1.0]), None);
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
