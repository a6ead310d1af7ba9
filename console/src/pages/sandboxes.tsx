import { useRef, useState } from "preact/hooks";
import { type Sandbox, enc, get, json } from "../api";
import { ErrorBox, Guard, Spark, StateBadge, age, fmtBytes, useAction, useFocusHeading, usePoll } from "../ui";

interface Sample {
  at: number;
  cpuUsec?: number;
  mem?: number;
}

/** The last samples of every sandbox's counters, kept across polls: CPU is the difference
 * of its CPU time between two polls, in cores. */
function useHistory() {
  const hist = useRef(new Map<string, Sample[]>());
  const add = (list: Sandbox[]) => {
    const now = Date.now();
    for (const s of list) {
      const h = hist.current.get(s.id) ?? [];
      h.push({ at: now, cpuUsec: s.cpu_usage_usec, mem: s.memory_bytes });
      if (h.length > 30) h.shift();
      hist.current.set(s.id, h);
    }
  };
  const cpu = (id: string): number[] => {
    const h = hist.current.get(id) ?? [];
    const out: number[] = [];
    for (let i = 1; i < h.length; i++) {
      const a = h[i - 1],
        b = h[i];
      if (a.cpuUsec === undefined || b.cpuUsec === undefined) continue;
      out.push(Math.max(0, (b.cpuUsec - a.cpuUsec) / 1000 / Math.max(b.at - a.at, 1)));
    }
    return out;
  };
  const mem = (id: string): number[] => (hist.current.get(id) ?? []).map((s) => (s.mem ?? 0) / 1048576);
  return { add, cpu, mem };
}

export function SandboxesPage({ go }: { go: (path: string) => void }) {
  const history = useHistory();
  const l = usePoll(
    async () => {
      const r = await get<{ sandboxes: Sandbox[] }>("/v1/sandboxes");
      history.add(r.sandboxes);
      return r.sandboxes;
    },
    [],
    2000,
  );
  const [filter, setFilter] = useState("");
  const [state, setState] = useState("");
  const [template, setTemplate] = useState("base");
  const [run, busy, error, clear] = useAction();
  const h = useFocusHeading("sandboxes");

  const create = () =>
    run(async () => {
      const s = await json<Sandbox>("POST", "/v1/sandboxes", template.trim() ? { template: template.trim() } : {});
      go(`/sandboxes/${s.id}`);
    });
  const act = (id: string, what: "pause" | "resume" | "remove") =>
    run(async () => {
      if (what === "remove") {
        if (!confirm(`Remove sandbox ${id} and everything in it?`)) return;
        await json("DELETE", `/v1/sandboxes/${enc(id)}`);
      } else await json("POST", `/v1/sandboxes/${enc(id)}/${what}`);
      l.reload();
    });

  return (
    <main>
      <h1 tabIndex={-1} ref={h}>
        Sandboxes
      </h1>
      <div class="toolbar">
        <form
          class="inline"
          onSubmit={(e) => {
            e.preventDefault();
            create();
          }}
        >
          <label for="new-template">Template</label>
          <input id="new-template" value={template} onInput={(e) => setTemplate((e.target as HTMLInputElement).value)} size={12} />
          <button type="submit" disabled={busy} id="create-sandbox">
            {busy ? "Working…" : "Create sandbox"}
          </button>
        </form>
        <span class="grow" />
        <label for="filter" class="sr-only">
          Search
        </label>
        <input id="filter" type="search" placeholder="Search id, template, node…" value={filter} onInput={(e) => setFilter((e.target as HTMLInputElement).value)} />
        <label for="state-filter" class="sr-only">
          State
        </label>
        <select id="state-filter" value={state} onChange={(e) => setState((e.target as HTMLSelectElement).value)}>
          <option value="">every state</option>
          {["creating", "running", "paused", "stopped", "failed", "lost"].map((s) => (
            <option value={s}>{s}</option>
          ))}
        </select>
      </div>
      <ErrorBox error={error} what="Action" />
      {error ? (
        <button class="link" onClick={clear}>
          dismiss
        </button>
      ) : null}
      <Guard l={l} what="sandboxes">
        {(list) => {
          const q = filter.trim().toLowerCase();
          const shown = list.filter(
            (s) => (!state || s.state === state) && (!q || [s.id, s.template, s.runtime, s.node ?? "", s.hostname].some((f) => f.toLowerCase().includes(q))),
          );
          if (!list.length) return <p class="empty">No sandboxes yet. Create one above, or with `space create`.</p>;
          return (
            <div class="table-wrap">
              <table class="sandboxes">
                <thead>
                  <tr>
                    <th>Id</th>
                    <th>State</th>
                    <th>Runtime</th>
                    <th>Template</th>
                    <th>Node</th>
                    <th>CPU</th>
                    <th>Memory</th>
                    <th>Age</th>
                    <th>
                      <span class="sr-only">Actions</span>
                    </th>
                  </tr>
                </thead>
                <tbody>
                  {shown.map((s) => (
                    <tr key={s.id} data-id={s.id}>
                      <td>
                        <a href={`#/sandboxes/${s.id}`}>{s.id}</a>
                      </td>
                      <td>
                        <StateBadge state={s.state} />
                      </td>
                      <td>{s.runtime}</td>
                      <td>{s.template}</td>
                      <td>{s.node ?? "local"}</td>
                      <td>
                        <Spark points={history.cpu(s.id)} max={s.cpu} label="CPU cores" />
                      </td>
                      <td>
                        <Spark points={history.mem(s.id)} max={s.memory_mib} label="MiB" /> <span class="muted">{fmtBytes(s.memory_bytes)}</span>
                      </td>
                      <td>{age(s.created_at)}</td>
                      <td class="actions">
                        {s.state === "running" ? (
                          <button disabled={busy} onClick={() => act(s.id, "pause")}>
                            Pause
                          </button>
                        ) : null}
                        {s.state === "paused" ? (
                          <button disabled={busy} onClick={() => act(s.id, "resume")}>
                            Resume
                          </button>
                        ) : null}
                        <button class="danger" disabled={busy} onClick={() => act(s.id, "remove")}>
                          Remove
                        </button>
                      </td>
                    </tr>
                  ))}
                </tbody>
              </table>
              {!shown.length ? <p class="empty">No sandbox matches.</p> : null}
            </div>
          );
        }}
      </Guard>
    </main>
  );
}
