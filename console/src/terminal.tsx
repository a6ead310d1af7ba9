// A live terminal on a sandbox process: xterm.js on a WebSocket
// (`/v1/sandboxes/{id}/processes/{pid}/terminal`, decision 0058). Output frames carry their
// byte offset, so after a network drop the terminal reconnects from the end of what it
// showed: nothing twice, nothing lost.
import { Terminal } from "@xterm/xterm";
import { FitAddon } from "@xterm/addon-fit";
import { useEffect, useRef, useState } from "preact/hooks";
import { enc, getKey } from "./api";

/** `gone`: spaced does not know the process (the sandbox was rolled back or restarted). */
export type TermState = "connecting" | "live" | "reconnecting" | "exited" | "failed" | "gone";

interface Props {
  sandbox: string;
  pid: number;
  /** Keys typed go to the process (false: watch only). */
  input?: boolean;
  onState?: (s: TermState, detail: string) => void;
}

const MAX_RETRIES = 30;

export function TerminalView({ sandbox, pid, input = true, onState }: Props) {
  const box = useRef<HTMLDivElement>(null);
  const [state, setState] = useState<TermState>("connecting");
  const [detail, setDetail] = useState("");

  useEffect(() => {
    const term = new Terminal({
      cursorBlink: true,
      convertEol: false,
      fontFamily: "ui-monospace, Menlo, Consolas, monospace",
      fontSize: 14,
      scrollback: 5000,
      disableStdin: !input,
    });
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(box.current!);
    fit.fit();
    (window as unknown as { __term?: Terminal }).__term = term;
    let ws: WebSocket | null = null;
    let shown = 0; // bytes of output shown: the offset to reconnect from
    let closed = false;
    let retries = 0;
    let timer: ReturnType<typeof setTimeout> | undefined;
    const say = (s: TermState, d: string) => {
      setState(s);
      setDetail(d);
      onState?.(s, d);
    };
    const send = (data: string | Uint8Array) => {
      if (ws?.readyState === WebSocket.OPEN) ws.send(data);
    };
    const resize = () => send(JSON.stringify({ resize: { rows: term.rows, cols: term.cols } }));
    const connect = () => {
      const proto = location.protocol === "https:" ? "wss" : "ws";
      const url = `${proto}://${location.host}/v1/sandboxes/${enc(sandbox)}/processes/${pid}/terminal?offset=${shown}`;
      ws = new WebSocket(url, ["space.v1", `space-key.${getKey() ?? ""}`]);
      ws.binaryType = "arraybuffer";
      ws.onopen = () => {
        retries = 0;
        say("live", "");
        resize();
      };
      ws.onmessage = (m) => {
        if (typeof m.data === "string") {
          const j = JSON.parse(m.data);
          if (j.exit) {
            closed = true;
            say("exited", j.exit.signal ? `killed by signal ${j.exit.signal}` : `exit code ${j.exit.code ?? 0}`);
          } else if (j.gap) {
            term.write(`\r\n[${j.gap.to - j.gap.from} bytes of output were dropped]\r\n`);
            shown = j.gap.to;
          } else if (j.error) {
            closed = true;
            say("failed", j.error.message);
          }
          return;
        }
        const buf = new Uint8Array(m.data as ArrayBuffer);
        const view = new DataView(buf.buffer, buf.byteOffset, 8);
        const offset = Number(view.getBigUint64(0));
        let data = buf.subarray(8);
        if (offset < shown) data = data.subarray(Math.min(data.length, shown - offset));
        shown = Math.max(shown, offset + buf.length - 8);
        term.write(data);
      };
      ws.onclose = (ev) => {
        if (closed) return;
        if (ev.code === 4404) {
          closed = true;
          say("gone", ev.reason || "no such process");
          return;
        }
        if (ev.code === 4401 || ev.code === 4403) {
          closed = true;
          say("failed", ev.reason || "refused");
          return;
        }
        if (retries >= MAX_RETRIES) {
          say("failed", "the connection to spaced was lost");
          return;
        }
        retries++;
        const wait = Math.min(200 * 2 ** retries, 5000);
        say("reconnecting", `connection lost; retrying in ${(wait / 1000).toFixed(1)} s (from byte ${shown})`);
        timer = setTimeout(connect, wait);
      };
    };
    const keys = term.onData((d) => send(new TextEncoder().encode(d)));
    const bin = term.onBinary((d) => send(Uint8Array.from(d, (c) => c.charCodeAt(0))));
    const sized = term.onResize(() => resize());
    const ro = new ResizeObserver(() => fit.fit());
    ro.observe(box.current!);
    connect();
    if (input) term.focus();
    return () => {
      closed = true;
      clearTimeout(timer);
      ro.disconnect();
      keys.dispose();
      bin.dispose();
      sized.dispose();
      ws?.close();
      term.dispose();
    };
  }, [sandbox, pid, input]);

  return (
    <div class="terminal-wrap">
      <div class={`term-status term-${state}`} role="status" aria-live="polite" data-state={state}>
        {state}
        {detail ? `: ${detail}` : ""}
      </div>
      <div class="terminal" ref={box} data-pid={pid} />
    </div>
  );
}
