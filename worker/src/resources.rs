//! Machine resources sent with every heartbeat (sysinfo).

use cumulus_api::Resources;
use sysinfo::System;

/// Samples global CPU use and memory. CPU use is measured between two consecutive samples
/// (the first sample reports 0 %).
pub struct ResourceSampler {
    system: Option<System>,
}

impl std::fmt::Debug for ResourceSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResourceSampler")
            .field("available", &self.system.is_some())
            .finish()
    }
}

impl Default for ResourceSampler {
    fn default() -> Self {
        Self::new()
    }
}

impl ResourceSampler {
    /// A sampler; when the OS information cannot be read, every sample is zero.
    pub fn new() -> Self {
        let system = match System::new() {
            Ok(mut s) => {
                s.refresh_cpu_usage();
                Some(s)
            }
            Err(e) => {
                tracing::warn!("cannot read system resources, reporting zeros: {e}");
                None
            }
        };
        Self { system }
    }

    /// Refreshes and returns CPU % (0..=100, all cores) and used/total memory in bytes.
    pub fn sample(&mut self) -> Resources {
        let Some(system) = self.system.as_mut() else {
            return Resources::default();
        };
        system.refresh_cpu_usage();
        system.refresh_memory();
        let cpu = f64::from(system.global_cpu_usage());
        Resources {
            cpu_percent: if cpu.is_finite() {
                cpu.clamp(0.0, 100.0)
            } else {
                0.0
            },
            memory_used_bytes: system.used_memory(),
            memory_total_bytes: system.total_memory(),
            gpus: Vec::new(),
            warm_spares: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_memory() {
        let mut sampler = ResourceSampler::new();
        let r = sampler.sample();
        assert!(r.memory_total_bytes > 0);
        assert!(r.memory_used_bytes <= r.memory_total_bytes);
        assert!((0.0..=100.0).contains(&r.cpu_percent));
    }
}
