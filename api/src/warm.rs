//! Warm spares (`JobSpec.warm_spares`, `warm_imports`): the rule for what a job may ask.
//!
//! A worker agent keeps up to `warm_spares` idle interpreters per job it runs ranks of,
//! started in the job's environment with `warm_imports` imported, and a replacement rank
//! of the job takes one instead of a fresh process. A spare runs a rank's script in its
//! own process (`runpy`), so the job's command must start a Python interpreter on a
//! script or a module: `python SCRIPT ARGS…` or `python -m MODULE ARGS…` (`argv[0]`
//! named `python`, `python3` or `python3.N`, looked up in `PATH` like any command).
//! These checks are shared by the CLI, the coordinator's API and `apply`; the Python SDK
//! checks the same (`cumulus.client`).

use crate::limits::{MAX_WARM_IMPORT_BYTES, MAX_WARM_IMPORTS, MAX_WARM_SPARES};

/// How the job's command enters Python, as a warm spare runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PythonEntry<'a> {
    /// `python SCRIPT ARGS…`: the script's path (relative to the working directory).
    Script(&'a str),
    /// `python -m MODULE ARGS…`: the module's dotted name.
    Module(&'a str),
}

/// Whether `program`'s file name is a Python interpreter's: `python`, `python3` or
/// `python3.N` (any directory before it).
pub fn is_python_program(program: &str) -> bool {
    let name = program.rsplit('/').next().unwrap_or(program);
    match name.strip_prefix("python") {
        Some("") | Some("3") => true,
        Some(rest) => rest
            .strip_prefix("3.")
            .is_some_and(|minor| !minor.is_empty() && minor.bytes().all(|b| b.is_ascii_digit())),
        None => false,
    }
}

/// Whether `name` is a dotted Python module name of ASCII identifiers (`torch`,
/// `numpy.linalg`), at most [`MAX_WARM_IMPORT_BYTES`].
pub fn is_module_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_WARM_IMPORT_BYTES
        && name.split('.').all(|part| {
            let mut bytes = part.bytes();
            bytes
                .next()
                .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
                && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
        })
}

/// How `command` enters Python, or `None` when a warm spare cannot run it (not a Python
/// interpreter, or interpreter options before the script).
pub fn python_entry(command: &[String]) -> Option<PythonEntry<'_>> {
    let (program, rest) = command.split_first()?;
    if !is_python_program(program) {
        return None;
    }
    match rest {
        [flag, module, ..] if flag == "-m" && is_module_name(module) => {
            Some(PythonEntry::Module(module))
        }
        [script, ..] if !script.is_empty() && !script.starts_with('-') => {
            Some(PythonEntry::Script(script))
        }
        _ => None,
    }
}

/// Checks a job's warm-spare settings against its command.
///
/// # Errors
/// A sentence naming the field that is wrong and why.
pub fn check(warm_spares: u32, warm_imports: &[String], command: &[String]) -> Result<(), String> {
    if warm_spares > MAX_WARM_SPARES {
        return Err(format!(
            "warm_spares is {warm_spares}, above the limit of {MAX_WARM_SPARES} per worker"
        ));
    }
    if warm_imports.len() > MAX_WARM_IMPORTS {
        return Err(format!(
            "warm_imports names {} modules, above the limit of {MAX_WARM_IMPORTS}",
            warm_imports.len()
        ));
    }
    if let Some(bad) = warm_imports.iter().find(|m| !is_module_name(m)) {
        return Err(format!(
            "warm_imports: {:?} is not a module name (dotted ASCII identifiers, at most \
             {MAX_WARM_IMPORT_BYTES} bytes)",
            bad.chars().take(64).collect::<String>()
        ));
    }
    if warm_spares == 0 && !warm_imports.is_empty() {
        return Err("warm_imports needs warm_spares of at least 1".into());
    }
    if warm_spares > 0 && python_entry(command).is_none() {
        return Err(
            "warm_spares needs a command that starts a Python interpreter on a script or a \
             module (`python SCRIPT ARGS...` or `python -m MODULE ARGS...`, argv[0] named \
             python, python3 or python3.N, no options before the script)"
                .into(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn python_commands_are_recognised() {
        assert_eq!(
            python_entry(&argv("python train.py --x 1")),
            Some(PythonEntry::Script("train.py"))
        );
        assert_eq!(
            python_entry(&argv("/opt/venv/bin/python3.12 -m pkg.train")),
            Some(PythonEntry::Module("pkg.train"))
        );
        assert_eq!(
            python_entry(&argv("python3 /a/b.py")),
            Some(PythonEntry::Script("/a/b.py"))
        );
        for bad in [
            "bash run.sh",
            "python",
            "python -u train.py",
            "python -m",
            "python -m 1bad",
            "python2 x.py",
            "python3.x a.py",
            "pythonista a.py",
        ] {
            assert_eq!(python_entry(&argv(bad)), None, "{bad}");
        }
    }

    #[test]
    fn settings_are_bounded_and_named() {
        let cmd = argv("python train.py");
        assert!(check(0, &[], &argv("bash x")).is_ok(), "off: any command");
        assert!(check(2, &["torch".into(), "numpy.linalg".into()], &cmd).is_ok());
        let e = check(MAX_WARM_SPARES + 1, &[], &cmd).expect_err("too many");
        assert!(e.contains("warm_spares"), "{e}");
        let e = check(1, &["torch;rm".into()], &cmd).expect_err("bad module");
        assert!(e.contains("warm_imports"), "{e}");
        let e = check(0, &["torch".into()], &cmd).expect_err("imports without spares");
        assert!(e.contains("warm_spares"), "{e}");
        let e = check(1, &[], &argv("bash run.sh")).expect_err("not python");
        assert!(e.contains("warm_spares needs"), "{e}");
        let many = vec!["m".to_string(); MAX_WARM_IMPORTS + 1];
        assert!(check(1, &many, &cmd).is_err());
    }
}
