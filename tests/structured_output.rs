//! Structured output on the real default model (SmolLM2-135M-Instruct,
//! 4-bit): sampled at temperature 1, every output parses and validates
//! against its JSON schema; regexes and Lark grammars hold too; a
//! constraint that does not compile is refused before anything runs.

use mlxcel_engine::{GenerationOutput, GenerationRequest, Message, Prompt, SamplingParams, Speculation};
use mlxcel_tests::default_engine;
use serde_json::Value;

const SCHEMAS: [(&str, &str); 5] = [
    (
        "nested objects",
        r#"{"type":"object","properties":{"name":{"type":"string","maxLength":24},"address":{"type":"object","properties":{"city":{"type":"string","maxLength":24},"country":{"type":"string","maxLength":24}},"required":["city","country"],"additionalProperties":false}},"required":["name","address"],"additionalProperties":false}"#,
    ),
    (
        "arrays",
        r#"{"type":"object","properties":{"fruits":{"type":"array","items":{"type":"string","maxLength":16},"minItems":1,"maxItems":4},"counts":{"type":"array","items":{"type":"integer","minimum":0,"maximum":999},"maxItems":3}},"required":["fruits","counts"],"additionalProperties":false}"#,
    ),
    (
        "enums",
        r#"{"type":"object","properties":{"colour":{"enum":["red","green","blue"]},"size":{"type":"string","enum":["small","medium","large"]},"in_stock":{"type":"boolean"}},"required":["colour","size","in_stock"],"additionalProperties":false}"#,
    ),
    (
        "numbers",
        r#"{"type":"object","properties":{"age":{"type":"integer","minimum":0,"maximum":120},"height_m":{"type":"number","minimum":0.5,"maximum":2.5},"score":{"type":"number"}},"required":["age","height_m","score"],"additionalProperties":false}"#,
    ),
    (
        "strings with patterns",
        r#"{"type":"object","properties":{"email":{"type":"string","pattern":"^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},"date":{"type":"string","pattern":"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"},"code":{"type":"string","pattern":"^[A-Z]{3}-[0-9]{4}$"}},"required":["email","date","code"],"additionalProperties":false}"#,
    ),
];

fn request(prompt: &str, params: SamplingParams) -> GenerationRequest {
    GenerationRequest { params, ..GenerationRequest::new(Prompt::Chat(vec![Message::user(prompt.to_string())])) }
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 1.0, seed: Some(seed), max_tokens: 256, ..Default::default() }
}

#[test]
fn sampled_outputs_validate_against_their_schemas() {
    let engine = default_engine();
    for (what, schema) in SCHEMAS {
        let validator = jsonschema::validator_for(&serde_json::from_str(schema).unwrap()).unwrap();
        let requests: Vec<GenerationRequest> = (0..20)
            .map(|seed| request(&format!("Reply with a JSON object for a made-up example ({what})."), SamplingParams { json_schema: Some(schema.into()), ..sampled(seed) }))
            .collect();
        let outputs: Vec<GenerationOutput> = engine.generate_batch(&requests).into_iter().map(Result::unwrap).collect();
        for (seed, output) in outputs.iter().enumerate() {
            assert_eq!(output.finish_reason.as_str(), "stop", "{what}, seed {seed}: {:?}", output.text);
            let value: Value = serde_json::from_str(&output.text).unwrap_or_else(|e| panic!("{what}, seed {seed}: {e}: {:?}", output.text));
            let errors: Vec<String> = validator.iter_errors(&value).map(|e| e.to_string()).collect();
            assert!(errors.is_empty(), "{what}, seed {seed}: {} {errors:?}", output.text);
            assert!(output.stats.mask_time > std::time::Duration::ZERO);
            if seed < 2 {
                println!("{what}: {}", output.text);
            }
        }
        let distinct: std::collections::HashSet<&str> = outputs.iter().map(|o| o.text.as_str()).collect();
        assert!(distinct.len() > 1, "{what}: sampling at temperature 1 varies the output");
    }
}

#[test]
fn regexes_and_lark_grammars_hold() {
    let engine = default_engine();
    for seed in 0..8 {
        let out = engine
            .generate(&request("Make up a phone number.", SamplingParams { regex: Some(r"\(\d{3}\) \d{3}-\d{4}".into()), ..sampled(seed) }), |_| true)
            .unwrap();
        assert!(is_phone_number(&out.text), "{:?}", out.text);
        let lark = "start: greeting \" \" name \"!\"\ngreeting: \"Hello\" | \"Hi\"\nname: /[A-Z][a-z]{1,9}/";
        let out = engine.generate(&request("Greet someone.", SamplingParams { grammar: Some(lark.into()), ..sampled(seed) }), |_| true).unwrap();
        let (greeting, rest) = out.text.split_once(' ').unwrap_or_else(|| panic!("{:?}", out.text));
        assert!(["Hello", "Hi"].contains(&greeting) && rest.ends_with('!'), "{:?}", out.text);
        let name = &rest[..rest.len() - 1];
        assert!((2..=10).contains(&name.len()) && name.chars().next().unwrap().is_ascii_uppercase(), "{:?}", out.text);
        assert!(name.chars().skip(1).all(|c| c.is_ascii_lowercase()), "{:?}", out.text);
    }
}

/// `(ddd) ddd-dddd`, checked by hand.
fn is_phone_number(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 14 && b[0] == b'(' && b[4] == b')' && b[5] == b' ' && b[9] == b'-' && [1, 2, 3, 6, 7, 8, 10, 11, 12, 13].iter().all(|&i| b[i].is_ascii_digit())
}

/// Greedy constrained decoding gives the same tokens with prompt lookup,
/// beside unconstrained rows in one batch, and alone.
#[test]
fn constrained_rows_are_deterministic_in_batches_and_with_speculation() {
    let engine = default_engine();
    let (_, schema) = SCHEMAS[0];
    let greedy = SamplingParams { json_schema: Some(schema.into()), max_tokens: 128, ..Default::default() };
    let alone = engine.generate(&request("Describe a person as JSON.", greedy.clone()), |_| true).unwrap();
    let spec = engine
        .generate(&request("Describe a person as JSON.", SamplingParams { speculation: Speculation::PromptLookup, ..greedy.clone() }), |_| true)
        .unwrap();
    assert_eq!(spec.tokens, alone.tokens);
    let batch = engine.generate_batch(&[
        request("Tell me a joke.", SamplingParams { max_tokens: 40, ..Default::default() }),
        request("Describe a person as JSON.", greedy.clone()),
        request("Describe a person as JSON.", SamplingParams { temperature: 0.9, seed: Some(3), ..greedy.clone() }),
    ]);
    let batched = batch.into_iter().map(Result::unwrap).collect::<Vec<_>>();
    assert_eq!(batched[1].tokens, alone.tokens);
    serde_json::from_str::<Value>(&batched[2].text).unwrap();
}

#[test]
fn constraints_that_do_not_compile_are_refused_up_front() {
    let engine = default_engine();
    for (params, name) in [
        (SamplingParams { json_schema: Some("{\"type\": ".into()), ..Default::default() }, "json_schema"),
        (SamplingParams { json_schema: Some(r#"{"type": "object", "properties": {"a": {"type": "nope"}}}"#.into()), ..Default::default() }, "json_schema"),
        (SamplingParams { regex: Some("(unclosed".into()), ..Default::default() }, "regex"),
        (SamplingParams { grammar: Some("start: undefined_rule".into()), ..Default::default() }, "grammar"),
        (SamplingParams { regex: Some("a".into()), grammar: Some("start: \"a\"".into()), ..Default::default() }, "grammar"),
    ] {
        let err = engine.generate(&request("Hello", params), |_| panic!("nothing is generated")).unwrap_err().to_string();
        assert!(err.contains(name), "{err}");
    }
}
