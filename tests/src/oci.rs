//! OCI images the tests build themselves, a real registry (Debian's `docker-registry`) on
//! loopback inside the test's own network namespace, filled with `skopeo`, and a small
//! token-auth front for it (the `WWW-Authenticate: Bearer` realm flow). Nothing here talks to
//! anything outside the namespace.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::NodeNet;

pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// One entry of a layer. Names go into the raw header, so hostile ones (`../x`) can be made.
pub enum Entry {
    File(&'static str, Vec<u8>, u32),
    Dir(&'static str, u32),
    Symlink(&'static str, &'static str),
    Hardlink(&'static str, &'static str),
    CharDev(&'static str),
    /// A file with xattrs and an owner.
    FileX {
        path: &'static str,
        data: Vec<u8>,
        mode: u32,
        uid: u64,
        xattrs: Vec<(&'static str, Vec<u8>)>,
    },
}

/// A layer's tar (uncompressed).
pub fn layer_tar(entries: &[Entry]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        let (path, data, mode, uid): (&str, &[u8], u32, u64) = match e {
            Entry::File(p, d, m) => {
                h.set_entry_type(tar::EntryType::Regular);
                (p, d, *m, 0)
            }
            Entry::Dir(p, m) => {
                h.set_entry_type(tar::EntryType::Directory);
                (p, &[], *m, 0)
            }
            Entry::Symlink(p, t) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_link_name_literal(t).unwrap();
                (p, &[], 0o777, 0)
            }
            Entry::Hardlink(p, t) => {
                h.set_entry_type(tar::EntryType::Link);
                h.set_link_name_literal(t).unwrap();
                (p, &[], 0o644, 0)
            }
            Entry::CharDev(p) => {
                h.set_entry_type(tar::EntryType::Char);
                (p, &[], 0o666, 0)
            }
            Entry::FileX {
                path,
                data,
                mode,
                uid,
                xattrs,
            } => {
                let recs: Vec<(String, &[u8])> = xattrs
                    .iter()
                    .map(|(k, v)| (format!("SCHILY.xattr.{k}"), v.as_slice()))
                    .collect();
                b.append_pax_extensions(recs.iter().map(|(k, v)| (k.as_str(), *v)))
                    .unwrap();
                h.set_entry_type(tar::EntryType::Regular);
                (path, data, *mode, *uid)
            }
        };
        h.as_gnu_mut().unwrap().name[..path.len()].copy_from_slice(path.as_bytes());
        h.set_mode(mode);
        h.set_uid(uid);
        h.set_gid(uid);
        h.set_mtime(1_700_000_000);
        h.set_size(data.len() as u64);
        h.set_cksum();
        b.append(&h, data).unwrap();
    }
    b.into_inner().unwrap()
}

pub fn compress(tar: &[u8], c: Compression) -> Vec<u8> {
    match c {
        Compression::None => tar.to_vec(),
        Compression::Gzip => {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(tar).unwrap();
            gz.finish().unwrap()
        }
        Compression::Zstd => zstd::encode_all(tar, 3).unwrap(),
    }
}

fn media_type(c: Compression) -> &'static str {
    match c {
        Compression::None => "application/vnd.oci.image.layer.v1.tar",
        Compression::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
        Compression::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
    }
}

/// An image to write: layers (uncompressed tars and how to compress each) and the config's
/// `config` object (Env, WorkingDir, User, Cmd, ...).
pub struct Image {
    pub layers: Vec<(Vec<u8>, Compression)>,
    pub config: Value,
    pub arch: &'static str,
}

/// What [`write_layout`] wrote: the manifest's digest (what `@sha256:` pulls name).
pub struct Written {
    pub manifest_digest: String,
    pub layer_digests: Vec<String>,
}

fn put_blob(dir: &Path, bytes: &[u8]) -> Result<(String, usize)> {
    let d = sha256(bytes);
    let path = dir
        .join("blobs/sha256")
        .join(d.trim_start_matches("sha256:"));
    std::fs::create_dir_all(path.parent().unwrap())?;
    std::fs::write(&path, bytes)?;
    Ok((d, bytes.len()))
}

fn put_image(dir: &Path, img: &Image) -> Result<(Value, Written)> {
    let mut layers = Vec::new();
    let mut diff_ids = Vec::new();
    let mut layer_digests = Vec::new();
    for (tar, c) in &img.layers {
        diff_ids.push(sha256(tar));
        let (d, n) = put_blob(dir, &compress(tar, *c))?;
        layer_digests.push(d.clone());
        layers.push(json!({"mediaType": media_type(*c), "digest": d, "size": n}));
    }
    let config = json!({
        "architecture": img.arch, "os": "linux", "config": img.config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    let (cd, cn) = put_blob(dir, &serde_json::to_vec(&config)?)?;
    let manifest = json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cn},
        "layers": layers,
    });
    let (md, mn) = put_blob(dir, &serde_json::to_vec(&manifest)?)?;
    Ok((
        json!({"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": mn,
               "platform": {"architecture": img.arch, "os": "linux"}}),
        Written {
            manifest_digest: md,
            layer_digests,
        },
    ))
}

fn finish_layout(dir: &Path, desc: Value, tag: &str) -> Result<()> {
    let mut desc = desc;
    desc["annotations"] = json!({"org.opencontainers.image.ref.name": tag});
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    std::fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": [desc]}))?,
    )?;
    Ok(())
}

/// Writes `img` as an OCI image layout at `dir`, tagged `tag`.
pub fn write_layout(dir: &Path, img: &Image, tag: &str) -> Result<Written> {
    let (desc, w) = put_image(dir, img)?;
    finish_layout(dir, desc, tag)?;
    Ok(w)
}

/// Writes an image index of `imgs` (one per platform) as an OCI layout at `dir`.
pub fn write_layout_index(dir: &Path, imgs: &[Image], tag: &str) -> Result<Vec<Written>> {
    let mut descs = Vec::new();
    let mut out = Vec::new();
    for img in imgs {
        let (d, w) = put_image(dir, img)?;
        descs.push(d);
        out.push(w);
    }
    let index = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                       "manifests": descs});
    let (d, n) = put_blob(dir, &serde_json::to_vec(&index)?)?;
    finish_layout(
        dir,
        json!({"mediaType": "application/vnd.oci.image.index.v1+json", "digest": d, "size": n}),
        tag,
    )?;
    Ok(out)
}

/// Writes `img` as a legacy `docker save` archive (uncompressed layer tars) at `path`.
pub fn write_docker_archive(path: &Path, img: &Image, tag: &str) -> Result<()> {
    write_docker_archive_with(path, img, tag, None)
}

/// [`write_docker_archive`], its config naming `diff_ids` instead of the layers' own.
pub fn write_docker_archive_with(
    path: &Path,
    img: &Image,
    tag: &str,
    diff_ids: Option<Vec<String>>,
) -> Result<()> {
    let mut b = tar::Builder::new(std::fs::File::create(path)?);
    let mut add = |name: &str, data: &[u8]| -> Result<()> {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_cksum();
        b.append_data(&mut h, name, data)?;
        Ok(())
    };
    let diff_ids: Vec<String> =
        diff_ids.unwrap_or_else(|| img.layers.iter().map(|(t, _)| sha256(t)).collect());
    let config = json!({"architecture": img.arch, "os": "linux", "config": img.config,
                        "rootfs": {"type": "layers", "diff_ids": diff_ids}});
    let config = serde_json::to_vec(&config)?;
    let cname = format!("{}.json", sha256(&config).trim_start_matches("sha256:"));
    add(&cname, &config)?;
    let mut names = Vec::new();
    for (i, (tar, _)) in img.layers.iter().enumerate() {
        let n = format!("layer{i}/layer.tar");
        add(&n, tar)?;
        names.push(n);
    }
    let manifest = json!([{"Config": cname, "RepoTags": [tag], "Layers": names}]);
    add("manifest.json", &serde_json::to_vec(&manifest)?)?;
    b.into_inner()?.flush()?;
    Ok(())
}

/// A static busybox and the applets the tests use, as a first layer.
pub fn busybox_layer() -> Vec<Entry> {
    let bb = std::fs::read("/bin/busybox").expect("busybox-static at /bin/busybox");
    let mut v = vec![
        Entry::Dir("bin/", 0o755),
        Entry::File("bin/busybox", bb, 0o755),
    ];
    for a in ["sh", "cat", "ls", "id", "env", "test", "stat", "pwd"] {
        let p: &'static str = Box::leak(format!("bin/{a}").into_boxed_str());
        v.push(Entry::Symlink(p, "busybox"));
    }
    v.push(Entry::Dir("etc/", 0o755));
    v.push(Entry::File(
        "etc/passwd",
        b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n".to_vec(),
        0o644,
    ));
    v.push(Entry::File(
        "etc/group",
        b"root:x:0:\napp:x:1000:\n".to_vec(),
        0o644,
    ));
    v
}

/// `docker-registry` serving on 127.0.0.1:`port` inside `net`, storing under a temp dir.
pub struct Registry {
    child: Child,
    _dir: tempfile::TempDir,
    pub addr: String,
}

impl Registry {
    /// Starts it (with `htpasswd`, basic auth for that user) and waits until it answers.
    pub fn start(net: &NodeNet, port: u16, htpasswd: Option<(&str, &str)>) -> Result<Registry> {
        let dir = tempfile::tempdir()?;
        let auth = match htpasswd {
            Some((u, p)) => {
                let file = dir.path().join("htpasswd");
                let st = Command::new("htpasswd")
                    .args(["-Bbc", file.to_str().unwrap(), u, p])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .context("htpasswd (apache2-utils)")?;
                if !st.success() {
                    bail!("htpasswd failed");
                }
                format!(
                    "auth:\n  htpasswd:\n    realm: space-test\n    path: {}\n",
                    file.display()
                )
            }
            None => String::new(),
        };
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n{auth}",
                dir.path().join("data").display()
            ),
        )?;
        let log = std::fs::File::create(dir.path().join("registry.log"))?;
        let child = net
            .command("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("start docker-registry (Debian's docker-registry package)")?;
        let r = Registry {
            child,
            _dir: dir,
            addr: format!("127.0.0.1:{port}"),
        };
        wait_http(net, &format!("http://{}/v2/", r.addr))?;
        Ok(r)
    }

    /// `skopeo copy` of the layout at `layout` (tag `tag`) to `REGISTRY/repo`; `all` copies
    /// a whole index.
    pub fn push(
        &self,
        net: &NodeNet,
        layout: &Path,
        tag: &str,
        repo: &str,
        creds: Option<(&str, &str)>,
        all: bool,
    ) -> Result<()> {
        let mut cmd = net.command("skopeo");
        cmd.args(["copy", "--quiet", "--dest-tls-verify=false"]);
        if all {
            cmd.arg("--all");
        }
        if let Some((u, p)) = creds {
            cmd.arg(format!("--dest-creds={u}:{p}"));
        }
        cmd.arg(format!("oci:{}:{tag}", layout.display()))
            .arg(format!("docker://{}/{repo}", self.addr));
        let out = cmd.output().context("skopeo")?;
        if !out.status.success() {
            bail!(
                "skopeo copy failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

impl Registry {
    /// The digest of `repo`'s manifest as the registry holds it (skopeo may rewrite it).
    pub fn digest(&self, net: &NodeNet, repo: &str) -> Result<String> {
        let out = net
            .command("skopeo")
            .args(["inspect", "--raw", "--tls-verify=false"])
            .arg(format!("docker://{}/{repo}", self.addr))
            .output()?;
        if !out.status.success() {
            bail!("skopeo inspect: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(sha256(&out.stdout))
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits (at most 10 s, 100 tries) until `url` answers at all inside `net`.
pub fn wait_http(net: &NodeNet, url: &str) -> Result<()> {
    let t0 = Instant::now();
    for _ in 0..100 {
        let out = net
            .command("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-m",
                "1",
                "-w",
                "%{http_code}",
                url,
            ])
            .output()?;
        let code = String::from_utf8_lossy(&out.stdout).to_string();
        if code != "000" && !code.is_empty() {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(10) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("{url} did not answer within 10 s")
}

/// What the token front does with blob bodies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlobMode {
    Pass,
    /// Sends the first half of every blob, with a Content-Length to match.
    Truncate,
}

/// A front for a registry that wants bearer tokens: `/v2/...` without `Bearer TOKEN` gets 401
/// and a `WWW-Authenticate: Bearer realm=".../token"` challenge; `/token` hands out TOKEN for
/// the right basic credentials (401 otherwise); with the token, requests are passed on to the
/// registry. Runs on a thread of its own inside the namespace.
pub struct TokenFront {
    pub addr: String,
    /// What happened, in order: "token ok", "token refused", "challenge", "proxied GET /v2/...".
    pub hits: Arc<Mutex<Vec<String>>>,
    pub mode: Arc<Mutex<BlobMode>>,
}

const TOKEN: &str = "space-test-token-1";

impl TokenFront {
    pub fn start(net: &NodeNet, port: u16, upstream: &str, user: &str, pass: &str) -> Result<Self> {
        let ns = std::fs::File::open(net.path())?;
        let (tx, rx) = std::sync::mpsc::channel();
        let hits = Arc::new(Mutex::new(Vec::new()));
        let mode = Arc::new(Mutex::new(BlobMode::Pass));
        let addr = format!("127.0.0.1:{port}");
        let basic = format!(
            "Basic {}",
            base64::Engine::encode(
                &base64::engine::general_purpose::STANDARD,
                format!("{user}:{pass}")
            )
        );
        let state = Front {
            upstream: upstream.to_string(),
            realm: format!("http://{addr}/token"),
            basic,
            hits: hits.clone(),
            mode: mode.clone(),
        };
        let bind: SocketAddr = addr.parse()?;
        std::thread::spawn(move || {
            let ready = tx.clone();
            let r = (|| -> Result<()> {
                rustix::thread::move_into_link_name_space(
                    std::os::fd::AsFd::as_fd(&ns),
                    Some(rustix::thread::LinkNameSpaceType::Network),
                )?;
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::bind(bind).await?;
                    ready.send(Ok(())).ok();
                    serve(listener, Arc::new(state)).await
                })
            })();
            if let Err(e) = r {
                let _ = tx.send(Err(e));
            }
        });
        rx.recv_timeout(Duration::from_secs(10))
            .context("token front did not start")??;
        Ok(Self { addr, hits, mode })
    }

    pub fn hits(&self) -> Vec<String> {
        self.hits.lock().unwrap().clone()
    }
}

struct Front {
    upstream: String,
    realm: String,
    basic: String,
    hits: Arc<Mutex<Vec<String>>>,
    mode: Arc<Mutex<BlobMode>>,
}

type Resp = hyper::Response<http_body_util::Full<bytes::Bytes>>;

async fn serve(listener: tokio::net::TcpListener, front: Arc<Front>) -> Result<()> {
    let client: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    loop {
        let (stream, _) = listener.accept().await?;
        let (front, client) = (front.clone(), client.clone());
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let (front, client) = (front.clone(), client.clone());
                async move { Ok::<_, std::convert::Infallible>(handle(&front, &client, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn reply(status: u16, headers: &[(&str, String)], body: Vec<u8>) -> Resp {
    let mut b = hyper::Response::builder().status(status);
    for (k, v) in headers {
        b = b.header(*k, v);
    }
    b.body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap()
}

async fn handle(
    front: &Front,
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
    req: hyper::Request<hyper::body::Incoming>,
) -> Resp {
    use http_body_util::BodyExt;
    let auth = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.to_string())
        .unwrap_or_default();
    let hit = |s: String| front.hits.lock().unwrap().push(s);
    if path.starts_with("/token") {
        if auth == front.basic {
            hit("token ok".into());
            let body = json!({"token": TOKEN, "access_token": TOKEN, "expires_in": 300});
            return reply(
                200,
                &[("content-type", "application/json".into())],
                body.to_string().into_bytes(),
            );
        }
        hit("token refused".into());
        return reply(
            401,
            &[],
            br#"{"details":"incorrect username or password"}"#.to_vec(),
        );
    }
    if auth != format!("Bearer {TOKEN}") {
        hit("challenge".into());
        let challenge = format!("Bearer realm=\"{}\",service=\"space-test\"", front.realm);
        return reply(
            401,
            &[
                ("www-authenticate", challenge),
                ("content-type", "application/json".into()),
            ],
            br#"{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}"#.to_vec(),
        );
    }
    hit(format!("proxied {} {path}", req.method()));
    let mut up = hyper::Request::builder()
        .method(req.method().clone())
        .uri(format!("http://{}{path}", front.upstream));
    for (k, v) in req.headers() {
        if k != "authorization" && k != "host" {
            up = up.header(k, v);
        }
    }
    let up = up
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let resp = match client.request(up).await {
        Ok(r) => r,
        Err(e) => return reply(502, &[], e.to_string().into_bytes()),
    };
    let status = resp.status().as_u16();
    let mut headers: Vec<(String, String)> = resp
        .headers()
        .iter()
        .filter(|(k, _)| *k != "content-length" && *k != "transfer-encoding")
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or_default().to_string()))
        .collect();
    let mut body = resp
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    if path.contains("/blobs/") && *front.mode.lock().unwrap() == BlobMode::Truncate {
        body.truncate(body.len() / 2);
        headers.retain(|(k, _)| k != "docker-content-digest");
    }
    let hs: Vec<(&str, String)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    reply(status, &hs, body)
}

/// The image most tests pull: busybox; then a layer with a whiteout, an opaque directory, a
/// device node, a file capability and a hardlink (gzip); then a file owned by uid 1000 (zstd).
pub fn sample_image() -> Image {
    let cap = {
        // vfs_cap_data v2: magic|effective, permitted/inheritable (CAP_NET_RAW = 13).
        let mut v = Vec::new();
        for w in [0x0200_0001u32, 1 << 13, 0, 0, 0] {
            v.extend_from_slice(&w.to_le_bytes());
        }
        v
    };
    let mut l1 = busybox_layer();
    l1.push(Entry::File("etc/gone", b"lower".to_vec(), 0o644));
    l1.push(Entry::Dir("opt/", 0o755));
    l1.push(Entry::Dir("opt/lower/", 0o755));
    l1.push(Entry::File("opt/lower/a", b"a".to_vec(), 0o644));
    l1.push(Entry::File("opt/lower/b", b"b".to_vec(), 0o644));
    let l2 = vec![
        Entry::File("etc/.wh.gone", Vec::new(), 0o644),
        Entry::File("opt/lower/c", b"c".to_vec(), 0o644),
        Entry::File("opt/lower/.wh..wh..opq", Vec::new(), 0o644),
        Entry::Dir("dev/", 0o755),
        Entry::CharDev("dev/sda"),
        Entry::FileX {
            path: "usr/bin/ping",
            data: b"#!/bin/sh\necho pong\n".to_vec(),
            mode: 0o755,
            uid: 0,
            xattrs: vec![("security.capability", cap)],
        },
        Entry::Hardlink("usr/bin/ping2", "usr/bin/ping"),
    ];
    let l3 = vec![
        Entry::Dir("work/", 0o755),
        Entry::FileX {
            path: "work/hello.txt",
            data: b"hello from layer 3\n".to_vec(),
            mode: 0o640,
            uid: 1000,
            xattrs: vec![],
        },
    ];
    Image {
        layers: vec![
            (layer_tar(&l1), Compression::None),
            (layer_tar(&l2), Compression::Gzip),
            (layer_tar(&l3), Compression::Zstd),
        ],
        config: json!({
            "Env": ["PATH=/bin:/usr/bin", "GREETING=hi there"],
            "WorkingDir": "/work",
            "Cmd": ["/bin/sh"],
        }),
        arch: "amd64",
    }
}

pub fn path_str(p: &Path) -> String {
    p.to_str().expect("utf-8 path").to_string()
}

pub fn tmp_layout() -> Result<(tempfile::TempDir, PathBuf)> {
    let d = tempfile::tempdir()?;
    let p = d.path().join("layout");
    std::fs::create_dir(&p)?;
    Ok((d, p))
}
