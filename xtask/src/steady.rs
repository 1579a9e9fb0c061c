//! How steady this machine's own CPU is: a fixed loop timed in short
//! windows, on one thread.
//!
//! Why: on the cloud hosts this project runs on, a fixed loop's time per
//! 10 ms window wanders from 1.0x to 1.5x its best (and now and then 2.5x)
//! from one window to the next, with no other process running and no
//! steal time counted. The soft-RoCE guest's CPUs are threads of this
//! machine, so every tool's latency in the guest flips with it. `compare`
//! prints this spread before and after its guest run: a goal closer than
//! that spread needs many rounds to settle.

use std::fmt;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// A fixed loop's time per window over a probe, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Steadiness {
    pub windows: usize,
    pub best: f64,
    pub p10: f64,
    pub median: f64,
    pub p90: f64,
}

impl Steadiness {
    /// The summary of windows' times (milliseconds), or `None` for none.
    pub fn of(mut ms: Vec<f64>) -> Option<Steadiness> {
        if ms.is_empty() {
            return None;
        }
        ms.sort_by(f64::total_cmp);
        // The nearest rank: the smallest value with at least `q` of them
        // at or below it.
        let at = |q: f64| ms[((q * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1];
        Some(Steadiness { windows: ms.len(), best: ms[0], p10: at(0.1), median: at(0.5), p90: at(0.9) })
    }

    /// How much slower the slow tenth of the windows ran than the fast
    /// tenth.
    pub fn spread(&self) -> f64 {
        self.p90 / self.p10
    }
}

impl fmt::Display for Steadiness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a fixed loop took {:.1} ms at best, {:.1} / {:.1} / {:.1} ms at p10 / median / p90 over {} windows \
             (p90/p10 {:.2}x)",
            self.best,
            self.p10,
            self.median,
            self.p90,
            self.windows,
            self.spread()
        )
    }
}

/// The loop: `n` rounds of integer work the compiler cannot drop.
fn spin(n: u64) -> u64 {
    let mut x = 0u64;
    for i in 0..n {
        x = black_box(x.wrapping_add(i.wrapping_mul(i)));
    }
    x
}

/// Times a loop sized to about `window` at this machine's best, over
/// about `total`.
pub fn probe(window: Duration, total: Duration) -> Option<Steadiness> {
    // Size the loop from the fastest of a few short calibrations.
    let n = 1 << 16;
    let best = (0..20)
        .map(|_| {
            let t = Instant::now();
            black_box(spin(n));
            t.elapsed()
        })
        .min()?;
    let per_window = (n as f64 * window.as_secs_f64() / best.as_secs_f64().max(1e-9)) as u64;
    let started = Instant::now();
    let mut ms = Vec::new();
    while started.elapsed() < total {
        let t = Instant::now();
        black_box(spin(per_window.max(1)));
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Steadiness::of(ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_takes_nearest_ranks_of_the_windows() {
        let ms: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        let s = Steadiness::of(ms).unwrap();
        assert_eq!((s.windows, s.best, s.p10, s.median, s.p90), (20, 1.0, 2.0, 10.0, 18.0));
        assert_eq!(s.spread(), 9.0);
        assert_eq!(Steadiness::of(vec![3.0]).unwrap().p90, 3.0);
        assert!(Steadiness::of(Vec::new()).is_none());
    }

    #[test]
    fn a_probe_times_windows_near_the_asked_length() {
        let s = probe(Duration::from_millis(2), Duration::from_millis(100)).unwrap();
        assert!(s.windows >= 5, "{s}");
        // Sized from the best calibration, so no window runs much faster
        // than asked; slower ones are the machine's doing.
        assert!(s.best > 0.5 && s.best <= s.p10 && s.p10 <= s.median && s.median <= s.p90, "{s}");
    }
}
