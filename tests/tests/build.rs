//! Dockerfile builds (issue 12 item 3, decision 0018) through `space template build`: every
//! RUN in a sandbox of the build, each step cached, errors with their line numbers. Builds
//! start FROM `minimal` (busybox) so they need no network.

use std::path::Path;
use std::process::Output;

use space_tests::Spaced;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn write(dir: &Path, rel: &str, content: &str) {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, content).unwrap();
}

fn build(s: &Spaced, args: &[&str]) -> Output {
    let mut all = vec!["template", "build"];
    all.extend_from_slice(args);
    s.space(&all)
}

fn build_ok(s: &Spaced, args: &[&str]) -> String {
    let out = build(s, args);
    assert!(
        out.status.success(),
        "build {args:?} failed:\n{}\nspaced log:\n{}",
        text(&out.stderr),
        s.log_tail()
    );
    text(&out.stderr)
}

fn failed(out: &Output, want: &[&str]) {
    let err = text(&out.stderr);
    assert!(!out.status.success(), "expected a failure:\n{err}");
    for w in want {
        assert!(err.contains(w), "wanted {w:?} in:\n{err}");
    }
}

const DOCKERFILE: &str = r#"# a comment
FROM minimal
ARG GREETING=hello
ENV APP_HOME=/app \
    MODE=test
WORKDIR /app
COPY src/ ./src/
COPY . /all/
COPY run.sh /app/
RUN echo "$GREETING from RUN as $(id -u)" > /app/out.txt && cat /app/out.txt
RUN ls /app/src > /app/listing.txt
EXPOSE 8080
CMD ["sh", "/app/run.sh"]
"#;

fn context() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    write(d.path(), "Dockerfile", DOCKERFILE);
    write(d.path(), "src/a.txt", "A\n");
    write(d.path(), "src/b.txt", "B\n");
    write(d.path(), "run.sh", "echo running v1\n");
    write(d.path(), "secret.env", "TOKEN=do-not-send\n");
    write(d.path(), ".dockerignore", "secret.env\n*.tmp\n");
    write(d.path(), "junk.tmp", "x");
    d
}

#[test]
fn a_dockerfile_builds_runs_in_sandboxes_and_rebuilds_from_the_first_changed_step() {
    let s = Spaced::start().unwrap();
    let ctx = context();
    let c = ctx.path().to_str().unwrap();
    let log = build_ok(&s, &["app", c, "--build-arg", "GREETING=hi"]);
    assert!(log.contains("[1/11] FROM minimal"), "{log}");
    assert!(
        log.contains("  | hi from RUN as 0"),
        "a RUN's own output streams:\n{log}"
    );
    assert!(!log.contains("(cached)"), "{log}");

    let id = s.create(&["--template", "app"]);
    let (code, out, err) = s.sh(
        &id,
        "pwd; cat out.txt; echo $APP_HOME $MODE; cat listing.txt; ls -a /all; cat /app/run.sh",
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out,
        "/app\nhi from RUN as 0\n/app test\na.txt\nb.txt\n.\n..\n.dockerignore\nDockerfile\nrun.sh\nsrc\n\
         echo running v1\n",
        ".dockerignore keeps secret.env and *.tmp out of the context"
    );
    // The template's metadata.
    let list: serde_json::Value =
        serde_json::from_str(&s.space_ok(&["template", "ls", "--json"])).unwrap();
    assert!(
        list["templates"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| !t["name"].as_str().unwrap().starts_with("space-build-")),
        "build steps are not listed: {list}"
    );

    // Unchanged: every step is cached.
    let log = build_ok(&s, &["app", c, "--build-arg", "GREETING=hi", "--replace"]);
    assert_eq!(log.matches("(cached)").count(), 5, "{log}");
    // run.sh changed: only `COPY src/` stays cached (`COPY .` sends run.sh too).
    write(ctx.path(), "run.sh", "echo running v2\n");
    let log = build_ok(&s, &["app", c, "--build-arg", "GREETING=hi", "--replace"]);
    assert_eq!(log.matches("(cached)").count(), 1, "{log}");
    let id = s.create(&["--template", "app"]);
    assert_eq!(s.sh(&id, "cat /app/run.sh").1, "echo running v2\n");
    // --no-cache runs all of it.
    let log = build_ok(
        &s,
        &[
            "app",
            c,
            "--build-arg",
            "GREETING=hi",
            "--replace",
            "--no-cache",
        ],
    );
    assert_eq!(log.matches("(cached)").count(), 0, "{log}");
    // A taken name needs --replace.
    failed(&build(&s, &["app", c]), &["exists", "--replace"]);
}

#[test]
fn build_errors_name_the_line_and_keep_the_cached_steps() {
    let s = Spaced::start().unwrap();
    let ctx = tempfile::tempdir().unwrap();
    let c = ctx.path().to_str().unwrap();
    write(ctx.path(), "f.txt", "file\n");
    let cases: &[(&str, &[&str])] = &[
        (
            "FROM minimal\nRUN true\nBOGUS x\n",
            &["line 3", "unknown instruction BOGUS"],
        ),
        ("RUN true\n", &["line 1", "before FROM"]),
        (
            "FROM minimal\nCOPY ../outside /x\n",
            &["line 2", "outside the build context"],
        ),
        (
            "FROM minimal\nCOPY nothere /x\n",
            &["line 2", "not in the build context"],
        ),
        ("FROM minimal\nFROM minimal\n", &["line 2", "multi-stage"]),
        (
            "FROM 127.0.0.1:5999/nothing:1\n",
            &["cannot reach the registry"],
        ),
    ];
    for (df, want) in cases {
        write(ctx.path(), "Dockerfile", df);
        failed(&build(&s, &["bad", c, "--insecure"]), want);
    }
    failed(&build(&s, &["bad", "/no/such/dir"]), &["build context"]);
    failed(&build(&s, &["Bad Name", c]), &["invalid template name"]);

    // A RUN that fails: its exit code and last output; the steps before it stay cached.
    write(
        ctx.path(),
        "Dockerfile",
        "FROM minimal\nCOPY f.txt /f.txt\nRUN echo first; echo boom >&2; exit 3\n",
    );
    failed(&build(&s, &["bad", c]), &["line 3", "exit code 3", "boom"]);
    write(
        ctx.path(),
        "Dockerfile",
        "FROM minimal\nCOPY f.txt /f.txt\nRUN cat /f.txt\n",
    );
    let log = build_ok(&s, &["good", c]);
    assert_eq!(log.matches("(cached)").count(), 1, "{log}");
    let list = s.space_ok(&["template", "ls"]);
    assert!(
        !list.contains("bad"),
        "no template is left half-made: {list}"
    );
    // No build sandbox is left behind.
    let ls: serde_json::Value = serde_json::from_str(&s.space_ok(&["ls", "--json"])).unwrap();
    let n = ls
        .as_array()
        .or_else(|| ls["sandboxes"].as_array())
        .map_or(0, |a| a.len());
    assert_eq!(n, 0, "build sandboxes are removed: {ls}");
}
