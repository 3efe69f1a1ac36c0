//! How long the monitor keeps reading its userfaultfd after a fault before
//! it goes back to sleep in the event loop.
//!
//! A fault is a round trip between two threads: the faulting thread (a
//! vCPU) wakes the monitor, the monitor wakes it back. When the monitor's
//! CPU has gone idle in between, the first wake-up pays for bringing that
//! CPU out of its idle state. Inside a VM whose idle vCPUs halt at once (no
//! guest halt-polling) that is a VM exit and a host reschedule, about
//! 20 µs measured here per wake-up, more than the monitor's own work. A
//! guest's first writes come in bursts (a file being written, a file
//! system being made), so the monitor keeps reading for a short window
//! after each fault and catches the burst's next fault awake.
//!
//! The window adapts like KVM's halt polling: it grows (doubling from a
//! start value up to a maximum) while faults keep arriving soon after the
//! window ended, and halves when the next fault is further away than the
//! maximum. A monitor whose faults are rare polls little: each isolated
//! fault costs at most the current window, and the window halves after it.

use std::time::{Duration, Instant};

/// The window a growing poll starts at.
const GROW_START: Duration = Duration::from_micros(10);

/// Default maximum poll window.
pub const DEFAULT_FAULT_POLL: Duration = Duration::from_micros(50);

/// The adaptive window of one monitor.
#[derive(Debug)]
pub(crate) struct FaultPoll {
    max: Duration,
    window: Duration,
    /// When the monitor last stopped handling faults (its window over).
    idle_since: Option<Instant>,
}

impl FaultPoll {
    /// A window of at most `max`; zero never polls.
    pub(crate) fn new(max: Duration) -> FaultPoll {
        FaultPoll {
            max,
            window: Duration::ZERO,
            idle_since: None,
        }
    }

    /// How long to keep reading after the faults handled now.
    pub(crate) fn window(&self) -> Duration {
        self.window
    }

    /// A fault arrived at `now`; adapts the window to how long the monitor
    /// had been idle.
    pub(crate) fn fault_at(&mut self, now: Instant) {
        let Some(since) = self.idle_since.take() else {
            return;
        };
        let gap = now.saturating_duration_since(since);
        if gap > self.max {
            // Polling longer would not have caught it: poll less.
            self.window /= 2;
            if self.window < GROW_START {
                self.window = Duration::ZERO;
            }
        } else if gap > self.window {
            // A longer window would have caught it.
            self.window = (self.window * 2).max(GROW_START).min(self.max);
        }
    }

    /// The monitor has handled everything and polled its window out at
    /// `now`.
    pub(crate) fn idle_at(&mut self, now: Instant) {
        self.idle_since = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn a_burst_grows_the_window_until_it_covers_the_gaps() {
        let mut p = FaultPoll::new(us(50));
        let t = Instant::now();
        p.fault_at(t);
        assert_eq!(p.window(), Duration::ZERO, "the first fault has no gap");
        let mut now = t;
        let mut seen = vec![];
        for _ in 0..5 {
            p.idle_at(now);
            now += us(30);
            p.fault_at(now);
            seen.push(p.window());
        }
        // 30 µs gaps: the window stops growing once it covers them.
        assert_eq!(seen, vec![us(10), us(20), us(40), us(40), us(40)]);
    }

    #[test]
    fn faults_caught_inside_the_window_keep_it() {
        let mut p = FaultPoll::new(us(50));
        let t = Instant::now();
        p.idle_at(t);
        p.fault_at(t + us(5));
        assert_eq!(p.window(), us(10));
        p.idle_at(t + us(10));
        p.fault_at(t + us(12));
        assert_eq!(p.window(), us(10));
    }

    #[test]
    fn rare_faults_shrink_the_window_to_zero() {
        let mut p = FaultPoll::new(us(80));
        let mut now = Instant::now();
        for _ in 0..4 {
            p.idle_at(now);
            now += us(70);
            p.fault_at(now);
        }
        assert_eq!(p.window(), us(80));
        let mut seen = vec![];
        for _ in 0..4 {
            p.idle_at(now);
            now += Duration::from_millis(5);
            p.fault_at(now);
            seen.push(p.window());
        }
        assert_eq!(seen, vec![us(40), us(20), us(10), Duration::ZERO]);
    }

    #[test]
    fn a_zero_maximum_never_polls() {
        let mut p = FaultPoll::new(Duration::ZERO);
        let mut now = Instant::now();
        for _ in 0..3 {
            p.idle_at(now);
            now += us(1);
            p.fault_at(now);
            assert_eq!(p.window(), Duration::ZERO);
        }
    }
}
