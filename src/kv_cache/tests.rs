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

/// A step's sequences written into one pool in one write a tensor (`write_held_all`) land
/// where each one's own write puts them, through tables that interleave their blocks and
/// with a sequence crossing into its next block; spans out of order take each one's write.
#[test]
fn one_write_for_a_steps_sequences_equals_a_write_each() {
    // Tokens: sequence 0 two (positions BLOCK - 1, BLOCK), sequence 1 one (position 3).
    let tables = [Pages::new(&[2, 0], BLOCK + 1), Pages::new(&[1], 4)];
    let spans = [(0, 2, BLOCK - 1), (2, 1, 3)];
    let step: Vec<f32> = (0..3 * 2 * 3).map(|i| i as f32 + 1.0).collect();
    let a = Tensor::from_vec(step, (1, 3, 2, 3), &Device::Cpu)
        .unwrap()
        .transpose(1, 2)
        .unwrap(); // (1, 2 heads, 3 tokens, 3): rows contiguous, strided between them
    let b = (a.clone() * -1.0).unwrap();
    let write = |together: bool, order: [usize; 2]| {
        let layer = kv(3 * BLOCK);
        let views: Vec<LayerView> = order
            .iter()
            .map(|&i| LayerView::new(&layer, &tables[i]))
            .collect();
        let at: Vec<_> = order.iter().map(|&i| spans[i]).collect();
        match together {
            true => drop(LayerView::write_held_all(&views, &a, &b, &at).unwrap()),
            false => {
                for (view, &(start, len, pos)) in views.iter().zip(&at) {
                    let (x, y) = (
                        a.narrow(2, start, len).unwrap(),
                        b.narrow(2, start, len).unwrap(),
                    );
                    view.write_held(&x, &y, pos).unwrap();
                }
            }
        }
        let LayerCache::Kv { k, v } = &layer else {
            unreachable!()
        };
        (
            k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        )
    };
    let each = write(false, [0, 1]);
    assert!(each.0.iter().any(|&x| x != 0.0), "something was written");
    assert_eq!(write(true, [0, 1]), each);
    // Out of order (sequence 1's span first): not one write, the same cache.
    assert_eq!(write(true, [1, 0]), each);
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
