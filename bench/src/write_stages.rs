//! Scenario `write_stages` (issue 3, the profile behind measurement 1): where the time of
//! one replicated write goes, stage by stage, on the leader and on a follower.
//!
//! A 3-coordinator cluster runs with `RUST_LOG=…,cumulus_stage=trace`, so every
//! coordinator logs the stage events of `cumulus_raft_store::stage` (wall-clock
//! nanosecond timestamps, one clock for every process of the machine). The same clients
//! and payload as `write_path` write for the measured window at 1 and 16 clients; then
//! the coordinators' logs are read back and each Raft entry the leader proposed is
//! followed through its stages by its log index:
//!
//! ```text
//! client_write ─ log append (leader: hand-off, write + fdatasync, back) ─ AppendEntries
//!   round trip [follower: decode, log append (hand-off, write + fdatasync, back), reply]
//!   ─ apply ─ client_write returns
//! ```
//!
//! Rows: the p50 and mean of every stage in microseconds, the entry cycle (one proposed
//! entry's start to the next's) and the writes per entry. The trace logging costs the
//! coordinators some CPU, so this scenario's latencies are a little above `write_path`'s;
//! it explains that scenario, it does not replace it. Events whose index cannot be
//! matched (an AppendEntries that carried several entries, a heartbeat) are skipped,
//! and the number of matched entries is each row's sample count.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use cumulus_e2e::{Cluster, ClusterOpts};

use crate::Ctx;
use crate::report::{Row, percentile};
use crate::write_path::{CLIENTS_PER_CHANNEL, Target, Template, measure_system};

/// Scenario name in every row.
const SCENARIO: &str = "write_stages";
/// Concurrent clients measured, in order.
const CONCURRENCY: [usize; 2] = [1, 16];
/// The `RUST_LOG` directive that turns the stage events on.
const STAGE_LOG: &str = "cumulus_stage=trace";
/// Largest coordinator log read back, in bytes (a 10 s run at 16 clients writes ~20 MB).
const MAX_LOG_BYTES: u64 = 512 * 1024 * 1024;

/// Runs the scenario.
pub async fn run(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let measure = ctx.pick(Duration::from_secs(10), Duration::from_secs(1));
    let warmup = ctx.pick(Duration::from_secs(2), Duration::from_millis(300));
    let dir = ctx.work_dir.join(SCENARIO);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let template = Arc::new(Template::new(&dir)?);
    let mut rows = Vec::new();
    for c in CONCURRENCY {
        let cluster = Cluster::start(ClusterOpts {
            coordinators: 3,
            workers: 0,
            coordinator_log: Some(STAGE_LOG.into()),
            ..ClusterOpts::default()
        })
        .await
        .context("starting the 3-node Cumulus cluster")?;
        let mut clients = Vec::new();
        for _ in 0..c.div_ceil(CLIENTS_PER_CHANNEL) {
            clients.push(
                cluster
                    .leader_client()
                    .await
                    .context("connecting to the Cumulus leader")?,
            );
        }
        let m = measure_system(
            c,
            0,
            warmup,
            measure,
            |task| Target::Cumulus(clients[task / CLIENTS_PER_CHANNEL].clone()),
            &template,
            "cumulus",
        )
        .await?;
        rows.push(Row::new(
            SCENARIO,
            &format!("c={c} client-observed write p50"),
            percentile(&m.latencies_ms, 50.0) * 1_000.0,
            "us",
            m.latencies_ms.len(),
        ));
        let mut logs = Vec::new();
        for entry in std::fs::read_dir(cluster.dir.path()).context("listing the cluster dir")? {
            let path = entry.context("listing the cluster dir")?.path();
            let is_coordinator_log = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("coord-") && n.ends_with(".log"));
            if is_coordinator_log {
                logs.push(read_events(&path)?);
            }
        }
        drop(cluster);
        rows.extend(stage_rows(c, &logs)?);
    }
    Ok(rows)
}

/// Positions of events in one log, by log index.
type IndexMap = HashMap<u64, usize>;

/// One stage event: its `stage` and its numeric fields.
#[derive(Debug, Default)]
struct Event {
    /// The `stage` field.
    stage: String,
    /// The other fields that parse as u64, by name.
    fields: HashMap<String, u64>,
}

impl Event {
    /// Field `name`, or 0 when absent.
    fn get(&self, name: &str) -> u64 {
        self.fields.get(name).copied().unwrap_or(0)
    }
}

/// The stage events of one coordinator's log (lines `… cumulus_stage: stage="…" k=v …`).
fn read_events(path: &Path) -> anyhow::Result<Vec<Event>> {
    let len = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    if len > MAX_LOG_BYTES {
        bail!("{} is {len} bytes, over {MAX_LOG_BYTES}", path.display());
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let marker = format!("{}: ", cumulus_raft_store::stage::TARGET);
    let mut events = Vec::new();
    for line in text.lines() {
        let Some(at) = line.find(&marker) else {
            continue;
        };
        let mut event = Event::default();
        for token in line[at + marker.len()..].split_whitespace() {
            let Some((key, value)) = token.split_once('=') else {
                continue;
            };
            if key == "stage" {
                event.stage = value.trim_matches('"').to_string();
            } else if let Ok(v) = value.parse::<u64>() {
                event.fields.insert(key.to_string(), v);
            }
        }
        if !event.stage.is_empty() {
            events.push(event);
        }
    }
    Ok(events)
}

/// Microseconds from `a` to `b` (both ns), 0 when `b` is before `a`.
fn us(a: u64, b: u64) -> f64 {
    b.saturating_sub(a) as f64 / 1_000.0
}

/// The per-stage rows of one run at `c` clients from every coordinator's events.
fn stage_rows(c: usize, logs: &[Vec<Event>]) -> anyhow::Result<Vec<Row>> {
    let has = |events: &Vec<Event>, stage: &str| events.iter().any(|e| e.stage == stage);
    let Some(leader) = logs.iter().position(|l| has(l, "submit")) else {
        bail!("no coordinator logged a submit stage event (is {STAGE_LOG} honoured?)");
    };
    let by_index = |events: &[Event], stage: &str, key: &str| -> IndexMap {
        let mut m = HashMap::new();
        for (i, e) in events.iter().enumerate() {
            if e.stage == stage {
                m.insert(e.get(key), i);
            }
        }
        m
    };
    let l = &logs[leader];
    let l_append = by_index(l, "log_append", "last_index");
    let l_apply = by_index(l, "apply", "last_index");
    let mut l_replicate: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, e) in l.iter().enumerate() {
        if e.stage == "replicate" {
            l_replicate.entry(e.get("last_index")).or_default().push(i);
        }
    }
    let followers: Vec<(&Vec<Event>, IndexMap, IndexMap)> = logs
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != leader)
        .map(|(_, f)| {
            (
                f,
                by_index(f, "append_entries_served", "last_index"),
                by_index(f, "log_append", "last_index"),
            )
        })
        .collect();

    let mut stages: Vec<(&str, Vec<f64>)> = STAGES.iter().map(|s| (*s, Vec::new())).collect();
    let mut push = |name: &str, v: f64| {
        if let Some((_, xs)) = stages.iter_mut().find(|(n, _)| *n == name) {
            xs.push(v);
        }
    };
    let writes = l.iter().filter(|e| e.stage == "submit").count();
    for e in l.iter().filter(|e| e.stage == "submit") {
        push(S_CHECKS, us(e.get("start_ns"), e.get("proposed_ns")));
        push(S_PROPOSED, us(e.get("proposed_ns"), e.get("end_ns")));
    }
    let mut cw_starts: Vec<u64> = Vec::new();
    for cw in l.iter().filter(|e| e.stage == "client_write") {
        let index = cw.get("index");
        cw_starts.push(cw.get("start_ns"));
        let (Some(&a), Some(&ap), Some(reps)) = (
            l_append.get(&index),
            l_apply.get(&index),
            l_replicate.get(&index),
        ) else {
            continue;
        };
        let (a, ap) = (&l[a], &l[ap]);
        let Some(first) = reps.iter().map(|&i| &l[i]).min_by_key(|r| r.get("end_ns")) else {
            continue;
        };
        // The follower whose served request lies inside the first answered round trip.
        let Some((served, f_append)) = followers.iter().find_map(|(f, served, appended)| {
            let s = &f[*served.get(&index)?];
            let fa = &f[*appended.get(&index)?];
            (s.get("received_ns") >= first.get("start_ns")
                && s.get("end_ns") <= first.get("end_ns"))
            .then_some((s, fa))
        }) else {
            continue;
        };
        push(S_CW_TO_APPEND, us(cw.get("start_ns"), a.get("called_ns")));
        push(S_L_HANDOFF, us(a.get("called_ns"), a.get("io_start_ns")));
        push(S_L_IO, us(a.get("io_start_ns"), a.get("io_end_ns")));
        push(S_L_BACK, us(a.get("io_end_ns"), a.get("done_ns")));
        let first_sent = reps
            .iter()
            .map(|&i| l[i].get("start_ns"))
            .min()
            .unwrap_or(0);
        // Since openraft 0.10 the leader replicates once its append has written the
        // entries (`written_ns`), while its own fdatasync runs.
        push(S_TO_REPLICATE, us(a.get("written_ns"), first_sent));
        let rtt = us(first.get("start_ns"), first.get("end_ns"));
        let served_us = us(served.get("received_ns"), served.get("end_ns"));
        push(S_RTT, rtt);
        push(S_TRANSPORT, (rtt - served_us).max(0.0));
        push(
            S_F_DECODE,
            us(served.get("received_ns"), served.get("decoded_ns")),
        );
        push(
            S_F_TO_APPEND,
            us(served.get("decoded_ns"), f_append.get("called_ns")),
        );
        push(
            S_F_HANDOFF,
            us(f_append.get("called_ns"), f_append.get("io_start_ns")),
        );
        push(
            S_F_IO,
            us(f_append.get("io_start_ns"), f_append.get("io_end_ns")),
        );
        push(
            S_F_BACK,
            us(f_append.get("io_end_ns"), f_append.get("done_ns")),
        );
        push(S_F_REPLY, us(f_append.get("done_ns"), served.get("end_ns")));
        push(S_TO_APPLY, us(first.get("end_ns"), ap.get("start_ns")));
        push(S_APPLY, us(ap.get("start_ns"), ap.get("end_ns")));
        push(S_ANSWERED, us(ap.get("end_ns"), cw.get("end_ns")));
        push(S_CW, us(cw.get("start_ns"), cw.get("end_ns")));
    }
    cw_starts.sort_unstable();
    for w in cw_starts.windows(2) {
        push(S_CYCLE, us(w[0], w[1]));
    }
    let entries = cw_starts.len();
    if entries == 0 || stages.iter().all(|(_, xs)| xs.is_empty()) {
        bail!("no proposed entry could be followed through its stages");
    }
    let mut rows = Vec::new();
    for (name, xs) in &stages {
        if xs.is_empty() {
            continue;
        }
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        rows.push(Row::new(
            SCENARIO,
            &format!("c={c} {name} p50"),
            percentile(xs, 50.0),
            "us",
            xs.len(),
        ));
        rows.push(Row::new(
            SCENARIO,
            &format!("c={c} {name} mean"),
            mean,
            "us",
            xs.len(),
        ));
    }
    rows.push(Row::new(
        SCENARIO,
        &format!("c={c} writes per proposed entry"),
        writes as f64 / entries as f64,
        "ratio",
        entries,
    ));
    Ok(rows)
}

const S_CHECKS: &str = "submit: checks before proposing";
const S_PROPOSED: &str = "submit: proposed -> answered";
const S_CW: &str = "entry: client_write total";
const S_CYCLE: &str = "entry: start to next entry's start";
const S_CW_TO_APPEND: &str = "leader: client_write -> log append";
const S_L_HANDOFF: &str = "leader: append (write) -> fdatasync starts";
const S_L_IO: &str = "leader: fdatasync (sync thread)";
const S_L_BACK: &str = "leader: fdatasync -> flush reported";
const S_TO_REPLICATE: &str = "leader: append written -> AppendEntries sent";
const S_RTT: &str = "AppendEntries round trip (first answer)";
const S_TRANSPORT: &str = "  of it: transport and encode (not on follower)";
const S_F_DECODE: &str = "  follower: decode";
const S_F_TO_APPEND: &str = "  follower: decoded -> log append";
const S_F_HANDOFF: &str = "  follower: append (write) -> fdatasync starts";
const S_F_IO: &str = "  follower: fdatasync (sync thread)";
const S_F_BACK: &str = "  follower: fdatasync -> flush reported";
const S_F_REPLY: &str = "  follower: flush reported -> reply encoded";
const S_TO_APPLY: &str = "leader: answer -> apply starts";
const S_APPLY: &str = "leader: apply";
const S_ANSWERED: &str = "leader: applied -> client_write returns";

/// Every stage in the order of the rows.
const STAGES: &[&str] = &[
    S_CHECKS,
    S_PROPOSED,
    S_CW,
    S_CYCLE,
    S_CW_TO_APPEND,
    S_L_HANDOFF,
    S_L_IO,
    S_L_BACK,
    S_TO_REPLICATE,
    S_RTT,
    S_TRANSPORT,
    S_F_DECODE,
    S_F_TO_APPEND,
    S_F_HANDOFF,
    S_F_IO,
    S_F_BACK,
    S_F_REPLY,
    S_TO_APPLY,
    S_APPLY,
    S_ANSWERED,
];
