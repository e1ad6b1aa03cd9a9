//! Where a model's tensors come from, for candle's `VarBuilder`: the memory-mapped
//! checkpoint (each tensor's pages dropped once copied), bytes compiled into the binary, or
//! random weights for `bench --config`; all counted as they are taken.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::linear::Quantizer;
use crate::model::Transformer;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Builds the model from `backend` at `dtype`; returns it with the number of parameters it
/// took.
pub(super) fn build(
    cfg: &ModelConfig,
    backend: Box<dyn SimpleBackend>,
    dtype: DType,
    quant: Option<&dyn Quantizer>,
    device: &Device,
) -> Result<(Transformer, usize)> {
    let params = Arc::new(AtomicUsize::new(0));
    let counting = Counting {
        inner: backend,
        params: params.clone(),
    };
    let vb = VarBuilder::from_backend(Box::new(counting), dtype, device.clone());
    let model = Transformer::new_quantized(cfg, vb, quant)?;
    // An embedding kept in the file's blocks is not read through the VarBuilder.
    let params = params.load(Ordering::Relaxed) + model.embedding_elements_in_blocks();
    Ok((model, params))
}

/// Counts the elements of every tensor the model takes, so the parameter count is what was
/// actually loaded (a tied LM head counts once).
struct Counting {
    inner: Box<dyn SimpleBackend>,
    params: Arc<AtomicUsize>,
}

impl SimpleBackend for Counting {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.inner.get(s, name, h, dtype, dev)?;
        self.params.fetch_add(t.elem_count(), Ordering::Relaxed);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.inner.get_unchecked(name, dtype, dev)?;
        self.params.fetch_add(t.elem_count(), Ordering::Relaxed);
        Ok(t)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// The memory-mapped checkpoint, with each tensor's pages dropped from this process once
/// candle has copied it out. candle's CPU tensors own their memory, so every weight is copied
/// from the map; without this the resident peak is the weights twice (the copies plus the
/// mapped file: 1,085 MB for SmolLM-135M's 538 MB in f32), with it about once.
pub(super) struct Unmapping(pub(super) MmapedSafetensors);

impl Unmapping {
    fn release(&self, name: &str) {
        #[cfg(unix)]
        if let Ok(view) = self.0.get(name) {
            let data = view.data();
            // SAFETY: sysconf has no preconditions.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
            let start = (data.as_ptr() as usize).next_multiple_of(page);
            let end = (data.as_ptr() as usize + data.len()) / page * page;
            if end > start {
                // SAFETY: the whole pages in [start, end) belong to memmap2's read-only
                // shared map of the file, which outlives this call. MADV_DONTNEED only drops
                // them from this process's page tables: a later read faults the same bytes
                // back in from the page cache (the file is not written while mapped, as
                // `MmapedSafetensors::new` requires), so nothing observable changes.
                unsafe {
                    libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED)
                };
            }
        }
    }
}

impl SimpleBackend for Unmapping {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = SimpleBackend::get(&self.0, s, name, h, dtype, dev)?;
        self.release(name);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.0.get_unchecked(name, dtype, dev)?;
        self.release(name);
        Ok(t)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_tensor(name)
    }
}

pub(super) struct RandomWeights;

impl SimpleBackend for RandomWeights {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if name.ends_with("norm.weight") {
            return Tensor::ones(s, dtype, dev);
        }
        Tensor::randn(0f32, 0.02, s, dev)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("random weights need a shape for {name}")
    }

    /// Only the fused-expert layout and optional tensors are asked about: say no.
    fn contains_tensor(&self, _: &str) -> bool {
        false
    }
}
