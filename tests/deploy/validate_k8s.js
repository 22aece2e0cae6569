// Validates Kubernetes objects (a JSON array on stdin) against the Kubernetes API schemas
// of kubernetes-models and the Prometheus-operator CRD schemas, offline. Prints one line per
// object; exits 1 when any object is invalid or of a kind with no schema here.
"use strict";
const path = require("path");
const modules = path.join(__dirname, "..", "..", ".tools", "node_modules");

function modelFor(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  const pkg = group.endsWith("monitoring.coreos.com")
    ? "@kubernetes-models/prometheus-operator"
    : "kubernetes-models";
  const rel = group === "" ? version : `${group}/${version}`;
  const mod = require(path.join(modules, pkg, rel, kind));
  return mod[kind];
}

const objects = JSON.parse(require("fs").readFileSync(0, "utf8"));
let bad = 0;
for (const o of objects) {
  const name = `${o.kind}/${o.metadata && o.metadata.name}`;
  let Model;
  try {
    Model = modelFor(o.apiVersion, o.kind);
  } catch (e) {
    console.log(`NO SCHEMA ${o.apiVersion} ${name}`);
    bad++;
    continue;
  }
  try {
    new Model(o).validate();
    console.log(`valid ${o.apiVersion} ${name}`);
  } catch (e) {
    console.log(`INVALID ${o.apiVersion} ${name}: ${e.message}`);
    bad++;
  }
}
process.exit(bad ? 1 : 0);
