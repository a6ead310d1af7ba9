// Shared pieces: data hooks with loading and error states, the error and loading boxes,
// sparklines and charts drawn as SVG (no chart library), and formatting.
import type { ComponentChildren } from "preact";
import { useCallback, useEffect, useRef, useState } from "preact/hooks";
import { ApiError } from "./api";

export interface Loaded<T> {
  data: T | undefined;
  error: ApiError | undefined;
  loading: boolean;
  reload: () => void;
}

/** Calls `load` now, whenever `deps` change, and every `everyMs` when given. The last good
 * data stays shown while a later call fails; the error is shown beside it. */
export function usePoll<T>(load: () => Promise<T>, deps: unknown[], everyMs?: number): Loaded<T> {
  const [data, setData] = useState<T | undefined>(undefined);
  const [error, setError] = useState<ApiError | undefined>(undefined);
  const [loading, setLoading] = useState(true);
  const [tick, setTick] = useState(0);
  const reload = useCallback(() => setTick((t) => t + 1), []);
  useEffect(() => {
    let live = true;
    setLoading(true);
    load()
      .then((d) => {
        if (!live) return;
        setData(d);
        setError(undefined);
      })
      .catch((e) => live && setError(asApiError(e)))
      .finally(() => live && setLoading(false));
    return () => {
      live = false;
    };
  }, [...deps, tick]);
  useEffect(() => {
    if (!everyMs) return;
    const t = setInterval(() => {
      if (document.visibilityState === "visible") reload();
    }, everyMs);
    return () => clearInterval(t);
  }, [everyMs, ...deps]);
  return { data, error, loading, reload };
}

export function asApiError(e: unknown): ApiError {
  return e instanceof ApiError ? e : new ApiError(0, "client", String((e as Error)?.message ?? e));
}

/** Runs one action (a button's), keeping its error and whether it runs. */
export function useAction(): [(f: () => Promise<unknown>) => Promise<void>, boolean, ApiError | undefined, () => void] {
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<ApiError | undefined>(undefined);
  const run = useCallback(async (f: () => Promise<unknown>) => {
    setBusy(true);
    setError(undefined);
    try {
      await f();
    } catch (e) {
      setError(asApiError(e));
    } finally {
      setBusy(false);
    }
  }, []);
  return [run, busy, error, () => setError(undefined)];
}

export function ErrorBox({ error, what }: { error: ApiError | undefined; what?: string }) {
  if (!error) return null;
  return (
    <div class="error" role="alert">
      <strong>{what ?? "Failed"}:</strong> {error.message}
      {error.status ? <span class="muted"> (HTTP {error.status})</span> : null}
    </div>
  );
}

export function Loading({ what }: { what: string }) {
  return (
    <div class="loading" role="status" aria-live="polite">
      Loading {what}…
    </div>
  );
}

/** Loading, error (the API's message) or the content: never a blank area. */
export function Guard<T>({ l, what, children }: { l: Loaded<T>; what: string; children: (d: T) => ComponentChildren }) {
  if (l.data === undefined) {
    if (l.error) return <ErrorBox error={l.error} what={`Loading ${what}`} />;
    return <Loading what={what} />;
  }
  return (
    <>
      <ErrorBox error={l.error} what={`Refreshing ${what}`} />
      {children(l.data)}
    </>
  );
}

export function Spark({ points, max, label }: { points: number[]; max?: number; label: string }) {
  const w = 80,
    h = 20;
  if (points.length < 2) return <svg class="spark" width={w} height={h} role="img" aria-label={`${label}: no data yet`} />;
  const top = Math.max(max ?? 0, ...points, 1e-9);
  const step = w / (points.length - 1);
  const d = points.map((p, i) => `${i ? "L" : "M"}${(i * step).toFixed(1)},${(h - 1 - (p / top) * (h - 2)).toFixed(1)}`).join("");
  return (
    <svg class="spark" width={w} height={h} viewBox={`0 0 ${w} ${h}`} role="img" aria-label={`${label}: ${points[points.length - 1].toFixed(1)}`}>
      <path d={d} fill="none" stroke="currentColor" stroke-width="1.5" />
    </svg>
  );
}

export function Chart({ title, points, unit, max }: { title: string; points: Array<[number, number]>; unit: string; max?: number }) {
  const w = 560,
    h = 140,
    pad = 30;
  const ys = points.map((p) => p[1]);
  const top = Math.max(max ?? 0, ...ys, 1e-9);
  const t0 = points.length ? points[0][0] : 0;
  const t1 = points.length ? points[points.length - 1][0] : 1;
  const x = (t: number) => pad + ((t - t0) / Math.max(t1 - t0, 1)) * (w - pad - 4);
  const y = (v: number) => h - 16 - (v / top) * (h - 26);
  const d = points.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join("");
  return (
    <figure class="chart">
      <figcaption>
        {title}
        {ys.length ? `: ${fmtNum(ys[ys.length - 1])} ${unit}` : ": no samples yet"}
      </figcaption>
      <svg viewBox={`0 0 ${w} ${h}`} role="img" aria-label={title}>
        <line x1={pad} y1={h - 16} x2={w} y2={h - 16} class="axis" />
        <text x={2} y={14} class="tick">
          {fmtNum(top)}
        </text>
        <text x={2} y={h - 18} class="tick">
          0
        </text>
        <path d={d} fill="none" stroke="currentColor" stroke-width="1.5" />
      </svg>
    </figure>
  );
}

export function fmtNum(n: number): string {
  if (n >= 100) return n.toFixed(0);
  if (n >= 10) return n.toFixed(1);
  return n.toFixed(2);
}

export function fmtBytes(n: number | undefined): string {
  if (n === undefined || n === null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return `${i ? v.toFixed(1) : v} ${units[i]}`;
}

export function age(iso: string, now = Date.now()): string {
  const s = Math.max(0, Math.round((now - Date.parse(iso)) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

export function StateBadge({ state }: { state: string }) {
  return <span class={`badge state-${state}`}>{state}</span>;
}

/** Focus moves to the page's heading when the page changes (keyboard and screen readers). */
export function useFocusHeading(dep: unknown) {
  const ref = useRef<HTMLHeadingElement>(null);
  useEffect(() => ref.current?.focus(), [dep]);
  return ref;
}
