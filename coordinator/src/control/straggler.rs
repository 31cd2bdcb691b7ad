//! Straggler detection, pure: from the steps each rank of a running job reported (the
//! leader's soft progress, sampled by the control loop) to the ranks whose steps/s has
//! stayed below the job's fraction of the median of its other ranks for the job's
//! window. No clock (the caller passes the leader's time), no I/O, no randomness: the
//! same samples give the same verdicts.
//!
//! The rules, each there to keep a healthy rank from being flagged:
//! - A rank's rate is measured over a lookback ([`lookback_ms`]: a sixth of the window,
//!   5..=10 s), from samples taken after its attempt's first progress report: no rate
//!   during start-up, nor for a new attempt until it has a full lookback.
//! - A rank is compared with the median of the *other* ranks' rates (so with two ranks,
//!   with the other one; a rank alone is never judged), and only while every rank has a
//!   rate and that median stands for at least [`MIN_REFERENCE_STEPS`] steps in a
//!   lookback: coarser rates are too noisy to judge (slow steps, a stall that hits
//!   every rank, such as a synchronous checkpoint or a collective waiting).
//! - A rank is flagged once the time it was judged below adds up to the window with no
//!   lookback's worth of judgements "not below" in between (a shorter spell, such as
//!   another rank's pause lowering the median, interrupts without resetting); a pass
//!   where the job cannot be judged (a rank restarting, a stall of every rank) neither
//!   adds nor resets. A new attempt starts from nothing.
//!
//! A limit to know: ranks that wait for each other at every step (synchronous data
//! parallel training) all report the slowest one's rate, so none of them is below the
//! others; detection finds ranks that run at their own pace between synchronizations.

use std::collections::{BTreeMap, VecDeque};

/// Fewest steps the others' median rate must stand for in one lookback for a rank to be
/// judged: with fewer, one step more or less (reports arrive with heartbeats) would move
/// a rate past the fraction.
pub const MIN_REFERENCE_STEPS: u64 = 8;
/// Shortest lookback, in milliseconds (a few heartbeats).
pub const MIN_LOOKBACK_MS: u64 = 5_000;
/// Longest lookback, in milliseconds.
pub const MAX_LOOKBACK_MS: u64 = 10_000;
/// Least time between two kept samples of a rank, in milliseconds (a lookback keeps at
/// most `MAX_LOOKBACK_MS / SAMPLE_INTERVAL_MS + 2` samples per rank).
pub const SAMPLE_INTERVAL_MS: u64 = 250;
/// Longest time one pass may add to a rank's time below, in milliseconds: a loop that
/// stalled does not turn one observation into a window.
pub const MAX_PASS_MS: u64 = 2_000;

/// A job's straggler rule: its fraction (thousandths) and window (ms).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Below means a rate under this share of the others' median, in thousandths.
    pub fraction_permille: u32,
    /// How long a rank must stay below to be flagged, in milliseconds.
    pub window_ms: u64,
}

/// The lookback a rate is measured over for `window_ms`: a sixth of it, within
/// [`MIN_LOOKBACK_MS`]`..=`[`MAX_LOOKBACK_MS`].
pub fn lookback_ms(window_ms: u64) -> u64 {
    (window_ms / 6).clamp(MIN_LOOKBACK_MS, MAX_LOOKBACK_MS)
}

/// What the caller saw of one rank's current attempt at this pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankSample {
    /// Global rank.
    pub rank: u32,
    /// Its current attempt.
    pub attempt: u32,
    /// Its latest reported step.
    pub step: u64,
    /// The attempt runs and has made its first progress report (else it is not judged,
    /// and neither is the job).
    pub reported: bool,
}

/// A rank found to be a straggler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Global rank.
    pub rank: u32,
    /// The attempt.
    pub attempt: u32,
    /// Its rate over the lookback, in thousandths of a step per second.
    pub millisteps_per_s: u64,
    /// The median rate of the other ranks, in thousandths of a step per second.
    pub median_millisteps_per_s: u64,
}

/// What the detector remembers of one rank between passes.
#[derive(Clone, Debug, Default)]
struct RankMemory {
    attempt: u32,
    /// `(leader ms, step)` since its first report, oldest first, spanning a lookback.
    samples: VecDeque<(u64, u64)>,
    /// Time judged below since its last reset, in milliseconds.
    below_ms: u64,
    /// Time judged not below since it was last judged below, in milliseconds: a lookback
    /// of it resets `below_ms`.
    above_ms: u64,
}

/// What the detector remembers of one job between passes (the leader's soft state:
/// lost on a leader change, which only delays a flag).
#[derive(Clone, Debug, Default)]
pub struct JobMemory {
    ranks: BTreeMap<u32, RankMemory>,
    /// Leader time of the previous pass.
    last_ms: Option<u64>,
}

impl JobMemory {
    /// One pass at leader time `now_ms` over every rank of the job (`ranks`, one entry
    /// each): records the samples, judges, and returns the ranks whose time below has
    /// reached the rule's window (again at every later pass while it stays so).
    pub fn observe(&mut self, rule: Rule, now_ms: u64, ranks: &[RankSample]) -> Vec<Verdict> {
        let lookback = lookback_ms(rule.window_ms);
        let dt = self
            .last_ms
            .map_or(0, |t| now_ms.saturating_sub(t).min(MAX_PASS_MS));
        self.last_ms = Some(now_ms);
        self.ranks.retain(|r, _| ranks.iter().any(|s| s.rank == *r));
        // Record, and measure each rank's rate over a full lookback.
        let mut rates: Vec<Option<u64>> = Vec::with_capacity(ranks.len());
        for s in ranks {
            let m = self.ranks.entry(s.rank).or_default();
            if m.attempt != s.attempt || !s.reported {
                *m = RankMemory {
                    attempt: s.attempt,
                    ..RankMemory::default()
                };
            }
            if !s.reported {
                rates.push(None);
                continue;
            }
            if m.samples
                .back()
                .is_none_or(|(at, _)| now_ms >= at + SAMPLE_INTERVAL_MS)
            {
                m.samples.push_back((now_ms, s.step));
            } else if let Some(last) = m.samples.back_mut() {
                last.1 = last.1.max(s.step);
            }
            // Keep one sample at or before the lookback's start.
            while m.samples.len() >= 2 && m.samples[1].0 + lookback <= now_ms {
                m.samples.pop_front();
            }
            rates.push(rate(&m.samples, now_ms, lookback));
        }
        let judged = ranks.len() >= 2 && rates.iter().all(Option::is_some);
        let rates: Vec<u64> = rates.into_iter().flatten().collect();
        let mut sorted = rates.clone();
        sorted.sort_unstable();
        let mut verdicts = Vec::new();
        for (s, rate) in ranks.iter().zip(&rates) {
            let m = self.ranks.get_mut(&s.rank).expect("recorded above");
            if !judged {
                continue; // neither adds nor resets
            }
            let median = median_without(&sorted, *rate);
            // The others' median stands for too few steps in a lookback to judge.
            if u128::from(median) * u128::from(lookback)
                < u128::from(MIN_REFERENCE_STEPS) * 1_000_000
            {
                continue;
            }
            let below =
                u128::from(*rate) * 1000 < u128::from(rule.fraction_permille) * u128::from(median);
            if below {
                m.below_ms = m.below_ms.saturating_add(dt);
                m.above_ms = 0;
            } else {
                m.above_ms = m.above_ms.saturating_add(dt);
                if m.above_ms >= lookback {
                    m.below_ms = 0;
                }
            }
            if m.below_ms >= rule.window_ms {
                verdicts.push(Verdict {
                    rank: s.rank,
                    attempt: s.attempt,
                    millisteps_per_s: *rate,
                    median_millisteps_per_s: median,
                });
            }
        }
        verdicts
    }
}

/// The rate over the lookback ending at `now_ms`, in thousandths of a step per second,
/// once the samples span it (`None` before).
fn rate(samples: &VecDeque<(u64, u64)>, now_ms: u64, lookback: u64) -> Option<u64> {
    let (t0, s0) = *samples.front()?;
    let (_, s1) = *samples.back()?;
    if t0 + lookback > now_ms {
        return None;
    }
    let elapsed = now_ms - t0;
    let steps = s1.saturating_sub(s0);
    Some((u128::from(steps) * 1_000_000 / u128::from(elapsed.max(1))) as u64)
}

/// The median of `sorted` without one element equal to `value` (which it holds): the
/// middle one, or the mean of the two middle ones. O(1).
fn median_without(sorted: &[u64], value: u64) -> u64 {
    let i = sorted.partition_point(|x| *x < value);
    let others = sorted.len() - 1;
    let at = |j: usize| if j < i { sorted[j] } else { sorted[j + 1] };
    if others == 0 {
        return 0;
    }
    if others % 2 == 1 {
        at(others / 2)
    } else {
        (at(others / 2 - 1) + at(others / 2)) / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: Rule = Rule {
        fraction_permille: 700,
        window_ms: 60_000,
    };
    /// The control loop's pass interval.
    const TICK_MS: u64 = 100;
    /// Reports reach the leader with heartbeats.
    const HEARTBEAT_MS: u64 = 1_000;

    /// A simulated job: each rank's true speed over time and its reported step as the
    /// leader sees it (updated once per heartbeat, each rank at its own phase).
    struct Sim {
        ranks: Vec<SimRank>,
        memory: JobMemory,
        now_ms: u64,
        rule: Rule,
        /// First verdict per rank: (leader ms, verdict).
        flagged: BTreeMap<u32, (u64, Verdict)>,
    }

    struct SimRank {
        /// Steps per second at leader time ms.
        speed: Box<dyn Fn(u64) -> f64>,
        progress: f64,
        seen_step: u64,
        phase_ms: u64,
        attempt: u32,
        reported_after_ms: u64,
    }

    impl Sim {
        fn new(rule: Rule, speeds: Vec<Box<dyn Fn(u64) -> f64>>) -> Self {
            let n = speeds.len() as u64;
            Self {
                ranks: speeds
                    .into_iter()
                    .enumerate()
                    .map(|(i, speed)| SimRank {
                        speed,
                        progress: 0.0,
                        seen_step: 0,
                        phase_ms: i as u64 * HEARTBEAT_MS / n / TICK_MS * TICK_MS,
                        attempt: 0,
                        reported_after_ms: 2_000 + i as u64 * 500,
                    })
                    .collect(),
                memory: JobMemory::default(),
                now_ms: 0,
                rule,
                flagged: BTreeMap::new(),
            }
        }

        fn run_until(&mut self, end_ms: u64) {
            while self.now_ms < end_ms {
                self.now_ms += TICK_MS;
                let now = self.now_ms;
                for r in &mut self.ranks {
                    r.progress += (r.speed)(now) * TICK_MS as f64 / 1000.0;
                    if now % HEARTBEAT_MS == r.phase_ms % HEARTBEAT_MS {
                        r.seen_step = r.progress as u64;
                    }
                }
                let samples: Vec<RankSample> = self
                    .ranks
                    .iter()
                    .enumerate()
                    .map(|(i, r)| RankSample {
                        rank: i as u32,
                        attempt: r.attempt,
                        step: r.seen_step,
                        reported: now >= r.reported_after_ms,
                    })
                    .collect();
                for v in self.memory.observe(self.rule, now, &samples) {
                    self.flagged.entry(v.rank).or_insert((now, v));
                }
            }
        }

        /// Restarts rank `i`: a new attempt from its last step, silent for `silent_ms`.
        fn restart(&mut self, i: usize, silent_ms: u64) {
            let r = &mut self.ranks[i];
            r.attempt += 1;
            r.reported_after_ms = self.now_ms + silent_ms;
        }
    }

    fn constant(steps_per_s: f64) -> Box<dyn Fn(u64) -> f64> {
        Box::new(move |_| steps_per_s)
    }

    /// Full speed until `from_ms`, then `share` of it.
    fn slowed(steps_per_s: f64, from_ms: u64, share: f64) -> Box<dyn Fn(u64) -> f64> {
        Box::new(move |t| {
            if t >= from_ms {
                steps_per_s * share
            } else {
                steps_per_s
            }
        })
    }

    #[test]
    fn a_rank_at_a_third_of_the_speed_is_flagged_within_the_window_and_ten_seconds() {
        for world in [2, 3, 4, 8] {
            let mut speeds: Vec<Box<dyn Fn(u64) -> f64>> =
                (0..world - 1).map(|_| constant(10.0)).collect();
            speeds.push(slowed(10.0, 30_000, 0.3));
            let mut sim = Sim::new(RULE, speeds);
            sim.run_until(200_000);
            let slow = world as u32 - 1;
            assert_eq!(sim.flagged.len(), 1, "world {world}: {:?}", sim.flagged);
            let (at, v) = sim.flagged[&slow];
            let after = at - 30_000;
            assert!(
                (RULE.window_ms..=RULE.window_ms + 10_000).contains(&after),
                "world {world}: flagged {after} ms after the slowdown"
            );
            assert!(v.millisteps_per_s < 3_500, "{v:?}");
            assert!(
                (9_000..=11_000).contains(&v.median_millisteps_per_s),
                "{v:?}"
            );
        }
    }

    #[test]
    fn no_false_flag_at_start_up_at_world_size_one_or_after_a_restart() {
        // Ranks that start one after another, the first ones slow at first (imports,
        // compilation), all at the same speed after.
        let warm = |until: u64| -> Box<dyn Fn(u64) -> f64> {
            Box::new(move |t| if t < until { 1.0 } else { 10.0 })
        };
        let mut sim = Sim::new(RULE, vec![warm(20_000), warm(5_000), warm(10_000)]);
        sim.run_until(300_000);
        assert!(sim.flagged.is_empty(), "{:?}", sim.flagged);

        // A rank alone is never judged, however slow.
        let mut sim = Sim::new(RULE, vec![constant(0.5)]);
        sim.run_until(300_000);
        assert!(sim.flagged.is_empty());

        // A rank restarted (a new attempt, silent for 20 s): not flagged.
        let mut sim = Sim::new(RULE, vec![constant(10.0), constant(10.0), constant(10.0)]);
        sim.run_until(90_000);
        sim.restart(1, 20_000);
        sim.run_until(300_000);
        assert!(sim.flagged.is_empty(), "{:?}", sim.flagged);
    }

    #[test]
    fn stalls_of_every_rank_and_slow_steps_flag_nothing() {
        // A checkpoint every 30 s that stalls every rank for 10 s, with the ranks
        // leaving it up to 2 s apart.
        let stalled = |skew: u64| -> Box<dyn Fn(u64) -> f64> {
            Box::new(move |t| {
                if (t + skew) % 30_000 < 10_000 {
                    0.0
                } else {
                    10.0
                }
            })
        };
        let mut sim = Sim::new(RULE, vec![stalled(0), stalled(1_000), stalled(2_000)]);
        sim.run_until(400_000);
        assert!(sim.flagged.is_empty(), "{:?}", sim.flagged);

        // Steps of 3 s (too coarse to judge), one rank at half that speed: not judged.
        let mut sim = Sim::new(RULE, vec![constant(0.33), constant(0.33), constant(0.16)]);
        sim.run_until(400_000);
        assert!(sim.flagged.is_empty(), "{:?}", sim.flagged);

        // A pause of one rank shorter than the window (a GC, a slow read) is forgiven.
        let paused: Box<dyn Fn(u64) -> f64> = Box::new(|t| {
            if (60_000..100_000).contains(&t) {
                0.0
            } else {
                10.0
            }
        });
        let mut sim = Sim::new(RULE, vec![constant(10.0), constant(10.0), paused]);
        sim.run_until(300_000);
        assert!(sim.flagged.is_empty(), "{:?}", sim.flagged);
    }

    #[test]
    fn a_stall_of_every_rank_holds_a_stragglers_time_below_instead_of_resetting_it() {
        // Rank 2 at 30% all along; every rank stalls 25 s in every 60 s, longer than a
        // lookback: while the stall fills a lookback no rank can be judged, which must
        // not reset rank 2's time below (about 49 s per cycle, short of the window).
        let stalled = |share: f64| -> Box<dyn Fn(u64) -> f64> {
            Box::new(move |t| {
                if t % 60_000 < 25_000 {
                    0.0
                } else {
                    10.0 * share
                }
            })
        };
        let mut sim = Sim::new(RULE, vec![stalled(1.0), stalled(1.0), stalled(0.3)]);
        sim.run_until(300_000);
        assert_eq!(sim.flagged.keys().copied().collect::<Vec<_>>(), vec![2]);
    }

    /// xorshift64*: a seeded, dependency-free generator for the benchmark below.
    struct Rng(u64);

    impl Rng {
        fn next_f64(&mut self) -> f64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
        }

        fn normal(&mut self) -> f64 {
            let (u, v) = (self.next_f64().max(1e-12), self.next_f64());
            (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
        }
    }

    /// One simulated run of `minutes` with `world` ranks and a noise like a real job's:
    /// each rank's steady speed off by a few percent, step-to-step jitter (a 10% spread
    /// over each second), a pause of one rank (0.5-3 s: a GC, a slow read) about every 2
    /// minutes per rank, and every 30 s a checkpoint that stalls every rank 2-5 s, each
    /// leaving it up to 1 s apart; reports reach the leader with 1 s heartbeats at a
    /// random phase per rank. `slow`: (rank, from ms, share) slows one rank. Returns the
    /// first flag per rank (leader ms).
    fn noisy_run(
        rng: &mut Rng,
        world: usize,
        minutes: u64,
        slow: Option<(usize, u64, f64)>,
    ) -> BTreeMap<u32, u64> {
        let end = minutes * 60_000;
        let base = 5.0 + 20.0 * rng.next_f64();
        let own: Vec<f64> = (0..world).map(|_| 1.0 + 0.03 * rng.normal()).collect();
        let phase: Vec<u64> = (0..world)
            .map(|_| (rng.next_f64() * 10.0) as u64 * 100)
            .collect();
        let mut progress = vec![0.0f64; world];
        let mut seen = vec![0u64; world];
        let mut jitter = vec![1.0f64; world];
        let mut paused_until = vec![0u64; world];
        let mut stall: (u64, u64, Vec<u64>) = (0, 0, vec![0; world]);
        let mut memory = JobMemory::default();
        let mut flagged = BTreeMap::new();
        let mut now = 0;
        while now < end {
            now += TICK_MS;
            if now % 30_000 == 0 {
                let len = 2_000 + (rng.next_f64() * 3_000.0) as u64;
                let skew = (0..world)
                    .map(|_| (rng.next_f64() * 1_000.0) as u64)
                    .collect();
                stall = (now, now + len, skew);
            }
            for r in 0..world {
                if now % 1_000 == 0 {
                    jitter[r] = (1.0 + 0.1 * rng.normal()).max(0.2);
                    if rng.next_f64() < 1.0 / 120.0 {
                        paused_until[r] = now + 500 + (rng.next_f64() * 2_500.0) as u64;
                    }
                }
                let stalled = now >= stall.0 && now < stall.1 + stall.2[r];
                let share = match slow {
                    Some((s, from, share)) if s == r && now >= from => share,
                    _ => 1.0,
                };
                if !stalled && now >= paused_until[r] {
                    progress[r] += base * own[r] * jitter[r] * share * TICK_MS as f64 / 1000.0;
                }
                if now % HEARTBEAT_MS == phase[r] {
                    seen[r] = progress[r] as u64;
                }
            }
            let samples: Vec<RankSample> = (0..world)
                .map(|r| RankSample {
                    rank: r as u32,
                    attempt: 0,
                    step: seen[r],
                    reported: now >= 3_000,
                })
                .collect();
            for v in memory.observe(RULE, now, &samples) {
                flagged.entry(v.rank).or_insert(now);
            }
        }
        flagged
    }

    /// The straggler benchmark (docs/benchmarks.md): 100 clean simulated runs of 10
    /// minutes at world sizes 2, 4 and 8 must flag nothing, a rank slowed to 30% of its
    /// speed must be flagged within the window + 10 s (50%: printed), and one slowed to
    /// 80% never. Simulated through the detector with the noise of [`noisy_run`]; prints
    /// the figures.
    #[test]
    #[ignore = "a benchmark: cargo test -p cumulus-coordinator --lib straggler_benchmark -- --ignored --nocapture"]
    fn straggler_benchmark() {
        let mut rng = Rng(0x5EED_CAFE_F00D_1234);
        let mut false_flags = 0;
        for run in 0..100 {
            let world = [2, 4, 8][run % 3];
            false_flags += noisy_run(&mut rng, world, 10, None).len();
        }
        println!("clean runs: 100 x 10 min (world 2/4/8), false flags: {false_flags}");
        for share in [0.3, 0.5] {
            for world in [2, 4, 8] {
                let mut late: Vec<u64> = Vec::new();
                let mut others = 0;
                for _ in 0..20 {
                    let from = 60_000 + (rng.next_f64() * 60_000.0) as u64;
                    let flagged = noisy_run(&mut rng, world, 5, Some((world - 1, from, share)));
                    others += flagged.keys().filter(|r| **r as usize != world - 1).count();
                    late.push(
                        flagged
                            .get(&(world as u32 - 1))
                            .map_or(u64::MAX, |at| at - from),
                    );
                }
                late.sort_unstable();
                println!(
                    "slowed to {share} at world size {world}, 20 runs: flagged after p50 {} ms, \
                     max {} ms (window {} ms; {} never), other ranks flagged: {others}",
                    late[late.len() / 2],
                    late[late.len() - 1],
                    RULE.window_ms,
                    late.iter().filter(|l| **l == u64::MAX).count()
                );
                if share <= 0.3 {
                    assert!(late[late.len() - 1] <= RULE.window_ms + 10_000, "{late:?}");
                }
                assert_eq!(others, 0);
            }
        }
        // Slower, but above the fraction: never flagged.
        let mut flagged_runs = 0;
        for run in 0..30 {
            let world = [2, 4, 8][run % 3];
            let flagged = noisy_run(&mut rng, world, 5, Some((world - 1, 60_000, 0.8)));
            flagged_runs += usize::from(!flagged.is_empty());
        }
        println!("slowed to 0.8, 30 runs of 5 min: runs with a flag: {flagged_runs}");
        assert_eq!(flagged_runs, 0);
        assert_eq!(false_flags, 0);
    }

    #[test]
    fn the_median_is_that_of_the_other_ranks() {
        assert_eq!(median_without(&[1, 5, 9], 1), 7);
        assert_eq!(median_without(&[1, 5, 9], 9), 3);
        assert_eq!(median_without(&[3, 10], 3), 10);
        assert_eq!(median_without(&[3, 10], 10), 3);
        assert_eq!(median_without(&[7], 7), 0);
        assert_eq!(median_without(&[2, 2, 2, 8], 2), 2);
    }

    #[test]
    fn a_flag_needs_the_whole_window_below_and_a_short_window_is_honoured() {
        let rule = Rule {
            fraction_permille: 700,
            window_ms: 4_000,
        };
        let mut sim = Sim::new(rule, vec![constant(20.0), slowed(20.0, 20_000, 0.3)]);
        sim.run_until(60_000);
        let (at, _) = sim.flagged[&1];
        // Lookback 5 s: the rate is below after ~2 s, then 4 s of window.
        assert!(
            (20_000 + 4_000..=20_000 + 4_000 + 6_000).contains(&at),
            "{at}"
        );
        // A rank at 85% of the others with a fraction of 0.7 is never below.
        let mut sim = Sim::new(rule, vec![constant(20.0), slowed(20.0, 20_000, 0.85)]);
        sim.run_until(120_000);
        assert!(sim.flagged.is_empty(), "{:?}", sim.flagged);
    }
}
