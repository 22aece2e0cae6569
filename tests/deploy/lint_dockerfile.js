// Lints the Dockerfile with dockerfile-utils (the Docker language service's validator),
// with every rule raised to an error. Prints one line per problem; exits 1 on any.
"use strict";
const path = require("path");
const fs = require("fs");
const utils = require(path.join(__dirname, "..", "..", ".tools", "node_modules", "dockerfile-utils"));

const file = process.argv[2];
const content = fs.readFileSync(file, "utf8");
const E = utils.ValidationSeverity.ERROR;
const settings = {
  deprecatedMaintainer: E, directiveCasing: E, emptyContinuationLine: E, instructionCasing: E,
  instructionCmdMultiple: E, instructionEntrypointMultiple: E, instructionHealthcheckMultiple: E,
  instructionJSONInSingleQuotes: E, instructionWorkdirRelative: E,
};
const problems = utils.validate(content, settings);
for (const p of problems) {
  console.log(`${file}:${p.range.start.line + 1}:${p.range.start.character + 1}: ${p.message}`);
}
console.log(`${problems.length} problem(s) in ${file}`);
process.exit(problems.length ? 1 : 0);
