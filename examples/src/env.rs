//! The rank environment set by the Cumulus worker agent (docs/architecture.md, "Rank
//! environment"). Every variable is optional so that the trainer also runs standalone;
//! an empty value counts as unset.

use cumulus_api::rank_env;
use std::path::PathBuf;

use thiserror::Error;

/// A rank environment variable could not be used.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum EnvError {
    /// A variable has a value of the wrong form.
    #[error("environment variable {name}={value:?} is invalid: {reason}")]
    Invalid {
        /// The variable.
        name: &'static str,
        /// Its value (cut to 200 characters).
        value: String,
        /// What it should be.
        reason: &'static str,
    },
    /// Variables that only make sense together are not all set.
    #[error("{0}")]
    Incomplete(String),
}

impl EnvError {
    /// Whether the error concerns the resume variables (the trainer then exits with
    /// the resume-validation code).
    pub fn is_resume(&self) -> bool {
        match self {
            EnvError::Invalid { name, .. } => name.starts_with("CUMULUS_RESUME"),
            EnvError::Incomplete(msg) => msg.contains("CUMULUS_RESUME"),
        }
    }
}

/// Where to resume from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumeFrom {
    /// `CUMULUS_RESUME_DIR`: a committed checkpoint part of this rank.
    pub dir: PathBuf,
    /// `CUMULUS_RESUME_STEP`: the step of that checkpoint.
    pub step: u64,
}

/// The rank environment, parsed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RankEnv {
    /// `RANK` (default 0).
    pub rank: u32,
    /// `WORLD_SIZE` (≥ 1 and > rank when set; `None` standalone).
    pub world_size: Option<u32>,
    /// `CUMULUS_ATTEMPT` (default 0 when not run by Cumulus).
    pub attempt: u64,
    /// `CUMULUS_JOB_ID`.
    pub job_id: Option<String>,
    /// `CUMULUS_SHARDS_FILE`.
    pub shards_file: Option<PathBuf>,
    /// `CUMULUS_AGENT_URL`, e.g. `http://127.0.0.1:41234`.
    pub agent_url: Option<String>,
    /// `CUMULUS_AGENT_TOKEN` (set exactly when the agent URL is).
    pub agent_token: Option<String>,
    /// `CUMULUS_AGENT_SOCKET`: the agent's Unix socket, an absolute path (set by an
    /// agent whose ranks run as another user).
    pub agent_socket: Option<PathBuf>,
    /// `CUMULUS_CKPT_STAGING`.
    pub ckpt_staging: Option<PathBuf>,
    /// `CUMULUS_RESUME_DIR` + `CUMULUS_RESUME_STEP`.
    pub resume: Option<ResumeFrom>,
    /// `CUMULUS_DATA_PLAN`: the data plan of an elastic job's rank (a JSON file,
    /// [`cumulus_api::rank_env::RankDataPlan`]); the trainer then reads its records
    /// through the plan ([`crate::trainer::elastic`]).
    pub data_plan: Option<PathBuf>,
}

fn cut(value: &str) -> String {
    value.chars().take(200).collect()
}

impl RankEnv {
    /// Reads the environment of this process.
    pub fn from_process_env() -> Result<Self, EnvError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the environment through `lookup` (name → value).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let get = |name: &str| lookup(name).filter(|v| !v.is_empty());
        fn number<T: std::str::FromStr>(
            name: &'static str,
            value: Option<String>,
            default: T,
            reason: &'static str,
        ) -> Result<T, EnvError> {
            match value {
                None => Ok(default),
                Some(v) => v.trim().parse().map_err(|_| EnvError::Invalid {
                    name,
                    value: cut(&v),
                    reason,
                }),
            }
        }
        let rank: u32 = number(
            rank_env::RANK,
            get(rank_env::RANK),
            0,
            "a non-negative integer",
        )?;
        let world_size: Option<u32> = match get(rank_env::WORLD_SIZE) {
            None => None,
            Some(_) => Some(number(
                rank_env::WORLD_SIZE,
                get(rank_env::WORLD_SIZE),
                1,
                "a positive integer",
            )?),
        };
        if let Some(w) = world_size
            && (w == 0 || rank >= w)
        {
            return Err(EnvError::Invalid {
                name: rank_env::RANK,
                value: rank.to_string(),
                reason: "must be below WORLD_SIZE (which must be ≥ 1)",
            });
        }
        let attempt: u64 = number(
            rank_env::ATTEMPT,
            get(rank_env::ATTEMPT),
            0,
            "a non-negative integer",
        )?;
        let agent_url = get(rank_env::AGENT_URL);
        let agent_token = get(rank_env::AGENT_TOKEN);
        if let Some(url) = &agent_url {
            if !url.starts_with("http://") && !url.starts_with("https://") {
                return Err(EnvError::Invalid {
                    name: rank_env::AGENT_URL,
                    value: cut(url),
                    reason: "an http:// or https:// URL",
                });
            }
            if agent_token.is_none() {
                return Err(EnvError::Incomplete(
                    "CUMULUS_AGENT_URL is set but CUMULUS_AGENT_TOKEN is not".to_string(),
                ));
            }
        }
        let agent_socket = get(rank_env::AGENT_SOCKET).map(PathBuf::from);
        if let Some(socket) = &agent_socket
            && (!socket.is_absolute() || agent_url.is_none())
        {
            return Err(EnvError::Invalid {
                name: rank_env::AGENT_SOCKET,
                value: cut(&socket.display().to_string()),
                reason: "an absolute path, with CUMULUS_AGENT_URL set",
            });
        }
        let ckpt_staging = get(rank_env::CKPT_STAGING).map(PathBuf::from);
        let resume = match (get(rank_env::RESUME_DIR), get(rank_env::RESUME_STEP)) {
            (None, None) => None,
            (Some(dir), Some(step)) => Some(ResumeFrom {
                dir: PathBuf::from(dir),
                step: step.trim().parse().map_err(|_| EnvError::Invalid {
                    name: rank_env::RESUME_STEP,
                    value: cut(&step),
                    reason: "a non-negative integer (the checkpoint step)",
                })?,
            }),
            (Some(_), None) => {
                return Err(EnvError::Incomplete(
                    "CUMULUS_RESUME_DIR is set but CUMULUS_RESUME_STEP is not".to_string(),
                ));
            }
            (None, Some(_)) => {
                return Err(EnvError::Incomplete(
                    "CUMULUS_RESUME_STEP is set but CUMULUS_RESUME_DIR is not".to_string(),
                ));
            }
        };
        Ok(Self {
            rank,
            world_size,
            attempt,
            job_id: get(rank_env::JOB_ID),
            shards_file: get(rank_env::SHARDS_FILE).map(PathBuf::from),
            agent_url,
            agent_token,
            agent_socket,
            ckpt_staging,
            resume,
            data_plan: get(rank_env::DATA_PLAN).map(PathBuf::from),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<RankEnv, EnvError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RankEnv::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_when_standalone() {
        let e = env(&[]).unwrap();
        assert_eq!(e.rank, 0);
        assert_eq!(e.world_size, None);
        assert_eq!(e.attempt, 0);
        assert!(e.agent_url.is_none() && e.resume.is_none() && e.ckpt_staging.is_none());
    }

    #[test]
    fn full_contract() {
        let e = env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("CUMULUS_ATTEMPT", "3"),
            ("CUMULUS_JOB_ID", "job-000001"),
            ("CUMULUS_SHARDS_FILE", "/s"),
            ("CUMULUS_AGENT_URL", "http://127.0.0.1:9"),
            ("CUMULUS_AGENT_TOKEN", "t"),
            ("CUMULUS_CKPT_STAGING", "/st"),
            ("CUMULUS_RESUME_DIR", "/r"),
            ("CUMULUS_RESUME_STEP", "100"),
            ("CUMULUS_DATA_PLAN", "/plan.json"),
        ])
        .unwrap();
        assert_eq!(e.rank, 2);
        assert_eq!(e.data_plan, Some(PathBuf::from("/plan.json")));
        assert_eq!(e.attempt, 3);
        assert_eq!(
            e.resume,
            Some(ResumeFrom {
                dir: PathBuf::from("/r"),
                step: 100
            })
        );
    }

    #[test]
    fn invalid_values_are_named() {
        let err = env(&[("RANK", "x")]).unwrap_err();
        assert!(err.to_string().contains("RANK"));
        assert!(!err.is_resume());
        assert!(env(&[("RANK", "4"), ("WORLD_SIZE", "4")]).is_err());
        assert!(env(&[("WORLD_SIZE", "0")]).is_err());
        assert_eq!(env(&[("RANK", "3")]).unwrap().rank, 3);
        assert!(env(&[("CUMULUS_AGENT_URL", "http://x")]).is_err());
        assert!(
            env(&[
                ("CUMULUS_AGENT_URL", "ftp://x"),
                ("CUMULUS_AGENT_TOKEN", "t")
            ])
            .is_err()
        );
        let err = env(&[("CUMULUS_RESUME_DIR", "/r")]).unwrap_err();
        assert!(err.is_resume());
        let err = env(&[("CUMULUS_RESUME_DIR", "/r"), ("CUMULUS_RESUME_STEP", "-1")]).unwrap_err();
        assert!(err.is_resume(), "{err}");
    }
}
