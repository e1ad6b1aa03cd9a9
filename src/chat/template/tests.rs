//! Unit tests of the jinja2 behaviours transformers relies on; the four real templates are
//! checked against transformers' own renders in tests/chat_templates.rs.

use super::time::strftime;
use super::*;

fn msg(role: &str, content: &str) -> Message {
    Message {
        role: role.into(),
        content: content.into(),
    }
}

/// Renders `source` for one user message "hi" with `extra` variables (a JSON object).
fn render(source: &str, extra: serde_json::Value) -> Result<String> {
    let t = ChatTemplate::new(source, Some("<s>"), Some("</s>"))?;
    let extra = extra.as_object().cloned().unwrap_or_default();
    t.render_with(&[msg("user", "hi")], true, &extra)
}

#[test]
fn a_syntax_error_names_its_line() {
    let err = ChatTemplate::new("a\n{% if x %}\n{{ y }", None, None).expect_err("an error");
    let text = err.to_string();
    assert!(
        text.starts_with("chat template, line 3: syntax error"),
        "{text}"
    );
    assert!(!text.contains('\n'), "{text}");
}

#[test]
fn raise_exception_surfaces_the_template_message_and_line() {
    let source = "{% for m in messages %}\n{% if m.role != 'system' %}\n\
                  {{ raise_exception('Only system roles are supported!') }}\n\
                  {% endif %}{% endfor %}";
    let text = render(source, serde_json::json!({}))
        .unwrap_err()
        .to_string();
    assert_eq!(
        text,
        "chat template, line 3: Only system roles are supported!"
    );
}

#[test]
fn other_render_errors_keep_minijinja_message_and_line() {
    let text = render("ok\n{{ messages[0].nope.deeper }}", serde_json::json!({}))
        .unwrap_err()
        .to_string();
    assert!(
        text.starts_with("chat template, line 2: undefined value"),
        "{text}"
    );
}

#[test]
fn python_string_and_dict_methods_work() {
    let source = "{{ '  x y  '.strip() }}|{{ 'a,b'.split(',')[1] }}|{{ 'abc'.startswith('ab') }}\
                  |{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}";
    assert_eq!(
        render(source, serde_json::json!({})).unwrap(),
        "x y|b|True|a=1"
    );
}

#[test]
fn tojson_writes_python_json_dumps() {
    let extra = serde_json::json!({"x": {"a": 1, "b": [1, 2], "c": "é\n\"", "d": null, "f": 1.5}});
    // serde_json without preserve_order sorts keys: this object is already in order.
    let out = render("{{ x | tojson }}", extra.clone()).unwrap();
    assert_eq!(
        out,
        r#"{"a": 1, "b": [1, 2], "c": "é\n\"", "d": null, "f": 1.5}"#
    );
    let out = render("{{ x.b | tojson(indent=2) }}", extra.clone()).unwrap();
    assert_eq!(out, "[\n  1,\n  2\n]");
    let out = render(
        "{{ {'b': 'é', 'a': []} | tojson(ensure_ascii=true, sort_keys=true) }}",
        extra,
    )
    .unwrap();
    assert_eq!(out, r#"{"a": [], "b": "\u00e9"}"#);
    // Not minijinja's own filter, which writes `<` as `\u003c`.
    assert_eq!(
        render("{{ '<|im_end|>' | tojson }}", serde_json::json!({})).unwrap(),
        "\"<|im_end|>\""
    );
    let out = render(
        "{{ [1e16, 1e-5, 0.1, 2.0, -0.0] | tojson }}",
        serde_json::json!({}),
    )
    .unwrap();
    assert_eq!(out, "[1e+16, 1e-05, 0.1, 2.0, -0.0]");
}

#[test]
fn trim_and_lstrip_blocks_are_on_and_the_final_newline_goes() {
    let source = "A\n  {% if true %}\n  B\n  {% endif %}\nC\n";
    assert_eq!(render(source, serde_json::json!({})).unwrap(), "A\n  B\nC");
}

#[test]
fn python_semantics_the_templates_rely_on() {
    let source = "{% set ns = namespace(n=0) %}{% for m in messages + messages %}\
                  {% set ns.n = ns.n + 1 %}{% if loop.last %}{{ loop.index0 }}{% endif %}\
                  {% endfor %}\
                  |{{ ns.n }}|{{ messages[-1]['content'] + '!' }}|{{ messages[1:] | length }}\
                  |{{ 'tool_calls' in messages[0] }}|{{ messages[0].content is string }}\
                  |{{ bos_token is defined }}{{ unk_token is defined }}|{{ tools is none }}\
                  |{{ none is none and None is none and True and not False }}";
    let out = render(source, serde_json::json!({})).unwrap();
    assert_eq!(out, "1|2|hi!|0|False|True|TrueFalse|True|True");
}

#[test]
fn crlf_templates_and_the_sequence_test_read_as_in_jinja2() {
    let source = "a\r\nb\r\n{% if true %}\r\nc\r\n{% endif %}\r\n";
    assert_eq!(render(source, serde_json::json!({})).unwrap(), "a\nb\nc\n");
    let source =
        "{{ 'abc' is sequence }}{{ {} is sequence }}{{ [] is sequence }}{{ 3 is sequence }}";
    assert_eq!(
        render(source, serde_json::json!({})).unwrap(),
        "TrueTrueTrueFalse"
    );
}

#[test]
fn extra_variables_override_and_loop_controls_work() {
    let source =
        "{{ bos_token }}{{ date_string }}{% for i in range(5) %}{% if i == 2 %}{% break %}\
                  {% endif %}{{ i }}{% endfor %}";
    let out = render(
        source,
        serde_json::json!({"bos_token": "B", "date_string": "D"}),
    )
    .unwrap();
    assert_eq!(out, "BD01");
}

#[test]
fn generation_blocks_pass_their_body_through() {
    let source = "{% for m in messages %}\n{%- generation %}\n[{{ m.content }}]\n\
                  {%- endgeneration %}\n{% endfor %}";
    assert_eq!(render(source, serde_json::json!({})).unwrap(), "[hi]");
}

#[test]
fn strftime_formats_utc_dates() {
    // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
    let secs = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
    let out = strftime("%d %b %Y|%A %a %B %m %y|%H:%M:%S %j %%", secs).unwrap();
    assert_eq!(out, "26 Jul 2024|Friday Fri July 07 24|13:05:09 208 %");
    assert!(strftime("%Q", 0).unwrap_err().to_string().contains("%Q"));
    assert_eq!(strftime("%d %m %Y", -86_400).unwrap(), "31 12 1969");
}

#[test]
fn read_messages_names_the_bad_entry() {
    let dir = std::env::temp_dir().join(format!("td-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.json");
    std::fs::write(&path, r#"[{"role": "user", "content": "hi"}]"#).unwrap();
    assert_eq!(read_messages(&path).unwrap(), vec![msg("user", "hi")]);
    for (text, want) in [
        (r#"{"role": "user"}"#, "expected a JSON list"),
        (
            r#"[{"role": "user", "content": "a"}, 3]"#,
            "message 1: expected an object",
        ),
        (
            r#"[{"role": "user", "content": 3}]"#,
            "message 0: \"content\" must be a string",
        ),
        (r#"[{"content": "a"}]"#, "message 0: missing \"role\""),
        (
            r#"[{"role": "user", "content": "a", "name": "x"}]"#,
            "message 0: unknown field \"name\"",
        ),
        ("[", "not JSON"),
    ] {
        std::fs::write(&path, text).unwrap();
        let err = read_messages(&path).unwrap_err().to_string();
        assert!(err.contains("m.json") && err.contains(want), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Templates that would abort or never end, from a hostile checkpoint: each is an error in
/// bounded time (well under a second unloaded; 10 s allowed), and a real template still
/// renders a long conversation.
#[test]
fn hostile_templates_are_bounded() {
    let cases = [
        (
            "{{ messages | tojson(indent=100000000000000) }}",
            "indent 100000000000000 is more than 64",
        ),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "more than 1000000 steps",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}\
             {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            "more than 1000000 steps",
        ),
    ];
    for (source, expect) in cases {
        let start = std::time::Instant::now();
        let text = render(source, serde_json::json!({}))
            .unwrap_err()
            .to_string();
        assert!(text.contains(expect), "{source}: {text}");
        assert!(
            start.elapsed().as_secs_f64() < 10.0,
            "{source}: {:?}",
            start.elapsed()
        );
    }
    let smollm2 = include_str!("../../../tests/data/chat_templates/smollm2.jinja");
    let t = ChatTemplate::new(smollm2, None, None).unwrap();
    let long: Vec<Message> = (0..2000)
        .map(|i| msg(["user", "assistant"][i % 2], &"word ".repeat(50)))
        .collect();
    assert!(t.render(&long, true).unwrap().len() > 2000 * 250);
}

/// Found by tests/fuzz_load.rs: a `{%` whose `%` is also the start of `%}` panicked in the
/// generation-tag rewrite; now it is minijinja's syntax error, like any other.
#[test]
fn overlapping_tag_marks_are_a_syntax_error() {
    for source in ["{%}", "a{%}b", "{%%}", "{%-}"] {
        let err = ChatTemplate::new(source, None, None).expect_err(source);
        assert!(err.to_string().contains("syntax error"), "{source}: {err}");
    }
    let ok = ChatTemplate::new("{% generation %}x{% endgeneration %}", None, None).unwrap();
    assert_eq!(ok.render(&[], false).unwrap(), "x");
}
