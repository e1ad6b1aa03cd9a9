//! Talking to a model through the CLI: the chat template in `generate` (`--prompt`,
//! `--system`, `--messages`, `--raw`, stdin and files), `chat` reusing its cache between
//! turns and dropping old turns, stop strings, sampling defaults and the seed, and bad
//! input. The bundled tiny-gqa (copied with a chat template added) runs everywhere; the
//! real SmolLM2-135M-Instruct checks replies against transformers' greedy ones
//! (tests/data/chat_reference.json, scripts/chat_reference.py).

mod common;

use common::{checkpoint, fails, ids, reference, run_json, BIN};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn chat_reference() -> Value {
    reference(&root().join("tests/data/chat_reference.json"))
}

/// models/tiny-gqa copied to a scratch directory, with `template` as its
/// chat_template.jinja (a fixture of tests/data/chat_templates) when given.
fn tiny_with_template(case: &str, template: Option<&str>) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("chat")
        .join(case);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(root().join("models/tiny-gqa")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    if let Some(name) = template {
        let src = root().join(format!("tests/data/chat_templates/{name}.jinja"));
        std::fs::copy(src, dir.join("chat_template.jinja")).unwrap();
    }
    dir
}

/// Runs `chat --json` with `input` on stdin; returns the turns' objects and stderr.
fn chat(dir: &Path, args: &[&str], input: &str) -> (Vec<Value>, String) {
    let mut child = Command::new(BIN)
        .args(["chat", "-m", dir.to_str().unwrap(), "--json"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "chat {args:?}: {stderr}");
    let turns = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (turns, stderr)
}

#[test]
fn smollm2_answers_like_transformers_through_its_template() {
    let Some(dir) = checkpoint("smollm2-135m-instruct") else {
        return;
    };
    let (m, r) = (dir.to_str().unwrap(), chat_reference());
    let want = &r["capital"];
    let g = run_json(&[
        "generate",
        "-m",
        m,
        "-p",
        "What is the capital of France?",
        "--temperature",
        "0",
        "-n",
        "64",
    ]);
    assert_eq!(g["chat_template_applied"], true);
    assert_eq!(ids(&g["prompt_token_ids"]), ids(&want["prompt_ids"]));
    assert_eq!(ids(&g["token_ids"]), ids(&want["generated_ids"]));
    assert!(g["text"].as_str().unwrap().contains("Paris"), "{g}");
    // --raw sends the text alone, as transformers' tokenizer(text) does.
    let raw = run_json(&[
        "generate",
        "-m",
        m,
        "-p",
        "What is the capital of France?",
        "--raw",
        "--temperature",
        "0",
        "-n",
        "8",
    ]);
    assert_eq!(raw["chat_template_applied"], false);
    assert_eq!(
        ids(&raw["prompt_token_ids"]),
        ids(&r["capital_raw"]["prompt_ids"])
    );

    // --system and --messages give the ids transformers' apply_chat_template gives.
    let case = |conversation: &str| {
        r["renders"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| {
                c["template"] == "smollm2"
                    && c["conversation"] == conversation
                    && c["add_generation_prompt"] == true
            })
            .unwrap()
            .clone()
    };
    let su = case("system_user");
    let (system, user) = (
        su["messages"][0]["content"].as_str().unwrap(),
        su["messages"][1]["content"].as_str().unwrap(),
    );
    let sys = run_json(&[
        "generate", "-m", m, "--system", system, "-p", user, "-n", "1",
    ]);
    assert_eq!(ids(&sys["prompt_token_ids"]), ids(&su["token_ids"]));
    let multi = r["renders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["template"] == "smollm2" && c["conversation"] == "multi_turn_system")
        .unwrap();
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("chat-messages.json");
    std::fs::write(&file, multi["messages"].to_string()).unwrap();
    let from_file = run_json(&[
        "generate",
        "-m",
        m,
        "--messages",
        file.to_str().unwrap(),
        "-n",
        "1",
    ]);
    assert_eq!(
        ids(&from_file["prompt_token_ids"]),
        ids(&multi["token_ids"])
    );
}

#[test]
fn smollm2_chat_reuses_its_cache_and_replies_like_transformers() {
    let Some(dir) = checkpoint("smollm2-135m-instruct") else {
        return;
    };
    let want = &chat_reference()["chat_greedy"]["turns"];
    let (turns, _) = chat(
        &dir,
        &["--temperature", "0", "-n", "64"],
        "Hi\nWhat did I just say?\n",
    );
    assert_eq!(turns.len(), 2);
    for (got, want) in turns.iter().zip(want.as_array().unwrap()) {
        assert_eq!(ids(&got["token_ids"]), ids(&want["generated_ids"]), "{got}");
        assert_eq!(got["text"], want["text"]);
        assert_eq!(got["stop_reason"], "eos");
    }
    // Turn 2 prefills only what follows turn 1's prompt and reply.
    let (first, second) = (&turns[0], &turns[1]);
    let reused = second["reused_tokens"].as_u64().unwrap();
    let turn1 = first["prompt_tokens"].as_u64().unwrap() + ids(&first["token_ids"]).len() as u64;
    assert_eq!(reused, turn1, "{second}");
    assert_eq!(
        second["prefill_tokens"].as_u64().unwrap() + reused,
        ids(&want[1]["prompt_ids"]).len() as u64
    );
}

#[test]
fn chat_keeps_the_shared_prefix_clears_and_drops_old_turns() {
    let dir = tiny_with_template("session", Some("smollm2"));
    let args = ["--temperature", "0", "-n", "12"];
    let (turns, _) = chat(
        &dir,
        &args,
        "ROMEO:\n\nJULIET:\n/clear\nROMEO:\n/exit\nignored\n",
    );
    assert_eq!(turns.len(), 3, "{turns:?}");
    assert_eq!(turns[0]["reused_tokens"], 0);
    assert!(
        turns[1]["reused_tokens"].as_u64().unwrap() > 0,
        "{}",
        turns[1]
    );
    // After /clear the same first message gives the same reply, from an empty cache.
    assert_eq!(turns[2]["reused_tokens"], 0);
    assert_eq!(turns[2]["token_ids"], turns[0]["token_ids"]);

    // A context of 128 tokens cannot hold many turns: the oldest go, and stderr says so.
    let input = "one\ntwo\nthree\nfour\nfive\nsix\n";
    let (turns, stderr) = chat(
        &dir,
        &["--temperature", "0", "-n", "8", "--context", "128"],
        input,
    );
    assert_eq!(turns.len(), 6);
    let dropped: u64 = turns
        .iter()
        .map(|t| t["dropped_messages"].as_u64().unwrap())
        .sum();
    assert!(dropped > 0, "{turns:?}");
    assert!(stderr.contains("dropped the"), "{stderr}");
    assert!(turns
        .iter()
        .all(|t| t["prompt_tokens"].as_u64().unwrap() + 8 <= 128));
}

#[test]
fn stop_strings_end_generation_without_being_printed() {
    let m = "tiny-gqa";
    let base = run_json(&["generate", "-m", m, "-p", "ROMEO:", "-t", "0", "-n", "40"]);
    let text = base["text"].as_str().unwrap().to_string();
    // A stop string of three characters from the middle of the text: it spans tokens or
    // not, and must be caught either way; what precedes its first occurrence is the output.
    let chars: Vec<char> = text.chars().collect();
    for at in [chars.len() / 3, chars.len() / 2] {
        let stop: String = chars[at..at + 3].iter().collect();
        let g = run_json(&[
            "generate", "-m", m, "-p", "ROMEO:", "-t", "0", "-n", "40", "--stop", &stop,
        ]);
        let want = &text[..text.find(&stop).unwrap()];
        assert_eq!(g["stop_reason"], "stop", "{stop:?}: {g}");
        assert_eq!(g["text"].as_str().unwrap(), want, "{stop:?}");
        // The same when streamed: stdout shows the text up to the stop string.
        let out = Command::new(BIN)
            .args([
                "generate", "-m", m, "-p", "ROMEO:", "-t", "0", "-n", "40", "--stop", &stop,
            ])
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim_end(),
            want.trim_end()
        );
    }
}

#[test]
fn sampling_defaults_and_a_reported_seed_that_repeats_the_run() {
    let m = "tiny-gqa";
    let a = run_json(&["generate", "-m", m, "-p", "ROMEO:", "-n", "24"]);
    // The bundled model's generation_config has no sampling fields: llama.cpp's defaults.
    assert_eq!(a["sampling"]["temperature"].as_f64().unwrap() as f32, 0.8);
    assert_eq!(a["sampling"]["top_k"], 40);
    let seed = a["seed"].as_u64().unwrap().to_string();
    let b = run_json(&[
        "generate", "-m", m, "-p", "ROMEO:", "-n", "24", "--seed", &seed,
    ]);
    assert_eq!(a["token_ids"], b["token_ids"]);
    let c = run_json(&["generate", "-m", m, "-p", "ROMEO:", "-n", "24"]);
    assert_ne!(a["seed"], c["seed"], "the seed is drawn at random");
    // A prompt from stdin and from a file equals the same prompt given inline.
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("chat-prompt.txt");
    std::fs::write(&file, "ROMEO:").unwrap();
    let f = run_json(&[
        "generate",
        "-m",
        m,
        "--prompt-file",
        file.to_str().unwrap(),
        "-t",
        "0",
    ]);
    let mut child = Command::new(BIN)
        .args(["generate", "-m", m, "-p", "-", "-t", "0", "--json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"ROMEO:").unwrap();
    let s: Value = serde_json::from_slice(&child.wait_with_output().unwrap().stdout).unwrap();
    let inline = run_json(&["generate", "-m", m, "-p", "ROMEO:", "-t", "0"]);
    assert_eq!(f["token_ids"], inline["token_ids"]);
    assert_eq!(s["token_ids"], inline["token_ids"]);
    assert_eq!(inline["chat_template_applied"], false);
}

#[test]
fn bad_chat_input_is_one_line_naming_it() {
    let dir = tiny_with_template("bad", Some("mistral"));
    let m = dir.to_str().unwrap();
    fails(
        &["generate", "-m", "tiny-gqa", "-p", "x", "--stop", ""],
        &[],
        "--stop",
    );
    fails(
        &["generate", "-m", "tiny-gqa", "-p", "x", "--system", "s"],
        &[],
        "no chat template",
    );
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("chat-bad-messages.json");
    for (bad, expect) in [
        (
            r#"{"role": "user", "content": "x"}"#,
            "chat-bad-messages.json",
        ),
        (r#"[{"role": "user"}]"#, "content"),
        (r#"[{"role": "user", "content": 3}]"#, "content"),
        ("not json", "chat-bad-messages.json"),
    ] {
        std::fs::write(&file, bad).unwrap();
        fails(
            &["generate", "-m", m, "--messages", file.to_str().unwrap()],
            &[],
            expect,
        );
    }
    // Mistral's template refuses a system message, in its own words.
    fails(
        &["generate", "-m", m, "--system", "s", "-p", "x"],
        &[],
        "roles must alternate",
    );
    let long = "word ".repeat(400);
    fails(
        &["generate", "-m", m, "-p", &long],
        &[],
        "context length is 256",
    );
    fails(&["chat", "-m", "tiny-gqa"], &[], "no chat template");
    // A hostile checkpoint's template: an error, not an abort or a render without end.
    for (source, expect) in [
        ("{{ messages | tojson(indent=100000000000000) }}", "indent"),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "steps",
        ),
    ] {
        std::fs::write(dir.join("chat_template.jinja"), source).unwrap();
        fails(&["generate", "-m", m, "-p", "x"], &[], expect);
    }
}
