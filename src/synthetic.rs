//! A deterministic, decoder-shaped synthetic engine: what the examples, tests and benchmarks drive ringscope with
//! when no model is at hand.
//!
//! It schedules requests with continuous batching — requests join while there is room, prefill their whole prompt
//! in one step, then decode one token per step until they leave — and produces, for every layer, a bf16 hidden
//! state per batch row that is a pure function of `(seed, layer, request id, token position)`. Anyone can
//! regenerate a row from its metadata ([`activation_row`]), which is how tests check exported rows bit for bit and
//! check that every row carries the right request id and position.

/// Shape and workload of the synthetic engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Decoder layers (one residual hookpoint each in the examples).
    pub layers: u32,
    /// Hidden size (elements per row).
    pub hidden: u32,
    /// Requests served in total.
    pub requests: u32,
    /// Most requests in one batch.
    pub max_concurrent: u32,
    /// New requests admitted per step at most (models arrivals).
    pub max_joins_per_step: u32,
    /// Prompt length range, inclusive.
    pub prompt_len: (u32, u32),
    /// Generated tokens per request, inclusive range.
    pub gen_len: (u32, u32),
    /// Seed of the schedule and of the activations.
    pub seed: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            layers: 8,
            hidden: 1024,
            requests: 64,
            max_concurrent: 16,
            max_joins_per_step: 2,
            prompt_len: (4, 48),
            gen_len: (8, 64),
            seed: 0x5EED,
        }
    }
}

/// One engine step: its number and `(request_id, token_position)` per batch row, in batch order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineStep {
    /// Step number, from 0.
    pub step: u64,
    /// Batch rows.
    pub rows: Vec<(u64, u32)>,
    /// Requests that prefilled in this step.
    pub prefills: u32,
}

#[derive(Debug, Clone, Copy)]
struct Active {
    id: u64,
    total: u32,
    done: u32,
}

/// The scheduler. Iterate it to get the steps.
#[derive(Debug, Clone)]
pub struct SyntheticEngine {
    cfg: EngineConfig,
    rng: u64,
    next_request: u64,
    step: u64,
    active: Vec<Active>,
}

/// splitmix64 finaliser: the one mixing function of the generator (mirrored by the Python reader tests).
pub const fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SyntheticEngine {
    /// A scheduler for `cfg`.
    pub fn new(cfg: EngineConfig) -> Self {
        SyntheticEngine { cfg, rng: mix64(cfg.seed), next_request: 0, step: 0, active: Vec::new() }
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    fn draw(&mut self, (lo, hi): (u32, u32)) -> u32 {
        self.rng = mix64(self.rng);
        lo + (self.rng % (hi.max(lo) - lo + 1) as u64) as u32
    }
}

impl Iterator for SyntheticEngine {
    type Item = EngineStep;

    fn next(&mut self) -> Option<EngineStep> {
        // Decode rows of running requests first, then the prompts of requests joining now (as vLLM orders them).
        let mut rows: Vec<(u64, u32)> = self.active.iter().map(|a| (a.id, a.done)).collect();
        for a in &mut self.active {
            a.done += 1;
        }
        let mut prefills = 0;
        while prefills < self.cfg.max_joins_per_step
            && (self.active.len() as u32) < self.cfg.max_concurrent
            && self.next_request < self.cfg.requests as u64
        {
            let id = self.next_request;
            self.next_request += 1;
            let prompt = self.draw(self.cfg.prompt_len).max(1);
            let gen = self.draw(self.cfg.gen_len);
            rows.extend((0..prompt).map(|p| (id, p)));
            self.active.push(Active { id, total: prompt + gen, done: prompt });
            prefills += 1;
        }
        self.active.retain(|a| a.done < a.total);
        if rows.is_empty() {
            return None;
        }
        let step = EngineStep { step: self.step, rows, prefills };
        self.step += 1;
        Some(step)
    }
}

/// The bf16 bit patterns of the hidden state of `(layer, request_id, position)` under `seed`, written to `out`
/// (one `u16` per element). Values are finite, with magnitudes in [2^-7, 2), like real residual activations.
pub fn activation_row(seed: u64, layer: u32, request_id: u64, position: u32, out: &mut [u16]) {
    let row_seed = mix64(mix64(mix64(seed ^ layer as u64) ^ request_id) ^ position as u64);
    for (i, o) in out.iter_mut().enumerate() {
        let mut x = row_seed.wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 29;
        let b = (x >> 48) as u16;
        *o = (b & 0x8000) | ((120 + ((b >> 7) & 7)) << 7) | (b & 0x7F);
    }
}

/// Fills `out` with layer `layer`'s hidden states for a whole batch (`rows.len() × hidden` bf16 values,
/// little-endian bytes), ready to hand to a capture.
pub fn fill_layer(seed: u64, layer: u32, hidden: u32, rows: &[(u64, u32)], out: &mut Vec<u8>) {
    let row_bytes = hidden as usize * 2;
    out.resize(rows.len() * row_bytes, 0);
    let mut row = vec![0u16; hidden as usize];
    for (&(req, pos), dst) in rows.iter().zip(out.chunks_exact_mut(row_bytes)) {
        activation_row(seed, layer, req, pos, &mut row);
        for (v, d) in row.iter().zip(dst.chunks_exact_mut(2)) {
            d.copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// `[[hookpoints]]` TOML for one bf16 residual hookpoint per layer, named `layers.{l}.resid` (id = layer), the
/// shape this engine produces. Append it to a session config.
pub fn residual_hookpoints_toml(layers: u32, hidden: u32) -> String {
    (0..layers)
        .map(|l| {
            format!(
                "[[hookpoints]]\nname = \"layers.{l}.resid\"\nsite = \"residual\"\nlayer = {l}\ndtype = \"bf16\"\nrow_width = {hidden}\n"
            )
        })
        .collect()
}

/// Every step with each layer's activations, generated up front so that a timed loop measures ringscope, not
/// the generator.
pub fn pregenerate(cfg: EngineConfig) -> Vec<(EngineStep, Vec<Vec<u8>>)> {
    SyntheticEngine::new(cfg)
        .map(|step| {
            let layers = (0..cfg.layers)
                .map(|l| {
                    let mut buf = Vec::new();
                    fill_layer(cfg.seed, l, cfg.hidden, &step.rows, &mut buf);
                    buf
                })
                .collect();
            (step, layers)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn schedule_is_continuous_batching_and_complete() {
        let cfg = EngineConfig { requests: 20, max_concurrent: 4, ..EngineConfig::default() };
        let steps: Vec<_> = SyntheticEngine::new(cfg).collect();
        assert_eq!(steps, SyntheticEngine::new(cfg).collect::<Vec<_>>(), "deterministic");
        let mut next_pos: HashMap<u64, u32> = HashMap::new();
        for s in &steps {
            let requests: std::collections::HashSet<_> = s.rows.iter().map(|r| r.0).collect();
            assert!(requests.len() <= 4);
            for &(req, pos) in &s.rows {
                let want = next_pos.entry(req).or_insert(0);
                assert_eq!(pos, *want, "request {req} positions must be consecutive across steps");
                *want += 1;
            }
        }
        assert_eq!(next_pos.len(), 20);
        assert!(steps.iter().any(|s| s.prefills > 0 && s.rows.len() > s.prefills as usize), "mixed steps");
    }

    #[test]
    fn activations_are_finite_and_distinct() {
        let (mut a, mut b) = (vec![0u16; 64], vec![0u16; 64]);
        activation_row(1, 0, 5, 3, &mut a);
        activation_row(1, 0, 5, 4, &mut b);
        assert_ne!(a, b);
        for v in a {
            let exp = (v >> 7) & 0xFF;
            assert!((120..=127).contains(&exp));
        }
    }
}
