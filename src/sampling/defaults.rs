//! Which sampling parameters a run uses when the user leaves some out: the flag, else the
//! checkpoint's generation_config.json, else llama.cpp's defaults. The seed is random unless
//! given; it is reported so that a run can be repeated.

use super::SamplingParams;
use crate::config::GenerationConfig;

/// llama.cpp's defaults (`common/common.h`, `common_params_sampling`).
pub const LLAMA_CPP: SamplingParams = SamplingParams {
    temperature: 0.8,
    top_k: 40,
    top_p: 0.95,
    min_p: 0.05,
    repeat_penalty: 1.0,
    seed: 0,
};

/// The sampling flags as given on the command line (`None`: not given).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Requested {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub seed: Option<u64>,
}

impl Requested {
    /// Whether any flag that shapes the distribution was given (the seed does not).
    fn any(&self) -> bool {
        self.temperature.is_some()
            || self.top_k.is_some()
            || self.top_p.is_some()
            || self.min_p.is_some()
            || self.repeat_penalty.is_some()
    }

    /// Every parameter from its flag, else from `gen`, else llama.cpp's default. A
    /// generation_config with `do_sample: false` means greedy unless a sampling flag is
    /// given (as in transformers); `top_k: 0` there means no top-k. Values the sampler would
    /// refuse are its to report, naming the flag.
    pub fn resolve(&self, gen: &GenerationConfig) -> SamplingParams {
        let d = LLAMA_CPP;
        let greedy = !self.any() && gen.do_sample == Some(false);
        let temperature = match greedy {
            true => 0.0,
            false => self
                .temperature
                .or(gen.temperature.map(|t| t as f32))
                .unwrap_or(d.temperature),
        };
        SamplingParams {
            temperature,
            top_k: self
                .top_k
                .or(gen.top_k.map(|k| k.max(0) as usize))
                .unwrap_or(d.top_k),
            top_p: self
                .top_p
                .or(gen.top_p.map(|p| p as f32))
                .unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repeat_penalty: self
                .repeat_penalty
                .or(gen.repetition_penalty.map(|r| r as f32))
                .unwrap_or(d.repeat_penalty),
            seed: self.seed.unwrap_or_else(rand::random),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_then_generation_config_then_llama_cpp() {
        let gen = GenerationConfig {
            do_sample: Some(true),
            temperature: Some(0.7),
            top_p: Some(0.8),
            top_k: Some(20),
            repetition_penalty: Some(1.05),
            ..Default::default()
        };
        let req = Requested {
            top_p: Some(0.5),
            seed: Some(3),
            ..Default::default()
        };
        let p = req.resolve(&gen);
        assert_eq!((p.temperature, p.top_k, p.top_p), (0.7, 20, 0.5));
        assert_eq!((p.min_p, p.repeat_penalty, p.seed), (0.05, 1.05, 3));
        // Nothing anywhere: llama.cpp's sampler, with a seed drawn at random.
        let p = Requested::default().resolve(&GenerationConfig::default());
        assert_eq!(
            (p.temperature, p.top_k, p.top_p, p.min_p),
            (0.8, 40, 0.95, 0.05)
        );
        let seeds: Vec<u64> = (0..4)
            .map(|_| {
                Requested::default()
                    .resolve(&GenerationConfig::default())
                    .seed
            })
            .collect();
        assert!(seeds.windows(2).any(|w| w[0] != w[1]), "{seeds:?}");
    }

    #[test]
    fn do_sample_false_is_greedy_until_a_flag_asks_otherwise() {
        let gen = GenerationConfig {
            do_sample: Some(false),
            ..Default::default()
        };
        assert_eq!(Requested::default().resolve(&gen).temperature, 0.0);
        let req = Requested {
            top_k: Some(5),
            ..Default::default()
        };
        assert_eq!(req.resolve(&gen).temperature, 0.8);
    }
}
