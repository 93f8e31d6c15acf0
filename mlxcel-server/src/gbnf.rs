//! llama-server's `grammar` field is GBNF; the engine's grammars are Lark
//! (llguidance's dialect). A grammar with `::=` rules is translated rule for
//! rule; anything else is passed on as Lark.

/// `grammar` as Lark: translated when it is GBNF, else as given.
pub fn to_lark_if_gbnf(grammar: &str) -> Result<String, String> {
    if grammar.contains("::=") {
        gbnf_to_lark(grammar)
    } else {
        Ok(grammar.to_string())
    }
}

#[derive(Debug, PartialEq)]
enum Token {
    Name(String),
    Define,
    Literal(String),
    Class(String),
    Any,
    Symbol(char),
    Repeat(String),
}

fn rule_name(name: &str) -> String {
    if name == "root" {
        "start".into()
    } else {
        format!("g_{}", name.to_ascii_lowercase().replace('-', "_"))
    }
}

/// One escape after `\` in a GBNF literal or class: the character it stands for.
fn escape(chars: &mut std::iter::Peekable<std::str::Chars>) -> Result<char, String> {
    let c = chars.next().ok_or("a `\\` at the end of the grammar")?;
    let hex = |chars: &mut std::iter::Peekable<std::str::Chars>, n: usize| -> Result<char, String> {
        let digits: String = (0..n).filter_map(|_| chars.next()).collect();
        u32::from_str_radix(&digits, 16).ok().and_then(char::from_u32).ok_or_else(|| format!("bad escape `\\{c}{digits}`"))
    };
    Ok(match c {
        'n' => '\n',
        'r' => '\r',
        't' => '\t',
        'x' => hex(chars, 2)?,
        'u' => hex(chars, 4)?,
        'U' => hex(chars, 8)?,
        other => other,
    })
}

fn tokens(source: &str) -> Result<Vec<Token>, String> {
    let mut out = Vec::new();
    let mut chars = source.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            c if c.is_whitespace() => {
                chars.next();
            }
            '#' => {
                while chars.next().is_some_and(|c| c != '\n') {}
            }
            ':' => {
                let op: String = chars.by_ref().take(3).collect();
                if op != "::=" {
                    return Err(format!("expected `::=`, found `{op}`"));
                }
                out.push(Token::Define);
            }
            '"' => {
                chars.next();
                let mut text = String::new();
                loop {
                    match chars.next().ok_or("an unterminated string literal")? {
                        '"' => break,
                        '\\' => text.push(escape(&mut chars)?),
                        c => text.push(c),
                    }
                }
                out.push(Token::Literal(text));
            }
            '[' => {
                chars.next();
                let mut class = String::from("[");
                loop {
                    match chars.next().ok_or("an unterminated character class")? {
                        ']' => break,
                        '\\' => {
                            let c = escape(&mut chars)?;
                            class.push_str(&regex_char(c));
                        }
                        '/' => class.push_str("\\/"),
                        c @ ('[' | '&' | '~') => {
                            class.push('\\');
                            class.push(c);
                        }
                        c => class.push(c),
                    }
                }
                class.push(']');
                out.push(Token::Class(class));
            }
            '{' => {
                chars.next();
                let repeat: String = chars.by_ref().take_while(|&c| c != '}').collect();
                out.push(Token::Repeat(format!("{{{}}}", repeat.replace(' ', ""))));
            }
            '.' => {
                chars.next();
                out.push(Token::Any);
            }
            '(' | ')' | '|' | '*' | '+' | '?' => {
                chars.next();
                out.push(Token::Symbol(c));
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let mut name = String::new();
                while let Some(&c) = chars.peek().filter(|c| c.is_ascii_alphanumeric() || **c == '-' || **c == '_') {
                    name.push(c);
                    chars.next();
                }
                out.push(Token::Name(name));
            }
            other => return Err(format!("unexpected character {other:?}")),
        }
    }
    Ok(out)
}

/// A character as it stands inside a regex character class.
fn regex_char(c: char) -> String {
    match c {
        '\\' | ']' | '[' | '^' | '-' | '/' | '&' | '~' => format!("\\{c}"),
        c if c.is_control() => format!("\\x{{{:x}}}", c as u32),
        c => c.to_string(),
    }
}

/// GBNF (llama.cpp's grammar format) as a Lark grammar; `root` becomes `start`.
pub fn gbnf_to_lark(source: &str) -> Result<String, String> {
    let tokens = tokens(source).map_err(|e| format!("not a valid GBNF grammar: {e}"))?;
    let mut lark = String::new();
    let mut has_root = false;
    for (i, token) in tokens.iter().enumerate() {
        match token {
            Token::Name(name) if tokens.get(i + 1) == Some(&Token::Define) => {
                has_root |= name == "root";
                if !lark.is_empty() {
                    lark.push('\n');
                }
                lark.push_str(&rule_name(name));
            }
            Token::Name(name) => {
                lark.push(' ');
                lark.push_str(&rule_name(name));
            }
            Token::Define => lark.push(':'),
            Token::Literal(text) => {
                lark.push(' ');
                lark.push_str(&serde_json::to_string(text).expect("a string serializes"));
            }
            Token::Class(class) => {
                lark.push_str(" /");
                lark.push_str(class);
                lark.push('/');
            }
            Token::Any => lark.push_str(" /(?s:.)/"),
            Token::Symbol(c @ ('*' | '+' | '?' | ')')) => lark.push(*c),
            Token::Symbol(c) => {
                lark.push(' ');
                lark.push(*c);
            }
            Token::Repeat(r) => lark.push_str(r),
        }
    }
    if !has_root {
        return Err("not a valid GBNF grammar: it has no `root` rule".into());
    }
    lark.push('\n');
    Ok(lark)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translates_rules_literals_classes_and_repeats() {
        let gbnf = r#"
# a comment
root ::= "yes" | "no" | answer-list
answer-list ::= "[" [a-z\-]+ ("," ws [0-9]{1,3})* "]"
ws ::= [ \t\n]*
"#;
        let lark = gbnf_to_lark(gbnf).unwrap();
        assert_eq!(
            lark,
            "start: \"yes\" | \"no\" | g_answer_list\ng_answer_list: \"[\" /[a-z\\-]/+ ( \",\" g_ws /[0-9]/{1,3})* \"]\"\ng_ws: /[ \\x{9}\\x{a}]/*\n"
        );
    }

    #[test]
    fn lark_passes_through_and_bad_gbnf_is_refused() {
        assert_eq!(to_lark_if_gbnf("start: \"a\"").unwrap(), "start: \"a\"");
        assert!(gbnf_to_lark("item ::= \"a\"").unwrap_err().contains("no `root` rule"));
        assert!(gbnf_to_lark("root ::= \"a").unwrap_err().contains("unterminated string"));
    }
}
