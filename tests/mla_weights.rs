//! An MLA layer holds each of its checkpoint's weights once: the heap it keeps after loading
//! is its tensors' bytes in the checkpoint, plus a little bookkeeping. The loader's parameter
//! count cannot show this (it counts what is read, not what is kept, so a copy made after
//! loading, such as kv_b_proj split into halves, escapes it); this binary counts every heap
//! allocation instead, and so holds this one test only.

mod common;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};
use tiny_decoder::config::HfConfig;
use tiny_decoder::model::attention::MlaAttention;

/// Bytes allocated and not yet freed, over the whole process.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct CountingAlloc;

unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Relaxed);
        System.alloc(l)
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Relaxed);
        System.alloc_zeroed(l)
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - l.size() as isize, Relaxed);
        System.realloc(p, l, new_size)
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Relaxed);
        System.dealloc(p, l)
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Tensor headers (shape, strides, Arcs) and the config copy: a few hundred bytes per tensor,
/// far less than the smallest duplicated matrix would add (kv_b_proj: 16 KiB here).
const BOOKKEEPING: usize = 4096;

#[test]
fn mla_layer_holds_each_weight_once() {
    for name in ["deepseek-v2", "deepseek-v3"] {
        let dir = common::fixture_dir(name);
        let cfg = HfConfig::from_file(&dir.join("config.json"))
            .unwrap()
            .validate()
            .unwrap();
        let path = dir.join("model.safetensors");
        let prefix = "model.layers.0.self_attn";
        let checkpoint: usize = unsafe { MmapedSafetensors::new(&path) }
            .unwrap()
            .tensors()
            .iter()
            .filter(|(n, _)| n.starts_with(&format!("{prefix}.")))
            .map(|(_, t)| t.shape().iter().product::<usize>() * DType::F32.size_in_bytes())
            .sum();
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu) }
            .unwrap();
        let before = LIVE.load(Relaxed);
        let layer = MlaAttention::new(&cfg, vb.pp(prefix)).unwrap();
        let held = (LIVE.load(Relaxed) - before) as usize;
        drop(layer);
        println!("{name}: layer holds {held} bytes, checkpoint has {checkpoint}");
        assert!(
            held >= checkpoint && held < checkpoint + BOOKKEEPING,
            "{name}: the layer holds {held} bytes for {checkpoint} bytes of weights"
        );
    }
}
