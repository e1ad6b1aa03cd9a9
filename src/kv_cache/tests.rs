//! The pages of a layer, written and read back in place and through a block table.

use super::*;
use candle_core::Tensor;

fn tensor(x: f32, t: usize) -> Tensor {
    Tensor::full(x, (1, 2, t, 3), &Device::Cpu).unwrap()
}

fn kv(positions: usize) -> LayerCache {
    let k = Tensor::zeros((1, 2, positions, 3), DType::F32, &Device::Cpu).unwrap();
    LayerCache::Kv {
        v: k.zeros_like().unwrap(),
        k,
    }
}

fn row(t: &Tensor) -> Vec<Vec<f32>> {
    t.get(0).unwrap().get(1).unwrap().to_vec2::<f32>().unwrap()
}

#[test]
fn one_run_of_blocks_is_written_in_place_and_read_as_views() {
    let layer = kv(2 * BLOCK);
    let pages = Pages::new(&[0, 1], 3);
    let view = LayerView::new(&layer, &pages);
    view.write(&tensor(1.0, 2), &tensor(-1.0, 2), 0).unwrap();
    let (k, v) = view.write(&tensor(2.0, 1), &tensor(-2.0, 1), 2).unwrap();
    assert_eq!(row(&k), vec![vec![1.0; 3], vec![1.0; 3], vec![2.0; 3]]);
    assert_eq!(row(&v), vec![vec![-1.0; 3], vec![-1.0; 3], vec![-2.0; 3]]);
    let LayerCache::Kv { k: buffer, .. } = &layer else {
        unreachable!()
    };
    // The preallocated buffer itself was written (no copy).
    assert_eq!(row(&buffer.narrow(2, 0, 3).unwrap()), row(&k));
}

#[test]
fn a_block_table_places_and_gathers_every_position() {
    let layer = kv(4 * BLOCK);
    // Positions 0..BLOCK + 2 in block 3, then block 1.
    let pages = Pages::new(&[3, 1], BLOCK + 2);
    assert!(pages.table().is_some());
    assert_eq!(
        pages.runs(BLOCK - 1, BLOCK + 2),
        vec![(4 * BLOCK - 1, 1), (BLOCK, 2)]
    );
    let view = LayerView::new(&layer, &pages);
    let ramp: Vec<f32> = (0..BLOCK + 2).flat_map(|p| [p as f32; 6]).collect();
    let ramp = Tensor::from_vec(ramp, (1, BLOCK + 2, 2, 3), &Device::Cpu)
        .unwrap()
        .transpose(1, 2)
        .unwrap();
    let held = view.write_held(&ramp, &ramp, 0).unwrap();
    assert!(
        held.pages.is_some(),
        "paged: the pool's tensors and the table"
    );
    let (k, _) = held.gathered().unwrap();
    let want: Vec<Vec<f32>> = (0..BLOCK + 2).map(|p| vec![p as f32; 3]).collect();
    assert_eq!(row(&k), want);
    let LayerCache::Kv { k: buffer, .. } = &layer else {
        unreachable!()
    };
    assert_eq!(
        row(&buffer.narrow(2, BLOCK, 1).unwrap()),
        vec![vec![BLOCK as f32; 3]]
    );
}

/// The cache keeps the weights' dtype, except block formats on CPU (bf16); a GGUF of floats
/// (its label F32 or F16) is not blocks; `--kv-dtype` names f32 or bf16, nothing else.
#[test]
fn the_cache_dtype_follows_the_weights_but_blocks_cache_in_bf16() {
    use candle_core::quantized::GgmlDType as G;
    let cpu = Device::Cpu;
    assert_eq!(dtype_for(DType::F32, None, &cpu), DType::F32);
    assert_eq!(dtype_for(DType::BF16, None, &cpu), DType::BF16);
    assert_eq!(dtype_for(DType::F32, Some(G::Q4K), &cpu), DType::BF16);
    assert_eq!(dtype_for(DType::F32, Some(G::Q8_0), &cpu), DType::BF16);
    assert_eq!(dtype_for(DType::F32, Some(G::F16), &cpu), DType::F32);
    assert_eq!(dtype_for(DType::F32, Some(G::F32), &cpu), DType::F32);
    assert_eq!(dtype_for(DType::BF16, Some(G::Q8_0), &cpu), DType::BF16);
    assert_eq!(parse_dtype("auto").unwrap(), None);
    assert_eq!(parse_dtype(" F32").unwrap(), Some(DType::F32));
    assert_eq!(parse_dtype("bf16").unwrap(), Some(DType::BF16));
    let e = parse_dtype("f16").unwrap_err().to_string();
    assert!(
        e.contains("--kv-dtype f16") && e.contains("auto, f32 or bf16"),
        "{e}"
    );
    let choose = |asked| choose_dtype(asked, DType::F32, Some(G::Q8_0), &cpu).unwrap();
    assert_eq!(choose(None), DType::BF16);
    assert_eq!(choose(Some(DType::F32)), DType::F32);
    assert_eq!(choose(Some(DType::BF16)), DType::BF16);
}
