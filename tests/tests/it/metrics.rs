//! `GET /metrics` against a real spaced: after creates, an exec, a snapshot and a 404, the
//! text parses with a Prometheus text parser and shows what was done.

use prometheus_parse::{LineInfo, Sample, Scrape, Value};
use reqwest::Method;
use space_tests::Spaced;

fn scrape(s: &Spaced) -> (String, Scrape) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (status, ctype, text) = rt.block_on(async {
        let r = s.req(Method::GET, "/metrics").send().await.unwrap();
        let ctype = r
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_string());
        (r.status().as_u16(), ctype, r.text().await.unwrap())
    });
    assert_eq!(status, 200, "{text}");
    assert_eq!(ctype.as_deref(), Some("text/plain; version=0.0.4"));
    // The parser skips what it cannot read: require that every line is something it reads.
    for line in text.lines() {
        assert!(
            !matches!(LineInfo::parse(line), LineInfo::Ignored | LineInfo::Empty),
            "not exposition format: {line:?}"
        );
    }
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    (text, scrape)
}

fn find<'a>(sc: &'a Scrape, name: &str, label: Option<(&str, &str)>) -> Option<&'a Sample> {
    sc.samples
        .iter()
        .find(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
}

fn number(sc: &Scrape, name: &str, label: Option<(&str, &str)>) -> f64 {
    match find(sc, name, label).map(|s| &s.value) {
        Some(Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v)) => *v,
        other => panic!("{name} {label:?}: {other:?}"),
    }
}

/// Checks the histogram `name` (cumulative buckets ending in +Inf, `_count` equal to the
/// +Inf bucket) and returns (count, sum).
fn histogram(sc: &Scrape, name: &str) -> (f64, f64) {
    let Some(Value::Histogram(buckets)) = find(sc, name, None).map(|s| &s.value) else {
        panic!("{name} is not a histogram");
    };
    assert_eq!(buckets.len(), 14, "{name}: {buckets:?}");
    assert!(
        buckets
            .windows(2)
            .all(|w| w[0].less_than < w[1].less_than && w[0].count <= w[1].count),
        "{name}: {buckets:?}"
    );
    let inf = buckets.last().unwrap();
    assert_eq!(inf.less_than, f64::INFINITY);
    let count = number(sc, &format!("{name}_count"), None);
    assert_eq!(count, inf.count, "{name}");
    (count, number(sc, &format!("{name}_sum"), None))
}

#[test]
fn metrics_show_what_was_done() {
    let s = Spaced::start().unwrap();
    let a = s.create(&[]);
    let _b = s.create(&[]);
    let (code, out, err) = s.sh(&a, "echo hi");
    assert_eq!((code, out.as_str()), (0, "hi\n"), "{err}");
    s.space_ok(&["snapshot", &a]);
    let (status, body) = s.call(Method::GET, "/v1/sandboxes/aaaaaaaaaaaaaaaaaaaa", None);
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("not_found"))
    );

    let (text, sc) = scrape(&s);
    let ctx = |what: &str| format!("{what}\n{text}");

    assert!(number(&sc, "space_sandboxes_created_total", None) >= 2.0);
    assert!(number(&sc, "space_execs_total", None) >= 1.0);
    assert!(number(&sc, "space_http_requests_total", None) >= 5.0);
    assert_eq!(
        number(&sc, "space_sandboxes", Some(("state", "running"))),
        2.0
    );
    assert!(
        number(&sc, "space_http_errors_total", Some(("code", "not_found"))) >= 1.0,
        "{}",
        ctx("404 counted")
    );

    let (n, sum) = histogram(&sc, "space_sandbox_create_seconds");
    assert!(n >= 2.0, "{}", ctx("creates timed"));
    // Plausible: each create took some time, and not minutes.
    assert!(sum > 0.0 && sum < 60.0 * n, "{}", ctx("create sum"));
    let (n, sum) = histogram(&sc, "space_exec_seconds");
    assert!(n >= 1.0 && sum > 0.0, "{}", ctx("exec timed"));
    let (n, sum) = histogram(&sc, "space_snapshot_seconds");
    assert!(n >= 1.0 && sum > 0.0, "{}", ctx("snapshot timed"));

    // The node's slot pool: both sandboxes hold a slot, each taken as a hit or a miss.
    // (and so do the warm pool's ready sandboxes).
    // A ready sandbox being built may or may not hold its slot yet.
    let ready = number(&sc, "space_pool_ready", Some(("template", "minimal")));
    let starting = number(&sc, "space_pool_starting", Some(("template", "minimal")));
    let attached = number(&sc, "space_net_slots_attached", None);
    assert!(
        (2.0 + ready..=2.0 + ready + starting).contains(&attached),
        "{}",
        ctx("slots attached")
    );
    assert!(
        number(&sc, "space_pool_hits_total", Some(("template", "minimal"))) >= 1.0,
        "{}",
        ctx("pool hits")
    );
    assert!(number(&sc, "space_pool_target", Some(("template", "minimal"))) >= 4.0);
    assert!(number(&sc, "space_net_slots_ready", None) >= 0.0);
    let taken = number(&sc, "space_net_pool_hits_total", None)
        + number(&sc, "space_net_pool_misses_total", None);
    assert!(taken >= 2.0, "{}", ctx("pool takes"));
    assert!(matches!(
        find(&sc, "space_net_pool_hits_total", None).map(|s| &s.value),
        Some(Value::Counter(_))
    ));
    assert!(matches!(
        find(&sc, "space_net_slots_ready", None).map(|s| &s.value),
        Some(Value::Gauge(_))
    ));
}

/// `--log-format json --log-spans`: every line is a JSON object; a create leaves the closing
/// line of its request span and of the node's `node.create` span, with their busy time, and
/// its log lines carry the sandbox id in their span fields.
#[test]
fn json_logs_carry_spans_and_their_durations() {
    let s = space_tests::Spaced::start_with(&["--log-format", "json", "--log-spans"]).unwrap();
    let id = s.create(&[]);
    s.space_ok(&["rm", &id]);
    let log = std::fs::read_to_string(s.log_path()).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(!lines.is_empty(), "no JSON lines in {log}");
    let closed = |name: &str| {
        lines.iter().find(|l| {
            l["fields"]["message"] == "close"
                && l["span"]["name"] == name
                && l["fields"]["time.busy"].is_string()
        })
    };
    let create = closed("node.create").unwrap_or_else(|| panic!("no node.create close in {log}"));
    assert_eq!(create["span"]["sandbox"], id.as_str(), "{create}");
    assert!(closed("request").is_some(), "no request span closed");
    assert!(
        lines.iter().any(|l| l["spans"].as_array().is_some_and(|s| s
            .iter()
            .any(|sp| sp["name"] == "node.remove" && sp["sandbox"] == id.as_str()))),
        "no line inside node.remove for {id}"
    );
}
