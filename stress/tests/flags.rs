//! Every flag a subcommand lists in `--help` does something: it changes the result (the JSON
//! report, the written trace, stderr's timing or metrics line, a plot file) against the same
//! command without it, or it is refused with an error naming it. `colocated --capacity-mb` and
//! `--h200` were once listed and silently ignored; this table is read against `--help`, so a
//! flag added without an entry here (or an entry for a flag that went) fails the test.
//!
//! Each case runs a small, fast command (`base`) without the flag (plus the case's `with`
//! arguments, the context where the flag applies) and again with it. Outputs are compared with
//! their wall-clock fields removed, and each subcommand's base is first run twice to show that
//! what is left is deterministic (so a difference is the flag's).

mod common;

use common::TINY_AGENT;
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::Command;

/// What giving a flag must do.
#[derive(Clone, Copy, Debug)]
enum Effect {
    /// Stdout (or the written trace) differs.
    Output,
    /// Exit status 2 and the flag named on stderr.
    Refused,
    /// Stderr gains a line containing this.
    Stderr(&'static str),
    /// The file named by the flag's value is written.
    File,
    /// The CUDA backend: a different result where a driver exists, else a clear error.
    Backend,
}
use Effect::*;

struct Case {
    flag: &'static str,
    /// The flag's value (None: a switch).
    value: Option<&'static str>,
    /// Arguments that make the flag apply (both runs get them).
    with: &'static [&'static str],
    /// Flags (each with its value) of the base that do not apply once the flag is given.
    drop: &'static [&'static str],
    effect: Effect,
}

const fn case(flag: &'static str, value: Option<&'static str>, effect: Effect) -> Case {
    Case { flag, value, with: &[], drop: &[], effect }
}

const fn case_with(flag: &'static str, value: &'static str, with: &'static [&'static str], effect: Effect) -> Case {
    Case { flag, value: Some(value), with, drop: &[], effect }
}

/// `headroom`'s additions to `TINY_AGENT`, and their flags.
const HEADROOM_SMALL: &[&str] =
    &["--vision-layers", "1", "--vision-hidden", "64", "--vision-intermediate", "128", "--rollout-batch", "2"];
const HEADROOM_SMALL_FLAGS: &[&str] =
    &["--vision-layers", "--vision-hidden", "--vision-intermediate", "--rollout-batch"];

/// The agent workload's flags (agent, headroom, gen-trace); `gpu` is what `--gpu` does there.
fn agent_cases(gpu: Effect, devices: Effect) -> Vec<Case> {
    vec![
        case("--preset", Some("llm-7b-sft"), Output),
        case("--seed", Some("2"), Output),
        case("--iterations", Some("2"), Output),
        case("--devices", Some("2"), devices),
        case("--hidden", Some("512"), Output),
        case("--layers", Some("3"), Output),
        case("--heads", Some("64"), Output),
        case("--kv-heads", Some("8"), Output),
        case("--intermediate", Some("768"), Output),
        case("--vocab", Some("2000"), Output),
        case("--dtype-bytes", Some("4"), Output),
        case("--vision", Some("false"), Output),
        case("--vision-hidden", Some("512"), Output),
        case("--vision-layers", Some("1"), Output),
        case("--vision-intermediate", Some("2048"), Output),
        case("--patch", Some("28"), Output),
        case("--images-min", Some("3"), Output),
        case("--images-max", Some("1"), Output),
        case("--resolutions", Some("224"), Output),
        case("--train-vision", Some("true"), Output),
        case("--prompt-median", Some("100"), Output),
        case("--prompt-max", Some("512"), Output),
        case_with("--observation-median", "2000", &["--turns-min", "3"], Output),
        case("--response-min", Some("300"), Output),
        case("--response-max", Some("40"), Output),
        case("--rollout", Some("false"), Output),
        case("--rollout-batch", Some("2"), Output),
        case("--turns-min", Some("3"), Output),
        case("--turns-max", Some("1"), Output),
        case("--kv-chunk", Some("16"), Output),
        case("--micro-batches", Some("2"), Output),
        case_with("--sft-batch", "2", &["--preset", "llm-7b-sft"], Output),
        case_with("--eval-every", "1", &["--preset", "llm-7b-sft"], Output),
        case("--grad-checkpointing", Some("false"), Output),
        case("--optimizer", Some("full"), Output),
        case("--lora-rank", Some("8"), Output),
        case_with("--trainable-layers", "1", &["--optimizer", "partial"], Output),
        case("--gpu", Some("h200"), gpu),
    ]
}

/// The global flags, with what each does under one subcommand (`plot`, `metrics`: the effect
/// of `--plot` and `--metrics-addr`; the others are refused where `refused` names them).
fn global_cases(refused: &[&str]) -> Vec<Case> {
    let all = [
        case("--compare", Some("pytorch"), Output),
        case("--backend", Some("cuda"), Backend),
        case("--capacity-mb", Some("1024"), Output),
        case("--h200", None, Output),
        case("--json", None, Output),
        case("--per-step", None, Output),
        case("--plot", Some("PLOT"), File),
        case("--metrics-addr", Some("127.0.0.1:0"), Stderr("serving live metrics")),
        case("--timing", None, Stderr("timing:")),
        case("--explain", None, Output),
    ];
    all.into_iter().map(|c| if refused.contains(&c.flag) { Case { effect: Refused, ..c } } else { c }).collect()
}

struct Sub {
    name: &'static str,
    /// The command without the flags under test (a flag of the case's own is taken out first).
    base: Vec<String>,
    cases: Vec<Case>,
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn subcommands(dir: &Path, trace: &Path) -> Vec<Sub> {
    let trace = trace.to_str().unwrap();
    let out = dir.join("out.jsonl");
    let mut agent_base = strings(&["agent"]);
    agent_base.extend(strings(TINY_AGENT));
    agent_base.extend(strings(&["--compare", "stepalloc", "--json"]));
    let mut agent = global_cases(&[]);
    agent.extend(agent_cases(Output, Output));

    // Headroom reports peaks alone: a small vision encoder and rollout batch, so that the
    // training side's flags move the peak too.
    let mut headroom_base = strings(&["headroom"]);
    headroom_base.extend(strings(TINY_AGENT));
    headroom_base.extend(strings(HEADROOM_SMALL));
    headroom_base.extend(strings(&["--compare", "stepalloc", "--json", "--max-scale", "2", "--probes", "1"]));
    let mut headroom = global_cases(&["--backend", "--per-step", "--plot", "--metrics-addr", "--explain"]);
    headroom.extend(agent_cases(Refused, Refused));
    for c in headroom.iter_mut() {
        match c.flag {
            // An evaluation step never holds the stepalloc peak of this workload; PyTorch's
            // cache keeps what it held.
            "--eval-every" => {
                c.with = &["--preset", "llm-7b-sft", "--compare", "pytorch"];
                c.drop = HEADROOM_SMALL_FLAGS;
            }
            // Without rollouts or a vision encoder, the small ones' flags do not apply.
            "--preset" | "--rollout" | "--vision" | "--sft-batch" => c.drop = HEADROOM_SMALL_FLAGS,
            // Two episodes fill two micro-batches as they fill four.
            "--micro-batches" => c.value = Some("1"),
            _ => {}
        }
    }
    headroom.extend([
        case("--dimension", Some("sequence"), Output),
        case("--max-scale", Some("3"), Output),
        // Bisection needs a failure within --max-scale: a device the doubled workload overflows.
        case_with("--probes", "2", &["--capacity-mb", "100"], Output),
    ]);

    let mut gen_base = strings(&["gen-trace"]);
    gen_base.extend(strings(TINY_AGENT));
    gen_base.extend(["--out".to_string(), out.to_str().unwrap().to_string()]);
    let mut gen = global_cases(&[
        "--compare",
        "--backend",
        "--capacity-mb",
        "--h200",
        "--json",
        "--per-step",
        "--plot",
        "--metrics-addr",
        "--explain",
    ]);
    gen.extend(agent_cases(Refused, Output));
    gen.extend([case("--format", Some("rmm"), Output), case("--out", Some("PLOT"), File)]);

    let mut random = global_cases(&["--per-step", "--plot", "--metrics-addr", "--explain"]);
    random.extend([
        case("--threads", Some("2"), Output),
        case("--ops", Some("3000"), Output),
        case("--streams", Some("1"), Output),
        case("--sizes", Some("large"), Output),
        case("--cross-free", Some("0.9"), Output),
        case("--record-stream", Some("0.9"), Output),
        case_with("--live-fraction", "0.01", &["--capacity-mb", "64"], Output),
        case("--step-every", Some("100"), Output),
        case("--seed", Some("2"), Output),
        // Tags are written on the CUDA backend alone.
        case("--tag-kib", Some("64"), Refused),
    ]);

    let mut advise = global_cases(&["--compare", "--backend", "--per-step", "--metrics-addr", "--explain"]);
    advise.push(case("--capacity-gb", Some("1"), Output));

    // `fit` needs --capacity-gb: its own case replaces the base's value (`with` names the flag).
    let mut fit =
        global_cases(&["--backend", "--capacity-mb", "--h200", "--per-step", "--plot", "--metrics-addr", "--explain"]);
    fit.extend([
        case_with("--capacity-gb", "0.75", &["--capacity-gb", "1"], Output),
        case("--outside-mb", Some("100"), Output),
        case("--pytorch-conf", Some("max_split_size_mb:64"), Output),
        case("--html", Some("PLOT"), File),
        case("--svg", Some("PLOT"), File),
    ]);

    let mut colocated =
        global_cases(&["--compare", "--backend", "--per-step", "--plot", "--metrics-addr", "--explain"]);
    colocated.extend([
        case("--iterations", Some("2"), Output),
        case("--seed", Some("2"), Output),
        case("--hidden", Some("1920"), Output),
        case("--layers", Some("8"), Output),
        case("--heads", Some("16"), Output),
        case("--kv-heads", Some("4"), Output),
        case("--intermediate", Some("4096"), Output),
        case("--vocab", Some("32000"), Output),
        case("--rollout-batch", Some("32"), Output),
        case("--prompt-tokens", Some("256"), Output),
        case("--response-min", Some("2048"), Output),
        case("--response-max", Some("2048"), Output),
        case("--kv-block", Some("512"), Output),
        case("--micro-batches", Some("2"), Output),
        case("--micro-tokens-min", Some("5000"), Output),
        case("--micro-tokens-max", Some("3072"), Output),
        case("--capacity-gb", Some("20"), Output),
        case("--link-gbps", Some("50"), Output),
    ]);

    vec![
        Sub { name: "agent", base: agent_base, cases: agent },
        Sub {
            name: "replay",
            base: strings(&["replay", trace, "--compare", "stepalloc", "--json"]),
            cases: global_cases(&[]),
        },
        Sub {
            name: "random",
            base: strings(&["random", "--threads", "1", "--ops", "2000", "--compare", "stepalloc", "--json"]),
            cases: random,
        },
        Sub { name: "headroom", base: headroom_base, cases: headroom },
        Sub { name: "advise", base: strings(&["advise", trace, "--json"]), cases: advise },
        Sub { name: "fit", base: strings(&["fit", trace, "--capacity-gb", "1", "--json"]), cases: fit },
        Sub { name: "colocated", base: strings(&["colocated", "--iterations", "1", "--json"]), cases: colocated },
        Sub { name: "gen-trace", base: gen_base, cases: gen },
    ]
}

/// The long flags `stepalloc-stress SUB --help` lists (without --help and --version).
fn help_flags(sub: &str) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_stepalloc-stress")).args([sub, "--help"]).output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("-h, ").or_else(|| l.strip_prefix("-V, ")).unwrap_or(l);
            let name: String =
                l.strip_prefix("--")?.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
            Some(format!("--{name}"))
        })
        .filter(|f| f != "--help" && f != "--version")
        .collect()
}

/// `args` without `flag` and its value.
fn without(args: &[String], flag: &str, switch: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip = 0;
    for a in args {
        if skip > 0 {
            skip -= 1;
            continue;
        }
        if a == flag {
            skip = usize::from(!switch);
            continue;
        }
        out.push(a.clone());
    }
    out
}

struct Ran {
    code: Option<i32>,
    /// Stdout, normalised, with the trace written by gen-trace appended.
    output: String,
    stderr: String,
}

/// The JSON's wall-clock fields removed (and the colocated report's echo of its inputs, so that
/// a flag must change a result, not only the echo).
fn normalise(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for k in ["wall_s", "ops_per_s", "parse_s", "seconds", "gib_per_s", "search_s", "spec", "cost"] {
                m.remove(k);
            }
            m.values_mut().for_each(normalise);
        }
        Value::Array(a) => a.iter_mut().for_each(normalise),
        _ => {}
    }
}

fn run(args: &[String], out_file: &Path) -> Ran {
    let _ = std::fs::remove_file(out_file);
    let out = Command::new(env!("CARGO_BIN_EXE_stepalloc-stress")).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let mut output = match serde_json::from_str::<Value>(&stdout) {
        Ok(mut v) => {
            normalise(&mut v);
            v.to_string()
        }
        Err(_) => stdout,
    };
    if let Ok(written) = std::fs::read_to_string(out_file) {
        output.push_str(&written);
    }
    Ran { code: out.status.code(), output, stderr: String::from_utf8_lossy(&out.stderr).to_string() }
}

#[test]
fn every_listed_flag_changes_the_result_or_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    let mut gen = strings(&["gen-trace"]);
    gen.extend(strings(TINY_AGENT));
    gen.extend(["--out".to_string(), trace.to_str().unwrap().to_string()]);
    let made = Command::new(env!("CARGO_BIN_EXE_stepalloc-stress")).args(&gen).output().unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let out_file = dir.path().join("out.jsonl");
    let mut failures = Vec::new();
    let mut baselines: HashMap<Vec<String>, Ran> = HashMap::new();
    for sub in subcommands(dir.path(), &trace) {
        let listed = help_flags(sub.name);
        let tabled: BTreeSet<String> = sub.cases.iter().map(|c| c.flag.to_string()).collect();
        assert_eq!(listed, tabled, "`{} --help` against this test's table (left: --help)", sub.name);
        let again = run(&sub.base, &out_file);
        let first = run(&sub.base, &out_file);
        assert_eq!(first.code, Some(0), "{}: {}", sub.name, first.stderr);
        assert!(first.output == again.output, "{}: the base command is not deterministic", sub.name);
        baselines.insert(sub.base.clone(), first);
        for c in &sub.cases {
            let mut baseline = without(&sub.base, c.flag, c.value.is_none());
            for d in c.drop {
                baseline = without(&baseline, d, false);
            }
            for w in c.with.chunks(2) {
                baseline = without(&baseline, w[0], false);
                baseline.extend(strings(w));
            }
            // A flag the context already gives (a required one) takes the case's value instead.
            let mut variant =
                if c.with.contains(&c.flag) { without(&baseline, c.flag, false) } else { baseline.clone() };
            variant.push(c.flag.to_string());
            let file = dir.path().join(format!("{}{}.out", sub.name, c.flag));
            let _ = std::fs::remove_file(&file);
            if let Some(v) = c.value {
                variant.push(if v == "PLOT" { file.to_str().unwrap().to_string() } else { v.to_string() });
            }
            // Most flags are not in the base: their baselines are the same command, run once.
            if !baselines.contains_key(&baseline) {
                let ran = run(&baseline, &out_file);
                baselines.insert(baseline.clone(), ran);
            }
            let b = &baselines[&baseline];
            let v = run(&variant, &out_file);
            let what = format!("{} {} {:?} ({:?})", sub.name, c.flag, c.value, c.effect);
            let ok = match c.effect {
                Output => b.code == Some(0) && v.code == Some(0) && b.output != v.output,
                Refused => v.code == Some(2) && v.stderr.contains(c.flag),
                Stderr(line) => v.code == Some(0) && v.stderr.contains(line) && !b.stderr.contains(line),
                File => v.code == Some(0) && std::fs::metadata(&file).is_ok_and(|m| m.len() > 0),
                Backend => {
                    (v.code == Some(2) && v.stderr.contains("CUDA")) || (v.code == Some(0) && v.output != b.output)
                }
            };
            if !ok {
                failures.push(format!(
                    "{what}: baseline exit {:?}, with the flag exit {:?}, same output: {}; stderr: {}",
                    b.code,
                    v.code,
                    b.output == v.output,
                    v.stderr.lines().last().unwrap_or("")
                ));
            }
        }
    }
    assert!(failures.is_empty(), "flags that neither change the result nor are refused:\n{}", failures.join("\n"));
}

/// A workload flag for a part the workload does not run is refused, naming what it needs.
#[test]
fn a_flag_for_a_part_the_workload_does_not_run_is_refused() {
    for (args, want) in [
        (
            &["--rollout-batch", "4", "--preset", "llm-7b-sft"][..],
            "--rollout-batch does not apply here: it shapes rollouts",
        ),
        (&["--sft-batch", "4"][..], "--sft-batch does not apply here: it shapes supervised fine-tuning"),
        (&["--eval-every", "2"][..], "--eval-every does not apply here"),
        (
            &["--vision-layers", "2", "--vision", "false"][..],
            "--vision-layers does not apply here: it shapes the vision",
        ),
        (&["--images-max", "2", "--preset", "llm-7b-sft", "--vision", "true"][..], "--images-max does not apply here"),
        (&["--lora-rank", "8", "--optimizer", "full"][..], "--lora-rank does not apply here: it sizes LoRA adapters"),
        (&["--trainable-layers", "2"][..], "--trainable-layers does not apply here"),
    ] {
        for sub in ["agent", "gen-trace", "headroom"] {
            let out = Command::new(env!("CARGO_BIN_EXE_stepalloc-stress"))
                .arg(sub)
                .args(args)
                .args(["--iterations", "1", "--out", "/dev/null"].iter().take(if sub == "gen-trace" { 4 } else { 2 }))
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{sub} {args:?}: {err}");
            assert!(err.contains(want), "{sub} {args:?}: {err}");
        }
    }
}

/// The refusal names the flag and the subcommand, and says why.
#[test]
fn an_ignored_flag_is_refused_with_its_reason() {
    let out = Command::new(env!("CARGO_BIN_EXE_stepalloc-stress"))
        .args(["colocated", "--per-step", "--iterations", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--per-step does not apply to `colocated`: it reports no steps"), "{err}");
}
