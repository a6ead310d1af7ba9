#!/usr/bin/env python3
"""Writes the seed inputs of every fuzz target into fuzz/corpus/<target>/seed-*.

The committed corpus is these seeds plus what `scripts/fuzz --merge` kept from long runs
(docs/FUZZING.md). Rerunning this rewrites the seeds only. Each seed starts with the byte the
target reads first (which message, which type, where to cut), as its entry point documents.
"""
import io, json, os, struct, tarfile

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# ---- protobuf, by hand (varints and length-delimited fields are all the guest protocol uses)
def varint(n):
    n &= (1 << 64) - 1
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def fv(num, n):
    return varint(num << 3) + varint(n)


def fb(num, b):
    if isinstance(b, str):
        b = b.encode()
    return varint(num << 3 | 2) + varint(len(b)) + b


def fmap(num, d):
    return b"".join(fb(num, fb(1, k) + fb(2, v)) for k, v in d.items())


# ---- rest: the selector of space_control::http::fuzzing::rest, then the body or query
rest = {
    0: {"template": "base", "cpu": 1.5, "memory_mib": 512, "disk_mib": 1024, "env": {"A": "b"},
        "metadata": {"k": "v"}, "hostname": "box", "timeout_secs": 60, "rlimits": {"nofile": 1024},
        "network": {"egress": "allowlist", "allow": ["example.com", "10.1.0.0/16"]}},
    1: {"timeout_secs": 30, "on_timeout": "pause"},
    2: {"every_secs": 60, "keep": 5},
    3: {"cmd": ["sh", "-c", "echo hi"], "env": {"X": "1"}, "cwd": "/tmp", "user": "user",
        "tty": True, "rows": 24, "cols": 80, "stdin": True, "tag": "t", "stdin_data": "aGk="},
    4: {"pid": 7, "signal": 15},
    5: {"pid": 7, "rows": 40, "cols": 120},
    6: {"path": "/home/user/d", "mode": 493, "parents": True},
    7: {"from": "/a", "to": "/b", "overwrite": False},
    8: {"egress": "allowlist", "allow": ["*.example.com", "1.2.3.4/32"]},
    9: {"port": 8080},
    10: {"ttl_secs": 600},
    11: {"template": "base", "size": 4, "runtime": "namespace"},
    12: {"value": "s3cr3t", "hosts": ["api.example.com"], "header": "Authorization",
         "format": "Bearer {value}"},
    13: {"snapshot": "snap-1"},
    14: {"replicas": 2},
    15: {"start_cmd": "python -m http.server", "ready_cmd": "curl -s localhost:8000"},
    16: {"reference": "docker.io/library/debian:bookworm", "insecure": False},
    17: {"sandbox": "sb-1", "snapshot": "snap-1"},
    18: {"name": "team-a", "max_sandboxes": 10, "max_memory_mib": 8192},
    19: {"max_sandboxes": 5},
    20: {"scope": "tenant", "name": "ci"},
    21: {"templateID": "base", "timeout": 300, "autoPause": True, "metadata": {"a": "b"},
         "envVars": {"K": "V"}, "network": {"allowOut": ["example.com"], "denyOut": ["0.0.0.0/0"],
         "rules": {"api.example.com": [{"headers": {"Authorization": "x"}}]}}},
    22: {"timeout": 60},
    23: {"allowOut": ["1.1.1.1"], "denyOut": ["0.0.0.0/0"], "allow_internet_access": False},
    24: {"name": "tok", "value": "v", "allowlist": ["api.example.com"]},
    25: {"name": "tok2"},
}
for sel, body in rest.items():
    put("rest", f"{sel:02}", bytes([sel]) + json.dumps(body).encode())
queries = {
    26: "path=/etc/hostname", 27: "path=/tmp/x&mode=420&append=true", 28: "path=/a/b&depth=2",
    29: "path=/home&recursive=true", 30: "offset=10&follow=true", 31: "limit=10&after=5",
    32: "start=1&end=2", 33: "from=snap-1&to=snap-2", 34: "name=t&replace=true",
    35: "force=true", 36: "tenant=team-a", 37: "start=1700000000&end=1700000100",
    38: "name=x", 39: "state=running&limit=5&nextToken=abc", 40: "name=tok",
}
for sel, q in queries.items():
    put("rest", f"{sel:02}", bytes([sel]) + q.encode())
env = lambda b: bytes([0]) + struct.pack(">I", len(b)) + b
put("rest", "41", bytes([41, 16]) + env(b'{"process":{"pid":1}}') + env(b'{"stdin":"aGk="}')
    + bytes([2]) + struct.pack(">I", 2) + b"{}")
put("rest", "42", bytes([42]) + b"user\nrelative/path")
put("rest", "43", bytes([0]) + b"[1,2]")

# ---- guest_daemon: the selector of space_daemon::fuzzing::guest, then the message
g = {
    0: fb(1, "sh") + fb(1, "-c") + fb(1, "true") + fmap(2, {"A": "1"}) + fb(3, "/tmp") + fb(4, "user")
       + fv(5, 1) + fv(6, 24) + fv(7, 80) + fb(10, "in"),
    1: fb(1, "/etc/../etc/./passwd"),
    2: fb(1, "/var/log/x") + fv(2, 10) + fv(3, 100),
    3: fb(1, fb(1, "/home/user/f") + fv(2, 0o644) + fv(3, 1) + fb(4, "user") + fmap(6, {"k": "v"})),
    4: fb(1, "/") + fv(2, 3),
    5: fb(1, "/a/b/c") + fv(2, 0o755) + fv(3, 1),
    6: fb(1, "/tmp/x") + fv(2, 1),
    7: fb(1, "/a") + fb(2, "/../b") + fv(3, 1),
    8: fb(1, "/home/user") + fv(2, 1),
    9: fmap(1, {"PATH": "/usr/bin", "SPACE_DNS": "10.0.0.1"}) + fb(2, "host") + fb(3, b"\x01" * 32)
       + fb(4, "0123456789abcdef0123456789abcdef") + fv(5, 1700000000000000000) + fb(6, b"\x02\x00\x00\x00\x00\x01"),
    10: fv(1, 5) + fv(2, 100) + fv(3, 1),
    11: fv(1, 5) + fv(2, 9) + fv(3, 1),
    12: fv(1, 5) + fb(2, "data"),
    13: fv(1, 5) + fv(2, 40) + fv(3, 100),
    14: fv(1, 5),
}
for sel, msg in g.items():
    put("guest_daemon", f"{sel:02}", bytes([sel]) + msg)
preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
frame = lambda n: struct.pack(">I", n)[1:] + b"\x04\x00\x00\x00\x00\x00" + b"\x00" * n
put("guest_daemon", "15", bytes([15, 7]) + b"old bytes" + preface + frame(6) + frame(0) + preface + frame(3))
put("guest_daemon", "15b", bytes([15, 0]) + preface[:10] + preface + frame(12))

# ---- guest_node: the selector of space_control::http::fuzzing::guest_reply, then the reply
entry = fb(1, "f") + fb(2, "/home/user/f") + fv(3, 1) + fv(4, 12) + fv(5, 0o4755) + fv(6, 1000) \
    + fv(7, 1000) + fv(8, 1700000000000) + fb(9, "../../etc") + fv(10, 1) + fb(11, "user") + fb(12, "user")
exit_ = fv(1, 1) + fv(2, 9) + fv(3, 1) + fv(4, 99)
n = {
    0: fb(2, fv(1, 2) + fv(2, 5) + fb(3, b"\xff\xfeout")),
    1: entry,
    2: fb(1, entry) + fb(1, fb(1, "d") + fv(3, 2)),
    3: fv(1, 1) + fb(2, "x.txt") + fv(3, 0),
    4: fb(1, fv(1, 3) + fb(2, "sleep") + fv(5, 0) + fb(6, exit_) + fv(7, 1 << 63)),
    5: fb(1, "0.1.0") + fb(2, "h") + fv(3, 1) + fv(7, 10) + fv(8, 5),
    6: exit_,
}
for sel, msg in n.items():
    put("guest_node", f"{sel:02}", bytes([sel]) + msg)
put("guest_node", "00b", bytes([0]) + fb(4, exit_))
put("guest_node", "00c", bytes([0]) + fb(3, fv(1, 1) + fv(2, 9)))


# ---- sniff: where to cut (first byte, of 255), then the connection's first bytes
def client_hello(name):
    sni = b"\x00" + struct.pack(">H", len(name)) + name
    sni_ext = struct.pack(">HH", 0, len(sni) + 2) + struct.pack(">H", len(sni)) + sni
    exts = struct.pack(">HH", 0x000A, 4) + b"\x00\x02\x00\x1d" + sni_ext
    body = b"\x03\x03" + b"\x11" * 32 + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00" \
        + struct.pack(">H", len(exts)) + exts
    hs = b"\x01" + struct.pack(">I", len(body))[1:] + body
    return b"\x16\x03\x01" + struct.pack(">H", len(hs)) + hs


hello = client_hello(b"API.Example.com.")
put("sniff", "tls", bytes([128]) + hello)
half = len(hello) // 2
split = hello[:5 + 2]  # two records: the handshake split across them
rec = lambda b: b"\x16\x03\x01" + struct.pack(">H", len(b)) + b
hs = hello[5:]
put("sniff", "tls-two-records", bytes([200]) + rec(hs[:half]) + rec(hs[half:]))
put("sniff", "http", bytes([100]) + b"GET / HTTP/1.1\r\nUser-Agent: x\r\nHost: Example.COM:8080\r\n\r\n")
put("sniff", "http-no-host", bytes([255]) + b"POST /x HTTP/1.0\r\n\r\n")
put("sniff", "http-ipv6", bytes([30]) + b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n")
put("sniff", "other", bytes([1]) + b"\x00\x01binary")


# ---- dns: policy bit, query length, the query, then the upstream's answer
def dname(n):
    return b"".join(bytes([len(l)]) + l.encode() for l in n.strip(".").split(".") if l) + b"\x00"


def dns_msg(id_, flags, q, answers=(), additionals=()):
    out = struct.pack(">HHHHHH", id_, flags, 1 if q else 0, len(answers), 0, len(additionals))
    if q:
        out += dname(q[0]) + struct.pack(">HH", q[1], 1)
    for name, typ, rdata in list(answers) + list(additionals):
        out += dname(name) + struct.pack(">HHIH", typ, 1, 30, len(rdata)) + rdata
    return out


A, CNAME, AAAA = 1, 5, 28
for tag, policy, qname, qtype, answers, extra in [
    ("allow-a", 0, "api.example.com", A, [("api.example.com", A, bytes([93, 184, 216, 34]))], []),
    ("cname", 0, "x.allowed.test", A, [("x.allowed.test", CNAME, dname("edge.cdn.test")),
                                        ("edge.cdn.test", A, bytes([93, 184, 216, 35])),
                                        ("other.test", A, bytes([93, 184, 216, 36]))],
     [("glue.test", A, bytes([1, 2, 3, 4]))]),
    ("rebind", 1, "rebind.test", A, [("rebind.test", A, bytes([169, 254, 169, 254])),
                                      ("rebind.test", A, bytes([10, 213, 0, 9]))], []),
    ("aaaa", 1, "v6.test", AAAA, [("v6.test", AAAA, b"\x20\x01" + b"\x00" * 14)], []),
    ("refused", 0, "not-allowed.test", A, [], []),
]:
    q = dns_msg(0x1234, 0x0100, (qname, qtype))
    r = dns_msg(0x1234, 0x8180, (qname, qtype), answers, extra)
    put("dns", tag, bytes([policy]) + struct.pack(">H", len(q)) + q + r)
put("dns", "garbage", bytes([0, 0, 5]) + b"\x00\x01\x02\x03\x04")


# ---- layer: tar streams, the hostile ones first
def tar(entries):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for e in entries:
            ti = tarfile.TarInfo(e["name"])
            ti.type = e.get("type", tarfile.REGTYPE)
            ti.mode = e.get("mode", 0o644)
            ti.linkname = e.get("link", "")
            data = e.get("data", b"")
            ti.size = len(data) if ti.type == tarfile.REGTYPE else 0
            if "pax" in e:
                ti.pax_headers = e["pax"]
            t.addfile(ti, io.BytesIO(data) if ti.type == tarfile.REGTYPE else None)
    return buf.getvalue()


D, S, L, C, F = tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.FIFOTYPE
layers = {
    "plain": [{"name": "etc", "type": D, "mode": 0o755}, {"name": "etc/hostname", "data": b"box\n"},
              {"name": "usr/bin/sudo", "mode": 0o4755, "data": b"\x7fELF"}],
    "climb": [{"name": "../outside/file", "data": b"x"}, {"name": "/outside/file", "data": b"y"}],
    "symlink-through": [{"name": "out", "type": S, "link": "../outside"},
                        {"name": "out/file", "data": b"written through"}],
    "abs-symlink": [{"name": "etc", "type": S, "link": "/tmp"}, {"name": "etc/passwd", "data": b"x"}],
    "hardlink-out": [{"name": "h", "type": L, "link": "../outside/file"}],
    "whiteouts": [{"name": "a/b", "data": b"1"}, {"name": "a/.wh.b"}, {"name": "a/.wh..wh..opq"},
                  {"name": ".wh.a"}],
    "devices": [{"name": "dev/null", "type": C, "mode": 0o666}, {"name": "fifo", "type": F}],
    "xattrs": [{"name": "bin/ping", "data": b"x",
                "pax": {"SCHILY.xattr.security.capability": "\x01\x00\x00\x02"}}],
}
for tag, entries in layers.items():
    put("layer", tag, tar(entries))

# ---- dockerfile
put("dockerfile", "simple", "FROM base\nRUN apt-get update && apt-get install -y curl\nENV A=1 B=\"two words\"\n"
    "WORKDIR /app\nCOPY . /app\nUSER user\nCMD [\"python\", \"-m\", \"http.server\"]\n")
put("dockerfile", "args", "ARG V=${A:-default}\nFROM base\nARG EMPTY\nENV P=${V:+set}/$EMPTY \\\n  Q=\\$literal\n"
    "RUN [\"sh\", \"-c\", \"echo $P\"]\nEXPOSE 8080\nLABEL a=b\n")
put("dockerfile", "bad", "RUN before from\nFROM\n")
put("dockerfile", "continuations", "FROM base\n# comment\nRUN echo a \\\n\n  && echo b \\\n# inner\n  && echo c\n")
tmpl = os.path.join(HERE, "..", "templates", "code-interpreter", "Dockerfile")
if os.path.exists(tmpl):
    put("dockerfile", "code-interpreter", open(tmpl, "rb").read())
