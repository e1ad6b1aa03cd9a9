//! A layer's attention tensors by their checkpoint names: the original projections read
//! as augmented (rows, C + 1) matrices, the converted ones fitted and put back under the
//! names the converted model loads, and the backend that serves them in place of the
//! checkpoint's.

use super::calibrate::Calibration;
use super::gqa::{self, augment, Heads, Projections};
use super::heal::{Form, Healer};
use super::rotation::Expected;
use super::spec::MlaLayout;
use super::{deepseek, lowrank, mla, Plan, Stage};
use crate::config::{AttentionConfig, ModelConfig};
use crate::error::{Error, Result};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use std::collections::HashMap;

/// One layer's original attention projections, augmented, in f64.
fn projections(
    backend: &dyn SimpleBackend,
    cfg: &ModelConfig,
    layer: usize,
) -> Result<Projections> {
    let AttentionConfig::Gqa { qkv_bias, .. } = cfg.attention else {
        return Err(Error::Invalid("--attention: not a GQA-family model".into()));
    };
    let name = |p: &str, what: &str| format!("model.layers.{layer}.self_attn.{p}.{what}");
    let get = |p: &str, what: &str| backend.get_unchecked(&name(p, what), DType::F32, &Device::Cpu);
    let proj = |p: &str| -> Result<Tensor> {
        let bias = match qkv_bias {
            true => Some(get(p, "bias")?),
            false => None,
        };
        augment(&get(p, "weight")?, bias.as_ref())
    };
    Ok(Projections {
        q: proj("q_proj")?,
        k: proj("k_proj")?,
        v: proj("v_proj")?,
        o: get("o_proj", "weight")?.to_dtype(DType::F64)?,
    })
}

/// Every layer's converted attention tensors, by checkpoint name, f32; each layer healed as
/// it is converted, then all together, when `healer` is given (`progress` follows both).
pub fn fit(
    plan: &Plan,
    heads: Heads,
    cfg: &ModelConfig,
    backend: &dyn SimpleBackend,
    calibration: &Calibration,
    mut healer: Option<&mut Healer>,
    progress: &mut impl FnMut(Stage, usize, usize),
) -> Result<HashMap<String, Tensor>> {
    let moments = calibration.moments.as_ref();
    let windows = calibration.windows.as_deref().filter(|_| plan.turns());
    let mut replaced = HashMap::new();
    let mut forms = Vec::with_capacity(cfg.num_hidden_layers);
    for layer in 0..cfg.num_hidden_layers {
        let w = projections(backend, cfg, layer)?;
        let moment = moments.map(|m| &m.per_layer[layer]);
        let form = if let Some(l) = plan.latent.filter(|l| l.rope.is_some()) {
            // DeepSeek's layout fits one rank less: its anchor is the latent's last channel.
            let latent = Some(super::Latent {
                rank: l.fitted(),
                ..l
            });
            let turn = windows
                .map(|x| Expected::measure(&x[layer], &w, heads, plan.num_heads, &cfg.rope))
                .transpose()?;
            let out = mla::convert(&Plan { latent, ..*plan }, heads, &w, moment, turn.as_ref())?;
            Form::Mla {
                q: out.q,
                kv_a: out.kv_a,
                kv_b: out.kv_b,
                o: w.o.clone(),
            }
        } else if plan.latent.is_some() {
            let out = lowrank::convert(plan, heads, &w, moment)?;
            Form::LowRank {
                q: w.q.clone(),
                down: out.down,
                k_up: out.k_up,
                v_up: out.v_up,
                o: w.o.clone(),
            }
        } else {
            let out = gqa::convert(plan, heads, &w, moment)?;
            Form::Gqa {
                q: out.q,
                k: out.k,
                v: out.v,
                o: out.o,
            }
        };
        forms.push(match healer.as_deref_mut() {
            Some(h) => {
                let healed = h.layer(layer, &form, &w)?;
                progress(Stage::Healing, layer + 1, cfg.num_hidden_layers);
                healed
            }
            None => form,
        });
    }
    if let Some(h) = healer {
        forms = h.end_to_end(forms, |done, n| progress(Stage::Distilling, done, n))?;
    }
    for (layer, form) in forms.iter().enumerate() {
        put(&mut replaced, plan, cfg, backend, layer, form)?;
    }
    Ok(replaced)
}

/// An MLA layer's tensors by their names under `self_attn.`, in `layout`: every tensor the
/// converted attention loads except `o_proj`'s own (DeepSeek's layout adds a zero `o_proj`
/// bias where the original has none).
fn mla_tensors(
    out: &mla::Mla,
    layout: MlaLayout,
    cfg: &ModelConfig,
    backend: &dyn SimpleBackend,
    layer: usize,
) -> Result<Vec<(String, Tensor)>> {
    let AttentionConfig::Gqa {
        qkv_bias, o_bias, ..
    } = cfg.attention
    else {
        return Err(Error::Invalid("--attention: not a GQA-family model".into()));
    };
    let c = cfg.hidden_size;
    if layout == MlaLayout::Ours {
        let weight = |t: &Tensor| t.narrow(1, 0, c)?.to_dtype(DType::F32);
        return Ok(vec![
            ("q_proj.weight".into(), weight(&out.q)?),
            ("kv_a_proj_with_mqa.weight".into(), weight(&out.kv_a)?),
            ("kv_b_proj.weight".into(), out.kv_b.to_dtype(DType::F32)?),
        ]);
    }
    let norm = format!("model.layers.{layer}.input_layernorm.weight");
    let gamma = backend.get_unchecked(&norm, DType::F64, &Device::Cpu)?;
    let gamma_max = gamma.abs()?.max_all()?.to_scalar::<f64>()?;
    let mut tensors = deepseek::standard(out, c, gamma_max, qkv_bias)?;
    if !o_bias {
        tensors.push((
            "o_proj.bias".into(),
            Tensor::zeros(c, DType::F32, &Device::Cpu)?,
        ));
    }
    Ok(tensors)
}

/// `form`'s tensors under their checkpoint names: an augmented (rows, C + 1) projection as
/// its weight and, where the model has them, its bias; MLA in `plan`'s layout.
fn put(
    replaced: &mut HashMap<String, Tensor>,
    plan: &Plan,
    cfg: &ModelConfig,
    backend: &dyn SimpleBackend,
    layer: usize,
    form: &Form,
) -> Result<()> {
    let AttentionConfig::Gqa { qkv_bias, .. } = cfg.attention else {
        return Err(Error::Invalid("--attention: not a GQA-family model".into()));
    };
    let c = cfg.hidden_size;
    let name = |p: &str, what: &str| format!("model.layers.{layer}.self_attn.{p}.{what}");
    let mut augmented = |p: &str, t: &Tensor| -> Result<()> {
        replaced.insert(name(p, "weight"), t.narrow(1, 0, c)?.to_dtype(DType::F32)?);
        if qkv_bias {
            let bias = t.narrow(1, c, 1)?.squeeze(1)?.to_dtype(DType::F32)?;
            replaced.insert(name(p, "bias"), bias);
        }
        Ok(())
    };
    let plain = match form {
        Form::Gqa { q, k, v, o } => {
            augmented("q_proj", q)?;
            augmented("k_proj", k)?;
            augmented("v_proj", v)?;
            vec![("o_proj", o)]
        }
        Form::LowRank {
            q,
            down,
            k_up,
            v_up,
            o,
        } => {
            augmented("q_proj", q)?;
            augmented("kv_down", down)?;
            vec![("k_up", k_up), ("v_up", v_up), ("o_proj", o)]
        }
        Form::Mla { q, kv_a, kv_b, o } => {
            let out = mla::Mla {
                q: q.clone(),
                kv_a: kv_a.clone(),
                kv_b: kv_b.clone(),
            };
            let Some(latent) = plan.latent else {
                return Err(Error::Invalid("an MLA form without an MLA plan".into()));
            };
            for (p, t) in mla_tensors(&out, latent.layout, cfg, backend, layer)? {
                replaced.insert(format!("model.layers.{layer}.self_attn.{p}"), t);
            }
            vec![("o_proj", o)]
        }
    };
    for (p, t) in plain {
        replaced.insert(name(p, "weight"), t.to_dtype(DType::F32)?);
    }
    Ok(())
}

/// The checkpoint's tensors, with some replaced by the conversion's (f32, on the CPU).
pub struct Replaced {
    pub inner: Box<dyn SimpleBackend>,
    pub replaced: HashMap<String, Tensor>,
}

impl SimpleBackend for Replaced {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        match self.replaced.get(name) {
            Some(t) if t.shape() != &s => Err(candle_core::Error::Msg(format!(
                "converted {name}: shape {:?}, the model expects {s:?}",
                t.shape()
            ))),
            Some(t) => t.to_dtype(dtype)?.to_device(dev),
            None => self.inner.get(s, name, h, dtype, dev),
        }
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        match self.replaced.get(name) {
            Some(t) => t.to_dtype(dtype)?.to_device(dev),
            None => self.inner.get_unchecked(name, dtype, dev),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.replaced.contains_key(name) || self.inner.contains_tensor(name)
    }
}
