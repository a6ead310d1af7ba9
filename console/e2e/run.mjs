// End-to-end tests of the console in Debian's chromium (issue 17, decision 0058), against a
// real spaced. Run by tests/tests/it/console.rs, which starts spaced:
//   SPACE_URL=http://... SPACE_KEY=sk_... SHOTS=docs/console node e2e/run.mjs
// Prints one JSON line of figures last. Every wait is bounded; a failed step throws and the
// process exits 1 with the step's name, after a screenshot of the page as it was.
import puppeteer from "puppeteer-core";
import { mkdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const URL = process.env.SPACE_URL;
const KEY = process.env.SPACE_KEY;
const SHOTS = process.env.SHOTS ?? "shots";
const TEMPLATE = process.env.SPACE_TEMPLATE ?? "base";
const LOADS = Number(process.env.TTI_LOADS ?? 20);
const KEYS = Number(process.env.ECHO_KEYS ?? 200);
const BROWSER = process.env.CHROMIUM ?? "/usr/bin/chromium";
if (!URL || !KEY) throw new Error("SPACE_URL and SPACE_KEY are needed");
mkdirSync(SHOTS, { recursive: true });
rmSync(join(SHOTS, "failed.png"), { force: true });

const api = async (method, path, body, key = KEY) => {
  const r = await fetch(`${URL}${path}`, {
    method,
    headers: { Authorization: `Bearer ${key}`, ...(body ? { "Content-Type": "application/json" } : {}) },
    body: body ? JSON.stringify(body) : undefined,
    signal: AbortSignal.timeout(120_000),
  });
  const text = await r.text();
  if (!r.ok) throw new Error(`${method} ${path}: ${r.status} ${text}`);
  return (r.headers.get("content-type") ?? "").includes("application/json") ? JSON.parse(text) : text;
};

const pct = (xs, p) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
};

let step = "launch";
const browser = await puppeteer.launch({
  executablePath: BROWSER,
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", `--user-data-dir=${join(tmpdir(), `space-e2e-${process.pid}`)}`],
  protocolTimeout: 120_000,
});
const page = await browser.newPage();
page.setDefaultTimeout(60_000);
await page.setViewport({ width: 1280, height: 800 });
const problems = [];
page.on("pageerror", (e) => problems.push(`page error: ${e.message}`));
page.on("console", (m) => {
  if (m.type() === "error" && !/Failed to load resource|WebSocket connection/.test(m.text())) problems.push(`console error: ${m.text()}`);
});
// A request to any origin but spaced's is a failure: the page loads nothing else.
const origins = new Set();
page.on("request", (r) => origins.add(new globalThis.URL(r.url()).origin));
page.on("dialog", (d) => d.accept());

// Replaces an input's value as a user would (the inputs are controlled by the page).
const fill = async (sel, value) => {
  await page.focus(sel);
  await page.keyboard.down("Control");
  await page.keyboard.press("KeyA");
  await page.keyboard.up("Control");
  await page.keyboard.press("Backspace");
  await page.type(sel, value);
};
const shot = (name) => page.screenshot({ path: join(SHOTS, `${name}.png`) });
const text = () => page.evaluate(() => document.body.innerText);
const termText = () =>
  page.evaluate(() => {
    const t = window.__term;
    if (!t) return "";
    const b = t.buffer.active;
    const out = [];
    for (let i = 0; i < b.length; i++) out.push(b.getLine(i)?.translateToString(true) ?? "");
    return out.join("\n");
  });
const waitFor = async (what, f, ms = 60_000) => {
  const end = Date.now() + ms;
  for (;;) {
    if (await f()) return;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
};
const figures = {};
let forkId;

try {
  step = "sign in: a wrong key is refused with the API's message";
  await page.goto(`${URL}/ui/`, { waitUntil: "domcontentloaded" });
  await page.waitForSelector("#key");
  await shot("signin");
  await page.type("#key", "sk_not_a_real_key");
  await page.click("button[type=submit]");
  await page.waitForSelector(".error");
  if (!(await text()).includes("missing or invalid API key")) throw new Error("the refusal does not show the API's message");

  step = "sign in with the admin key";
  await fill("#key", KEY);
  await page.click("button[type=submit]");
  await page.waitForSelector("#create-sandbox");

  step = "create a sandbox";
  await fill("#new-template", TEMPLATE);
  await page.click("#create-sandbox");
  await page.waitForFunction(() => /^#\/sandboxes\/[^/]+/.test(location.hash), { timeout: 120_000 });
  const id = await page.evaluate(() => location.hash.split("/")[2]);
  figures.sandbox = id;

  step = "type echo hi in the terminal and see hi";
  await page.waitForSelector(".term-status[data-state=live]", { timeout: 60_000 });
  await page.click(".terminal");
  await waitFor("a shell prompt", async () => /[#$] ?$/m.test(await termText()));
  await page.keyboard.type("echo hi\n");
  await waitFor("hi echoed", async () => /^hi$/m.test(await termText()));
  await shot("sandbox-terminal");

  step = "terminal keystroke to echo round trip";
  const rtts = await page.evaluate(async (n) => {
    const t = window.__term;
    const out = [];
    for (let i = 0; i < n; i++) {
      const ch = String.fromCharCode(97 + (i % 26));
      const t0 = performance.now();
      await new Promise((resolve) => {
        const d = t.onWriteParsed(() => {
          d.dispose();
          resolve();
        });
        t.input(ch);
      });
      out.push(performance.now() - t0);
    }
    t.input("\u0015"); // ^U: the typed line goes
    return out;
  }, KEYS);
  figures.echo_ms = { n: rtts.length, p50: pct(rtts, 50), p90: pct(rtts, 90), p99: pct(rtts, 99) };

  step = "upload a file and see it listed";
  await page.goto(`${URL}/ui/#/sandboxes/${id}/files`);
  await page.waitForSelector("table.files");
  const local = join(tmpdir(), `space-e2e-upload-${process.pid}.txt`);
  writeFileSync(local, "uploaded from the browser\n");
  const input = await page.$("#upload");
  await input.uploadFile(local);
  const fname = local.split("/").pop();
  await page.waitForSelector(`tr[data-name="${fname}"]`);
  await page.click(`tr[data-name="${fname}"] button.link`);
  await waitFor("the preview", async () => (await text()).includes("uploaded from the browser"));
  await shot("files");

  step = "snapshot, break, roll back from the tree, see the file again";
  await page.goto(`${URL}/ui/#/sandboxes/${id}/snapshots`);
  await page.waitForSelector("#take-snapshot");
  await page.type("#snap-label", "before-break");
  await page.click("#take-snapshot");
  await page.waitForSelector("li[data-snapshot]", { timeout: 120_000 });
  const snap = await page.$eval("li[data-snapshot]", (e) => e.dataset.snapshot);
  await api("DELETE", `/v1/sandboxes/${id}/files?path=${encodeURIComponent(`/root/${fname}`)}`);
  await page.click(`li[data-snapshot="${snap}"] .row-actions button`);
  await waitFor("the rollback", async () => (await text()).includes(`Rolled back to ${snap}`), 120_000);
  // A snapshot after the rollback starts a branch: the tree shows it under the first.
  await fill("#snap-label", "after-rollback");
  await page.click("#take-snapshot");
  await page.waitForFunction(() => document.querySelectorAll("li[data-snapshot]").length >= 2, { timeout: 120_000 });
  await waitFor("the head on the new snapshot", async () => (await page.$$eval("li[data-snapshot] .badge.head", (l) => l.length)) === 1);
  const levels = await page.$$eval("li[data-snapshot]", (l) => l.map((e) => e.getAttribute("aria-level")));
  if (levels.join(",") !== "1,2") throw new Error(`the tree is not drawn as a branch: levels ${levels}`);
  // A fork from the first snapshot opens the fork; the source's tree shows it as a leaf.
  await page.click(`li[data-snapshot="${snap}"] .row-actions button:nth-child(2)`);
  await page.waitForFunction((src) => /^#\/sandboxes\/[^/]+/.test(location.hash) && !location.hash.includes(src), { timeout: 120_000 }, id);
  forkId = await page.evaluate(() => location.hash.split("/")[2]);
  await page.goto(`${URL}/ui/#/sandboxes/${id}/snapshots`);
  await page.waitForSelector(`li[data-fork="${forkId}"]`, { timeout: 20_000 });
  // The tree from the keyboard: arrows move between rows, Enter diffs the focused snapshot.
  await page.focus("li[data-snapshot][tabindex='0']");
  await page.keyboard.press("Home");
  const focused = await page.evaluate(() => document.activeElement?.dataset?.snapshot);
  if (focused !== snap) throw new Error(`Home did not focus the first snapshot (${focused})`);
  await page.keyboard.press("Enter");
  await waitFor("the diff of the focused snapshot", async () => (await text()).includes(`Changed since ${snap}`));
  await shot("snapshots");
  // A diff from the head: a small text file's changes, line by line.
  const head = await page.$eval("li[data-snapshot]:has(.badge.head)", (e) => e.dataset.snapshot);
  const put = await fetch(`${URL}/v1/sandboxes/${id}/files?path=${encodeURIComponent(`/root/${fname}`)}`, {
    method: "PUT",
    headers: { Authorization: `Bearer ${KEY}` },
    body: "uploaded from the browser\nchanged in the sandbox\n",
  });
  if (!put.ok) throw new Error(`write: ${put.status}`);
  await page.click(`li[data-snapshot="${head}"] .row-actions button:nth-child(3)`);
  await page.waitForSelector(`li[data-path="/root/${fname}"] details`, { timeout: 30_000 });
  await page.click(`li[data-path="/root/${fname}"] summary`);
  const diffText = await page.$eval(`li[data-path="/root/${fname}"] pre`, (e) => e.innerText);
  if (!diffText.includes("+changed in the sandbox")) throw new Error(`no text diff: ${diffText}`);
  await shot("diff");
  await page.goto(`${URL}/ui/#/sandboxes/${id}/files`);
  await page.waitForSelector(`tr[data-name="${fname}"]`);

  step = "change the egress policy";
  await page.goto(`${URL}/ui/#/sandboxes/${id}/network`);
  const hasNet = await page.waitForSelector("#network-form, .notice");
  if ((await hasNet.evaluate((e) => e.id)) === "network-form") {
    await page.select("#egress", "allowlist");
    await fill("#allow", "10.9.8.0/24");
    await page.click("#network-form button[type=submit]");
    await page.waitForSelector("#network-form .ok");
    const net = (await api("GET", `/v1/sandboxes/${id}`)).network;
    if (net.egress !== "allowlist" || !net.allow.includes("10.9.8.0/24")) throw new Error(`policy not changed: ${JSON.stringify(net)}`);
    figures.policy = "changed";
  } else figures.policy = "no network on this node";
  await shot("network");

  step = "watch an event arrive live";
  await page.goto(`${URL}/ui/#/sandboxes/${id}/timeline`);
  await page.waitForSelector(".timeline li");
  const before = await page.$$eval(".timeline li[data-action=exec]", (l) => l.length);
  await api("POST", `/v1/sandboxes/${id}/exec`, { cmd: ["true"] });
  await waitFor("the exec event", async () => (await page.$$eval(".timeline li[data-action=exec]", (l) => l.length)) > before, 15_000);
  await shot("timeline");

  step = "the other pages";
  await page.goto(`${URL}/ui/#/sandboxes/${id}/metrics`);
  await page.waitForSelector(".chart");
  await shot("metrics");
  await page.goto(`${URL}/ui/#/sandboxes`);
  await page.waitForSelector("table.sandboxes");
  await new Promise((r) => setTimeout(r, 4500)); // two polls: the sparklines have points
  await shot("sandboxes");
  await page.goto(`${URL}/ui/#/templates`);
  await page.waitForSelector("main table");
  // A Dockerfile build, its log streaming in.
  await fill("#build-name", "console-built");
  await fill("#build-dockerfile", "FROM minimal\nRUN echo built-by-the-console > /built\n");
  await page.click("#build-form button[type=submit]");
  await waitFor("the build's log", async () => (await text()).includes("Built console-built version 1"), 120_000);
  if (!(await text()).includes("Step 2/2")) throw new Error("the build log shows no steps");
  await shot("templates");
  await page.goto(`${URL}/ui/#/nodes`);
  await page.waitForSelector("main table");
  await shot("nodes");
  // The theme switch; the terminal after the rollback has a new shell of its own.
  await page.goto(`${URL}/ui/#/sandboxes/${id}/terminal`);
  await page.waitForSelector(".term-status[data-state=live]");
  await page.click("#theme-toggle");
  await page.waitForFunction(() => document.documentElement.dataset.theme === "dark");
  await shot("dark-terminal");
  await page.click("#theme-toggle");
  await page.waitForFunction(() => document.documentElement.dataset.theme === "light");
  await page.setViewport({ width: 390, height: 844 });
  await page.goto(`${URL}/ui/#/sandboxes`);
  await page.waitForSelector("table.sandboxes");
  await shot("phone-sandboxes");
  await page.setViewport({ width: 1280, height: 800 });

  step = "an unknown sandbox URL";
  await page.goto(`${URL}/ui/#/sandboxes/nosuchsandbox0000000`);
  await page.waitForSelector("#sandbox-gone");
  await shot("unknown-sandbox");

  step = "a sandbox removed while its page is open";
  const other = await api("POST", "/v1/sandboxes", { template: TEMPLATE });
  await page.goto(`${URL}/ui/#/sandboxes/${other.id}/files`);
  await page.waitForSelector("table.files");
  await api("DELETE", `/v1/sandboxes/${other.id}`);
  await page.waitForSelector("#sandbox-gone", { timeout: 20_000 });
  if (!(await text()).includes("removed while this page was open")) throw new Error("the removal is not explained");
  await shot("removed-while-open");

  step = "a lost connection to spaced";
  await page.goto(`${URL}/ui/#/sandboxes`);
  await page.waitForSelector("table.sandboxes");
  await page.setOfflineMode(true);
  await page.waitForSelector("#unreachable", { timeout: 20_000 });
  if (!(await page.$("table.sandboxes"))) throw new Error("the page went blank when spaced went away");
  await shot("connection-lost");
  await page.setOfflineMode(false);
  await page.waitForFunction(() => !document.getElementById("unreachable"), { timeout: 20_000 });

  step = "a revoked key";
  const made = await api("POST", "/v1/keys", { tenant: "default", scope: "tenant", name: "e2e" });
  await page.evaluate((k) => sessionStorage.setItem("space.key", k), made.key);
  await page.goto(`${URL}/ui/#/sandboxes`);
  await page.reload();
  await page.waitForSelector("table.sandboxes");
  await api("DELETE", `/v1/keys/${made.info.id}`);
  await page.waitForSelector("#key", { timeout: 30_000 });
  if (!(await text()).includes("Signed out")) throw new Error("a revoked key does not say why it was signed out");
  await shot("revoked-key");

  step = "first load: time to interactive";
  await page.evaluate((k) => sessionStorage.setItem("space.key", k), KEY);
  const ttis = [];
  for (let i = 0; i < LOADS; i++) {
    // A query that differs each time: a real navigation, not a hash change.
    await page.goto(`${URL}/ui/?load=${i}#/sandboxes`, { waitUntil: "domcontentloaded" });
    await page.waitForSelector("table.sandboxes");
    ttis.push(await page.evaluate(() => performance.now()));
  }
  figures.tti_ms = { n: ttis.length, p50: pct(ttis, 50), p90: pct(ttis, 90), p99: pct(ttis, 99) };

  step = "no other origin";
  const own = new globalThis.URL(URL).origin;
  const foreign = [...origins].filter((o) => o !== own && o !== "null" && !o.startsWith("data:") && !o.startsWith("blob:"));
  if (foreign.length) throw new Error(`the page loaded other origins: ${foreign.join(", ")}`);
  if (problems.length) throw new Error(`the page logged errors:\n${problems.join("\n")}`);
  await api("DELETE", `/v1/sandboxes/${id}`);
  await api("DELETE", `/v1/sandboxes/${forkId}`);
} catch (e) {
  try {
    await shot("failed");
  } catch {}
  console.error(`console e2e failed at "${step}": ${e.message}`);
  if (problems.length) console.error(problems.join("\n"));
  await browser.close();
  process.exit(1);
}
await browser.close();
console.log(JSON.stringify(figures));
