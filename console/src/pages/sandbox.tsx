import { useEffect, useState } from "preact/hooks";
import { ApiError, type EntryInfo, type ProcessInfo, type Sandbox, type SandboxEvent, call, enc, get, json } from "../api";
import { TerminalView } from "../terminal";
import { Chart, ErrorBox, Guard, Loading, StateBadge, age, fmtBytes, useAction, useFocusHeading, usePoll } from "../ui";
import { SnapshotsTab } from "./snapshots";

const TABS = ["terminal", "processes", "files", "snapshots", "timeline", "network", "ports", "metrics"] as const;
type Tab = (typeof TABS)[number];

export function SandboxPage({ id, tab, go }: { id: string; tab?: string; go: (p: string) => void }) {
  const l = usePoll(() => get<Sandbox>(`/v1/sandboxes/${enc(id)}`), [id], 3000);
  const current: Tab = (TABS as readonly string[]).includes(tab ?? "") ? (tab as Tab) : "terminal";
  const h = useFocusHeading(id);
  const gone = l.error?.status === 404;
  return (
    <main>
      <p class="crumbs">
        <a href="#/sandboxes">Sandboxes</a> / {id}
      </p>
      <h1 tabIndex={-1} ref={h}>
        Sandbox {id} {l.data ? <StateBadge state={l.data.state} /> : null}
      </h1>
      {gone ? (
        <div class="error" role="alert" id="sandbox-gone">
          <strong>Sandbox {id} does not exist</strong>
          {l.data ? " any more: it was removed while this page was open." : "."} {l.error?.message} <a href="#/sandboxes">Back to the sandboxes</a>
        </div>
      ) : (
        <Guard l={l} what="the sandbox">
          {(s) => (
            <>
              <p class="facts">
                <span>runtime {s.runtime}</span> <span>template {s.template}</span> <span>node {s.node ?? "local"}</span> <span>age {age(s.created_at)}</span>{" "}
                <span>
                  {s.cpu} CPU, {s.memory_mib} MiB
                </span>
                {s.error ? <span class="error-inline">error: {s.error}</span> : null}
              </p>
              <nav class="tabs" role="tablist" aria-label="Sandbox views">
                {TABS.map((t) => (
                  <a role="tab" aria-selected={t === current} class={t === current ? "active" : ""} href={`#/sandboxes/${id}/${t}`} id={`tab-${t}`}>
                    {t}
                  </a>
                ))}
              </nav>
              <section role="tabpanel" aria-labelledby={`tab-${current}`}>
                {current === "terminal" ? <TerminalTab id={id} running={s.state === "running"} /> : null}
                {current === "processes" ? <ProcessesTab id={id} /> : null}
                {current === "files" ? <FilesTab id={id} /> : null}
                {current === "snapshots" ? <SnapshotsTab id={id} go={go} /> : null}
                {current === "timeline" ? <TimelineTab id={id} /> : null}
                {current === "network" ? <NetworkTab s={s} reload={l.reload} /> : null}
                {current === "ports" ? <PortsTab id={id} /> : null}
                {current === "metrics" ? <MetricsTab id={id} /> : null}
              </section>
            </>
          )}
        </Guard>
      )}
    </main>
  );
}

const SHELL = ["/bin/sh", "-c", "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi"];

/** The console's shell: one per sandbox and tab session, found again after a reload. A
 * shell is known by its pid and start time, so a rollback or restart (whose processes start
 * over, and may reuse the pid) gets a new shell instead of someone else's process. */
function TerminalTab({ id, running }: { id: string; running: boolean }) {
  const slot = `space.term.${id}`;
  const [pid, setPid] = useState<number | undefined>(undefined);
  const [run, busy, error] = useAction();
  const start = () =>
    run(async () => {
      const r = await json<{ pid: number }>("POST", `/v1/sandboxes/${enc(id)}/exec`, {
        cmd: SHELL,
        tty: true,
        stdin: true,
        background: true,
        rows: 30,
        cols: 100,
        tag: "console",
      });
      const { processes } = await get<{ processes: ProcessInfo[] }>(`/v1/sandboxes/${enc(id)}/processes`);
      const p = processes.find((x) => x.pid === r.pid);
      sessionStorage.setItem(slot, JSON.stringify({ pid: r.pid, started_at: p?.started_at }));
      setPid(r.pid);
    });
  /** The kept shell when it still runs, else a new one. */
  const resume = () =>
    run(async () => {
      let kept: { pid?: number; started_at?: string } = {};
      try {
        kept = JSON.parse(sessionStorage.getItem(slot) ?? "{}");
      } catch {
        // Not ours: start afresh.
      }
      if (kept.pid !== undefined) {
        const { processes } = await get<{ processes: ProcessInfo[] }>(`/v1/sandboxes/${enc(id)}/processes`);
        const p = processes.find((x) => x.pid === kept.pid);
        if (p && p.running && p.tag === "console" && p.started_at === kept.started_at) {
          setPid(p.pid);
          return;
        }
      }
      sessionStorage.removeItem(slot);
      await start();
    });
  useEffect(() => {
    setPid(undefined);
    if (running) resume();
  }, [id, running]);
  if (!running) return <p class="notice">The sandbox is not running: resume it to open a terminal.</p>;
  return (
    <div>
      <ErrorBox error={error} what="Starting a shell" />
      {pid !== undefined ? (
        <>
          <div class="toolbar">
            <span class="muted">shell pid {pid}</span>
            <span class="grow" />
            <button
              disabled={busy}
              onClick={() => {
                sessionStorage.removeItem(slot);
                setPid(undefined);
                start();
              }}
            >
              New shell
            </button>
          </div>
          <TerminalView
            sandbox={id}
            pid={pid}
            onState={(st) => {
              // The shell went with a rollback or restart: a new one takes its place.
              if (st === "gone") {
                sessionStorage.removeItem(slot);
                setPid(undefined);
                start();
              }
            }}
          />
        </>
      ) : busy ? (
        <Loading what="a shell" />
      ) : null}
    </div>
  );
}

function ProcessesTab({ id }: { id: string }) {
  const l = usePoll(() => get<{ processes: ProcessInfo[] }>(`/v1/sandboxes/${enc(id)}/processes`).then((r) => r.processes), [id], 3000);
  const [attached, setAttached] = useState<number | undefined>(undefined);
  return (
    <Guard l={l} what="processes">
      {(ps) => (
        <>
          {!ps.length ? <p class="empty">No processes started through the API.</p> : null}
          <table>
            <thead>
              <tr>
                <th>Pid</th>
                <th>Command</th>
                <th>Tag</th>
                <th>State</th>
                <th>Output</th>
                <th>Started</th>
                <th />
              </tr>
            </thead>
            <tbody>
              {ps.map((p) => (
                <tr key={p.pid}>
                  <td>{p.pid}</td>
                  <td class="mono">{p.cmd.join(" ")}</td>
                  <td>{p.tag}</td>
                  <td>{p.running ? "running" : p.signal ? `signal ${p.signal}` : `exit ${p.exit_code ?? 0}`}</td>
                  <td>{fmtBytes(p.output_bytes)}</td>
                  <td>{age(p.started_at)} ago</td>
                  <td>
                    <button onClick={() => setAttached(p.pid)}>Attach</button>
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
          {attached !== undefined ? (
            <div>
              <h2>Process {attached}</h2>
              <TerminalView sandbox={id} pid={attached} input={ps.find((p) => p.pid === attached)?.tty ?? false} />
            </div>
          ) : null}
        </>
      )}
    </Guard>
  );
}

const PREVIEW_MAX = 256 * 1024;

function FilesTab({ id }: { id: string }) {
  const [dir, setDir] = useState("/root");
  const [typed, setTyped] = useState("/root");
  const l = usePoll(() => get<{ entries: EntryInfo[] }>(`/v1/sandboxes/${enc(id)}/files/list?path=${enc(dir)}`).then((r) => r.entries), [id, dir]);
  const [preview, setPreview] = useState<{ path: string; text: string } | undefined>(undefined);
  const [run, busy, error] = useAction();
  const open = (e: EntryInfo) => {
    if (e.type === "dir") {
      setDir(e.path);
      setTyped(e.path);
      setPreview(undefined);
      return;
    }
    run(async () => {
      if (e.size > PREVIEW_MAX) throw new ApiError(0, "client", `${e.path} is ${fmtBytes(e.size)}: download it instead of a preview`);
      const r = await call("GET", `/v1/sandboxes/${enc(id)}/files?path=${enc(e.path)}`);
      const bytes = new Uint8Array(await r.arrayBuffer());
      const text = new TextDecoder("utf-8", { fatal: false }).decode(bytes);
      setPreview({ path: e.path, text: bytes.includes(0) ? "(binary file)" : text });
    });
  };
  const download = (e: EntryInfo) =>
    run(async () => {
      const r = await call("GET", `/v1/sandboxes/${enc(id)}/files?path=${enc(e.path)}`);
      const url = URL.createObjectURL(await r.blob());
      const a = document.createElement("a");
      a.href = url;
      a.download = e.name;
      a.click();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    });
  const upload = (files: FileList | null) =>
    run(async () => {
      for (const f of Array.from(files ?? [])) {
        const path = `${dir.replace(/\/$/, "")}/${f.name}`;
        await call("PUT", `/v1/sandboxes/${enc(id)}/files?path=${enc(path)}`, undefined, f);
      }
      l.reload();
    });
  const up = dir === "/" ? null : dir.replace(/\/[^/]*\/?$/, "") || "/";
  return (
    <div>
      <form
        class="toolbar"
        onSubmit={(e) => {
          e.preventDefault();
          setDir(typed.trim() || "/");
        }}
      >
        <label for="dir">Directory</label>
        <input id="dir" value={typed} onInput={(e) => setTyped((e.target as HTMLInputElement).value)} size={40} />
        <button type="submit">Open</button>
        <span class="grow" />
        <label class="button" for="upload">
          Upload…
        </label>
        <input id="upload" type="file" multiple class="sr-only" onChange={(e) => upload((e.target as HTMLInputElement).files)} />
      </form>
      <ErrorBox error={error} what="File" />
      {busy ? <Loading what="the file" /> : null}
      <Guard l={l} what={dir}>
        {(entries) => (
          <table class="files">
            <thead>
              <tr>
                <th>Name</th>
                <th>Size</th>
                <th>Mode</th>
                <th />
              </tr>
            </thead>
            <tbody>
              {up !== null ? (
                <tr>
                  <td>
                    <button class="link" onClick={() => open({ name: "..", path: up, type: "dir", size: 0, mode: 0 })}>
                      ..
                    </button>
                  </td>
                  <td />
                  <td />
                  <td />
                </tr>
              ) : null}
              {[...entries]
                .sort((a, b) => Number(b.type === "dir") - Number(a.type === "dir") || a.name.localeCompare(b.name))
                .map((e) => (
                  <tr key={e.path} data-name={e.name}>
                    <td>
                      <button class="link" onClick={() => open(e)}>
                        {e.name}
                        {e.type === "dir" ? "/" : ""}
                      </button>
                    </td>
                    <td>{e.type === "dir" ? "" : fmtBytes(e.size)}</td>
                    <td class="mono">{(e.mode & 0o7777).toString(8).padStart(4, "0")}</td>
                    <td>{e.type === "file" ? <button onClick={() => download(e)}>Download</button> : null}</td>
                  </tr>
                ))}
            </tbody>
          </table>
        )}
      </Guard>
      {preview ? (
        <div class="preview">
          <h2>{preview.path}</h2>
          <pre>{preview.text}</pre>
        </div>
      ) : null}
    </div>
  );
}

/** Events and the audit trail, newest first; new ones arrive every second. */
function TimelineTab({ id }: { id: string }) {
  const [events, setEvents] = useState<SandboxEvent[]>([]);
  const [error, setError] = useState<ApiError | undefined>(undefined);
  const [loaded, setLoaded] = useState(false);
  useEffect(() => {
    let after = 0;
    let live = true;
    let timer: ReturnType<typeof setTimeout>;
    const poll = async () => {
      try {
        for (let page = 0; page < 20; page++) {
          const r = await get<{ events: SandboxEvent[] }>(`/v1/sandboxes/${enc(id)}/events?after=${after}&limit=1000`);
          if (!live) return;
          if (r.events.length) {
            after = r.events[r.events.length - 1].id;
            setEvents((old) => [...r.events.slice().reverse(), ...old].slice(0, 2000));
          }
          if (r.events.length < 1000) break;
        }
        setError(undefined);
      } catch (e) {
        if (live) setError(e as ApiError);
      }
      if (live) {
        setLoaded(true);
        timer = setTimeout(poll, 1000);
      }
    };
    poll();
    return () => {
      live = false;
      clearTimeout(timer);
    };
  }, [id]);
  return (
    <div>
      <ErrorBox error={error} what="Events" />
      {!loaded ? <Loading what="events" /> : null}
      <ol class="timeline" aria-live="polite">
        {events.map((e) => (
          <li key={e.id} class={e.result === "ok" ? "" : "bad"} data-action={e.action}>
            <time>{new Date(e.time).toLocaleTimeString()}</time> <strong>{e.action}</strong> <span class="muted">{e.actor}</span> {e.result !== "ok" ? <span class="badge state-failed">{e.result}</span> : null}{" "}
            <span class="detail">{e.detail}</span>
          </li>
        ))}
      </ol>
    </div>
  );
}

function NetworkTab({ s, reload }: { s: Sandbox; reload: () => void }) {
  const [egress, setEgress] = useState(s.network?.egress ?? "open");
  const [allow, setAllow] = useState((s.network?.allow ?? []).join("\n"));
  const [run, busy, error] = useAction();
  const [saved, setSaved] = useState(false);
  const save = (e: Event) => {
    e.preventDefault();
    setSaved(false);
    run(async () => {
      const rules = allow
        .split(/\s+/)
        .map((r) => r.trim())
        .filter(Boolean);
      await json("PUT", `/v1/sandboxes/${enc(s.id)}/network`, { egress, allow: rules });
      setSaved(true);
      reload();
    });
  };
  if (!s.network) return <p class="notice">This sandbox has no network slot (its node runs without networking).</p>;
  return (
    <form onSubmit={save} class="stack" id="network-form">
      <p>
        Address {String(s.network["address"] ?? "–")}, gateway {String(s.network["gateway"] ?? "–")}
      </p>
      <label for="egress">Egress</label>
      <select id="egress" value={egress} onChange={(e) => setEgress((e.target as HTMLSelectElement).value)}>
        <option value="open">open: public addresses</option>
        <option value="allowlist">allowlist: only the rules below</option>
        <option value="none">none: nothing leaves</option>
      </select>
      <label for="allow">Allow rules (CIDRs, addresses, domains, *.wildcards), one per line</label>
      <textarea id="allow" rows={6} value={allow} onInput={(e) => setAllow((e.target as HTMLTextAreaElement).value)} />
      <div>
        <button type="submit" disabled={busy}>
          {busy ? "Saving…" : "Save policy"}
        </button>{" "}
        {saved ? (
          <span class="ok" role="status">
            Saved: in force now.
          </span>
        ) : null}
      </div>
      <ErrorBox error={error} what="Policy" />
    </form>
  );
}

function PortsTab({ id }: { id: string }) {
  const [port, setPort] = useState("8080");
  const [urls, setUrls] = useState<Array<{ port: number; url: string }>>([]);
  const [run, busy, error] = useAction();
  const open = (e: Event) => {
    e.preventDefault();
    run(async () => {
      const n = Number(port);
      if (!Number.isInteger(n) || n < 1 || n > 65535) throw new ApiError(0, "client", "A port is a number from 1 to 65535.");
      const r = await json<{ port: number; url: string }>("POST", `/v1/sandboxes/${enc(id)}/ports`, { port: n });
      setUrls((u) => [r, ...u.filter((x) => x.port !== r.port)]);
    });
  };
  return (
    <div>
      <form class="toolbar" onSubmit={open}>
        <label for="port">Port</label>
        <input id="port" value={port} onInput={(e) => setPort((e.target as HTMLInputElement).value)} size={6} inputMode="numeric" />
        <button type="submit" disabled={busy}>
          Get URL
        </button>
      </form>
      <ErrorBox error={error} what="Port" />
      <ul>
        {urls.map((u) => (
          <li key={u.port}>
            {u.port}:{" "}
            <a href={u.url} target="_blank" rel="noopener noreferrer">
              {u.url}
            </a>
          </li>
        ))}
      </ul>
    </div>
  );
}

interface Metrics {
  cpu: number;
  memory_limit_bytes: number;
  disk_total_bytes?: number | null;
  disk_used_bytes?: number | null;
  samples: Array<{ time: string; cpu_pct: number; memory_bytes: number; memory_cache_bytes: number }>;
}

function MetricsTab({ id }: { id: string }) {
  const l = usePoll(() => get<Metrics>(`/v1/sandboxes/${enc(id)}/metrics`), [id], 5000);
  return (
    <Guard l={l} what="metrics">
      {(m) => (
        <div class="charts">
          <Chart title="CPU" unit="% of its limit" max={100} points={m.samples.map((s) => [Date.parse(s.time), s.cpu_pct])} />
          <Chart title="Memory" unit="MiB" max={m.memory_limit_bytes / 1048576} points={m.samples.map((s) => [Date.parse(s.time), s.memory_bytes / 1048576])} />
          <p>
            Disk: {m.disk_used_bytes != null ? `${fmtBytes(m.disk_used_bytes)} of ${fmtBytes(m.disk_total_bytes ?? undefined)}` : "not known while it is not running"}
          </p>
        </div>
      )}
    </Guard>
  );
}
