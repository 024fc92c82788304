"""Validates the Kubernetes manifests under deploy/kubernetes/ (run by scripts/check-manifests.sh
with target/manifest-venv/bin/python: needs kubernetes-validate, which brings jsonschema and
PyYAML).

    python tools/check_manifests.py [--dir deploy/kubernetes] [--kubernetes-version 1.37.0] [--self-test]

Every document of every *.yaml file is checked:
- built-in kinds (Deployment, Service, ConfigMap, RBAC...) by kubernetes-validate against the
  Kubernetes API's schemas, strictly (an unknown field is an error, as in kubectl apply);
- custom resources (InferencePool, HTTPRoute, Gateway) against the JSON schemas vendored in
  deploy/kubernetes/schemas/ (tools/crd_schema.py makes them from the published CRDs);
- a ConfigMap value that is itself a configuration with an apiVersion and kind of a vendored
  schema (the endpoint picker's EndpointPickerConfig) against that schema;
then what no schema sees: the InferencePool selects the Deployment's pods on a port they
expose, its endpointPickerRef names a Service on that port, the HTTPRoute sends to the pool,
the picker mounts its ConfigMap and reads its file, every pluginRef names a declared plugin,
and the picker's metrics extractor names vLLM's three load metrics.

--self-test also breaks copies of the manifests in known ways and requires each to fail.
Exit status: 0 valid, 1 invalid (each error printed), 2 a schema or validator missing.
"""

import argparse
import copy
import glob
import json
import os
import sys

import jsonschema
import kubernetes_validate
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOAD_METRICS = {"queuedRequestsSpec": "vllm:num_requests_waiting",
                "runningRequestsSpec": "vllm:num_requests_running",
                "kvUsageSpec": "vllm:kv_cache_usage_perc"}


def load_schemas(folder):
    """{(apiVersion, kind): schema} of the vendored schemas."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            schema = json.load(f)
        props = schema.get("properties", {})
        key = (props.get("apiVersion", {}).get("const"), props.get("kind", {}).get("const"))
        if None in key:
            sys.exit(f"{path}: not a schema with apiVersion and kind pinned")
        out[key] = schema
    return out


def schema_errors(doc, schema):
    v = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message[:300]}"
            for e in sorted(v.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


def validate_doc(doc, schemas, version):
    """(validator, [errors]) of one document."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in schemas:
        return f"vendored schema {key[1]} {key[0]}", schema_errors(doc, schemas[key])
    try:
        kubernetes_validate.validate(doc, version, strict=True)
        return f"kubernetes-validate {version} --strict", []
    except kubernetes_validate.SchemaNotFoundError:
        return "none", [f"no schema for {key[1]} {key[0]}: neither Kubernetes {version} nor deploy/kubernetes/schemas has it"]
    except kubernetes_validate.ValidationError as e:
        return f"kubernetes-validate {version} --strict", [str(e).split("\n\n")[0][:400]]
    except kubernetes_validate.InvalidSchemaError as e:
        return "kubernetes-validate", [f"invalid schema: {e}"]


def embedded_configs(doc, schemas):
    """[(key, parsed value)] of a ConfigMap's values that are configurations with a vendored schema."""
    out = []
    if doc.get("kind") != "ConfigMap":
        return out
    for key, text in (doc.get("data") or {}).items():
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            continue
        if isinstance(value, dict) and (value.get("apiVersion"), value.get("kind")) in schemas:
            out.append((key, value))
    return out


def cross_checks(docs):
    """What the schemas do not see: the objects' references to each other."""
    errors = []
    by = {}
    for _, d in docs:
        by.setdefault(d.get("kind"), {})[d["metadata"]["name"]] = d
    pools = by.get("InferencePool", {})
    deployments = by.get("Deployment", {})
    services = by.get("Service", {})
    configmaps = by.get("ConfigMap", {})
    for name, pool in pools.items():
        sel = pool["spec"]["selector"]["matchLabels"]
        ports = {p["number"] for p in pool["spec"]["targetPorts"]}
        members = [d for d in deployments.values()
                   if sel.items() <= d["spec"]["template"]["metadata"].get("labels", {}).items()]
        if not members:
            errors.append(f"InferencePool {name}: its selector {sel} matches no Deployment's pods")
        for d in members:
            exposed = {p["containerPort"] for c in d["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
            if not ports <= exposed:
                errors.append(f"InferencePool {name}: targetPorts {sorted(ports)} not all exposed by Deployment "
                              f"{d['metadata']['name']} ({sorted(exposed)})")
        ref = pool["spec"].get("endpointPickerRef")
        if ref:
            svc = services.get(ref["name"])
            if svc is None:
                errors.append(f"InferencePool {name}: endpointPickerRef names Service {ref['name']}, which is not here")
            elif ref["port"]["number"] not in {p["port"] for p in svc["spec"]["ports"]}:
                errors.append(f"InferencePool {name}: Service {ref['name']} has no port {ref['port']['number']}")
    for name, route in by.get("HTTPRoute", {}).items():
        for rule in route["spec"].get("rules", []):
            for b in rule.get("backendRefs", []):
                if b.get("kind") == "InferencePool" and b["name"] not in pools:
                    errors.append(f"HTTPRoute {name}: backendRef InferencePool {b['name']} is not here")
        for p in route["spec"].get("parentRefs", []):
            if p.get("kind", "Gateway") == "Gateway" and p["name"] not in by.get("Gateway", {}):
                errors.append(f"HTTPRoute {name}: parentRef Gateway {p['name']} is not here")
    for dname, d in deployments.items():
        spec = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            cm = v.get("configMap", {}).get("name")
            if cm and cm not in configmaps:
                errors.append(f"Deployment {dname}: volume {v['name']} names ConfigMap {cm}, which is not here")
        for c in spec["containers"]:
            for arg in c.get("args", []):
                if arg.startswith("--config-file="):
                    path = arg.split("=", 1)[1]
                    mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
                    cms = [volumes.get(m["name"], {}).get("configMap", {}).get("name") for m in mounts]
                    keys = {k for cm in cms if cm in configmaps for k in configmaps[cm].get("data", {})}
                    if os.path.basename(path) not in keys:
                        errors.append(f"Deployment {dname}: --config-file {path} is in no mounted ConfigMap")
    return errors


def picker_checks(config):
    """An EndpointPickerConfig's references, and the load metrics it reads."""
    errors = []
    names = {p.get("name") or p["type"] for p in config.get("plugins", [])}
    refs = [r["pluginRef"] for prof in config.get("schedulingProfiles", []) for r in prof.get("plugins", [])]
    for src in (config.get("dataLayer") or {}).get("sources", []):
        refs.append(src["pluginRef"])
        refs += [e["pluginRef"] for e in src.get("extractors", [])]
    refs += [p["pluginRef"] for p in (config.get("requestHandler") or {}).get("parsers", [])]
    errors += [f"pluginRef {r} names no plugin" for r in refs if r not in names]
    extractors = [p for p in config.get("plugins", []) if p["type"] == "core-metrics-extractor"]
    if not extractors:
        errors.append("no core-metrics-extractor: the picker would read no load metrics")
    for p in extractors:
        params = p.get("parameters", {})
        engine = params.get("defaultEngine", "vllm")
        cfgs = {c["name"]: c for c in params.get("engineConfigs", [])}
        if engine not in cfgs:
            errors.append(f"core-metrics-extractor: defaultEngine {engine} has no engineConfigs entry naming its metrics")
            continue
        for field, metric in LOAD_METRICS.items():
            if cfgs[engine].get(field) != metric:
                errors.append(f"core-metrics-extractor: {field} is {cfgs[engine].get(field)!r}, not {metric}")
    return errors


def check(folder, version, quiet=False):
    """Number of errors in the manifests of `folder` (each printed unless quiet)."""
    schemas = load_schemas(os.path.join(folder, "schemas"))
    files = sorted(glob.glob(os.path.join(folder, "*.yaml")))
    if not files:
        print(f"no manifests in {folder}")
        return 1
    docs, errors = [], 0

    def report(where, validator, errs):
        nonlocal errors
        errors += len(errs)
        if quiet:
            return
        print(f"{'ok  ' if not errs else 'FAIL'} {where}  ({validator})")
        for e in errs:
            print(f"       {e}")

    for path in files:
        rel = os.path.relpath(path, ROOT)
        try:
            with open(path) as f:
                loaded = [d for d in yaml.safe_load_all(f) if d is not None]
        except yaml.YAMLError as e:
            report(rel, "YAML", [str(e)])
            continue
        for doc in loaded:
            where = f"{rel}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
            validator, errs = validate_doc(doc, schemas, version)
            report(where, validator, errs)
            if not errs:
                docs.append((rel, doc))
            for key, value in embedded_configs(doc, schemas):
                _, errs = validate_doc(value, schemas, version)
                if value.get("kind") == "EndpointPickerConfig" and not errs:
                    errs = picker_checks(value)
                report(f"{where} [{key}]: {value['kind']}", f"vendored schema {value['kind']} {value['apiVersion']}", errs)
    errs = cross_checks(docs)
    report("references between the objects", "cross-checks", errs)
    return errors


# Breakages the check must catch: (what, file, function that breaks the loaded documents).
def _set(path, value):
    def f(docs):
        kind, name = path[0], path[1]
        d = next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)
        node = d
        for k in path[2:-1]:
            node = node[k]
        node[path[-1]] = value
    return f


def _epp_config(mutate):
    def f(docs):
        cm = next(d for d in docs if d["kind"] == "ConfigMap")
        cfg = yaml.safe_load(cm["data"]["epp-config.yaml"])
        mutate(cfg)
        cm["data"]["epp-config.yaml"] = yaml.safe_dump(cfg)
    return f


BREAKAGES = [
    ("an unknown field in the Deployment's container", "unmask.yaml",
     _set(["Deployment", "unmask", "spec", "template", "spec", "containers", 0, "gpus"], 1)),
    ("a probe port of the wrong type", "unmask.yaml",
     _set(["Deployment", "unmask", "spec", "template", "spec", "containers", 0, "readinessProbe", "httpGet", "port"], [8000])),
    ("an InferencePool port as a string", "inferencepool.yaml",
     _set(["InferencePool", "unmask", "spec", "targetPorts"], [{"number": "8000"}])),
    ("an InferencePool without a selector", "inferencepool.yaml",
     _set(["InferencePool", "unmask", "spec", "selector"], None)),
    ("an InferencePool failureMode it does not know", "inferencepool.yaml",
     _set(["InferencePool", "unmask", "spec", "endpointPickerRef", "failureMode"], "Retry")),
    ("an InferencePool selecting no pods", "inferencepool.yaml",
     _set(["InferencePool", "unmask", "spec", "selector", "matchLabels"], {"app": "vllm"})),
    ("an HTTPRoute field it does not have", "gateway.yaml",
     _set(["HTTPRoute", "unmask", "spec", "backend"], "unmask")),
    ("an HTTPRoute sending to a pool that is not there", "gateway.yaml",
     _set(["HTTPRoute", "unmask", "spec", "rules", 0, "backendRefs", 0, "name"], "other")),
    ("a picker config with an unknown top-level field", "epp.yaml",
     _epp_config(lambda c: c.update(scorers=[]))),
    ("a picker profile naming a plugin that is not declared", "epp.yaml",
     _epp_config(lambda c: c["schedulingProfiles"][0]["plugins"].append({"pluginRef": "lora-affinity-scorer"}))),
    ("a picker reading the wrong queue metric", "epp.yaml",
     _epp_config(lambda c: c["plugins"][1]["parameters"]["engineConfigs"][0].update(queuedRequestsSpec="unmask_queue_depth"))),
]


def self_test(folder, version):
    import shutil
    import tempfile
    failures = 0
    for what, file, breaks in BREAKAGES:
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(folder, tmp, dirs_exist_ok=True)
            path = os.path.join(tmp, file)
            with open(path) as f:
                docs = [d for d in yaml.safe_load_all(f) if d is not None]
            breaks(docs)
            with open(path, "w") as f:
                yaml.safe_dump_all(docs, f)
            n = check(tmp, version, quiet=True)
        print(f"{'ok  ' if n else 'FAIL'} rejected: {what}" + ("" if n else " (it passed)"))
        failures += 0 if n else 1
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join(ROOT, "deploy/kubernetes"))
    ap.add_argument("--kubernetes-version", default=kubernetes_validate.latest_version())
    ap.add_argument("--self-test", action="store_true", help="also require known breakages to fail")
    a = ap.parse_args()
    errors = check(a.dir, a.kubernetes_version)
    print(f"check-manifests: {errors} error(s)")
    if a.self_test:
        missed = self_test(a.dir, a.kubernetes_version)
        print(f"check-manifests self-test: {len(BREAKAGES) - missed} passed, {missed} failed")
        errors += missed
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
