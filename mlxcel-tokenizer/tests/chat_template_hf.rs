//! Chat templates rendered like transformers' `apply_chat_template` (jinja2 goldens + inline
//! templates in the style of well-known models).

use std::path::PathBuf;

use mlxcel_tokenizer::chat_template::{ChatTemplate, Message, RenderOptions};
use mlxcel_tokenizer::Error;
use serde::Serialize;
use serde_json::{json, Value};

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

fn render(source: &str, messages: &[Value], options: &RenderOptions) -> Result<String, Error> {
    ChatTemplate::new(source)?.render(messages, options)
}

/// Goldens from `tests/reference/chat_template_goldens.py` (Python jinja2 configured as
/// transformers does), including SmolLM2-135M-Instruct's real template.
#[test]
fn matches_jinja2_goldens() {
    let goldens: Value = serde_json::from_str(
        &std::fs::read_to_string(data_dir().join("chat_template_goldens.json")).unwrap(),
    )
    .unwrap();
    let cases = goldens["cases"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let template_file = case["template"].as_str().unwrap();
        let source = std::fs::read_to_string(data_dir().join(template_file)).unwrap();
        let template = ChatTemplate::new(source).unwrap();
        let options = RenderOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            tools: Some(case["tools"].clone()).filter(|t| !t.is_null()),
            bos_token: case["bos_token"].as_str().map(String::from),
            eos_token: case["eos_token"].as_str().map(String::from),
            ..Default::default()
        };
        let messages = case["messages"].as_array().unwrap();
        let rendered = template.render(messages, &options).unwrap();
        assert_eq!(
            rendered,
            case["expected"].as_str().unwrap(),
            "{template_file}: {}",
            case["name"]
        );
    }
}

#[test]
fn smollm2_inserts_default_system_prompt() {
    let source = std::fs::read_to_string(data_dir().join("smollm2_chat_template.jinja")).unwrap();
    let template = ChatTemplate::new(source).unwrap();
    let options = RenderOptions::with_generation_prompt(true);
    assert_eq!(
        template.render(&[Message::user("Hi")], &options).unwrap(),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        template
            .render(
                &[Message::system("Be brief."), Message::user("Hi")],
                &RenderOptions::default()
            )
            .unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
}

const LLAMA3_STYLE: &str = r#"{{- bos_token }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- if loop.last and add_generation_prompt %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
    {%- endif %}
{%- endfor %}
"#;

#[test]
fn llama3_style_bos_loop_and_trim() {
    let options = RenderOptions {
        add_generation_prompt: true,
        bos_token: Some("<|begin_of_text|>".into()),
        eos_token: Some("<|eot_id|>".into()),
        ..Default::default()
    };
    let messages = [
        json!({"role": "user", "content": "  Hi there \n"}),
        json!({"role": "assistant", "content": "Hello!"}),
        json!({"role": "user", "content": "Bye"}),
    ];
    assert_eq!(
        render(LLAMA3_STYLE, &messages, &options).unwrap(),
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[test]
fn raise_exception_becomes_a_chat_template_error() {
    let messages = [
        json!({"role": "user", "content": "a"}),
        json!({"role": "user", "content": "b"}),
    ];
    let err = render(LLAMA3_STYLE, &messages, &RenderOptions::default()).unwrap_err();
    let Error::ChatTemplate(message) = &err else {
        panic!("unexpected error {err:?}")
    };
    assert!(
        message.contains("Conversation roles must alternate user/assistant/user/assistant/..."),
        "{message}"
    );
    assert!(message.contains("line 4"), "{message}");
}

const QWEN_STYLE: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "system" and not tools %}
        {{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

#[test]
fn qwen_style_tools_and_tool_calls() {
    // Keys in sorted order so the result does not depend on serde_json's `preserve_order`.
    let tools = json!([{
        "function": {
            "description": "Weather in <city> & region",
            "name": "get_weather",
            "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}
        },
        "type": "function"
    }]);
    let messages = [
        json!({"role": "user", "content": "Weather in Zürich?"}),
        json!({"role": "assistant", "content": "", "tool_calls": [
            {"function": {"arguments": {"city": "Zürich", "unit": "°C"}, "name": "get_weather"}, "type": "function"}
        ]}),
        json!({"role": "tool", "content": "{\"temp\": 21.5}"}),
        json!({"role": "tool", "content": "sunny"}),
    ];
    let options = RenderOptions {
        add_generation_prompt: true,
        tools: Some(tools),
        ..Default::default()
    };
    assert_eq!(
        render(QWEN_STYLE, &messages, &options).unwrap(),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n<tools>\n\
         {\"function\": {\"description\": \"Weather in <city> & region\", \"name\": \"get_weather\", \"parameters\": \
         {\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"], \"type\": \"object\"}}, \"type\": \"function\"}\n\
         </tools><|im_end|>\n<|im_start|>user\nWeather in Zürich?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n\
         {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"unit\": \"°C\"}}\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\n{\"temp\": 21.5}\n</tool_response>\n<tool_response>\nsunny\n</tool_response><|im_end|>\n\
         <|im_start|>assistant\n"
    );
    // Without tools: `tools` is none, so the plain system prompt is used.
    assert_eq!(
        render(QWEN_STYLE, &[json!({"role": "user", "content": "Hi"})], &RenderOptions::default()).unwrap(),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn tojson_behaves_like_python_json_dumps() {
    let data = json!({"a": [1, 2.5, null, true], "b": "é<&>'\"\\\n\u{1}", "c": {}, "d": []});
    let options = RenderOptions {
        extra: vec![("data".into(), data)],
        ..Default::default()
    };
    let out = |source: &str| render(source, &[], &options).unwrap();
    assert_eq!(
        out("{{ data | tojson }}"),
        r#"{"a": [1, 2.5, null, true], "b": "é<&>'\"\\\n\u0001", "c": {}, "d": []}"#
    );
    assert_eq!(
        out("{{ data.b | tojson(ensure_ascii=True) }}"),
        r#""\u00e9<&>'\"\\\n\u0001""#
    );
    assert_eq!(
        out("{{ '😀' | tojson(ensure_ascii=True) }}"),
        r#""\ud83d\ude00""#
    );
    assert_eq!(
        out("{{ data.a | tojson(separators=(',', ':')) }}"),
        "[1,2.5,null,true]"
    );
    assert_eq!(
        out("{{ data | tojson(indent=2) }}"),
        "{\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"b\": \"é<&>'\\\"\\\\\\n\\u0001\",\n  \"c\": {},\n  \"d\": []\n}"
    );
    assert_eq!(
        out("{{ {'z': 1, 'a': 2} | tojson(sort_keys=true) }}"),
        r#"{"a": 2, "z": 1}"#
    );
    assert_eq!(
        out("{{ {'z': 1, 'a': 2} | tojson }}"),
        r#"{"z": 1, "a": 2}"#
    );
    assert_eq!(
        out("{{ 1e20 | tojson }} {{ 0.00001 | tojson }} {{ 3.0 | tojson }}"),
        "1e+20 1e-05 3.0"
    );
}

#[test]
fn struct_field_order_is_kept() {
    #[derive(Serialize)]
    struct ToolCall {
        name: &'static str,
        arguments: serde_json::Map<String, Value>,
    }
    let messages = [Message::user("Hi")];
    let call = ToolCall {
        name: "f",
        arguments: serde_json::Map::new(),
    };
    let options = RenderOptions {
        extra: vec![("call".into(), serde_json::to_value(&call).unwrap())],
        ..Default::default()
    };
    assert_eq!(
        ChatTemplate::new("{{ messages[0] | tojson }}")
            .unwrap()
            .render(&messages, &options)
            .unwrap(),
        r#"{"role": "user", "content": "Hi"}"#
    );
}

#[test]
fn missing_tools_and_documents_are_none() {
    let out = render(
        "{{ tools is none }} {{ documents is none }} {{ tools is defined }} {{ 'T' if tools else 'F' }} {{ add_generation_prompt }} [{{ bos_token }}]",
        &[],
        &RenderOptions::default(),
    )
    .unwrap();
    assert_eq!(out, "True True True F False []");
}

#[test]
fn values_print_like_python() {
    let source = r#"{{ tools is none }} {{ x }} {{ none }} {{ [1, 'a', none, true, 1.5, {'k': "it's"}] }} {{ 1e20 }} {{ 2.0 }}"#;
    assert_eq!(
        render(source, &[], &RenderOptions::default()).unwrap(),
        r#"True  None [1, 'a', None, True, 1.5, {'k': "it's"}] 1e+20 2.0"#
    );
}

#[test]
fn python_methods_and_whitespace_control() {
    let source = "{% for m in messages %}\n  {% if m.content.startswith('/') %}\n{{ m.content[1:].upper() }}\n  {% else %}\n{{- ' ' ~ m.content.split(',') | map('trim') | join('+') -}}\n  {% endif %}\n{% endfor %}\n{% for k, v in messages[0].items() %}{{ k }}={{ v.strip() }};{% endfor %}{{ messages[0].get('missing', 'dflt') }}";
    let messages = [
        json!({"content": " /cmd ", "role": "user"}),
        json!({"content": "a, b ,c", "role": "user"}),
        json!({"content": "/x y", "role": "user"}),
    ];
    // Without preserve_order serde_json sorts keys; the message keys above are already sorted.
    let out = render(source, &messages, &RenderOptions::default()).unwrap();
    assert_eq!(out, " /cmd a+b+cX Y\ncontent=/cmd;role=user;dflt");
}

#[test]
fn strftime_now_and_loop_controls() {
    let out = render(
        "{{ strftime_now('%Y-%m-%d') }}",
        &[],
        &RenderOptions::default(),
    )
    .unwrap();
    assert_eq!(out.len(), 10, "{out}");
    assert!(out.starts_with("20"), "{out}");
    let out = render(
        "{% for i in range(10) %}{% if i == 1 %}{% continue %}{% endif %}{% if i > 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
        &[],
        &RenderOptions::default(),
    )
    .unwrap();
    assert_eq!(out, "023");
}

#[test]
fn generation_blocks_render_their_body() {
    let source = "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}|{% endfor %}";
    let messages = [Message::user("q"), Message::assistant("a")];
    assert_eq!(
        ChatTemplate::new(source)
            .unwrap()
            .render(&messages, &RenderOptions::default())
            .unwrap(),
        "q|a|"
    );
}

#[test]
fn syntax_and_runtime_errors_carry_line_numbers() {
    let err = ChatTemplate::new("ok\n{% if %}").unwrap_err();
    let Error::ChatTemplate(message) = &err else {
        panic!("unexpected error {err:?}")
    };
    assert!(
        message.contains("syntax error") && message.contains("line 2"),
        "{message}"
    );

    let err = render(
        "a\nb\n{{ messages[0].content + 1 }}",
        &[json!({"content": "x"})],
        &RenderOptions::default(),
    )
    .unwrap_err();
    let Error::ChatTemplate(message) = &err else {
        panic!("unexpected error {err:?}")
    };
    assert!(message.contains("line 3"), "{message}");
}

#[test]
fn extra_variables_reach_the_template() {
    let options = RenderOptions {
        extra: vec![("enable_thinking".into(), json!(false))],
        ..Default::default()
    };
    let source = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}";
    assert_eq!(
        render(source, &[], &options).unwrap(),
        "<think>\n\n</think>"
    );
}

/// Content parts render as Hugging Face's list of typed parts, which
/// vision-language templates (SmolVLM's) loop over; plain text stays a string.
#[test]
fn content_parts_render_as_typed_lists() {
    use mlxcel_tokenizer::ContentPart;
    let source = "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}{% elif p.type == 'image' %}<image>{% endif %}{% endfor %}{% endif %}|{% endfor %}";
    let template = ChatTemplate::new(source).unwrap();
    let messages = [
        Message::system("Be brief."),
        Message::user(vec![ContentPart::image_path("a.png"), ContentPart::text("What is it?"), ContentPart::image_bytes(vec![1u8, 2])]),
    ];
    assert_eq!(template.render(&messages, &RenderOptions::default()).unwrap(), "Be brief.|<image>What is it?<image>|");
    assert_eq!(messages[1].content.images().count(), 2);
}
