//! Draws `docs/algorithms.svg`: one bursty client replayed against each
//! algorithm at the same limit, 10 requests per 10 s, on a `MemoryStore`
//! with a manual clock, so the picture is the same on every run.
//!
//! ```text
//! scripts/picture            # or: cargo run --example algorithms_picture -- docs/algorithms.svg
//! ```
//!
//! Every row shows each attempt (admitted or denied) and, as a line, how
//! many requests were admitted in the 10 s before each instant, beside the
//! limit (10): where an algorithm lets more through in some 10 s, and how
//! it spreads what it admits.

use std::time::Duration;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use tower_redis_ratelimit::clock::ManualClock;
use tower_redis_ratelimit::{Algorithm, MemoryStore, Policy, Store, StoreError};

/// The limit every algorithm enforces.
const LIMIT: &str = "10/10s";
const MAX: u32 = 10;
const WINDOW_MS: u64 = 10_000;
/// How long the replay lasts.
const END_MS: u64 = 60_000;
/// Where the replay starts: a whole number of windows since the epoch, so
/// the fixed windows start at 0 s, 10 s, 20 s, ... of the picture.
const START: Duration = Duration::from_secs(1_700_000_000);

/// The client: when it sends each request, in ms since the start.
fn attempts() -> Vec<u64> {
    let mut at = Vec::new();
    // A burst at the end of the first window and one at the start of the
    // next: 12 requests in [9.0 s, 10.0 s) and 12 in [10.0 s, 11.0 s).
    at.extend((0..24).map(|i| 9_000 + i * 1_000 / 12));
    // Idle, then a steady trickle at twice the rate: one request every
    // 500 ms for 24 s.
    at.extend((0..48).map(|i| 22_000 + i * 500));
    // Idle, then a second burst: 15 requests in one second.
    at.extend((0..15).map(|i| 50_000 + i * 1_000 / 15));
    at
}

/// One attempt of the replay.
struct Attempt {
    at_ms: u64,
    admitted: bool,
}

/// Replay [`attempts`] against `policy` on a fresh store.
async fn replay(policy: &Policy) -> Result<Vec<Attempt>, StoreError> {
    let clock = ManualClock::new(START);
    let store = MemoryStore::with_clock(clock.clone());
    let mut out = Vec::new();
    for at_ms in attempts() {
        clock.set(START + Duration::from_millis(at_ms));
        let decision = store.check("client", policy).await?;
        out.push(Attempt {
            at_ms,
            admitted: decision.allowed(),
        });
    }
    Ok(out)
}

/// How many of `admitted` (ms, ascending) lie in the rolling window
/// `(t − 10 s, t]`, as a step line: the count changes only where a request
/// is admitted or leaves the window 10 s later.
fn rolling_count(admitted: &[u64]) -> Vec<(f64, f64)> {
    let mut changes: Vec<(u64, i32)> = admitted
        .iter()
        .flat_map(|&t| [(t, 1), (t + WINDOW_MS, -1)])
        .collect();
    changes.retain(|&(t, _)| t < END_MS);
    changes.sort_by_key(|&(t, delta)| (t, delta));
    let mut points = vec![(0.0, 0.0)];
    let mut count = 0;
    let mut i = 0;
    while i < changes.len() {
        let t = changes[i].0;
        let before = count;
        while i < changes.len() && changes[i].0 == t {
            count += changes[i].1;
            i += 1;
        }
        let x = t as f64 / 1_000.0;
        points.push((x, f64::from(before)));
        points.push((x, f64::from(count)));
    }
    points.push((END_MS as f64 / 1_000.0, f64::from(count)));
    points
}

/// The most requests admitted in any rolling window of 10 s.
fn worst_window(admitted: &[u64]) -> usize {
    admitted
        .iter()
        .map(|&start| {
            admitted
                .iter()
                .filter(|&&t| t >= start && t < start + WINDOW_MS)
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// The rows: each algorithm and its name.
const ROWS: [(Algorithm, &str); 4] = [
    (Algorithm::FixedWindow, "Fixed window"),
    (Algorithm::SlidingWindow, "Sliding window counter"),
    (Algorithm::SlidingLog, "Sliding log (the default)"),
    (Algorithm::Gcra, "GCRA (token bucket)"),
];

/// Where the strips of attempts sit below the count (y, in the count's units).
const ADMITTED_BAND: (f64, f64) = (-2.4, -0.8);
const DENIED_BAND: (f64, f64) = (-4.4, -2.8);
const Y_TOP: f64 = 25.0;

const BLUE: RGBColor = RGBColor(31, 97, 172);
const GREEN: RGBColor = RGBColor(46, 140, 60);
const RED: RGBColor = RGBColor(200, 50, 40);
const GREY: RGBColor = RGBColor(120, 120, 120);
const ORANGE: RGBColor = RGBColor(230, 140, 20);

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "docs/algorithms.svg".to_owned());

    let root = SVGBackend::new(&path, (1000, 1180)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        "One bursty client against each algorithm, same limit: 10 requests per 10 s",
        ("sans-serif", 24),
    )?;
    let (legend, rows) = root.split_vertically(50);
    for (i, line) in [
        "blue: requests admitted in the 10 s before each instant; orange: the limit, 10",
        "ticks: each attempt, admitted (green) or denied (red); grey: the windows that \
         the fixed window and the counter count in",
    ]
    .into_iter()
    .enumerate()
    {
        legend.draw(&Text::new(
            line,
            (60, 4 + 20 * i as i32),
            ("sans-serif", 15).into_font().color(&GREY),
        ))?;
    }

    let attempts_total = attempts().len();
    for (row, ((algorithm, name), area)) in ROWS
        .into_iter()
        .zip(rows.split_evenly((ROWS.len(), 1)))
        .enumerate()
    {
        let policy = LIMIT.parse::<Policy>()?.with_algorithm(algorithm)?;
        let run = replay(&policy).await?;
        let admitted: Vec<u64> = run.iter().filter(|a| a.admitted).map(|a| a.at_ms).collect();
        let caption = format!(
            "{}: {} of {} admitted, at most {} in any 10 s",
            name,
            admitted.len(),
            attempts_total,
            worst_window(&admitted),
        );

        let mut chart = ChartBuilder::on(&area)
            .caption(caption, ("sans-serif", 19))
            .margin(8)
            .x_label_area_size(36)
            .y_label_area_size(52)
            .build_cartesian_2d(0.0..END_MS as f64 / 1_000.0, DENIED_BAND.0 - 0.4..Y_TOP)?;
        chart
            .configure_mesh()
            .x_labels(13)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .x_desc("time (s)")
            .y_labels(6)
            .y_label_formatter(&|y| {
                if *y >= 0.0 {
                    format!("{y:.0}")
                } else {
                    String::new()
                }
            })
            .y_desc("admitted in last 10 s")
            .light_line_style(WHITE)
            .bold_line_style(RGBColor(232, 232, 232))
            .axis_desc_style(("sans-serif", 14))
            .draw()?;

        // The window edges the fixed window and the counter count in.
        if matches!(algorithm, Algorithm::FixedWindow | Algorithm::SlidingWindow) {
            for edge in (WINDOW_MS..END_MS).step_by(WINDOW_MS as usize) {
                let x = edge as f64 / 1_000.0;
                chart.draw_series(LineSeries::new(
                    [(x, 0.0), (x, Y_TOP)],
                    GREY.mix(0.45).stroke_width(1),
                ))?;
            }
        }

        // The limit.
        let end = END_MS as f64 / 1_000.0;
        chart.draw_series(LineSeries::new(
            [(0.0, f64::from(MAX)), (end, f64::from(MAX))],
            ORANGE.stroke_width(2),
        ))?;

        // Admitted in the last 10 s.
        chart.draw_series(LineSeries::new(
            rolling_count(&admitted),
            BLUE.stroke_width(2),
        ))?;

        // Each attempt, as a tick in its strip.
        chart.draw_series(run.iter().map(|a| {
            let x = a.at_ms as f64 / 1_000.0;
            let (band, color) = if a.admitted {
                (ADMITTED_BAND, GREEN)
            } else {
                (DENIED_BAND, RED)
            };
            PathElement::new([(x, band.0), (x, band.1)], color.stroke_width(1))
        }))?;
        for (band, label, color) in [
            (ADMITTED_BAND, "admitted", GREEN),
            (DENIED_BAND, "denied", RED),
        ] {
            chart.draw_series(std::iter::once(Text::new(
                label,
                (end - 4.5, band.1 + 0.3),
                ("sans-serif", 12).into_font().color(&color),
            )))?;
        }

        // What the client does, over the first row.
        if row == 0 {
            let centred = ("sans-serif", 13)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Center, VPos::Center));
            for (x, text) in [
                (10.0, "burst at a window edge"),
                (17.5, "idle"),
                (34.0, "steady trickle, twice the rate"),
                (50.5, "second burst"),
            ] {
                chart.draw_series(std::iter::once(Text::new(
                    text,
                    (x, Y_TOP - 1.8),
                    centred.clone(),
                )))?;
            }
        }
    }
    root.present()?;
    println!("wrote {path}");
    Ok(())
}
