//! A Dockerfile parser for single-stage builds (decision 0018): FROM, RUN, COPY, ADD, ENV,
//! ARG, WORKDIR, USER, LABEL, ENTRYPOINT, CMD and SHELL; EXPOSE, VOLUME, STOPSIGNAL,
//! HEALTHCHECK and MAINTAINER are accepted and noted as ignored. Line continuations,
//! comments, JSON (exec) forms, quoting and `$VAR` / `${VAR}` / `${VAR:-x}` / `${VAR:+x}`
//! substitution follow Docker's rules; every error names its line.

use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Dockerfile line {line}: {message}")]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

/// A command: `RUN x y` (shell form, run by the SHELL) or `RUN ["x", "y"]` (exec form).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Shell(String),
    Exec(Vec<String>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Instruction {
    From(String),
    Run(Command),
    /// COPY or ADD (`add`): sources relative to the context, a destination in the image.
    Copy {
        srcs: Vec<String>,
        dest: String,
        chown: Option<String>,
        chmod: Option<u32>,
        add: bool,
    },
    Env(Vec<(String, String)>),
    Arg(String, Option<String>),
    Workdir(String),
    User(String),
    Label(Vec<(String, String)>),
    Entrypoint(Command),
    Cmd(Command),
    Shell(Vec<String>),
    /// Accepted, has no effect here (EXPOSE, VOLUME, ...): the keyword.
    Ignored(String),
}

/// One instruction with its first line and its text (the cache key's part).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub line: usize,
    pub text: String,
    pub instruction: Instruction,
}

fn err(line: usize, message: impl Into<String>) -> ParseError {
    ParseError {
        line,
        message: message.into(),
    }
}

/// The logical lines: continuations joined, comments and blank lines dropped.
fn logical_lines(src: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut cur: Option<(usize, String)> = None;
    for (i, raw) in src.lines().enumerate() {
        let n = i + 1;
        let trimmed = raw.trim_start();
        if trimmed.starts_with('#') || (trimmed.is_empty() && cur.is_none()) {
            continue;
        }
        let (body, cont) = match raw.trim_end().strip_suffix('\\') {
            Some(b) => (b.to_string(), true),
            None => (raw.to_string(), false),
        };
        match &mut cur {
            Some((_, acc)) => acc.push_str(&body),
            None => cur = Some((n, body)),
        }
        if !cont && let Some(done) = cur.take() {
            out.push(done);
        }
    }
    if let Some(done) = cur {
        out.push(done);
    }
    out
}

/// Substitutes `$NAME`, `${NAME}`, `${NAME:-word}` and `${NAME:+word}` from `vars`; `\$` is a
/// literal `$`. Unknown names are empty, as in Docker.
pub fn substitute(
    s: &str,
    vars: &BTreeMap<String, String>,
    line: usize,
) -> Result<String, ParseError> {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' && chars.peek() == Some(&'$') {
            out.push('$');
            chars.next();
            continue;
        }
        if c != '$' {
            out.push(c);
            continue;
        }
        if chars.peek() == Some(&'{') {
            chars.next();
            let mut inner = String::new();
            loop {
                match chars.next() {
                    Some('}') => break,
                    Some(c) => inner.push(c),
                    None => return Err(err(line, format!("unterminated ${{ in {s:?}"))),
                }
            }
            let (name, op) = match inner.find(':') {
                Some(i) => (&inner[..i], Some(&inner[i..])),
                None => (inner.as_str(), None),
            };
            let val = vars.get(name).filter(|v| !v.is_empty());
            match op {
                None => out.push_str(val.map_or("", |v| v.as_str())),
                Some(o) if o.starts_with(":-") => {
                    out.push_str(val.map_or(&o[2..], |v| v.as_str()));
                }
                Some(o) if o.starts_with(":+") => {
                    if val.is_some() {
                        out.push_str(&o[2..]);
                    }
                }
                Some(o) => {
                    return Err(err(
                        line,
                        format!("unsupported substitution ${{{name}{o}}}"),
                    ));
                }
            }
        } else {
            let mut name = String::new();
            while let Some(&c) = chars.peek() {
                if c.is_ascii_alphanumeric() || c == '_' {
                    name.push(c);
                    chars.next();
                } else {
                    break;
                }
            }
            if name.is_empty() {
                out.push('$');
            } else {
                out.push_str(vars.get(&name).map_or("", |v| v.as_str()));
            }
        }
    }
    Ok(out)
}

/// Splits on whitespace, honouring single and double quotes and backslash escapes.
fn words(s: &str, line: usize) -> Result<Vec<String>, ParseError> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' | '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some(q) if q == c => break,
                        Some('\\') if c == '"' => {
                            if let Some(n) = chars.next() {
                                cur.push(n);
                            }
                        }
                        Some(x) => cur.push(x),
                        None => return Err(err(line, format!("unterminated quote in {s:?}"))),
                    }
                }
            }
            '\\' => {
                in_word = true;
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

/// `["a", "b"]` when `s` is a JSON array of strings.
fn json_array(s: &str) -> Option<Vec<String>> {
    let t = s.trim();
    if !t.starts_with('[') {
        return None;
    }
    serde_json::from_str::<Vec<String>>(t).ok()
}

fn command(args: &str, line: usize, what: &str) -> Result<Command, ParseError> {
    if let Some(v) = json_array(args) {
        if v.is_empty() {
            return Err(err(line, format!("{what} has an empty command")));
        }
        return Ok(Command::Exec(v));
    }
    if args.trim().is_empty() {
        return Err(err(line, format!("{what} needs a command")));
    }
    Ok(Command::Shell(args.trim().to_string()))
}

/// `K=V K2="v 2"`, or the legacy `K value with spaces`.
fn pairs(args: &str, line: usize, what: &str) -> Result<Vec<(String, String)>, ParseError> {
    let ws = words(args, line)?;
    if ws.is_empty() {
        return Err(err(line, format!("{what} needs KEY=VALUE")));
    }
    if !ws[0].contains('=') {
        if what == "LABEL" {
            return Err(err(line, "LABEL needs KEY=VALUE"));
        }
        let mut it = args.trim().splitn(2, char::is_whitespace);
        let k = it.next().unwrap_or_default().to_string();
        let v = it.next().unwrap_or_default().trim().to_string();
        return Ok(vec![(k, v)]);
    }
    ws.into_iter()
        .map(|w| match w.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(err(line, format!("{what}: {w:?} is not KEY=VALUE"))),
        })
        .collect()
}

/// Parses `src` with `build_args` (`--build-arg`) for ARG values.
pub fn parse(src: &str, build_args: &BTreeMap<String, String>) -> Result<Vec<Step>, ParseError> {
    let mut steps = Vec::new();
    // What `$VAR` means at each point: ARGs (declared, with --build-arg values), then ENVs.
    let mut vars: BTreeMap<String, String> = BTreeMap::new();
    let mut seen_from = false;
    for (line, text) in logical_lines(src) {
        let text = text.trim().to_string();
        let (kw, args) = match text.find(char::is_whitespace) {
            Some(i) => (&text[..i], text[i..].trim_start()),
            None => (text.as_str(), ""),
        };
        let kw = kw.to_ascii_uppercase();
        if !seen_from && kw != "FROM" && kw != "ARG" {
            return Err(err(
                line,
                format!("{kw} before FROM: a Dockerfile starts with FROM"),
            ));
        }
        let sub = |s: &str, vars: &BTreeMap<String, String>| substitute(s, vars, line);
        let instruction = match kw.as_str() {
            "FROM" => {
                if seen_from {
                    return Err(err(
                        line,
                        "a second FROM: multi-stage builds are not supported",
                    ));
                }
                let ws = words(&sub(args, &vars)?, line)?;
                match ws.as_slice() {
                    [image] => {
                        seen_from = true;
                        Instruction::From(image.clone())
                    }
                    [_, as_kw, _] if as_kw.eq_ignore_ascii_case("as") => {
                        seen_from = true;
                        Instruction::From(ws[0].clone())
                    }
                    [] => return Err(err(line, "FROM needs an image or template")),
                    _ => return Err(err(line, format!("FROM takes one image, got {args:?}"))),
                }
            }
            "RUN" => {
                if args.starts_with("--") {
                    return Err(err(line, format!("RUN flags are not supported: {args:?}")));
                }
                Instruction::Run(command(args, line, "RUN")?)
            }
            "CMD" => Instruction::Cmd(command(args, line, "CMD")?),
            "ENTRYPOINT" => Instruction::Entrypoint(command(args, line, "ENTRYPOINT")?),
            "SHELL" => match json_array(args) {
                Some(v) if !v.is_empty() => Instruction::Shell(v),
                _ => {
                    return Err(err(
                        line,
                        "SHELL takes a JSON array, e.g. [\"/bin/bash\", \"-c\"]",
                    ));
                }
            },
            "COPY" | "ADD" => {
                let mut rest: Vec<String> = match json_array(args) {
                    Some(v) => v,
                    None => words(args, line)?,
                };
                let (mut chown, mut chmod) = (None, None);
                while rest.first().is_some_and(|w| w.starts_with("--")) {
                    let flag = rest.remove(0);
                    match flag.split_once('=') {
                        Some(("--chown", v)) if !v.is_empty() => chown = Some(sub(v, &vars)?),
                        Some(("--chmod", v)) => {
                            chmod = Some(u32::from_str_radix(v, 8).map_err(|_| {
                                err(line, format!("--chmod={v} is not an octal mode"))
                            })?)
                        }
                        Some(("--from", _)) => {
                            return Err(err(
                                line,
                                format!("{kw} --from: multi-stage builds are not supported"),
                            ));
                        }
                        _ => return Err(err(line, format!("{kw}: unknown flag {flag}"))),
                    }
                }
                if rest.len() < 2 {
                    return Err(err(line, format!("{kw} needs a source and a destination")));
                }
                let dest = sub(&rest.pop().unwrap_or_default(), &vars)?;
                let srcs = rest
                    .iter()
                    .map(|s| sub(s, &vars))
                    .collect::<Result<Vec<_>, _>>()?;
                if let Some(u) = srcs.iter().find(|s| s.contains("://")) {
                    return Err(err(
                        line,
                        format!(
                            "{kw} of a URL ({u}) is not supported: builds read only the context"
                        ),
                    ));
                }
                Instruction::Copy {
                    srcs,
                    dest,
                    chown,
                    chmod,
                    add: kw == "ADD",
                }
            }
            "ENV" => {
                let ps = pairs(&sub(args, &vars)?, line, "ENV")?;
                for (k, v) in &ps {
                    vars.insert(k.clone(), v.clone());
                }
                Instruction::Env(ps)
            }
            "LABEL" | "MAINTAINER" => {
                if kw == "MAINTAINER" {
                    Instruction::Label(vec![("maintainer".into(), args.trim().to_string())])
                } else {
                    Instruction::Label(pairs(&sub(args, &vars)?, line, "LABEL")?)
                }
            }
            "ARG" => {
                let ws = words(args, line)?;
                let [one] = ws.as_slice() else {
                    return Err(err(line, "ARG takes one NAME or NAME=default"));
                };
                let (name, default) = match one.split_once('=') {
                    Some((n, d)) => (n.to_string(), Some(sub(d, &vars)?)),
                    None => (one.clone(), None),
                };
                if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    return Err(err(line, format!("ARG name {name:?} is not valid")));
                }
                if let Some(v) = build_args.get(&name).or(default.as_ref()) {
                    vars.entry(name.clone()).or_insert_with(|| v.clone());
                }
                Instruction::Arg(name, default)
            }
            "WORKDIR" => {
                let d = sub(args.trim(), &vars)?;
                if d.is_empty() {
                    return Err(err(line, "WORKDIR needs a directory"));
                }
                Instruction::Workdir(d)
            }
            "USER" => {
                let u = sub(args.trim(), &vars)?;
                if u.is_empty() || u.contains(char::is_whitespace) {
                    return Err(err(line, "USER takes one user[:group]"));
                }
                Instruction::User(u)
            }
            "EXPOSE" | "VOLUME" | "STOPSIGNAL" | "HEALTHCHECK" | "ONBUILD" => {
                Instruction::Ignored(kw.clone())
            }
            other => return Err(err(line, format!("unknown instruction {other}"))),
        };
        steps.push(Step {
            line,
            text: format!("{kw} {args}").trim().to_string(),
            instruction,
        });
    }
    if !seen_from {
        return Err(err(1, "no FROM: a Dockerfile starts with FROM"));
    }
    // Build args nobody declared are a mistake worth naming.
    let declared: Vec<&String> = steps
        .iter()
        .filter_map(|s| match &s.instruction {
            Instruction::Arg(n, _) => Some(n),
            _ => None,
        })
        .collect();
    if let Some(k) = build_args.keys().find(|k| !declared.contains(k)) {
        return Err(err(
            1,
            format!("--build-arg {k} is not declared by any ARG"),
        ));
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(src: &str) -> Result<Vec<Step>, ParseError> {
        parse(src, &BTreeMap::new())
    }

    #[test]
    fn every_instruction_parses() {
        let src = "# syntax=docker/dockerfile:1\nARG BASE=minimal\nFROM $BASE\n\
                   ENV A=1 B=\"two words\"\nENV LEGACY value with spaces\n\
                   RUN echo $A && \\\n    echo done\nRUN [\"/bin/sh\", \"-c\", \"true\"]\n\
                   COPY --chown=1000 --chmod=640 a b /dst/\nADD [\"x y\", \"/z\"]\n\
                   WORKDIR /app/${A}\nUSER 1000:1000\nLABEL k=v\nEXPOSE 80\n\
                   SHELL [\"/bin/bash\", \"-c\"]\nENTRYPOINT [\"/bin/app\"]\nCMD serve --port 8\n";
        let s = p(src).unwrap();
        let ins: Vec<&Instruction> = s.iter().map(|s| &s.instruction).collect();
        assert_eq!(ins[1], &Instruction::From("minimal".into()));
        assert_eq!(
            ins[2],
            &Instruction::Env(vec![
                ("A".into(), "1".into()),
                ("B".into(), "two words".into())
            ])
        );
        assert_eq!(
            ins[3],
            &Instruction::Env(vec![("LEGACY".into(), "value with spaces".into())])
        );
        assert_eq!(
            ins[4],
            &Instruction::Run(Command::Shell("echo $A &&     echo done".into())),
            "RUN text is left to the shell"
        );
        assert_eq!(s[4].line, 6);
        assert_eq!(
            ins[6],
            &Instruction::Copy {
                srcs: vec!["a".into(), "b".into()],
                dest: "/dst/".into(),
                chown: Some("1000".into()),
                chmod: Some(0o640),
                add: false
            }
        );
        assert!(matches!(ins[7], Instruction::Copy { add: true, .. }));
        assert_eq!(ins[8], &Instruction::Workdir("/app/1".into()));
        assert_eq!(ins[9], &Instruction::User("1000:1000".into()));
        assert_eq!(ins[11], &Instruction::Ignored("EXPOSE".into()));
        assert_eq!(
            ins[14],
            &Instruction::Cmd(Command::Shell("serve --port 8".into()))
        );
    }

    #[test]
    fn build_args_override_defaults_and_must_be_declared() {
        let mut args = BTreeMap::new();
        args.insert("V".to_string(), "9".to_string());
        let s = parse("FROM minimal\nARG V=1\nENV X=$V\n", &args).unwrap();
        assert_eq!(
            s[2].instruction,
            Instruction::Env(vec![("X".into(), "9".into())])
        );
        args.insert("NOPE".into(), "1".into());
        let e = parse("FROM minimal\nARG V\n", &args).unwrap_err();
        assert!(e.message.contains("NOPE"), "{e}");
    }

    #[test]
    fn errors_name_their_line() {
        for (src, line, want) in [
            ("RUN true\n", 1, "before FROM"),
            ("FROM a\n\nBOGUS x\n", 3, "unknown instruction BOGUS"),
            ("FROM a\nFROM b\n", 2, "multi-stage"),
            ("FROM a\nCOPY only\n", 2, "source and a destination"),
            ("FROM a\nCOPY --from=x a b\n", 2, "multi-stage"),
            ("FROM a\nENV A=\"unterminated\n", 2, "unterminated quote"),
            ("FROM a\nADD https://x/y /z\n", 2, "URL"),
            ("FROM a\nRUN\n", 2, "needs a command"),
            ("FROM a\nSHELL bash\n", 2, "JSON array"),
            ("# only a comment\n", 1, "no FROM"),
            ("FROM a\nWORKDIR ${X\n", 2, "unterminated"),
        ] {
            let e = p(src).unwrap_err();
            assert_eq!(e.line, line, "{src:?}: {e}");
            assert!(e.message.contains(want), "{src:?}: {e}");
        }
    }

    #[test]
    fn substitution_forms() {
        let mut v = BTreeMap::new();
        v.insert("A".to_string(), "x".to_string());
        let s = |t: &str| substitute(t, &v, 1).unwrap();
        assert_eq!(
            s("$A/${A}/${B:-d}/${A:+set}/${B:+no}/\\$A"),
            "x/x/d/set//$A"
        );
    }
}
