//! The knobs of the NCCL model (`docs/semantics.md`) and the placement policies.

use std::fmt;

use crate::Size;

/// How a `send`/`recv` that names no communicator and no stream is placed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// One communicator and one stream per unordered pair of ranks, used for
    /// both directions: what PyTorch does for unbatched `send`/`recv`.
    #[default]
    Shared,
    /// One lane (a communicator and a stream on each end) per ordered pair of
    /// ranks. duplex connects every lane at creation in an order that cannot
    /// hang, so lanes are never cold (rules R6 and R7 do not apply to them).
    PerDirection,
}

impl Policy {
    /// The name used in schedule files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Shared => "shared",
            Policy::PerDirection => "per-direction",
        }
    }

    /// Parses a policy name.
    pub fn parse(text: &str) -> Result<Policy, String> {
        match text {
            "shared" => Ok(Policy::Shared),
            "per-direction" => Ok(Policy::PerDirection),
            other => Err(format!(
                "unknown policy `{other}`: use `shared` or `per-direction`"
            )),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The model knobs of rules R2, R5, R6/R7, R8 and R10.
///
/// The defaults are NCCL's documented contract (the strict mode): no eager
/// capacity, channels connected before the program starts, communicator order
/// enforced, unbounded kernel concurrency.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct Model {
    /// R5: bytes a connected channel may hold sent but not yet received.
    pub eager: Size,
    /// R6 and R7: communicators start unconnected; the first op toward a peer
    /// performs a host handshake and the first message is a rendezvous.
    pub lazy_connect: bool,
    /// R2: ops of one communicator on one rank run one at a time, in issue order.
    pub comm_order: bool,
    /// R10: at most this many NCCL launches in progress at once on one rank.
    pub kernels: Option<u32>,
    /// R8: accept a matched pair where one side is in a group of two or
    /// more ops and the other is not (`one-sided-groups=accept`). NCCL's
    /// maintainers call it undefined, so the strict model (`error`, the
    /// default) reports it; NCCL 2.28 on the H200s completed every
    /// one-sided pattern measured, which a calibrated model may accept.
    pub one_sided_groups: bool,
    /// R6 under `lazy-connect=on`: which cold channels make their first
    /// message a rendezvous. `false` (`cold-channels=rendezvous`, the
    /// default): every cold channel until it has delivered a message, as
    /// R6 was written from hangs over NVLink. `true`
    /// (`cold-channels=mismatched`): only a channel with a side set up in
    /// a round of mismatched calls (R7), which NCCL connects from the wrong
    /// data; one set up by complementary calls buffers at once, as measured
    /// over loopback sockets (`docs/semantics.md`, R6).
    pub cold_mismatched_only: bool,
}

impl Default for Model {
    fn default() -> Self {
        Model {
            eager: Size(0),
            lazy_connect: false,
            comm_order: true,
            kernels: None,
            one_sided_groups: false,
            cold_mismatched_only: false,
        }
    }
}

impl Model {
    /// Applies one `KEY=VALUE` setting, as written after `model` in a schedule
    /// file or given to `--model` on the command line.
    pub fn set(&mut self, setting: &str) -> Result<(), String> {
        let Some((key, value)) = setting.split_once('=') else {
            return Err(format!(
                "`{setting}` is not a model setting: expected KEY=VALUE with KEY one of eager, lazy-connect, comm-order, kernels, one-sided-groups, cold-channels"
            ));
        };
        if setting.split_whitespace().count() > 1 {
            return Err(format!(
                "`{setting}` is several words: give one KEY=VALUE per setting (`--model eager=4KiB --model lazy-connect=on`)"
            ));
        }
        // A knob of two words, each with its value, in the order the error
        // message names them.
        let either = |words: [(&str, bool); 2]| {
            words
                .iter()
                .find(|(w, _)| *w == value)
                .map(|(_, b)| *b)
                .ok_or_else(|| {
                    format!(
                        "`{key}` takes `{}` or `{}`, not `{value}`",
                        words[0].0, words[1].0
                    )
                })
        };
        match key {
            "eager" => self.eager = Size::parse(value)?,
            "lazy-connect" => self.lazy_connect = either([("on", true), ("off", false)])?,
            "comm-order" => self.comm_order = either([("on", true), ("off", false)])?,
            "one-sided-groups" => {
                self.one_sided_groups = either([("error", false), ("accept", true)])?
            }
            "cold-channels" => {
                self.cold_mismatched_only = either([("rendezvous", false), ("mismatched", true)])?
            }
            "kernels" => {
                self.kernels = match value {
                    "unbounded" => None,
                    n => match crate::size::decimal::<u32>(n) {
                        Some(n) if n > 0 => Some(n),
                        _ => {
                            return Err(format!(
                                "`kernels` takes a whole number from 1 to {} or `unbounded`, not `{n}`",
                                u32::MAX
                            ));
                        }
                    },
                }
            }
            other => {
                return Err(format!(
                    "unknown model key `{other}`: use eager, lazy-connect, comm-order, kernels, one-sided-groups or cold-channels"
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Display for Model {
    /// Prints every knob as `KEY=VALUE` pairs, in the order of the format page.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on_off = |b: bool| if b { "on" } else { "off" };
        write!(
            f,
            "eager={} lazy-connect={} comm-order={} kernels=",
            self.eager,
            on_off(self.lazy_connect),
            on_off(self.comm_order)
        )?;
        match self.kernels {
            Some(n) => write!(f, "{n}")?,
            None => write!(f, "unbounded")?,
        }
        write!(
            f,
            " one-sided-groups={}",
            if self.one_sided_groups {
                "accept"
            } else {
                "error"
            }
        )?;
        // Said only when it is not the default: it matters only with
        // `lazy-connect=on` and `eager` above 0, and every report would
        // otherwise carry it.
        if self.cold_mismatched_only {
            write!(f, " cold-channels=mismatched")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_round_trip_through_display() {
        let mut m = Model::default();
        for s in [
            "eager=64MiB",
            "lazy-connect=on",
            "comm-order=off",
            "kernels=1",
            "cold-channels=mismatched",
        ] {
            m.set(s).unwrap();
        }
        let mut again = Model::default();
        for s in m.to_string().split(' ') {
            again.set(s).unwrap();
        }
        assert_eq!(m, again);
        assert_eq!(m.eager, Size(64 << 20));
        assert_eq!(m.kernels, Some(1));
        assert!(m.cold_mismatched_only);
        assert!(m.to_string().ends_with(" cold-channels=mismatched"), "{m}");
        assert!(!Model::default().to_string().contains("cold-channels"));
    }

    #[test]
    fn bad_settings_say_what_is_expected() {
        let mut m = Model::default();
        assert!(m.set("eager").unwrap_err().contains("KEY=VALUE"));
        assert!(
            m.set("kernels=0")
                .unwrap_err()
                .contains("from 1 to 4294967295")
        );
        let e = m.set("kernels=4294967296").unwrap_err();
        assert!(e.contains("from 1 to 4294967295"), "{e}");
        assert!(
            m.set("lazy-connect=yes")
                .unwrap_err()
                .contains("`on` or `off`")
        );
        assert!(
            m.set("speed=fast")
                .unwrap_err()
                .contains("unknown model key")
        );
    }
}
