//! A plugin's `log` import made safe for the host's log: one line per call,
//! with newlines and other control characters escaped (a plugin cannot forge
//! host log lines), cut to [`MAX_LOG_BYTES`], and at most
//! `log-lines-per-sec` lines a second per plugin. Lines past the rate are
//! dropped and counted (`levee_plugin_log_dropped_total`), with one warning
//! a second saying how many.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Longest message a plugin's log line keeps, bytes.
pub const MAX_LOG_BYTES: usize = 2048;

/// How often a plugin's dropped lines are reported.
const WARN_EVERY: Duration = Duration::from_secs(1);

/// The message as one bounded line: control characters escaped, cut to
/// [`MAX_LOG_BYTES`] with the original length said.
pub fn one_line(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(MAX_LOG_BYTES) + 32);
    for (at, c) in message.char_indices() {
        if out.len() >= MAX_LOG_BYTES {
            out.push_str(&format!("… ({} more bytes)", message.len() - at));
            break;
        }
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            // Controls, line and paragraph separators, bidirectional overrides.
            c if c.is_control()
                || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}') =>
            {
                out.push_str(&format!("\\u{{{:x}}}", c as u32))
            }
            c => out.push(c),
        }
    }
    out
}

/// What to do with one log line.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Write it.
    Write,
    /// Drop it silently (already counted).
    Drop,
    /// Drop it, and warn that this many lines were dropped since the last warning.
    DropAndWarn(u64),
}

#[derive(Debug, Default)]
struct Bucket {
    tokens: f64,
    refilled: Option<Instant>,
    unreported: u64,
    warned: Option<Instant>,
}

/// One plugin's log rate, shared by its instances and versions.
#[derive(Debug, Default)]
pub struct LogLimit {
    per_sec: AtomicU64,
    bucket: Mutex<Bucket>,
    dropped: AtomicU64,
}

impl LogLimit {
    /// A limit of `lines_per_sec`.
    pub fn with_rate(lines_per_sec: f64) -> LogLimit {
        let limit = LogLimit::default();
        limit.set_rate(lines_per_sec);
        limit
    }

    /// Sets the rate (from the plugin's configuration, on every load).
    pub fn set_rate(&self, lines_per_sec: f64) {
        self.per_sec.store(lines_per_sec.to_bits(), Ordering::Relaxed);
    }

    /// Decides about one more line now.
    pub fn admit(&self) -> Verdict {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Verdict {
        let rate = f64::from_bits(self.per_sec.load(Ordering::Relaxed));
        let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        // A second's worth of lines is the most that can come at once.
        let elapsed = b.refilled.map_or(1.0, |t| now.duration_since(t).as_secs_f64());
        b.tokens = (b.tokens + elapsed * rate).min(rate.max(1.0));
        b.refilled = Some(now);
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            return Verdict::Write;
        }
        self.dropped.fetch_add(1, Ordering::Relaxed);
        b.unreported += 1;
        if b.warned.is_none_or(|t| now.duration_since(t) >= WARN_EVERY) {
            b.warned = Some(now);
            return Verdict::DropAndWarn(std::mem::take(&mut b.unreported));
        }
        Verdict::Drop
    }

    /// Lines dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_one_line_of_bounded_length() {
        assert_eq!(one_line("a\nFAKE host line\r\x1b[31m\tz"), "a\\nFAKE host line\\r\\u{1b}[31m\\tz");
        let long = "é".repeat(10_000);
        let cut = one_line(&long);
        assert!(cut.len() < MAX_LOG_BYTES + 40, "{}", cut.len());
        assert!(cut.ends_with("more bytes)"), "{cut}");
    }

    #[test]
    fn lines_past_the_rate_are_dropped_counted_and_reported_once_a_second() {
        let limit = LogLimit::default();
        limit.set_rate(10.0);
        let start = Instant::now();
        let verdicts: Vec<Verdict> = (0..1000).map(|_| limit.admit_at(start)).collect();
        assert_eq!(verdicts.iter().filter(|v| **v == Verdict::Write).count(), 10);
        assert_eq!(verdicts.iter().filter(|v| matches!(v, Verdict::DropAndWarn(_))).count(), 1);
        assert_eq!(limit.dropped(), 990);
        // A second later: ten more lines, and one warning counting the rest.
        let later = start + Duration::from_secs(1);
        assert_eq!(limit.admit_at(later), Verdict::Write);
        for _ in 0..9 {
            limit.admit_at(later);
        }
        assert_eq!(limit.admit_at(later), Verdict::DropAndWarn(990));
    }
}
