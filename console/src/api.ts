// The REST API as the console calls it: every call carries the session's key
// (Authorization: Bearer, decision 0058), and every failure is an ApiError with the API's
// own message.

const KEY = "space.key";

export function getKey(): string | null {
  return sessionStorage.getItem(KEY);
}

export function setKey(key: string | null): void {
  if (key === null) sessionStorage.removeItem(KEY);
  else sessionStorage.setItem(KEY, key);
}

/** A failed call: the HTTP status (0: no answer at all) and the API's message. */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
  ) {
    super(message);
  }
}

/** Listeners told when a call comes back 401: the key was revoked or is wrong. */
const unauthorized: Array<(e: ApiError) => void> = [];
export function onUnauthorized(f: (e: ApiError) => void): void {
  unauthorized.push(f);
}

/** Listeners told whether spaced answers at all (false: a network failure). */
const reachability: Array<(up: boolean) => void> = [];
export function onReachability(f: (up: boolean) => void): void {
  reachability.push(f);
}

export async function call(method: string, path: string, body?: unknown, raw?: Blob | ArrayBuffer | Uint8Array | string, rawType = "application/octet-stream"): Promise<Response> {
  const headers: Record<string, string> = {};
  const key = getKey();
  if (key) headers["Authorization"] = `Bearer ${key}`;
  let payload: BodyInit | undefined;
  if (raw !== undefined) {
    payload = raw as BodyInit;
    headers["Content-Type"] = rawType;
  } else if (body !== undefined) {
    payload = JSON.stringify(body);
    headers["Content-Type"] = "application/json";
  }
  let resp: Response;
  try {
    resp = await fetch(path, { method, headers, body: payload, cache: "no-store" });
  } catch (e) {
    reachability.forEach((f) => f(false));
    throw new ApiError(0, "unreachable", `spaced did not answer (${(e as Error).message}): is it running?`);
  }
  reachability.forEach((f) => f(true));
  if (!resp.ok) {
    let code = `http_${resp.status}`;
    let message = `${method} ${path}: HTTP ${resp.status}`;
    try {
      const j = await resp.json();
      if (j?.error?.message) {
        message = j.error.message;
        code = j.error.code ?? code;
      }
    } catch {
      // Not JSON: the status says it.
    }
    const err = new ApiError(resp.status, code, message);
    if (resp.status === 401) unauthorized.forEach((f) => f(err));
    throw err;
  }
  return resp;
}

export async function json<T>(method: string, path: string, body?: unknown): Promise<T> {
  const resp = await call(method, path, body);
  if (resp.status === 204) return undefined as T;
  return (await resp.json()) as T;
}

export const get = <T>(path: string) => json<T>("GET", path);

export interface Sandbox {
  id: string;
  tenant: string;
  template: string;
  runtime: string;
  state: string;
  created_at: string;
  cpu: number;
  memory_mib: number;
  hostname: string;
  error?: string;
  memory_bytes?: number;
  cpu_usage_usec?: number;
  node?: string;
  network?: SandboxNetwork;
  restored: boolean;
}

export interface SandboxNetwork {
  egress?: string;
  allow?: string[];
  deny?: string[];
  [k: string]: unknown;
}

export interface ProcessInfo {
  pid: number;
  cmd: string[];
  tag: string;
  tty: boolean;
  running: boolean;
  exit_code?: number;
  signal?: number;
  started_at: string;
  output_bytes: number;
}

export interface EntryInfo {
  name: string;
  path: string;
  type: string;
  size: number;
  mode: number;
  modified_at?: string;
}

export interface Snapshot {
  id: string;
  sandbox_id: string;
  parent_id?: string;
  label?: string;
  created_at: string;
  size_bytes?: number;
}

export interface SandboxEvent {
  id: number;
  time: number;
  actor: string;
  sandbox_id: string;
  action: string;
  result: string;
  detail?: string;
}

export interface Template {
  name: string;
  version: number;
  [k: string]: unknown;
}

export interface Pool {
  template: string;
  runtime: string;
  min: number;
  max: number;
  target: number;
  ready: number;
  starting: number;
  hits: number;
  misses: number;
  [k: string]: unknown;
}

export interface NodeRow {
  id: string;
  name: string;
  state: string;
  [k: string]: unknown;
}

export const enc = encodeURIComponent;

/** The ndjson lines of a streamed answer, each as it arrives. */
export async function* lines<T>(resp: Response): AsyncGenerator<T> {
  const reader = resp.body!.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let nl: number;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl).trim();
      buf = buf.slice(nl + 1);
      if (line) yield JSON.parse(line) as T;
    }
  }
  if (buf.trim()) yield JSON.parse(buf) as T;
}
