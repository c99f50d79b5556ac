//! Redis's own count of its work: CPU and commands, from `INFO`.

/// Redis's CPU µs (user + system) and commands so far.
pub(crate) async fn redis_work(connection: &mut redis::aio::MultiplexedConnection) -> (f64, f64) {
    let info: String = redis::cmd("INFO")
        .arg("all")
        .query_async(connection)
        .await
        .unwrap();
    let field = |name: &str| -> f64 {
        info.lines()
            .find_map(|l| l.strip_prefix(name))
            .map_or(0.0, |v| v.trim().parse().unwrap_or(0.0))
    };
    let cpu = (field("used_cpu_user:") + field("used_cpu_sys:")) * 1e6;
    let commands: f64 = info
        .lines()
        .filter(|l| l.starts_with("cmdstat_"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<f64>()
                .ok()
        })
        .sum();
    (cpu, commands)
}
