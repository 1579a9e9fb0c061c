//! Results in perftest's columns and units.

use std::fmt;

/// One bandwidth result, perftest's columns.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct BwRow {
    /// Message size.
    pub bytes: usize,
    /// Messages.
    pub iterations: u64,
    /// The best rate over any stretch of a tenth of the run (at least four
    /// send-queue depths), MiB/s.
    pub bw_peak_mib_s: f64,
    /// All bytes over all the time, MiB/s.
    pub bw_average_mib_s: f64,
    /// Millions of messages per second.
    pub msg_rate_mpps: f64,
}

impl BwRow {
    /// perftest's header line.
    pub const HEADER: &'static str = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";
}

impl fmt::Display for BwRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            " {:<10} {:<10}       {:>10.2}         {:>10.2}           {:.6}",
            self.bytes, self.iterations, self.bw_peak_mib_s, self.bw_average_mib_s, self.msg_rate_mpps
        )
    }
}

/// One latency result, perftest's columns, in microseconds.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct LatRow {
    /// Message size.
    pub bytes: usize,
    /// Samples.
    pub iterations: u64,
    /// Fastest.
    pub t_min: f64,
    /// Slowest.
    pub t_max: f64,
    /// Median.
    pub t_typical: f64,
    /// Mean.
    pub t_avg: f64,
    /// Standard deviation.
    pub t_stdev: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p99_9: f64,
}

impl LatRow {
    /// perftest's header line.
    pub const HEADER: &'static str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]";

    /// The statistics of `samples` (microseconds; reordered). The quantiles
    /// are selected, not sorted for: linear in the sample count, so a
    /// longer run costs the same per sample.
    pub fn from_samples(bytes: usize, samples: &mut [f64]) -> LatRow {
        LatRow::of(bytes, samples, f64::total_cmp, |s| s)
    }

    /// The statistics of clock-tick samples (reordered), each `us_per_tick`
    /// microseconds: as [`from_samples`](Self::from_samples) of the samples
    /// in microseconds, with the quantiles selected among the integer ticks
    /// (cheaper to compare than floating point).
    pub fn from_ticks(bytes: usize, ticks: &mut [u64], us_per_tick: f64) -> LatRow {
        LatRow::of(bytes, ticks, u64::cmp, |t| t as f64 * us_per_tick)
    }

    /// The statistics of `samples` ordered by `cmp`, each `us(sample)`
    /// microseconds (`us` keeps that order).
    fn of<T: Copy>(
        bytes: usize,
        samples: &mut [T],
        mut cmp: impl FnMut(&T, &T) -> std::cmp::Ordering,
        us: impl Fn(T) -> f64,
    ) -> LatRow {
        let n = samples.len();
        let index = |q: f64| quantile_index(q, n);
        let ([median, p99, p99_9], t_min, t_max) = if n == 0 {
            ([0.0; 3], 0.0, 0.0)
        } else {
            let at = [index(0.5), index(0.99), index(0.999)];
            let quantiles = select(samples, at, &mut cmp).map(&us);
            // After the selection nothing below the median lies past it,
            // and nothing above the last quantile before it: the extremes
            // are found among those few.
            let lo = samples[..=at[0]].iter().min_by(|a, b| cmp(a, b));
            let hi = samples[at[2]..].iter().max_by(|a, b| cmp(a, b));
            (quantiles, lo.map_or(0.0, |&s| us(s)), hi.map_or(0.0, |&s| us(s)))
        };
        let avg = if n == 0 { 0.0 } else { samples.iter().map(|&s| us(s)).sum::<f64>() / n as f64 };
        let var = if n < 2 {
            0.0
        } else {
            samples.iter().map(|&s| (us(s) - avg) * (us(s) - avg)).sum::<f64>() / (n - 1) as f64
        };
        LatRow {
            bytes,
            iterations: n as u64,
            t_min,
            t_max,
            t_typical: median,
            t_avg: avg,
            t_stdev: var.sqrt(),
            p99,
            p99_9,
        }
    }
}

/// The values that would sit at `at` (ascending indices, each below
/// `samples.len()`) if `samples` were sorted by `cmp`, found by selection:
/// each index is selected among what lies past the one before it.
fn select<T: Copy, const N: usize>(
    samples: &mut [T],
    at: [usize; N],
    mut cmp: impl FnMut(&T, &T) -> std::cmp::Ordering,
) -> [T; N] {
    let mut from = 0;
    at.map(|i| {
        if i >= from {
            samples[from..].select_nth_unstable_by(i - from, &mut cmp);
            from = i + 1;
        }
        samples[i]
    })
}

/// The index of quantile `q` among `n` sorted samples (`n` > 0).
fn quantile_index(q: f64, n: usize) -> usize {
    ((q * n as f64).ceil() as usize).clamp(1, n) - 1
}

impl fmt::Display for LatRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            " {:<7} {:<10}   {:>8.2}       {:>8.2}     {:>8.2}           {:>8.2}        {:>8.2}         {:>8.2}               {:>8.2}",
            self.bytes,
            self.iterations,
            self.t_min,
            self.t_max,
            self.t_typical,
            self.t_avg,
            self.t_stdev,
            self.p99,
            self.p99_9
        )
    }
}

/// A result row of either kind.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(untagged))]
pub enum Row {
    /// From a bandwidth test.
    Bw(BwRow),
    /// From a latency test.
    Lat(LatRow),
}

impl fmt::Display for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Row::Bw(r) => r.fmt(f),
            Row::Lat(r) => r.fmt(f),
        }
    }
}

/// The best rate over any stretch of at least `window` completed
/// operations, from `(completed, seconds since the start)` stamps
/// (perftest's peak is its best short stretch too). The average when the
/// run is shorter than a window.
pub(super) fn peak_rate(stamps: &[(u64, f64)], size: usize, window: u64) -> f64 {
    let point = |i: usize| if i == 0 { (0, 0.0) } else { stamps[i - 1] };
    let mut best = 0.0f64;
    let mut j = 0;
    for k in 1..=stamps.len() {
        let (done, t) = point(k);
        // The latest start that still leaves a whole window.
        while j + 1 < k && done - point(j + 1).0 >= window {
            j += 1;
        }
        let (from, t0) = point(j);
        let secs = t - t0;
        if done - from >= window && secs > 0.0 {
            best = best.max((done - from) as f64 * size as f64 / secs);
        }
    }
    if best == 0.0 {
        if let Some(&(done, secs)) = stamps.last() {
            if secs > 0.0 {
                best = done as f64 * size as f64 / secs;
            }
        }
    }
    best
}

pub(super) const MIB: f64 = (1u64 << 20) as f64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_statistics_match_their_definitions() {
        let mut s: Vec<f64> = (1..=1000).rev().map(f64::from).collect();
        let r = LatRow::from_samples(2, &mut s);
        assert_eq!((r.t_min, r.t_max, r.t_typical, r.p99, r.p99_9), (1.0, 1000.0, 500.0, 990.0, 999.0));
        assert!((r.t_avg - 500.5).abs() < 1e-9);
        assert!((r.t_stdev - 288.819).abs() < 1e-3, "{}", r.t_stdev);
        let one = LatRow::from_samples(8, &mut [3.0]);
        assert_eq!((one.t_typical, one.p99_9, one.t_stdev), (3.0, 3.0, 0.0));
    }

    #[test]
    fn selected_quantiles_equal_sorted_ones() {
        // Shuffled values with many repeats, at every length up to 300.
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for n in 1..=300usize {
            let mut s: Vec<f64> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 17) as f64
                })
                .collect();
            let mut sorted = s.clone();
            sorted.sort_by(f64::total_cmp);
            let at = |q: f64| sorted[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
            let r = LatRow::from_samples(1, &mut s);
            assert_eq!(
                (r.t_min, r.t_max, r.t_typical, r.p99, r.p99_9),
                (sorted[0], sorted[n - 1], at(0.5), at(0.99), at(0.999)),
                "{n} samples"
            );
        }
    }

    #[test]
    fn tick_statistics_equal_those_of_the_same_samples_in_microseconds() {
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        for n in [0usize, 1, 2, 3, 10, 999, 1000, 1001] {
            let ticks: Vec<u64> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    1000 + x % 5000
                })
                .collect();
            let per = 0.37;
            let mut us: Vec<f64> = ticks.iter().map(|&t| t as f64 * per).collect();
            let a = LatRow::from_ticks(64, &mut ticks.clone(), per);
            // A sample far past any real latency (a clock that stepped back)
            // still gives finite statistics.
            let mut huge = ticks.clone();
            huge.push(u64::MAX - 5);
            let h = LatRow::from_ticks(64, &mut huge, per);
            assert_eq!(h.t_max, (u64::MAX - 5) as f64 * per);
            assert!(h.t_avg.is_finite() && h.t_stdev.is_finite());
            let b = LatRow::from_samples(64, &mut us);
            assert_eq!(
                (a.iterations, a.t_min, a.t_max, a.t_typical, a.p99, a.p99_9),
                (b.iterations, b.t_min, b.t_max, b.t_typical, b.p99, b.p99_9),
                "{n} samples"
            );
            assert!((a.t_avg - b.t_avg).abs() <= 1e-9 * b.t_avg.abs().max(1.0), "{n}: {} {}", a.t_avg, b.t_avg);
            assert!((a.t_stdev - b.t_stdev).abs() <= 1e-6 * b.t_stdev.max(1.0), "{n}: {} {}", a.t_stdev, b.t_stdev);
        }
    }

    #[test]
    fn the_peak_is_the_best_tenth_and_at_least_the_average() {
        let ms = 1e-3;
        // 100 messages of 1 MiB: the first half at 1 per ms, the second at 2 per ms.
        let mut stamps = Vec::new();
        for i in 1..=50u64 {
            stamps.push((i, ms * i as f64));
        }
        for i in 1..=50u64 {
            stamps.push((50 + i, ms * 50.0 + ms * i as f64 / 2.0));
        }
        let peak = peak_rate(&stamps, 1 << 20, 10) / MIB;
        let avg = 100.0 / 0.075;
        assert!(peak > avg, "{peak} vs {avg}");
        assert!((peak - 2000.0).abs() < 1.0, "{peak}");
        // A window longer than the run: the average.
        let whole = peak_rate(&stamps, 1 << 20, 1000) / MIB;
        assert!((whole - avg).abs() < 1.0, "{whole} vs {avg}");
    }
}
