//! A bench's settings, from the environment.

/// The number in the variable `name`, else `default` (an empty variable
/// counts as unset).
pub(crate) fn setting(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .map_or(default, |v| v.parse().expect(name))
}
