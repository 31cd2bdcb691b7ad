//! Reads a process's resident memory and CPU time from `/proc` (Linux).

use anyhow::Context;

/// Resident set size of `pid`, in bytes (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS line")?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .context("no VmRSS value")?
        .parse()
        .context("VmRSS is not a number")?;
    Ok(kib * 1024)
}

/// User + system CPU time of `pid` so far, in seconds (`/proc/<pid>/stat` fields 14 and
/// 15, in clock ticks of 1/100 s, the Linux default `USER_HZ`).
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The command name (field 2) may contain spaces: fields are counted after its ')'.
    let rest = stat.rsplit_once(')').context("malformed stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11).context("no utime")?.parse()?;
    let stime: f64 = fields.get(12).context("no stime")?.parse()?;
    Ok((utime + stime) / 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let pid = std::process::id();
        assert!(rss_bytes(pid).expect("rss") > 0);
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        assert!(x > 0);
        assert!(cpu_seconds(pid).expect("cpu") > 0.0);
    }
}
