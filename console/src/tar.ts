// A ustar archive of a few small text files, made in the browser: the build context a
// Dockerfile build takes (POST /v1/templates/{name}/build, application/x-tar).

function header(name: string, size: number): Uint8Array {
  const h = new Uint8Array(512);
  const put = (s: string, at: number, len: number) => {
    const b = new TextEncoder().encode(s);
    if (b.length > len) throw new Error(`tar: ${s} is too long`);
    h.set(b, at);
  };
  put(name, 0, 100);
  put("0000644\0", 100, 8);
  put("0000000\0", 108, 8);
  put("0000000\0", 116, 8);
  put(size.toString(8).padStart(11, "0") + "\0", 124, 12);
  put(Math.floor(Date.now() / 1000).toString(8).padStart(11, "0") + "\0", 136, 12);
  put("        ", 148, 8); // the checksum field counts as spaces while it is summed
  put("0", 156, 1);
  put("ustar\0", 257, 6);
  put("00", 263, 2);
  let sum = 0;
  for (const b of h) sum += b;
  put(sum.toString(8).padStart(6, "0") + "\0 ", 148, 8);
  return h;
}

/** The archive of `files` (name → text). */
export function tar(files: Record<string, string>): Uint8Array {
  const parts: Uint8Array[] = [];
  for (const [name, text] of Object.entries(files)) {
    const body = new TextEncoder().encode(text);
    parts.push(header(name, body.length), body, new Uint8Array((512 - (body.length % 512)) % 512));
  }
  parts.push(new Uint8Array(1024));
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}
