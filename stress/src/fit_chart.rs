//! The picture of `fit`: one chart of the device's memory over the trace, every configuration's
//! reserved bytes as a line against the usable memory, each peak marked, each first
//! out-of-memory crossed, the steps shaded by phase, the live tensors as an area beneath, and
//! beside it a legend with each configuration's verdict and the modules live at the peak.
//! Layer: drawing over `fit`'s report and the runs' timelines; no I/O.
//!
//! `svg` gives the chart alone; `html` a self-contained page (no network, no external script or
//! font) with the chart, the table and a small script that checks every series is drawn: it
//! writes its verdict into `#check` (`data-ok="true"`), which the browser test reads.
//!
//! Invariants: every text from the trace or the user (module names, configuration names) is
//! escaped; coordinates are finite (scales never divide by zero); the SVG has one
//! `.series` polyline and one `.peak-marker` per configuration, and the root's
//! `data-series` says how many.

use crate::fit::{count, site_text, size, Fit};
use crate::report::gib;
use std::fmt::Write as _;

const W: f64 = 1040.0;
/// The plot area.
const LEFT: f64 = 64.0;
const TOP: f64 = 84.0;
const PLOT_W: f64 = 600.0;
const PLOT_H: f64 = 380.0;
/// The legend and module panel, right of the plot.
const PANEL_X: f64 = LEFT + PLOT_W + 40.0;
const PANEL_W: f64 = W - PANEL_X - 16.0;
/// Line colours of the configurations, in order (the usable line is red, the area grey).
const COLOURS: &[&str] = &["#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c", "#8c564b", "#e377c2", "#17becf", "#bcbd22"];
/// Tints of the steps' bands, by phase (in the order phases first appear).
const TINTS: &[&str] = &["#eef3f9", "#fbf3e4", "#eef7ee", "#f7eef5"];
/// Steps up to which each band is labelled.
const LABELLED_STEPS: usize = 16;
const FONT: &str = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', sans-serif";

/// Escapes text for SVG and HTML, attributes included.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The column whose peak the module panel describes: the user's own setting, else the first.
fn described(f: &Fit) -> usize {
    f.report.configs.iter().position(|c| c.name == crate::fit::YOURS).unwrap_or(0)
}

/// A tick step (in the axis' unit) that gives at most 8 intervals up to `top`.
fn tick_step(top: f64) -> f64 {
    for step in [0.125, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0] {
        if top / step <= 8.0 {
            return step;
        }
    }
    5000.0
}

/// `text` cut to `max` characters, keeping its end (a module path's informative part).
fn keep_end(text: &str, max: usize) -> String {
    let n = text.chars().count();
    if n <= max {
        return text.to_string();
    }
    let tail: String = text.chars().skip(n - (max - 1)).collect();
    format!("…{tail}")
}

/// The chart alone.
pub fn svg(f: &Fit) -> String {
    let r = &f.report;
    let runs = &f.runs;
    let capacity = r.device.capacity_bytes;
    let usable = r.device.usable_bytes;
    let highest = runs.iter().flat_map(|run| run.timeline.iter()).map(|s| s.reserved_max.max(s.reserved)).max();
    // The axis reaches a little above the usable line or the highest line; the memory outside
    // PyTorch fills what is above the usable line, up to the device's capacity.
    let top_bytes = usable.max(highest.unwrap_or(0)).max(1 << 20) as f64 * 1.08;
    let (unit, unit_bytes) = if top_bytes >= (1u64 << 30) as f64 { ("GiB", 1u64 << 30) } else { ("MiB", 1 << 20) };
    let in_unit = |b: u64| b as f64 / unit_bytes as f64;
    let step = tick_step(top_bytes / unit_bytes as f64);
    let y_max = (top_bytes / unit_bytes as f64 / step).ceil() * step;
    let x_max = runs.iter().flat_map(|run| run.timeline.last()).map(|s| s.op).max().unwrap_or(1).max(1) as f64;
    let sx = |op: u64| LEFT + op as f64 / x_max * PLOT_W;
    let sy = |bytes: u64| TOP + PLOT_H - in_unit(bytes).min(y_max) / y_max * PLOT_H;
    let module_rows = r.configs.get(described(f)).map_or(0, |c| crate::fit::shown_modules(c).0.len());
    let legend_h = 20.0 + r.configs.len() as f64 * 40.0 + 24.0;
    let panel_h = legend_h + 40.0 + module_rows as f64 * 30.0;
    let height = (TOP + PLOT_H + 60.0).max(TOP + panel_h + 10.0).ceil();

    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" class="fit-chart" data-series="{}" width="{W}" height="{height}" viewBox="0 0 {W} {height}" font-family="{FONT}" font-size="12" role="img">"#,
        runs.len()
    );
    let _ = writeln!(
        o,
        "<title>Memory of {} on a {} GiB device under {} configurations</title>",
        escape(&r.trace.path),
        gib(capacity),
        runs.len()
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    // Title, verdict and subtitle.
    let name = std::path::Path::new(&r.trace.path)
        .file_name()
        .map_or(r.trace.path.clone(), |n| n.to_string_lossy().into_owned());
    let _ = writeln!(
        o,
        r##"<text x="{LEFT}" y="26" font-size="18" font-weight="600" fill="#1a1a1a">Will it fit? {} on a {} GiB device</text>"##,
        escape(&keep_end(&name, 56)),
        gib(capacity)
    );
    let names =
        |fits: bool| -> Vec<&str> { r.configs.iter().filter(|c| c.fits == fits).map(|c| c.name.as_str()).collect() };
    let (yes, no) = (names(true), names(false));
    let mut verdict = String::new();
    if !yes.is_empty() {
        let _ = write!(verdict, r##"<tspan fill="#2e7d32">fits under {}</tspan>"##, escape(&yes.join(", ")));
    }
    if !no.is_empty() {
        let sep = if yes.is_empty() { "" } else { "; " };
        let _ =
            write!(verdict, r##"{sep}<tspan fill="#c62828">out of memory under {}</tspan>"##, escape(&no.join(", ")));
    }
    let _ =
        writeln!(o, r##"<text class="verdict" x="{LEFT}" y="48" font-size="14" font-weight="600">{verdict}</text>"##);
    let _ = writeln!(
        o,
        r##"<text x="{LEFT}" y="68" fill="#555">{} usable ({} outside PyTorch) · live tensors peak at {} · {} allocations{}</text>"##,
        size(usable),
        size(r.device.outside_bytes),
        size(r.trace.floor_bytes),
        count(r.trace.allocations),
        if r.trace.steps > 0 { format!(" in {} steps", count(r.trace.steps)) } else { String::new() }
    );

    // Step bands, tinted by phase.
    if let Some(first) = runs.first() {
        let mut phases: Vec<&str> = Vec::new();
        for (i, s) in first.steps.iter().enumerate() {
            let end = first.steps.get(i + 1).map_or(x_max as u64, |n| n.first_op);
            let k = phases.iter().position(|p| *p == s.phase).unwrap_or_else(|| {
                phases.push(&s.phase);
                phases.len() - 1
            });
            let (x0, x1) = (sx(s.first_op), sx(end));
            let _ = writeln!(
                o,
                r#"<rect class="step" x="{x0:.1}" y="{TOP}" width="{:.1}" height="{PLOT_H}" fill="{}"/>"#,
                (x1 - x0).max(0.5),
                TINTS[k % TINTS.len()]
            );
            if i > 0 {
                let _ = writeln!(
                    o,
                    r##"<line x1="{x0:.1}" y1="{TOP}" x2="{x0:.1}" y2="{:.1}" stroke="#ffffff" stroke-width="2"/>"##,
                    TOP + PLOT_H
                );
            }
            if first.steps.len() <= LABELLED_STEPS && x1 - x0 > 36.0 {
                let _ = writeln!(
                    o,
                    r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11" fill="#777">{} {}</text>"##,
                    (x0 + x1) / 2.0,
                    TOP + PLOT_H + 15.0,
                    escape(&s.phase),
                    i + 1
                );
            }
        }
    }
    // Grid and axes.
    let mut v = 0.0;
    while v <= y_max + 1e-9 {
        let y = TOP + PLOT_H - v / y_max * PLOT_H;
        let _ = writeln!(
            o,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e3e3e3"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
            LEFT + PLOT_W,
            LEFT - 8.0,
            y + 4.0,
            if step < 1.0 { format!("{v:.2}") } else { format!("{v:.0}") }
        );
        v += step;
    }
    let _ = writeln!(
        o,
        r##"<text x="16" y="{:.1}" transform="rotate(-90 16 {:.1})" text-anchor="middle" fill="#555">{unit} of device memory</text>"##,
        TOP + PLOT_H / 2.0,
        TOP + PLOT_H / 2.0
    );
    let _ = writeln!(
        o,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#555">trace events 0 – {}: allocations and frees in order, steps shaded →</text>"##,
        LEFT + PLOT_W / 2.0,
        TOP + PLOT_H + 36.0,
        count(x_max as u64)
    );
    // Memory outside PyTorch: the band between the usable line and the device's capacity.
    let (yu, yc) = (sy(usable), sy(capacity));
    let _ = writeln!(
        o,
        r##"<defs><pattern id="outside" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="#c9c9c9" stroke-width="2"/></pattern></defs><rect x="{LEFT}" y="{yc:.1}" width="{PLOT_W}" height="{:.1}" fill="url(#outside)"/>"##,
        (yu - yc).max(0.0)
    );
    // Live tensors (requested bytes) beneath: from the run that skipped fewest allocations.
    if let Some(run) = runs.iter().min_by_key(|run| run.ooms) {
        let mut d = format!("M{:.1},{:.1}", LEFT, TOP + PLOT_H);
        for s in &run.timeline {
            let _ = write!(d, " L{:.1},{:.1}", sx(s.op), sy(s.requested));
        }
        let _ = write!(d, " L{:.1},{:.1} Z", sx(run.timeline.last().map_or(0, |s| s.op)), TOP + PLOT_H);
        let _ = writeln!(o, r##"<path class="live" d="{d}" fill="#d5d9df" stroke="#b5bac2" stroke-width="0.8"/>"##);
    }
    // The usable line.
    let _ = writeln!(
        o,
        r##"<line class="usable" x1="{LEFT}" y1="{yu:.1}" x2="{:.1}" y2="{yu:.1}" stroke="#c62828" stroke-width="2" stroke-dasharray="7 4"/><text x="{:.1}" y="{:.1}" fill="#c62828" font-weight="600">usable {}</text>"##,
        LEFT + PLOT_W,
        LEFT + 6.0,
        yu - 6.0,
        size(usable)
    );
    // Each configuration's reserved bytes, its peak and its first out-of-memory.
    for (i, (run, c)) in runs.iter().zip(&r.configs).enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let mut points = String::new();
        for s in &run.timeline {
            let _ = write!(points, "{:.1},{:.1} ", sx(s.op), sy(s.reserved_max.max(s.reserved)));
        }
        let _ = writeln!(
            o,
            r#"<polyline class="series" data-config="{}" fill="none" stroke="{colour}" stroke-width="2.2" stroke-linejoin="round" points="{}"/>"#,
            escape(&c.name),
            points.trim_end()
        );
    }
    for (i, (run, c)) in runs.iter().zip(&r.configs).enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let (px, py) = match &run.peak_moment {
            Some(p) => (sx(p.op), sy(c.peak_reserved_bytes)),
            None => (LEFT, sy(0)),
        };
        let _ = writeln!(
            o,
            r#"<circle class="peak-marker" data-config="{}" cx="{px:.1}" cy="{py:.1}" r="5.5" fill="{colour}" stroke="white" stroke-width="2"><title>{}: peak {} reserved</title></circle>"#,
            escape(&c.name),
            escape(&c.name),
            size(c.peak_reserved_bytes)
        );
        if let Some(m) = &run.first_oom {
            let (x, y) = (sx(m.op), yu);
            let _ = writeln!(
                o,
                r#"<g class="oom-marker" data-config="{}" stroke="{colour}" stroke-width="3" stroke-linecap="round"><line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}"/><line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}"/><title>{}: first out of memory</title></g>"#,
                escape(&c.name),
                x - 6.0,
                y - 6.0,
                x + 6.0,
                y + 6.0,
                x - 6.0,
                y + 6.0,
                x + 6.0,
                y - 6.0,
                escape(&c.name)
            );
        }
    }
    let _ = writeln!(
        o,
        r##"<rect x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}" fill="none" stroke="#9a9a9a"/>"##
    );
    legend(&mut o, f);
    o.push_str("</svg>\n");
    o
}

/// The panel right of the plot: each configuration's verdict, then the modules at a peak.
fn legend(o: &mut String, f: &Fit) {
    let r = &f.report;
    let mut y = TOP + 4.0;
    for (i, c) in r.configs.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let _ = writeln!(
            o,
            r#"<line x1="{PANEL_X}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-width="3"/><circle cx="{:.1}" cy="{:.1}" r="4" fill="{colour}"/><text x="{:.1}" y="{:.1}" font-weight="600">{}</text>"#,
            y - 4.0,
            PANEL_X + 22.0,
            y - 4.0,
            PANEL_X + 11.0,
            y - 4.0,
            PANEL_X + 30.0,
            y,
            escape(&c.name)
        );
        let _ = writeln!(
            o,
            r##"<text x="{:.1}" y="{y:.1}" text-anchor="end" fill="#333">peak {}</text>"##,
            PANEL_X + PANEL_W,
            size(c.peak_reserved_bytes)
        );
        let (verdict, colour) = if c.fits {
            (format!("fits, {} to spare", size(c.headroom_bytes)), "#2e7d32")
        } else {
            let at = c.first_oom.as_ref().map_or(String::new(), |m| format!(" at allocation {}", count(m.allocation)));
            (format!("out of memory{at}"), "#c62828")
        };
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" fill="{colour}">{}</text>"#,
            PANEL_X + 30.0,
            y + 16.0,
            escape(&verdict)
        );
        y += 40.0;
    }
    let _ = writeln!(
        o,
        r##"<rect x="{PANEL_X}" y="{:.1}" width="14" height="10" fill="#d5d9df" stroke="#b5bac2"/><text x="{:.1}" y="{:.1}" fill="#555">live tensors</text><rect x="{:.1}" y="{:.1}" width="14" height="10" fill="url(#outside)"/><text x="{:.1}" y="{:.1}" fill="#555">outside PyTorch</text>"##,
        y - 10.0,
        PANEL_X + 20.0,
        y,
        PANEL_X + 110.0,
        y - 10.0,
        PANEL_X + 130.0,
        y
    );
    y += 34.0;
    let Some(c) = r.configs.get(described(f)) else { return };
    if r.trace.sites == "none" {
        let _ = writeln!(
            o,
            r##"<text x="{PANEL_X}" y="{y:.1}" fill="#555">The trace records no modules: record the step</text><text x="{PANEL_X}" y="{:.1}" fill="#555">with python -m stepalloc.fit to see them here.</text>"##,
            y + 16.0
        );
        return;
    }
    let (groups, how) = crate::fit::shown_modules(c);
    if groups.is_empty() {
        return;
    }
    let when = match (&c.peak_phase, c.peak_step) {
        (Some(phase), Some(step)) => format!(" ({phase} step {step})"),
        _ => String::new(),
    };
    let _ = writeln!(
        o,
        r##"<text class="modules-title" x="{PANEL_X}" y="{y:.1}" font-weight="600">Live at {}'s peak{}</text><text x="{PANEL_X}" y="{:.1}" fill="#777" font-size="11">{}</text>"##,
        escape(&c.name),
        escape(&when),
        y + 15.0,
        escape(how)
    );
    y += 22.0;
    let most = groups.iter().map(|m| m.bytes).max().unwrap_or(1).max(1) as f64;
    for m in groups {
        y += 30.0;
        let w = (m.bytes as f64 / most * (PANEL_W - 70.0)).max(1.0);
        let _ = writeln!(
            o,
            r##"<text class="module" x="{PANEL_X}" y="{:.1}" fill="#333" font-size="11">{}<title>{}</title></text><rect x="{PANEL_X}" y="{:.1}" width="{w:.1}" height="8" rx="2" fill="#8fa3bf"/><text x="{:.1}" y="{:.1}" fill="#555" font-size="11">{}</text>"##,
            y - 12.0,
            escape(&keep_end(&m.module, 54)),
            escape(&m.module),
            y - 6.0,
            PANEL_X + w + 6.0,
            y + 2.0,
            escape(&size(m.bytes))
        );
    }
}

/// A self-contained page: the chart, the table, and the check that every series is drawn.
pub fn html(f: &Fit) -> String {
    let r = &f.report;
    let mut rows = String::new();
    for c in &r.configs {
        let verdict = if c.fits {
            "<td class=\"yes\">fits</td>".to_string()
        } else {
            format!(
                "<td class=\"no\">out of memory{}</td>",
                c.first_oom.as_ref().map_or(String::new(), |m| format!(" at allocation {}", count(m.allocation)))
            )
        };
        let _ = writeln!(
            rows,
            "<tr><th>{}<br><code>{}</code></th>{verdict}<td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&c.name),
            escape(&c.env).replace(',', ",<wbr>"),
            size(c.peak_reserved_bytes),
            size(c.peak_allocated_bytes),
            if c.fits { size(c.headroom_bytes) } else { "–".to_string() },
            c.alloc_retries
        );
    }
    let mut ooms = String::new();
    for c in &r.configs {
        if let Some(m) = &c.first_oom {
            let _ = writeln!(
                ooms,
                "<li><b>{}</b>: allocation {} of {}{}{} failed with {} cached but free, the largest free block {} \
                 ({:.0}% fragmented).</li>",
                escape(&c.name),
                count(m.allocation),
                escape(&size(m.size)),
                escape(&site_text(&m.module, &m.torch_op)),
                match (&m.phase, m.step) {
                    (Some(p), Some(s)) => format!(" ({} step {s})", escape(p)),
                    _ => String::new(),
                },
                escape(&size(m.cached_free_bytes)),
                escape(&size(m.largest_free_block_bytes)),
                m.external_fragmentation * 100.0
            );
        }
    }
    let ooms = if ooms.is_empty() { String::new() } else { format!("<h2>First out-of-memory</h2><ul>{ooms}</ul>") };
    let notes: String = r.notes.iter().map(|n| format!("<li>{}</li>", escape(n))).collect();
    let notes = if notes.is_empty() { String::new() } else { format!("<h2>Notes</h2><ul>{notes}</ul>") };
    format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Will it fit? {title}</title>
<style>
body {{ font-family: {FONT}; color: #1a1a1a; margin: 24px auto; max-width: 1080px; padding: 0 16px; }}
h2 {{ font-size: 16px; margin: 24px 0 8px; }}
figure {{ margin: 0; }} svg {{ max-width: 100%; height: auto; }}
table {{ border-collapse: collapse; font-variant-numeric: tabular-nums; }}
th, td {{ padding: 6px 12px; border-bottom: 1px solid #e3e3e3; text-align: right; }}
th:first-child {{ text-align: left; max-width: 420px; }} th code {{ font-weight: normal; color: #555; }}
thead th {{ color: #555; font-weight: 600; }} td.yes, td.no, thead th:nth-child(2) {{ text-align: left; }}
td.yes, td.no {{ font-weight: 600; white-space: nowrap; }} td.yes {{ color: #2e7d32; }} td.no {{ color: #c62828; }}
code {{ font-size: 12px; }} td:nth-child(2) {{ max-width: 320px; }} #check {{ color: #777; font-size: 12px; }}
</style></head>
<body>
<figure>
{svg}</figure>
<h2>Each configuration</h2>
<table><thead><tr><th>configuration</th><th>verdict</th><th>peak reserved</th><th>peak allocated</th><th>headroom</th><th>alloc retries</th></tr></thead>
<tbody>
{rows}</tbody></table>
{ooms}{notes}
<p id="check" data-ok="false">the chart's check did not run</p>
<script>
(function () {{
  var svg = document.querySelector("svg.fit-chart");
  var el = document.getElementById("check");
  var want = Number(svg.getAttribute("data-series"));
  var missing = [];
  var series = svg.querySelectorAll("polyline.series");
  series.forEach(function (p) {{
    var box = p.getBBox();
    if (!(p.points.numberOfItems > 1 && box.width > 0)) missing.push(p.getAttribute("data-config"));
  }});
  var peaks = svg.querySelectorAll("circle.peak-marker").length;
  var ok = series.length === want && peaks === want && missing.length === 0;
  el.setAttribute("data-ok", ok ? "true" : "false");
  el.textContent = ok
    ? "check: all " + want + " series drawn, " + peaks + " peaks marked"
    : "check FAILED: " + series.length + " of " + want + " series, " + peaks + " peaks, not drawn: " + missing.join(", ");
}})();
</script>
</body></html>
"#,
        title = escape(&r.trace.path),
        svg = svg(f),
    )
}
