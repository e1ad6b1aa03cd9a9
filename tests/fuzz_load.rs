//! Property test: loading a checkpoint whose config.json, safetensors header or GGUF header
//! has been mutated never panics; `info` and the load that `generate` does each succeed or
//! return an error. A bounded number of cases runs in `cargo test`; `.ci/run` runs 1,000
//! per target on fresh seeds (PROPTEST_CASES), and a long run is
//! `PROPTEST_CASES=100000 cargo test --release --test fuzz_load`.

mod common;

use candle_core::{DType, Device};
use common::gguf::{table, to_gguf};
use proptest::prelude::*;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::OnceLock;
use tiny_decoder::loader;
use tiny_decoder::loader::DTypeArg;

const FIELDS: [&str; 10] = [
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rope_parameters",
    "tie_word_embeddings",
];

fn scratch(case: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("fuzz")
        .join(case);
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(
            common::fixture_dir("qwen3-qknorm").join(name),
            dir.join(name),
        )
        .unwrap();
    }
    dir
}

fn try_load(dir: &std::path::Path) {
    if let Ok(files) = loader::resolve(dir.to_str().unwrap()) {
        let _ = loader::load(&files, DType::F32, &Device::Cpu);
    }
}

fn json_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (-3i64..300).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::json!(f)),
        "[a-z_]{0,8}".prop_map(Value::from),
        Just(serde_json::json!({"rope_type": "yarn"})),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn mutated_config_never_panics(edits in prop::collection::vec((0..FIELDS.len(), json_value()), 1..4)) {
        let dir = scratch("config");
        let path = dir.join("config.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for (field, value) in edits {
            v[FIELDS[field]] = value;
        }
        std::fs::write(&path, v.to_string()).unwrap();
        try_load(&dir);
    }

    #[test]
    fn mutated_safetensors_never_panics(flips in prop::collection::vec((0usize..4096, any::<u8>()), 1..6), cut in 0usize..4) {
        let dir = scratch("safetensors");
        let path = dir.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, byte) in flips {
            let i = at % header; // inside the length prefix or the JSON header
            bytes[i] = byte;
        }
        if cut == 0 {
            bytes.truncate(header + 100);
        }
        std::fs::write(&path, bytes).unwrap();
        try_load(&dir);
    }
}

/// A GGUF written from a fixture (with its tokenizer), once per test binary.
fn gguf() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES
        .get_or_init(|| std::fs::read(to_gguf("llama-mha-tied", "fuzz-base.gguf", |_| {})).unwrap())
}

/// The values a size or count field is set to: the edges of every width, and around them.
fn extreme() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(31),
        Just(32),
        Just(1 << 31),
        Just(u32::MAX as u64),
        Just(1 << 32),
        Just(1 << 62),
        Just(1 << 63),
        Just(u64::MAX),
        any::<u64>(),
        0u64..4096,
    ]
}

/// One structured change to a GGUF: a tensor's dimension, type or offset, the header's
/// counts, a byte of the header, or a cut.
#[derive(Debug, Clone)]
enum GgufEdit {
    Dim(usize, usize, u64),
    Type(usize, u32),
    Offset(usize, u64),
    Count(bool, u64),
    Byte(usize, u8),
    Cut(usize),
}

fn gguf_edit() -> impl Strategy<Value = GgufEdit> {
    prop_oneof![
        (any::<usize>(), 0usize..4, extreme()).prop_map(|(t, d, v)| GgufEdit::Dim(t, d, v)),
        (any::<usize>(), prop_oneof![0u32..40, any::<u32>()])
            .prop_map(|(t, v)| GgufEdit::Type(t, v)),
        (any::<usize>(), extreme()).prop_map(|(t, v)| GgufEdit::Offset(t, v)),
        (any::<bool>(), extreme()).prop_map(|(kv, v)| GgufEdit::Count(kv, v)),
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| GgufEdit::Byte(at, b)),
        any::<usize>().prop_map(GgufEdit::Cut),
    ]
}

fn apply(bytes: &mut Vec<u8>, edit: &GgufEdit) {
    let t = table(gguf());
    let header = t
        .last()
        .map_or(bytes.len(), |e| e.offset_at + 8)
        .min(bytes.len());
    let put = |b: &mut Vec<u8>, at: usize, v: &[u8]| {
        if at + v.len() <= b.len() {
            b[at..at + v.len()].copy_from_slice(v);
        }
    };
    match *edit {
        GgufEdit::Dim(i, d, v) => {
            let e = &t[i % t.len()];
            put(
                bytes,
                e.dims_at + 8 * (d % e.n_dims.max(1)),
                &v.to_le_bytes(),
            );
        }
        GgufEdit::Type(i, v) => put(bytes, t[i % t.len()].type_at, &v.to_le_bytes()),
        GgufEdit::Offset(i, v) => put(bytes, t[i % t.len()].offset_at, &v.to_le_bytes()),
        GgufEdit::Count(kv, v) => put(bytes, if kv { 16 } else { 8 }, &v.to_le_bytes()),
        GgufEdit::Byte(at, b) => put(bytes, at % header, &[b]),
        GgufEdit::Cut(at) => bytes.truncate(at % bytes.len()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn mutated_gguf_never_panics(edits in prop::collection::vec(gguf_edit(), 1..4)) {
        let mut bytes = gguf().to_vec();
        for edit in &edits {
            apply(&mut bytes, edit);
        }
        let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-mutated.gguf");
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(source) = loader::open(path.to_str().unwrap()) {
            let _ = source.describe(DTypeArg::Auto, &Device::Cpu); // info
            let _ = source.load(DTypeArg::Auto, &Device::Cpu); // generate's load
        }
    }
}

/// The file the GGUF cases mutate loads as it is, so that they reach the loader's checks
/// past the header and not only its refusals.
#[test]
fn the_gguf_the_cases_mutate_loads() {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-unmutated.gguf");
    std::fs::write(&path, gguf()).unwrap();
    let source = loader::open(path.to_str().unwrap()).unwrap();
    source.load(DTypeArg::Auto, &Device::Cpu).unwrap();
}

/// Pieces of chat templates, hostile ones among them, with numbers set to extremes.
fn template_piece() -> impl Strategy<Value = String> {
    let n = prop_oneof![
        Just(0i64),
        Just(-1),
        Just(1 << 20),
        Just(i64::MAX),
        0i64..100_000
    ];
    prop_oneof![
        Just("{{ messages | tojson }}".to_string()),
        n.clone()
            .prop_map(|n| format!("{{{{ messages | tojson(indent={n}) }}}}")),
        n.clone()
            .prop_map(|n| format!("{{% for i in range({n}) %}}")),
        Just("{% endfor %}".to_string()),
        n.clone().prop_map(|n| format!("{{{{ 'ab' * {n} }}}}")),
        n.clone().prop_map(|n| format!(
            "{{% set ns = namespace(s='x') %}}{{% for i in range({n}) %}}\
             {{% set ns.s = ns.s ~ ns.s %}}{{% endfor %}}{{{{ ns.s | length }}}}"
        )),
        n.prop_map(|n| format!("{{{{ messages[{n}]['content'] }}}}")),
        Just("{{ raise_exception('refused') }}".to_string()),
        Just("{{ strftime_now('%Y-%m-%d %H:%M %j %%') }}".to_string()),
        Just(
            "{% for m in messages %}{{ m.role }}: {{ m.content.strip() }}{% endfor %}".to_string()
        ),
        Just("{{ bos_token }}{% if add_generation_prompt %}<|assistant|>{% endif %}".to_string()),
        "[ -~]{0,24}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// A template from a checkpoint compiles and renders, or fails with an error, in bounded
    /// time (its fuel makes it well under a second; 20 s leaves room for a loaded host):
    /// never a panic, an abort or a render without end.
    #[test]
    fn hostile_chat_templates_end_in_an_answer(pieces in prop::collection::vec(template_piece(), 1..6)) {
        use tiny_decoder::chat::{ChatTemplate, Message};
        let source = pieces.concat();
        let start = std::time::Instant::now();
        if let Ok(t) = ChatTemplate::new(&source, Some("<s>"), Some("</s>")) {
            let msg = |role: &str| Message { role: role.into(), content: " hi ".into() };
            let _ = t.render(&[msg("system"), msg("user")], true);
        }
        prop_assert!(start.elapsed().as_secs_f64() < 20.0, "{source}: {:?}", start.elapsed());
    }

    /// tokenizer_config.json with its fields set to other types and values.
    #[test]
    fn mutated_tokenizer_config_never_panics(
        edits in prop::collection::vec((0usize..5, json_value(), template_piece()), 1..4)
    ) {
        let dir = scratch("tokenizer-config");
        let fields = ["add_bos_token", "add_eos_token", "bos_token", "eos_token", "chat_template"];
        let mut config = serde_json::json!({});
        for (field, value, piece) in edits {
            config[fields[field]] = match fields[field] {
                "chat_template" if value.is_string() => Value::from(piece),
                "chat_template" => serde_json::json!([{"name": "default", "template": piece}]),
                _ => value,
            };
        }
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        // As generate does: load, then compile and render the template if there is one.
        let Ok(files) = loader::resolve(dir.to_str().unwrap()) else { return Ok(()) };
        let Ok(loaded) = loader::load(&files, DType::F32, &Device::Cpu) else { return Ok(()) };
        let meta = &loaded.meta;
        if let Some(source) = &meta.chat_template {
            use tiny_decoder::chat::{ChatTemplate, Message};
            let (bos, eos) = (meta.bos_token.as_deref(), meta.eos_token.as_deref());
            if let Ok(t) = ChatTemplate::new(source, bos, eos) {
                let _ = t.render(&[Message { role: "user".into(), content: "hi".into() }], true);
            }
        }
        if let Some(tokenizer) = &loaded.tokenizer {
            let _ = tokenizer.encode("hi there");
        }
    }
}
