//! CPU time and memory of a process, read from `/proc`: how the load test charges each
//! target (lockcell proxy, etcd member, grpc-proxy) for the work a scenario caused,
//! from the kernel's accounting rather than the process's own claims.

use anyhow::{bail, Context};

/// One reading of a process's resource use.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct ProcSample {
    /// User plus system CPU time since the process started.
    pub cpu_seconds: f64,
    /// Resident memory now (VmRSS).
    pub rss_bytes: u64,
    /// Highest resident memory since the process started (VmHWM).
    pub peak_rss_bytes: u64,
}

/// Parses /proc/<pid>/stat (utime+stime fields 14,15, in clock ticks; the comm field may contain spaces and parentheses — split after the LAST ')') and /proc/<pid>/status (VmRSS, VmHWM in kB).
///
/// A status without memory lines (a zombie, a kernel thread) reads as zero memory
/// rather than an error: it genuinely holds none.
pub fn parse(stat: &str, status: &str, ticks_per_second: u64) -> anyhow::Result<ProcSample> {
    if ticks_per_second == 0 {
        bail!("clock ticks per second must be positive");
    }
    let close = stat
        .rfind(')')
        .context("no ')' closing the comm field in /proc/<pid>/stat")?;
    // After the comm field come field 3 (state) onwards, so field f is at index f - 3.
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    let field = |f: usize| -> anyhow::Result<u64> {
        let raw = fields
            .get(f - 3)
            .with_context(|| format!("/proc/<pid>/stat has no field {f}"))?;
        raw.parse()
            .with_context(|| format!("field {f} of /proc/<pid>/stat is {raw:?}, not a number"))
    };
    let ticks = field(14)? + field(15)?;
    Ok(ProcSample {
        cpu_seconds: ticks as f64 / ticks_per_second as f64,
        rss_bytes: status_kb(status, "VmRSS")? * 1024,
        peak_rss_bytes: status_kb(status, "VmHWM")? * 1024,
    })
}

/// The value of a `Key:   1234 kB` line of /proc/<pid>/status; zero when absent.
fn status_kb(status: &str, key: &str) -> anyhow::Result<u64> {
    let Some(line) = status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
    else {
        return Ok(0);
    };
    let mut words = line.split_whitespace();
    let n = words
        .next()
        .with_context(|| format!("{key} in /proc/<pid>/status has no value"))?;
    if words.next() != Some("kB") {
        bail!("{key} in /proc/<pid>/status is not in kB: {line:?}");
    }
    n.parse()
        .with_context(|| format!("{key} in /proc/<pid>/status is {n:?}, not a number"))
}

/// Clock ticks per second of /proc/<pid>/stat's time fields. Linux reports 100 through
/// `sysconf(_SC_CLK_TCK)` on every platform we run on (x86_64 and aarch64: USER_HZ is
/// fixed at 100 whatever the kernel's CONFIG_HZ), so it is a constant here rather than
/// an unsafe libc call.
const TICKS_PER_SECOND: u64 = 100;

/// Reads a live process (ticks per second: 100, which is what Linux reports through sysconf(_SC_CLK_TCK) on every platform we run on; say so in a comment). None if the process is gone.
///
/// A process exiting between the two reads can leave half-written text; that too reads
/// as gone, since a sampler has nothing better to report for it.
pub fn read(pid: u32) -> Option<ProcSample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse(&stat, &status, TICKS_PER_SECOND).ok()
}

/// Tracks one process over a phase: peak of peaks, cpu delta.
///
/// `peak_rss_bytes` is the process's lifetime high-water mark (VmHWM), not the phase's:
/// the kernel keeps no per-phase peak, so a phase that must own its peak starts on a
/// fresh process. Periodic [`ProcTracker::sample`] calls keep the last readings when
/// the process dies mid-phase, as a killed etcd member does.
#[derive(Debug, Clone)]
pub struct ProcTracker {
    /// The tracked process.
    pid: u32,
    /// Reading at the start of the phase, the base of the CPU delta; None if the
    /// process was already gone.
    first: Option<ProcSample>,
    /// Most recent reading, the end of the CPU delta and the reported RSS.
    last: Option<ProcSample>,
    /// Highest VmHWM or VmRSS seen in any reading.
    peak: u64,
}

impl ProcTracker {
    pub fn start(pid: u32) -> Self {
        let mut t = Self {
            pid,
            first: None,
            last: None,
            peak: 0,
        };
        t.observe(read(pid));
        t.first = t.last;
        t
    }

    /// Takes one reading; call it periodically so a process that dies still leaves
    /// recent figures.
    pub fn sample(&mut self) {
        self.observe(read(self.pid));
    }

    /// Takes a last reading and returns: cpu = delta since start, rss = last seen,
    /// peak = max seen VmHWM. All zero if the process was never seen.
    pub fn finish(mut self) -> ProcSample {
        self.sample();
        self.summary()
    }

    fn observe(&mut self, reading: Option<ProcSample>) {
        if let Some(s) = reading {
            self.peak = self.peak.max(s.peak_rss_bytes).max(s.rss_bytes);
            self.last = Some(s);
        }
    }

    fn summary(&self) -> ProcSample {
        let Some(last) = self.last else {
            return ProcSample::default();
        };
        let base = self.first.map_or(0.0, |f| f.cpu_seconds);
        ProcSample {
            cpu_seconds: (last.cpu_seconds - base).max(0.0),
            rss_bytes: last.rss_bytes,
            peak_rss_bytes: self.peak,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tetcd\n\
        Umask:\t0022\n\
        State:\tS (sleeping)\n\
        Pid:\t4242\n\
        VmPeak:\t11931248 kB\n\
        VmSize:\t11865704 kB\n\
        VmHWM:\t  204800 kB\n\
        VmRSS:\t  102400 kB\n\
        RssAnon:\t   90000 kB\n\
        Threads:\t12\n";

    /// A stat line whose comm holds spaces and both parentheses, as a process may
    /// name itself anything up to 15 bytes.
    fn stat_with_comm(comm: &str, utime: u64, stime: u64) -> String {
        format!(
            "4242 ({comm}) S 1 4242 4242 0 -1 4194560 5000 0 3 0 {utime} {stime} 0 0 20 0 \
             12 0 123456 11865704960 25600 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 \
             1 0 0 0 0 0"
        )
    }

    #[test]
    fn parses_cpu_and_memory() {
        let s = parse(&stat_with_comm("etcd", 250, 50), STATUS, 100).unwrap();
        assert_eq!(
            s,
            ProcSample {
                cpu_seconds: 3.0,
                rss_bytes: 102400 * 1024,
                peak_rss_bytes: 204800 * 1024,
            }
        );
    }

    #[test]
    fn comm_with_spaces_and_parentheses() {
        let stat = stat_with_comm("a) b (c) 9 9", 7, 3);
        let s = parse(&stat, STATUS, 100).unwrap();
        assert_eq!(s.cpu_seconds, 0.1);
    }

    #[test]
    fn zombie_without_memory_lines_reads_zero_memory() {
        let s = parse(
            &stat_with_comm("x", 1, 1),
            "Name:\tx\nState:\tZ (zombie)\n",
            100,
        )
        .unwrap();
        assert_eq!(s.rss_bytes, 0);
        assert_eq!(s.peak_rss_bytes, 0);
    }

    #[test]
    fn malformed_input_is_an_error() {
        assert!(parse("4242 etcd S 1", STATUS, 100).is_err());
        assert!(parse("4242 (etcd) S 1 2 3", STATUS, 100).is_err());
        assert!(parse(&stat_with_comm("x", 1, 1), "VmRSS:\tlots kB\n", 100).is_err());
        assert!(parse(&stat_with_comm("x", 1, 1), "VmRSS:\t12 MB\n", 100).is_err());
        assert!(parse(&stat_with_comm("x", 1, 1), STATUS, 0).is_err());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_this_process() {
        let s = read(std::process::id()).expect("our own /proc entry");
        assert!(s.cpu_seconds >= 0.0);
        assert!(s.rss_bytes > 1024 * 1024, "a test binary holds over 1 MiB");
        assert!(s.peak_rss_bytes >= s.rss_bytes);
        assert!(s.rss_bytes < 64 * 1024 * 1024 * 1024);
    }

    #[test]
    fn a_gone_process_reads_none() {
        // Above any pid_max Linux allows (2^22), so never a live process.
        assert_eq!(read(u32::MAX), None);
        assert_eq!(ProcTracker::start(u32::MAX).finish(), ProcSample::default());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn tracks_this_process() {
        let mut t = ProcTracker::start(std::process::id());
        t.sample();
        let s = t.finish();
        assert!(s.cpu_seconds >= 0.0);
        assert!(s.rss_bytes > 0);
        assert!(s.peak_rss_bytes >= s.rss_bytes);
    }

    #[test]
    fn tracker_keeps_peak_of_peaks_and_last_reading_after_death() {
        let reading = |cpu: f64, rss: u64, peak: u64| ProcSample {
            cpu_seconds: cpu,
            rss_bytes: rss,
            peak_rss_bytes: peak,
        };
        let mut t = ProcTracker {
            pid: u32::MAX,
            first: Some(reading(10.0, 100, 100)),
            last: None,
            peak: 0,
        };
        t.observe(t.first);
        t.observe(Some(reading(12.5, 300, 300)));
        t.observe(Some(reading(14.0, 200, 300)));
        t.observe(None);
        assert_eq!(t.summary(), reading(4.0, 200, 300));
    }
}
