//! space's own Python SDK (`sdk/python`, package `space-sdk`) against a real spaced: the tests
//! in `sdk/python/tests/` drive every part of the REST API through it, sync and async.

use std::path::Path;
use std::process::Command;

use space_tests::*;

#[test]
fn the_python_sdk_drives_a_real_spaced() {
    let Some(python) = sdk_python() else { return };
    let Some(s) = Spaced::start_with_base(&[]) else {
        return;
    };
    let out = Command::new(python)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../sdk/python/tests"))
        .args(["-m", "unittest", "-v", "test_sdk"])
        .env("SPACE_URL", &s.url)
        .env("SPACE_API_KEY", &s.key)
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("ALL_PROXY")
        .env("NO_PROXY", "*")
        .output()
        .expect("run the SDK's tests");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the SDK's tests failed:\n{}{stderr}\nspaced log:\n{}",
        String::from_utf8_lossy(&out.stdout),
        s.log_tail()
    );
    eprintln!("{stderr}");
}
