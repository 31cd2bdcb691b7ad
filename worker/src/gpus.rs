//! The agent's GPUs: what it registers (inventory) and what every heartbeat says of them
//! (memory used, utilization, health).
//!
//! Sources, chosen with `--gpus`:
//! - `auto` (the default): NVIDIA GPUs through NVML (`nvml-wrapper`, which loads the
//!   driver's `libnvidia-ml.so` at run time). No driver, or no NVML: zero GPUs, logged
//!   once, never an error.
//! - `none`: zero GPUs.
//! - `0,2`: the NVML GPUs with these indices only (the agent refuses to start if one is
//!   missing).
//! - a path to a JSON inventory file (contains `/` or ends in `.json`): a list of
//!   `{"index", "uuid", "name", "memory_total_bytes"}` objects, each optionally with
//!   `memory_used_bytes`, `utilization_percent`, `healthy` (default true) and `error`.
//!   The file is read again at every heartbeat: a GPU that is gone from it, or marked
//!   unhealthy, is reported unhealthy. Tests use it on machines without GPUs.
//!
//! The inventory is fixed when the agent starts; a GPU added later is seen after a
//! restart of the agent. A registered GPU that NVML no longer finds, or for which it
//! answers an error, is reported unhealthy with NVML's message.

use std::path::{Path, PathBuf};

use cumulus_api::limits::{MAX_GPU_ERROR_BYTES, MAX_GPU_NAME_BYTES, MAX_GPUS_PER_WORKER};
use cumulus_api::{GpuDevice, GpuStatus};
use nvml_wrapper::Nvml;
use serde::Deserialize;

/// Why the `--gpus` setting cannot be used; the agent does not start.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// `--gpus` is neither `auto`, `none`, a list of indices nor a file path.
    #[error(
        "--gpus {0:?}: expected auto, none, a list of GPU indices (0,1) or a JSON inventory file"
    )]
    BadSetting(String),
    /// `--gpus` named indices but NVML cannot be used.
    #[error("--gpus names GPU indices but NVML is not available: {0}")]
    NoNvml(String),
    /// An index given in `--gpus` that NVML does not list.
    #[error("--gpus names GPU {index}, but NVML lists {count} GPUs")]
    NoSuchIndex {
        /// The index asked for.
        index: u32,
        /// How many GPUs NVML lists.
        count: u32,
    },
    /// NVML answered an error while the inventory was read.
    #[error("cannot read GPU {index} through NVML: {message}")]
    Nvml {
        /// The GPU's index.
        index: u32,
        /// NVML's message.
        message: String,
    },
    /// The inventory file cannot be read or parsed, or breaks a rule.
    #[error("GPU inventory file {path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// One GPU of an inventory file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileGpu {
    index: u32,
    uuid: String,
    name: String,
    memory_total_bytes: u64,
    #[serde(default)]
    memory_used_bytes: u64,
    #[serde(default)]
    utilization_percent: u32,
    #[serde(default = "yes")]
    healthy: bool,
    #[serde(default)]
    error: String,
}

fn yes() -> bool {
    true
}

/// Largest inventory file read, in bytes.
const MAX_INVENTORY_FILE_BYTES: u64 = 1 << 20;

enum Source {
    None,
    // NVML's function table is ~12 KB: boxed.
    Nvml(Box<Nvml>),
    File(PathBuf),
}

/// The agent's GPUs: the inventory fixed at start and a sampler of their condition.
pub struct GpuMonitor {
    source: Source,
    inventory: Vec<GpuDevice>,
}

impl std::fmt::Debug for GpuMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuMonitor")
            .field("inventory", &self.inventory)
            .finish_non_exhaustive()
    }
}

impl GpuMonitor {
    /// A monitor with no GPUs.
    pub fn none() -> Self {
        Self {
            source: Source::None,
            inventory: Vec::new(),
        }
    }

    /// Opens the source `setting` names (see the module documentation) and reads the
    /// inventory.
    ///
    /// # Errors
    /// [`GpuError`] for a setting that cannot be used: an unknown form, indices without
    /// NVML or beyond its list, an unreadable or invalid inventory file.
    pub fn open(setting: &str) -> Result<Self, GpuError> {
        let setting = setting.trim();
        match setting {
            "" | "auto" => Ok(Self::detect()),
            "none" => Ok(Self::none()),
            s if s.contains('/') || s.ends_with(".json") => {
                let path = PathBuf::from(s);
                let gpus = read_file(&path)?;
                let inventory = gpus.iter().map(device_of).collect();
                Ok(Self {
                    source: Source::File(path),
                    inventory,
                })
            }
            s => {
                let mut indices = Vec::new();
                for part in s.split(',') {
                    let index: u32 = part
                        .trim()
                        .parse()
                        .map_err(|_| GpuError::BadSetting(s.to_string()))?;
                    if !indices.contains(&index) {
                        indices.push(index);
                    }
                }
                if indices.len() > MAX_GPUS_PER_WORKER {
                    return Err(GpuError::BadSetting(s.to_string()));
                }
                let nvml = Nvml::init().map_err(|e| GpuError::NoNvml(e.to_string()))?;
                let inventory = nvml_inventory(&nvml, Some(&indices))?;
                Ok(Self {
                    source: Source::Nvml(Box::new(nvml)),
                    inventory,
                })
            }
        }
    }

    /// NVML's GPUs, or none (logged) when NVML cannot be loaded or read.
    fn detect() -> Self {
        let nvml = match Nvml::init() {
            Ok(nvml) => nvml,
            Err(e) => {
                tracing::info!("no NVIDIA GPUs: NVML is not available ({e})");
                return Self::none();
            }
        };
        match nvml_inventory(&nvml, None) {
            Ok(inventory) => Self {
                source: Source::Nvml(Box::new(nvml)),
                inventory,
            },
            Err(e) => {
                tracing::warn!("no GPUs offered: {e}");
                Self::none()
            }
        }
    }

    /// The GPUs this agent registers, in index order.
    pub fn inventory(&self) -> &[GpuDevice] {
        &self.inventory
    }

    /// The condition of every inventory GPU, in inventory order. Never fails: a GPU
    /// whose reading fails is reported unhealthy with the reason.
    pub fn sample(&mut self) -> Vec<GpuStatus> {
        match &self.source {
            Source::None => Vec::new(),
            Source::Nvml(nvml) => self
                .inventory
                .iter()
                .map(|g| nvml_status(nvml, &g.uuid))
                .collect(),
            Source::File(path) => {
                let current = read_file(path);
                self.inventory
                    .iter()
                    .map(|g| match &current {
                        Err(e) => unhealthy(&g.uuid, &e.to_string()),
                        Ok(list) => match list.iter().find(|f| f.uuid == g.uuid) {
                            None => unhealthy(&g.uuid, "gone from the inventory file"),
                            Some(f) => GpuStatus {
                                uuid: f.uuid.clone(),
                                memory_used_bytes: f.memory_used_bytes,
                                utilization_percent: f.utilization_percent.min(100),
                                healthy: f.healthy,
                                error: if f.healthy {
                                    String::new()
                                } else if f.error.is_empty() {
                                    "marked unhealthy in the inventory file".into()
                                } else {
                                    cut(&f.error)
                                },
                            },
                        },
                    })
                    .collect()
            }
        }
    }
}

fn unhealthy(uuid: &str, error: &str) -> GpuStatus {
    GpuStatus {
        uuid: uuid.to_string(),
        healthy: false,
        error: cut(error),
        ..GpuStatus::default()
    }
}

/// `text` cut to [`MAX_GPU_ERROR_BYTES`] on a character boundary, control characters
/// escaped.
fn cut(text: &str) -> String {
    let text = cumulus_api::text::escape_control(text);
    let mut end = text.len().min(MAX_GPU_ERROR_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

fn device_of(f: &FileGpu) -> GpuDevice {
    GpuDevice {
        index: f.index,
        uuid: f.uuid.clone(),
        name: f.name.clone(),
        memory_total_bytes: f.memory_total_bytes,
    }
}

/// Reads and checks an inventory file: at most [`MAX_GPUS_PER_WORKER`] GPUs, valid and
/// distinct UUIDs, distinct indices, printable names.
fn read_file(path: &Path) -> Result<Vec<FileGpu>, GpuError> {
    let fail = |message: String| GpuError::File {
        path: path.to_path_buf(),
        message,
    };
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| fail(e.to_string()))?;
    let mut text = String::new();
    file.take(MAX_INVENTORY_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| fail(e.to_string()))?;
    if text.len() as u64 > MAX_INVENTORY_FILE_BYTES {
        return Err(fail(format!(
            "larger than {MAX_INVENTORY_FILE_BYTES} bytes"
        )));
    }
    let gpus: Vec<FileGpu> = serde_json::from_str(&text).map_err(|e| fail(e.to_string()))?;
    if gpus.len() > MAX_GPUS_PER_WORKER {
        return Err(fail(format!(
            "{} GPUs, more than the limit of {MAX_GPUS_PER_WORKER}",
            gpus.len()
        )));
    }
    let mut uuids = std::collections::BTreeSet::new();
    let mut indices = std::collections::BTreeSet::new();
    for g in &gpus {
        if !cumulus_api::gpus::is_valid_uuid(&g.uuid) {
            return Err(fail(format!(
                "GPU {} has an invalid UUID (1..=128 bytes of [A-Za-z0-9._:-])",
                g.index
            )));
        }
        if g.name.len() > MAX_GPU_NAME_BYTES || !cumulus_api::text::is_printable(&g.name) {
            return Err(fail(format!(
                "GPU {} has a name longer than {MAX_GPU_NAME_BYTES} bytes or not printable",
                g.uuid
            )));
        }
        if !uuids.insert(g.uuid.clone()) || !indices.insert(g.index) {
            return Err(fail(format!(
                "GPU {} (index {}) is listed twice",
                g.uuid, g.index
            )));
        }
    }
    Ok(gpus)
}

/// NVML's GPUs (those of `only`, in that order, or all in index order).
fn nvml_inventory(nvml: &Nvml, only: Option<&[u32]>) -> Result<Vec<GpuDevice>, GpuError> {
    let count = nvml.device_count().map_err(|e| GpuError::Nvml {
        index: 0,
        message: e.to_string(),
    })?;
    let indices: Vec<u32> = match only {
        Some(list) => {
            if let Some(&index) = list.iter().find(|&&i| i >= count) {
                return Err(GpuError::NoSuchIndex { index, count });
            }
            list.to_vec()
        }
        None => (0..count).take(MAX_GPUS_PER_WORKER).collect(),
    };
    let mut inventory = Vec::with_capacity(indices.len());
    for index in indices {
        let nvml_error = |e: nvml_wrapper::error::NvmlError| GpuError::Nvml {
            index,
            message: e.to_string(),
        };
        let device = nvml.device_by_index(index).map_err(nvml_error)?;
        let uuid = device.uuid().map_err(nvml_error)?;
        if !cumulus_api::gpus::is_valid_uuid(&uuid) {
            return Err(GpuError::Nvml {
                index,
                message: format!(
                    "unexpected UUID {:?}",
                    cumulus_api::text::escape_control(&uuid)
                ),
            });
        }
        let mut name = device.name().map_err(nvml_error)?;
        if name.len() > MAX_GPU_NAME_BYTES || !cumulus_api::text::is_printable(&name) {
            name = format!("GPU {index}");
        }
        let memory_total_bytes = device.memory_info().map_err(nvml_error)?.total;
        inventory.push(GpuDevice {
            index,
            uuid,
            name,
            memory_total_bytes,
        });
    }
    Ok(inventory)
}

/// One GPU's reading; any NVML error makes it unhealthy.
fn nvml_status(nvml: &Nvml, uuid: &str) -> GpuStatus {
    let reading = nvml.device_by_uuid(uuid).and_then(|device| {
        let memory = device.memory_info()?;
        let utilization = device.utilization_rates()?;
        Ok((memory.used, utilization.gpu))
    });
    match reading {
        Ok((memory_used_bytes, utilization)) => GpuStatus {
            uuid: uuid.to_string(),
            memory_used_bytes,
            utilization_percent: utilization.min(100),
            healthy: true,
            error: String::new(),
        },
        Err(e) => unhealthy(uuid, &format!("NVML: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, body: &str) -> PathBuf {
        let path = dir.join("gpus.json");
        std::fs::write(&path, body).expect("write inventory");
        path
    }

    #[test]
    fn inventory_file_is_read_again_at_every_sample() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write(
            dir.path(),
            r#"[{"index":0,"uuid":"GPU-a","name":"Fake","memory_total_bytes":1024},
                {"index":1,"uuid":"GPU-b","name":"Fake","memory_total_bytes":1024,
                 "memory_used_bytes":10,"utilization_percent":150}]"#,
        );
        let mut monitor = GpuMonitor::open(path.to_str().expect("utf-8")).expect("opens");
        assert_eq!(monitor.inventory().len(), 2);
        let status = monitor.sample();
        assert!(status.iter().all(|s| s.healthy), "{status:?}");
        assert_eq!(status[1].utilization_percent, 100);
        // One marked unhealthy, one gone.
        write(
            dir.path(),
            r#"[{"index":0,"uuid":"GPU-a","name":"Fake","memory_total_bytes":1024,
                 "healthy":false,"error":"Xid 79: fallen off the bus"}]"#,
        );
        let status = monitor.sample();
        assert!(
            !status[0].healthy && status[0].error.contains("Xid 79"),
            "{status:?}"
        );
        assert!(
            !status[1].healthy && status[1].error.contains("gone"),
            "{status:?}"
        );
        // Unreadable: every GPU unhealthy, with the reason.
        std::fs::write(&path, "not json").expect("write");
        let status = monitor.sample();
        assert!(
            status
                .iter()
                .all(|s| !s.healthy && s.error.contains("gpus.json"))
        );
    }

    #[test]
    fn bad_settings_and_files_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        for bad in ["0,x", "-1", "all"] {
            assert!(
                matches!(GpuMonitor::open(bad), Err(GpuError::BadSetting(_))),
                "{bad}"
            );
        }
        assert!(
            GpuMonitor::open("none")
                .expect("none")
                .inventory()
                .is_empty()
        );
        for body in [
            r#"[{"index":0,"uuid":"GPU-a","name":"x","memory_total_bytes":1},
                {"index":1,"uuid":"GPU-a","name":"x","memory_total_bytes":1}]"#,
            r#"[{"index":0,"uuid":"GPU,a","name":"x","memory_total_bytes":1}]"#,
            r#"[{"index":0,"uuid":"GPU-a","name":"\u001b[2J","memory_total_bytes":1}]"#,
            r#"[{"index":0,"uuid":"GPU-a","name":"x","memory_total_bytes":1,"extra":1}]"#,
            "{}",
        ] {
            let path = write(dir.path(), body);
            assert!(
                matches!(
                    GpuMonitor::open(path.to_str().expect("utf-8")),
                    Err(GpuError::File { .. })
                ),
                "{body}"
            );
        }
        let missing = dir.path().join("missing.json");
        assert!(GpuMonitor::open(missing.to_str().expect("utf-8")).is_err());
    }

    #[test]
    fn auto_never_fails() {
        // With or without a driver: a list (maybe empty), never an error.
        let mut monitor = GpuMonitor::open("auto").expect("auto never fails");
        let status = monitor.sample();
        assert_eq!(status.len(), monitor.inventory().len());
    }
}
