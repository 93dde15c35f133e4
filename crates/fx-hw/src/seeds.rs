//! Seeds of the tests on fresh random inputs: a new one every run, from the clock, so the
//! suite keeps meeting inputs it has not seen; or the one `FX_TEST_SEED` names, to replay a
//! failure. Every test prints the seed it used, so a failure's log names its replay.

/// The seed for `test` (its name, printed with the seed): `FX_TEST_SEED` when it holds a
/// number, else the clock's nanoseconds.
pub fn test_seed(test: &str) -> u64 {
    let seed = seed_from(std::env::var("FX_TEST_SEED").ok().as_deref()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    eprintln!("{test}: seed {seed} (FX_TEST_SEED={seed} replays it)");
    seed
}

/// `FX_TEST_SEED`'s value as a seed (`None`: unset or not a number).
fn seed_from(v: Option<&str>) -> Option<u64> {
    v.and_then(|v| v.trim().parse::<u64>().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_seed_replays_and_anything_else_is_fresh() {
        assert_eq!(seed_from(Some("1796648697840139971")), Some(1_796_648_697_840_139_971));
        assert_eq!(seed_from(Some(" 7\n")), Some(7));
        assert_eq!(seed_from(Some("soon")), None);
        assert_eq!(seed_from(None), None);
        if std::env::var_os("FX_TEST_SEED").is_none() {
            assert_ne!(test_seed("seeds::a"), 0);
        }
    }
}
