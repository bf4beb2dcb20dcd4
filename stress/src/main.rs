//! `stepalloc-stress`: the command line. Builds an event stream (the `agent` workload by
//! default, a trace with `replay`), runs it under every compared configuration and prints the
//! side-by-side report; `random` hammers one allocator from many threads with integrity checks;
//! `advise` searches the allocator settings that give a trace the lowest peak (`advise.rs`);
//! `fit` says whether a recorded step fits a device of a given size under each allocator
//! (`fit.rs`, drawn by `fit_chart.rs`);
//! `colocated` compares ways of sharing one device between a rollout engine and a trainer.
//! Exit status: 0 on success, 1 when an integrity check failed, 2 on bad input or a failed
//! write (a full disk). When stdout's reader goes away (`| head -3`), the command stops writing
//! and exits quietly with the status it had (0, or 1 for a failed integrity check), as ripgrep
//! does: not 141 (death by SIGPIPE, GNU tools' way), which fails `set -o pipefail` scripts for
//! a `| head` that got what it asked for; see `output.rs`.

use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;
use stepalloc_stress::advise::{self, AdviseOptions, Capacity};
use stepalloc_stress::compare::{self, Base};
use stepalloc_stress::export::{self, ExportFormat};
use stepalloc_stress::fit::{self, FitOptions};
use stepalloc_stress::fit_chart;
use stepalloc_stress::headroom::{self, HeadroomArgs};
use stepalloc_stress::note;
use stepalloc_stress::ops::{Program, SourceNotes};
use stepalloc_stress::output::{out, out_json, Failure};
use stepalloc_stress::replay::{self, OpSource, RunConfig};
use stepalloc_stress::report::{self, Report};
use stepalloc_stress::trace;
use stepalloc_stress::verdict;
use stepalloc_stress::workload::agent::{self, AgentArgs, AgentSpec, AgentStream};
use stepalloc_stress::workload::colocated::{self, ColocatedSpec};
use stepalloc_stress::workload::random::{self, RandomArgs};

#[derive(Parser)]
#[command(
    name = "stepalloc-stress",
    version,
    about = "Agent workloads, trace replay and side-by-side allocator policy reports for stepalloc"
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    Sim,
    Cuda,
}

#[derive(Args)]
struct Global {
    /// Configurations to compare: presets pytorch, pytorch_expandable, split128,
    /// empty_cache_every_step, stepalloc, vm_small_pages, vm_page_reuse, vm_page_release, or raw strings
    /// (`key:value,...`, optionally `name=key:value,...`).
    #[arg(long, global = true, num_args = 1..)]
    compare: Vec<String>,
    #[arg(long, global = true, value_enum, default_value = "sim")]
    backend: BackendArg,
    /// Simulated device memory in MiB [default: 81920, an 80 GB GPU].
    #[arg(long, global = true, value_name = "MIB", conflicts_with = "h200")]
    capacity_mb: Option<u64>,
    /// Simulate an H200 (143771 MiB) instead.
    #[arg(long, global = true)]
    h200: bool,
    /// Print the report as JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// Also report every step.
    #[arg(long, global = true)]
    per_step: bool,
    /// Draw reserved / allocated / requested over time for every configuration (SVG).
    #[arg(long, global = true, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Serve live Prometheus metrics while it runs (host:port).
    #[arg(long, global = true)]
    metrics_addr: Option<String>,
    /// Print generation / parse and run times to stderr.
    #[arg(long, global = true)]
    timing: bool,
    /// Describe what holds the reserved bytes at their peak (live blocks, free space in used
    /// segments, whole free segments by size). Slower: reads statistics at every allocation.
    #[arg(long, global = true)]
    explain: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Synthetic multimodal agent-training workload (the default).
    Agent(AgentArgs),
    /// Many threads and streams with random sizes, cross-thread frees and integrity checks.
    Random(RandomArgs),
    /// Replay a trace: PyTorch snapshot (pickle or JSON), RMM log CSV or stepalloc JSON lines.
    Replay { file: PathBuf },
    /// The largest scale of the agent workload each configuration runs without out-of-memory
    /// on the simulated device of `--capacity-mb` (bisection).
    Headroom {
        #[command(flatten)]
        agent: AgentArgs,
        #[command(flatten)]
        search: HeadroomArgs,
    },
    /// Which allocator settings give this trace the lowest peak reserved on your device: replays
    /// it under PyTorch's keys and stepalloc's (in parallel) and prints the best
    /// PYTORCH_CUDA_ALLOC_CONF and STEPALLOC_CONF beside your current setting, why they win,
    /// and what was live at each peak.
    Advise {
        /// The trace: PyTorch snapshot (pickle or JSON), RMM log CSV or stepalloc JSON lines.
        file: PathBuf,
        /// Device memory in GiB, (0, 16384] (default: --capacity-mb, or --h200; PyTorch
        /// snapshots do not record the device's size).
        #[arg(long, allow_hyphen_values = true, value_name = "GIB", conflicts_with_all = ["capacity_mb", "h200"])]
        capacity_gb: Option<String>,
    },
    /// Will this training step fit on a device of this size? Replays a trace (recorded without a
    /// GPU by `python -m stepalloc.fit`, or any trace `replay` reads) under PyTorch's allocator
    /// (default, expandable_segments:True, max_split_size_mb:128, your PYTORCH_CUDA_ALLOC_CONF)
    /// and stepalloc's recommended configuration, at the device's usable memory: peaks, the first
    /// out-of-memory with its module and operator, and the modules live at the peak.
    Fit {
        /// The trace: stepalloc JSON lines (with `module` / `torch_op`), PyTorch snapshot
        /// (pickle or JSON) or RMM log CSV.
        file: PathBuf,
        /// The device's total memory in GiB, (0, 16384] (an "80 GB" H100 reports 79.6).
        #[arg(long, required = true, allow_hyphen_values = true, value_name = "GIB")]
        capacity_gb: String,
        /// Device memory that is not PyTorch's (CUDA context, NCCL, other processes), in MiB.
        #[arg(long, value_name = "MIB", default_value_t = fit::DEFAULT_OUTSIDE_MB)]
        outside_mb: u64,
        /// Your PYTORCH_CUDA_ALLOC_CONF: adds a column `yours`, PyTorch's allocator read as
        /// PyTorch reads the string.
        #[arg(long, value_name = "STRING", allow_hyphen_values = true)]
        pytorch_conf: Option<String>,
        /// Write a self-contained page (no network): the chart, the table and the first
        /// out-of-memory of each configuration.
        #[arg(long, value_name = "FILE.html")]
        html: Option<PathBuf>,
        /// Write the chart alone: memory over the trace for each configuration against the
        /// usable memory, peaks marked, the modules at the peak named.
        #[arg(long, value_name = "FILE.svg")]
        svg: Option<PathBuf>,
    },
    /// A rollout engine and a trainer taking turns on one device: both resident, PyTorch with
    /// empty_cache, vLLM's sleep mode and stepalloc's pause/resume side by side (peak device
    /// use, bytes copied and modelled switch time per iteration, whether each fits).
    Colocated {
        #[command(flatten)]
        spec: ColocatedSpec,
        /// The device to fit, in GiB [default: 80; --capacity-mb or --h200 set it in MiB].
        #[arg(long, value_name = "GIB", conflicts_with_all = ["capacity_mb", "h200"])]
        capacity_gb: Option<u64>,
        /// Effective host-link bandwidth in GB/s: PCIe 4 x16 about 25, PCIe 5 x16 about 50.
        #[arg(long, default_value_t = colocated::PCIE4_X16_GBPS)]
        link_gbps: f64,
    },
    /// Write the agent workload as a trace file (for replay benchmarks and tests).
    GenTrace {
        #[command(flatten)]
        agent: AgentArgs,
        #[arg(long, value_enum, default_value = "jsonl")]
        format: ExportFormat,
        #[arg(long)]
        out: PathBuf,
    },
}

fn main() {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => std::process::exit(code),
        Err(Failure::ClosedPipe) => std::process::exit(0),
        Err(Failure::Error(e)) => {
            note!("error: {e}");
            std::process::exit(2);
        }
    }
}

fn run(cli: Cli) -> Result<i32, Failure> {
    let g = &cli.global;
    let capacity_mb = if g.h200 { H200_MB } else { g.capacity_mb.unwrap_or(DEFAULT_MB) };
    let command = cli.command.unwrap_or_else(|| Command::Agent(AgentArgs::default()));
    refuse_unused(g, &command)?;
    refuse_overwriting_input(g, &command)?;
    let started = Instant::now();
    // The agent workload is generated as it runs (one iteration at a time, again for every
    // configuration); a trace is read once.
    let (input, workload, defaults) = match command {
        Command::Agent(args) => {
            let mut spec = args.spec()?;
            // The step-time model follows the simulated device unless --gpu says otherwise.
            if g.h200 && args.gpu.is_none() {
                spec.gpu = agent::Gpu::H200;
            }
            let name = agent::stream_name(&spec);
            (Input::Agent(spec), name, compare::DEFAULT_AGENT)
        }
        Command::Replay { file } => {
            let program = trace::load(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            (Input::Trace(program), format!("replay {}", file.display()), compare::DEFAULT_OTHER)
        }
        Command::Random(args) => return run_random(g, &args, capacity_mb),
        Command::Colocated { spec, capacity_gb, link_gbps } => return run_colocated(g, &spec, capacity_gb, link_gbps),
        Command::Advise { file, capacity_gb } => return run_advise(g, &file, capacity_gb.as_deref(), capacity_mb),
        Command::Fit { file, capacity_gb, outside_mb, pytorch_conf, html, svg } => {
            let args = FitArgs { file, capacity_gb, outside_mb, pytorch_conf, html, svg };
            return run_fit(g, &args);
        }
        Command::Headroom { agent, search } => return run_headroom(g, &agent, &search, capacity_mb),
        Command::GenTrace { agent, format, out } => {
            let program = agent::generate(&agent.spec()?)?;
            let file = std::fs::File::create(&out).map_err(|e| format!("{}: {e}", out.display()))?;
            let mut w = std::io::BufWriter::new(file);
            let events = export::export(&program, format, &mut w)?;
            std::io::Write::flush(&mut w).map_err(|e| format!("{}: {e}", out.display()))?;
            note!("wrote {events} events to {}", out.display());
            if g.timing {
                note!("timing: {events} events generated and written in {:.3} s", started.elapsed().as_secs_f64());
            }
            return Ok(0);
        }
    };
    let parse_s = started.elapsed().as_secs_f64();
    let (devices, notes) = match &input {
        Input::Trace(program) => {
            if g.timing {
                note!("timing: {} ops built in {:.3} s", program.ops.len(), parse_s);
            }
            (program.devices, program.notes.clone())
        }
        // Validated: 1..=ops::MAX_DEVICES.
        Input::Agent(spec) => (
            u16::try_from(spec.devices).unwrap_or(1),
            SourceNotes { format: agent::stream_name(spec), ..Default::default() },
        ),
    };
    let base = Base { cuda: g.backend == BackendArg::Cuda, capacity_mb, devices };
    let mut configs = resolve(g, defaults, &base)?;
    for rc in &mut configs {
        rc.explain = g.explain;
        // A trace is held whole: what was live at each run's peak can be read from it.
        rc.track_peak = matches!(input, Input::Trace(_));
    }
    let mut report = Report { workload, source: notes, parse_s, runs: Vec::new() };
    for rc in &configs {
        let run = match &input {
            Input::Trace(program) => {
                let pb = progress(program.ops.len() as u64, rc);
                let run = replay::run(program, rc, pb.as_ref(), g.metrics_addr.as_deref());
                finish(pb);
                let mut run = run?;
                if let Some(m) = &run.peak_moment {
                    run.peak_attribution =
                        Some(advise::attribute(program, m.op, m.device, advise::TOP_GROUPS, &run.failed_allocs));
                }
                run
            }
            Input::Agent(spec) => {
                let mut stream = AgentStream::new(spec)?;
                let pb = progress(stream.len_hint(), rc);
                let run = replay::run_source(&mut stream, rc, pb.as_ref(), g.metrics_addr.as_deref());
                finish(pb);
                run?
            }
        };
        if g.timing {
            print_timing(&rc.name, &run);
        }
        report.runs.push(run);
    }
    let columns: Vec<(verdict::Role, &report::RunReport)> =
        configs.iter().map(verdict::role).zip(&report.runs).collect();
    emit(g, &report, verdict::verdict(&columns).as_deref())?;
    Ok(0)
}

/// `--capacity-mb` when neither it nor `--h200` is given: an 80 GB GPU.
const DEFAULT_MB: u64 = 81_920;
/// `--h200`: an H200's memory as the driver reports it.
const H200_MB: u64 = 143_771;

/// Refuses an output file (`--plot`, `--html`, `--svg`) that is the trace being read, or another
/// output of the same run: writing it would destroy the recording (a step recorded for minutes)
/// or one picture would silently replace the other.
fn refuse_overwriting_input(g: &Global, command: &Command) -> Result<(), String> {
    let (input, outputs): (&std::path::Path, Vec<(&str, &std::path::Path)>) = match command {
        Command::Replay { file } | Command::Advise { file, .. } => {
            (file, g.plot.as_deref().map(|p| ("--plot", p)).into_iter().collect())
        }
        Command::Fit { file, html, svg, .. } => {
            let outputs = [("--html", html), ("--svg", svg)];
            (file, outputs.into_iter().filter_map(|(flag, p)| p.as_deref().map(|p| (flag, p))).collect())
        }
        _ => return Ok(()),
    };
    for (i, &(flag, path)) in outputs.iter().enumerate() {
        if same_file(path, input) {
            return Err(format!(
                "{flag} {}: that is the trace this run reads; writing there would destroy it. Name another file",
                path.display()
            ));
        }
        if let Some((other, _)) = outputs[..i].iter().find(|(_, p)| same_file(p, path)) {
            return Err(format!("{flag} {}: {other} writes that file too; give each its own file", path.display()));
        }
    }
    Ok(())
}

/// Whether two paths name one file: the same file on disk when both exist, else the same path
/// once made absolute.
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => matches!((std::path::absolute(a), std::path::absolute(b)), (Ok(x), Ok(y)) if x == y),
    }
}

/// Refuses every flag `command` would ignore, naming it: a flag listed in `--help` either changes
/// the result or is refused (a flag that silently did nothing would let a user believe it had
/// been applied). A value given as its default changes nothing and passes.
fn refuse_unused(g: &Global, command: &Command) -> Result<(), String> {
    let (name, unused): (&str, &[&str]) = match command {
        Command::Agent(_) => ("agent", &[]),
        Command::Replay { .. } => ("replay", &[]),
        Command::Random(_) => ("random", &["--per-step", "--plot", "--metrics-addr", "--explain"]),
        Command::Headroom { .. } => ("headroom", &["--per-step", "--plot", "--metrics-addr", "--explain", "--gpu"]),
        Command::Advise { .. } => ("advise", &["--compare", "--backend", "--per-step", "--metrics-addr", "--explain"]),
        Command::Fit { .. } => {
            ("fit", &["--backend", "--capacity-mb", "--h200", "--per-step", "--plot", "--metrics-addr", "--explain"])
        }
        Command::Colocated { .. } => {
            ("colocated", &["--compare", "--backend", "--per-step", "--plot", "--metrics-addr", "--explain"])
        }
        Command::GenTrace { .. } => (
            "gen-trace",
            &[
                "--compare",
                "--backend",
                "--capacity-mb",
                "--h200",
                "--json",
                "--per-step",
                "--plot",
                "--metrics-addr",
                "--explain",
                "--gpu",
            ],
        ),
    };
    let gpu = match command {
        Command::Headroom { agent, .. } | Command::GenTrace { agent, .. } => agent.gpu.is_some(),
        _ => false,
    };
    for &flag in unused {
        let given = match flag {
            "--compare" => !g.compare.is_empty(),
            "--backend" => g.backend != BackendArg::Sim,
            "--capacity-mb" => g.capacity_mb.is_some(),
            "--h200" => g.h200,
            "--json" => g.json,
            "--per-step" => g.per_step,
            "--plot" => g.plot.is_some(),
            "--metrics-addr" => g.metrics_addr.is_some(),
            "--explain" => g.explain,
            "--gpu" => gpu,
            _ => false,
        };
        if given {
            return Err(format!("{flag} does not apply to `{name}`: {}; drop it", why(name, flag)));
        }
    }
    Ok(())
}

/// Why `command` has no use for `flag` (the second half of `refuse_unused`'s message).
fn why(command: &str, flag: &str) -> &'static str {
    match (command, flag) {
        ("gen-trace", "--json" | "--plot" | "--per-step" | "--explain" | "--metrics-addr") => {
            "it writes a trace file (--out, --format) and runs nothing"
        }
        ("gen-trace", _) => "a trace holds the workload's events alone, whatever device or configuration replays it",
        (_, "--gpu") => "the GPU sets the modelled step times, which this command does not report",
        ("colocated", "--compare" | "--backend") => "it runs its own four columns on the simulated device",
        ("advise", "--compare" | "--backend") => "it searches its own configurations on the simulated device",
        ("fit", "--backend") => "it replays on the simulated device of --capacity-gb",
        ("fit", "--capacity-mb" | "--h200") => "the device's size is --capacity-gb (and --outside-mb)",
        ("fit", "--plot") => "its picture is --svg FILE (the chart) or --html FILE (a page)",
        ("fit", "--per-step") => "it reports the whole trace and the step of its peaks and first out-of-memory",
        ("fit", "--explain") => "it attributes each peak by module already",
        (_, "--per-step") => "it reports no steps",
        (_, "--plot") => "it draws no plot",
        (_, "--metrics-addr") => "it serves no live metrics",
        (_, "--explain") => "it does not attribute its peaks",
        _ => "it does not use it",
    }
}

/// What `agent` and `replay` run: a workload generated as it runs, or a trace read whole.
enum Input {
    Agent(AgentSpec),
    Trace(Program),
}

fn finish(pb: Option<ProgressBar>) {
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
}

/// The configurations of `--compare`, or the default comparison.
fn resolve(g: &Global, defaults: &[&str], base: &Base) -> Result<Vec<RunConfig>, String> {
    if g.compare.is_empty() {
        let names: Vec<String> = defaults.iter().map(|s| s.to_string()).collect();
        return compare::resolve(&names, base);
    }
    compare::resolve(&g.compare, base)
}

fn run_headroom(g: &Global, agent: &AgentArgs, search: &HeadroomArgs, capacity_mb: u64) -> Result<i32, Failure> {
    let spec = agent.spec()?;
    if spec.devices > 1 {
        return Err(format!(
            "--devices {}: headroom searches one device's scale; run it without --devices (each rank is the \
             same workload with another seed)",
            spec.devices
        )
        .into());
    }
    let base = Base { cuda: g.backend == BackendArg::Cuda, capacity_mb, devices: 1 };
    let configs = resolve(g, compare::DEFAULT_AGENT, &base)?;
    let started = Instant::now();
    let report = headroom::run(&spec, search, &base, &configs)?;
    if g.timing {
        note!("timing: headroom search in {:.3} s", started.elapsed().as_secs_f64());
    }
    if g.json {
        out_json(&report)?;
    } else {
        out(&headroom::table(&report))?;
    }
    Ok(0)
}

fn run_advise(g: &Global, file: &std::path::Path, capacity_gb: Option<&str>, capacity_mb: u64) -> Result<i32, Failure> {
    // The flags first (`refuse_unused`): a bad capacity is refused before a large trace is read.
    let capacity = match capacity_gb {
        Some(gb) => advise::capacity_from_gb(gb)?,
        None => Capacity {
            mb: capacity_mb,
            source: if g.h200 {
                "--h200".to_string()
            } else {
                format!("--capacity-mb {capacity_mb}; the trace does not record the device's size, set --capacity-gb")
            },
        },
    };
    let started = Instant::now();
    let program = trace::load(file).map_err(|e| format!("{}: {e}", file.display()))?;
    if g.timing {
        note!("timing: {} ops built in {:.3} s", program.ops.len(), started.elapsed().as_secs_f64());
    }
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let opts = AdviseOptions { trace_name: file.display().to_string(), capacity, threads };
    let pb = if std::io::stderr().is_terminal() {
        let pb = ProgressBar::new(1);
        if let Ok(style) =
            ProgressStyle::with_template("advise [{bar:40}] {pos}/{len} configurations ({elapsed}) {msg}")
        {
            pb.set_style(style.progress_chars("=> "));
        }
        Some(pb)
    } else {
        None
    };
    let result = advise::advise(&program, &opts, pb.as_ref());
    finish(pb);
    let (advice, runs) = result?;
    if g.timing {
        note!(
            "timing: advise in {:.3} s ({} configurations on {threads} threads)",
            started.elapsed().as_secs_f64(),
            advice.candidates
        );
    }
    // The plot is written even when stdout's reader has gone.
    let printed = if g.json { out_json(&advice) } else { out(&advise::text(&advice)) };
    if let Some(path) = &g.plot {
        let report = advise::plot_report(&advice, runs);
        write_plot(path, &report)?;
    }
    printed?;
    Ok(0)
}

/// `fit`'s own arguments.
struct FitArgs {
    file: PathBuf,
    capacity_gb: String,
    outside_mb: u64,
    pytorch_conf: Option<String>,
    html: Option<PathBuf>,
    svg: Option<PathBuf>,
}

fn run_fit(g: &Global, a: &FitArgs) -> Result<i32, Failure> {
    // The flags first: a bad capacity or setting is refused before a large trace is read.
    let capacity = advise::capacity_from_gb(&a.capacity_gb)?;
    let usable = fit::usable_mb(&capacity, a.outside_mb)?;
    if let Some(text) = &a.pytorch_conf {
        stepalloc_stress::torch_conf::translate(text, capacity.mb, usable)?;
    }
    let started = Instant::now();
    let program = trace::load(&a.file).map_err(|e| format!("{}: {e}", a.file.display()))?;
    if g.timing {
        note!("timing: {} ops built in {:.3} s", program.ops.len(), started.elapsed().as_secs_f64());
    }
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let opts = FitOptions {
        trace_name: a.file.display().to_string(),
        capacity,
        outside_mb: a.outside_mb,
        pytorch_conf: a.pytorch_conf.clone(),
        compare: g.compare.clone(),
        threads,
    };
    let replayed = Instant::now();
    let result = fit::fit(&program, &opts)?;
    if g.timing {
        note!(
            "timing: {} configurations replayed in {:.3} s on {threads} threads",
            result.runs.len(),
            replayed.elapsed().as_secs_f64()
        );
    }
    // The pictures are written even when stdout's reader has gone.
    let printed = if g.json { out_json(&result.report) } else { out(&fit::text(&result.report)) };
    for (path, text) in [(&a.svg, fit_chart::svg as fn(&fit::Fit) -> String), (&a.html, fit_chart::html)] {
        if let Some(path) = path {
            std::fs::write(path, text(&result)).map_err(|e| format!("{}: {e}", path.display()))?;
            note!("wrote {}", path.display());
        }
    }
    printed?;
    Ok(0)
}

fn run_colocated(g: &Global, spec: &ColocatedSpec, capacity_gb: Option<u64>, link_gbps: f64) -> Result<i32, Failure> {
    // One of --capacity-gb, --capacity-mb and --h200 at most (clap refuses two); each checked
    // under its own name.
    let capacity_mb = match (capacity_gb, g.capacity_mb) {
        (Some(gb), _) => {
            if !(1..=colocated::MAX_CAPACITY_GB).contains(&gb) {
                return Err(format!("--capacity-gb {gb}: must be in 1..={}", colocated::MAX_CAPACITY_GB).into());
            }
            gb * 1024
        }
        (None, Some(mb)) => {
            let most = colocated::MAX_CAPACITY_GB * 1024;
            if !(1..=most).contains(&mb) {
                return Err(format!("--capacity-mb {mb}: must be in 1..={most}").into());
            }
            mb
        }
        (None, None) if g.h200 => H200_MB,
        (None, None) => colocated::DEFAULT_CAPACITY_GB * 1024,
    };
    let started = Instant::now();
    let cost = colocated::CostModel::new(link_gbps)?;
    let report = colocated::run(spec, capacity_mb, cost)?;
    if g.timing {
        note!("timing: colocated in {:.3} s", started.elapsed().as_secs_f64());
    }
    if g.json {
        out_json(&report)?;
    } else {
        out(&colocated::table(&report))?;
    }
    Ok(0)
}

fn progress(ops: u64, rc: &RunConfig) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let pb = ProgressBar::new(ops);
    if let Ok(style) = ProgressStyle::with_template("{msg:>24} [{bar:40}] {pos}/{len} ops ({eta})") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(rc.name.clone());
    Some(pb)
}

/// The report on stdout with its verdict, and the plot (written even when stdout's reader has
/// gone).
fn emit(g: &Global, report: &Report, verdict: Option<&str>) -> Result<(), Failure> {
    let printed = if g.json {
        let mut v = report.to_json(g.per_step, false);
        if let Some(verdict) = verdict {
            v["verdict"] = verdict.into();
        }
        out_json(&v)
    } else {
        let mut text = report::table_with(report, verdict);
        if g.per_step {
            for run in &report.runs {
                text.push_str(&report::step_table(run));
            }
        }
        out(&text)
    };
    if let Some(path) = &g.plot {
        write_plot(path, report)?;
    }
    printed
}

fn write_plot(path: &std::path::Path, report: &Report) -> Result<(), Failure> {
    std::fs::write(path, report::svg(report)).map_err(|e| format!("{}: {e}", path.display()))?;
    note!("plot written to {}", path.display());
    Ok(())
}

fn run_random(g: &Global, args: &RandomArgs, capacity_mb: u64) -> Result<i32, Failure> {
    if g.backend == BackendArg::Sim && args.tag_kib != random::DEFAULT_TAG_KIB {
        return Err(format!(
            "--tag-kib {} does not apply to the simulated device: it holds no bytes, so no tags are written (use \
             --backend cuda)",
            args.tag_kib
        )
        .into());
    }
    let base = Base { cuda: g.backend == BackendArg::Cuda, capacity_mb, devices: 1 };
    let configs = resolve(g, compare::DEFAULT_OTHER, &base)?;
    let mut report = Report {
        workload: format!(
            "random ({} threads x {} ops, {:?} sizes, seed {})",
            args.threads, args.ops, args.sizes, args.seed
        ),
        ..Default::default()
    };
    let mut checks = Vec::new();
    for rc in &configs {
        let (run, integrity) = random::run(args, rc)?;
        if g.timing {
            print_timing(&rc.name, &run);
        }
        report.runs.push(run);
        checks.push(integrity);
    }
    let code = if checks.iter().all(|c| c.ok()) { 0 } else { 1 };
    let printed = if g.json {
        let mut v = report.to_json(false, false);
        v["integrity"] = serde_json::to_value(&checks).map_err(|e| e.to_string())?;
        out_json(&v)
    } else {
        let mut text = report::table(&report);
        for c in &checks {
            text.push_str(&format!(
                "integrity of {}: {} overlapping live blocks, invariants {}, {} bytes leaked, {} refused calls{}, \
                 {} corrupted tags of {} tagged blocks{}\n",
                c.config,
                c.overlaps,
                match &c.invariants {
                    Ok(()) => "hold".to_string(),
                    Err(e) => format!("BROKEN ({e})"),
                },
                c.leaked_bytes,
                c.refused_calls,
                c.first_refusal.as_ref().map_or(String::new(), |f| format!(" (first: {f})")),
                c.corrupted_tags,
                c.tagged_blocks,
                c.first_corruption.as_ref().map_or(String::new(), |f| format!(" (first: {f})"))
            ));
        }
        out(&text)
    };
    // A failed integrity check keeps its status when stdout's reader has gone.
    match printed {
        Ok(()) | Err(Failure::ClosedPipe) => Ok(code),
        Err(e) => Err(e),
    }
}

/// `--timing`: one line per configuration on stderr.
fn print_timing(name: &str, run: &report::RunReport) {
    note!("timing: {name}: {} ops in {:.3} s ({:.2} Mops/s)", run.ops, run.wall_s, run.ops_per_s / 1e6);
}
