//! SVG line plots of a scenario's series, one line per target, so latency over time and
//! re-grants after a zone failure can be compared at a glance.
//!
//! Built on plotters' SVG backend without its `ttf` feature: text is written as SVG
//! `<text>` elements that the viewer renders, so no font library or system font is
//! needed when plotting (plotters only estimates text widths for layout).

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;

/// One named line of a plot, typically one target's series.
#[derive(Debug, Clone)]
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// Line colours in order (the Okabe–Ito palette), told apart by colour-blind readers
/// too; the drivers pass lines in target order, so a target keeps its colour across plots.
const COLOURS: &[RGBColor] = &[
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(240, 228, 66),
];

/// Size of every plot in pixels: wide enough for a minutes-long time axis.
const SIZE: (u32, u32) = (1024, 600);

/// Writes an SVG line plot (one coloured line per Line, legend with labels, axis descriptions) to `path`.
///
/// The y axis starts at zero (or below, for negative data) so that lines of different
/// targets are compared by height, not by a zoomed-in difference. Non-finite points are
/// skipped; with no points at all the plot is drawn with empty unit axes.
pub fn line_plot(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    lines: &[Line],
) -> anyhow::Result<()> {
    let finite: Vec<Vec<(f64, f64)>> = lines
        .iter()
        .map(|l| {
            l.points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .collect()
        })
        .collect();
    let all = || finite.iter().flatten();
    let (x_lo, x_hi) = span(all().map(|p| p.0), false);
    let (y_lo, y_hi) = span(all().map(|p| p.1), true);

    let draw = || -> anyhow::Result<()> {
        let root = SVGBackend::new(path, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 24))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(72)
            .build_cartesian_2d(x_lo..x_hi, y_lo..y_hi)?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .draw()?;
        for (i, (line, points)) in lines.iter().zip(&finite).enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    colour.stroke_width(2),
                ))?
                .label(line.label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().with_context(|| format!("plotting {}", path.display()))
}

/// Range of an axis covering `values`, never empty; from zero when `from_zero` and the
/// values are all positive.
fn span(values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if lo > hi {
        return (0.0, 1.0);
    }
    if from_zero {
        lo = lo.min(0.0);
        // Headroom so the highest point does not sit on the frame.
        hi += (hi - lo) * 0.05;
    }
    if hi <= lo {
        hi = lo + 1.0;
    }
    (lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_an_svg_with_every_label() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keepalive-p99.svg");
        let lines = vec![
            Line {
                label: "lockcell".to_string(),
                points: (0..60).map(|s| (s as f64, 2.0 + (s % 7) as f64)).collect(),
            },
            Line {
                label: "etcd".to_string(),
                points: vec![(0.0, 5.0), (30.0, f64::NAN), (59.0, 9.0)],
            },
            Line {
                label: "etcd-grpc-proxy".to_string(),
                points: vec![(0.0, 1.0), (59.0, 4.0)],
            },
        ];
        line_plot(
            &path,
            "keepalive p99 <per second>",
            "seconds",
            "p99 (ms)",
            &lines,
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
        for text in [
            "lockcell",
            "etcd-grpc-proxy",
            "seconds",
            "p99 (ms)",
            "&lt;per second&gt;",
        ] {
            assert!(svg.contains(text), "missing {text}");
        }
        assert!(svg.contains("<polyline") || svg.contains("<path"));
    }

    #[test]
    fn empty_and_flat_data_still_plot() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.svg");
        line_plot(&path, "nothing", "x", "y", &[]).unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("nothing"));
        let flat = [Line {
            label: "flat".to_string(),
            points: vec![(3.0, 0.0), (3.0, 0.0)],
        }];
        line_plot(&path, "flat", "x", "y", &flat).unwrap();
        assert!(std::fs::read_to_string(&path).unwrap().contains("flat"));
    }

    #[test]
    fn spans() {
        assert_eq!(span([].into_iter(), true), (0.0, 1.0));
        assert_eq!(span([2.0, 4.0].into_iter(), false), (2.0, 4.0));
        assert_eq!(span([5.0, 15.0].into_iter(), true), (0.0, 15.75));
        assert_eq!(span([-10.0, 10.0].into_iter(), true), (-10.0, 11.0));
        assert_eq!(span([3.0].into_iter(), false), (3.0, 4.0));
    }

    #[test]
    fn unwritable_path_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no/such/dir/plot.svg");
        assert!(line_plot(&path, "t", "x", "y", &[]).is_err());
    }
}
