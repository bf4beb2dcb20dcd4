//! The agent workload as a stream, one iteration at a time (`AgentStream`), and several ranks
//! in lockstep: the merge that keeps every device's events between the same step markers as
//! when its rank runs alone. Owns the stream's phases and the slowest rank's step times.

use super::{stream_name, AgentSpec, Gen};
use crate::ops::{Op, Program, SourceNotes};
use crate::replay::{Chunk, OpSource};

/// `generate` of several ranks: the lockstep stream's chunks gathered into one program.
pub(super) fn generate_ranks(spec: &AgentSpec, max_ops: usize) -> Result<Program, String> {
    let mut stream = AgentStream::within(spec, max_ops)?;
    let mut ops = Vec::new();
    while let Some((chunk, _)) = stream.next_chunk()? {
        if ops.len().saturating_add(chunk.len()) > max_ops {
            return Err(format!(
                "the agent workload is too large: more than {max_ops} events over its {} devices; lower --iterations, \
                 --devices or the workload's dimensions",
                spec.devices
            ));
        }
        ops.extend_from_slice(chunk);
    }
    Ok(Program {
        ops,
        phases: stream.phases.clone(),
        ids: stream.ids(),
        devices: stream.devices(),
        notes: SourceNotes { format: stream_name(spec), ..Default::default() },
    })
}

/// The agent workload generated one iteration at a time, as the runner consumes it: memory is
/// one iteration's events (the bound of `ops::MAX_OPS` applies per iteration, over all ranks:
/// each rank has an equal share), whatever `--iterations`. Same spec, same events as `generate`.
///
/// With `devices` > 1 it runs one rank per device in lockstep, as data-parallel ranks do: rank
/// `r` is the workload with seed `seed + r` on device `r`; every step's events of every rank
/// lie between the same step markers (see `lockstep`), so each device sees exactly the events,
/// in the same order and steps, as that rank run alone on one device.
pub struct AgentStream<'a> {
    /// One generator per rank; rank `r` allocates on device `r`.
    ranks: Vec<Gen<'a>>,
    next_iteration: u64,
    /// Chunks generated ahead: the weights and the first iteration (to estimate the total).
    ready: std::collections::VecDeque<Vec<Op>>,
    chunk: Vec<Op>,
    /// The merged stream's phases (several ranks; one rank hands out its builder's).
    phases: Vec<String>,
    /// Several ranks: each step's modelled compute time, the slowest rank's (data-parallel
    /// ranks wait for each other at every step); one rank hands out its own clock's.
    step_compute: Vec<f64>,
    len_hint: u64,
}

impl<'a> AgentStream<'a> {
    pub fn new(spec: &'a AgentSpec) -> Result<AgentStream<'a>, String> {
        AgentStream::within(spec, crate::ops::MAX_OPS)
    }

    /// A stream whose chunks (the weights, each iteration) hold at most `max_ops` events, over
    /// all ranks: each rank holds at most `max_ops / devices`.
    pub fn within(spec: &'a AgentSpec, max_ops: usize) -> Result<AgentStream<'a>, String> {
        spec.validate()?;
        // Validated: 1..=ops::MAX_DEVICES.
        let devices = u16::try_from(spec.devices).unwrap_or(1);
        let max_ops = (max_ops / usize::from(devices)).max(1);
        let mut stream = AgentStream {
            ranks: Vec::with_capacity(devices as usize),
            next_iteration: 0,
            ready: std::collections::VecDeque::new(),
            chunk: Vec::new(),
            phases: Vec::new(),
            step_compute: Vec::new(),
            len_hint: 0,
        };
        let mut weights = Vec::with_capacity(devices as usize);
        for rank in 0..devices {
            let mut g = Gen::rank(spec, rank);
            g.b = std::mem::take(&mut g.b).with_max_ops(max_ops);
            g.weights();
            if let Some(e) = g.b.limit_error() {
                return Err(format!("the agent workload's weights are too many: {}", shared(e, devices)));
            }
            weights.push(g.b.take_ops());
            stream.ranks.push(g);
        }
        let weights = stream.merge(weights)?;
        stream.len_hint = weights.len() as u64;
        stream.ready.push_back(weights);
        if spec.iterations > 0 {
            let first = stream.iteration()?;
            stream.len_hint = stream.len_hint.saturating_add((first.len() as u64).saturating_mul(spec.iterations));
            stream.ready.push_back(first);
        }
        Ok(stream)
    }

    fn iteration(&mut self) -> Result<Vec<Op>, String> {
        let i = self.next_iteration;
        self.next_iteration += 1;
        let mut chunks = Vec::with_capacity(self.ranks.len());
        let devices = self.ranks.len() as u16;
        for g in &mut self.ranks {
            g.iteration(i);
            if let Some(e) = g.b.limit_error() {
                return Err(format!(
                    "iteration {} of the agent workload is too large: {}; lower the workload's dimensions",
                    i + 1,
                    shared(e, devices)
                ));
            }
            chunks.push(g.b.take_ops());
        }
        if self.ranks.len() > 1 {
            // The steps this iteration added, each the slowest rank's (ranks run in lockstep).
            let steps = self.ranks.iter().map(|g| g.clock.steps.len()).max().unwrap_or(0);
            for k in self.step_compute.len()..steps {
                let slowest = self.ranks.iter().filter_map(|g| g.clock.steps.get(k)).fold(0.0, |a: f64, &b| a.max(b));
                self.step_compute.push(slowest);
            }
        }
        self.merge(chunks)
    }

    /// One chunk per rank into the stream's chunk: one rank's as it is, several in lockstep.
    fn merge(&mut self, mut chunks: Vec<Vec<Op>>) -> Result<Vec<Op>, String> {
        if chunks.len() == 1 {
            return Ok(chunks.pop().unwrap_or_default());
        }
        lockstep(&chunks, &self.ranks, &mut self.phases)
    }

    /// Ids handed out so far (every id of the merged stream is below it).
    fn ids(&self) -> u32 {
        let most = self.ranks.iter().map(|g| g.b.ids()).max().unwrap_or(0);
        most.saturating_mul(self.ranks.len() as u32)
    }
}

/// A rank's bound error, saying that the bound is shared by the devices.
fn shared(e: &str, devices: u16) -> String {
    if devices > 1 {
        format!("{e} (each of its {devices} devices has 1/{devices} of it: lower --devices)")
    } else {
        e.to_string()
    }
}

impl OpSource for AgentStream<'_> {
    fn next_chunk(&mut self) -> Result<Option<Chunk<'_>>, String> {
        self.chunk = match self.ready.pop_front() {
            Some(chunk) => chunk,
            None if self.next_iteration < self.ranks[0].s.iterations => self.iteration()?,
            None => return Ok(None),
        };
        let phases = if self.ranks.len() == 1 { self.ranks[0].b.phases() } else { &self.phases };
        Ok(Some((&self.chunk, phases)))
    }

    fn len_hint(&self) -> u64 {
        self.len_hint
    }

    fn devices(&self) -> u16 {
        self.ranks.len() as u16
    }

    fn step_compute_s(&self) -> &[f64] {
        if self.ranks.len() == 1 {
            &self.ranks[0].clock.steps
        } else {
            &self.step_compute
        }
    }
}

/// A step marker of one rank: `Some(phase)` a step begins, `None` a step ends.
type Marker<'p> = Option<&'p str>;

/// Interleaves one chunk of every rank in lockstep: each rank's events up to its next step
/// marker, in rank order, then that marker once, so every device's events stay between the
/// same step boundaries as when its rank runs alone. Rank `r`'s id `i` becomes `i * ranks + r`
/// (dense, and no two ranks share one). Every rank must reach the same markers: the phase
/// sequence of the workload does not depend on its seed.
fn lockstep(chunks: &[Vec<Op>], ranks: &[Gen], phases: &mut Vec<String>) -> Result<Vec<Op>, String> {
    let n = chunks.len() as u32;
    let remap = |id: u32, rank: usize| {
        id.checked_mul(n).and_then(|v| v.checked_add(rank as u32)).ok_or_else(|| {
            format!("the agent workload is too large: more than {} blocks live at once over {n} devices", u32::MAX)
        })
    };
    let mut out = Vec::with_capacity(chunks.iter().map(Vec::len).sum());
    let mut pos = vec![0usize; chunks.len()];
    loop {
        // `None`: every rank reached the end of its chunk.
        let mut first: Option<Marker> = None;
        for (r, chunk) in chunks.iter().enumerate() {
            let rest = &chunk[pos[r]..];
            let k = rest.iter().position(|op| matches!(op, Op::StepBegin { .. } | Op::StepEnd)).unwrap_or(rest.len());
            for &op in &rest[..k] {
                out.push(match op {
                    Op::Alloc { id, size, stream, device } => Op::Alloc { id: remap(id, r)?, size, stream, device },
                    Op::Free { id } => Op::Free { id: remap(id, r)? },
                    Op::RecordStream { id, stream } => Op::RecordStream { id: remap(id, r)?, stream },
                    other => other,
                });
            }
            pos[r] += k;
            let this: Option<Marker> = match chunk.get(pos[r]) {
                Some(Op::StepBegin { phase }) => {
                    Some(Some(ranks[r].b.phases().get(*phase as usize).map_or("step", String::as_str)))
                }
                Some(_) => Some(None),
                None => None,
            };
            if r == 0 {
                first = this;
            } else if this != first {
                return Err(format!(
                    "the agent workload's ranks are out of step: rank {r} reaches {} where rank 0 reaches {}",
                    describe(this),
                    describe(first)
                ));
            }
        }
        match first {
            None => return Ok(out),
            Some(None) => out.push(Op::StepEnd),
            Some(Some(name)) => {
                let index = match phases.iter().position(|p| p == name) {
                    Some(i) => i,
                    None => {
                        phases.push(name.to_string());
                        phases.len() - 1
                    }
                };
                // Each rank's builder bounds its phases (MAX_PHASES), and the ranks share them.
                let phase = u16::try_from(index).map_err(|_| format!("more than {} phases", u16::MAX))?;
                out.push(Op::StepBegin { phase });
            }
        }
        for p in &mut pos {
            *p += 1;
        }
    }
}

fn describe(marker: Option<Marker>) -> String {
    match marker {
        None => "the end of the iteration".into(),
        Some(None) => "a step end".into(),
        Some(Some(phase)) => format!("a `{phase}` step"),
    }
}
