// The space console (issue 17, decision 0058): hash routes, a sign-in gate, a banner when
// spaced stops answering, and a light and a dark theme.
import "@xterm/xterm/css/xterm.css";
import "./style.css";
import { render } from "preact";
import { useEffect, useState } from "preact/hooks";
import { getKey, onReachability, onUnauthorized, setKey } from "./api";
import { NodesPage, TemplatesPage } from "./pages/cluster";
import { SandboxPage } from "./pages/sandbox";
import { SandboxesPage } from "./pages/sandboxes";
import { SignIn } from "./pages/signin";

function route(): string[] {
  return location.hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
}

function go(path: string) {
  location.hash = `#${path}`;
}

function theme(): string {
  return localStorage.getItem("space.theme") ?? (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light");
}

function App() {
  const [parts, setParts] = useState(route());
  const [signedIn, setSignedIn] = useState(getKey() !== null);
  const [reason, setReason] = useState<string | undefined>(undefined);
  const [down, setDown] = useState(false);
  const [mode, setMode] = useState(theme());
  useEffect(() => {
    const f = () => setParts(route());
    addEventListener("hashchange", f);
    onUnauthorized((e) => {
      setKey(null);
      setReason(`Signed out: ${e.message}`);
      setSignedIn(false);
    });
    onReachability((up) => setDown(!up));
    return () => removeEventListener("hashchange", f);
  }, []);
  useEffect(() => {
    document.documentElement.dataset.theme = mode;
  }, [mode]);
  if (!signedIn)
    return (
      <SignIn
        reason={reason}
        onDone={() => {
          setReason(undefined);
          setSignedIn(true);
        }}
      />
    );
  const [page, id, tab] = parts;
  let body;
  if (!page || page === "sandboxes") body = id ? <SandboxPage id={id} tab={tab} go={go} /> : <SandboxesPage go={go} />;
  else if (page === "templates") body = <TemplatesPage />;
  else if (page === "nodes") body = <NodesPage />;
  else
    body = (
      <main>
        <h1>Not found</h1>
        <p class="error" role="alert">
          There is no page {location.hash}. <a href="#/sandboxes">Go to the sandboxes</a>
        </p>
      </main>
    );
  const nav = (p: string, label: string) => (
    <a href={`#/${p}`} class={(page ?? "sandboxes") === p ? "active" : ""} aria-current={(page ?? "sandboxes") === p ? "page" : undefined}>
      {label}
    </a>
  );
  return (
    <>
      <a class="skip" href="#content" onClick={(e) => (e.preventDefault(), document.querySelector<HTMLElement>("main h1")?.focus())}>
        Skip to content
      </a>
      <header class="top">
        <span class="brand">space</span>
        <nav aria-label="Pages">
          {nav("sandboxes", "Sandboxes")}
          {nav("templates", "Templates")}
          {nav("nodes", "Nodes")}
        </nav>
        <span class="grow" />
        <button
          class="link"
          id="theme-toggle"
          onClick={() => {
            const next = mode === "dark" ? "light" : "dark";
            localStorage.setItem("space.theme", next);
            setMode(next);
          }}
        >
          {mode === "dark" ? "Light" : "Dark"} theme
        </button>
        <button
          class="link"
          onClick={() => {
            setKey(null);
            setReason("Signed out.");
            setSignedIn(false);
          }}
        >
          Sign out
        </button>
      </header>
      {down ? (
        <div class="banner" role="alert" id="unreachable">
          spaced is not answering. The page keeps trying; what it shows may be out of date.
        </div>
      ) : null}
      <div id="content">{body}</div>
    </>
  );
}

document.documentElement.dataset.theme = theme();
render(<App />, document.getElementById("app")!);
