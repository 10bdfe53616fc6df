"""Validates custom resources that kubernetes-validate has no schema for (it only warns about
them and passes): ServiceMonitor, ServingRuntime, InferenceService, ScaledObject, against
the schemas vendored in deploy/k8s/schema/, deploy/kserve/schema/ and deploy/keda/schema/
(their READMEs say where they come from). Kubernetes types inside them (Container, Volume, ObjectMeta, ...) are checked against
kubernetes-validate's strict definitions of the given Kubernetes version.

  .venv/bin/python deploy/validate_custom_resources.py [-k 1.37] FILE.yaml...

Prints one PASS or FAIL line per resource (every error of a failing one); exits 1 when any
resource fails or has a kind with no vendored schema. Used by tests/deploy.rs.
"""

import argparse
import json
import os
import sys

import importlib_resources
import jsonschema
import referencing
import yaml
from kubernetes_validate import utils as kv

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "k8s/schema/servicemonitor-monitoring-v1.json",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "kserve/schema/servingruntime-serving-v1alpha1.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "kserve/schema/inferenceservice-serving-v1beta1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda/schema/scaledobject-keda-v1alpha1.json",
}


def kubernetes_definitions(version):
    """kubernetes-validate's strict definitions for the newest schema set not after `version`."""
    versions = [v for v in kv.all_versions() if kv.major_minor(v) <= kv.major_minor(version)]
    if not versions:
        sys.exit(f"kubernetes-validate has no schemas for Kubernetes {version}")
    folder = importlib_resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{versions[-1]}-local-strict"
    with importlib_resources.as_file(folder / "_definitions.json") as path, open(path) as f:
        return versions[-1], json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", "--kubernetes-version", default=kv.latest_version())
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    version, definitions = kubernetes_definitions(args.kubernetes_version)
    registry = referencing.Resource.from_contents(definitions) @ referencing.Registry()
    failed = False
    for file in args.files:
        with open(file) as f:
            documents = [d for d in yaml.safe_load_all(f) if d]
        for doc in documents:
            what = f"{file} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            schema_file = SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
            if schema_file is None:
                print(f"FAIL {what}: no vendored schema for {doc.get('apiVersion')} {doc.get('kind')}")
                failed = True
                continue
            with open(os.path.join(HERE, schema_file)) as f:
                schema = json.load(f)
            validator = jsonschema.Draft202012Validator(schema, registry=registry)
            errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
            if errors:
                failed = True
                print(f"FAIL {what} against {schema_file} (Kubernetes {version} definitions):")
                for e in errors:
                    print(f"  {'.'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}")
            else:
                print(f"PASS {what} against {schema_file} (Kubernetes {version} definitions)")
    return 1 if failed else 0


sys.exit(main())
