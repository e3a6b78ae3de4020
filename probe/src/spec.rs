//! What a probe is: its target, weights, aggregation, thresholds and action.

use std::fmt;
use std::str::FromStr;

use crate::load::Weights;
use crate::ProbeError;

/// At most this many outputs (rows of the weight matrix) per probe.
pub const MAX_OUTPUTS: usize = 64;

/// The longest window of [`Aggregation::Window`].
pub const MAX_WINDOW: u32 = 1 << 16;

/// Which hookpoint a probe reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The hookpoint of this name.
    HookPoint(String),
    /// The hookpoint of this layer and site (`residual`, `attn_out`, ...).
    Layer {
        /// The layer.
        layer: u32,
        /// The site's name.
        site: String,
    },
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::HookPoint(name) => write!(f, "hookpoint `{name}`"),
            Target::Layer { layer, site } => write!(f, "layer {layer}, site `{site}`"),
        }
    }
}

/// How a request's per-token scores become the score its threshold is compared with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Aggregation {
    /// Each token on its own: the request alerts when any token's score reaches the threshold.
    PerToken,
    /// The mean of the request's token scores so far.
    Mean,
    /// The highest token score so far.
    Max,
    /// Exponential moving average: `ema = alpha · s + (1 − alpha) · ema`, starting at the first token's score.
    Ema {
        /// Weight of the newest token, in (0, 1].
        alpha: f32,
    },
    /// The highest mean over `window` consecutive scored tokens so far (fewer while the request is shorter).
    Window {
        /// Tokens per window, 1 to 65536.
        window: u32,
    },
}

impl Aggregation {
    /// The names the configuration uses: `per_token`, `mean`, `max`, `ema`, `window`.
    pub const NAMES: [&'static str; 5] = ["per_token", "mean", "max", "ema", "window"];

    /// The aggregation of this name, with its parameter (`ema_alpha` for `ema`, `window` for `window`).
    pub fn from_name(name: &str, ema_alpha: Option<f32>, window: Option<u32>) -> Result<Aggregation, String> {
        let agg = match name {
            "per_token" => Aggregation::PerToken,
            "mean" => Aggregation::Mean,
            "max" => Aggregation::Max,
            "ema" => Aggregation::Ema {
                alpha: ema_alpha.ok_or("aggregate = \"ema\" needs ema_alpha (the newest token's weight, in (0, 1])")?,
            },
            "window" => Aggregation::Window {
                window: window.ok_or("aggregate = \"window\" needs window (tokens per window, 1 to 65536)")?,
            },
            other => {
                return Err(format!(
                    "unknown aggregate `{other}`: use one of {}",
                    Aggregation::NAMES.map(|n| format!("\"{n}\"")).join(", ")
                ))
            }
        };
        agg.validate()?;
        Ok(agg)
    }

    /// The configuration's name of this aggregation.
    pub fn name(&self) -> &'static str {
        match self {
            Aggregation::PerToken => "per_token",
            Aggregation::Mean => "mean",
            Aggregation::Max => "max",
            Aggregation::Ema { .. } => "ema",
            Aggregation::Window { .. } => "window",
        }
    }

    fn validate(&self) -> Result<(), String> {
        match *self {
            Aggregation::Ema { alpha } if !(alpha > 0.0 && alpha <= 1.0) => {
                Err(format!("ema_alpha {alpha} is outside (0, 1]"))
            }
            Aggregation::Window { window } if window == 0 || window > MAX_WINDOW => {
                Err(format!("window {window} is outside 1 to {MAX_WINDOW} tokens"))
            }
            _ => Ok(()),
        }
    }
}

/// What a probe does when a request's aggregated score reaches a threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Record an alert (alerts channel, C poll, Python iterator).
    Alert,
    /// Record an alert and raise the request's stop flag ([`crate::Flags`]), which the engine reads to end it.
    Stop,
}

impl FromStr for Action {
    type Err = String;
    fn from_str(s: &str) -> Result<Action, String> {
        match s {
            "alert" => Ok(Action::Alert),
            "stop" => Ok(Action::Stop),
            other => Err(format!("unknown action `{other}`: use \"alert\" or \"stop\"")),
        }
    }
}

impl Action {
    /// The configuration's name.
    pub fn name(self) -> &'static str {
        match self {
            Action::Alert => "alert",
            Action::Stop => "stop",
        }
    }
}

/// A probe as defined, before its target is resolved against a session's hookpoints.
#[derive(Debug, Clone)]
pub struct ProbeDef {
    /// The probe's name (unique in a session).
    pub name: String,
    /// The hookpoint it reads.
    pub target: Target,
    /// `K × d` weights.
    pub weights: Weights,
    /// `K` biases (zeros when the definition gives none).
    pub bias: Vec<f32>,
    /// Per-request aggregation.
    pub aggregation: Aggregation,
    /// Thresholds: one for every output, or one per output.
    pub thresholds: Vec<f32>,
    /// What reaching a threshold does.
    pub action: Action,
    /// Optional names of the `K` outputs (for alerts and tables).
    pub labels: Vec<String>,
    /// No alert before a request has this many scored tokens (≥ 1): a mean over its first token or two is mostly
    /// noise.
    pub min_tokens: u32,
}

/// A checked probe: weights, bias, thresholds and labels agree in `K`, every number is finite, and `d` is the
/// width of the rows it will read.
#[derive(Debug, Clone)]
pub struct Probe {
    name: String,
    target: Target,
    weights: Weights,
    bias: Vec<f32>,
    aggregation: Aggregation,
    thresholds: Vec<f32>,
    action: Action,
    labels: Vec<String>,
    min_tokens: u32,
}

impl Probe {
    /// Checks `def` for rows of `row_width` elements.
    pub fn new(def: ProbeDef, row_width: u32) -> Result<Probe, ProbeError> {
        let ProbeDef { name, target, weights, mut bias, aggregation, mut thresholds, action, labels, min_tokens } = def;
        let bad = |m: String| ProbeError::invalid(&name, m);
        if name.is_empty() {
            return Err(ProbeError::invalid("", "a probe needs a name"));
        }
        let (k, d) = (weights.outputs(), weights.width());
        if k == 0 || k > MAX_OUTPUTS {
            return Err(bad(format!("{k} outputs (weight rows); use 1 to {MAX_OUTPUTS}")));
        }
        if d != row_width as usize {
            return Err(bad(format!(
                "weights are {k} × {d} but {target} has rows of {row_width} elements: the weights' second dimension \
                 must equal the hookpoint's row_width"
            )));
        }
        if let Some(i) = weights.values().iter().position(|w| !w.is_finite()) {
            return Err(bad(format!(
                "weight [{}, {}] is {} (weights must be finite)",
                i / d,
                i % d,
                weights.values()[i]
            )));
        }
        if bias.is_empty() {
            bias = vec![0.0; k];
        }
        if bias.len() != k {
            return Err(bad(format!("{} biases for {k} outputs (give one per weight row)", bias.len())));
        }
        if let Some(i) = bias.iter().position(|b| !b.is_finite()) {
            return Err(bad(format!("bias [{i}] is {} (biases must be finite)", bias[i])));
        }
        if thresholds.is_empty() {
            return Err(bad(
                "no threshold: give threshold (one for every output) or thresholds (one per output)".into()
            ));
        }
        if thresholds.len() == 1 && k > 1 {
            thresholds = vec![thresholds[0]; k];
        }
        if thresholds.len() != k {
            return Err(bad(format!("{} thresholds for {k} outputs (give one, or one per output)", thresholds.len())));
        }
        if let Some(i) = thresholds.iter().position(|t| t.is_nan()) {
            return Err(bad(format!("threshold [{i}] is NaN")));
        }
        if !labels.is_empty() && labels.len() != k {
            return Err(bad(format!("{} labels for {k} outputs (give one per output, or none)", labels.len())));
        }
        aggregation.validate().map_err(bad)?;
        if min_tokens == 0 {
            return Err(bad("min_tokens must be at least 1".into()));
        }
        Ok(Probe { name, target, weights, bias, aggregation, thresholds, action, labels, min_tokens })
    }

    /// The probe's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The hookpoint it reads.
    pub fn target(&self) -> &Target {
        &self.target
    }
    /// `K`, the number of outputs.
    pub fn outputs(&self) -> usize {
        self.weights.outputs()
    }
    /// `d`, the width of the rows it reads.
    pub fn width(&self) -> usize {
        self.weights.width()
    }
    /// The weights, `K × d` row-major.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }
    /// The `K` biases.
    pub fn bias(&self) -> &[f32] {
        &self.bias
    }
    /// The aggregation.
    pub fn aggregation(&self) -> Aggregation {
        self.aggregation
    }
    /// The `K` thresholds.
    pub fn thresholds(&self) -> &[f32] {
        &self.thresholds
    }
    /// The action.
    pub fn action(&self) -> Action {
        self.action
    }
    /// Scored tokens a request needs before it may alert.
    pub fn min_tokens(&self) -> u32 {
        self.min_tokens
    }
    /// Output `k`'s label (its index when none was given).
    pub fn label(&self, k: usize) -> String {
        self.labels.get(k).cloned().unwrap_or_else(|| k.to_string())
    }
}
