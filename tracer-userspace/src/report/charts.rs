//! The page's charts, drawn by `plotters` into SVG strings: vector, a few kilobytes each, text
//! as `<text>` the browser renders with its own fonts (no font files in the binary, nothing
//! fetched), escaped by the backend.

use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;

use super::batch::{Series, TimelineRow};
use crate::model::rollout::{PerPhase, Phase};

type Drawn = Result<(), Box<dyn std::error::Error>>;

pub const WIDTH: u32 = 960;

/// The colour of a phase, the same in every chart and in the page's legend.
pub fn phase_color(phase: Phase) -> RGBColor {
    match phase {
        Phase::Model => RGBColor(0x4e, 0x79, 0xa7),
        Phase::Tool => RGBColor(0xf2, 0x8e, 0x2b),
        Phase::Verify => RGBColor(0x59, 0xa1, 0x4f),
        Phase::Queue => RGBColor(0xe1, 0x57, 0x59),
        Phase::External => RGBColor(0xb0, 0x7a, 0xa1),
        Phase::Agent => RGBColor(0x9c, 0x75, 0x5f),
    }
}

fn line_color(index: usize) -> RGBColor {
    const COLORS: [RGBColor; 8] = [
        RGBColor(0x4e, 0x79, 0xa7),
        RGBColor(0xe1, 0x57, 0x59),
        RGBColor(0x59, 0xa1, 0x4f),
        RGBColor(0xf2, 0x8e, 0x2b),
        RGBColor(0xb0, 0x7a, 0xa1),
        RGBColor(0x76, 0xb7, 0xb2),
        RGBColor(0x9c, 0x75, 0x5f),
        RGBColor(0xed, 0xc9, 0x48),
    ];
    COLORS[index % COLORS.len()]
}

/// Draws with `draw` on a `width` × `height` SVG; a failure is said in the chart's place.
fn svg(
    width: u32,
    height: u32,
    draw: impl FnOnce(DrawingArea<SVGBackend<'_>, plotters::coord::Shift>) -> Drawn,
) -> String {
    let mut out = String::new();
    let result = {
        let root = SVGBackend::with_string(&mut out, (width, height)).into_drawing_area();
        root.fill(&WHITE)
            .map_err(Into::into)
            .and_then(|()| draw(root.clone()))
            .and_then(|()| root.present().map_err(Into::into))
    };
    match result {
        Ok(()) => out,
        Err(error) => format!("<p class=\"error\">this chart could not be drawn: {error}</p>"),
    }
}

/// At most `chars` characters, an ellipsis where cut.
fn shortened(text: &str, chars: usize) -> String {
    if text.chars().count() <= chars {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(chars - 1).collect();
    out.push('…');
    out
}

/// Rollouts per duration bin: (start s, end s, count).
pub fn histogram(bins: &[(f64, f64, u64)]) -> String {
    svg(WIDTH, 280, |root| {
        let x_max = bins.last().map_or(1.0, |b| b.1);
        let y_max = bins.iter().map(|b| b.2).max().unwrap_or(1).max(1) as f64 * 1.1;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc("rollout duration (s)")
            .y_desc("rollouts")
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()?;
        chart.draw_series(bins.iter().filter(|b| b.2 > 0).map(|&(start, end, count)| {
            Rectangle::new(
                [(start, 0.0), (end, count as f64)],
                phase_color(Phase::Model).filled(),
            )
        }))?;
        Ok(())
    })
}

/// How a chart of labelled rows is laid out.
struct RowLayout {
    label_width: u32,
    label_chars: usize,
    font_size: u32,
    margin: u32,
    x_desc: &'static str,
}

type RowChart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<
        plotters::coord::types::RangedCoordf64,
        plotters::coord::ranged1d::SegmentedCoord<plotters::coord::types::RangedCoordi32>,
    >,
>;

/// A chart of rows labelled `labels`, top to bottom, over `0..x_max` seconds; draw row `i`
/// between [`row_bounds`].
fn row_chart<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    labels: &[String],
    x_max: f64,
    layout: &RowLayout,
) -> Result<RowChart<'a, 'b>, Box<dyn std::error::Error>> {
    // Two segments at least: one (0..0) is drawn upside down.
    let n = labels.len().max(2) as i32;
    let mut chart = ChartBuilder::on(root)
        .margin(layout.margin)
        .x_label_area_size(36)
        .y_label_area_size(layout.label_width)
        .build_cartesian_2d(0.0..x_max, (0..n - 1).into_segmented())?;
    let label = |value: &SegmentValue<i32>| match value {
        SegmentValue::CenterOf(i) => labels
            .get((n - 1 - i) as usize)
            .map(|label| shortened(label, layout.label_chars))
            .unwrap_or_default(),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(labels.len())
        .y_label_formatter(&label)
        .label_style(("sans-serif", layout.font_size))
        .x_desc(layout.x_desc)
        .draw()?;
    Ok(chart)
}

/// The y coordinates between which row `index` of `rows` is drawn (row 0 on top).
fn row_bounds(rows: usize, index: usize) -> (SegmentValue<i32>, SegmentValue<i32>) {
    let y = rows.max(2) as i32 - 1 - index as i32;
    (SegmentValue::Exact(y), SegmentValue::Exact(y + 1))
}

/// Horizontal stacked bars, one per labelled row, of seconds per phase.
pub fn phase_bars(rows: &[(String, PerPhase<u64>)]) -> String {
    let height = 70 + 44 * rows.len().max(2) as u32;
    svg(WIDTH, height, |root| {
        let x_max = rows
            .iter()
            .map(|(_, ms)| ms.iter().sum::<u64>())
            .max()
            .unwrap_or(1)
            .max(1) as f64
            / 1e3;
        let labels: Vec<String> = rows.iter().map(|(label, _)| label.clone()).collect();
        let layout = RowLayout {
            label_width: 230,
            label_chars: 40,
            font_size: 13,
            margin: 12,
            x_desc: "seconds",
        };
        let mut chart = row_chart(&root, &labels, x_max * 1.02, &layout)?;
        for (row, (_, ms)) in rows.iter().enumerate() {
            let (low, high) = row_bounds(rows.len(), row);
            let mut x = 0.0;
            for phase in Phase::ALL {
                let width = ms[phase as usize] as f64 / 1e3;
                if width <= 0.0 {
                    continue;
                }
                let mut bar = Rectangle::new(
                    [(x, low.clone()), (x + width, high.clone())],
                    phase_color(phase).filled(),
                );
                bar.set_margin(6, 6, 0, 0);
                chart.draw_series([bar])?;
                x += width;
            }
        }
        Ok(())
    })
}

/// What a line chart's y axis counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    /// Rollouts.
    Count,
    /// Seconds waited.
    Wait,
    /// A share of time busy, 0..=1.
    Busy,
}

impl Axis {
    fn description(self) -> &'static str {
        match self {
            Axis::Count => "rollouts",
            Axis::Wait => "wait",
            Axis::Busy => "busy",
        }
    }

    fn label(self, y: f64, y_max: f64) -> String {
        match self {
            Axis::Count => format!("{y:.0}"),
            Axis::Wait if y_max < 1.0 => format!("{:.0} ms", y * 1e3),
            Axis::Wait => format!("{y:.1} s"),
            Axis::Busy => format!("{:.0} %", y * 100.0),
        }
    }
}

/// Lines over the batch's time, one per named series.
pub fn lines(series: &[(String, &Series)], axis: Axis) -> String {
    svg(WIDTH, 300, |root| {
        let x_max = series
            .iter()
            .flat_map(|(_, s)| s.points.iter().map(|p| p.0))
            .fold(1.0, f64::max);
        let data_max = series
            .iter()
            .flat_map(|(_, s)| s.points.iter().map(|p| p.1))
            .fold(0.0, f64::max);
        let y_max = match axis {
            Axis::Busy => 1.0,
            _ => (data_max * 1.1).max(1e-3),
        };
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
        let y_format = |y: &f64| axis.label(*y, y_max);
        chart
            .configure_mesh()
            .x_desc("seconds since the first rollout started")
            .y_desc(axis.description())
            .y_label_formatter(&y_format)
            .draw()?;
        for (index, (name, series)) in series.iter().enumerate() {
            let color = line_color(index);
            chart
                .draw_series(LineSeries::new(
                    series.points.iter().copied(),
                    color.stroke_width(2),
                ))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
            // A line of a few points (one metric export a minute) shows its points.
            if series.points.len() <= 40 {
                chart.draw_series(
                    series
                        .points
                        .iter()
                        .map(|&point| Circle::new(point, 3, color.filled())),
                )?;
            }
        }
        if series.len() > 1 || series.first().is_some_and(|(name, _)| !name.is_empty()) {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK.mix(0.3))
                .draw()?;
        }
        Ok(())
    })
}

/// A rollout's critical path: one row per span, its extent in grey, its stretches on the
/// path coloured by phase; times in seconds since the rollout started.
pub fn timeline(rows: &[TimelineRow], start_ns: u64, end_ns: u64) -> String {
    let height = 56 + 22 * rows.len().max(2) as u32;
    svg(WIDTH, height, |root| {
        let seconds = |ns: u64| ns.saturating_sub(start_ns) as f64 / 1e9;
        let labels: Vec<String> = rows.iter().map(|row| row.label.clone()).collect();
        let layout = RowLayout {
            label_width: 380,
            label_chars: 58,
            font_size: 12,
            margin: 8,
            x_desc: "seconds since the rollout started",
        };
        let mut chart = row_chart(&root, &labels, seconds(end_ns).max(1e-3), &layout)?;
        for (index, row) in rows.iter().enumerate() {
            let (low, high) = row_bounds(rows.len(), index);
            let mut extent = Rectangle::new(
                [
                    (seconds(row.start_ns), low.clone()),
                    (seconds(row.end_ns), high.clone()),
                ],
                RGBColor(0xd0, 0xd0, 0xd0).filled(),
            );
            extent.set_margin(5, 5, 0, 0);
            chart.draw_series([extent])?;
            chart.draw_series(row.segments.iter().map(|&(phase, from, to)| {
                let mut bar = Rectangle::new(
                    [(seconds(from), low.clone()), (seconds(to), high.clone())],
                    phase_color(phase).filled(),
                );
                bar.set_margin(3, 3, 0, 0);
                bar
            }))?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_svg_with_their_labels_escaped() {
        let bars = phase_bars(&[("p50 <0-1>".to_owned(), [1000, 0, 0, 500, 0, 0])]);
        assert!(bars.starts_with("<svg"), "{}", &bars[..bars.len().min(200)]);
        assert!(bars.contains("p50 &lt;0-1&gt;"));
        assert!(
            bars.contains("#4E79A7") || bars.contains("#4e79a7"),
            "the model colour"
        );
        let histogram = histogram(&[(0.0, 1.0, 3), (1.0, 2.0, 0), (2.0, 3.0, 1)]);
        assert!(histogram.contains("rollout duration (s)"));
    }
}
