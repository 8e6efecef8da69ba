#!/usr/bin/env python3
"""Validates deploy/kubernetes/*.yaml strictly (unknown fields are errors):
core kinds against the Kubernetes API schemas bundled by kubernetes-validate,
the KEDA ScaledObject against the models generated from KEDA's CRD
(cloudcoil.models.keda), and the rules that tie the manifests to levee.toml
(drain timing, probe paths, the scaling endpoint). Exits 1 on any failure."""

import pathlib
import sys
import tomllib

import kubernetes_validate
import pydantic
import yaml
from cloudcoil.models.keda.v1alpha1 import ScaledObject

KUBERNETES = "1.30.0"
HERE = pathlib.Path(__file__).resolve().parent / "kubernetes"


def validate(doc):
    if doc.get("kind") == "ScaledObject":
        try:
            ScaledObject.model_validate(doc, strict=True, extra="forbid")
            return []
        except pydantic.ValidationError as e:
            return [f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    try:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        return []
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"no schema for {doc.get('apiVersion')}/{doc.get('kind')}: {e}"]


def consistency(docs):
    """The manifests agree with each other and with levee.toml."""
    errors = []
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    config = tomllib.loads(by_kind[("ConfigMap", "levee-config")]["data"]["levee.toml"])
    pod = by_kind[("Deployment", "levee")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    grace = pod["terminationGracePeriodSeconds"]
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = config["server"]["shutdown-grace-secs"]
    if grace < pre_stop + drain:
        errors.append(f"terminationGracePeriodSeconds {grace} < preStop {pre_stop} + shutdown-grace-secs {drain}")
    if container["readinessProbe"]["httpGet"]["path"] != "/ready":
        errors.append("the readiness probe must be /ready (it fails while draining)")
    if container["livenessProbe"]["httpGet"]["path"] != "/health":
        errors.append("the liveness probe must be /health")
    if "nvidia.com/gpu" not in container["resources"]["requests"]:
        errors.append("the Levee container must request a GPU")
    trigger = by_kind[("ScaledObject", "levee")]["spec"]["triggers"][0]
    if not trigger["metadata"]["url"].endswith("/v1/scaling") or trigger["metadata"]["valueLocation"] != "desiredReplicas":
        errors.append("the KEDA trigger must read desiredReplicas from /v1/scaling")
    if config["shared-state"]["backend"] != "redis":
        errors.append("replicas must share state through Redis")
    return errors


def main(paths):
    failed = False
    docs = []
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            docs.append(doc)
            errors = validate(doc)
            name = f"{path.name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            print(("FAIL " if errors else "ok   ") + name)
            for error in errors:
                print("     " + error)
            failed |= bool(errors)
    if {p.name for p in paths} >= {"configmap.yaml", "levee.yaml", "keda-scaledobject.yaml"}:
        errors = consistency(docs)
        print(("FAIL " if errors else "ok   ") + "manifests agree with levee.toml")
        for error in errors:
            print("     " + error)
        failed |= bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    args = [pathlib.Path(a) for a in sys.argv[1:]] or sorted(HERE.glob("*.yaml"))
    sys.exit(main(args))
