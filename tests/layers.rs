//! The rooms of `src/` import one way only: each room may use the rooms below it in
//! [`ROOMS`], never one above it, so the room graph has no circle. docs/architecture.md
//! draws the same order; this test fails, naming the file and line, when an import runs up.

use std::path::{Path, PathBuf};

/// Top to bottom: front-ends, then loading, then the engine, then the facts every room
/// shares. `cli` is the binary's room and reaches the library as `tiny_decoder::`.
const ROOMS: &[(&str, &str)] = &[
    ("cli", "front-end"),
    ("serve", "front-end"),
    ("convert", "front-end"),
    ("chat", "front-end"),
    ("eval", "front-end"),
    ("bench", "front-end"),
    ("loader", "loading"),
    ("generate", "engine"),
    ("grammar", "engine"),
    ("sampling", "engine"),
    ("model", "engine"),
    ("kv_cache", "engine"),
    ("config", "base"),
    ("error", "base"),
];

fn rank(room: &str) -> Option<usize> {
    ROOMS.iter().position(|(name, _)| *name == room)
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The rooms a line of code names as `crate::ROOM` or `tiny_decoder::ROOM` (comments cut).
fn named_rooms(line: &str) -> Vec<&str> {
    let code = line.split("//").next().unwrap_or_default();
    let mut rooms = Vec::new();
    for prefix in ["crate::", "tiny_decoder::"] {
        for (at, _) in code.match_indices(prefix) {
            let rest = &code[at + prefix.len()..];
            match rest.strip_prefix('{') {
                // `use crate::{a::X, b};`: the first name of each item at the top level.
                Some(group) => {
                    let (mut depth, mut item_start) = (0, true);
                    for (i, c) in group.char_indices() {
                        match c {
                            '{' => depth += 1,
                            '}' if depth == 0 => break,
                            '}' => depth -= 1,
                            ',' if depth == 0 => item_start = true,
                            c if item_start && !c.is_whitespace() => {
                                rooms.push(leading_name(&group[i..]));
                                item_start = false;
                            }
                            _ => {}
                        }
                    }
                }
                None => rooms.push(leading_name(rest)),
            }
        }
    }
    rooms
}

fn leading_name(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

#[test]
fn imports_run_down_the_rooms_only() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut upward = Vec::new();
    let mut unranked = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&src).unwrap();
        let first = relative.components().next().unwrap().as_os_str();
        let room = first.to_str().unwrap().trim_end_matches(".rs");
        if room == "lib" || room == "main" {
            continue; // the crate's doors: they name every room
        }
        let Some(own) = rank(room) else {
            unranked.push(relative.display().to_string());
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            for used in named_rooms(line) {
                // Root re-exports (`crate::Result`, `tiny_decoder::KvCache`) start upper-case.
                if used == room || used.starts_with(|c: char| c.is_ascii_uppercase()) {
                    continue;
                }
                match rank(used) {
                    Some(r) if r > own => {}
                    _ => upward.push(format!(
                        "src/{}:{}: {room} ({}) uses {used}",
                        relative.display(),
                        n + 1,
                        ROOMS[own].1,
                    )),
                }
            }
        }
    }
    assert!(
        unranked.is_empty(),
        "rooms missing from ROOMS (add them where they sit): {unranked:?}"
    );
    assert!(
        upward.is_empty(),
        "imports that run up the rooms:\n{}",
        upward.join("\n")
    );
}

#[test]
fn an_upward_import_would_be_seen() {
    assert_eq!(
        named_rooms("use crate::serve::Server; // crate::cli"),
        ["serve"]
    );
    assert_eq!(
        named_rooms("let x = tiny_decoder::model::Transformer::new();"),
        ["model"]
    );
    assert_eq!(
        named_rooms("use tiny_decoder::{bench, loader::{self, Loaded}, ModelConfig};"),
        ["bench", "loader", "ModelConfig"]
    );
    assert!(rank("serve") < rank("model"));
}
