//! Warnings a submit is answered with (`SubmitJobResponse.warnings`): what the
//! coordinator accepts but the submitter should hear about before the job runs. The
//! coordinator computes them once, from the spec as it will run (defaults filled in), so
//! every client says the same: `cumulusctl` prints each on stderr as `warning: ...`, the
//! Python SDK raises each as a `cumulus.SubmitWarning` (Python `warnings`).

/// The warnings of a job spec, one sentence each (empty: nothing to say).
///
/// `max_restarts` is the job's restart budget (the default filled in); `checkpoints`
/// whether it has a checkpoint target (`ckpt_dir` or `ckpt_url`, also when taken from
/// the job it resumes from).
pub fn submit_warnings(max_restarts: u32, checkpoints: bool) -> Vec<String> {
    let mut out = Vec::new();
    if max_restarts > 0 && !checkpoints {
        out.push(restarts_without_checkpoints(max_restarts));
    }
    out
}

/// The warning for a job that may restart but has nowhere to checkpoint.
pub fn restarts_without_checkpoints(max_restarts: u32) -> String {
    format!(
        "the job may restart up to {max_restarts} times but has no checkpoint directory: \
         every restart starts over from step 0 (give it --ckpt-dir / ckpt_dir to resume \
         from its last checkpoint, or --max-restarts 0 / max_restarts=0 for none)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_restarts_without_a_checkpoint_target_warn() {
        assert!(submit_warnings(0, false).is_empty());
        assert!(submit_warnings(3, true).is_empty());
        let w = submit_warnings(3, false);
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("up to 3 times"), "{}", w[0]);
        assert!(w[0].contains("step 0"), "{}", w[0]);
    }
}
