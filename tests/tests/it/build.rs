//! Dockerfile builds (issue 12 item 3, decision 0018) through `space template build`: every
//! RUN in a sandbox of the build, each step cached, errors with their line numbers. Builds
//! start FROM `minimal` (busybox) so they need no network.

use std::path::Path;
use std::process::Output;

use space_tests::{Spaced, quantile};

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

#[test]
fn a_base_with_a_start_command_is_built_on_without_running_it() {
    let s = Spaced::start().unwrap();
    s.space_ok(&[
        "template",
        "set",
        "minimal",
        "--start-cmd",
        "touch /started; exec sleep 100000",
        "--ready-cmd",
        "test -e /started",
    ]);
    let ctx = tempfile::tempdir().unwrap();
    write(
        ctx.path(),
        "Dockerfile",
        "FROM minimal\nRUN test ! -e /started && echo clean > /built\n",
    );
    build_ok(&s, &["svc", ctx.path().to_str().unwrap()]);
    let id = s.create(&["--template", "svc"]);
    let (code, out, err) = s.sh(&id, "cat /built; test -e /started && echo started");
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out, "clean\nstarted\n",
        "no build step ran the start command; the result runs it"
    );
}

/// `cargo test -p space-tests --test it -- --ignored --nocapture build::rebuild_bench`: a
/// ten-step Dockerfile (FROM minimal; RUN, COPY, ENV, WORKDIR) built once, then rebuilt
/// ROUNDS times with only its last step (a RUN) changed. Reports the wall time of `space
/// template build` and that time minus the changed step's own (the server's `step N took`).
#[test]
#[ignore]
fn rebuild_bench() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(10);
    let s = Spaced::start_with(&["--network", "off"]).unwrap();
    let ctx = tempfile::tempdir().unwrap();
    write(ctx.path(), "f1", &"one\n".repeat(1000));
    write(ctx.path(), "f2", &"two\n".repeat(1000));
    let dockerfile = |last: &str| {
        format!(
            "FROM minimal\nENV A=1\nRUN echo 1 > /s1\nRUN echo 2 > /s2\nCOPY f1 /f1\n\
             RUN echo 3 > /s3\nWORKDIR /w\nRUN echo 4 > /s4\nCOPY f2 /f2\nRUN echo {last} > /last\n"
        )
    };
    let c = ctx.path().to_str().unwrap().to_string();
    write(ctx.path(), "Dockerfile", &dockerfile("first"));
    let t0 = std::time::Instant::now();
    build_ok(&s, &["b", &c, "--egress", "none"]);
    let first = t0.elapsed().as_secs_f64();
    let (mut total, mut overhead) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        write(ctx.path(), "Dockerfile", &dockerfile(&format!("round-{r}")));
        let t0 = std::time::Instant::now();
        let log = build_ok(&s, &["b", &c, "--egress", "none", "--replace"]);
        let wall = t0.elapsed().as_secs_f64();
        assert_eq!(log.matches("(cached)").count(), 6, "{log}");
        let step: f64 = log
            .lines()
            .find_map(|l| l.strip_prefix("note: step 10 took "))
            .and_then(|t| t.trim_end_matches(" s").parse().ok())
            .unwrap_or_else(|| panic!("no step time in:\n{log}"));
        total.push(wall);
        overhead.push(wall - step);
    }
    eprintln!("first build of 10 steps: {first:.2} s");
    for (what, v) in [
        ("rebuild, last step changed", &total),
        ("  minus that step's own time", &overhead),
    ] {
        eprintln!(
            "{what}: p50 {:.3} s, p90 {:.3} s, p99 {:.3} s ({} rounds)",
            quantile(v, 0.5),
            quantile(v, 0.9),
            quantile(v, 0.99),
            v.len()
        );
    }
}
