//! `chat`: an interactive conversation. On a terminal, lines are read with rustyline (line
//! editing, history); otherwise plain lines from stdin, so a session can be scripted:
//! `printf 'Hi\nWhat did I just say?\n' | tiny-decoder chat -m DIR --json`.
//! `/clear` starts over, `/exit` or end of input ends. Ctrl-C during a reply stops that
//! reply (it stays in the conversation); at the prompt it ends the session.

use super::args::ChatArgs;
use super::generate::{catch_interrupt, check_stops, sampling_line, INTERRUPTED};
use super::{chat_template, load, tokenizer};
use anyhow::{bail, Result};
use serde_json::json;
use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::Ordering;
use tiny_decoder::chat::Conversation;
use tiny_decoder::config::GenerationConfig;
use tiny_decoder::generate::Options;
use tiny_decoder::loader::bundled;
use tiny_decoder::sampling::Sampler;

/// The conversation's length unless `--context` says otherwise: llama.cpp's default, which
/// bounds the cache of a model with a long context.
const DEFAULT_CONTEXT: usize = 4096;

/// Where the user's lines come from.
enum Input {
    Terminal(rustyline::DefaultEditor),
    Lines(std::io::StdinLock<'static>),
}

impl Input {
    fn open() -> Result<Self> {
        Ok(match std::io::stdin().is_terminal() {
            true => Input::Terminal(rustyline::DefaultEditor::new()?),
            false => Input::Lines(std::io::stdin().lock()),
        })
    }

    /// The next line, or `None` at the end of input (EOF, or Ctrl-C/Ctrl-D at the prompt).
    fn next(&mut self) -> Result<Option<String>> {
        match self {
            Input::Terminal(editor) => match editor.readline("> ") {
                Ok(line) => {
                    let _ = editor.add_history_entry(line.as_str());
                    Ok(Some(line))
                }
                Err(rustyline::error::ReadlineError::Eof)
                | Err(rustyline::error::ReadlineError::Interrupted) => Ok(None),
                Err(e) => Err(e.into()),
            },
            Input::Lines(stdin) => {
                let mut line = String::new();
                match stdin.read_line(&mut line)? {
                    0 => Ok(None),
                    _ => Ok(Some(line.trim_end_matches(['\n', '\r']).to_string())),
                }
            }
        }
    }
}

pub fn run_chat(a: ChatArgs) -> Result<()> {
    let requested = a.sampling.requested();
    Sampler::new(&requested.resolve(&GenerationConfig::default()))?;
    check_stops(&a.stop)?;
    catch_interrupt();
    let model_name = a.model.as_deref().unwrap_or(bundled::DEFAULT);
    let loaded = load(model_name, &a.placement)?;
    let tok = tokenizer(&loaded, model_name)?;
    let Some(template) = chat_template(&loaded)? else {
        bail!(
            "{model_name} has no chat template (chat_template.jinja or tokenizer_config.json): \
             use `generate --raw` for plain text"
        );
    };
    let params = requested.resolve(&loaded.generation);
    let mut sampler = Sampler::new(&params)?;
    eprintln!("{}", sampling_line(&params, true));
    let context = a.context.unwrap_or(DEFAULT_CONTEXT);
    let mut chat = Conversation::new(&loaded.model, tok, template, a.system.as_deref(), context)?;
    let mut input = Input::open()?;
    let mut stdout = std::io::stdout().lock();
    while let Some(line) = input.next()? {
        match line.trim() {
            "/exit" => break,
            "/clear" => {
                chat.clear();
                eprintln!("(conversation cleared)");
                continue;
            }
            "" => continue,
            _ => {}
        }
        INTERRUPTED.store(false, Ordering::SeqCst);
        let opts = Options {
            max_new_tokens: a.max_new_tokens,
            stop: &a.stop,
            interrupt: Some(&INTERRUPTED),
            ignore_eos: false,
            logprobs: None,
        };
        let json_mode = a.json;
        let turn = chat.turn(&line, opts, &mut sampler, |text| {
            if !json_mode {
                let _ = std::io::stdout()
                    .write_all(text.as_bytes())
                    .and_then(|_| std::io::stdout().flush());
            }
        });
        let (g, notes) = match turn {
            Ok(done) => done,
            // A turn that cannot run (too long, a template error) is reported; the
            // conversation goes on as before it.
            Err(e) => {
                eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
                continue;
            }
        };
        if notes.dropped_messages > 0 {
            eprintln!(
                "note: dropped the {} oldest messages to fit the context of {context} tokens",
                notes.dropped_messages
            );
        }
        if a.json {
            let out = json!({
                "token_ids": g.token_ids,
                "text": g.text,
                "stop_reason": g.stop_reason.as_str(),
                "prefill_tokens": g.prefill_tokens(),
                "reused_tokens": g.reused_tokens,
                "prompt_tokens": g.prompt_token_ids.len(),
                "dropped_messages": notes.dropped_messages,
                "prefill_tokens_per_s": g.prefill_tokens_per_s(),
                "decode_tokens_per_s": g.decode_tokens_per_s(),
                "seed": params.seed,
            });
            writeln!(stdout, "{out}")?;
        } else {
            writeln!(stdout)?;
            eprintln!(
                "[{} new prompt tokens, {} reused | {} tokens, {:.1} tok/s | {}]",
                g.prefill_tokens(),
                g.reused_tokens,
                g.token_ids.len(),
                g.decode_tokens_per_s(),
                g.stop_reason.as_str()
            );
        }
        stdout.flush()?;
    }
    Ok(())
}
