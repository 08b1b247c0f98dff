//! Byte counts as the schedule format writes them: `4096`, `4096B`, `4KiB`, `256MiB`, `1GiB`.

use std::fmt;

/// A number of bytes.
///
/// Parsing accepts an integer with an optional binary suffix (`B`, `KiB`,
/// `MiB`, `GiB`); printing uses the largest suffix that divides the value
/// exactly, so that a printed size parses back to the same number.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct Size(pub u64);

const UNITS: [(&str, u64); 4] = [
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("B", 1),
];

/// `text` as a decimal number written with digits alone (the format's
/// integers: no sign, no spaces), if it is one that fits `T`.
pub(crate) fn decimal<T: std::str::FromStr>(text: &str) -> Option<T> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// A setting's count (a deadline in milliseconds, a bound on states or
/// executions): a whole number of at least 1, written with digits alone,
/// space around it ignored (an environment variable's value may carry
/// some). `None` for anything else, `0`, `+5` and `5ms` included: one rule
/// for the command line and the environment.
pub fn positive_count(text: &str) -> Option<u64> {
    decimal::<u64>(text.trim()).filter(|n| *n > 0)
}

impl Size {
    /// Parses `text` as a size; the error says what was expected.
    pub fn parse(text: &str) -> Result<Size, String> {
        let digits = text.bytes().take_while(u8::is_ascii_digit).count();
        let (number, unit) = text.split_at(digits);
        if number.is_empty() {
            return Err(format!(
                "`{text}` is not a size: expected a number of bytes such as 4096, 64KiB or 256MiB"
            ));
        }
        let value: u64 = number
            .parse()
            .map_err(|_| format!("`{text}` is too large a size"))?;
        if unit.starts_with(['.', ',']) && unit[1..].starts_with(|c: char| c.is_ascii_digit()) {
            return Err(format!(
                "`{text}` is not a whole number of bytes: sizes take no fractions; write it in a smaller unit (1536KiB, not 1.5MiB)"
            ));
        }
        let scale = if unit.is_empty() {
            1
        } else {
            UNITS
                .iter()
                .find(|(name, _)| *name == unit)
                .map(|(_, scale)| *scale)
                .ok_or_else(|| {
                    format!("`{text}` has an unknown unit `{unit}`: use B, KiB, MiB or GiB")
                })?
        };
        value
            .checked_mul(scale)
            .map(Size)
            .ok_or_else(|| format!("`{text}` is too large a size"))
    }

    /// The number of bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            return write!(f, "0B");
        }
        let (name, scale) = UNITS
            .iter()
            .find(|(_, scale)| self.0.is_multiple_of(*scale))
            .copied()
            .unwrap_or(("B", 1));
        write!(f, "{}{}", self.0 / scale, name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_digits_alone_and_at_least_one() {
        assert_eq!(positive_count("1"), Some(1));
        assert_eq!(positive_count(" 5000\n"), Some(5000));
        assert_eq!(positive_count("18446744073709551615"), Some(u64::MAX));
        for bad in [
            "",
            "0",
            "+5",
            "-1",
            "5ms",
            "1e3",
            "1 000",
            "18446744073709551616",
            "٣",
        ] {
            assert_eq!(positive_count(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_fraction_is_refused_with_what_to_write_instead() {
        for text in ["1.5MiB", "0.5KiB", "2,5GiB", "1.0"] {
            let e = Size::parse(text).expect_err(text);
            assert!(e.contains("no fractions") && e.contains(text), "{e}");
        }
        assert!(Size::parse("1.MiB").is_err());
    }

    #[test]
    fn parses_every_unit() {
        assert_eq!(Size::parse("4096"), Ok(Size(4096)));
        assert_eq!(Size::parse("17B"), Ok(Size(17)));
        assert_eq!(Size::parse("4KiB"), Ok(Size(4096)));
        assert_eq!(Size::parse("256MiB"), Ok(Size(256 << 20)));
        assert_eq!(Size::parse("2GiB"), Ok(Size(2 << 30)));
    }

    #[test]
    fn rejects_garbage_with_a_reason() {
        assert!(Size::parse("MiB").unwrap_err().contains("not a size"));
        assert!(
            Size::parse("4MB")
                .unwrap_err()
                .contains("unknown unit `MB`")
        );
        assert!(Size::parse("-4").unwrap_err().contains("not a size"));
        assert!(
            Size::parse("99999999999999999999")
                .unwrap_err()
                .contains("too large")
        );
        assert!(
            Size::parse("17179869184GiB")
                .unwrap_err()
                .contains("too large")
        );
    }

    #[test]
    fn prints_the_largest_exact_unit_and_round_trips() {
        for (bytes, text) in [
            (0, "0B"),
            (1, "1B"),
            (1536, "1536B"),
            (4096, "4KiB"),
            (3 << 20, "3MiB"),
        ] {
            assert_eq!(Size(bytes).to_string(), text);
        }
        for bytes in [0, 1, 1023, 1024, 1536, 1 << 20, (1 << 30) + 1, u64::MAX] {
            assert_eq!(Size::parse(&Size(bytes).to_string()), Ok(Size(bytes)));
        }
    }
}
