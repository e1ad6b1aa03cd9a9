//! The tiny models compiled into the binary, one per attention variant, so `generate` works
//! offline from any directory. They are trained by scripts/train_tiny.py on Shakespeare and
//! differ only in their attention (configs/tiny-*.json).

/// A model whose files are part of the executable.
pub struct Bundled {
    pub name: &'static str,
    pub config: &'static str,
    pub tokenizer: &'static [u8],
    pub weights: &'static [u8],
}

macro_rules! bundled {
    ($name:literal) => {
        Bundled {
            name: $name,
            config: include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/models/",
                $name,
                "/config.json"
            )),
            tokenizer: include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/models/",
                $name,
                "/tokenizer.json"
            )),
            weights: include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/models/",
                $name,
                "/model.safetensors"
            )),
        }
    };
}

pub const MODELS: [Bundled; 4] = [
    bundled!("tiny-mha"),
    bundled!("tiny-gqa"),
    bundled!("tiny-mqa"),
    bundled!("tiny-mla"),
];

/// What `generate` runs without `--model`: GQA keeps most of MHA's quality at half its cache.
pub const DEFAULT: &str = "tiny-gqa";

pub fn find(name: &str) -> Option<&'static Bundled> {
    MODELS.iter().find(|b| b.name == name)
}
