import { useState } from "preact/hooks";
import { ApiError, get, setKey } from "../api";
import { ErrorBox, asApiError, useFocusHeading } from "../ui";

/** Sign in with an API key: checked with one call before it is kept for the session. */
export function SignIn({ reason, onDone }: { reason?: string; onDone: () => void }) {
  const [key, setValue] = useState("");
  const [error, setError] = useState<ApiError | undefined>(undefined);
  const [busy, setBusy] = useState(false);
  const h = useFocusHeading("signin");
  const submit = async (e: Event) => {
    e.preventDefault();
    const k = key.trim();
    if (!k) {
      setError(new ApiError(0, "client", "Paste an API key (sk_…): `space key create`, or the admin key spaced printed."));
      return;
    }
    setBusy(true);
    setError(undefined);
    setKey(k);
    try {
      await get("/v1/sandboxes");
      onDone();
    } catch (err) {
      setKey(null);
      setError(asApiError(err));
    } finally {
      setBusy(false);
    }
  };
  return (
    <main class="signin">
      <form onSubmit={submit} aria-labelledby="signin-h">
        <h1 id="signin-h" tabIndex={-1} ref={h}>
          space console
        </h1>
        {reason ? <p class="notice">{reason}</p> : null}
        <label for="key">API key</label>
        <input id="key" name="key" type="password" autoComplete="off" value={key} onInput={(e) => setValue((e.target as HTMLInputElement).value)} placeholder="sk_…" />
        <p class="muted">Kept in this tab only, and sent with every call as a header.</p>
        <button type="submit" disabled={busy}>
          {busy ? "Checking…" : "Sign in"}
        </button>
        <ErrorBox error={error} what="Sign-in" />
      </form>
    </main>
  );
}
