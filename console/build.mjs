// Builds the console into dist/ (decision 0058): one bundle, one stylesheet, index.html.
// Fails when the bundle is over the page budget of 200 KB gzipped.
import { build } from "esbuild";
import { copyFileSync, mkdirSync, readFileSync, rmSync, readdirSync } from "node:fs";
import { gzipSync } from "node:zlib";

const BUDGET = 200 * 1024;
rmSync("dist", { recursive: true, force: true });
mkdirSync("dist");
await build({
  entryPoints: { app: "src/main.tsx" },
  bundle: true,
  minify: true,
  format: "esm",
  target: "es2022",
  outdir: "dist",
  jsx: "automatic",
  jsxImportSource: "preact",
  legalComments: "none",
  logLevel: "warning",
});
copyFileSync("src/index.html", "dist/index.html");
let failed = false;
for (const f of readdirSync("dist").sort()) {
  const raw = readFileSync(`dist/${f}`);
  const gz = gzipSync(raw, { level: 9 }).length;
  console.log(`console: dist/${f}  ${raw.length} bytes, ${gz} gzipped`);
  if (f.endsWith(".js") && gz > BUDGET) {
    console.error(`console: dist/${f} is ${gz} bytes gzipped, over the ${BUDGET} budget`);
    failed = true;
  }
}
if (failed) process.exit(1);
