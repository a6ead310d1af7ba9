import { useState } from "preact/hooks";
import { type Sandbox, type Snapshot, enc, get, json } from "../api";
import { ErrorBox, Guard, Loading, age, fmtBytes, useAction, usePoll } from "../ui";

interface Change {
  path: string;
  change: string;
  type: string;
  text_diff?: string;
}

interface ForkOf {
  sandbox: string;
  snapshot: string;
}

/** A node of the drawn tree: a snapshot, or a sandbox forked from one (a leaf). */
interface Node {
  snap?: Snapshot;
  fork?: string;
  children: Node[];
}

const key = (n: Node) => (n.snap ? `0${n.snap.created_at}` : `1${n.fork}`);

/** The snapshots as a tree by parent, a rollback starting a new branch from the snapshot it
 * went back to, and each fork a leaf under the snapshot it came from. */
function tree(list: Snapshot[], forks: ForkOf[]): Node[] {
  const by = new Map<string, Node>();
  for (const s of list) by.set(s.id, { snap: s, children: [] });
  const roots: Node[] = [];
  for (const n of by.values()) {
    const p = n.snap!.parent_id ? by.get(n.snap!.parent_id) : undefined;
    if (p) p.children.push(n);
    else roots.push(n);
  }
  for (const f of forks) by.get(f.snapshot)?.children.push({ fork: f.sandbox, children: [] });
  return roots;
}

const ROW = 34,
  COL = 26;

/** Lays the tree out as rows (one per node, oldest first by walk) with a depth each. */
function layout(roots: Node[]): Array<{ n: Node; depth: number; parentRow: number }> {
  const out: Array<{ n: Node; depth: number; parentRow: number }> = [];
  const walk = (n: Node, depth: number, parentRow: number) => {
    const row = out.length;
    out.push({ n, depth, parentRow });
    n.children.sort((a, b) => key(a).localeCompare(key(b))).forEach((c) => walk(c, depth + 1, row));
  };
  roots.sort((a, b) => key(a).localeCompare(key(b))).forEach((r) => walk(r, 0, -1));
  return out;
}

export function SnapshotsTab({ id, go }: { id: string; go: (p: string) => void }) {
  const l = usePoll(() => get<{ snapshots: Snapshot[]; head?: string; forks?: ForkOf[] }>(`/v1/sandboxes/${enc(id)}/snapshots`), [id], 5000);
  const [label, setLabel] = useState("");
  const [selected, setSelected] = useState<string | undefined>(undefined);
  const [diff, setDiff] = useState<{ snap: string; changes: Change[] } | undefined>(undefined);
  const [run, busy, error] = useAction();
  const [done, setDone] = useState("");

  const take = (e: Event) => {
    e.preventDefault();
    run(async () => {
      const s = await json<Snapshot>("POST", `/v1/sandboxes/${enc(id)}/snapshots`, label.trim() ? { label: label.trim() } : {});
      setLabel("");
      setDone(`Snapshot ${s.id} taken.`);
      l.reload();
    });
  };
  const rollback = (snap: string) =>
    run(async () => {
      if (!confirm(`Roll sandbox ${id} back to snapshot ${snap}? Its processes restart and changes since are lost.`)) return;
      await json("POST", `/v1/sandboxes/${enc(id)}/rollback`, { snapshot: snap });
      setDone(`Rolled back to ${snap}.`);
      l.reload();
    });
  const fork = (snap: string) =>
    run(async () => {
      const r = await json<Sandbox | { sandboxes: Sandbox[] }>("POST", `/v1/sandboxes/${enc(id)}/fork`, { snapshot: snap });
      const made = "sandboxes" in r ? r.sandboxes[0] : r;
      go(`/sandboxes/${made.id}`);
    });
  const showDiff = (snap: string) =>
    run(async () => {
      const r = await get<{ changes: Change[] }>(`/v1/sandboxes/${enc(id)}/diff?from=${enc(snap)}`);
      setDiff({ snap, changes: r.changes });
    });
  /** Arrow keys move between the tree's rows; Enter on a snapshot shows its diff. */
  const treeKey = (e: KeyboardEvent, snap: string | undefined) => {
    const row = e.currentTarget as HTMLElement;
    if (e.target !== row) return; // a button inside the row keeps its keys
    const rows = Array.from(row.parentElement?.querySelectorAll<HTMLElement>("[role=treeitem]") ?? []);
    const at = rows.indexOf(row);
    const next = e.key === "ArrowDown" ? rows[at + 1] : e.key === "ArrowUp" ? rows[at - 1] : e.key === "Home" ? rows[0] : e.key === "End" ? rows[rows.length - 1] : undefined;
    if (next) {
      e.preventDefault();
      row.tabIndex = -1;
      next.tabIndex = 0;
      next.focus();
      if (next.dataset.snapshot) setSelected(next.dataset.snapshot);
    } else if (e.key === "Enter") {
      e.preventDefault();
      if (snap) showDiff(snap);
      else row.querySelector<HTMLAnchorElement>("a")?.click();
    }
  };

  return (
    <div>
      <form class="toolbar" onSubmit={take}>
        <label for="snap-label">Label</label>
        <input id="snap-label" value={label} onInput={(e) => setLabel((e.target as HTMLInputElement).value)} placeholder="optional" />
        <button type="submit" disabled={busy} id="take-snapshot">
          Take snapshot
        </button>
        {done ? (
          <span class="ok" role="status">
            {done}
          </span>
        ) : null}
      </form>
      <ErrorBox error={error} what="Snapshot" />
      {busy ? <Loading what="…" /> : null}
      <Guard l={l} what="snapshots">
        {({ snapshots: list, head, forks }) => {
          if (!list.length) return <p class="empty">No snapshots yet.</p>;
          const rows = layout(tree(list, forks ?? []));
          const width = 20 + COL * (1 + Math.max(...rows.map((r) => r.depth)));
          return (
            <div class="snaptree">
              <svg width={width} height={rows.length * ROW} aria-hidden="true" class="tree-lines">
                {rows.map((r, i) =>
                  r.parentRow >= 0 ? (
                    <path d={`M${10 + (r.depth - 1) * COL},${r.parentRow * ROW + ROW / 2} V${i * ROW + ROW / 2} H${10 + r.depth * COL}`} fill="none" stroke="currentColor" />
                  ) : null,
                )}
                {rows.map((r, i) => (
                  r.n.fork ? (
                    <rect x={10 + r.depth * COL - 5} y={i * ROW + ROW / 2 - 5} width={10} height={10} class="fork" />
                  ) : (
                    <circle cx={10 + r.depth * COL} cy={i * ROW + ROW / 2} r={r.n.snap!.id === head ? 7 : 5} class={r.n.snap!.id === head ? "head" : ""} />
                  )
                ))}
              </svg>
              <ul class="tree-rows" role="tree" aria-label="Snapshot tree">
                {rows.map((r) => {
                  if (r.n.fork)
                    return (
                      <li role="treeitem" aria-level={r.depth + 1} key={`fork-${r.n.fork}`} data-fork={r.n.fork} tabIndex={-1} onKeyDown={(e) => treeKey(e, undefined)}>
                        <span class="badge">fork</span> <a href={`#/sandboxes/${r.n.fork}/snapshots`}>sandbox {r.n.fork}</a>
                      </li>
                    );
                  const s = r.n.snap!;
                  return (
                    <li
                      role="treeitem"
                      aria-level={r.depth + 1}
                      aria-selected={selected === s.id}
                      key={s.id}
                      data-snapshot={s.id}
                      tabIndex={selected === s.id || (!selected && s.id === head) ? 0 : -1}
                      onClick={() => setSelected(s.id)}
                      onKeyDown={(e) => treeKey(e, s.id)}
                    >
                      <span class="mono">{s.id}</span> {s.label ? <strong>{s.label}</strong> : null} <span class="muted">{age(s.created_at)} ago</span>{" "}
                      {s.size_bytes !== undefined ? <span class="muted">{fmtBytes(s.size_bytes)}</span> : null} {s.id === head ? (
                        <span class="badge head" title="the sandbox's files descend from this snapshot">
                          head
                        </span>
                      ) : null}
                      <span class="row-actions">
                        <button disabled={busy} onClick={() => rollback(s.id)}>
                          Roll back
                        </button>
                        <button disabled={busy} onClick={() => fork(s.id)}>
                          Fork
                        </button>
                        <button disabled={busy} onClick={() => showDiff(s.id)}>
                          Diff
                        </button>
                      </span>
                    </li>
                  );
                })}
              </ul>
            </div>
          );
        }}
      </Guard>
      {diff ? (
        <div class="diff">
          <h2>Changed since {diff.snap}</h2>
          {!diff.changes.length ? <p class="empty">Nothing changed.</p> : null}
          <ul>
            {diff.changes.map((c) => {
              const kind = c.change;
              return (
                <li class={`chg-${kind}`} key={c.path} data-path={c.path}>
                  <span class="badge">{kind}</span> <span class="mono">{c.path}</span> <span class="muted">{c.type}</span>
                  {c.text_diff ? (
                    <details>
                      <summary>text changes</summary>
                      <pre class="textdiff" aria-label={`Text changes of ${c.path}`}>
                        {c.text_diff.split("\n").map((line) => (
                          <div class={line.startsWith("+") && !line.startsWith("+++") ? "add" : line.startsWith("-") && !line.startsWith("---") ? "del" : ""}>{line}</div>
                        ))}
                      </pre>
                    </details>
                  ) : null}
                </li>
              );
            })}
          </ul>
        </div>
      ) : null}
    </div>
  );
}
