"""Writes servicemonitor-monitoring-v1.json: a JSON Schema for the Prometheus Operator's
ServiceMonitor (monitoring.coreos.com/v1), which kubernetes-validate does not know.

Source: the PyPI package cloudcoil.models.prometheus_operator==0.80.1.0, Pydantic models that
cloudcoil-model-codegen generated from prometheus-operator v0.80.1's CRD manifests (their
openAPIV3Schema: field names, types, enums, patterns, required fields). Pydantic writes them
out as JSON Schema; this script then
  - forbids properties the CRD does not define (additionalProperties: false), as the API
    server's strict field validation (`kubectl apply --validate=strict`) does;
  - drops titles and defaults, and turns "X or null" into X (no manifest here sets a null);
  - takes ObjectMeta from kubernetes-validate's definitions instead of the package's copy.
Run it in a throwaway venv (not the project's .venv), from the repository root:

  python3 -m venv /tmp/gen && /tmp/gen/bin/pip install cloudcoil.models.prometheus_operator==0.80.1.0
  /tmp/gen/bin/python deploy/k8s/schema/generate.py
"""

import json
import os

from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

SOURCE = "cloudcoil.models.prometheus_operator==0.80.1.0 (generated from prometheus-operator v0.80.1's CRDs)"
K8S = "https://kubernetes.io/api/_definitions.json#/$defs/"


def tidy(node):
    if isinstance(node, list):
        return [tidy(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: tidy(v) for k, v in node.items() if k not in ("title", "default")}
    options = node.get("anyOf")
    if options and {"type": "null"} in options:
        rest = [o for o in options if o != {"type": "null"}]
        del node["anyOf"]
        if len(rest) == 1:
            node.update(rest[0])
        else:
            node["anyOf"] = rest
    if "properties" in node and "additionalProperties" not in node:
        node["additionalProperties"] = False
    return node


def reachable(schema):
    """Only the $defs that the schema refers to, directly or through other $defs."""
    defs, seen = schema["$defs"], set()
    todo = [{k: v for k, v in schema.items() if k != "$defs"}]
    while todo:
        text = json.dumps(todo.pop())
        for name in defs:
            if f'"#/$defs/{name}"' in text and name not in seen:
                seen.add(name)
                todo.append(defs[name])
    schema["$defs"] = {k: v for k, v in sorted(defs.items()) if k in seen}
    return schema


schema = ServiceMonitor.model_json_schema(by_alias=True)
schema["properties"]["metadata"] = {"$ref": K8S + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
schema = reachable(tidy(schema))
schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
out = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://inferd.invalid/schema/servicemonitor-monitoring-v1.json",
    "description": f"ServiceMonitor monitoring.coreos.com/v1, from {SOURCE}; see README.md",
    **schema,
}
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "servicemonitor-monitoring-v1.json")
with open(path, "w") as f:
    json.dump(out, f, indent=1, sort_keys=True)
    f.write("\n")
print(f"wrote {path}: {len(out['$defs'])} definitions")
