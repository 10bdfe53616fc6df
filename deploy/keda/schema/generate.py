"""Writes scaledobject-keda-v1alpha1.json: a JSON Schema for KEDA's ScaledObject
(keda.sh/v1alpha1), which kubernetes-validate does not know, from KEDA's own CRD manifest
(its openAPIV3Schema), made strict as the API server's field validation is:
  - properties the CRD does not define are refused (additionalProperties: false), except
    where the CRD keeps unknown fields (x-kubernetes-preserve-unknown-fields);
  - metadata is kubernetes-validate's ObjectMeta; apiVersion, kind and metadata are required.

  .venv/bin/python deploy/keda/schema/generate.py PATH/TO/keda/config/crd/bases/keda.sh_scaledobjects.yaml

The committed file comes from kedacore/keda at commit 8b4f083ca (v2.20.1 and 117 commits);
see README.md.
"""

import json
import os
import sys

import yaml

K8S = "https://kubernetes.io/api/_definitions.json#/$defs/"


def strict(node):
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: strict(v) for k, v in node.items() if k != "description"}
    keeps_unknown = node.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in node and "additionalProperties" not in node and not keeps_unknown:
        node["additionalProperties"] = False
    # JSON Schema has no "int-or-string": the API server takes either.
    if node.pop("x-kubernetes-int-or-string", False):
        node.pop("anyOf", None)
        node["type"] = ["integer", "string"]
    return {k: v for k, v in node.items() if not k.startswith("x-kubernetes-")}


with open(sys.argv[1]) as f:
    crd = yaml.safe_load(f)
version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
schema = strict(version["schema"]["openAPIV3Schema"])
schema["properties"]["metadata"] = {"$ref": K8S + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
schema["properties"]["apiVersion"] = {"const": "keda.sh/v1alpha1"}
schema["properties"]["kind"] = {"const": "ScaledObject"}
schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
out = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://inferd.invalid/schema/scaledobject-keda-v1alpha1.json",
    "description": "ScaledObject keda.sh/v1alpha1, from KEDA's CRD (kedacore/keda 8b4f083ca); see README.md",
    **schema,
}
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scaledobject-keda-v1alpha1.json")
with open(path, "w") as f:
    json.dump(out, f, indent=1, sort_keys=True)
    f.write("\n")
print(f"wrote {path}")
