//! Dispatch of the parsed command line, and the hints printed under an error.

use std::path::Path;

use anyhow::{Context, Result};

use crate::args::{
    ArtifactsCommand, CertKind, CertsCommand, CkptCommand, Cli, ClusterCommand, Command,
    DatasetCommand, GlobalOpts, LocalCommand, OutputFormat, SplitArgs, TokenCommand,
};
use crate::client::{Client, ClientError, RetryPolicy};
use crate::config::{self, ClusterFile, ConfigError};
use crate::dataset::{self, SplitError, SplitOptions};
use crate::demo::{self, DemoOptions};
use crate::jobs;
use crate::local::{self, LocalError, UpOptions};
use crate::logs::LogError;
use crate::output::print_data;
use crate::render;
use crate::watch;

/// Runs one command.
pub async fn run(cli: Cli) -> Result<()> {
    let g = &cli.global;
    let out = g.output;
    match cli.command {
        Command::Submit(a) => {
            jobs::warn_missing_dir("--dataset", &a.job.dataset);
            jobs::submit(&config::resolve(g)?, &a, out).await
        }
        Command::Run(a) => {
            jobs::warn_missing_dir("--dataset", &a.job.dataset);
            crate::run::run(&config::resolve(g)?, &a, out).await
        }
        Command::Artifacts(ArtifactsCommand::Ls(a)) => {
            crate::artifacts::ls(&config::resolve(g)?, &a.job, a.rank, out).await
        }
        Command::Artifacts(ArtifactsCommand::Get(a)) => {
            crate::artifacts::get(&config::resolve(g)?, &a).await
        }
        Command::Status(j) => jobs::status(&config::resolve(g)?, &j.job, out).await,
        Command::Describe(j) => jobs::describe(&config::resolve(g)?, &j.job, out).await,
        Command::List(l) => jobs::list(&config::resolve(g)?, &l, out).await,
        Command::Summary(a) => watch::summary(&config::resolve(g)?, &a, out).await,
        Command::Watch(j) => watch::watch(&config::resolve(g)?, &j.job, out).await,
        Command::Completion(c) => {
            // Into memory first: clap_complete panics on a write error (a closed pipe).
            let mut command = <Cli as clap::CommandFactory>::command();
            let mut script = Vec::new();
            clap_complete::generate(c.shell, &mut command, "cumulusctl", &mut script);
            std::io::Write::write_all(&mut std::io::stdout().lock(), &script)
                .context("writing to stdout")
        }
        Command::Cancel(j) => jobs::cancel(&config::resolve(g)?, &j.job, out).await,
        Command::Pause(j) => jobs::pause(&config::resolve(g)?, &j.job, out).await,
        Command::Resume(j) => jobs::resume(&config::resolve(g)?, &j.job, out).await,
        Command::Delete(a) => jobs::delete(&config::resolve(g)?, &a, out).await,
        Command::Purge(a) => jobs::purge(&config::resolve(g)?, &a, out).await,
        Command::Logs(l) => {
            jobs::logs(
                &config::resolve(g)?,
                &l.job,
                (
                    l.rank,
                    l.tail,
                    l.since.map(|ms| render::now_ms().saturating_sub(ms)),
                ),
                (l.follow, l.raw),
                out,
            )
            .await
        }
        Command::Ckpt(CkptCommand::Ls(j)) => jobs::ckpt_ls(&config::resolve(g)?, &j.job, out).await,
        Command::Cluster(ClusterCommand::Status) => {
            jobs::cluster_status(&config::resolve(g)?, out).await
        }
        Command::Workers => jobs::workers(&config::resolve(g)?, out).await,
        Command::Token(TokenCommand::Create(a)) => {
            jobs::token_create(&config::resolve(g)?, &a, out).await
        }
        Command::Token(TokenCommand::Ls) => jobs::token_ls(&config::resolve(g)?, out).await,
        Command::Token(TokenCommand::Revoke(a)) => {
            jobs::token_revoke(&config::resolve(g)?, &a.name, out).await
        }
        Command::Whoami => jobs::whoami(&config::resolve(g)?, out).await,
        Command::Cluster(ClusterCommand::AddLearner(a)) => {
            jobs::add_learner(&config::resolve(g)?, a.id, &a.member_addr, out).await
        }
        Command::Cluster(ClusterCommand::Promote(m)) => {
            jobs::promote(&config::resolve(g)?, m.id, out).await
        }
        Command::Cluster(ClusterCommand::Remove(m)) => {
            jobs::remove(&config::resolve(g)?, m.id, out).await
        }
        Command::Dataset(DatasetCommand::Split(a)) => dataset_split(a, out).await,
        Command::Local(LocalCommand::Up(a)) => {
            let opts = UpOptions {
                dir: g.local_dir.clone(),
                coordinators: a.coordinators,
                workers: a.workers,
                slots: a.slots,
                bin_dir: a.bin_dir,
                ready_timeout: local::READY_TIMEOUT,
                insecure: g.insecure,
                ranks: match (a.run_as, a.allow_root) {
                    (_, true) => local::Ranks::Root,
                    (Some(value), false) => local::Ranks::RunAs(value),
                    (None, false) => local::Ranks::Default,
                },
            };
            let started = local::up(&opts, true).await?;
            match out {
                OutputFormat::Json | OutputFormat::Yaml => print_data(out, &started.file)?,
                OutputFormat::Table | OutputFormat::Wide => {
                    print!("{}", local::up_summary(&started, &local_dir_flag(g)))
                }
            }
            Ok(())
        }
        Command::Local(LocalCommand::Down(a)) => {
            let dir = g.local_dir.clone();
            let outcomes = tokio::task::spawn_blocking(move || local::down(&dir, a.purge))
                .await
                .context("local down task")??;
            match out {
                OutputFormat::Json | OutputFormat::Yaml => print_data(out, &outcomes)?,
                OutputFormat::Table | OutputFormat::Wide => {
                    for (p, o) in &outcomes {
                        let what = match o {
                            local::StopOutcome::NotRunning => "was not running",
                            local::StopOutcome::Terminated => "stopped",
                            local::StopOutcome::Killed => {
                                "killed (did not stop within 10 s of SIGTERM)"
                            }
                            local::StopOutcome::Stuck => "STILL RUNNING",
                        };
                        println!(
                            "{:<14} pid {:<8} {what}",
                            p.name,
                            p.pid.map_or("-".into(), |p| p.to_string())
                        );
                    }
                    if a.purge {
                        println!("purged {}", g.local_dir.display());
                    }
                }
            }
            Ok(())
        }
        Command::Local(LocalCommand::Status) => local_status(g).await,
        Command::Demo(a) => {
            demo::run(&DemoOptions {
                dir: a.dir,
                keep: a.keep,
                bin_dir: a.bin_dir,
            })
            .await
        }
        Command::Certs(c) => certs(c),
    }
}

/// `dataset split`: the shards written on a blocking thread, then the report.
async fn dataset_split(a: SplitArgs, out: OutputFormat) -> Result<()> {
    let holdout_fraction = a.holdout_fraction.unwrap_or(if a.holdout_out.is_some() {
        dataset::DEFAULT_HOLDOUT_FRACTION
    } else {
        0.0
    });
    let opts = SplitOptions {
        input: a.file,
        shards: a.shards,
        out: a.out,
        holdout_fraction,
        holdout_out: a.holdout_out,
        force: a.force,
    };
    let report = tokio::task::spawn_blocking(move || dataset::split(&opts))
        .await
        .context("dataset split task")??;
    match out {
        OutputFormat::Json | OutputFormat::Yaml => print_data(out, &report)?,
        OutputFormat::Table | OutputFormat::Wide => print!("{}", dataset::report_text(&report)),
    }
    Ok(())
}

/// `certs init` and `certs issue`: files written, one line each.
fn certs(cmd: CertsCommand) -> Result<()> {
    use cumulus_tls::Identity;
    use cumulus_tls::generate::{CA_FILE, CA_KEY_FILE, ClusterCa};
    match cmd {
        CertsCommand::Init(a) => {
            if a.dir.join(CA_FILE).exists() {
                anyhow::bail!(
                    "{} already holds a CA; issue more certificates with `cumulusctl certs issue`",
                    a.dir.display()
                );
            }
            let ca = ClusterCa::generate("cumulus cluster")?;
            ca.write(&a.dir)?;
            println!(
                "CA: {} (key {})",
                a.dir.join(CA_FILE).display(),
                a.dir.join(CA_KEY_FILE).display()
            );
            for id in a.coordinators {
                let files = ca
                    .issue(&Identity::Coordinator(id), &a.hosts)?
                    .write(&a.dir, &format!("coordinator-{id}"))?;
                println!(
                    "coordinator {id}: {} (key {})",
                    files.cert.display(),
                    files.key.display()
                );
            }
            for id in a.workers {
                if Identity::from_uri(&Identity::Worker(id.clone()).uri()).is_none() {
                    anyhow::bail!("worker id {id:?} is not valid: use 1..=128 of [A-Za-z0-9._-@]");
                }
                let files = ca
                    .issue(&Identity::Worker(id.clone()), &a.hosts)?
                    .write(&a.dir, &id)?;
                println!(
                    "worker {id}: {} (key {})",
                    files.cert.display(),
                    files.key.display()
                );
            }
        }
        CertsCommand::Issue(a) => {
            let ca = ClusterCa::load(&a.dir.join(CA_FILE), &a.dir.join(CA_KEY_FILE))?;
            let (identity, name) = match a.kind {
                CertKind::Coordinator => {
                    let id: u64 = a.id.parse().ok().filter(|id| *id != 0).with_context(|| {
                        format!("coordinator id {:?} is not a node id (1, 2, …)", a.id)
                    })?;
                    (Identity::Coordinator(id), format!("coordinator-{id}"))
                }
                CertKind::Worker => (Identity::Worker(a.id.clone()), a.id.clone()),
                CertKind::User => (Identity::User(a.id.clone()), format!("user-{}", a.id)),
            };
            if Identity::from_uri(&identity.uri()).is_none() {
                anyhow::bail!(
                    "{:?} is not a valid id: use 1..=128 of [A-Za-z0-9._-@]",
                    a.id
                );
            }
            let files = ca.issue(&identity, &a.hosts)?.write(&a.dir, &name)?;
            println!(
                "{identity}: {} (key {})",
                files.cert.display(),
                files.key.display()
            );
        }
    }
    Ok(())
}

/// ` --local-dir DIR` when it is not the default, for printed example commands.
fn local_dir_flag(g: &GlobalOpts) -> String {
    if g.local_dir == Path::new(cumulus_api::client_config::DEFAULT_LOCAL_DIR) {
        String::new()
    } else {
        format!(" --local-dir {}", g.local_dir.display())
    }
}

async fn local_status(g: &GlobalOpts) -> Result<()> {
    let mut file = ClusterFile::load(&g.local_dir)?
        .ok_or_else(|| LocalError::NotFound(g.local_dir.clone()))?;
    // A process restarted by hand is found and recorded (its pid, for `local down`).
    let adopted = local::adopt_running(&mut file);
    if !adopted.is_empty() {
        file.store(&g.local_dir)?;
        if !g.output.is_data() {
            println!(
                "found running again (restarted by hand), now recorded: {}\n",
                adopted.join(", ")
            );
        }
    }
    let procs = local::processes(&file);
    let alive: Vec<bool> = procs.iter().map(local::Proc::alive).collect();
    let token = config::read_token_file(&file.token_file).ok();
    let status = match (&token, alive.iter().any(|a| *a)) {
        (Some(token), true) => {
            let conn = config::Conn {
                retry_total: std::time::Duration::from_secs(g.timeout),
                grpc: file.grpc_addrs(),
                http: file.http_addrs(),
                token: token.clone(),
                tls: file
                    .ca_file()
                    .as_deref()
                    .map(config::client_tls)
                    .transpose()?,
            };
            Some(
                Client::with_policy(&conn, RetryPolicy::single_pass(conn.grpc.len()))?
                    .cluster_status()
                    .await,
            )
        }
        _ => None,
    };
    match g.output {
        OutputFormat::Json | OutputFormat::Yaml => {
            #[derive(serde::Serialize)]
            struct P<'a> {
                name: &'a str,
                pid: Option<u32>,
                alive: bool,
                log: &'a Path,
            }
            let v = serde_json::json!({
                "processes": procs.iter().zip(&alive).map(|(p, a)| P { name: &p.name, pid: p.pid, alive: *a, log: &p.log }).collect::<Vec<_>>(),
                "cluster": status.as_ref().and_then(|s| s.as_ref().ok()),
                "cluster_error": status.as_ref().and_then(|s| s.as_ref().err()).map(|e| e.to_string()),
            });
            print_data(g.output, &v)?;
        }
        OutputFormat::Table | OutputFormat::Wide => {
            let mut t = render::table(&["PROCESS", "PID", "ALIVE", "LOG"]);
            for (p, a) in procs.iter().zip(&alive) {
                t.add_row(vec![
                    p.name.clone(),
                    p.pid.map_or("-".into(), |x| x.to_string()),
                    if *a { "yes".into() } else { "no".into() },
                    p.log.display().to_string(),
                ]);
            }
            print!("{}", render::table_text(&t));
            println!();
            match status {
                Some(Ok(s)) => print!("{}", render::cluster_status(&s)),
                Some(Err(e)) => println!("cluster status unavailable: {e}"),
                None => println!(
                    "no process is running; start it with `cumulusctl{} local up`",
                    local_dir_flag(g)
                ),
            }
        }
    }
    Ok(())
}

/// A hint for an error, when one helps: what to check or run next.
pub fn hint(err: &anyhow::Error) -> Option<String> {
    for cause in err.chain() {
        if let Some(e) = cause.downcast_ref::<ClientError>() {
            return match e {
                ClientError::Exhausted(_) => Some(
                    "is the cluster running? check --addr/CUMULUS_ADDR, or `cumulusctl local status` for a local cluster".into(),
                ),
                ClientError::Unauthenticated => Some("the token must be the cluster's (for a local cluster: <local-dir>/token) or a user's (`cumulusctl token create`)".into()),
                _ => None,
            };
        }
        if let Some(e) = cause.downcast_ref::<LogError>() {
            return match e {
                LogError::Exhausted { .. } => {
                    Some("check --http/CUMULUS_HTTP and that the coordinators are up".into())
                }
                LogError::Unauthenticated => Some(
                    "the token must be the cluster's (for a local cluster: <local-dir>/token) or a user's (`cumulusctl token create`)"
                        .into(),
                ),
                _ => None,
            };
        }
        if let Some(e) = cause.downcast_ref::<LocalError>() {
            return match e {
                LocalError::Exited { .. } | LocalError::NotReady { .. } => {
                    Some("fix the cause shown above, then `cumulusctl local down` and `cumulusctl local up` again".into())
                }
                _ => None,
            };
        }
        if let Some(SplitError::BadRow { .. }) = cause.downcast_ref::<SplitError>() {
            return Some("every row must have the same number of comma-separated numbers, the last an integer label ≥ 0, no header".into());
        }
        if let Some(ConfigError::BadToken { .. }) = cause.downcast_ref::<ConfigError>() {
            return Some("the token file must hold one line of visible ASCII".into());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_for_common_failures() {
        let e = anyhow::Error::new(ClientError::Exhausted(
            cumulus_client::CallError::Exhausted {
                method: "GetJob",
                attempts: 20,
                elapsed_ms: 30_000,
                last_addr: "127.0.0.1:1".into(),
                last: "Unavailable".into(),
            },
        ));
        assert!(hint(&e).expect("hint").contains("local status"));
        let e = anyhow::Error::new(ClientError::Unauthenticated).context("status");
        assert!(hint(&e).expect("hint").contains("<local-dir>/token"));
        assert_eq!(hint(&anyhow::anyhow!("plain")), None);
    }
}
