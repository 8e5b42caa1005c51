//! `fdpblk plot`: a grouped bar chart as a PNG from a small JSON table, drawn with the raster
//! and PNG writer of `sim::plot` (no other dependency). `tools/waf-compare` uses it for its
//! chart.
//!
//! Input (a file, or `-` for standard input):
//! ```json
//! {"title": "write amplification per configuration", "y_label": "ratio",
//!  "series": ["fdpblk overhead", "drive media/host", "simulated waf"],
//!  "groups": [{"name": "raw", "values": [1.0, 1.02, 1.31]}, ...]}
//! ```
//! Each group gets one bar per series; a `null` value draws no bar and prints `-` in its
//! place. The y axis starts at `y_min` (default 0).

use super::CmdResult;
use crate::sim::plot::Canvas;
use clap::Args;
use serde_json::Value;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct PlotArgs {
    /// JSON table, `-` for stdin: {"title", "y_label", "y_min"?, "series": [names],
    /// "groups": [{"name", "values": [one number or null per series]}]}.
    pub table: PathBuf,
    /// Output PNG.
    #[arg(long, short)]
    pub out: PathBuf,
}

/// A parsed bar-chart table.
#[derive(Debug, Clone, PartialEq)]
pub struct BarTable {
    pub title: String,
    pub y_label: String,
    pub y_min: f64,
    pub series: Vec<String>,
    pub groups: Vec<(String, Vec<Option<f64>>)>,
}

/// Parses and checks a table; errors say what is wrong.
pub fn parse_table(v: &Value) -> Result<BarTable, String> {
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let series: Vec<String> = v
        .get("series")
        .and_then(Value::as_array)
        .ok_or("missing \"series\": a list of series names")?
        .iter()
        .map(|x| x.as_str().map(str::to_string).ok_or("\"series\" entries must be strings"))
        .collect::<Result<_, _>>()?;
    if series.is_empty() {
        return Err("\"series\" is empty".into());
    }
    // One colour each (8), and a legend line each: more could not be told apart.
    if series.len() > MAX_SERIES {
        return Err(format!("{} series: a chart holds at most {MAX_SERIES}; split the table", series.len()));
    }
    let mut groups = Vec::new();
    for g in v.get("groups").and_then(Value::as_array).ok_or("missing \"groups\": a list of {name, values}")? {
        let name = g.get("name").and_then(Value::as_str).ok_or("a group has no \"name\"")?.to_string();
        let vals = g.get("values").and_then(Value::as_array).ok_or_else(|| format!("group {name}: no \"values\" list"))?;
        if vals.len() != series.len() {
            return Err(format!("group {name}: {} values for {} series", vals.len(), series.len()));
        }
        let vals = vals
            .iter()
            .map(|x| match x {
                Value::Null => Ok(None),
                x => x
                    .as_f64()
                    .filter(|f| f.abs() <= MAX_VALUE)
                    .map(Some)
                    .ok_or_else(|| format!("group {name}: {x} is not a number (at most {MAX_VALUE:e} in size) or null")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        groups.push((name, vals));
    }
    if groups.is_empty() {
        return Err("\"groups\" is empty".into());
    }
    if groups.len() * series.len() > MAX_BARS {
        return Err(format!("{} bars: a chart holds at most {MAX_BARS}; split the table", groups.len() * series.len()));
    }
    let y_min = match v.get("y_min") {
        None | Some(Value::Null) => 0.0,
        Some(y) => y.as_f64().filter(|f| f.abs() <= MAX_VALUE).ok_or_else(|| format!("\"y_min\" {y} is not a number of at most {MAX_VALUE:e}"))?,
    };
    Ok(BarTable {
        title: s("title"),
        y_label: s("y_label"),
        y_min,
        series,
        groups,
    })
}

/// Bounds of a table: the canvas grows with the bars, and values far past any ratio or
/// percentage would only break the axis arithmetic.
const MAX_BARS: usize = 2000;
const MAX_SERIES: usize = 8;
const MAX_VALUE: f64 = 1e12;

/// Draws the grouped bar chart, values printed above their bars.
pub fn render(t: &BarTable) -> Canvas {
    let nbars = t.groups.len() * t.series.len();
    let bar_w = 40i64;
    let group_gap = 36i64;
    // Title, then one legend line per series, then the plot.
    let legend_top = 44i64;
    let top = legend_top + 22 * t.series.len() as i64 + 40;
    let (left, right, bottom) = (90i64, 40i64, 90i64);
    let groups_w = t.groups.len() as i64 * (t.series.len() as i64 * bar_w + group_gap);
    let w = (left + right + groups_w).max(640) as usize;
    let h = (top + 400 + bottom) as usize;
    let mut c = Canvas::new(w, h);
    let (pw, ph) = (w as i64 - left - right, h as i64 - top - bottom);
    let vmax = t.groups.iter().flat_map(|g| g.1.iter().flatten()).fold(t.y_min + 1e-9, |a, &b| a.max(b));
    let span = vmax - t.y_min;
    let step = [0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 20.0, 25.0, 50.0, 100.0]
        .into_iter()
        .find(|s| span / s <= 8.0)
        .unwrap_or_else(|| 10f64.powf((span / 8.0).log10().ceil()));
    let ymax = t.y_min + ((span / step).ceil().max(1.0)) * step;
    let py = |y: f64| top + ph - (((y - t.y_min) / (ymax - t.y_min)).clamp(0.0, 1.0) * ph as f64).round() as i64;
    // Counted, not accumulated: far from zero, y + step can round back to y.
    let lines = ((ymax - t.y_min) / step).round().clamp(0.0, 64.0) as u32;
    for k in 0..=lines {
        let y = t.y_min + f64::from(k) * step;
        c.line(left, py(y), left + pw, py(y), 2, 1, 0);
        let l = if step < 1.0 { format!("{y:.2}") } else { format!("{y:.0}") };
        c.text(left - 10 - Canvas::text_width(&l, 2), py(y) - 7, &l, 1, 2);
    }
    c.line(left, top, left, top + ph, 1, 2, 0);
    c.line(left, top + ph, left + pw, top + ph, 1, 2, 0);
    c.text(16, 16, &t.title, 1, 2);
    c.text(16, top - 28, &t.y_label, 3, 2);
    // Legend, one series per line under the title.
    for (i, s) in t.series.iter().enumerate() {
        let (color, y) = (4 + (i % 8) as u8, legend_top + 22 * i as i64);
        c.rect(16, y, 30, y + 14, color);
        c.text(38, y + 1, s, 1, 2);
    }
    let inner = pw - 2 * 12;
    let slot = inner as f64 / nbars.max(1) as f64;
    let bw = (slot * t.series.len() as f64 - group_gap as f64).max(t.series.len() as f64 * 4.0) / t.series.len() as f64;
    for (gi, (name, vals)) in t.groups.iter().enumerate() {
        let gx = left + 12 + (gi as f64 * slot * t.series.len() as f64) as i64 + group_gap / 2;
        for (si, v) in vals.iter().enumerate() {
            let x0 = gx + (si as f64 * bw) as i64;
            let x1 = gx + ((si + 1) as f64 * bw) as i64 - 2;
            let label = match v {
                Some(v) => {
                    c.rect(x0, py(*v), x1, top + ph - 1, 4 + (si % 8) as u8);
                    format!("{v:.3}")
                }
                None => "-".to_string(),
            };
            let ly = v.map_or(top + ph, py) - 12;
            c.text((x0 + x1) / 2 - Canvas::text_width(&label, 1) / 2, ly, &label, 1, 1);
        }
        let gw = (bw * t.series.len() as f64) as i64;
        c.text(gx + gw / 2 - Canvas::text_width(name, 2) / 2, top + ph + 14 + (gi as i64 % 2) * 22, name, 1, 2);
    }
    c
}

/// The largest table read (`simulate --json` of every policy and utilisation is a few KiB).
const MAX_TABLE_BYTES: u64 = 16 << 20;

pub fn run(a: &PlotArgs) -> CmdResult {
    let what = a.table.display().to_string();
    let text = if a.table.as_os_str() == "-" {
        super::read_text_at_most(std::io::stdin(), MAX_TABLE_BYTES, &what)?
    } else {
        std::fs::File::open(&a.table).map_err(|e| format!("cannot read {what}: {e}")).and_then(|f| super::read_text_at_most(f, MAX_TABLE_BYTES, &what))?
    };
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", a.table.display()))?;
    let t = parse_table(&v).map_err(|e| format!("{}: {e}", a.table.display()))?;
    std::fs::write(&a.out, render(&t).png()).map_err(|e| format!("cannot write {}: {e}", a.out.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tables_are_checked() {
        let good = json!({"title": "t", "series": ["a", "b"], "groups": [{"name": "x", "values": [1.0, null]}]});
        let t = parse_table(&good).unwrap();
        assert_eq!(t.groups, vec![("x".to_string(), vec![Some(1.0), None])]);
        for bad in [
            json!({"groups": [{"name": "x", "values": [1]}]}),
            json!({"series": [], "groups": [{"name": "x", "values": []}]}),
            json!({"series": ["a"], "groups": []}),
            json!({"series": ["a"], "groups": [{"name": "x", "values": [1, 2]}]}),
            json!({"series": ["a"], "groups": [{"name": "x", "values": ["1"]}]}),
            json!({"series": ["a"], "groups": [{"values": [1]}]}),
            json!({"series": ["a"], "groups": [{"name": "x", "values": [1e300]}]}),
            json!({"series": ["a"], "y_min": -1e300, "groups": [{"name": "x", "values": [1]}]}),
            json!({"series": ["a"], "groups": (0..3000).map(|i| json!({"name": i.to_string(), "values": [1]})).collect::<Vec<_>>()}),
            // 2000 series in one group: a canvas of gigabytes, and colours repeated.
            json!({"series": (0..2000).map(|i| i.to_string()).collect::<Vec<_>>(), "groups": [{"name": "x", "values": vec![1; 2000]}]}),
            json!({"series": (0..9).map(|i| i.to_string()).collect::<Vec<_>>(), "groups": [{"name": "x", "values": vec![1; 9]}]}),
        ] {
            assert!(parse_table(&bad).is_err(), "{bad}");
        }
        // Far from zero a step of 0.1 is below the float's resolution: the grid still ends.
        let far = json!({"series": ["a"], "y_min": 1e12, "groups": [{"name": "x", "values": [1e12]}]});
        assert!(!render(&parse_table(&far).unwrap()).png().is_empty());
    }

    #[test]
    fn bars_are_drawn_to_scale() {
        let t = parse_table(&json!({"title": "t", "series": ["a", "b"],
            "groups": [{"name": "x", "values": [1.0, 2.0]}, {"name": "y", "values": [null, 0.5]}]}))
        .unwrap();
        let c = render(&t);
        // Count the pixels of each series' colour: bar b of x is twice bar a of x's height,
        // and equal in width, so about twice as many pixels (legend squares included).
        let count = |col: u8| (0..c.h).flat_map(|y| (0..c.w).map(move |x| (x, y))).filter(|&(x, y)| c.get(x, y) == col).count();
        let (a, b) = (count(4) as f64, count(5) as f64);
        // b = 2.0 + 0.5 = 2.5 units of bar, a = 1.0 unit (legend squares are equal).
        assert!(a > 0.0 && b > 2.0 * a && b < 3.0 * a, "a {a} b {b}");
        let png = c.png();
        assert_eq!(&png[1..4], b"PNG");
    }
}
