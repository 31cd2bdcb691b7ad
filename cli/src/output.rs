//! Printing a command's answer in the format `-o` asks for: the message as JSON or YAML
//! for scripts, or the command's human text.

use std::io::Write;

use anyhow::{Context, Result};

use crate::args::OutputFormat;

/// Writes `v` to stdout as pretty JSON.
///
/// # Errors
/// A closed or failing stdout.
pub fn print_json<T: serde::Serialize + ?Sized>(v: &T) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, v).context("writing JSON to stdout")?;
    writeln!(out).context("writing to stdout")?;
    Ok(())
}

/// Writes `v` to stdout as YAML (the same fields as [`print_json`]).
///
/// # Errors
/// A value YAML cannot hold, or a closed or failing stdout.
pub fn print_yaml<T: serde::Serialize + ?Sized>(v: &T) -> Result<()> {
    let text = yaml_serde::to_string(v).context("encoding YAML")?;
    print_text(&text)
}

/// Writes `s` to stdout as is.
///
/// # Errors
/// A closed or failing stdout.
pub fn print_text(s: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(s.as_bytes()).context("writing to stdout")?;
    Ok(())
}

/// Writes `v` as JSON or YAML when `output` is one of them.
///
/// # Panics
/// Never for a data format; a table format is the caller's to print (a programmer
/// error, asserted).
///
/// # Errors
/// As [`print_json`] and [`print_yaml`].
pub fn print_data<T: serde::Serialize + ?Sized>(output: OutputFormat, v: &T) -> Result<()> {
    match output {
        OutputFormat::Json => print_json(v),
        OutputFormat::Yaml => print_yaml(v),
        OutputFormat::Table | OutputFormat::Wide => {
            unreachable!("print_data is called for the data formats only")
        }
    }
}
