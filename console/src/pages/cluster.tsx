import { useState } from "preact/hooks";
import { ApiError, type NodeRow, type Pool, type Template, call, enc, get, lines } from "../api";
import { tar } from "../tar";
import { ErrorBox, Guard, age, asApiError, fmtBytes, useFocusHeading, usePoll } from "../ui";

interface TemplateLog {
  type: "step" | "note" | "output" | "done" | "error";
  n?: number;
  of?: number;
  text?: string;
  template?: Template;
  error?: { code: string; message: string };
}

/** A Dockerfile build (decision 0018) with its log streaming in as the build runs. */
function BuildForm({ done }: { done: () => void }) {
  const [name, setName] = useState("");
  const [dockerfile, setDockerfile] = useState("FROM base\nRUN echo hello from the console > /etc/motd\n");
  const [replace, setReplace] = useState(false);
  const [log, setLog] = useState<string[]>([]);
  const [state, setState] = useState<"idle" | "building" | "done" | "failed">("idle");
  const [error, setError] = useState<ApiError | undefined>(undefined);
  const build = async (e: Event) => {
    e.preventDefault();
    setError(undefined);
    setLog([]);
    setState("building");
    try {
      const q = replace ? "?replace=true" : "";
      const resp = await call("POST", `/v1/templates/${enc(name.trim())}/build${q}`, undefined, tar({ Dockerfile: dockerfile }), "application/x-tar");
      for await (const l of lines<TemplateLog>(resp)) {
        const text =
          l.type === "step" ? `Step ${l.n}/${l.of}: ${l.text}` : l.type === "done" ? `Built ${l.template?.name} version ${l.template?.version}` : l.type === "error" ? `error: ${l.error?.message}` : (l.text ?? "");
        setLog((old) => [...old, text].slice(-2000));
        if (l.type === "error") throw new ApiError(0, l.error?.code ?? "build", l.error?.message ?? "the build failed");
        if (l.type === "done") {
          setState("done");
          done();
        }
      }
    } catch (err) {
      setState("failed");
      setError(asApiError(err));
    }
  };
  return (
    <form class="stack" onSubmit={build} id="build-form">
      <h2>Build a template from a Dockerfile</h2>
      <label for="build-name">Template name</label>
      <input id="build-name" value={name} onInput={(e) => setName((e.target as HTMLInputElement).value)} placeholder="my-template" />
      <label for="build-dockerfile">Dockerfile</label>
      <textarea id="build-dockerfile" class="mono" rows={6} value={dockerfile} onInput={(e) => setDockerfile((e.target as HTMLTextAreaElement).value)} />
      <label>
        <input type="checkbox" checked={replace} onChange={(e) => setReplace((e.target as HTMLInputElement).checked)} /> a new version when the name is taken
      </label>
      <div>
        <button type="submit" disabled={state === "building" || !name.trim()}>
          {state === "building" ? "Building…" : "Build"}
        </button>{" "}
        {state === "done" ? (
          <span class="ok" role="status">
            Built.
          </span>
        ) : null}
      </div>
      <ErrorBox error={error} what="Build" />
      {log.length ? (
        <pre class="build-log" aria-live="polite" aria-label="Build log">
          {log.join("\n")}
        </pre>
      ) : null}
    </form>
  );
}

export function TemplatesPage() {
  const t = usePoll(() => get<{ templates: Template[] }>("/v1/templates").then((r) => r.templates), [], 10000);
  const p = usePoll(() => get<{ pools: Pool[] }>("/v1/pools").then((r) => r.pools), [], 3000);
  const h = useFocusHeading("templates");
  return (
    <main>
      <h1 tabIndex={-1} ref={h}>
        Templates and pools
      </h1>
      <Guard l={t} what="templates">
        {(list) => (
          <table>
            <thead>
              <tr>
                <th>Name</th>
                <th>Version</th>
                <th>Source</th>
                <th>Runtime</th>
                <th>Made</th>
              </tr>
            </thead>
            <tbody>
              {list.map((x) => (
                <tr key={`${x.name}@${x.version}`}>
                  <td>{x.name}</td>
                  <td>{x.version}</td>
                  <td class="mono">{String(x["source"] ?? "")}</td>
                  <td>{String(x["runtime"] ?? "node default")}</td>
                  <td>{x["created_at"] ? `${age(String(x["created_at"]))} ago` : ""}</td>
                </tr>
              ))}
            </tbody>
          </table>
        )}
      </Guard>
      <BuildForm done={t.reload} />
      <h2>Warm pools</h2>
      <Guard l={p} what="pools">
        {(list) =>
          !list.length ? (
            <p class="empty">No warm pools: `space pool set TEMPLATE --min N` makes one.</p>
          ) : (
            <table>
              <thead>
                <tr>
                  <th>Template</th>
                  <th>Runtime</th>
                  <th>Ready</th>
                  <th>Starting</th>
                  <th>Min–max</th>
                  <th>Target</th>
                  <th>Hits</th>
                  <th>Misses</th>
                </tr>
              </thead>
              <tbody>
                {list.map((x) => (
                  <tr key={x.template}>
                    <td>{x.template}</td>
                    <td>{x.runtime}</td>
                    <td>{x.ready}</td>
                    <td>{x.starting}</td>
                    <td>
                      {x.min}–{x.max}
                    </td>
                    <td>{x.target}</td>
                    <td>{x.hits}</td>
                    <td>{x.misses}</td>
                  </tr>
                ))}
              </tbody>
            </table>
          )
        }
      </Guard>
    </main>
  );
}

export function NodesPage() {
  const l = usePoll(() => get<{ nodes: NodeRow[] }>("/v1/nodes").then((r) => r.nodes), [], 3000);
  const h = useFocusHeading("nodes");
  return (
    <main>
      <h1 tabIndex={-1} ref={h}>
        Nodes
      </h1>
      <Guard l={l} what="nodes">
        {(list) => (
          <table>
            <thead>
              <tr>
                <th>Node</th>
                <th>State</th>
                <th>Runtimes</th>
                <th>Sandboxes</th>
                <th>CPU allocated</th>
                <th>Memory allocated</th>
                <th>Memory available</th>
                <th>Pool ready</th>
              </tr>
            </thead>
            <tbody>
              {list.map((n) => (
                <tr key={n.id ?? n.name}>
                  <td>
                    {n.name} <span class="muted mono">{n.id ?? ""}</span>
                  </td>
                  <td>
                    <span class={`badge node-${n.state}`}>{n.state}</span>
                  </td>
                  <td>{((n["runtimes"] as string[]) ?? []).join(", ")}</td>
                  <td>{String(n["sandboxes"])}</td>
                  <td>
                    {String(n["allocated_cpu"])} of {String(n["cpus"])}
                  </td>
                  <td>
                    {fmtBytes(Number(n["allocated_memory_mib"]) * 1048576)} of {fmtBytes(Number(n["memory_bytes"]))}
                  </td>
                  <td>{fmtBytes(Number(n["memory_available_bytes"]))}</td>
                  <td>{String(n["pool_ready"])}</td>
                </tr>
              ))}
            </tbody>
          </table>
        )}
      </Guard>
    </main>
  );
}
