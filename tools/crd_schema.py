"""JSON schemas for custom resources, from their CustomResourceDefinitions, for
tools/check_manifests.py (needs PyYAML: run it with target/manifest-venv/bin/python).

    python tools/crd_schema.py CRD.yaml [CRD.yaml ...] --out deploy/kubernetes/schemas [--version v1]

Writes one file per served version, <kind>-<group>-<version>.json (lower case): the version's
openAPIV3Schema with apiVersion and kind pinned, and every object that lists its properties
(and neither allows more nor preserves unknown fields) closed to other fields, as the API
server's strict field validation (kubectl apply's default) rejects unknown fields. The rules a
CRD writes in CEL (x-kubernetes-validations) are kept as annotations only: JSON Schema cannot
run them.
"""

import argparse
import json
import os
import sys

import yaml


def close_objects(node):
    """Adds additionalProperties: false to each object schema that names its properties."""
    if isinstance(node, dict):
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        if node.get("x-kubernetes-int-or-string"):
            node.pop("type", None)
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if node.get("nullable") and "type" in node:
            node["type"] = [node["type"], "null"]
        for value in node.values():
            close_objects(value)
    elif isinstance(node, list):
        for value in node:
            close_objects(value)


def schemas(crd, source, only=None):
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"]
    bundle = {k: v for k, v in crd["metadata"].get("annotations", {}).items() if "bundle-version" in k}
    for version in spec["versions"]:
        if not version.get("served", True) or (only and version["name"] not in only):
            continue
        schema = json.loads(json.dumps(version["schema"]["openAPIV3Schema"]))
        # metadata is the API server's ObjectMeta: name and namespace are checked here; the rest
        # (labels, annotations...) is left open.
        schema.setdefault("properties", {})["metadata"] = {
            "type": "object",
            "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253},
                           "namespace": {"type": "string"}},
            "x-kubernetes-preserve-unknown-fields": True,
        }
        close_objects(schema)
        schema["properties"]["apiVersion"] = {"const": f"{group}/{version['name']}"}
        schema["properties"]["kind"] = {"const": kind}
        schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
        schema["$schema"] = "http://json-schema.org/draft-07/schema#"
        schema["$comment"] = (f"{kind} {group}/{version['name']} from the CRD {crd['metadata']['name']} "
                              f"({source}; {json.dumps(bundle)}), by tools/crd_schema.py")
        yield f"{kind}-{group}-{version['name']}".lower() + ".json", schema


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("crds", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--source", default="", help="where the CRDs came from, kept in each schema")
    ap.add_argument("--version", action="append", help="only this version (repeatable; default every served one)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for path in a.crds:
        with open(path) as f:
            for crd in yaml.safe_load_all(f):
                if not crd or crd.get("kind") != "CustomResourceDefinition":
                    continue
                for name, schema in schemas(crd, a.source or os.path.basename(path), a.version):
                    with open(os.path.join(a.out, name), "w") as out:
                        json.dump(schema, out, indent=1, sort_keys=True)
                        out.write("\n")
                    print(f"{name}: {crd['spec']['names']['kind']}", file=sys.stderr)


if __name__ == "__main__":
    main()
