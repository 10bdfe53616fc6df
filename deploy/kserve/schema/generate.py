"""Writes servingruntime-serving-v1alpha1.json and inferenceservice-serving-v1beta1.json:
JSON Schemas for KServe's ServingRuntime and InferenceService, which kubernetes-validate does
not know.

Source: the model classes of KServe's Python SDK, the PyPI wheel kserve==0.21.0
(kserve/models/*.py). OpenAPI Generator wrote them from KServe's OpenAPI document, which
openapi-gen derives from the same Go types (pkg/apis/serving/...) that controller-gen turns
into the CRDs' openAPIV3Schema; each class lists its fields with their JSON names and types
(`openapi_types`, `attribute_map`) and says which may not be empty. This script reads those
classes with `ast` (nothing is imported or run) and writes, for every KServe type reachable
from the two kinds:
  - its fields, and no others (additionalProperties: false), as the API server's strict field
    validation (`kubectl apply --validate=strict`) treats the CRDs' structural schemas;
  - field types: string, integer, boolean, number, lists, maps, nested KServe types;
  - required fields (a setter that refuses None);
  - Kubernetes types (V1Container, V1Volume, V1ResourceRequirements, V1ObjectMeta, ...) as
    references into kubernetes-validate's strict definitions, resolved when validating.
What the CRDs have beyond this is not checked: value constraints (enums, minimums, patterns)
that kubebuilder markers add, and the types of Knative and KEDA fields (accepted as anything;
they occur only in status and in KEDA triggers), and of the two KServe types the wheel names but
lacks (V1alpha1WorkerSpec: the multi-node `workerSpec`; V1beta1MetricQuantity: in the
autoscaling metrics). Run from the repository root:

  pip download --no-deps kserve==0.21.0 -d /tmp/kserve
  python3 deploy/kserve/schema/generate.py /tmp/kserve/kserve-0.21.0-py3-none-any.whl
"""

import ast
import json
import os
import re
import sys
import zipfile

SOURCE = "the model classes of the PyPI wheel kserve==0.21.0 (KServe's Python SDK)"
K8S = "https://kubernetes.io/api/_definitions.json#/$defs/"
# Kubernetes types the SDK names in its own way; other V1<Name> are io.k8s.api.core.v1.<Name>.
K8S_NAMES = {
    "V1ObjectMeta": "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
    "V1ListMeta": "io.k8s.apimachinery.pkg.apis.meta.v1.ListMeta",
    "V1Time": "io.k8s.apimachinery.pkg.apis.meta.v1.Time",
    "ResourceQuantity": "io.k8s.apimachinery.pkg.api.resource.Quantity",
    "K8sIoApiAppsV1DeploymentStrategy": "io.k8s.api.apps.v1.DeploymentStrategy",
    "K8sIoApiAutoscalingV2HorizontalPodAutoscalerBehavior": "io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior",
}
SCALARS = {"str": "string", "int": "integer", "bool": "boolean", "float": "number", "datetime": "string"}
KINDS = {
    "servingruntime-serving-v1alpha1.json": ("V1alpha1ServingRuntime", "serving.kserve.io/v1alpha1", "ServingRuntime"),
    "inferenceservice-serving-v1beta1.json": ("V1beta1InferenceService", "serving.kserve.io/v1beta1", "InferenceService"),
}


def read_classes(wheel):
    """{class name: (fields {json name: type}, required json names)} of kserve/models/*.py."""
    classes = {}
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            if not re.fullmatch(r"kserve/models/[a-z0-9_]+\.py", member):
                continue
            tree = ast.parse(zf.read(member))
            for node in tree.body:
                if not isinstance(node, ast.ClassDef):
                    continue
                values = {}
                for item in node.body:
                    if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
                        if item.targets[0].id in ("openapi_types", "attribute_map"):
                            values[item.targets[0].id] = ast.literal_eval(item.value)
                if "openapi_types" not in values:
                    continue
                source = ast.get_source_segment(zf.read(member).decode(), node)
                required = re.findall(r"Invalid value for `(\w+)`, must not be `None`", source)
                names = values["attribute_map"]
                classes[node.name] = (
                    {names[k]: t for k, t in values["openapi_types"].items()},
                    sorted(names[k] for k in set(required)),
                )
    return classes


def type_schema(t, classes, wanted):
    if t in SCALARS:
        return {"type": SCALARS[t]}
    if t == "object":
        return {}
    if t.startswith("list[") and t.endswith("]"):
        return {"type": "array", "items": type_schema(t[5:-1], classes, wanted)}
    if t.startswith("dict(str, ") and t.endswith(")"):
        return {"type": "object", "additionalProperties": type_schema(t[10:-1], classes, wanted)}
    if re.match(r"V1(alpha|beta)\d", t):
        if t not in classes:
            # Named by a field but missing from the wheel (two in 0.21.0, see above).
            print(f"generate.py: {t} is not in the SDK; its fields are not checked", file=sys.stderr)
            return {"description": f"{t}: not in the SDK, not checked"}
        wanted.append(t)
        return {"$ref": f"#/$defs/{t}"}
    if t in K8S_NAMES:
        return {"$ref": K8S + K8S_NAMES[t]}
    if re.fullmatch(r"V1[A-Z]\w+", t):
        return {"$ref": K8S + "io.k8s.api.core.v1." + t[2:]}
    if t.startswith(("Knative", "GithubCom", "NetUrl")):
        return {"description": f"{t}: not checked"}
    sys.exit(f"generate.py: no mapping for the SDK type {t}")


def schema_for(root, api_version, kind, classes):
    defs, wanted = {}, [root]
    while wanted:
        name = wanted.pop()
        if name in defs:
            continue
        fields, required = classes[name]
        defs[name] = {
            "type": "object",
            "additionalProperties": False,
            "properties": {k: type_schema(t, classes, wanted) for k, t in sorted(fields.items())},
        }
        if required:
            defs[name]["required"] = required
    top = defs.pop(root)
    top["properties"]["apiVersion"] = {"const": api_version}
    top["properties"]["kind"] = {"const": kind}
    top["required"] = sorted(set(top.get("required", [])) | {"apiVersion", "kind", "metadata"})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://inferd.invalid/schema/{kind.lower()}.json",
        "description": f"{kind} {api_version}, from {SOURCE}; a subset of the CRD's schema, see README.md",
        **top,
        "$defs": dict(sorted(defs.items())),
    }


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    classes = read_classes(sys.argv[1])
    here = os.path.dirname(os.path.abspath(__file__))
    for file, (root, api_version, kind) in KINDS.items():
        schema = schema_for(root, api_version, kind, classes)
        with open(os.path.join(here, file), "w") as f:
            json.dump(schema, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {file}: {kind}, {len(schema['$defs'])} KServe types")


main()
