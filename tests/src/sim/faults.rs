//! Injected faults: what a sick server does, for the balancer's tests to see.
//!
//! Set at start with `--fault KIND[:KEY=VALUE,...]` (repeatable) or at run time with
//! `POST /admin/fault` on the metrics port and a JSON body `{"kind": KIND, KEY: VALUE, ...}`.
//! One request fault and one metrics fault can be active together; setting another of the
//! same group replaces it, and `none` clears both.
//!
//! | kind | group | what a client sees |
//! | --- | --- | --- |
//! | `hang_before_first_token` | request | requests are accepted (and counted running) but get no token |
//! | `stall_mid_stream` (`after_tokens`, default 1) | request | streams stop after that many tokens |
//! | `status_500`, `status_503` | request | every API request answers that status |
//! | `close_mid_stream` (`after_tokens`, default 1) | request | the connection closes after that many tokens, without `[DONE]` |
//! | `slow_metrics` (`delay_ms`, default 5000) | metrics | `/metrics` answers after the delay |
//! | `garbage_metrics` | metrics | `/metrics` answers 200 with text that is not Prometheus |
//! | `metrics_nan` | metrics | `/metrics` answers the exposition with the running gauge at `NaN` |
//! | `metrics_negative` | metrics | `/metrics` answers the exposition with the waiting gauge at `-1` |
//! | `metrics_huge` (`bytes`, default 10000000) | metrics | `/metrics` answers the exposition padded with comment lines to that many bytes |
//! | `exit` (`after_ms` default 0, `code` default 1) | - | the process exits |
//! | `none` | - | clears the faults |
//!
//! Frozen sequences (hang, stall) resume when the fault is cleared.

use serde::{Deserialize, Serialize};

use super::engine::Freeze;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Fault {
    HangBeforeFirstToken,
    StallMidStream {
        #[serde(default = "one")]
        after_tokens: u32,
    },
    #[serde(rename = "status_500")]
    Status500,
    #[serde(rename = "status_503")]
    Status503,
    CloseMidStream {
        #[serde(default = "one")]
        after_tokens: u32,
    },
    SlowMetrics {
        #[serde(default = "five_seconds")]
        delay_ms: u64,
    },
    GarbageMetrics,
    MetricsNan,
    MetricsNegative,
    MetricsHuge {
        #[serde(default = "ten_megabytes")]
        bytes: u64,
    },
    Exit {
        #[serde(default)]
        after_ms: u64,
        #[serde(default = "exit_code")]
        code: i32,
    },
    None,
}

fn one() -> u32 {
    1
}

fn five_seconds() -> u64 {
    5000
}

fn ten_megabytes() -> u64 {
    10_000_000
}

fn exit_code() -> i32 {
    1
}

impl Fault {
    /// Parses the command-line form `KIND[:KEY=VALUE,...]`, e.g. `stall_mid_stream:after_tokens=5`.
    pub fn parse_cli(spec: &str) -> Result<Self, String> {
        let (kind, params) = spec.split_once(':').unwrap_or((spec, ""));
        let mut object = serde_json::Map::new();
        object.insert("kind".into(), kind.into());
        for param in params.split(',').filter(|p| !p.is_empty()) {
            let (key, value) = param
                .split_once('=')
                .ok_or_else(|| format!("fault parameter {param:?} is not KEY=VALUE"))?;
            let value: i64 = value
                .parse()
                .map_err(|_| format!("fault parameter {key}: {value:?} is not an integer"))?;
            object.insert(key.into(), value.into());
        }
        serde_json::from_value(object.into()).map_err(|e| format!("fault {spec:?}: {e}"))
    }
}

/// The faults in force.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Faults {
    pub request: Option<Fault>,
    pub metrics: Option<Fault>,
}

impl Faults {
    /// Records `fault`; `exit` is an action, not a state, and is left to the caller.
    pub fn apply(&mut self, fault: Fault) {
        match fault {
            Fault::HangBeforeFirstToken
            | Fault::StallMidStream { .. }
            | Fault::Status500
            | Fault::Status503
            | Fault::CloseMidStream { .. } => self.request = Some(fault),
            Fault::SlowMetrics { .. }
            | Fault::GarbageMetrics
            | Fault::MetricsNan
            | Fault::MetricsNegative
            | Fault::MetricsHuge { .. } => self.metrics = Some(fault),
            Fault::None => *self = Self::default(),
            Fault::Exit { .. } => {}
        }
    }

    /// What the engine must hold back.
    pub fn freeze(&self) -> Option<Freeze> {
        match self.request {
            Some(Fault::HangBeforeFirstToken) => Some(Freeze::BeforeFirstToken),
            Some(Fault::StallMidStream { after_tokens }) => Some(Freeze::AfterTokens(after_tokens)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_and_json_forms_agree() {
        assert_eq!(
            Fault::parse_cli("stall_mid_stream:after_tokens=5").unwrap(),
            Fault::StallMidStream { after_tokens: 5 }
        );
        assert_eq!(
            Fault::parse_cli("close_mid_stream").unwrap(),
            Fault::CloseMidStream { after_tokens: 1 }
        );
        assert_eq!(Fault::parse_cli("status_503").unwrap(), Fault::Status503);
        assert_eq!(
            Fault::parse_cli("exit:after_ms=200,code=3").unwrap(),
            Fault::Exit {
                after_ms: 200,
                code: 3
            }
        );
        let json: Fault =
            serde_json::from_str(r#"{"kind":"slow_metrics","delay_ms":250}"#).unwrap();
        assert_eq!(json, Fault::SlowMetrics { delay_ms: 250 });
        assert_eq!(Fault::parse_cli("metrics_nan").unwrap(), Fault::MetricsNan);
        assert_eq!(
            Fault::parse_cli("metrics_huge").unwrap(),
            Fault::MetricsHuge { bytes: 10_000_000 }
        );
        let json: Fault = serde_json::from_str(r#"{"kind":"metrics_huge","bytes":5000}"#).unwrap();
        assert_eq!(json, Fault::MetricsHuge { bytes: 5000 });
        for bad in [
            "explode",
            "stall_mid_stream:after=1",
            "slow_metrics:delay_ms=soon",
            "exit:x",
        ] {
            assert!(Fault::parse_cli(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn groups_replace_and_none_clears() {
        let mut faults = Faults::default();
        faults.apply(Fault::HangBeforeFirstToken);
        faults.apply(Fault::GarbageMetrics);
        assert_eq!(faults.freeze(), Some(Freeze::BeforeFirstToken));
        faults.apply(Fault::Status500);
        assert_eq!(faults.freeze(), None);
        assert_eq!(faults.request, Some(Fault::Status500));
        assert_eq!(faults.metrics, Some(Fault::GarbageMetrics));
        faults.apply(Fault::MetricsNegative);
        assert_eq!(faults.metrics, Some(Fault::MetricsNegative));
        assert_eq!(faults.request, Some(Fault::Status500));
        faults.apply(Fault::None);
        assert_eq!(faults, Faults::default());
    }
}
